"""DeepSeek-V4-Flash in the engine: the model (mHC residual streams, CSA/HCA attention with
the lightning indexer, sqrt-softplus MoE, the MTP draft layer), its fused static decode step, its
config dialects, checkpoint names and loading, KV layout and `make-model` writer, and its
`Architecture` entry (architecture.py).

Importing the package loads no torch (engine/config.py parses V4 configs through
`engine.v4.config`); the model modules import torch themselves.
"""

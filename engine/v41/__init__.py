"""DeepSeek-V4.1-Flash in the engine: CSA2 shared compressed KV, two-level index top-k, the QAT
numerics, delayed-pre mHC, Engram and the DSpark drafter.

Importing the package loads no torch (engine/config.py parses V4.1 configs through
`engine.v41.config`); the model modules import torch themselves.
"""

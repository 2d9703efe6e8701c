"""Tokenizers ringserve writes itself (no torch, no engine): the deterministic synthetic BPE of
the random test and demo models (`synthetic_bpe.py`). It sits below engine/, server/ and
train/, so that checkpoint writers in any of them can produce a tokenizer without importing
the server."""

"""Moved to `tokenization/synthetic_bpe.py` (below engine/ and server/). This name stays only
until tests/e2e/test_agent_chat.py and tests/e2e/test_saved_by_transformers.py import the new
one; then delete this file."""
from tokenization.synthetic_bpe import write_tokenizer

__all__ = ["write_tokenizer"]

"""Held-out loss (nats per token) and bits per character, by transformers and by ringserve.

The held-out text is one token stream ([bos] page [eos] per page) cut into windows of L+1
tokens with stride L, so each token after the first is a target exactly once, at a position
below L, as in training. Bits per character divide the total nats by ln 2 and by the number of
characters the targets decode to (special tokens decode to nothing). Both scorers run in fp32
on the same windows; ringserve's runs its own forward (engine/v4/model.py) over a dense state,
exactly as its tests drive it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from engine.v4.attention import SeqSlice, SequenceContext
from engine.v4.model import DeepseekV4

from .score import Score


class Decoder(Protocol):
    """A tokenizers.Tokenizer or the server's Tokenizer: both decode like this."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def token_stream(tok: Tokenizer, texts: Iterable[str], bos: int = 0, eos: int = 1) -> list[int]:
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return ids


def windows(ids: list[int], length: int, limit: int | None = None) -> torch.Tensor:
    """[N, length + 1] windows with stride `length` (the last token of one is the first of the next)."""
    n = (len(ids) - 1) // length
    n = n if limit is None else min(n, limit)
    if n < 1:
        raise ValueError(f"{len(ids)} held-out tokens do not fill one window of {length + 1}")
    t = torch.tensor(ids[: n * length + 1])
    return torch.stack([t[i * length: (i + 1) * length + 1] for i in range(n)])


def target_chars(tok: Decoder, wins: torch.Tensor) -> int:
    targets = torch.cat([w[1:] for w in wins]).tolist()
    return len(tok.decode(targets, skip_special_tokens=True))


@torch.no_grad()
def score_transformers(model, wins: torch.Tensor, tok: Decoder, batch: int = 8) -> Score:
    """transformers' DeepseekV4ForCausalLM (fp32) over the windows."""
    total = 0.0
    for i in range(0, len(wins), batch):
        w = wins[i: i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()  # [b, L, V]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
    return Score(total, wins[:, 1:].numel(), target_chars(tok, wins))


@torch.no_grad()
def ringserve_logits(model: DeepseekV4, ids: torch.Tensor) -> torch.Tensor:
    """One sequence [S] from position 0 through ringserve's forward → fp32 logits [S, V]."""
    ctx = SequenceContext([SeqSlice(model.new_state(), 0, 0, len(ids))])
    return model.logits(model(ids, torch.arange(len(ids)), ctx))


@torch.no_grad()
def score_ringserve(model: DeepseekV4, wins: torch.Tensor, tok: Decoder) -> Score:
    total = 0.0
    for w in wins:
        logits = ringserve_logits(model, w[:-1])  # [L, V]
        total += F.cross_entropy(logits, w[1:], reduction="sum").item()
    return Score(total, wins[:, 1:].numel(), target_chars(tok, wins))

"""Held-out loss of a V4.1 checkpoint by ringserve's engine and by the training model, and the
engine's own prefill logits and DSpark draft (what the recipe's test compares against).

The engine runs exactly as it serves: `engine.weights.load_model` on the exported directory, a
paged V4.1 KV cache, one prefill chunk from position 0 (engine/v41/model.py), its default
numerics (the reference's: exact block GEMMs), logits one row at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.v41.attention import Chunk
from engine.v41.dspark import DSpark
from engine.v41.kv_cache import V41KVCache

from . import v41_model
from .score import Score
from .evaluate import Decoder, target_chars
from .v41 import Model
from .v41_model import effective_weights

_BLOCK = 16


def _sequence(engine_model, length: int):
    # one sequence: its positions' blocks plus the block manager's slack
    cache = V41KVCache.for_model(engine_model, "auto", 1, max(length, 64), num_full_blocks=length // _BLOCK + 16,
                                 block_size=_BLOCK)
    seq = cache.new_sequence()
    cache.allocate(seq, 0, length)
    return seq


@torch.no_grad()
def engine_prefill(engine_model, ids: torch.Tensor):
    """One sequence [S] from position 0 → (fp32 logits [S, V], the sequence, the forward's output)."""
    seq = _sequence(engine_model, len(ids))
    out = engine_model(ids, [Chunk(seq, 0, 0, len(ids))])
    return engine_model.logits(out.x), seq, out


@torch.no_grad()
def engine_draft(engine_model, ids: torch.Tensor, anchor: int) -> tuple[list[int], torch.Tensor]:
    """The engine's DSpark draft after prefilling ids [S]: anchor = the token at position S."""
    _, seq, out = engine_prefill(engine_model, ids)
    dspark = DSpark(engine_model)
    dspark.observe(out.main_hidden, out.chunks)
    draft = dspark.draft(seq, anchor, len(ids) - 1)
    return draft.tokens, draft.confidence


@torch.no_grad()
def score_engine(engine_model, wins: torch.Tensor, tok: Decoder) -> Score:
    total = 0.0
    for w in wins:
        logits, _, _ = engine_prefill(engine_model, w[:-1])
        total += F.cross_entropy(logits, w[1:], reduction="sum").item()
    return Score(total, wins[:, 1:].numel(), target_chars(tok, wins))


@torch.no_grad()
def score_training_model(model: Model, wins: torch.Tensor, tok: Decoder, batch: int = 8) -> Score:
    """The training forward (exact GEMMs) over the same windows."""
    w = effective_weights(model.params)
    total = 0.0
    for i in range(0, len(wins), batch):
        chunk = wins[i: i + batch]
        logits = v41_model.forward(model.cfg, w, model.hasher, chunk[:, :-1], exact=True).logits.cpu()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                 reduction="sum").item()
    return Score(total, wins[:, 1:].numel(), target_chars(tok, wins))

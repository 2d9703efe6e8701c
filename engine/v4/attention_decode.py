"""Attention of a static-shape decode/verify step (see decode_batch.py), over a [B, q] grid.

The maths is engine/v4/attention_ops.py's, as on the per-sequence path; what differs is the
gathering: masks instead of Python loops and data-dependent lengths, so that nothing here reads
a tensor value on the host and the step is CUDA-graph capturable. History lengths are fixed
(window − 1 keys, span − 1 compressor rows, every entry the full table can address for the
indexer and HCA, the top-k picked entries for CSA attention); positions a sequence does not
have yet are masked and their rows zeroed.
"""

from __future__ import annotations

import torch

from ..kv_cache import PoolRef
from .attention_ops import finish_entries, index_scores, pool_span, sink_attention, top_k_entries


def _history_positions(batch, count: int) -> torch.Tensor:
    """The `count` positions before each sequence's first token: [B, count]."""
    return batch.start[:, None] - count + torch.arange(count, device=batch.start.device)


def _read_masked(ref: PoolRef, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows [B, L, width]; invalid ones are zero whatever the slot holds."""
    rows = ref.read(slots)
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def compress(compressor, rows: torch.Tensor, batch, refs: tuple[PoolRef, PoolRef], rope_table,
             dtype: torch.dtype) -> None:
    """Append this step's compressor rows and write the entries they complete.

    rows: [B, q, 2·width] fp32 ([C | Z + ape] per token). A token at position p completes
    entry p // m when (p + 1) % m == 0; its entry pools the `span` rows ending at p. Every
    token's candidate is computed (static shapes); those that complete nothing go to the dummy
    block.
    """
    state_ref, entry_ref = refs
    m, span = compressor.ratio, compressor.span
    q = batch.tokens_per_seq
    pos = batch.positions.view(-1, q)  # [B, q]
    hist_pos = _history_positions(batch, span - 1)
    hist_slots, hist_valid = batch.sliding_slots(hist_pos)
    history = _read_masked(state_ref, hist_slots, hist_valid)  # [B, span−1, 2·width]
    all_rows = torch.cat((history, rows), dim=1)  # [B, span−1+q, 2·width]
    all_pos = torch.cat((hist_pos, pos), dim=1)
    spans = all_rows.unfold(1, span, 1).transpose(-1, -2)  # [B, q, span, 2·width]: rows ending at each token
    missing = all_pos.unfold(1, span, 1) < 0  # [B, q, span]
    pooled = pool_span(spans, missing, compressor.overlap, m, compressor.out_dim)  # [B, q, d]
    entry_of_token = torch.div(pos, m, rounding_mode="floor")  # [B, q]
    candidates = finish_entries(pooled.flatten(0, 1), compressor, entry_of_token.flatten(), rope_table, dtype)
    completes = (pos + 1).remainder(m) == 0
    target = batch.entry_slots(entry_of_token, m)
    entry_ref.write(torch.where(completes, target, torch.zeros_like(target)), candidates)  # others → dummy
    row_slots, _ = batch.sliding_slots(pos)
    state_ref.write(row_slots, rows)


def read_entries(ref: PoolRef, batch, ratio: int, index: torch.Tensor) -> torch.Tensor:
    """Entries index [B, N] (< max_context / ratio) → [B, N, dim]; entries a sequence does not
    have yet (this step's included) read as zero."""
    count = torch.div(batch.start + batch.tokens_per_seq, ratio, rounding_mode="floor")  # [B]
    return _read_masked(ref, batch.entry_slots(index, ratio), index < count[:, None])


def attend(attn, layer: int, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, q_res: torch.Tensor, rope,
           comp_rows, index_rows, rope_table, batch) -> torch.Tensor:
    """Window + compressed-entry attention with a sink for every sequence of the batch.

    q: [T, H, hd]; kv: [T, hd] this step's keys (= values). Returns [T, H, hd] fp32.
    """
    cfg = attn.cfg
    refs = batch.cache.layer_pools(layer)
    nseq, steps = batch.num_seqs, batch.tokens_per_seq
    window = cfg.sliding_window
    pos = batch.positions.view(nseq, steps)
    # Keys: the window − 1 positions before the step (from the pool), then this step's own.
    prev_pos = _history_positions(batch, window - 1)
    prev_slots, prev_valid = batch.sliding_slots(prev_pos)
    prev = _read_masked(refs["window"], prev_slots, prev_valid)  # [B, W−1, hd]
    new_slots, _ = batch.sliding_slots(pos)
    refs["window"].write(new_slots, kv)
    keys = torch.cat((prev.to(kv.dtype), kv.view(nseq, steps, -1)), dim=1).float()  # [B, L, hd]
    key_pos = torch.cat((prev_pos, pos), dim=1)
    key_valid = torch.cat((prev_valid, torch.ones_like(pos, dtype=torch.bool)), dim=1)
    qpos = pos[:, :, None]
    in_window = key_valid[:, None, :] & (key_pos[:, None, :] <= qpos) & (key_pos[:, None, :] > qpos - window)
    sources = [(keys, in_window)]
    if attn.compressor is not None:
        sources.append(_entry_source(attn, x, q_res, rope, comp_rows, index_rows, rope_table, batch, refs))
    qf = q.float().view(nseq, steps, cfg.num_heads, -1)
    return sink_attention(qf, sources, attn.attn_sink, cfg.head_dim**-0.5).flatten(0, 1)


def _entry_source(attn, x, q_res, rope, comp_rows, index_rows, rope_table, batch, refs):
    """(entries, mask) the step's queries attend besides the window: every visible entry (HCA,
    or CSA while it has no more entries than top-k), or each query's top-k (CSA)."""
    m = attn.ratio
    nseq, steps = batch.num_seqs, batch.tokens_per_seq
    pos = batch.positions.view(nseq, steps)
    compress(attn.compressor, comp_rows.view(nseq, steps, -1), batch, (refs["comp_rows"], refs["comp_entries"]),
             rope_table, x.dtype)
    index = torch.arange(batch.max_context // m, device=x.device).expand(nseq, -1)  # [B, E]
    visible = index[:, None, :] < torch.div(pos + 1, m, rounding_mode="floor")[..., None]  # [B, q, E]
    indexer = attn.indexer
    if indexer is not None:
        compress(indexer.compressor, index_rows.view(nseq, steps, -1), batch, (refs["index_rows"], refs["index_keys"]),
                 rope_table, x.dtype)
    if indexer is None or indexer.topk >= index.shape[1]:
        return read_entries(refs["comp_entries"], batch, m, index).float(), visible  # [B, E, hd]
    keys = read_entries(refs["index_keys"], batch, m, index)  # [B, E, dI]
    iq, iw = indexer.queries(q_res, x, *rope)  # [T, Hi, dI], [T, Hi]
    scores = index_scores(iq.view(nseq, steps, indexer.num_heads, -1), iw.view(nseq, steps, -1), keys,
                          indexer.head_dim)  # [B, q, E]
    picked, valid = top_k_entries(scores, visible, indexer.topk)  # [B, q, K]
    entries = read_entries(refs["comp_entries"], batch, m, picked.flatten(1)).float()
    return entries.view(nseq, steps, picked.shape[-1], -1), valid  # [B, q, K, hd]

"""The attention core of a static-shape decode/verify step (see decode_batch.py).

Same maths as `Attention._attend` and `Compressor.step` on the per-sequence path, restated over
a [B, q] grid with masks instead of Python loops and data-dependent lengths, so that nothing
here reads a tensor value on the host: the step is CUDA-graph capturable. History lengths are
fixed (window − 1 keys, span − 1 compressor rows, every entry the full table can address for
the indexer and HCA, the top-k picked entries for CSA attention); positions a sequence does not
have yet are masked and their rows zeroed.
"""

from __future__ import annotations

import torch

from .decode_batch import DecodeBatch
from .kv_cache import PoolRef
from .layers import apply_rope, rms_norm


def _history_positions(batch: DecodeBatch, count: int) -> torch.Tensor:
    """The `count` positions before each sequence's first token: [B, count]."""
    return batch.start[:, None] - count + torch.arange(count, device=batch.start.device)


def _read_masked(ref: PoolRef, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows [B, L, width]; invalid ones are zero whatever the slot holds."""
    rows = ref.read(slots)
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def compress(compressor, rows: torch.Tensor, batch: DecodeBatch, refs: tuple[PoolRef, PoolRef], rope_table,
             dtype: torch.dtype) -> None:
    """Append this step's compressor rows and write the entries they complete.

    rows: [B, q, 2·width] fp32 ([C | Z + ape] per token). A token at position p completes
    entry p // m when (p + 1) % m == 0; its entry pools the `span` rows ending at p (2m when
    overlapping: Ca of the previous window and Cb of this one, m otherwise). Every token's
    candidate is computed (static shapes); those that complete nothing go to the dummy block.
    """
    state_ref, entry_ref = refs
    m, d = compressor.ratio, compressor.out_dim
    q = batch.tokens_per_seq
    pos = batch.positions.view(-1, q)  # [B, q]
    span = (2 if compressor.overlap else 1) * m
    hist_pos = _history_positions(batch, span - 1)
    hist_slots, hist_valid = batch.sliding_slots(hist_pos)
    history = _read_masked(state_ref, hist_slots, hist_valid)  # [B, span−1, 2·width]
    all_rows = torch.cat((history, rows), dim=1)  # [B, span−1+q, 2·width]
    all_pos = torch.cat((hist_pos, pos), dim=1)
    windows = all_rows.unfold(1, span, 1).transpose(-1, -2)  # [B, q, span, 2·width]: rows ending at each token
    missing = (all_pos.unfold(1, span, 1) < 0)[..., None]  # [B, q, span, 1]: before position 0
    width = windows.shape[-1] // 2
    kv = windows[..., :width].masked_fill(missing, 0.0)
    gate = windows[..., width:].masked_fill(missing, float("-inf"))
    if compressor.overlap:  # Ca (first d features) of the previous window ‖ Cb of this one
        kv = torch.cat((kv[..., :m, :d], kv[..., m:, d:]), dim=-2)
        gate = torch.cat((gate[..., :m, :d], gate[..., m:, d:]), dim=-2)
    pooled = (kv * torch.softmax(gate, dim=-2)).sum(dim=-2)  # [B, q, d]
    entry_of_token = torch.div(pos, m, rounding_mode="floor")  # [B, q]
    cos, sin = rope_table((entry_of_token * m).flatten())
    candidates = apply_rope(rms_norm(pooled.flatten(0, 1).to(dtype), compressor.norm, compressor.eps), cos, sin)
    completes = (pos + 1).remainder(m) == 0
    target = batch.entry_slots(entry_of_token, m)
    entry_ref.write(torch.where(completes, target, torch.zeros_like(target)), candidates)  # others → dummy
    row_slots, _ = batch.sliding_slots(pos)
    state_ref.write(row_slots, rows)


def read_entries(ref: PoolRef, batch: DecodeBatch, ratio: int, index: torch.Tensor) -> torch.Tensor:
    """Entries index [B, N] (< max_context / ratio) → [B, N, dim]; entries a sequence does not
    have yet (this step's included) read as zero."""
    count = torch.div(batch.start + batch.tokens_per_seq, ratio, rounding_mode="floor")  # [B]
    return _read_masked(ref, batch.entry_slots(index, ratio), index < count[:, None])


def select_entries(indexer, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keys: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's top-k over the static entry axis.

    keys: [B, E, dI]; visible: [B, q, E]. Returns (picked [B, q, K] entry indices, valid
    [B, q, K]) with K = index_topk < E: each query's top-k visible entries by index score, ties
    to the lower entry index (stable sort), as on the per-sequence path; slots beyond a
    query's visible count are invalid.
    """
    b, q = visible.shape[:2]
    iq, iw = indexer.queries(q_res, x, cos, sin)  # [T, Hi, dI], [T, Hi]
    iq = iq.view(b, q, indexer.num_heads, indexer.head_dim)
    scores = torch.einsum("bqhd,bed->bqhe", iq, keys.float()).relu_() * indexer.head_dim**-0.5
    scores = (scores * iw.view(b, q, -1, 1)).sum(dim=2).masked_fill_(~visible, float("-inf"))  # [B, q, E]
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., : indexer.topk]
    return picked, visible.gather(-1, picked)


def attend(attn, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, comp_rows, index_rows, rope_table, batch: DecodeBatch, layer: int) -> torch.Tensor:
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
    qf = q.float().view(nseq, steps, cfg.num_heads, -1)
    scale = cfg.head_dim**-0.5
    logits = torch.einsum("bqhd,bld->bqhl", qf, keys) * scale
    parts = [logits.masked_fill(~in_window[:, :, None, :], float("-inf"))]
    entries = None
    if attn.compressor is not None:
        m = attn.ratio
        compress(attn.compressor, comp_rows.view(nseq, steps, -1), batch, (refs["comp_rows"], refs["comp_entries"]),
                 rope_table, x.dtype)
        index = torch.arange(batch.max_context // m, device=x.device).expand(nseq, -1)  # [B, E]
        visible = index[:, None, :] < torch.div(pos + 1, m, rounding_mode="floor")[..., None]  # [B, q, E]
        sparse = attn.indexer is not None and attn.indexer.topk < index.shape[1]
        if attn.indexer is not None:
            compress(attn.indexer.compressor, index_rows.view(nseq, steps, -1), batch,
                     (refs["index_rows"], refs["index_keys"]), rope_table, x.dtype)
        if sparse:  # CSA: read only each query's top-k entries
            keys_i = read_entries(refs["index_keys"], batch, m, index)
            picked, visible = select_entries(attn.indexer, q_res, x, cos, sin, keys_i, visible)  # [B, q, K]
            entries = read_entries(refs["comp_entries"], batch, m, picked.flatten(1)).float()
            entries = entries.view(nseq, steps, picked.shape[-1], -1)  # [B, q, K, hd]
            clog = torch.einsum("bqhd,bqkd->bqhk", qf, entries) * scale
        else:  # HCA, or CSA with no more entries than top-k: every visible entry
            entries = read_entries(refs["comp_entries"], batch, m, index).float()  # [B, E, hd]
            clog = torch.einsum("bqhd,bed->bqhe", qf, entries) * scale
        parts.append(clog.masked_fill(~visible[:, :, None, :], float("-inf")))
    parts.append(attn.attn_sink.float().view(1, 1, -1, 1).expand(nseq, steps, -1, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    num_keys = keys.shape[1]
    out = torch.einsum("bqhl,bld->bqhd", probs[..., :num_keys], keys)
    if entries is not None:
        pattern = "bqhk,bqkd->bqhd" if entries.dim() == 4 else "bqhe,bed->bqhd"
        out = out + torch.einsum(pattern, probs[..., num_keys:-1], entries)
    return out.flatten(0, 1)

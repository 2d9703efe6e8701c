"""A static-shape decode step through the fused Triton kernels: the prototype of a decode backend.

Same contract as `DeepseekV4.forward` on a `DecodeBatch` (streams out, pools written in place),
but each layer's mHC mixing is one `mhc_mix` launch (collapse included) and the attention core
(`attention_decode.attend`) becomes: the window write, `compressor_step` per compressor,
`indexer_topk` (CSA), and one `sparse_mla_decode`. The slot tables every layer needs are built
once per step by `StepMeta.build` (they depend only on the batch, the ratio and the span), so a
captured graph holds them as static buffers refreshed from the `DecodeBatch` each replay.

`fused_attention` mirrors `Attention.forward` (projections unchanged) because the engine has
no backend hook yet; wiring these kernels in means replacing the `attention_decode.attend`
call there and the `hc_mix_weights` + `hc_collapse` pair in `Block.forward`. Used by
perf/bench_gpu_ops.py (launch counts) and tests/kernels/test_triton_fused_path.py (parity).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.decode_batch import DecodeBatch
from engine.layers import apply_rope, hc_expand, head_rms_norm, rms_norm
from kernels.triton.compressor_step import compressor_step
from kernels.triton.indexer_topk import indexer_topk
from kernels.triton.mhc_mix import mhc_mix
from kernels.triton.sparse_mla_decode import sparse_mla_decode


@dataclass
class StepMeta:
    """Per-step metadata shared by every layer. B sequences × q tokens; W the window."""

    positions: torch.Tensor                      # [B, q] int32
    window_writes: torch.Tensor                  # [B, q] int64: window slots of this step's tokens
    window_slots: torch.Tensor                   # [B, q, W−1] int32: history positions start−W+1 .. start−1
    full_table: torch.Tensor                     # [B, F] int32
    rows: dict[int, torch.Tensor] = field(default_factory=dict)        # span → [B, span−1+q] state slots
    completes: dict[int, torch.Tensor] = field(default_factory=dict)   # m → [B, q] entry slot or −1
    entry_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # m → [B, q, r/2]
    counts: dict[int, torch.Tensor] = field(default_factory=dict)      # m → [B] entries after the step
    visible: dict[int, torch.Tensor] = field(default_factory=dict)     # m → [B, q, E] dense entry slots

    @classmethod
    def build(cls, batch: DecodeBatch, cfg, rope_table) -> "StepMeta":
        b, q = batch.num_seqs, batch.tokens_per_seq
        pos = batch.positions.view(b, q)
        window = cfg.sliding_window
        hist = batch.start[:, None] - (window - 1) + torch.arange(window - 1, device=pos.device)  # [B, W−1]
        slots, valid = batch.sliding_slots(hist)
        # Every history position precedes the step, so it is in each query's window iff > p − W.
        in_window = valid[:, None, :] & (hist[:, None, :] > pos[..., None] - window)
        writes, _ = batch.sliding_slots(pos)                                  # padding rows: the dummy block
        meta = cls(pos.int(), writes, torch.where(in_window, slots[:, None, :], -1).int(), batch.full_table.int())
        for m in sorted({r for r in cfg.compress_ratios[: cfg.num_layers] if r}):
            kinds = {k for k, r in zip(cfg.layer_kinds, cfg.compress_ratios) if r == m}
            for span in {2 * m if k == "csa" else m for k in kinds}:
                rpos = batch.start[:, None] - (span - 1) + torch.arange(span - 1 + q, device=pos.device)
                rslots, rvalid = batch.sliding_slots(rpos)
                meta.rows[span] = torch.where(rvalid, rslots, -1).int()
            entry = torch.div(pos, m, rounding_mode="floor")
            meta.completes[m] = torch.where((pos + 1) % m == 0, batch.entry_slots(entry, m), -1).int()
            cos, sin = rope_table((entry * m).flatten())
            meta.entry_rope[m] = (cos.view(b, q, -1), sin.view(b, q, -1))
            meta.counts[m] = torch.div(batch.start + q, m, rounding_mode="floor").int()
            index = torch.arange(batch.max_context // m, device=pos.device)
            seen = index < torch.div(pos + 1, m, rounding_mode="floor")[..., None]      # [B, q, E]
            meta.visible[m] = torch.where(seen, batch.entry_slots(index.expand(b, -1), m)[:, None, :], -1).int()
        return meta


def _tensor(ref):
    """A PoolRef's storage tensor and record format."""
    return ref.pool.tensors[ref.layer], ref.pool.spec.fmt


def _compress(compressor, rows: torch.Tensor, rows_ref, entries_ref, meta: StepMeta, dtype: torch.dtype) -> None:
    m = compressor.ratio
    span = (2 if compressor.overlap else 1) * m
    state, _ = _tensor(rows_ref)
    pool, fmt = _tensor(entries_ref)
    cos, sin = meta.entry_rope[m]
    compressor_step(rows, state, meta.rows[span], pool, fmt, meta.completes[m], compressor.norm, compressor.eps,
                    cos, sin, m, compressor.overlap, dtype)


def fused_attend(attn, q, kv, x, q_res, cos, sin, comp_rows, idx_rows, batch: DecodeBatch, layer: int,
                 meta: StepMeta) -> torch.Tensor:
    """attention_decode.attend through the fused kernels. Returns [T, H, hd] fp32."""
    cfg = attn.cfg
    refs = batch.cache.layer_pools(layer)
    b, t = batch.num_seqs, batch.tokens_per_seq
    refs["window"].write(meta.window_writes, kv)            # history reads below never touch these slots
    entry_pool = entry_fmt = entry_slots = None
    if attn.compressor is not None:
        m = attn.ratio
        _compress(attn.compressor, comp_rows.view(b, t, -1), refs["comp_rows"], refs["comp_entries"], meta, x.dtype)
        num_entries = batch.max_context // m
        if attn.indexer is not None:
            _compress(attn.indexer.compressor, idx_rows.view(b, t, -1), refs["index_rows"], refs["index_keys"],
                      meta, x.dtype)
        if attn.indexer is not None and attn.indexer.topk < num_entries:
            iq, iw = attn.indexer.queries(q_res, x, cos, sin)
            keys, key_fmt = _tensor(refs["index_keys"])
            _, entry_slots = indexer_topk(iq.view(b, t, *iq.shape[1:]), iw.view(b, t, -1), keys, key_fmt,
                                          meta.full_table, meta.counts[m], meta.positions, m, attn.indexer.topk,
                                          max_entries=num_entries)
        else:
            entry_slots = meta.visible[m]
        entry_pool, entry_fmt = _tensor(refs["comp_entries"])
    window_pool, window_fmt = _tensor(refs["window"])
    out = sparse_mla_decode(q.view(b, t, cfg.num_heads, -1), attn.attn_sink, window_pool, window_fmt,
                            meta.window_slots, entry_pool, entry_fmt or "fp32", entry_slots,
                            new_kv=kv.view(b, t, -1), scale=cfg.head_dim**-0.5)
    return out.flatten(0, 1)


def fused_attention(attn, x, positions, rope, batch: DecodeBatch, layer: int, meta: StepMeta) -> torch.Tensor:
    """Attention.forward on a DecodeBatch with the fused core: [T, D] → [T, D]."""
    cfg = attn.cfg
    eps = cfg.rms_norm_eps
    cos, sin = rope.main if attn.kind == "swa" else rope.compress
    q_res = rms_norm(attn.wq_a(x), attn.q_norm, eps)
    q = attn.wq_b(q_res).view(x.shape[0], cfg.num_heads, cfg.head_dim)
    q = apply_rope(head_rms_norm(q, eps), cos, sin)
    kv = apply_rope(rms_norm(attn.wkv(x), attn.kv_norm, eps), cos, sin)
    comp_rows = attn.compressor.project(x, positions) if attn.compressor is not None else None
    idx_rows = attn.indexer.compressor.project(x, positions) if attn.indexer is not None else None
    out = fused_attend(attn, q, kv, x, q_res, cos, sin, comp_rows, idx_rows, batch, layer, meta)
    out = apply_rope(out.to(x.dtype), cos, sin, inverse=True)
    grouped = out.view(x.shape[0], cfg.o_groups, -1)
    return attn.wo_b(attn.wo_a(grouped).flatten(1))


def _mix(site, streams: torch.Tensor, cfg):
    return mhc_mix(streams, site.fn, site.base, site.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
                   collapse=True)


def fused_block(block, streams, token_ids, positions, rope, batch: DecodeBatch, layer: int, meta: StepMeta):
    """Block.forward with one mhc_mix launch per site: [T, n, D] → [T, n, D]."""
    eps = block.cfg.rms_norm_eps
    _, post, comb, x = _mix(block.hc_attn, streams, block.cfg)
    attn = fused_attention(block.attn, rms_norm(x, block.attn_norm, eps), positions, rope, batch, layer, meta)
    streams = hc_expand(streams, attn, post, comb)
    _, post, comb, x = _mix(block.hc_ffn, streams, block.cfg)
    return hc_expand(streams, block.ffn(rms_norm(x, block.ffn_norm, eps), token_ids), post, comb)


def fused_forward(model, batch: DecodeBatch, on_layer=None) -> torch.Tensor:
    """DeepseekV4.forward(batch.token_ids, batch.positions, batch) through the fused kernels.

    ``on_layer(i)`` (optional) is called before layer i and with None after the last (counters).
    """
    mark = on_layer or (lambda i: None)
    mark("meta")
    meta = StepMeta.build(batch, model.cfg, model.rope_compress)
    mark("model")
    rope = model.step_rope(batch.positions)
    streams = model.embed[batch.token_ids].unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()
    for i, block in enumerate(model.layers):
        mark(i)
        streams = fused_block(block, streams, batch.token_ids, batch.positions, rope, batch, i, meta)
    mark(None)
    return streams

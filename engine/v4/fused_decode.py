"""The static-shape decode/verify forward through fused kernels: few launches per layer.

Same contract as `DeepseekV4.forward` (and `MTPLayer.forward`) on a `DecodeBatch`: streams out,
KV pools written in place, the same maths (engine/v4/layers.py, engine/v4/attention_ops.py) in the same
rounding order. What changes is how it is launched (`kernels` dispatch: Triton on CUDA, the CPU
kernels on CPU), per layer:

  mHC      mhc_mix (Sinkhorn + collapse + the block's RMSNorm), mhc_expand        2 × 2
  attn     x → [wq_a | wkv] and [compressor / indexer wkv, wgate, weights_proj]  ≤ 2 GEMMs
           q_res RMSNorm; kv RMSNorm + RoPE + window write; q head-norm + RoPE      3
           q_res → wq_b (| indexer wq_b, packed, when the shape indexes: CSA)       1 GEMM
           compressor_step per compressor (ape added inside)                        ≤ 2
           indexer_topk over each sequence's real entry count (CSA, sparse)        2
           sparse_mla_decode (window + picked entries + the step's keys)           1
           inverse RoPE of the output; wo_a; wo_b                                   1 + 2 GEMMs
  MoE      gate GEMM, route, permute, gather, w13, SwiGLU, w2; shared [w1 | w3],
           SwiGLU, w2; combine (weights, unpermute, sum, + shared)                  11
           (on CPU, decode-sized: gate GEMM, then kernels/cpu_moe_decode.py's two
           numba calls around one SwiGLU over the routed and shared rows)            4
The per-step slot tables are built once (engine/v4/step_meta.py). Projections sharing an input are
packed into one GEMM (engine/v4/packed_linear.py) when their formats allow it.

On CPU a static shape the compiled step covers (kernels/cpu_step_plan.py: fp32, raw KV pools,
up to 16 rows) runs as one jitted call instead (kernels/cpu_step.py: the same kernels from
inside numba, embedding to logits), the CPU's analogue of replaying a captured graph.
"""

from __future__ import annotations

import numba
import torch

import kernels
from kernels.cpu_moe_decode import DecodeMoE
from kernels.cpu_step_plan import StepProgram

from ..decode_batch import DecodeBatch
from .layers import rms_norm
from .packed_linear import PackedLinear
from .step_meta import StepMeta, compressor_spans


def _pool(ref) -> tuple[torch.Tensor, str]:
    """A PoolRef's storage tensor and record format."""
    return ref.pool.tensors[ref.layer], ref.pool.spec.fmt


class _AttentionPlan:
    """One attention layer's packed projections: x → outputs by name, q_res → q (and index q)."""

    def __init__(self, attn):
        self.attn = attn
        x_names, x_lins = ["q_lora", "kv"], [attn.wq_a, attn.wkv]
        if attn.compressor is not None:
            x_names += ["comp_c", "comp_z"]
            x_lins += [attn.compressor.wkv, attn.compressor.wgate]
        if attn.indexer is not None:
            x_names += ["idx_c", "idx_z", "idx_w"]
            x_lins += [attn.indexer.compressor.wkv, attn.indexer.compressor.wgate, attn.indexer.weights_proj]
        self.x_names, self.x_proj = x_names, PackedLinear(x_lins)
        self.q_proj = PackedLinear([attn.wq_b])
        # With the indexer's queries (a shape whose entries outnumber its top-k), packed with wq_b
        self.q_index_proj = PackedLinear([attn.wq_b, attn.indexer.wq_b]) if attn.indexer is not None else None

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.x_names, self.x_proj(x)))

    def uses_indexer(self, max_context: int) -> bool:
        """Whether a shape reaching `max_context` positions picks entries by the indexer: only when
        it can hold more entries than the top-k (below that every visible entry is attended, and
        the index queries, an [H_I·d_I, q_lora] GEMM, would be computed for nothing)."""
        indexer = self.attn.indexer
        return indexer is not None and indexer.topk < max_context // self.attn.ratio


class FusedDecoder:
    """The fused decode forward of one model (its packed projections are built once)."""

    # Decode-sized CPU MoE layers through kernels/cpu_moe_decode.py (False: op by op; the bench's
    # baseline, same bits)
    cpu_moe = True
    # CPU static shapes as one compiled call (kernels/cpu_step.py; False: op by op, the bench's
    # baseline)
    cpu_step = True

    def __init__(self, model):
        self.model = model
        cfg = model.cfg
        blocks = list(model.layers) + [m.block for m in model.mtp]
        self.attn_plans = [_AttentionPlan(b.attn) for b in blocks]
        self.shared = [PackedLinear([b.ffn.shared_w1, b.ffn.shared_w3]) if cfg.n_shared_experts else None
                       for b in blocks]
        self.spans = compressor_spans(cfg, range(cfg.num_layers))
        self._moe_kernels: dict[int, tuple[list, DecodeMoE | None]] = {}
        # (id(batch), numba threads) → its program
        self._programs: dict[tuple[int, int], tuple[DecodeBatch, StepProgram | None]] = {}
        self._rope: tuple | None = None  # RoPE tables [P, r/2] (main cos, sin, compress cos, sin)
        self._bf16: dict = {}  # bf16 copies of the bf16-exact dense weights the programs read
        # Test/bench hook: called with the layer index before each layer, None after the last.
        self.on_layer = None

    # ---- entry points ----------------------------------------------------------------------------
    def forward(self, batch: DecodeBatch) -> torch.Tensor:
        """DeepseekV4.forward(batch.token_ids, batch.positions, batch): final streams [T, n, D]."""
        program = self.program(batch)
        if program is not None:
            return program.run(with_logits=False)[0]
        model = self.model
        meta = StepMeta.build(batch, model.cfg, model.rope_compress, self.spans)
        rope = model.step_rope(batch.positions)
        streams = model.embed[batch.token_ids].unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()
        for i, block in enumerate(model.layers):
            if self.on_layer is not None:
                self.on_layer(i)
            streams = self.block(i, block, streams, batch.token_ids, rope, batch, meta)
        if self.on_layer is not None:
            self.on_layer(None)
        return streams

    def forward_logits(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(final streams [T, n, D], logits [T, vocab] fp32): forward, then DeepseekV4.logits; one
        call where the compiled CPU step covers the shape."""
        program = self.program(batch)
        if program is not None:
            return program.run()
        streams = self.forward(batch)
        return streams, self.model.logits(streams)

    def greedy_steps(self, batch: DecodeBatch, steps: int, live: int, stops):
        """Up to `steps` greedy decode steps in one compiled call (StepProgram.run_greedy), or
        None where no compiled step covers the batch."""
        program = self.program(batch)
        return program.run_greedy(steps, live, stops) if program is not None else None

    def program(self, batch: DecodeBatch) -> StepProgram | None:
        """The compiled CPU step of batch's shape at the current numba thread count (built on
        first use, rebuilt when a weight or pool it views was replaced), or None: the op path
        runs. A program splits its products for the thread count it was built at (one thread:
        none split), and a worker's count changes with the host's load (engine/core_share.py)."""
        if not (self.cpu_step and self.on_layer is None and batch.token_ids.is_cpu):
            return None
        key = (id(batch), numba.get_num_threads())
        cached = self._programs.get(key)
        if cached is not None and cached[0] is batch and (cached[1] is None or cached[1].valid()):
            return cached[1]
        program = StepProgram.build(self, batch, self._rope_tables, self._bf16)
        self._programs[key] = (batch, program)
        return program

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, ...]:
        """cos/sin of the main and the compress RoPE for positions [0, length), fp32 [length, r/2]
        each: the RotaryTables' own values (an element does not depend on the positions computed
        with it), grown as longer contexts come."""
        if self._rope is None or self._rope[0].shape[0] < length:
            positions = torch.arange(length)
            self._rope = (*self.model.rope_main(positions), *self.model.rope_compress(positions))
        return tuple(t[:length] for t in self._rope)

    def forward_mtp(self, inputs: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """MTPLayer.forward(model, inputs, batch.token_ids, batch.positions, batch)."""
        model, mtp = self.model, self.model.mtp[0]
        eps = model.cfg.rms_norm_eps
        meta = StepMeta.build(batch, model.cfg, model.rope_compress, {})
        tokens, positions = batch.token_ids, batch.positions
        emb = model.embed[tokens]
        emb = torch.where((positions == 0)[:, None], torch.zeros_like(emb), emb)
        h = mtp.h_proj(rms_norm(inputs, mtp.hnorm, eps)) + mtp.e_proj(rms_norm(emb, mtp.enorm, eps)).unsqueeze(1)
        index = model.cfg.num_layers
        return self.block(index, mtp.block, h, tokens, model.step_rope(positions), batch, meta, layer=mtp.layer_id)

    # ---- one block -------------------------------------------------------------------------------
    def block(self, index: int, block, streams: torch.Tensor, token_ids: torch.Tensor, rope, batch: DecodeBatch,
              meta: StepMeta, layer: int | None = None) -> torch.Tensor:
        """Block.forward: [T, n, D] → [T, n, D]. `index` picks the plan, `layer` the KV pools."""
        cfg = block.cfg
        layer = index if layer is None else layer
        site = block.hc_attn
        _, post, comb, x = kernels.mhc_mix(streams, site.fn, site.base, site.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                           cfg.rms_norm_eps, collapse=True, norm_weight=block.attn_norm,
                                           out_eps=cfg.rms_norm_eps)
        y = self.attention(self.attn_plans[index], x, rope, batch, meta, layer)
        streams = kernels.mhc_expand(streams, y, post, comb)
        site = block.hc_ffn
        _, post, comb, x = kernels.mhc_mix(streams, site.fn, site.base, site.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                           cfg.rms_norm_eps, collapse=True, norm_weight=block.ffn_norm,
                                           out_eps=cfg.rms_norm_eps)
        return kernels.mhc_expand(streams, self.moe(index, block.ffn, x, token_ids), post, comb)

    # ---- attention -------------------------------------------------------------------------------
    def attention(self, plan: _AttentionPlan, x: torch.Tensor, rope, batch: DecodeBatch, meta: StepMeta,
                  layer: int) -> torch.Tensor:
        """Attention.forward on a DecodeBatch: [T, D] → [T, D]."""
        attn = plan.attn
        cfg = attn.cfg
        eps, dtype = cfg.rms_norm_eps, x.dtype
        t, (b, q) = x.shape[0], meta.positions.shape
        cos, sin = rope.main if attn.kind == "swa" else rope.compress
        refs = batch.cache.layer_pools(layer)
        out = plan.project(x)
        q_res = kernels.norm_rope(out["q_lora"].unsqueeze(1), 1, attn.q_norm, eps).view(t, -1)
        window_pool, window_fmt = _pool(refs["window"])
        kv = kernels.norm_rope(out["kv"].unsqueeze(1), 1, attn.kv_norm, eps, cos, sin, pool=window_pool,
                               pool_fmt=window_fmt, slots=meta.window_writes).view(b, q, -1)
        indexed = plan.uses_indexer(batch.max_context)
        q_out = (plan.q_index_proj if indexed else plan.q_proj)(q_res)
        qh = kernels.norm_rope(q_out[0].view(t, cfg.num_heads, cfg.head_dim), 2, None, eps, cos, sin)
        entry_pool = entry_slots = None
        entry_fmt, entries_shared = "fp32", False
        if attn.compressor is not None:
            index_q = q_out[1] if indexed else None
            entry_pool, entry_fmt, entry_slots, entries_shared = self._entries(attn, out, index_q, cos, sin, refs,
                                                                               batch, meta, dtype)
        # StepMeta's window and visible-entry tables are shared by a sequence's rows (one slot per
        # column): a verify step reads those records once per sequence, not once per token
        o = kernels.sparse_mla_decode(qh.view(b, q, cfg.num_heads, -1), attn.attn_sink, window_pool, window_fmt,
                                      meta.window_slots, entry_pool, entry_fmt, entry_slots, new_kv=kv,
                                      scale=cfg.head_dim**-0.5, window_shared=True,
                                      entries_shared=entries_shared)  # [B, q, H, hd] fp32
        o = kernels.norm_rope(o.view(t, cfg.num_heads, -1), 0, None, eps, cos, sin, inverse=True, dtype=dtype)
        low = attn.wo_a(o.view(t, cfg.o_groups, -1)).flatten(1)  # [T, G·o_lora]
        return attn.wo_b(low)

    def _entries(self, attn, out, index_q, cos, sin, refs, batch: DecodeBatch, meta: StepMeta, dtype):
        """Compress this step's rows; (entry pool, format, slots [B, q, K], whether the slot table is
        shared by a sequence's rows) the queries attend. index_q: the indexer's raw queries [T,
        H_I·d_I] when the shape picks entries by the indexer (`_AttentionPlan.uses_indexer`)."""
        m, (b, q) = attn.ratio, meta.positions.shape
        comp = attn.compressor
        self._compress(comp, out["comp_c"], out["comp_z"], refs["comp_rows"], refs["comp_entries"], meta, dtype)
        indexer = attn.indexer
        if indexer is not None:
            self._compress(indexer.compressor, out["idx_c"], out["idx_z"], refs["index_rows"], refs["index_keys"],
                           meta, dtype)
        pool, fmt = _pool(refs["comp_entries"])
        num_entries = batch.max_context // m
        if index_q is None:
            return pool, fmt, meta.visible[m], True  # every visible entry: one table per sequence
        iq = kernels.norm_rope(index_q.view(b * q, indexer.num_heads, indexer.head_dim), 0, None, 0.0, cos, sin)
        keys, key_fmt = _pool(refs["index_keys"])
        _, slots = kernels.indexer_topk(iq.view(b, q, indexer.num_heads, -1),
                                        out["idx_w"].view(b, q, indexer.num_heads), keys, key_fmt, meta.full_table,
                                        meta.counts[m], meta.positions, m, indexer.topk, max_entries=num_entries,
                                        weight_scale=indexer.num_heads**-0.5)
        return pool, fmt, slots, False  # each token's own top-k

    @staticmethod
    def _compress(comp, c: torch.Tensor, z: torch.Tensor, rows_ref, entries_ref, meta: StepMeta,
                  dtype: torch.dtype) -> None:
        """compressor_step on the raw [C | Z] columns (adjacent in the packed output)."""
        b, q = meta.positions.shape
        rows = _adjacent(c, z).view(b, q, -1)
        state, _ = _pool(rows_ref)
        pool, fmt = _pool(entries_ref)
        cos, sin = meta.entry_rope[comp.ratio]
        kernels.compressor_step(rows, state, meta.rows[comp.span], pool, fmt, meta.completes[comp.ratio], comp.norm,
                                comp.eps, cos, sin, comp.ratio, comp.overlap, dtype, ape=comp.ape,
                                positions=meta.positions)

    # ---- MoE -------------------------------------------------------------------------------------
    def moe(self, index: int, moe, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """MoE.forward: [T, D] → [T, D]."""
        if moe.parallel is not None or not moe.experts.holds_all:
            return moe(x, token_ids)  # expert parallelism: its own dispatch
        cfg = moe.cfg
        fused = self._cpu_moe(index, moe) if self.cpu_moe and x.is_cpu else None
        if fused is not None and fused.takes(x):
            logits = kernels.dense_linear(x, moe.gate.float(), allow_bf16=False)  # [T, E], as MoE.route
            hashed = moe.hash_routing
            return fused(x, logits, None if hashed else moe.gate_bias.float(), token_ids if hashed else None,
                         moe.tid2eid if hashed else None, kernels.swiglu)
        k = cfg.num_experts_per_tok
        weights, expert_ids = moe.route(x, token_ids)  # [T, k] fp32, int32
        _, offsets, order, inverse = kernels.permute(expert_ids, cfg.n_routed_experts)
        ends = offsets[1:]  # [E] int32 cumulative row ends
        experts = moe.experts
        h = experts.w13.grouped_mm(kernels.gather_rows(x, order, k), ends)  # [T·k, 2I]
        y = experts.w2.grouped_mm(kernels.swiglu(h, experts.swiglu_limit), ends)  # [T·k, D]
        shared = None
        if self.shared[index] is not None:
            gate, up = self.shared[index](x)
            act = kernels.swiglu(_adjacent(gate, up), cfg.swiglu_limit)
            shared = moe.shared_w2(act)
        return kernels.moe_combine(y, weights, inverse, shared, x.dtype)

    def _cpu_moe(self, index: int, moe) -> DecodeMoE | None:
        """The layer's DecodeMoE over its prepared CPU weights (rebuilt when one was re-prepared:
        a replaced weight or scale), None when its formats do not fit one."""
        experts, packed = moe.experts, self.shared[index]
        mods = [experts.w13, experts.w2]
        if packed is not None:
            if packed.num_gemms != 1:
                return None
            mods += [packed.groups[0][0], moe.shared_w2]
        if any(m.fmt.kind == "dense" or not m.weight.is_cpu for m in mods):
            return None
        parts = [m.cpu_prepared(m.weight, m.scale) for m in mods] + [None] * (4 - len(mods))
        cached = self._moe_kernels.get(index)
        if cached is not None and all(a is b for a, b in zip(cached[0], parts)):
            return cached[1]
        cfg = moe.cfg
        fused = None
        if DecodeMoE.compatible(*parts) and experts.swiglu_limit == cfg.swiglu_limit:
            fused = DecodeMoE(*parts, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
        self._moe_kernels[index] = (parts, fused)
        return fused


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a | b] along the last dim: a view when b's columns follow a's in one buffer, else a copy."""
    if (a.dim() == 2 and b.dim() == 2 and a.stride() == b.stride() and a.stride(-1) == 1
            and b.data_ptr() == a.data_ptr() + a.shape[-1] * a.element_size()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()):
        return a.as_strided((a.shape[0], a.shape[1] + b.shape[1]), a.stride())
    return torch.cat((a, b), dim=-1)

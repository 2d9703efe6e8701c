"""The program of one static shape for the compiled CPU decode step (kernels/cpu_step.py).

`StepProgram.build(decoder, batch)` walks the model once, as engine/v4/fused_decode.py's forward
would, and records what every layer reads: numpy views of the weights (the prepared FP8 / FP4
codes and scales of kernels/cpu_prepared_gemm.py, dense fp32 matrices), of the KV pools, of the
RoPE tables and of the `DecodeBatch`'s fields, with the sizes and flags the kernels take. A step
is then one call, `run()`, like a CUDA graph's replay: the batch's contents change, no address
does.

What it covers (anything else returns None from `build`, and the op path runs): a CPU model in
fp32 with every KV pool raw fp32 (`--kv-dtype auto`), B·q ≤ MAX_ROWS rows, weights dense fp32 or
FP8 / FP4 with byte scales (ue8m0), a MoE holding every expert on this rank.

A weight or pool replaced after the build (a reload, a re-layout) is caught before each run by
identity checks on the parameters and pool tensors; the program is then rebuilt. In-place updates
need nothing where the program views the storage; the bf16 copies it reads instead of
bf16-exact dense weights are the exception, so an in-place write to such a weight (its version
counter moves) rebuilds the program and remakes the copy.
"""
from __future__ import annotations

import operator

import numba
import numpy as np
import torch
from numba import njit
from numba.core.registry import CPUDispatcher
from numba.typed import List

from kernels import cpu_quant_gemm as q
from kernels import cpu_step_layout as L
from kernels.cpu_step import run_step
from kernels.cpu_gemv import bf16_copy
from kernels.cpu_step_linear import COLUMNS, DENSE, DENSE_BF16, DENSE_T, FP4, FP8
from kernels.cpu_step_math import CHUNK, SOFTPLUS_CHUNK
from kernels.cpu_torch_sum import LANES

# Rows (B·q) the program serves: the row kernels' FP8 product reuses each decoded weight for four
# rows and stays ahead of tile decode + sgemm to about 16 rows (kernels/cpu_quant_gemm.py).
MAX_ROWS = 16
# A product runs its parallel kernel (with more than one numba thread) from this many weight
# bytes read per call times the activation rows each weight row meets; below it a parallel
# launch (~3 µs at one thread, more when a core is busy) costs more than the split saves. (At
# 16 rows the shared expert's [256, 1024] FP8 product is 4 M multiply-adds: counted by bytes
# alone it ran on one thread while the other waited.)
PARALLEL_BYTES = 384 << 10
# A product whose weight alone is this large runs its parallel kernel at any row count: a decode
# step at batch 1 reads each weight once from memory, at about twice one thread's rate on two.
# On a 2-core Xeon (Emerald Rapids, 2 threads, perf/bench_cpu_decode.py) moving the weights of
# 96-384 KiB (a small model's attention projections and routed experts) onto both threads took
# the batch-1 step of the tiny V4s of hidden 256-512 from 1.78 to 1.32 ms (issue41), 2.46 to
# 1.91 (hidden 512, vocabulary 32k) and 1.56 to 1.27 (hidden 384); wider ones moved within
# their noise. At batch 16 every weight from 24 KiB (PARALLEL_BYTES / 16 rows) split already.
PARALLEL_WEIGHT_BYTES = 96 << 10
_KINDS = {"dense": DENSE, "fp8": FP8, "fp4": FP4}
_X_MEMBERS = {"q_lora": (L.Q_LORA_P, L.Q_LORA_C), "kv": (L.KV_P, L.KV_C), "comp_c": (L.COMP_C_P, L.COMP_C_C),
              "comp_z": (L.COMP_Z_P, L.COMP_Z_C), "idx_c": (L.IDX_C_P, L.IDX_C_C), "idx_z": (L.IDX_Z_P, L.IDX_Z_C),
              "idx_w": (L.IDX_W_P, L.IDX_W_C)}


# The typed lists of a program's arrays, one per array type, in run_step's order; made and filled
# by cached jitted code. numba.typed.List's own methods, called from Python, compile for each
# item type in every process: ~3.5 s of each worker's start before (py-spy).
_LIST_KINDS = ("f1", "f2", "f3", "u2", "u3", "i2", "h2", "h3")
_F1, _F2, _F3 = numba.float32[::1], numba.float32[:, ::1], numba.float32[:, :, ::1]
_U2, _U3, _I2 = numba.uint8[:, ::1], numba.uint8[:, :, ::1], numba.int32[:, ::1]
_H2, _H3 = numba.uint16[:, ::1], numba.uint16[:, :, ::1]


@njit(cache=True)
def _new_lists():
    return (List.empty_list(_F1), List.empty_list(_F2), List.empty_list(_F3), List.empty_list(_U2),
            List.empty_list(_U3), List.empty_list(_I2), List.empty_list(_H2), List.empty_list(_H3))


@njit(cache=True)
def _append(items, array):
    items.append(array)


class Unsupported(Exception):
    """The shape or the model is outside what the compiled step covers."""


_VERSION = operator.attrgetter("_version")

# Parameters registered in this process so far (nn.Module.__setattr__ of a Parameter registers it):
# a program built before a registration may view a replaced weight, so it is rebuilt. A global
# count costs one compare a step, where watching each viewed parameter's slot cost ~80 lookups.
_registrations = 0


def _count_registration(module, name, param) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def _version(t: torch.Tensor) -> int:
    """t's in-place write counter; -1 for an inference tensor, which has none (nothing can write
    it outside inference mode, and the engine never does inside)."""
    return -1 if t.is_inference() else t._version


def _np(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor (fp8 / e8m0 / int8 as uint8); no copies."""
    if not t.is_contiguous():
        raise Unsupported(f"a non-contiguous {tuple(t.shape)} tensor")
    t = t.detach()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
        t = t.view(torch.uint8)
    return t.numpy()


class _Arrays:
    """The typed lists a program reads, one per array type, and what must stay as it is."""

    def __init__(self):
        self.lists = _new_lists()                # run_step's typed lists (kernels/cpu_step_layout.py's order)
        self.items: dict[str, list[np.ndarray]] = {kind: [] for kind in _LIST_KINDS}  # the same arrays, for Python
        self.keep: list = []                     # tensors the views alias (kept alive)
        # Checked before each run: no parameter was registered (replaced) since the build, and
        # holders[i][keys[i]] is still objects[i] (holders: dicts of what is not a parameter).
        self.registrations = _registrations
        self.holders: list[dict] = []
        self.keys: list = []
        self.objects: list = []
        # Each bf16 copy's source parameter and its in-place write counter then (inference tensors,
        # which have none, are left out: nothing writes them); checked in C-level loops.
        self.versioned: list[torch.Tensor] = []
        self.versions: list[int] = []

    def add(self, kind: str, t: torch.Tensor | np.ndarray, dtype=np.float32) -> int:
        arr = t if isinstance(t, np.ndarray) else _np(t)
        if arr.dtype != dtype:
            raise Unsupported(f"a {arr.dtype} array where {np.dtype(dtype)} is needed")
        self.keep.append(t)
        items = self.items[kind]
        _append(self.lists[_LIST_KINDS.index(kind)], arr)
        items.append(arr)
        return len(items) - 1

    def watch(self, holder: dict, key) -> None:
        """Rebuild the program if holder[key] is ever replaced."""
        self.holders.append(holder)
        self.keys.append(key)
        self.objects.append(holder[key])

    def unchanged(self) -> bool:
        # C-level loops: this runs before every step, and ~120 generator steps cost ~20 µs cold
        return (_registrations == self.registrations
                and all(map(operator.is_, map(dict.get, self.holders, self.keys), self.objects))
                and list(map(_VERSION, self.versioned)) == self.versions)

    def watch_version(self, t: torch.Tensor, version: int) -> None:
        """Rebuild the program if t is written in place (its version moves past `version`)."""
        if not t.is_inference():
            self.versioned.append(t)
            self.versions.append(version)


class StepProgram:
    """One static shape's compiled decode step over its `DecodeBatch`."""

    def __init__(self, bf16_copies: dict):
        self.arrays = _Arrays()
        self.bf16_copies = bf16_copies
        self.lin: list[list[int]] = []
        self.grp: list[list[int]] = []
        self.entry = None                        # run_step's compiled entry point for these argument types

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, decoder, batch, rope_tables, bf16_copies: dict) -> "StepProgram | None":
        """The program of `batch`'s shape, or None where the compiled step does not apply.
        rope_tables(positions) -> (main cos, main sin, compress cos, compress sin) fp32 [P, r/2];
        bf16_copies: the bf16 copies of bf16-exact dense weights, shared by a model's programs
        (id(parameter) → (parameter, its version, copy or None)), filled here."""
        try:
            return cls(bf16_copies)._build(decoder, batch, rope_tables)
        except Unsupported:
            return None

    def _build(self, decoder, batch, rope_tables) -> "StepProgram":
        model, cfg = decoder.model, decoder.model.cfg
        b, qn = batch.num_seqs, batch.tokens_per_seq
        if b * qn > MAX_ROWS or model.embed.dtype != torch.float32 or not model.embed.is_cpu:
            raise Unsupported("rows or dtype")
        arrays = self.arrays
        self.rows, self.q, self.hc, self.hidden = b * qn, qn, cfg.hc_mult, cfg.hidden_size
        layers = list(model.layers)
        ratios = sorted({cfg.compress_ratios[i] for i in range(len(layers)) if cfg.compress_ratios[i]}) or [1]
        spans: list[int] = []
        visible = {m: 0 for m in ratios}
        table, table_f = [], []
        for index, block in enumerate(layers):
            row, row_f = [-1] * L.LAYER_COLUMNS, [0.0] * L.LAYER_F_COLUMNS
            self._block(row, row_f, block, cfg)
            self._attention(row, row_f, decoder.attn_plans[index], batch, index, ratios, spans, visible)
            self._moe(row, row_f, decoder, index, block.ffn, cfg)
            table.append(row)
            table_f.append(row_f)
        self.layer = np.array(table, np.int64)
        self.layer_f = np.array(table_f, np.float64)
        self.step_ratios = np.array([[m, visible[m]] for m in ratios], np.int64)
        self.step_spans = np.array(spans or [1], np.int64)
        self._step(model, cfg, batch, rope_tables)
        self.lin_table = np.array(self.lin or [[0] * COLUMNS], np.int64)
        self.grp_table = np.array(self.grp or [[0] * COLUMNS], np.int64)
        # fields of the DecodeBatch buffer: views, so each fill is seen
        self.batch = tuple(_np(t) for t in (batch.token_ids, batch.positions, batch.start, batch.full_table,
                                            batch.sliding_table, batch.sliding_first))
        self.streams = torch.empty(b * qn, cfg.hc_mult * cfg.hidden_size)      # [T, n·D]
        self.logits = torch.empty(b * qn, cfg.vocab_size)                      # [T, V]
        # run_step's arguments but with_logits: the same objects every run (contents change)
        self._args = (self.layer, self.layer_f, self.step, self.step_f, self.step_ratios, self.step_spans,
                      self.lin_table, self.grp_table, arrays.lists, self.batch, self.streams.numpy(),
                      self.logits.numpy())
        # greedy_steps' buffers: (tokens, finite, stops, done), placeholders when a run samples on the host
        self._tokens = np.zeros((b * qn, 1), np.int64)
        self._no_greedy = (self._tokens, np.zeros(b * qn, np.bool_), np.full((b * qn, 1), -1, np.int64),
                           np.zeros(1, np.int64))
        return self

    def _block(self, row: list, row_f: list, block, cfg) -> None:
        a = self.arrays
        for (fn, base, scale, norm), site, weight in (((L.HC_A_FN, L.HC_A_BASE, L.HC_A_SCALE, L.ATTN_NORM),
                                                       block.hc_attn, block.attn_norm),
                                                      ((L.HC_F_FN, L.HC_F_BASE, L.HC_F_SCALE, L.FFN_NORM),
                                                       block.hc_ffn, block.ffn_norm)):
            row[fn], row[base], row[scale] = a.add("f2", site.fn), a.add("f1", site.base), a.add("f1", site.scale)
            row[norm] = a.add("f1", weight)
        row_f[L.EPS], row_f[L.HC_EPS] = cfg.rms_norm_eps, cfg.hc_eps

    # ---- products --------------------------------------------------------------------------------
    def _per(self, rows: int, weight_bytes: int, act_rows: int) -> int:
        """0 (this thread) or the parallel kernel's weight rows a task, for `rows` weight rows of
        `weight_bytes` in all, each met by about `act_rows` activation rows."""
        if numba.get_num_threads() == 1:
            return 0
        if weight_bytes * act_rows < PARALLEL_BYTES and weight_bytes < PARALLEL_WEIGHT_BYTES:
            return 0
        return q._rows_per_task(rows)

    def _bf16(self, weight: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
        """The bf16 copy of a dense fp32 weight (a view of the parameter `param`) whose values are
        all bf16, or None; made once per parameter object and version (a replaced or rewritten
        parameter gets a new one). The program is rebuilt when the parameter's version moves."""
        version = _version(param)
        cached = self.bf16_copies.get(id(param))
        if cached is None or cached[0] is not param or cached[1] != version:
            cached = self.bf16_copies[id(param)] = (param, version, bf16_copy(weight))
        self.arrays.watch_version(param, version)
        return cached[2]

    def _dense(self, w: torch.Tensor) -> int:
        """A lin row for a dense fp32 weight parameter [N, K]: its bf16 copy where it is bf16-exact."""
        if w.dtype != torch.float32:
            raise Unsupported("a dense weight not in fp32")
        a, half = self.arrays, self._bf16(w, w)
        if half is not None:
            desc = [DENSE_BF16, a.add("h2", half, np.uint16), -1, 1, 1, w.shape[0], w.shape[1],
                    self._per(w.shape[0], w.numel() * 2, self.rows)]
        else:
            desc = [DENSE, a.add("f2", w), -1, 1, 1, w.shape[0], w.shape[1],
                    self._per(w.shape[0], w.numel() * 4, self.rows)]
        self.lin.append(desc)
        return len(self.lin) - 1

    def _linear(self, m) -> int:
        """A lin row for Linear m (its format as stored); returns its index."""
        a, kind = self.arrays, _KINDS[m.fmt.kind]
        if kind == DENSE:
            return self._dense(m.weight)
        else:
            p = m.cpu_prepared(m.weight, m.scale)
            if p is None or p.grouped_weight or p.scales.dtype != np.uint8:
                raise Unsupported("a weight not prepared with byte scales")
            desc = [kind, a.add("u2", p.codes, np.uint8), a.add("u2", p.scales, np.uint8), p.block[0], p.block[1],
                    p.n, p.k, self._per(p.n, p.codes.nbytes, self.rows)]
        self.lin.append(desc)
        return len(self.lin) - 1

    def _grouped(self, m, weight: torch.Tensor, scale: torch.Tensor | None, slots: int) -> int:
        """A grp row for a stack [E, N, K] (experts, or wo_a's groups) of `slots` activation rows
        in all."""
        a, kind = self.arrays, _KINDS[m.fmt.kind]
        if kind == DENSE:
            if weight.dtype != torch.float32:
                raise Unsupported("a dense stack not in fp32")
            e, n, k = weight.shape
            half = self._bf16(weight, m.weight) if weight.is_contiguous() else None
            if half is not None:
                desc = [DENSE_BF16, a.add("h3", half, np.uint16), -1, 1, 1, n, k, 0]
            else:
                if not weight.is_contiguous():              # stored [E, K, N]-contiguous (relayout)
                    kind, weight = DENSE_T, weight.transpose(1, 2)
                desc = [kind, a.add("f3", weight), -1, 1, 1, n, k, 0]
        else:
            p = m.cpu_prepared(weight, scale)
            if p is None or not p.grouped_weight or p.scales.dtype != np.uint8:
                raise Unsupported("a stack not prepared with byte scales")
            e, n = p.codes.shape[0], p.n
            active = min(slots, e)
            desc = [kind, a.add("u3", p.codes, np.uint8), a.add("u3", p.scales, np.uint8), p.block[0], p.block[1],
                    n, p.k, self._per(n * active, p.codes[0].nbytes * active, slots // active)]
        self.grp.append(desc)
        return len(self.grp) - 1

    def _packed(self, row: list, packed, names: list[str], members: dict, first: int, count_col: int) -> None:
        """A PackedLinear's products into row[first:], count in row[count_col]; each named member's
        (product, first column) into its columns."""
        i = 0
        for p, (gemm, count) in enumerate(packed.groups):
            row[first + p] = self._linear(gemm)
            column = 0
            for width in packed.widths[i:i + count]:
                if names[i] in members:
                    row[members[names[i]][0]], row[members[names[i]][1]] = p, column
                column += width
                i += 1
        row[count_col] = len(packed.groups)

    # ---- attention -------------------------------------------------------------------------------
    def _attention(self, row: list, row_f: list, plan, batch, index: int, ratios: list[int], spans: list[int],
                   visible: dict) -> None:
        a, attn = self.arrays, plan.attn
        cfg = attn.cfg
        if len(plan.x_proj.groups) > 7:
            raise Unsupported("too many products of x")
        self._packed(row, plan.x_proj, plan.x_names, _X_MEMBERS, L.X_0, L.X_COUNT)
        refs = batch.cache.layer_pools(index)
        row[L.Q_NORM], row[L.KV_NORM] = a.add("f1", attn.q_norm), a.add("f1", attn.kv_norm)
        row[L.Q_LORA], row[L.HEADS], row[L.HEAD_DIM] = cfg.q_lora_rank, cfg.num_heads, cfg.head_dim
        row[L.SINK], row[L.WINDOW] = a.add("f1", attn.attn_sink), self._pool(refs["window"], cfg.head_dim)
        row[L.KIND] = {"swa": L.SWA, "csa": L.CSA, "hca": L.HCA}[attn.kind]
        row[L.ROPE] = L.ROPE_MAIN if attn.kind == "swa" else L.ROPE_COMPRESS
        row_f[L.ATTN_SCALE] = cfg.head_dim ** -0.5
        indexed = plan.uses_indexer(batch.max_context)
        row[L.INDEXED] = int(indexed)
        if indexed:
            self._packed(row, plan.q_index_proj, ["q", "iq"], {"q": (L.Q_P, L.Q_C), "iq": (L.IQ_P, L.IQ_C)},
                         L.QI_0, L.QI_COUNT)
        else:
            row[L.WQ_B] = self._linear(attn.wq_b)
        g = attn.wo_a.groups
        wo_a = attn.wo_a
        weight = wo_a.weight.view(g, wo_a.out_per_group, -1)
        scale = wo_a.scale.view(g, -1, wo_a.scale.shape[-1]) if wo_a.scale is not None else None
        row[L.WO_A] = self._grouped(wo_a, weight, scale, self.rows * g)     # each group: every token's row
        row[L.WO_GROUPS], row[L.WO_B] = g, self._linear(attn.wo_b)
        comp = attn.compressor
        if comp is None:
            return
        m = attn.ratio
        row[L.RATIO], row[L.RATIO_SLOT] = m, ratios.index(m)
        self._compressor(row, row_f, comp, refs["comp_rows"], refs["comp_entries"], spans,
                         (L.C_APE, L.C_NORM, L.C_STATE, L.C_ENTRIES, L.C_WIDTH, L.C_SPAN_SLOT, L.C_EPS), cfg.head_dim)
        row[L.C_DIM], row[L.C_OVERLAP] = comp.out_dim, int(comp.overlap)
        if attn.indexer is not None:
            ix = attn.indexer
            self._compressor(row, row_f, ix.compressor, refs["index_rows"], refs["index_keys"], spans,
                             (L.I_APE, L.I_NORM, L.I_STATE, L.I_KEYS, L.I_WIDTH, L.I_SPAN_SLOT, L.I_EPS), ix.head_dim)
            keys = refs["index_keys"].pool.tensors[index]
            row[L.I_KEY_RECORDS] = a.add("u2", keys.view(torch.uint8).view(-1, keys.shape[-1] * 4), np.uint8)
            row[L.I_KEYS_PER_BLOCK] = keys.shape[1]
            row[L.I_HEADS], row[L.I_DIM], row[L.I_TOPK] = ix.num_heads, ix.head_dim, ix.topk
            row_f[L.INDEX_SCALE], row_f[L.INDEX_WEIGHT_SCALE] = ix.head_dim ** -0.5, ix.num_heads ** -0.5
        if not indexed:
            visible[m] = batch.max_context // m

    def _pool(self, ref, width: int) -> int:
        """A raw fp32 pool (or compressor state) as [slots, width] rows in f2."""
        if ref.pool.spec.fmt != "fp32":
            raise Unsupported(f"a {ref.pool.spec.fmt} KV pool")
        self.arrays.watch(ref.pool.tensors, ref.layer)
        return self.arrays.add("f2", ref.pool.tensors[ref.layer].view(-1, width))

    def _compressor(self, row: list, row_f: list, comp, rows_ref, entries_ref, spans: list[int], cols: tuple,
                    dim: int) -> None:
        ape, norm, state, entries, width, span_slot, eps = cols
        a = self.arrays
        span = 2 * comp.ratio if comp.overlap else comp.ratio
        if span not in spans:
            spans.append(span)
        two_w = comp.ape.shape[1] * 2
        row[ape], row[norm] = a.add("f2", comp.ape), a.add("f1", comp.norm)
        row[state], row[entries] = self._pool(rows_ref, two_w), self._pool(entries_ref, dim)
        row[width], row[span_slot], row_f[eps] = two_w // 2, spans.index(span), comp.eps

    # ---- MoE and the step --------------------------------------------------------------------------
    def _moe(self, row: list, row_f: list, decoder, index: int, moe, cfg) -> None:
        a = self.arrays
        if moe.parallel is not None or not moe.experts.holds_all:
            raise Unsupported("expert parallelism")
        if moe.gate.dtype != torch.float32:
            raise Unsupported("a router not in fp32")
        row[L.GATE] = a.add("f2", moe.gate)
        row[L.GATE_PER] = self._per(moe.gate.shape[0], moe.gate.numel() * 4, self.rows)
        if moe.hash_routing:
            row[L.TID2EID] = a.add("i2", moe.tid2eid, np.int32)
        else:
            row[L.BIAS] = a.add("f1", moe.gate_bias)
        k, experts = cfg.num_experts_per_tok, moe.experts
        slots = self.rows * k
        row[L.W13] = self._grouped(experts.w13, experts.w13.weight, experts.w13.scale, slots)
        row[L.W2] = self._grouped(experts.w2, experts.w2.weight, experts.w2.scale, slots)
        row[L.TOPK], row[L.EXPERTS], row[L.INTER] = k, experts.num_experts, experts.inter
        row_f[L.SCALING], row_f[L.LIMIT_ROUTED], row_f[L.LIMIT_SHARED] = (cfg.routed_scaling_factor,
                                                                          experts.swiglu_limit, cfg.swiglu_limit)
        shared = decoder.shared[index]
        row[L.SH_COUNT] = 0
        if shared is not None:
            if shared.num_gemms > 2:
                raise Unsupported("a shared expert in more than two products")
            for p, (gemm, count) in enumerate(shared.groups):
                row[L.SH_0 + p] = self._linear(gemm)
            row[L.SH_COUNT], row[L.SH_W2] = shared.num_gemms, self._linear(moe.shared_w2)
        fused = decoder._cpu_moe(index, moe) if decoder.cpu_moe else None
        row[L.FUSED_ROWS] = fused.max_tokens if fused is not None else 0

    def _step(self, model, cfg, batch, rope_tables) -> None:
        a = self.arrays
        step = [0] * L.STEP_COLUMNS
        step[L.SEQS], step[L.Q], step[L.HC], step[L.HIDDEN] = batch.num_seqs, batch.tokens_per_seq, cfg.hc_mult, \
            cfg.hidden_size
        step[L.WINDOW_LEN], step[L.BLOCK] = cfg.sliding_window, batch.cache.layout.block_size
        step[L.ITERS], step[L.LANES], step[L.CHUNK] = cfg.hc_sinkhorn_iters, LANES, CHUNK
        step[L.SOFTPLUS_CHUNK] = SOFTPLUS_CHUNK
        step[L.MAX_CONTEXT], step[L.VOCAB] = batch.max_context, cfg.vocab_size
        if model.head.dtype != torch.float32:
            raise Unsupported("an LM head not in fp32")
        step[L.EMBED], step[L.HEAD] = a.add("f2", model.embed), self._dense(model.head)
        hh = model.hc_head
        step[L.HEAD_FN], step[L.HEAD_BASE], step[L.HEAD_SCALE] = a.add("f2", hh.fn), a.add("f1", hh.base), \
            a.add("f1", hh.scale)
        step[L.NORM] = a.add("f1", model.norm)
        for col, table in zip((L.MAIN_COS, L.MAIN_SIN, L.COMP_COS, L.COMP_SIN), rope_tables(batch.max_context)):
            step[col] = a.add("f2", table)
        self.step = np.array(step, np.int64)
        self.step_f = np.array([cfg.rms_norm_eps, cfg.hc_eps], np.float64)

    # ---- what a step reads -------------------------------------------------------------------------
    def weight_bytes(self, with_logits: bool = True) -> dict[str, float]:
        """Weight bytes one step (run(with_logits)) must read, by kind: every plain product's weight
        and scales (dense, bf16 copies, FP8, FP4; the LM head among them with the logits), the
        routers and one embedding row per token, and for each stack its active members: wo_a's every group, and of E routed experts the E·(1 − (1 − k/E)^T) a
        step of T tokens touches on average when routing is uniform (exact at T = 1)."""
        a, t = self.arrays.items, self.rows
        out = {"dense": 0.0, "bf16": 0.0, "fp8": 0.0, "fp4": 0.0, "experts": 0.0, "router": 0.0}
        names = {DENSE: "dense", DENSE_T: "dense", DENSE_BF16: "bf16", FP8: "fp8", FP4: "fp4"}
        for row, (kind, w, s, *_) in enumerate(self.lin_table.tolist() if self.lin else []):
            if row == self.step[L.HEAD] and not with_logits:
                continue
            weight = {DENSE: a["f2"], DENSE_BF16: a["h2"]}.get(kind, a["u2"])[w]
            out[names[kind]] += weight.nbytes + (a["u2"][s].nbytes if kind in (FP8, FP4) else 0)
        for index, (kind, w, s, *_) in enumerate(self.grp_table.tolist() if self.grp else []):
            stack = {DENSE: a["f3"], DENSE_T: a["f3"], DENSE_BF16: a["h3"]}.get(kind, a["u3"])[w]
            member = stack[0].nbytes + (a["u3"][s][0].nbytes if kind in (FP8, FP4) else 0)
            e = stack.shape[0]
            routed = index in set(self.layer[:, L.W13].tolist()) | set(self.layer[:, L.W2].tolist())
            if routed:
                k = int(self.layer[0, L.TOPK])
                out["experts"] += member * e * (1 - (1 - k / e) ** t)
            else:
                out[names[kind]] += member * e
        out["router"] = sum(a["f2"][g].nbytes for g in self.layer[:, L.GATE].tolist())
        out["router"] += t * a["f2"][self.step[L.EMBED]][0].nbytes        # (and the embedding rows)
        return out

    # ---- running ---------------------------------------------------------------------------------
    def valid(self) -> bool:
        """Whether every weight and pool is still the one the program views."""
        return self.arrays.unchanged()

    def run(self, with_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step over the batch's current contents: (streams [T, n, D], logits [T, V] or None
        without them), the program's own buffers (valid until the next run)."""
        self.step[L.TORCH_THREADS], self.step[L.THREADS] = torch.get_num_threads(), numba.get_num_threads()
        status = launch(self, self._args + (with_logits, 0, 0, self._no_greedy))
        if status != L.OK:
            raise _error(status)
        return self.streams.view(self.rows, self.hc, self.hidden), self.logits if with_logits else None

    def run_greedy(self, steps: int, live: int, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Up to `steps` greedy decode steps of the batch's first `live` rows in one call
        (kernels/cpu_step.greedy_steps; q = 1): (tokens [live, done] int64, finite [live] bool),
        done ≥ 1 the steps it ran. stops [live, S] int64: each row's stop ids, −1 padding. The
        batch's token ids, positions and starts are left where the last step put them."""
        if self.q != 1 or not 1 <= steps or not 0 < live <= self.rows or stops.shape[0] != live:
            raise ValueError("greedy steps run a q = 1 batch's live rows")
        if self._tokens.shape[1] < steps:
            self._tokens = np.zeros((self.rows, steps), np.int64)
        self.step[L.TORCH_THREADS], self.step[L.THREADS] = torch.get_num_threads(), numba.get_num_threads()
        finite, done = np.zeros(self.rows, np.bool_), np.zeros(1, np.int64)
        stops = np.ascontiguousarray(stops, np.int64)
        status = launch(self, self._args + (True, steps, live, (self._tokens, finite, stops, done)))
        if status != L.OK:
            raise _error(status)
        return self._tokens[:live, : done[0]].copy(), finite[:live]


def launch(program: StepProgram, args: tuple) -> int:
    """run_step(*args) for `program`, whose arguments keep their types from run to run: the first
    call goes through numba's dispatcher (which compiles or loads the cache), later ones straight
    to the compiled entry point it picked. The dispatcher types every argument on every call, the
    typed lists and tuples in Python: ~0.1 ms of a 1.4 ms batch-1 step of a 6-layer tiny V4."""
    entry = program.entry
    if entry is not None:
        return entry(*args)
    status = run_step(*args)
    if isinstance(run_step, CPUDispatcher):          # (not a test's or bench's stand-in)
        compiled = run_step.overloads.get(tuple(run_step.typeof_pyval(a) for a in args))
        if compiled is not None:
            program.entry = compiled.entry_point
    return status


def _error(status: int) -> Exception:
    """The op path's exception for a failed step."""
    return {L.BAD_TOKEN: IndexError("token ids must be in [0, vocab_size)"),
            L.BAD_SLOT: IndexError("a slot table entry lies outside its KV pool"),
            L.BAD_KEYS: ValueError("attention slots lie beyond their pools"),
            L.BAD_HASH_TOKEN: ValueError("token_ids must be in [0, vocab_size) for hash routing"),
            L.BAD_EXPERT: ValueError("expert ids out of range"),
            L.BAD_ENDS: ValueError("grouped product: invalid ends")}.get(status, RuntimeError(f"step status {status}"))

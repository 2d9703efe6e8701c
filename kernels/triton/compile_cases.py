"""The Triton launches of a decode step, made through the public wrappers on ``meta`` tensors.

`cases(geometry)` lists (label, thunk) pairs; under `launch_record.recording()` each thunk's
launches become records for `compile_check` (no data is touched, so a released model's shapes
cost nothing). A geometry is a DeepSeek-V4 model config plus a DeepSeek-V4.1 one:
  tiny      the `make-model --preset tiny` configs (the test suite's models), the V4 one with
            head_dim 128 / rope 64 / index dim 64 so the quantized KV formats fit as well
  small     the `--preset small` configs (the benchmark models: the released attention geometry)
  released  engine/configs/deepseek-v4-flash.json and ../shared/golden/deepseek-v4.1/release-config.json
For V4 the fused decode step's launches (engine/v4/fused_decode.py) are covered in bf16 and fp32
compute, for every --kv-dtype, for decode (q = 1) and MTP verify steps (q = 2, 4), at a short
context (every entry attended) and a long one (CSA picks by the indexer), with the released
weight formats (FP8 128×128 projections, FP4 experts) and with dense experts (an unquantized
checkpoint's grouped GEMM). V4.1's engine path launches Triton only
in its fast numerics (`Numerics(exact=False)`: act_quant + FP8 32×32 / FP4 GEMMs); its exact
numerics (the default) launch none. Shapes follow the engine's call sites; a dry run of the engine
itself (tests/fake_cuda) records the exact launches, strides included.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GEOMETRIES = ("tiny", "small", "released")
ROOT = Path(__file__).resolve().parents[2]
V4_RELEASED = ROOT / "engine" / "configs" / "deepseek-v4-flash.json"
V41_RELEASED = ROOT / ".." / "shared" / "golden" / "deepseek-v4.1" / "release-config.json"
TINY_KV_HEADS = {"head_dim": 128, "qk_rope_head_dim": 64, "index_head_dim": 64}
STEPS = ((1, 1), (16, 1), (16, 2), (16, 4))            # (sequences, tokens per sequence)
Case = tuple[str, Callable[[], object]]
F32, BF16, I32, I64, U8 = torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.uint8


def _t(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _ends(experts: int) -> torch.Tensor:
    """Grouped GEMM row ends: a host tensor (the wrappers check host offsets' values; all 0 is valid)."""
    return torch.zeros(experts, dtype=I32)


def _cols(rows: int, width: int, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns start .. start + n of a [rows, width] output: a packed GEMM's member."""
    return _t(rows, width, dtype=dtype)[:, start:start + n]


@dataclass(frozen=True)
class V4Shape:
    """What the decode step's kernels see of a DeepSeek-V4 config."""

    hidden: int
    heads: int
    head_dim: int
    rope: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    csa: int                 # CSA compression ratio (0: none)
    hca: int                 # HCA compression ratio (0: none)
    index_heads: int
    index_dim: int
    topk: int
    experts: int
    top_k: int
    inter: int
    hc: int
    sinkhorn: int
    fp8_block: tuple[int, int]
    contexts: tuple[int, int]  # a short context (no indexer) and a long one


def v4_shape(geometry: str) -> V4Shape:
    from engine.config import ModelConfig
    from engine.v4.checkpoint import preset_config

    if geometry == "released":
        cfg = ModelConfig.from_dict(json.loads(V4_RELEASED.read_text()))
    else:
        cfg = preset_config(geometry, **(TINY_KV_HEADS if geometry == "tiny" else {}))
    ratios = {kind: m for m, kind in zip(cfg.compress_ratios, cfg.layer_kinds) if m}
    block = tuple((cfg.quantization or {}).get("weight_block_size", (128, 128)))
    csa, hca = ratios.get("csa", 0), ratios.get("hca", 0)
    short = max(4 * cfg.sliding_window, 2 * hca)
    long = max(short, 2 * csa * cfg.index_topk, 64 * 1024 if geometry == "released" else 0)
    return V4Shape(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim, cfg.q_lora_rank, cfg.o_groups,
                   cfg.o_lora_rank, cfg.sliding_window, csa, hca, cfg.index_n_heads, cfg.index_head_dim,
                   cfg.index_topk, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.hc_mult, cfg.hc_sinkhorn_iters, block, (short, long))


def v41_text_config(geometry: str) -> dict:
    from engine.v41.checkpoint import PRESETS

    if geometry == "released":
        return json.loads(V41_RELEASED.read_text())["text_config"]
    return PRESETS[geometry]


def kv_formats(s: V4Shape, dtype: torch.dtype) -> dict[str, tuple[str, str, str]]:
    """--kv-dtype → (window, compressed entry, index key) formats (engine/kv_layout.py `_formats`)."""
    raw = "bf16" if dtype == BF16 else "fp32"
    out = {"auto": (raw, raw, raw), "bf16": ("bf16", "bf16", "bf16")}
    if s.rope == 64:
        out |= {"fp8": ("fp8_ds_mla", "fp8_ds_mla", "fp4_index"), "fp4": ("fp8_ds_mla", "fp4_kv", "fp4_index")}
    return out


def _pool(fmt: str, dim: int, blocks: int = 64, per_block: int = 64) -> torch.Tensor:
    from kernels.formats import get_format
    from kernels.triton.kv_codec import RAW_DTYPES

    if fmt in RAW_DTYPES:
        return _t(blocks, per_block, dim, dtype=RAW_DTYPES[fmt])
    return _t(blocks, per_block, get_format(fmt, dim).record_bytes, dtype=U8)


# ---- V4: one decode step --------------------------------------------------------------------------

def _gemms(s: V4Shape, dtype: torch.dtype, t: int) -> list[Case]:
    """The FP8 projections (packed where the engine packs them) and the FP4 routed experts."""
    from kernels.triton import quant_gemm as qg

    def fp8(n: int, k: int, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        bn, bk = s.fp8_block
        return _t(*lead, n, k, dtype=torch.float8_e4m3fn), _t(*lead, -(-n // bn), -(-k // bk),
                                                              dtype=torch.float8_e8m0fnu)

    def fp4(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _t(e, n, k // 2, dtype=torch.int8), _t(e, n, k // 32, dtype=torch.float8_e8m0fnu)

    hd, g = s.heads * s.head_dim, s.o_groups
    rows = t * s.top_k
    return [
        (f"fp8 [wq_a|wkv] M={t}", lambda: qg.fp8_linear(_t(t, s.hidden, dtype=dtype), *fp8(s.q_lora + s.head_dim,
                                                                                            s.hidden), s.fp8_block)),
        (f"fp8 wq_b M={t}", lambda: qg.fp8_linear(_t(t, s.q_lora, dtype=dtype), *fp8(hd, s.q_lora), s.fp8_block)),
        (f"fp8 wo_a grouped M={g * t}", lambda: qg.fp8_grouped_mm(
            _t(g * t, hd // g, dtype=dtype), *fp8(s.o_lora, hd // g, (g,)), _ends(g), s.fp8_block)),
        (f"fp8 wo_b M={t}", lambda: qg.fp8_linear(_t(t, g * s.o_lora, dtype=dtype), *fp8(s.hidden, g * s.o_lora),
                                                  s.fp8_block)),
        (f"fp4 experts w13 M={rows}", lambda: qg.fp4_grouped_mm(
            _t(rows, s.hidden, dtype=dtype), *fp4(s.experts, 2 * s.inter, s.hidden), _ends(s.experts))),
        (f"fp4 experts w2 M={rows}", lambda: qg.fp4_grouped_mm(
            _t(rows, s.inter, dtype=dtype), *fp4(s.experts, s.hidden, s.inter), _ends(s.experts))),
    ]


def _dense_experts(s: V4Shape, dtype: torch.dtype, t: int) -> list[Case]:
    """An unquantized model's routed experts on the GPU: kernels.dense_grouped_mm's Triton kernel
    (every dtype but aligned bf16 on sm90/sm100, which takes torch's CUTLASS kernel)."""
    from kernels.triton import dense_grouped_mm as dg

    def launch(n: int, k: int) -> None:
        rows = t * s.top_k
        x, w, out = _t(rows, k, dtype=dtype), _t(s.experts, n, k, dtype=dtype), _t(rows, n, dtype=dtype)
        grid, args, meta = dg.launch_plan(x, w, _t(s.experts, dtype=I32), out, dg.gpu_tiles(rows, s.experts, dtype),
                                          interpreted=False)
        dg._dense_grouped_mm_kernel[grid](*args, **meta)

    return [(f"dense experts w13 M={t * s.top_k}", lambda: launch(2 * s.inter, s.hidden)),
            (f"dense experts w2 M={t * s.top_k}", lambda: launch(s.hidden, s.inter))]


def _moe_and_mhc(s: V4Shape, dtype: torch.dtype, t: int) -> list[Case]:
    from kernels.triton.mhc_expand import mhc_expand
    from kernels.triton.mhc_mix import mhc_mix
    from kernels.triton.moe_ops import gather_rows, moe_combine, swiglu

    k, n, rows = s.top_k, s.hc, t * s.top_k
    return [
        (f"gather_rows T={t}", lambda: gather_rows(_t(t, s.hidden, dtype=dtype), _t(rows, dtype=I32), k)),
        (f"swiglu routed S={rows}", lambda: swiglu(_t(rows, 2 * s.inter, dtype=dtype), 10.0)),
        (f"swiglu shared S={t}", lambda: swiglu(_t(t, 2 * s.inter, dtype=dtype), 10.0)),
        (f"moe_combine T={t}", lambda: moe_combine(_t(rows, s.hidden, dtype=dtype), _t(t, k), _t(rows, dtype=I32),
                                                   _t(t, s.hidden, dtype=dtype), dtype)),
        (f"mhc_mix T={t}", lambda: mhc_mix(_t(t, n, s.hidden, dtype=dtype), _t((2 + n) * n, n * s.hidden),
                                           _t((2 + n) * n), _t(3), s.sinkhorn, 1e-6, 1e-6, collapse=True,
                                           norm_weight=_t(s.hidden))),
        (f"mhc_expand T={t}", lambda: mhc_expand(_t(t, n, s.hidden, dtype=dtype), _t(t, s.hidden, dtype=dtype),
                                                 _t(t, n), _t(t, n, n))),
    ]


def _attention(s: V4Shape, dtype: torch.dtype, b: int, q: int, kv: str, context: int) -> list[Case]:
    """One layer of each kind (SWA, CSA, HCA) at ``context`` positions."""
    from kernels.triton.compressor_step import compressor_step
    from kernels.triton.indexer_topk import indexer_topk
    from kernels.triton.norm_rope import norm_rope
    from kernels.triton.sparse_mla_decode import sparse_mla_decode

    win_fmt, ent_fmt, idx_fmt = kv_formats(s, dtype)[kv]
    t, d, half = b * q, s.head_dim, s.rope // 2
    cos = lambda: _t(t, half)  # noqa: E731
    out = [
        ("norm_rope q_res", lambda: norm_rope(_cols(t, s.q_lora + d, 0, s.q_lora, dtype).unsqueeze(1), 1,
                                              _t(s.q_lora))),
        (f"norm_rope kv+{win_fmt} store", lambda: norm_rope(
            _cols(t, s.q_lora + d, s.q_lora, d, dtype).unsqueeze(1), 1, _t(d), 1e-6, cos(), cos(),
            pool=_pool(win_fmt, d, per_block=256), pool_fmt=win_fmt, slots=_t(t, dtype=I64))),
        ("norm_rope q heads", lambda: norm_rope(_t(t, s.heads, d, dtype=dtype), 2, None, 1e-6, cos(), cos())),
        ("norm_rope inverse", lambda: norm_rope(_t(t, s.heads, d), 0, None, 1e-6, cos(), cos(), inverse=True,
                                                dtype=dtype)),
    ]

    def attend(kind: str, entries: int, fmt: str | None, shared: bool) -> Case:
        entry_args = {} if fmt is None else dict(entry_pool=_pool(fmt, d), entry_fmt=fmt,
                                                 entry_slots=_t(b, q, entries, dtype=I32))
        return (f"sparse_mla {kind} {win_fmt}/{fmt or '-'} q={q}", lambda: sparse_mla_decode(
            _t(b, q, s.heads, d, dtype=dtype), _t(s.heads), _pool(win_fmt, d, per_block=256), win_fmt,
            _t(b, q, s.window - 1, dtype=I32), **entry_args, new_kv=_t(b, q, d, dtype=dtype), scale=d**-0.5,
            window_shared=True, entries_shared=shared))

    def compress(m: int, overlap: bool, dim: int, fmt: str) -> Case:
        width = (2 if overlap else 1) * dim
        span = (2 if overlap else 1) * m
        return (f"compressor_step m={m} d={dim} {fmt}", lambda: compressor_step(
            _cols(t, 4 * width, 0, 2 * width, dtype).view(b, q, 2 * width), _t(64, 256, 2 * width),
            _t(b, span - 1 + q, dtype=I32), _pool(fmt, dim), fmt, _t(b, q, dtype=I32), _t(dim), 1e-6,
            _t(b, q, half), _t(b, q, half), m, overlap, dtype, ape=_t(m, width), positions=_t(b, q, dtype=I32)))

    out.append(attend("swa", 0, None, False))
    if s.hca:
        out += [compress(s.hca, False, d, ent_fmt), attend("hca", context // s.hca, ent_fmt, True)]
    if s.csa:
        out += [compress(s.csa, True, d, ent_fmt), compress(s.csa, True, s.index_dim, idx_fmt)]
        entries = context // s.csa
        if s.topk >= entries:                    # every visible entry, one table per sequence
            out.append(attend("csa", entries, ent_fmt, True))
        else:
            iw = s.index_heads
            out += [("norm_rope index q", lambda: norm_rope(_t(t, iw, s.index_dim, dtype=dtype), 0, None, 0.0, cos(),
                                                            cos())),
                    (f"indexer_topk {idx_fmt} E={entries}", lambda: indexer_topk(
                        _t(b, q, iw, s.index_dim, dtype=dtype), _t(b, q, iw, dtype=dtype), _pool(idx_fmt, s.index_dim),
                        idx_fmt, _t(b, context // 64 + 1, dtype=I32), _t(b, dtype=I32), _t(b, q, dtype=I32),
                        s.csa, s.topk, max_entries=entries, weight_scale=iw**-0.5)),
                    attend("csa", s.topk, ent_fmt, False)]
    return out


def _codec(s: V4Shape) -> list[Case]:
    """kv_codec's own kernels (the tests' quantize / gather; the engine's CUDA path uses CuPy's)."""
    from kernels.triton.kv_codec import gather_dequantize, quantize_scatter

    out = []
    for fmt, dim in (("fp8_ds_mla", s.head_dim), ("fp4_kv", s.head_dim), ("fp4_index", s.index_dim)):
        if s.rope == 64:
            out += [(f"quantize_scatter {fmt} d={dim}", lambda fmt=fmt, dim=dim: quantize_scatter(
                        _t(64, dim), _pool(fmt, dim), _t(64, dtype=I64), fmt)),
                    (f"gather_dequantize {fmt} d={dim}", lambda fmt=fmt, dim=dim: gather_dequantize(
                        _pool(fmt, dim), _t(64, dtype=I64), fmt, dim))]
    return out


# ---- V4.1: the fast numerics' GEMMs -------------------------------------------------------------------

def _v41(geometry: str, t: int) -> list[Case]:
    from kernels.triton import quant_gemm as qg

    c = v41_text_config(geometry)
    hidden, inter, q_lora = c["hidden_size"], c["moe_intermediate_size"], c["q_lora_rank"]
    hd = c["num_attention_heads"] * c["head_dim"]

    def fp8(n: int, k: int) -> Case:
        return (f"v41 fp8 32x32 {n}x{k} M={t}", lambda: qg.fp8_linear(
            _t(t, k, dtype=BF16), _t(n, k, dtype=torch.float8_e4m3fn), _t(-(-n // 32), -(-k // 32),
                                                                          dtype=torch.float8_e8m0fnu),
            (32, 32), act_quant=True, out_dtype=BF16))

    def fp4(n: int, k: int) -> Case:
        return (f"v41 fp4 expert {n}x{k} M={t}", lambda: qg.fp4_linear(
            _t(t, k, dtype=BF16), _t(n, k // 2, dtype=torch.int8), _t(n, k // 32, dtype=torch.float8_e8m0fnu),
            act_quant=True, out_dtype=BF16))

    return [fp8(q_lora, hidden), fp8(hd, q_lora), fp4(2 * inter, hidden), fp4(hidden, inter)]


def cases(geometry: str, quick: bool = False) -> list[Case]:
    """Every launch family of ``geometry``; labels say geometry, compute dtype and step. ``quick``:
    one verify step (bf16, B = 16, q = 2, the most quantized KV, the long context), every kernel
    still launched (what the CI test compiles)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of {GEOMETRIES}")
    s = v4_shape(geometry)
    out: list[Case] = []
    for dtype in (BF16,) if quick else (BF16, F32):
        dname = "bf16" if dtype == BF16 else "fp32"
        kvs = list(kv_formats(s, dtype))
        for b, q in ((16, 2),) if quick else STEPS:
            t = b * q
            step = [*_gemms(s, dtype, t), *_dense_experts(s, dtype, t), *_moe_and_mhc(s, dtype, t)]
            for kv in kvs[-1:] if quick else kvs:
                for context in s.contexts[-1:] if quick else s.contexts:
                    step += [(f"kv={kv} ctx={context} {label}", thunk)
                             for label, thunk in _attention(s, dtype, b, q, kv, context)]
            out += [(f"{geometry} v4 {dname} B={b} q={q} {label}", thunk) for label, thunk in step]
    out += [(f"{geometry} v4 {label}", thunk) for label, thunk in _codec(s)]
    for b, q in ((16, 2),) if quick else STEPS:
        out += [(f"{geometry} {label}", thunk) for label, thunk in _v41(geometry, b * q)]
    return out

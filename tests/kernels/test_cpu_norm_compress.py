"""kernels/cpu_norm_compress.py (numba) against the torch references of norm_rope / compressor_step.

norm_rope must be bit-identical (its RMS sum follows torch's summation order); compressor_step's
state rows must be bit-identical; its entries differ only through the softmax's exp (a polynomial
here, torch's own vectorised approximation there): fp32 entries within a few fp32 ulps and bf16
entries within one bf16 ulp of their row's scale; quantized entries must be exactly the quantization of
the kernel's own candidates. Pools are compared after the call, on clones.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.cpu_norm_compress import _exp, _fp16_bits, compressor_step, norm_rope
from kernels.formats import get_format
from kernels.triton import kv_codec
from kernels.triton.compressor_step import compressor_step_reference
from kernels.triton.norm_rope import norm_rope_reference
from kernels.triton.sparse_mla_decode import read_records

BF16, F32 = torch.bfloat16, torch.float32


def _rope(t: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = (torch.arange(t, dtype=F32)[:, None] * 3 + 1) / 100.0 ** (torch.arange(half) / half)
    return freqs.cos(), freqs.sin()


def _pool(fmt: str, dim: int, slots: int = 16) -> torch.Tensor:
    if fmt in kv_codec.RAW_DTYPES:
        return torch.zeros(slots // 4, 4, dim, dtype=kv_codec.RAW_DTYPES[fmt])
    return torch.zeros(slots // 4, 4, get_format(fmt, dim).record_bytes, dtype=torch.uint8)


def _same_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (torch's vector and scalar paths spell NaN
    differently, so its bits are not compared)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ---- norm_rope ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("norm", [0, 1, 2])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("t,h,d,half", [(1, 1, 512, 32), (3, 4, 64, 8), (2, 3, 16, 4), (1, 2, 1024, 32)])
def test_norm_rope_is_bit_identical(dtype, norm, inverse, t, h, d, half):
    g = torch.Generator().manual_seed(d + h)
    x = (3 * torch.randn(t, h, d, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if norm == 1 else None
    cos, sin = _rope(t, half)
    got = norm_rope(x, norm, w, 1e-6, cos, sin, inverse=inverse)
    assert got.dtype == dtype and torch.equal(got, norm_rope_reference(x, norm, w, 1e-6, cos, sin, inverse=inverse))


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_norm_rope_without_rope_and_zero_tokens(norm):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 128, generator=g).to(BF16)
    w = 1 + 0.1 * torch.randn(128, generator=g) if norm == 1 else None
    assert torch.equal(norm_rope(x, norm, w, 0.0), norm_rope_reference(x, norm, w, 0.0))
    assert norm_rope(x[:0], norm, w).shape == (0, 2, 128)


@pytest.mark.parametrize("pre_round", [False, True])
def test_norm_rope_rounds_a_wider_fp32_slice(pre_round):
    """x a column slice of an fp32 GEMM output, bf16 result (the attention output's inverse rope)."""
    g = torch.Generator().manual_seed(2)
    wide = 5 * torch.randn(3, 2 * 64 + 40, generator=g)
    x = wide[:, 40:].view(3, 2, 64)
    cos, sin = _rope(3, 16)
    for dtype in (BF16, None):
        got = norm_rope(x, 2, None, 1e-6, cos, sin, inverse=True, dtype=dtype, pre_round=pre_round)
        want = norm_rope_reference(x, 2, None, 1e-6, cos, sin, inverse=True, dtype=dtype, pre_round=pre_round)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("fmt,dim", [("fp32", 64), ("bf16", 64), ("fp16", 64), ("fp8_ds_mla", 128), ("fp4_kv", 64)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_norm_rope_pool_write_matches_reference(fmt, dim, dtype):
    g = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(4, 1, dim, generator=g)).to(dtype)
    w = 1 + 0.1 * torch.randn(dim, generator=g)
    cos, sin = _rope(4, 32 if fmt == "fp8_ds_mla" else 8)
    slots = torch.tensor([5, -1, 2, 9])
    pool = _pool(fmt, dim)
    pool.view(torch.uint8).view(-1)[:] = torch.randint(0, 255, (pool.view(torch.uint8).numel(),), generator=g,
                                                       dtype=torch.uint8)
    ref_pool = pool.clone()
    out = norm_rope(x, 1, w, 1e-6, cos, sin, pool=pool, pool_fmt=fmt, slots=slots)
    want = norm_rope_reference(x, 1, w, 1e-6, cos, sin, pool=ref_pool, pool_fmt=fmt, slots=slots)
    assert torch.equal(out, want)
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))        # slot -1 wrote nothing


def test_norm_rope_nan_stays_in_its_vector():
    x = torch.randn(3, 2, 64).to(BF16)
    x[1, 0, 3] = float("nan")
    cos, sin = _rope(3, 8)
    pool, ref_pool = _pool("bf16", 64), _pool("bf16", 64)
    got = norm_rope(x[:, :1], 1, torch.ones(64), 1e-6, cos, sin, pool=pool, pool_fmt="bf16", slots=torch.arange(3))
    want = norm_rope_reference(x[:, :1], 1, torch.ones(64), 1e-6, cos, sin, pool=ref_pool, pool_fmt="bf16",
                               slots=torch.arange(3))
    assert got[1].isnan().all() and _same_nan(got, want) and _same_nan(pool, ref_pool)
    out = norm_rope(x, 2, None, 1e-6, cos, sin)
    assert out[1, 0].isnan().all() and not out[1, 1].isnan().any() and not out[[0, 2]].isnan().any()
    assert _same_nan(out, norm_rope_reference(x, 2, None, 1e-6, cos, sin))


def test_norm_rope_rejects_a_slot_outside_the_pool():
    pool = _pool("bf16", 64)
    with pytest.raises(IndexError):
        norm_rope(torch.randn(1, 1, 64), 0, pool=pool, pool_fmt="bf16", slots=torch.tensor([16]))
    assert not pool.any()


# ---- numeric helpers ---------------------------------------------------------------------------

def test_exp_is_within_two_ulps():
    x = np.concatenate([np.linspace(-104, 88.7, 200001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30], dtype=np.float32)])
    got = np.array([_exp(v) for v in x], dtype=np.float32)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2 * ulp)
    assert _exp(np.float32(-np.inf)) == 0 and np.isinf(_exp(np.float32(89.0))) and np.isnan(_exp(np.float32(np.nan)))


def test_fp16_bits_match_torch():
    g = torch.Generator().manual_seed(4)
    v = torch.cat([torch.randn(20000, generator=g) * 10.0 ** torch.randint(-9, 6, (20000,), generator=g),
                   torch.tensor([65504.0, 65519.0, 65520.0, 1e9, -1e9, float("inf"), -float("inf"), 0.0, -0.0,
                                 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25])])
    got = torch.tensor([int(_fp16_bits(np.float32(e))) for e in v.numpy()], dtype=torch.int32)
    assert torch.equal(got.to(torch.int16), v.half().view(torch.int16))
    assert _fp16_bits(np.float32(np.nan)) & 0x7FFF > 0x7C00


# ---- compressor_step ---------------------------------------------------------------------------

def _compressor_case(overlap: bool, ratio: int, entry_fmt: str, starts: list[int], q: int, dtype: torch.dtype,
                     ape: bool, dim: int = 64, rope: int = 16, seed: int = 0) -> dict:
    """One sequence per start; history rows before position 0 have slot -1, the entry slot of a
    token that completes nothing is -1; a last padding sequence reads and writes nothing."""
    g = torch.Generator().manual_seed(seed)
    b = len(starts) + 1
    width, span = (2 if overlap else 1) * dim, (2 if overlap else 1) * ratio
    per_block = 8
    blocks = b * (span - 1 + q) // per_block + 2
    start = torch.tensor(starts + [0])
    pos = start[:, None] - (span - 1) + torch.arange(span - 1 + q)                       # [B, span-1+q]
    row_slots = torch.randperm(blocks * per_block, generator=g)[: b * pos.shape[1]].view(b, -1)
    row_slots = torch.where(pos >= 0, row_slots, -1)
    row_slots[-1] = -1
    positions = start[:, None] + torch.arange(q)                                          # [B, q]
    completes = (positions + 1) % ratio == 0
    completes[-1] = False
    entry_slots = torch.where(completes, 1 + torch.arange(b * q).view(b, q), -1)
    freqs = ((positions // ratio) * ratio)[..., None].float() / 100.0 ** (torch.arange(rope // 2) / (rope // 2))
    rows = torch.randn(b, q, 2 * width, generator=g)
    extra = {}
    if ape:                                  # raw projections in the compute dtype, a column slice
        wide = torch.randn(b, q, 2 * width + 8, generator=g).to(dtype)
        rows = wide[..., 8:]
        extra = dict(ape=torch.randn(ratio, width, generator=g), positions=positions)
    return dict(rows=rows, state_pool=torch.randn(blocks, per_block, 2 * width, generator=g), row_slots=row_slots,
                entry_pool=_pool(entry_fmt, dim, 4 * (b * q // 4 + 2)), entry_fmt=entry_fmt, entry_slots=entry_slots,
                norm_weight=1 + 0.1 * torch.randn(dim, generator=g), eps=1e-6, cos=freqs.cos(), sin=freqs.sin(),
                ratio=ratio, overlap=overlap, dtype=dtype, **extra)


def _run(fn, case: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    case = dict(case, **kw)
    case["state_pool"], case["entry_pool"] = case["state_pool"].clone(), case["entry_pool"].clone()
    fn(**case)
    return case["state_pool"], case["entry_pool"]


def _within_ulp(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Each entry row within one bf16 ulp (bf16) or 8 fp32 ulps (fp32) of its largest value, NaN
    alike: the rotation mixes two normed values, so a flip in one moves a small result by the
    ulp of its partner, not its own."""
    a, b = a.float().flatten(0, -2), b.float().flatten(0, -2)                         # [slots, D]
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    scale = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True)
    ulp = torch.where(scale > 0, 2.0 ** (torch.floor(torch.log2(scale)) - (7 if dtype == BF16 else 20)), 0.0)
    return bool(((a - b).abs() <= ulp).all())


def _starts(ratio: int, q: int, b: int) -> list[int]:
    """Sequence start, exactly completing an entry, mid-window, one over a completed entry."""
    return [0, 2 * ratio - q, ratio + ratio // 2, ratio][:b]


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 4), (False, 128), (True, 1)])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("q,b", [(1, 1), (2, 3), (3, 3)])
@pytest.mark.parametrize("ape", [False, True])
def test_compressor_step_matches_reference(overlap, ratio, dtype, q, b, ape):
    starts = _starts(ratio, q, b) if b > 1 else [2 * ratio - q]
    for fmt in ("fp32", "bf16"):
        case = _compressor_case(overlap, ratio, fmt, starts, q, dtype, ape, seed=q + b)
        state, entries = _run(compressor_step, case)
        ref_state, ref_entries = _run(compressor_step_reference, case)
        assert torch.equal(state, ref_state)                                  # rows appended bit for bit
        assert _within_ulp(entries, ref_entries, dtype if fmt == "fp32" else BF16)
        written = case["entry_slots"][case["entry_slots"] >= 0]
        assert written.numel() >= 1 and entries.view(-1, entries.shape[-1])[written].abs().sum() > 0
        assert not entries.view(-1, entries.shape[-1])[0].any()              # no token wrote slot 0


@pytest.mark.parametrize("entry_fmt", ["fp8_ds_mla", "fp4_kv", "fp4_index"])
@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 128)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_compressor_step_quantizes_its_candidates(entry_fmt, overlap, ratio, dtype):
    """A quantized entry is exactly reference.quantize of the kernel's own candidate (the fp32-pool
    run), and dequantizes close to the reference's entry."""
    dim, rope = (128, 64) if entry_fmt == "fp8_ds_mla" else (64, 16)
    starts, q = _starts(ratio, 2, 3), 2
    raw_case = _compressor_case(overlap, ratio, "fp32", starts, q, dtype, True, dim, rope)
    case = _compressor_case(overlap, ratio, entry_fmt, starts, q, dtype, True, dim, rope)
    state, records = _run(compressor_step, case)
    _, candidates = _run(compressor_step, raw_case)
    written = case["entry_slots"][case["entry_slots"] >= 0]
    expected = torch.zeros_like(records)
    reference.quantize_scatter(candidates.view(-1, dim)[written], expected, written, entry_fmt)
    assert written.numel() >= 1 and torch.equal(records, expected)
    ref_state, ref_records = _run(compressor_step_reference, case)
    assert torch.equal(state, ref_state)
    got, want = (read_records(r, entry_fmt, written, dim) for r in (records, ref_records))
    assert torch.allclose(got, want, rtol=0.3, atol=0.3 * want.abs().max().item())


def test_compressor_step_nan_history_poisons_only_its_sequence():
    case = _compressor_case(True, 4, "fp32", [2, 6], 2, BF16, True)
    clean = _run(compressor_step, case)[1]
    case["state_pool"].view(-1, case["state_pool"].shape[-1])[case["row_slots"][1, 1]] = float("nan")    # position 0
    entries = _run(compressor_step, case)[1]
    ref = _run(compressor_step_reference, case)[1]
    assert _within_ulp(entries, ref, BF16)
    seq1, seq0 = (case["entry_slots"][i][case["entry_slots"][i] >= 0] for i in (1, 0))
    flat = entries.view(-1, 64)
    assert flat[seq1].isnan().all() and torch.equal(flat[seq0], clean.view(-1, 64)[seq0])


def test_compressor_step_rejects_a_slot_outside_the_state_pool():
    case = _compressor_case(False, 4, "fp32", [3], 1, F32, False)
    case["row_slots"][0, -1] = case["state_pool"].shape[0] * case["state_pool"].shape[1]
    state = case["state_pool"].clone()
    with pytest.raises(IndexError):
        compressor_step(**case)
    assert torch.equal(state, case["state_pool"])

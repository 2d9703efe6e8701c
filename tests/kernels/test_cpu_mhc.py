"""kernels/cpu_mhc.py (numba mHC mix / expand) against the torch references they replace on CPU.

pre / post / comb differ from the reference only through the projection's summation order (and
numba's exp vs torch's): a few fp32 ulps, checked at rtol 1e-5. Given the same pre, the collapse
and its RMSNorm are bit-exact (torch's sum order is reproduced), so the collapsed x is checked
against the reference ops applied to our own pre, and against the reference end to end in bf16
ulps. Expand is checked bit for bit (fp32 at D < 256: one fp32 ulp, see the test).
"""
from __future__ import annotations

import pytest
import torch

from engine.v4.layers import hc_collapse, rms_norm
from kernels.cpu_mhc import mhc_expand, mhc_mix
from kernels.triton.mhc_expand import mhc_expand_reference
from kernels.triton.mhc_mix import mhc_mix_reference


def _case(t: int, dtype: torch.dtype, n: int = 4, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, d, generator=g).to(dtype), torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5,
            0.5 * torch.randn((2 + n) * n, generator=g), 1 + 0.2 * torch.randn(3, generator=g))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two bf16 tensors (same signs assumed)."""
    if a.numel() == 0:
        return 0
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d", [(4, 8), (4, 256), (2, 24)])
@pytest.mark.parametrize("iters", [1, 20])
def test_mix_matches_reference(t, dtype, n, d, iters):
    streams, fn, base, scale = _case(t, dtype, n, d)
    norm = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1))
    args = (streams, fn, base, scale, iters, 1e-6, 1e-6)
    plain = mhc_mix(*args)
    ref = mhc_mix_reference(*args)
    assert len(plain) == 3 and all(_close(a, b) for a, b in zip(plain, ref))
    pre, post, comb, x = mhc_mix(*args, collapse=True)
    assert all(torch.equal(a, b) for a, b in zip((pre, post, comb), plain))
    normed = mhc_mix(*args, collapse=True, norm_weight=norm, out_eps=1e-5)[3]
    assert x.dtype == normed.dtype == dtype and x.shape == (t, d)
    # bit-exact given our pre: the collapse, then the block's RMSNorm of it
    assert torch.equal(x, hc_collapse(streams, pre))
    assert torch.equal(normed, rms_norm(x, norm, 1e-5))
    # end to end against the reference (its pre differs by ulps)
    want = mhc_mix_reference(*args, collapse=True, norm_weight=norm, out_eps=1e-5)[3]
    if dtype == torch.bfloat16:
        assert _ulps(normed, want) <= 1
    else:
        scale_rms = want.pow(2).mean(-1, keepdim=True).sqrt() if t else 1.0
        assert torch.allclose(normed, want, rtol=0, atol=1e-5 * float(scale_rms.max()) if t else 0)


def test_mix_is_batch_invariant_and_keeps_nan_in_its_token():
    streams, fn, base, scale = _case(5, torch.bfloat16, 4, 256)
    norm = torch.ones(256)
    args = (fn, base, scale, 20, 1e-6, 1e-6)
    clean = mhc_mix(streams, *args, collapse=True, norm_weight=norm)
    for i in range(5):  # one token alone gives the same bits as in the batch
        alone = mhc_mix(streams[i:i + 1], *args, collapse=True, norm_weight=norm)
        assert all(torch.equal(a, b[i:i + 1]) for a, b in zip(alone, clean))
    streams[2, 1, 7] = float("nan")
    out = mhc_mix(streams, *args, collapse=True, norm_weight=norm)
    ref = mhc_mix_reference(streams, *args, collapse=True, norm_weight=norm)
    others = torch.arange(5) != 2
    for got, want, before in zip(out, ref, clean):
        assert got[2].isnan().all() and want[2].isnan().all()
        assert torch.equal(got[others], before[others])


def test_mix_rejects_bad_shapes():
    streams, fn, base, scale = _case(1, torch.float32)
    with pytest.raises(ValueError):
        mhc_mix(streams, fn[:-1], base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError):
        mhc_mix(streams, fn, base, scale, 0, 1e-6, 1e-6)
    with pytest.raises(ValueError):
        mhc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6, norm_weight=torch.ones(64))


@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d", [(4, 8), (4, 256), (2, 24)])
def test_expand_matches_reference_bit_for_bit(t, dtype, n, d):
    g = torch.Generator().manual_seed(2)
    streams = (torch.randn(t, n, d, generator=g) * torch.logspace(-3, 3, d)).to(dtype)  # wide range: rounding shows
    y = torch.randn(t, d, generator=g).to(dtype)
    post = 2 * torch.sigmoid(torch.randn(t, n, generator=g))
    comb = torch.softmax(3 * torch.randn(t, n, n, generator=g), -1)
    got = mhc_expand(streams, y, post, comb)
    want = mhc_expand_reference(streams, y, post, comb)
    assert got.dtype == dtype
    if dtype == torch.bfloat16 or d >= 256:
        assert torch.equal(got, want)
    else:  # torch's fp32 matmul at tiny D is not MKL's FMA chain: the mix may differ by an fp32 ulp of its largest term
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(streams.abs().max()) if t else 0.0)


def test_expand_nan_stays_in_its_token():
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(3, 4, 16, generator=g).bfloat16()
    y = torch.randn(3, 16, generator=g).bfloat16()
    post, comb = torch.rand(3, 4, generator=g), torch.rand(3, 4, 4, generator=g)
    y[1, 3] = float("nan")
    got, want = mhc_expand(streams, y, post, comb), mhc_expand_reference(streams, y, post, comb)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, :, 3].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and not got[[0, 2]].isnan().any()

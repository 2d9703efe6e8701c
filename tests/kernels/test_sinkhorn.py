"""kernels/sinkhorn.py: the numba Sinkhorn against the torch loop it replaces on CPU."""

from __future__ import annotations

import pytest
import torch

from kernels.sinkhorn import sinkhorn, sinkhorn_reference


def _combs(t: int, n: int, seed: int = 0) -> torch.Tensor:
    """Row-softmaxed logits of widely varying scale plus eps, as the mHC sites feed Sinkhorn."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, n, n, generator=g) * torch.logspace(-2, 1.5, t)[:, None, None]
    return torch.softmax(logits, dim=-1) + 1e-6


@pytest.mark.parametrize("t", [0, 1, 7, 64])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_bit_identical_to_the_torch_loop_for_the_models_widths(t, n, iters):
    comb = _combs(t, n)
    before = comb.clone()
    got = sinkhorn(comb, iters, 1e-6)
    assert torch.equal(got, sinkhorn_reference(comb, iters, 1e-6))
    assert torch.equal(comb, before)  # the input is not written


def test_wider_matrices_agree_to_fp32_rounding():
    comb = _combs(33, 16)
    assert torch.allclose(sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6), rtol=1e-5, atol=1e-7)


def test_nan_and_inf_stay_in_their_token():
    comb = _combs(4, 4)
    comb[1, 2, 3] = float("nan")
    comb[2, 0, 0] = float("inf")
    got, want = sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6)
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got[[0, 3]], want[[0, 3]]) and torch.isfinite(got[[0, 3]]).all()


def test_autograd_and_other_dtypes_take_the_torch_loop():
    comb = _combs(3, 4).requires_grad_()
    out = sinkhorn(comb, 5, 1e-6)
    out.sum().backward()  # differentiable: the torch loop
    assert comb.grad is not None and torch.isfinite(comb.grad).all()
    half = _combs(3, 4).double()
    assert sinkhorn(half, 5, 1e-6).dtype == torch.float64
    with torch.inference_mode():  # inference tensors go through numba too
        assert torch.equal(sinkhorn(_combs(5, 4), 20, 1e-6), sinkhorn_reference(_combs(5, 4), 20, 1e-6))
    with pytest.raises(ValueError, match="at least one iteration"):
        sinkhorn(_combs(1, 4), 0, 1e-6)


def test_torch_loop_context_runs_the_loop_on_cpu(monkeypatch):
    """What the launch-counting benchmarks use to see a GPU's path: no numba call inside."""
    from kernels import sinkhorn as module

    def refuse(*args):
        raise AssertionError("the numba kernel ran inside torch_loop()")

    monkeypatch.setattr(module, "_sinkhorn_kernel", refuse)
    comb = _combs(3, 4)
    with module.torch_loop():
        assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6))
    with pytest.raises(AssertionError, match="numba kernel ran"):
        sinkhorn(comb, 20, 1e-6)

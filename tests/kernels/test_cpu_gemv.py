"""kernels.dense_linear on CPU: the fp32 row kernel (kernels/cpu_gemv.py) for decode-sized
products against a float64 product, NaN and Inf propagation, the rows it hands to torch, and
the engine's dense projections and LM head going through it."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_gemv


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 summation error bound of x @ w^T: K · eps · sum |x| |w| (any summation order)."""
    return x.shape[-1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T).float() + 1e-30


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(1, 1), (7, 33), (257, 256), (1000, 96)])
def test_row_kernel_matches_a_float64_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    assert cpu_gemv.takes(x, w)
    out = kernels.dense_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert ((out - _exact(x, w)).abs() <= _bound(x, w)).all()


def test_leading_dims_and_rows_past_the_threshold():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(2, 2, 24, generator=g)                      # [..., K]: 4 rows
    out = kernels.dense_linear(x, w)
    assert out.shape == (2, 2, 40)
    assert ((out - _exact(x, w)).abs() <= _bound(x, w)).all()
    many = torch.randn(cpu_gemv.DENSE_GEMV_MAX_ROWS + 1, 24, generator=g)
    assert not cpu_gemv.takes(many, w)                          # sgemm's rows: torch's exact result
    assert torch.equal(kernels.dense_linear(many, w), torch.nn.functional.linear(many, w))


def test_what_goes_to_torch():
    w = torch.randn(8, 16)
    assert not cpu_gemv.takes(torch.randn(0, 16), w)                       # no rows
    assert not cpu_gemv.takes(torch.randn(1, 16, dtype=torch.bfloat16), w.bfloat16())
    assert not cpu_gemv.takes(torch.randn(1, 16), torch.randn(16, 8).T)   # a transposed view
    assert kernels.dense_linear(torch.randn(0, 16), w).shape == (0, 8)
    t = torch.randn(16, 8)
    x = torch.randn(1, 16)
    assert torch.equal(kernels.dense_linear(x, t.T), torch.nn.functional.linear(x, t.T))
    with pytest.raises(ValueError, match="features"):
        cpu_gemv.dense_linear(torch.randn(1, 15), w)


def test_nan_and_inf_propagate():
    w = torch.randn(6, 32)
    w[1, 3] = float("nan")
    w[2, 0] = float("inf")
    x = torch.randn(2, 32).abs() + 0.1
    x[1, 7] = float("nan")
    out = kernels.dense_linear(x, w)
    assert torch.isnan(out[0, 1]) and torch.isinf(out[0, 2])
    assert torch.isnan(out[1]).all()                                 # a NaN activation poisons its row
    assert torch.isfinite(out[0, [0, 3, 4, 5]]).all()


def test_autograd_keeps_torch():
    """Training (train/) differentiates through dense projections: with grad enabled and a
    weight that requires it the product stays torch's; under no_grad the row kernel runs."""
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(1, 16)
    assert not cpu_gemv.takes(x, w)
    kernels.dense_linear(x, w).sum().backward()
    assert w.grad is not None and torch.allclose(w.grad, x.expand(8, 16))
    with torch.no_grad():
        assert cpu_gemv.takes(x, w)
        assert ((kernels.dense_linear(x, w) - _exact(x, w)).abs() <= _bound(x, w)).all()


def test_a_dense_linear_takes_the_row_kernel(monkeypatch):
    """engine.linear.Linear with a dense weight (the packed compressor / indexer projections, and
    the LM head through the same op) runs the row kernel at decode sizes."""
    from engine.linear import Linear
    calls = []
    real = cpu_gemv._gemv

    def counting(w, a, out, per):
        calls.append(tuple(w.shape))
        return real(w, a, out, per)
    monkeypatch.setattr(cpu_gemv, "_gemv", counting)
    lin = Linear(24, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 24))
    x = torch.randn(1, 24)
    assert ((lin(x) - _exact(x, lin.weight)).abs() <= _bound(x, lin.weight)).all()
    assert calls == [(40, 24)]


def test_allow_bf16_false_keeps_torchs_products_exact(monkeypatch):
    """The router asks for exact products: past the row kernel's rows they stay fp32 even where
    kernels/cpu_precision.py allows bf16 operands."""
    from kernels import cpu_precision
    monkeypatch.setattr(cpu_precision, "BF16_MIN_MACS", 0)
    seen = []
    real = torch.nn.functional.linear

    def spying(x, w):
        seen.append(torch.get_float32_matmul_precision())
        return real(x, w)
    monkeypatch.setattr(cpu_gemv.F, "linear", spying)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with cpu_precision.matmul_precision("bf16"):
        kernels.dense_linear(x, w, allow_bf16=False)
        kernels.dense_linear(x, w)
    assert seen == ["highest", "medium"]


# ---- the bf16-bits row kernel (the compiled step's dense weights that are bf16-exact) ------------

@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(5, 7), (130, 256), (64, 1000)])
def test_bf16_row_kernel_equals_the_fp32_row_kernel_bit_for_bit(m, n, k):
    """A bf16 checkpoint's weight loaded in fp32 holds only bf16 values: the kernel reading its
    bf16 bits (half the bytes) must give the fp32 kernel's sums exactly, in one task and split
    over parallel tasks, and stay within the fp32 bound of a float64 product."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    x = torch.randn(m, k, generator=g)
    half = cpu_gemv.bf16_copy(w)
    assert half is not None and half.dtype == torch.uint16 and half.shape == w.shape
    want = torch.empty(m, n)
    cpu_gemv._dot_rows(w.numpy(), x.numpy(), 0, n, want.numpy())
    for per in (0, 16):
        got = torch.full((m, n), float("nan"))
        if per:
            cpu_gemv._gemv(half.numpy(), x.numpy(), got.numpy(), per)
        else:
            cpu_gemv._dot_rows(half.numpy(), x.numpy(), 0, n, got.numpy())
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert ((want - _exact(x, w)).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("n, k", [(37, 1024), (300, 96), (9, 4100)])
def test_a_rows_sum_depends_on_neither_the_row_count_nor_the_tiles(bf16, n, k):
    """Batch invariance of the row kernel: activation row i's outputs from a call with 2, 3, 7 or 16
    rows (in four-, two- and one-row passes) equal those of a call with row i alone, bit for
    bit, over weight tiles of one row (k = 4100), a few rows (1024) and whole tasks (96)."""
    g = torch.Generator().manual_seed(n + k + bf16)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    weight = cpu_gemv.bf16_copy(w).numpy() if bf16 else w.numpy()
    x = torch.randn(16, k, generator=g)
    alone = torch.empty(16, n)
    for i in range(16):
        cpu_gemv._dot_rows(weight, x[i:i + 1].numpy(), 0, n, alone[i:i + 1].numpy())
    for m in (2, 3, 7, 16):
        for per in (0, 8):
            got = torch.full((m, n), float("nan"))
            if per:
                cpu_gemv._gemv(weight, x[:m].numpy(), got.numpy(), per)
            else:
                cpu_gemv._dot_rows(weight, x[:m].numpy(), 0, n, got.numpy())
            assert torch.equal(got.view(torch.int32), alone[:m].view(torch.int32)), (m, per)


def test_bf16_copy_only_of_bf16_exact_weights():
    w = torch.randn(4, 8).bfloat16().float()
    assert torch.equal(cpu_gemv.bf16_copy(w).view(torch.bfloat16).float(), w)
    w[2, 3] = 1 + 2.0**-20                                           # one value off the bf16 grid
    assert cpu_gemv.bf16_copy(w) is None
    special = torch.tensor([[float("inf"), float("-inf"), 0.0, -0.0]])
    assert torch.equal(cpu_gemv.bf16_copy(special).view(torch.bfloat16).float().view(torch.int32),
                       special.view(torch.int32))

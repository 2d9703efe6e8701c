"""Prepared CPU quantized weights (kernels/cpu_prepared_gemm.py) against the generic entry points
(bit for bit: the same kernels) and the torch references (within the GEMM rounding bound)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_quant_gemm, reference
from _quant_inputs import abs_gemm, activations, assert_gemm_close, quant_weight
from engine.linear import GroupedLinear, GroupedWeight, Linear, WeightFormat


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def generic_linear(kind, x, w, s, block):
    if kind == "fp8":
        return kernels.fp8_linear(x, w, s, block, out_dtype=torch.float32)
    return kernels.fp4_linear(x, w, s, out_dtype=torch.float32, group=block[1])


def generic_grouped(kind, x, w, s, block, ends):
    if kind == "fp8":
        return kernels.fp8_grouped_mm(x, w, s, ends, block, out_dtype=torch.float32)
    return kernels.fp4_grouped_mm(x, w, s, ends, out_dtype=torch.float32, group=block[1])


def max_rows(kind: str) -> int:
    return cpu_quant_gemm.GEMV_MAX_ROWS if kind == "fp8" else cpu_quant_gemm.FP4_GEMV_MAX_ROWS


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("k", [64, 96, 320])
def test_prepared_linear_is_the_generic_product(kind, k):
    """Row counts 1 .. the fused limit and one past it (the tiled path), K with a partial scale
    block: equal to the generic entry point bit for bit, and to the reference within bound."""
    g = gen(k)
    w, s, block, wd = quant_weight(kind, (72, k), g)
    prepared = kernels.prepare_quant_weight(w, s, kind, block)
    for m in sorted({1, 2, 3, max_rows(kind), max_rows(kind) + 1}):
        x = activations(m, k, g)
        assert prepared.takes(x)
        out = prepared.linear(x)
        assert same_bits(out, generic_linear(kind, x, w, s, block)), f"{m} rows"
        assert_gemm_close(out, x @ wd.T, abs_gemm(x, wd, False), k)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_prepared_grouped_is_the_generic_product(kind):
    """Experts with no rows, one row, the fused limit, and more (the tiled path for that expert
    alone), and slots past the last end (zero): the generic entry point's result bit for bit."""
    g = gen(3)
    e, n, k = 5, 32, 64
    w, s, block, wd = quant_weight(kind, (e, n, k), g)
    big = max_rows(kind)
    counts = [0, 1, big, big + 3, 2]
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = int(ends[-1]) + 2                                    # two slots past the last expert
    x = activations(rows, k, g)
    prepared = kernels.prepare_quant_weight(w, s, kind, block)
    out = prepared.grouped(x, ends)
    assert same_bits(out, generic_grouped(kind, x, w, s, block, ends))
    ref = reference._grouped(x, wd, ends)
    assert_gemm_close(out, ref, abs_gemm(x, wd, False, ends), k)
    assert torch.equal(out[int(ends[-1]):], torch.zeros(2, n))
    assert prepared.grouped(x[:0], torch.zeros(e, dtype=torch.int32)).shape == (0, n)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_prepared_grouped_rejects_bad_ends(kind):
    w, s, block, _ = quant_weight(kind, (3, 16, 64), gen(4))
    prepared = kernels.prepare_quant_weight(w, s, kind, block)
    x = activations(4, 64, gen(5))
    for bad in ([2, 1, 4], [1, 2, 5], [-1, 2, 4]):              # decreasing, past the rows, negative
        with pytest.raises(ValueError, match="non-decreasing"):
            prepared.grouped(x, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        prepared.grouped(x, torch.tensor([1, 4], dtype=torch.int32))


def test_prepare_checks_the_weight_once():
    w, s, block, _ = quant_weight("fp8", (32, 64), gen(6))
    with pytest.raises(ValueError, match="scale must have shape"):
        kernels.prepare_quant_weight(w, s[:1], "fp8", block)
    with pytest.raises(ValueError, match="kind"):
        kernels.prepare_quant_weight(w, s, "int4", block)


def test_takes_only_contiguous_fp32_cpu_rows_of_its_width():
    w, s, block, _ = quant_weight("fp4", (16, 64), gen(7))
    prepared = kernels.prepare_quant_weight(w, s, "fp4", block)
    x = activations(2, 64, gen(8))
    assert prepared.takes(x)
    assert not prepared.takes(x.bfloat16())
    assert not prepared.takes(activations(2, 128, gen(8))[:, ::2])       # strided
    assert not prepared.takes(activations(2, 32, gen(8)))                # another K
    assert not prepared.takes(x.unsqueeze(0))
    assert not prepared.takes(x.clone().requires_grad_())
    with torch.no_grad():
        assert prepared.takes(x.clone().requires_grad_())


# ---- the engine's weight containers ------------------------------------------------------------

def _quantized_linear(kind: str, n: int, k: int, g: torch.Generator) -> tuple[Linear, torch.Tensor]:
    lin = Linear(k, n)
    lin.set_format(WeightFormat.fp8((16, 32)) if kind == "fp8" else WeightFormat.fp4(32))
    w, s, _, wd = quant_weight(kind, (n, k), g)
    with torch.no_grad():
        lin.weight.copy_(w.view(lin.weight.dtype))
        lin.scale.copy_(s)
    return lin, wd


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_linear_follows_its_storage(kind):
    """A Linear's prepared weight sees in-place updates (its numpy views alias the storage) and is
    rebuilt when the storage is replaced; the generic path's results throughout."""
    g = gen(9)
    lin, _ = _quantized_linear(kind, 48, 64, g)
    x = activations(2, 64, g)
    first = lin(x)
    assert same_bits(first, generic_linear(kind, x, lin.weight, lin.scale, lin.fmt.block))
    prepared = lin.cpu_prepared(lin.weight, lin.scale)
    w, s, _, _ = quant_weight(kind, (48, 64), g)
    with torch.no_grad():
        lin.weight.copy_(w.view(lin.weight.dtype))             # in place: same storage
    assert lin.cpu_prepared(lin.weight, lin.scale) is prepared
    assert same_bits(lin(x), generic_linear(kind, x, lin.weight, lin.scale, lin.fmt.block))
    lin.weight = torch.nn.Parameter(lin.weight.clone(), requires_grad=False)   # replaced
    assert lin.cpu_prepared(lin.weight, lin.scale) is not prepared
    assert same_bits(lin(x), generic_linear(kind, x, lin.weight, lin.scale, lin.fmt.block))
    assert "_cpu_prepared" not in lin.state_dict()


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_grouped_containers_match_the_generic_products(kind):
    """wo_a's GroupedLinear (one 'expert' per group) and a routed-expert GroupedWeight, at a
    decode-sized and a prefill-sized row count."""
    g = gen(10)
    groups, o, i = 4, 32, 64
    wo_a = GroupedLinear(groups, i, o)
    fmt = WeightFormat.fp8((16, 32)) if kind == "fp8" else WeightFormat.fp4(32)
    wo_a.set_format(fmt)
    w, s, _, wd = quant_weight(kind, (groups * o, i), g)
    with torch.no_grad():
        wo_a.weight.copy_(w.view(wo_a.weight.dtype))
        wo_a.scale.copy_(s)
    for t in (1, max_rows(kind) + 1):
        x = activations(t * groups, i, g).view(t, groups, i)
        want = torch.einsum("tgi,goi->tgo", x, wd.view(groups, o, i))
        got = wo_a(x)
        rows = x.transpose(0, 1).reshape(groups * t, i)
        ends = torch.arange(1, groups + 1, dtype=torch.int32) * t
        generic = generic_grouped(kind, rows, wo_a.weight.view(groups, o, -1),
                                  wo_a.scale.view(groups, -1, wo_a.scale.shape[-1]), fmt.block, ends)
        assert same_bits(got.transpose(0, 1).reshape(groups * t, o), generic)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    experts = GroupedWeight(3, i, o)
    experts.set_format(fmt)
    w, s, _, _ = quant_weight(kind, (3, o, i), g)
    with torch.no_grad():
        experts.weight.copy_(w.view(experts.weight.dtype))
        experts.scale.copy_(s)
    x = activations(7, i, g)
    ends = torch.tensor([2, 2, 7], dtype=torch.int32)
    assert same_bits(experts.grouped_mm(x, ends), generic_grouped(kind, x, experts.weight, experts.scale,
                                                                  fmt.block, ends))


def test_replacing_the_storage_releases_the_preparation():
    """The prepared views keep the storage they view alive: assigning a new weight or scale must
    drop them (packing replaces a member's weight by a view of the packed one)."""
    import gc
    import weakref

    lin, _ = _quantized_linear("fp8", 32, 64, gen(11))
    lin(activations(1, 64, gen(12)))
    old = weakref.ref(lin.weight)
    assert lin.__dict__.get("_cpu_prepared") is not None
    lin.weight = torch.nn.Parameter(lin.weight.clone(), requires_grad=False)
    assert "_cpu_prepared" not in lin.__dict__
    gc.collect()
    assert old() is None

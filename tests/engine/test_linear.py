"""engine/linear.py: every container computes what its dense twin computes on the weight that
the kernel reference decodes from its codes; expert subsets; zero-token MoE batches."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import quantize_fp4_rows, quantize_fp8_blocks
from engine.linear import GroupedLinear, Linear, RoutedExperts, WeightFormat
from engine.v4.checkpoint import preset_config
from engine.v4.layers import clamped_swiglu
from engine.v4.moe import MoE
import kernels
from kernels import reference


@pytest.fixture(params=["cpu", "triton"])
def kernel_path(request, monkeypatch):
    """Run the containers through the CPU kernels, or through the Triton kernels (the GPU
    path) interpreted on CPU tensors, to check the arguments the containers pass them."""
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton path runs interpreted only without a GPU")
        pytest.importorskip("kernels.triton.quant_gemm")
        monkeypatch.setattr(kernels, "_triton", lambda op, **tensors: True)
    return request.param


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _quantized(fmt: str, w: torch.Tensor, block: int = 16):
    """(format, codes, scales) of an fp32 [N, K] weight, and its decode by the kernel reference."""
    if fmt == "fp8":
        codes, scale = quantize_fp8_blocks(w, block)
        return WeightFormat.fp8((block, block)), codes, scale, reference.dequantize_fp8_weight(codes, scale,
                                                                                              (block, block))
    codes, scale = quantize_fp4_rows(w)
    return WeightFormat.fp4(32), codes, scale, reference.dequantize_fp4_weight(codes, scale, 32)


def _fill(module, fmt, codes, scale):
    module.set_format(fmt)
    module.weight.data.copy_(codes)
    module.scale.data.copy_(scale)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_linear_equals_dense_on_decoded_weight(kind, kernel_path):
    fmt, codes, scale, decoded = _quantized(kind, _randn(48, 64) * 0.1)
    lin = Linear(64, 48)
    _fill(lin, fmt, codes, scale)
    assert lin.weight.dtype == (torch.float8_e4m3fn if kind == "fp8" else torch.int8)
    x = _randn(3, 5, 64, seed=1)  # any leading dims
    want = F.linear(x, decoded)
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)
    assert lin(x[:0]).shape == (0, 5, 48) and lin(x[0, :0]).shape == (0, 48)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_grouped_linear_fp8_equals_the_grouped_einsum(kernel_path):
    groups, inp, out = 2, 64, 32
    fmt, codes, scale, decoded = _quantized("fp8", _randn(groups * out, inp) * 0.1)
    dense, quant = GroupedLinear(groups, inp, out), GroupedLinear(groups, inp, out)
    dense.weight.data.copy_(decoded)
    _fill(quant, fmt, codes, scale)
    x = _randn(7, groups, inp, seed=2)
    want = torch.stack([x[:, g] @ decoded[g * out:(g + 1) * out].T for g in range(groups)], dim=1)  # [T, G, O]
    assert torch.allclose(dense(x), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(quant(x), want, rtol=1e-5, atol=1e-5)
    assert quant(x[:0]).shape == (0, groups, out)
    assert not GroupedLinear(groups, inp, 24).supports(WeightFormat.fp8((16, 16)))  # a scale row across groups


def _experts(kind: str, e=4, h=64, i=32):
    """A dense and a quantized RoutedExperts holding the same (decoded) weights."""
    w13, w2 = _randn(e, 2 * i, h, seed=3) * 0.2, _randn(e, h, i, seed=4) * 0.2
    dense, quant = RoutedExperts(e, h, i, 10.0), RoutedExperts(e, h, i, 10.0)
    for name, full in (("w13", w13), ("w2", w2)):
        parts = [_quantized(kind, full[x]) for x in range(e)]
        getattr(quant, name).set_format(parts[0][0])
        getattr(quant, name).weight.data.copy_(torch.stack([p[1] for p in parts]))
        getattr(quant, name).scale.data.copy_(torch.stack([p[2] for p in parts]))
        getattr(dense, name).weight.data.copy_(torch.stack([p[3] for p in parts]))
    return dense, quant


def _expert_reference(dense: RoutedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row block s of x through slot s's MLP, written out per slot."""
    out, start = [], 0
    for s, n in enumerate(counts):
        rows = x[start:start + n]
        h = rows @ dense.w13.weight[s].T
        act = clamped_swiglu(h[:, :dense.inter], h[:, dense.inter:], dense.swiglu_limit)
        out.append(act @ dense.w2.weight[s].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_routed_experts_equal_per_expert_mlps(kind, kernel_path):
    dense, quant = _experts(kind)
    counts = [3, 0, 5, 1]  # an expert without rows
    x = _randn(sum(counts), 64, seed=5)
    want = _expert_reference(dense, x, counts)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert torch.allclose(dense(x, ends), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(quant(x, ends), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(quant.local_experts(x, torch.tensor(counts)), want, rtol=1e-5, atol=1e-5)
    assert quant(x[:0], torch.zeros(4, dtype=torch.int32)).shape == (0, 64)


def test_a_subset_holds_the_chosen_logical_experts():
    experts = RoutedExperts(8, 64, 32, 10.0)
    experts.set_format(WeightFormat.fp4(32))
    experts.select([5, 2, 5])  # a replica of expert 5 included
    assert experts.num_local_experts == 3 and not experts.holds_all
    assert experts.w13.weight.shape == (3, 64, 32) and experts.w13.scale.shape == (3, 64, 2)
    assert experts.w2.weight.shape == (3, 64, 16) and experts.w2.fmt == WeightFormat.fp4(32)
    assert experts.slots_of(5) == [0, 2] and experts.slots_of(3) == []
    with pytest.raises(ValueError, match="outside"):
        experts.select([8])


def _tiny_moe(hash_routing: bool) -> MoE:
    cfg = preset_config("tiny")
    moe = MoE(cfg, hash_routing).requires_grad_(False)
    for name, p in moe.named_parameters():
        p.data.copy_(_randn(*p.shape, seed=len(name)) * 0.2)
    if hash_routing:
        moe.tid2eid.copy_(torch.arange(cfg.vocab_size)[:, None] % cfg.n_routed_experts)
        moe.tid2eid[:, 1] = (moe.tid2eid[:, 0] + 1) % cfg.n_routed_experts
    return moe


@pytest.mark.parametrize("hash_routing", [False, True])
def test_moe_runs_a_zero_token_batch(hash_routing):
    moe = _tiny_moe(hash_routing)
    with torch.no_grad():
        out = moe(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
        some = moe(_randn(3, 64, seed=9), torch.tensor([1, 2, 3]))
    assert out.shape == (0, 64) and some.shape == (3, 64) and torch.isfinite(some).all()


def test_moe_with_a_share_of_the_experts_refuses_direct_routing():
    moe = _tiny_moe(False)
    moe.experts.select([0, 1])
    with pytest.raises(RuntimeError, match="ExpertParallelMoE"):
        moe(_randn(2, 64), torch.tensor([1, 2]))


@pytest.mark.parametrize("kind", ["dense", "fp4"])
def test_adopting_migrated_slots(kind):
    """What EPLB hands back (state_dict names, one row per new slot) becomes the new share."""
    dense, quant = _experts("fp4")
    experts = dense if kind == "dense" else quant
    old = {name: t.clone() for name, t in experts.state_dict().items()}
    experts.adopt({name: t[[2, 0]].contiguous() for name, t in old.items()}, [2, 0])
    assert experts.logical_ids == (2, 0) and experts.w13.lead == (2,)
    for name, t in experts.state_dict().items():
        want = old[name][[2, 0]]
        bits = (lambda v: v.view(torch.uint8)) if t.dtype != torch.float32 else (lambda v: v)  # noqa: E731
        assert t.dtype == want.dtype and torch.equal(bits(t), bits(want)), name
    # Dense stacks on CPU keep the layout CPU grouped_mm is fast on: [L, K, N] contiguous.
    assert kind == "fp4" or experts.w13.weight.transpose(1, 2).is_contiguous()
    x = _randn(4, 64, seed=6)
    assert experts(x, torch.tensor([1, 4], dtype=torch.int32)).shape == (4, 64)

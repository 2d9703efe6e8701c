"""kernels/cpu_moe_decode.py's two-call MoE layer against the op-by-op composition of the generic
kernel entry points (bit for bit: the same kernels in the same order), against dense torch maths
on the dequantized weights (within rounding), and inside the fused decode forward of a
quantized checkpoint."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.cpu_moe_decode import DecodeMoE
from _quant_inputs import quant_weight

E, H, I, K = 12, 64, 32, 3  # experts, hidden, expert width, top-k
LIMIT, SCALING = 7.0, 1.5


class Layer:
    """Random MoE weights: routed w13 [E, 2I, H] / w2 [E, H, I] of one kind, shared of another."""

    def __init__(self, routed: str, shared: str | None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.routed, self.shared = routed, shared
        self.w13 = quant_weight(routed, (E, 2 * I, H), g)
        self.w2 = quant_weight(routed, (E, H, I), g)
        self.s13 = quant_weight(shared, (2 * I, H), g) if shared else None
        self.s2 = quant_weight(shared, (H, I), g) if shared else None
        self.bias = torch.randn(E, generator=g) * 0.1
        self.tid2eid = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(50)]).to(torch.int32)

    def decode_moe(self) -> DecodeMoE:
        def prepared(w, kind):
            return kernels.prepare_quant_weight(w[0], w[1], kind, w[2])

        parts = [prepared(self.w13, self.routed), prepared(self.w2, self.routed)]
        parts += [prepared(self.s13, self.shared), prepared(self.s2, self.shared)] if self.shared else [None, None]
        assert DecodeMoE.compatible(*parts)
        return DecodeMoE(*parts, K, SCALING, LIMIT)


def _grouped(kind, x, w, ends):
    if kind == "fp8":
        return kernels.fp8_grouped_mm(x, w[0], w[1], ends, w[2], out_dtype=torch.float32)
    return kernels.fp4_grouped_mm(x, w[0], w[1], ends, out_dtype=torch.float32, group=w[2][1])


def _linear(kind, x, w):
    if kind == "fp8":
        return kernels.fp8_linear(x, w[0], w[1], w[2], out_dtype=torch.float32)
    return kernels.fp4_linear(x, w[0], w[1], out_dtype=torch.float32, group=w[2][1])


def op_by_op(layer: Layer, x, logits, hashed: bool, tokens):
    """What engine/v4/fused_decode.py's MoE runs op by op, through the generic entry points."""
    weights, ids = kernels.route(logits, None if hashed else layer.bias, K, SCALING,
                                 token_ids=tokens if hashed else None, tid2eid=layer.tid2eid if hashed else None)
    _, offsets, order, inverse = kernels.permute(ids, E)
    ends = offsets[1:]
    h = _grouped(layer.routed, kernels.gather_rows(x, order, K), layer.w13, ends)
    y = _grouped(layer.routed, kernels.swiglu(h, LIMIT), layer.w2, ends)
    shared = None
    if layer.shared:
        shared = _linear(layer.shared, kernels.swiglu(_linear(layer.shared, x, layer.s13), LIMIT), layer.s2)
    return kernels.moe_combine(y, weights, inverse, shared, torch.float32)


def dense(layer: Layer, x, logits, hashed: bool, tokens):
    """Token by token in float64 on the dequantized weights (no kernel involved)."""
    scores = torch.nn.functional.softplus(logits.double()).sqrt()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        ids = layer.tid2eid[tokens[t]].long() if hashed else (scores[t] + layer.bias.double()).topk(K).indices
        w = scores[t, ids] / (scores[t, ids].sum() + 1e-20) * SCALING
        for e, wt in zip(ids.tolist(), w):
            h = layer.w13[3][e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:I].clamp(max=LIMIT)) * h[I:].clamp(-LIMIT, LIMIT)
            out[t] += wt * (layer.w2[3][e].double() @ act)
        if layer.shared:
            h = layer.s13[3].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:I].clamp(max=LIMIT)) * h[I:].clamp(-LIMIT, LIMIT)
            out[t] += layer.s2[3].double() @ act
    return out


def _inputs(t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randn(t, E, generator=g), torch.randint(0, 50, (t,), generator=g)


@pytest.mark.parametrize("routed, shared", [("fp4", "fp8"), ("fp8", "fp4"), ("fp4", None)])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("t", [1, 5])
def test_equals_the_ops_bit_for_bit(routed, shared, hashed, t):
    layer = Layer(routed, shared)
    moe = layer.decode_moe()
    x, logits, tokens = _inputs(t)
    assert moe.takes(x)
    out = moe(x, logits, None if hashed else layer.bias, tokens if hashed else None,
              layer.tid2eid if hashed else None, kernels.swiglu)
    ref = op_by_op(layer, x, logits, hashed, tokens)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    want = dense(layer, x, logits, hashed, tokens)
    assert torch.allclose(out.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_experts_past_the_row_limit_take_the_tiled_path_and_still_equal_the_ops():
    """With a fused row limit of 1, every expert two tokens share goes the tiled way (both in
    the op path and here: the limit is the prepared weight's)."""
    layer = Layer("fp4", "fp8")
    moe = layer.decode_moe()
    moe.w13.max_rows = moe.w2.max_rows = 1
    x, logits, tokens = _inputs(4)
    tokens[:] = 7  # hash routing: four tokens, the same three experts
    out = moe(x, logits, None, tokens, layer.tid2eid, kernels.swiglu)
    ref = op_by_op(layer, x, logits, True, tokens)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_takes_only_decode_sized_fp32_matrices():
    moe = Layer("fp4", "fp8").decode_moe()
    assert moe.max_tokens == 8  # the shared FP8 GEMV's row limit
    assert moe.takes(torch.randn(8, H)) and not moe.takes(torch.randn(9, H))
    assert not moe.takes(torch.randn(0, H)) and not moe.takes(torch.randn(2, H, dtype=torch.bfloat16))
    assert not moe.takes(torch.randn(H, 2).t())  # strided


def test_bad_ids_are_the_ops_errors_and_nothing_is_written():
    layer = Layer("fp4", "fp8")
    moe = layer.decode_moe()
    x, logits, tokens = _inputs(2)
    bad = layer.tid2eid.clone()
    bad[tokens[1]] = torch.tensor([0, E, 1], dtype=torch.int32)
    for table, toks in ((bad, tokens), (layer.tid2eid, torch.tensor([3, 50]))):
        with pytest.raises(ValueError) as ours:
            moe(x, logits, None, toks, table, kernels.swiglu)
        with pytest.raises(ValueError) as theirs:
            weights, ids = kernels.route(logits, None, K, SCALING, token_ids=toks, tid2eid=table)
            kernels.permute(ids, E)
        assert str(ours.value) == str(theirs.value)


def test_fused_decode_moe_of_a_quantized_checkpoint_equals_its_ops(checkpoint_factory):
    """Every layer of a tiny FP8/FP4 V4 (hash-routed and learned) through FusedDecoder.moe, the
    kernel against the op path; a replaced expert weight is seen at once."""
    from engine.v4.fused_decode import FusedDecoder
    from engine.weights import load_model

    path = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    model = load_model(path, dtype=torch.float32, progress=False)
    decoder = FusedDecoder(model)
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    kinds = set()
    for i, block in enumerate(model.layers):
        kinds.add(block.ffn.hash_routing)
        for t in (1, 3, 8, 9):
            x = torch.randn(t, cfg.hidden_size, generator=g)
            tokens = torch.randint(0, cfg.vocab_size, (t,), generator=g)
            decoder.cpu_moe = True
            ours = decoder.moe(i, block.ffn, x, tokens)
            decoder.cpu_moe = False
            theirs = decoder.moe(i, block.ffn, x, tokens)
            assert torch.equal(ours, theirs), (i, t)
        fused = decoder._cpu_moe(i, block.ffn)
        assert fused is not None and fused.takes(x[:8]) and not fused.takes(x)
    assert kinds == {True, False}
    ffn, x = model.layers[-1].ffn, torch.randn(1, cfg.hidden_size, generator=g)
    tokens = torch.tensor([5])
    decoder.cpu_moe = True
    before = decoder.moe(len(model.layers) - 1, ffn, x, tokens)
    w2 = ffn.experts.w2
    w2.weight = torch.nn.Parameter(w2.weight.flip(0), requires_grad=False)  # experts' w2 in reverse order
    after = decoder.moe(len(model.layers) - 1, ffn, x, tokens)
    decoder.cpu_moe = False
    assert not torch.equal(after, before)
    assert torch.equal(after, decoder.moe(len(model.layers) - 1, ffn, x, tokens))

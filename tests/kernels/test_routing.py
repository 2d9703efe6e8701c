"""MoE routing and permutation: CPU implementation vs reference, tie and NaN rules, invariants."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def check_equal(logits, bias, k, scaling=1.5, token_ids=None, tid2eid=None):
    w, ids = kernels.route(logits, bias, k, scaling, token_ids, tid2eid)
    w_ref, ids_ref = reference.route(logits, bias, k, scaling, token_ids, tid2eid)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    assert same(w, w_ref)                # bitwise (see kernels/cpu_routing.py)
    return w, ids


@pytest.mark.parametrize("num_experts,k", [(256, 6), (384, 6), (8, 2), (7, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_random_matches_reference(num_experts, k, with_bias):
    g = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(300, num_experts, generator=g) * 4
    bias = torch.randn(num_experts, generator=g) * 0.1 if with_bias else None
    w, _ = check_equal(logits, bias, k)
    assert torch.allclose(w.sum(-1), torch.full((300,), 1.5), rtol=1e-5)


def test_ties_go_to_lower_expert_ids():
    logits = torch.zeros(3, 16)
    logits[1, [3, 9, 12]] = 1.0
    logits[2] = torch.tensor([1.0, 2.0] * 8)
    _, ids = check_equal(logits, None, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 12, 0], [1, 3, 5, 7]]
    bias = torch.zeros(16)
    bias[15] = 1e-3                        # bias only reorders selection
    w, ids = check_equal(logits, bias, 4)
    assert ids[0].tolist() == [15, 0, 1, 2] and torch.allclose(w[0], torch.full((4,), 0.375))


def test_nan_and_inf_logits():
    logits = torch.randn(4, 32)
    logits[0, 5] = float("nan")            # NaN ranks last: not selected
    logits[1, :] = float("nan")            # all NaN: ids 0..k-1, NaN weights
    logits[2, 7] = float("inf")            # selected first; its weight NaN (inf/inf), others 0
    logits[3, 3] = 1e9                     # softplus threshold: s = sqrt(x)
    w, ids = check_equal(logits, None, 6)
    assert 5 not in ids[0].tolist() and not torch.isnan(w[0]).any()
    assert ids[1].tolist() == list(range(6)) and torch.isnan(w[1]).all()
    assert ids[2, 0] == 7 and torch.isnan(w[2, 0]) and (w[2, 1:] == 0).all()
    assert ids[3, 0] == 3


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 20), e=st.integers(2, 40), data=st.data())
def test_hypothesis_integer_logits_tie_heavy(t, e, data):
    k = data.draw(st.integers(1, e))
    seed = data.draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (t, e), generator=g).float()
    bias = torch.randint(-1, 2, (e,), generator=g).float() * 0.5
    _, ids = check_equal(logits, bias, k)
    key = (reference.router_scores(logits) + bias).tolist()
    for row, chosen in zip(key, ids.tolist()):        # brute force: sort by (-key, id)
        assert chosen == sorted(range(e), key=lambda i: (-row[i], i))[:k]


def test_hash_routing():
    g = torch.Generator().manual_seed(0)
    tid2eid = torch.randint(0, 64, (1000, 6), generator=g)
    token_ids = torch.randint(0, 1000, (50,), generator=g)
    logits = torch.randn(50, 64, generator=g)
    w, ids = check_equal(logits, torch.randn(64), 6, 2.5, token_ids, tid2eid)
    assert torch.equal(ids.long(), tid2eid[token_ids])
    with pytest.raises(ValueError, match="token_ids must be in"):
        kernels.route(logits, None, 6, 1.5, token_ids + 1000, tid2eid)
    with pytest.raises(ValueError, match="tid2eid must be"):
        kernels.route(logits, None, 5, 1.5, token_ids, tid2eid)


def test_route_arguments_raise():
    with pytest.raises(ValueError, match="logits"):
        kernels.route(torch.zeros(2, 8, dtype=torch.float64), None, 2, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        kernels.route(torch.zeros(2, 8), None, 9, 1.0)
    with pytest.raises(ValueError, match="bias"):
        kernels.route(torch.zeros(2, 8), torch.zeros(7), 2, 1.0)


def check_permutation(expert_ids: torch.Tensor, num_experts: int) -> None:
    counts, offsets, order, inverse = kernels.permute(expert_ids, num_experts)
    for got, want in zip((counts, offsets, order, inverse), reference.permute(expert_ids, num_experts)):
        assert got.dtype == torch.int32 and torch.equal(got, want)
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    assert counts.sum() == n and offsets[0] == 0 and offsets[-1] == n
    assert torch.equal(offsets[1:] - offsets[:-1], counts)
    assert torch.equal(order.sort().values, torch.arange(n, dtype=torch.int32))
    assert torch.equal(order[inverse.long()], torch.arange(n, dtype=torch.int32))
    grouped = flat[order.long()]
    for e in range(num_experts):
        seg = order[offsets[e]:offsets[e + 1]]
        assert (grouped[offsets[e]:offsets[e + 1]] == e).all()
        assert (seg[1:] > seg[:-1]).all()            # stable: ascending flat slot


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 40), k=st.integers(1, 8), e=st.integers(1, 20), seed=st.integers(0, 1000))
def test_permutation_invariants(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    check_permutation(torch.randint(0, e, (t, k), generator=g).to(torch.int32), e)


def test_permutation_of_routed_ids():
    _, ids = kernels.route(torch.randn(4096, 256), torch.randn(256) * 0.1, 6, 1.5)
    check_permutation(ids, 256)
    with pytest.raises(ValueError, match="expert ids"):
        kernels.permute(ids, 100)

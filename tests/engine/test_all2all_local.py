"""The all-to-all backends in a one-rank gloo group, in the test process (EP = 1: what a lone
rank and the EP-1 benchmark run): bitwise the single-rank MoE, padding and argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ep_children as kids
from engine.distributed import eplb
from engine.distributed.all2all import CapacityOverflow, NaiveAllGather, PaddedA2A, SlotLayout, TorchA2A
from engine.distributed.ep_moe import ExpertParallelMoE
from engine.distributed.group import init_group, pick_free_port


@pytest.fixture(scope="module")
def group():
    g = init_group(0, 1, "127.0.0.1", pick_free_port(), "gloo", "local", timeout_s=10)
    yield g
    g.close()


@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_one_rank_backends_equal_single_rank(group, tokens):
    case = kids.Case(11, 8, 3, 10, 6, [tokens])
    w13, w2 = kids.make_weights(case)
    x, weights, ids = kids.make_tokens(case, 0, 1)
    want = kids.reference_moe(x, weights, ids, w13, w2)
    layout = SlotLayout(8, 1)
    l2p, count = eplb.identity_placement(1, 8, 1).layer_maps(0)
    for a2a in (TorchA2A(layout), PaddedA2A(layout, capacity=max(1, tokens * 3)), NaiveAllGather(layout)):
        moe = ExpertParallelMoE(a2a, kids.glu_experts(w13, w2), l2p, count)
        assert torch.equal(moe(x, weights, ids), want), type(a2a).__name__
        assert torch.equal(moe.take_load(), torch.bincount(ids.reshape(-1).long(), minlength=8))
        assert a2a.stats.dispatch_bytes == a2a.stats.combine_bytes == 0  # nothing leaves a lone rank


def test_padded_rows_are_grouped_then_padding(group):
    layout = SlotLayout(4, 1)
    a2a = PaddedA2A(layout, capacity=8)
    x = torch.arange(5, dtype=torch.float32).unsqueeze(1).repeat(1, 2)  # token t is all t
    slots = torch.tensor([[2], [0], [2], [1], [0]])
    d = a2a.dispatch(x, slots, torch.ones(5, 1))
    assert d.x.shape == (8, 2) and d.counts.tolist() == [2, 1, 2, 0]
    assert d.x[:, 0].tolist() == [1, 4, 3, 0, 2, 0, 0, 0]  # by expert, token order within, zeros after
    with pytest.raises(ValueError, match="padding included"):
        a2a.combine(d.x[:5], d)
    assert torch.equal(a2a.combine(d.x * 2, d), x * 2)
    with pytest.raises(CapacityOverflow, match="5 rows from rank 0 to rank 0 exceed the capacity of 4"):
        PaddedA2A(layout, capacity=4).dispatch(x, slots, torch.ones(5, 1))


def test_bad_arguments(group):
    layout = SlotLayout(4, 1)
    with pytest.raises(ValueError, match=r"slot ids must lie in \[0, 4\)"):
        TorchA2A(layout).dispatch(torch.zeros(2, 3), torch.tensor([[0], [4]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="layout is for 2 ranks"):
        TorchA2A(SlotLayout(4, 2))
    with pytest.raises(ValueError, match="do not split evenly"):
        SlotLayout(5, 2)
    l2p, count = eplb.identity_placement(1, 4, 1).layer_maps(0)
    with pytest.raises(ValueError, match="at least one replica"):
        ExpertParallelMoE(TorchA2A(layout), lambda x, c: x, l2p, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="already initialized"):
        init_group(0, 1, "127.0.0.1", pick_free_port(), "gloo", "second", timeout_s=5)
    assert np.array_equal(eplb.identity_placement(1, 4, 1).local_experts(0, 0), np.arange(4))

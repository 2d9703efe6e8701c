"""EPLB placement (numpy, one process): map invariants, the replication and packing rules checked
against brute force, imbalance on skewed loads, migration plans replayed on a simulated cluster,
and the logical->physical replica choice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.distributed import eplb
from engine.distributed.ep_moe import map_to_physical


def skewed_load(seed: int, layers: int, experts: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.zipf(1.6, size=(layers, experts)).astype(np.float64) * rng.integers(1, 50, size=(layers, experts))


def check_invariants(p: eplb.Placement, layers: int, experts: int, ranks: int, redundant: int) -> None:
    physical = experts + redundant
    assert p.physical_to_logical.shape == (layers, physical) and p.num_ranks == ranks
    assert p.slots_per_rank * ranks == physical
    for layer in range(layers):
        p2l, l2p, count = p.physical_to_logical[layer], p.logical_to_physical[layer], p.logical_replica_count[layer]
        assert (count >= 1).all() and count.sum() == physical
        assert np.array_equal(count, np.bincount(p2l, minlength=experts))
        for e in range(experts):
            slots = l2p[e]
            assert (slots[: count[e]] >= 0).all() and (slots[count[e]:] == -1).all()  # -1 only as padding
            assert (p2l[slots[: count[e]]] == e).all()  # the maps are inverse
        valid = l2p[l2p >= 0]
        assert np.array_equal(np.sort(valid), np.arange(physical))  # every slot named exactly once


@pytest.mark.parametrize("layers,experts,ranks,redundant", [(3, 16, 4, 4), (2, 8, 2, 0), (4, 12, 4, 8), (1, 6, 3, 3)])
def test_rebalance_invariants(layers, experts, ranks, redundant):
    for seed in range(5):
        load = skewed_load(seed, layers, experts)
        placement = eplb.rebalance(load, ranks, redundant)
        check_invariants(placement, layers, experts, ranks, redundant)
        again = eplb.rebalance(load.copy(), ranks, redundant)
        assert np.array_equal(again.physical_to_logical, placement.physical_to_logical)  # a pure function


def test_rebalance_zero_load_and_identity_invariants():
    check_invariants(eplb.rebalance(np.zeros((2, 8)), 4, 4), 2, 8, 4, 4)
    check_invariants(eplb.identity_placement(2, 8, 4), 2, 8, 4, 0)


def test_replication_minimises_the_max_load_per_replica():
    """Greedy argmax(load/replicas) reaches the brute-force optimum of max_e load_e / replicas_e."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        experts, extra = 4, int(rng.integers(1, 5))
        load = rng.integers(1, 100, size=(1, experts)).astype(np.float64)
        _, _, count = eplb.replicate_experts(load, experts + extra)
        best = min(max(load[0] / (1 + np.array(c)))
                   for c in itertools.product(range(extra + 1), repeat=experts) if sum(c) == extra)
        assert max(load[0] / count[0]) == pytest.approx(best)


def test_packing_fills_every_rank_equally_and_follows_the_greedy_rule():
    rng = np.random.default_rng(1)
    weight = rng.random((3, 12))
    pack, index = eplb.balanced_packing(weight, 4)
    for layer in range(3):
        assert np.array_equal(np.bincount(pack[layer], minlength=4), [3, 3, 3, 3])
        for p in range(4):  # positions within a pack are 0..2
            assert sorted(index[layer, pack[layer] == p]) == [0, 1, 2]
        # replay: heaviest first, each into the lightest non-full pack
        totals, sizes = np.zeros(4), np.zeros(4, dtype=int)
        for item in np.argsort(-weight[layer], kind="stable"):
            open_packs = [q for q in range(4) if sizes[q] < 3]
            lightest = min(open_packs, key=lambda q: (totals[q], q))
            assert pack[layer, item] == lightest
            totals[lightest] += weight[layer, item]
            sizes[lightest] += 1


def test_imbalance_decreases_on_skewed_loads():
    layers, experts, ranks = 4, 16, 4
    for seed in range(5):
        load = skewed_load(seed, layers, experts)
        before = eplb.imbalance(load, eplb.identity_placement(layers, experts, ranks))
        after = eplb.imbalance(load, eplb.rebalance(load, ranks, num_redundant=4))
        assert (after <= before + 1e-12).all() and after.mean() < before.mean(), (before, after)


def test_rank_loads_by_hand():
    load = np.array([[8.0, 2.0, 4.0, 6.0]])
    placement = eplb.rebalance(load, num_ranks=2, num_redundant=2)  # 6 slots, 3 per rank
    per_rank = eplb.rank_loads(load, placement)[0]
    want = np.zeros(2)
    for slot, e in enumerate(placement.physical_to_logical[0]):
        want[slot // 3] += load[0, e] / placement.logical_replica_count[0, e]
    assert np.allclose(per_rank, want) and per_rank.sum() == pytest.approx(load.sum())
    assert eplb.imbalance(load, placement)[0] == pytest.approx(per_rank.max() / per_rank.mean())
    assert eplb.imbalance(np.ones((1, 4)), eplb.identity_placement(1, 4, 2))[0] == 1.0


def replay(plan: list[list[eplb.Move]], old: eplb.Placement, new: eplb.Placement) -> list[np.ndarray]:
    """Simulate the moves on per-rank arrays of 'weights' (= the logical id each slot holds)."""
    so = old.slots_per_rank
    held = [old.physical_to_logical[:, r * so:(r + 1) * so] for r in range(old.num_ranks)]
    out = []
    for r in range(new.num_ranks):
        mine = np.full((new.num_layers, new.slots_per_rank), -1)
        keep = min(old.slots_per_rank, new.slots_per_rank)
        mine[:, :keep] = held[r][:, :keep]
        for m in plan[r]:
            mine[m.layer, m.slot - r * new.slots_per_rank] = held[m.from_rank][m.layer, m.from_slot]
        out.append(mine)
    return out


@pytest.mark.parametrize("redundant_old,redundant_new", [(0, 4), (4, 4), (4, 8)])
def test_migration_plan_moves_exactly_the_changed_slots(redundant_old, redundant_new):
    layers, experts, ranks = 3, 16, 4
    old_load, new_load = skewed_load(1, layers, experts), skewed_load(2, layers, experts)
    old = eplb.rebalance(old_load, ranks, redundant_old)
    new = eplb.rebalance(new_load, ranks, redundant_new)
    plan = eplb.migration_plan(old, new)
    so, sn = old.slots_per_rank, new.slots_per_rank
    for r in range(ranks):
        moved = {(m.layer, m.slot - r * sn) for m in plan[r]}
        was, now = old.physical_to_logical, new.physical_to_logical
        changed = {(layer, i) for layer in range(layers) for i in range(sn)
                   if i >= so or was[layer, r * so + i] != now[layer, r * sn + i]}
        assert moved == changed
        for m in plan[r]:
            e = new.physical_to_logical[m.layer, m.slot]
            assert old.physical_to_logical[m.layer, m.from_rank * so + m.from_slot] == e  # the source holds it
            held_here = (old.local_experts(m.layer, r) == e).any()
            assert (m.from_rank == r) == held_here  # local copy exactly when the rank already had it
    for r, mine in enumerate(replay(plan, old, new)):
        assert np.array_equal(mine, new.physical_to_logical[:, r * sn:(r + 1) * sn])
    assert eplb.migration_plan(new, new) == [[] for _ in range(ranks)]


def test_map_to_physical_picks_replicas_round_robin():
    placement = eplb.rebalance(np.array([[1.0, 1.0, 50.0, 1.0]]), num_ranks=2, num_redundant=4)
    l2p, count = placement.layer_maps(0)
    assert int(count[2]) >= 3
    ids = torch.full((9, 1), 2, dtype=torch.int32)  # every token to the hot expert
    for salt in (0, 1):
        slots = map_to_physical(ids, l2p, count, salt).reshape(-1)
        assert (torch.as_tensor(placement.physical_to_logical[0])[slots] == 2).all()
        for t in range(9):
            assert int(slots[t]) == int(l2p[2, (t + salt) % int(count[2])])
    mixed = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    assert (torch.as_tensor(placement.physical_to_logical[0])[map_to_physical(mixed, l2p, count, 5)] == mixed).all()

"""Rank programs for tests/engine/test_ep_distributed.py, run in spawned processes.

Each program forms real gloo groups on 127.0.0.1, runs its checks and writes a JSON result per
rank (`<out>/<program>-<rank>.json`); the test process asserts on those. Every rank builds the
same random MoE from the case seed, but each rank's EP path only ever gets its own slots' weights.
The reference is the single-rank MoE written out as engine/v4/moe.py computes it (permute, expert
compute, weight, sum of the k choices), with an expert computation whose result for a row does
not depend on which other rows share the call or where the row sits (fixed-order multiply-adds
and a piecewise-linear GLU) — so EP and reference agree bitwise exactly when dispatch/combine add
no arithmetic of their own. A second check runs engine/v4/moe.py's real grouped GEMMs + SwiGLU
with a tolerance (GEMMs and SiLU are not row-invariant).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels
from engine.distributed import eplb
from engine.distributed.all2all import CapacityOverflow, NaiveAllGather, PaddedA2A, SlotLayout, TorchA2A
from engine.distributed.ep_moe import ExpertParallelMoE, map_to_physical
from engine.distributed.group import RendezvousError, init_group
from engine.v4.layers import clamped_swiglu

LIMIT = 10.0  # swiglu clamp, as the tiny preset
HOST = "127.0.0.1"


def run_rank(plan: list[tuple[str, list[int]]], rank: int, world_size: int, out_dir: str) -> None:
    """Process entry: run each (program, ports) of plan in turn, writing `<program>-<rank>.json`
    = {"ok": result} or {"error": traceback} as each ends; after an error the rank exits at once
    (its peers then fail fast instead of waiting out a collective timeout)."""
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    for program, ports in plan:
        try:
            record = {"ok": PROGRAMS[program](rank, world_size, ports)}
        except BaseException:
            record = {"error": traceback.format_exc()}
        Path(out_dir, f"{program}-{rank}.json").write_text(json.dumps(record))
        if "error" in record:
            sys.exit(1)


# ---------------------------------------------------------------- model and reference

@dataclasses.dataclass
class Case:
    seed: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: list[int]  # per rank
    hot_rank: int | None = None  # route every token to this rank's experts (identity placement)


def make_weights(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    w13 = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=g) * 0.3  # [E, 2I, H]
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=g) * 0.3  # [E, H, I]
    return w13, w2


def make_tokens(case: Case, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's x [T, H] and its routing (weights [T, k] fp32, expert_ids [T, k] int32)."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank + 1)
    t = case.tokens[rank]
    x = torch.randn(t, case.hidden, generator=g)
    logits = torch.randn(t, case.experts, generator=g)
    bias = torch.zeros(case.experts)
    if case.hot_rank is not None:
        per = case.experts // world_size
        bias[case.hot_rank * per:(case.hot_rank + 1) * per] = 100.0
    weights, ids = kernels.route(logits, bias, case.top_k, 1.5)
    return x, weights, ids


def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ w[N, K]^T as K elementwise multiply-adds in a fixed order: [S, N]. Unlike a GEMM
    (or a sum() whose vectorisation depends on the shape), a row's result never depends on S."""
    acc = x[:, :1] * w[:, 0]  # [S, N]
    for j in range(1, x.shape[1]):
        acc = acc + x[:, j:j + 1] * w[:, j]
    return acc


def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A clamped ReLU-GLU: exact elementwise arithmetic. SiLU is not used here because torch's
    CPU exp has a vectorised body and a scalar tail that can round differently, so SiLU of one
    value depends on its position in the tensor."""
    return gate.clamp(min=0.0, max=LIMIT) * up.clamp(min=-LIMIT, max=LIMIT)


def glu_experts(w13: torch.Tensor, w2: torch.Tensor):
    """The expert callback over the given expert stacks: (x_sorted [S, H], counts [L]) -> [S, H];
    rows after counts.sum() (padding) stay zero."""
    inter = w2.shape[2]

    def compute(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype)
        start = 0
        for e, n in enumerate(counts.tolist()):
            h = rowwise(x[start:start + n], w13[e])  # [n, 2I]
            y[start:start + n] = rowwise(reglu(h[:, :inter], h[:, inter:]), w2[e])
            start += n
        return y

    return compute


def grouped_experts(w13: torch.Tensor, w2: torch.Tensor):
    """The same experts with engine/v4/moe.py's grouped GEMMs (not row-invariant: compared with a tolerance)."""
    inter = w2.shape[2]

    def compute(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(x, w13.transpose(1, 2), offs=ends)
        return F.grouped_mm(clamped_swiglu(h[:, :inter], h[:, inter:], LIMIT), w2.transpose(1, 2), offs=ends)

    return compute


def reference_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """Single-rank routed MoE, engine/v4/moe.py's steps, all experts local."""
    t, k = ids.shape
    counts, _, order, inverse = kernels.permute(ids, w13.shape[0])
    order = order.long()
    y = glu_experts(w13, w2)(x[order // k], counts.long())  # [T·k, H] expert order
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return y[inverse.long()].view(t, k, x.shape[1]).sum(dim=1).to(x.dtype)


def physical_weights(w13, w2, p2l_local: np.ndarray):
    idx = torch.as_tensor(p2l_local)
    return w13[idx].contiguous(), w2[idx].contiguous()


# ---------------------------------------------------------------- checks

def socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def backends(layout: SlotLayout, capacity: int):
    return {"torch": TorchA2A(layout), "padded": PaddedA2A(layout, capacity=capacity), "naive": NaiveAllGather(layout)}


def check_backends(case: Case, rank: int, world_size: int) -> dict:
    """Identity placement: every backend's EP output == the single-rank reference, bitwise."""
    w13, w2 = make_weights(case)
    x, weights, ids = make_tokens(case, rank, world_size)
    want = reference_moe(x, weights, ids, w13, w2)
    layout = SlotLayout(case.experts, world_size)
    local = np.arange(rank * layout.slots_per_rank, (rank + 1) * layout.slots_per_rank)
    experts = glu_experts(*physical_weights(w13, w2, local))
    l2p, count = eplb.identity_placement(1, case.experts, world_size).layer_maps(0)
    out = {}
    for name, a2a in backends(layout, max(1, max(case.tokens) * case.top_k)).items():
        got = ExpertParallelMoE(a2a, experts, l2p, count)(x, weights, ids)
        out[name] = {"bitwise": torch.equal(got, want), "shape": list(got.shape),
                     "max_abs": float((got - want).abs().max()) if got.numel() else 0.0}
    out["tokens"] = case.tokens[rank]
    return out


def check_grouped_mm(case: Case, rank: int, world_size: int) -> dict:
    """engine/v4/moe.py's own MoE._experts (grouped GEMMs) vs EP with grouped GEMMs on local slices."""
    from engine.v4.checkpoint import preset_config
    from engine.v4.moe import MoE

    w13, w2 = make_weights(case)
    x, weights, ids = make_tokens(case, rank, world_size)
    cfg = dataclasses.replace(preset_config("tiny"), n_routed_experts=case.experts, num_experts_per_tok=case.top_k,
                              hidden_size=case.hidden, moe_intermediate_size=case.inter, swiglu_limit=LIMIT)
    moe = MoE(cfg, hash_routing=False)
    moe.experts.w13.weight.data.copy_(w13)
    moe.experts.w2.weight.data.copy_(w2)
    with torch.no_grad():
        want = moe._experts(x, weights, ids)
    layout = SlotLayout(case.experts, world_size)
    local = np.arange(rank * layout.slots_per_rank, (rank + 1) * layout.slots_per_rank)
    l2p, count = eplb.identity_placement(1, case.experts, world_size).layer_maps(0)
    got = ExpertParallelMoE(TorchA2A(layout), grouped_experts(*physical_weights(w13, w2, local)), l2p, count)(
        x, weights, ids)
    return {"close": bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5)), "max_abs": float((got - want).abs().max())}


def check_overflow(case: Case, rank: int, world_size: int) -> dict:
    """Capacity 1 with many rows per pair: every rank raises, and the group stays usable."""
    w13, w2 = make_weights(case)
    x, weights, ids = make_tokens(case, rank, world_size)
    layout = SlotLayout(case.experts, world_size)
    l2p, count = eplb.identity_placement(1, case.experts, world_size).layer_maps(0)
    moe = ExpertParallelMoE(PaddedA2A(layout, capacity=1), glu_experts(w13, w2), l2p, count)
    try:
        moe(x, weights, ids)
        raised = ""
    except CapacityOverflow as e:
        raised = str(e)
    ping = torch.ones(1)
    dist.all_reduce(ping)
    return {"raised": raised, "group_ok_after": float(ping) == world_size}


def check_replicas(case: Case, rank: int, world_size: int) -> dict:
    """Redundant replicas (EPLB on a skewed load): output still == reference, and the replicas
    of a replicated expert really share its tokens."""
    w13, w2 = make_weights(case)
    x, weights, ids = make_tokens(case, rank, world_size)
    want = reference_moe(x, weights, ids, w13, w2)
    load = np.arange(case.experts, dtype=np.float64)[None] ** 3  # expert E-1 the hottest
    placement = eplb.rebalance(load, world_size, num_redundant=world_size)
    layout = SlotLayout(placement.num_physical, world_size)
    experts = glu_experts(*physical_weights(w13, w2, placement.local_experts(0, rank)))
    l2p, count = placement.layer_maps(0)
    got = ExpertParallelMoE(TorchA2A(layout), experts, l2p, count)(x, weights, ids)
    slots = map_to_physical(ids, l2p, count, rank).reshape(-1)
    per_slot = torch.zeros(placement.num_physical, dtype=torch.long).index_add_(0, slots, torch.ones_like(slots))
    dist.all_reduce(per_slot)
    hot = int(np.argmax(placement.logical_replica_count[0]))
    used = int((per_slot[l2p[hot, : int(count[hot])]] > 0).sum())
    return {"bitwise": torch.equal(got, want), "hot_replicas": int(count[hot]), "hot_replicas_used": used}


def check_migration(case: Case, rank: int, world_size: int) -> dict:
    """identity -> rebalance on the measured load (R = N) -> rebalance again on another load:
    after each migration the local weights are exactly the new slots' experts and the output is
    bitwise the identity-placement output."""
    w13, w2 = make_weights(case)
    scales = (torch.arange(case.experts * 6, dtype=torch.uint8) % 251).view(case.experts, 6)  # [E, 6] uint8
    x, weights, ids = make_tokens(case, rank, world_size)
    old = eplb.identity_placement(1, case.experts, world_size)
    local = old.local_experts(0, rank)
    tensors = {"w13": w13[local].clone(), "w2": w2[local].clone(), "scale": scales[local].clone()}
    moe = ExpertParallelMoE(TorchA2A(SlotLayout(old.num_physical, world_size)),
                            glu_experts(tensors["w13"], tensors["w2"]), *old.layer_maps(0))
    base = moe(x, weights, ids)
    load = eplb.all_reduce_load(moe.take_load()[None])  # [1, E] global tokens per expert
    skew = np.roll(load, 3, axis=1) * 7 + np.arange(case.experts)
    out = {"steps": []}
    for new in (eplb.rebalance(load, world_size, world_size), eplb.rebalance(skew, world_size, world_size)):
        plan = eplb.migration_plan(old, new)
        tensors = eplb.migrate_expert_weights(tensors, plan, 0, new.slots_per_rank, rank)
        want_local = new.local_experts(0, rank)
        exact = all(torch.equal(tensors[n], full[torch.as_tensor(want_local)])
                    for n, full in (("w13", w13), ("w2", w2), ("scale", scales)))
        moe = ExpertParallelMoE(TorchA2A(SlotLayout(new.num_physical, world_size)),
                                glu_experts(tensors["w13"], tensors["w2"]), *new.layer_maps(0))
        out["steps"].append({"weights_exact": exact, "bitwise": torch.equal(moe(x, weights, ids), base),
                             "moves": sum(map(len, plan))})
        old = new
    return out


def ep_checks(rank: int, world_size: int, ports: list[int]) -> dict:
    make_tokens(Case(0, 8, 2, 4, 2, [1] * world_size), rank, world_size)  # kernels.route starts a thread once
    fds0, threads0 = socket_fds(), threads()
    t0 = time.perf_counter()
    group = init_group(rank, world_size, HOST, ports[0], "gloo", f"ep-{ports[0]}", timeout_s=60)
    form_s = time.perf_counter() - t0
    n = world_size
    e, k, h = (8, 2, 16) if n == 2 else (16, 4, 12)
    results = {"form_s": form_s}
    rng = np.random.default_rng(7 + n)
    rand_tokens = [int(v) for v in rng.integers(1, 13, size=n)]
    rand_tokens[n - 1] = 0  # one rank with nothing to do still takes part
    results["random"] = check_backends(Case(1, e, k, h, 8, rand_tokens), rank, n)
    results["random_k3"] = check_backends(Case(2, 12 if n == 2 else 16, 3, h, 6, [5] * n), rank, n)
    results["hot_rank"] = check_backends(Case(3, e, k, h, 8, [9] * n, hot_rank=n - 1), rank, n)
    results["all_idle"] = check_backends(Case(4, e, k, h, 8, [0] * n), rank, n)
    results["grouped_mm"] = check_grouped_mm(Case(5, e, k, h, 8, [7] * n), rank, n)
    results["overflow"] = check_overflow(Case(6, e, k, h, 8, [8] * n), rank, n)
    results["replicas"] = check_replicas(Case(7, e, k, h, 8, [11] * n), rank, n)
    results["migration"] = check_migration(Case(8, e, k, h, 8, [10] * n), rank, n)
    results["checks_s"] = time.perf_counter() - t0 - form_s
    group.close()
    results["leaks"] = {"socket_fds": socket_fds() - fds0, "threads": threads() - threads0,
                        "port_free": rank != 0 or _port_free(ports[0])}
    return results


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


# ---------------------------------------------------------------- rendezvous and failures

def _rendezvous_error(**kwargs) -> dict:
    if kwargs["rank"]:
        _wait_listening(kwargs["master_port"])  # time the rendezvous, not the head's start-up
    t0 = time.perf_counter()
    try:
        init_group(master_addr=HOST, backend="gloo", **kwargs)
    except RendezvousError as e:
        return {"missing": e.missing, "message": str(e), "after_s": time.perf_counter() - t0,
                "pg_left": dist.is_initialized()}
    return {"missing": None, "message": "formed", "after_s": time.perf_counter() - t0}


def rendezvous(rank: int, world_size: int, ports: list[int]) -> dict:
    """Two processes: (a) world size 3, rank 2 never comes; (b) the ranks use different
    generations on one store. A good group forms before, between and after, in the same
    processes: it lines the two up for the next case and proves a failed rendezvous leaves
    nothing behind."""
    short = 0.5 if rank else 1.0  # the store's host (rank 0) waits longest, so the others time out on it
    out = {"good": [_good_group(rank, ports[0])]}
    out["absent"] = _rendezvous_error(rank=rank, world_size=3, master_port=ports[1], generation="g1",
                                      timeout_s=short)
    out["good"].append(_good_group(rank, ports[2]))
    out["stale"] = _rendezvous_error(rank=rank, world_size=2, master_port=ports[3],
                                     generation="new" if rank == 0 else "old", timeout_s=short)
    out["good"].append(_good_group(rank, ports[4]))
    return out


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)
    raise TimeoutError(f"nothing listens on {HOST}:{port}")


def _good_group(rank: int, port: int) -> float:
    with init_group(rank, 2, HOST, port, "gloo", f"good-{port}", timeout_s=30) as group:
        ping = torch.ones(1)
        dist.all_reduce(ping, group=group.cpu_group)
        return float(ping)


def peer_failure(rank: int, world_size: int, ports: list[int]) -> dict:
    """The last rank is the victim. (a) it hangs (waits on the store) while the others all_reduce: they fail
    after the 1 s collective timeout. (b) in a new group it is SIGKILLed: the others' all_reduce
    fails at once (a TCP reset), long before the 10 s timeout."""
    victim = world_size - 1
    out = {}
    group = init_group(rank, world_size, HOST, ports[0], "gloo", "hang", timeout_s=30, collective_timeout_s=1.0)
    if rank == victim:  # hang until the others have given up on it
        group.store.wait(["gave_up"], timedelta(seconds=30))
        while group.store.add("gave_up", 0) < world_size - 1:
            time.sleep(0.01)
    else:
        out["hung"] = _timed_failure()
        group.store.add("gave_up", 1)
    t0 = time.perf_counter()
    group.close(grace_s=5.0)
    out["hung_close_s"] = time.perf_counter() - t0
    group = init_group(rank, world_size, HOST, ports[1], "gloo", "kill", timeout_s=30, collective_timeout_s=10.0)
    group.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # let the kill land first
    out["killed"] = _timed_failure()
    t0 = time.perf_counter()
    group.close(grace_s=0.5)
    out["killed_close_s"] = time.perf_counter() - t0
    return out


def _timed_failure() -> dict:
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4))
        return {"failed": False, "after_s": time.perf_counter() - t0}
    except RuntimeError as e:
        return {"failed": True, "after_s": time.perf_counter() - t0, "error": str(e).splitlines()[0][:200]}


PROGRAMS = {"ep_checks": ep_checks, "rendezvous": rendezvous, "peer_failure": peer_failure}

"""Expert parallelism across REAL processes: gloo groups on 127.0.0.1, spawned ranks.

Spawning a rank costs seconds here (torch's import), so there are two spawns per module, one per
world size, each running a plan of rank programs (ep_children.py says what each proves):
- world size 2: every dispatch/combine check, then the rendezvous failures;
- world size 4: every dispatch/combine check, then a hung and a SIGKILLed peer.
The tests below read those results. Each spawn joins all of its processes (killing any survivor,
then failing), and the ranks check that closing a group gave back every socket and thread.
"""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

import ep_children
from engine.distributed.group import RendezvousError, init_group, pick_free_port

PLANS = {2: {"ep_checks": 1, "rendezvous": 5}, 4: {"ep_checks": 1, "peer_failure": 2}}  # program: ports
VICTIM = {4: 3}  # peer_failure kills its last rank


def run_ranks(programs: dict[str, int], world_size: int, out_dir, timeout_s: float = 120,
              victim: int | None = None) -> dict[str, list[dict | None]]:
    """Spawn world_size ranks running the programs in order; program -> per-rank results (None
    where the victim died before writing one)."""
    plan = [(name, [pick_free_port("127.0.0.1") for _ in range(n)]) for name, n in programs.items()]
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=ep_children.run_rank, args=(plan, r, world_size, str(out_dir)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {timeout_s} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results: dict[str, list[dict | None]] = {}
    for name, _ in plan:
        results[name] = []
        for r in range(world_size):
            path = out_dir / f"{name}-{r}.json"
            record = json.loads(path.read_text()) if path.exists() else None
            assert record is not None or r == victim, f"rank {r} wrote no {name} result (exit {procs[r].exitcode})"
            assert record is None or "error" not in record, f"rank {r} failed in {name}:\n{record['error']}"
            results[name].append(record and record["ok"])
    for r, p in enumerate(procs):
        assert (p.exitcode != 0) if r == victim else (p.exitcode == 0), f"rank {r} exited with {p.exitcode}"
    assert not multiprocessing.active_children()
    return results


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(world_size: int) -> dict[str, list[dict | None]]:
        if world_size not in cache:
            out = tmp_path_factory.mktemp(f"ep{world_size}")
            cache[world_size] = run_ranks(PLANS[world_size], world_size, out, victim=VICTIM.get(world_size))
        return cache[world_size]

    return get


def _assert_backends(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        for backend in ("torch", "padded", "naive"):
            got = res[case][backend]
            assert got["bitwise"], f"{case}/{backend} rank {rank}: max |EP - single rank| = {got['max_abs']}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_backend_equals_single_rank_bitwise(spawned, world_size):
    """Random routing with one rank at zero tokens, k = 3, every token on one rank's experts, and
    a step where no rank has a token."""
    results = spawned(world_size)["ep_checks"]
    for case in ("random", "random_k3", "hot_rank", "all_idle"):
        _assert_backends(results, case)
    idle = results[-1]["random"]
    assert idle["tokens"] == 0 and idle["torch"]["shape"][0] == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_engine_moe_grouped_gemms(spawned, world_size):
    for rank, res in enumerate(spawned(world_size)["ep_checks"]):
        assert res["grouped_mm"]["close"], f"rank {rank}: EP grouped GEMMs vs engine MoE: {res['grouped_mm']}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_padded_overflow_raises_on_every_rank(spawned, world_size):
    for rank, res in enumerate(spawned(world_size)["ep_checks"]):
        assert "exceed the capacity of 1 rows" in res["overflow"]["raised"], f"rank {rank}: {res['overflow']}"
        assert res["overflow"]["group_ok_after"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicas_and_migration_keep_output_identical(spawned, world_size):
    for res in spawned(world_size)["ep_checks"]:
        rep = res["replicas"]
        assert rep["bitwise"] and rep["hot_replicas"] >= 2 and rep["hot_replicas_used"] >= 2, rep
        assert len(res["migration"]["steps"]) == 2
        for step in res["migration"]["steps"]:
            assert step["weights_exact"] and step["bitwise"] and step["moves"] > 0, step


@pytest.mark.parametrize("world_size", [2, 4])
def test_close_releases_sockets_threads_and_port(spawned, world_size):
    for rank, res in enumerate(spawned(world_size)["ep_checks"]):
        assert res["leaks"] == {"socket_fds": 0, "threads": 0, "port_free": True}, (rank, res["leaks"])


def test_rendezvous_timeout_names_missing_ranks(spawned):
    a, b = spawned(2)["rendezvous"]
    for res, timeout in ((a, 1.0), (b, 0.5)):
        assert res["good"] == [2.0, 2.0, 2.0]  # groups form again after each failed rendezvous
        absent = res["absent"]
        assert absent["missing"] == [2] and "ranks [2] of world size 3 did not arrive" in absent["message"]
        assert timeout <= absent["after_s"] < timeout + 3.0 and not absent["pg_left"]
    # different generations on one store never meet: each side is missing the other
    assert a["stale"]["missing"] == [1] and "'new'" in a["stale"]["message"]
    assert b["stale"]["missing"] == [0] and "'old'" in b["stale"]["message"]


def test_unreachable_head_is_named():
    port = pick_free_port("127.0.0.1")  # nothing listens there
    t0 = time.perf_counter()
    with pytest.raises(RendezvousError, match="rank 0 did not arrive") as info:
        init_group(1, 2, "127.0.0.1", port, "gloo", "lonely", timeout_s=0.5)
    assert info.value.missing == [0]
    assert time.perf_counter() - t0 < 8  # torch's store client retries once past its timeout


def test_dead_or_hung_peer_fails_the_others_within_a_bound(spawned):
    results = spawned(4)["peer_failure"]
    assert results[3] is None  # the victim
    for res in results[:3]:
        hung, killed = res["hung"], res["killed"]
        assert hung["failed"] and 0.9 <= hung["after_s"] < 3.0, hung  # the collective timeout: 1 s
        assert killed["failed"] and killed["after_s"] < 3.0, killed  # a TCP reset, not the 10 s timeout
        assert res["killed_close_s"] < 2.0 and res["hung_close_s"] < 5.0, res


def test_rank_claims_retries_and_disagreement():
    """Against a store hosted here (standing in for the head, which never registers): a rank may
    retry its own claim; another process's claim on it, or a different world size, is refused."""
    import os
    import socket
    from datetime import timedelta

    from engine.distributed.rendezvous_store import ClusterStore, StoreServer

    port = pick_free_port("127.0.0.1")
    server = StoreServer("127.0.0.1", port)  # the store rank 0 would host, and a client of it
    head = ClusterStore("127.0.0.1", port, timedelta(seconds=10))
    for _ in range(2):  # the retry is not "already claimed"
        with pytest.raises(RendezvousError, match=r"ranks \[0, 2\] of world size 3 did not arrive") as info:
            init_group(1, 3, "127.0.0.1", port, "gloo", "claims", timeout_s=0.3)
        assert info.value.missing == [0, 2]
    head.set("ringserve/claims/claims/2", "elsewhere:1")
    with pytest.raises(RendezvousError, match="rank 2 of generation 'claims' .* already claimed by elsewhere:1"):
        init_group(2, 3, "127.0.0.1", port, "gloo", "claims", timeout_s=0.3)
    peer = {"pid": 1, "host": "h", "world_size": 4, "backend": "gloo"}
    head.set("ringserve/odd/arrived/0", json.dumps(peer))
    with pytest.raises(RendezvousError, match=r"ranks \[0\] disagree on world size/backend") as info:
        init_group(1, 2, "127.0.0.1", port, "gloo", "odd", timeout_s=2)
    assert info.value.missing == []
    assert head.get("ringserve/odd/claims/1").decode() == f"{socket.gethostname()}:{os.getpid()}"
    head.close()
    server.stop()

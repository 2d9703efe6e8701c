"""Expert parallelism on the fake CUDA device: two ranks (processes) in a real gloo group, each
with half the experts on its fake GPU, stepping in lockstep; decode steps captured as graphs.

The padded all-to-all (fixed buffers, a count table gathered first: PaddedA2A) is what a captured
step needs. Each collective is checked and the ranks agree on it for real (tests/fake_cuda/
collectives.py). Every captured decode step replays its graph with one device read (the step's
results) on the rank that has requests, none on the rank running dummy steps; the collectives
inside the captured forward happened at capture and agreed on both ranks; a rank with nothing
to run replays a padding-only shape, so it keeps the others on graphs. The uneven all-to-all
(TorchA2A) reads its split sizes on the host: a captured engine refuses it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server_process import free_port
from tests.fake_cuda import available

RANK = Path(__file__).with_name("ep_rank.py")


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    # 8 experts, top-2: each of the 2 ranks holds 4
    return checkpoint_factory("dry-ep", index_topk=4, n_routed_experts=8, num_experts_per_tok=2)


def _run(model_dir: Path, backend: str, out: Path) -> list[dict]:
    why = available()
    if why is not None:
        pytest.skip(f"fake CUDA device unavailable: {why}")
    port = free_port(2)
    procs = [subprocess.Popen([sys.executable, str(RANK), str(r), str(port), str(model_dir), backend, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    results = []
    for r in range(2):
        path = out / f"rank{r}.json"
        assert path.exists(), logs[r][-3000:]
        results.append(json.loads(path.read_text()))
    return results


def test_captured_ep_decode_with_the_padded_all_to_all(model_dir, tmp_path):
    results = _run(model_dir, "padded_all_to_all", tmp_path)
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["captures"] > 0 and res["captured_collectives"] > 0
        static = [s for s in res["steps"] if s["static"]]
        assert len(static) >= 3, res["steps"]
        assert all(s["replays"] == 1 and s["collectives"] == 0 for s in static), static  # all inside the graph
        assert all(s["syncs"] <= 1 for s in res["steps"]), res["steps"]
    assert len(results[0]["steps"]) == len(results[1]["steps"])  # lockstep: the same steps on both ranks
    # rank 1's request ends first; its dummy steps replay a padding shape, keeping rank 0 on graphs
    assert [s["static"] for s in results[0]["steps"]] == [s["static"] for s in results[1]["steps"]]
    assert sum(s["static"] for s in results[0]["steps"]) >= len(results[0]["steps"]) - 1


def test_the_uneven_all_to_all_is_refused_where_steps_are_captured(model_dir, tmp_path):
    """The uneven all-to-all sizes its buffers from counts read on the host (a data-dependent
    shape, which the fake device reports at the first eager step), so a captured engine refuses
    it at start-up with the fix in the message."""
    results = _run(model_dir, "all_to_all", tmp_path)
    assert all("padded_all_to_all" in res.get("error", "") for res in results), [r.get("error") for r in results]

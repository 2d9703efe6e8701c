"""perf/bench_sparse_mla.py runs (Triton interpreter without CUDA) and checks its two read
patterns agree: the gpu_check.sh step that times them on a GPU must not fail on its own code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_prints_a_row_per_q_with_identical_outputs():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "perf/bench_sparse_mla.py", "--q", "1", "4"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    tables = r.stdout.split("\n\n")  # shared tables vs per-token reads, then the column splits
    rows = [line.split() for line in tables[0].splitlines() if line[:3].strip().isdigit()]
    assert [row[0] for row in rows] == ["1", "4"] and all(row[-1] == "yes" for row in rows)
    splits = [line.split() for line in tables[1].splitlines() if line[:3].strip().isdigit()]
    assert {(row[0], row[1]) for row in splits} >= {("1", "1"), ("1", "2"), ("4", "1"), ("4", "2")}
    assert all(float(row[-1]) == 0.0 for row in splits if row[-1] != "(default)")  # every split, same output
    per_row_mb, shared_mb = float(rows[1][5]), float(rows[1][6])
    assert shared_mb < per_row_mb  # q = 4: the window read once per sequence

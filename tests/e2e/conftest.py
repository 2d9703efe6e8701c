"""Fixtures: a tiny model made by `ringserve make-model`, and a shared `ringserve serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server_process import Server


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("e2e") / "tiny"
    subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(out), "--preset", "tiny", "--seed", "3"],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def server(model_dir):
    """One server for test_api and test_bad_input (neither stops, overloads or counts on a fresh one)."""
    s = Server(model_dir, "--max-num-seqs", "4", "--max-queued-requests", "16")
    yield s
    assert s.stop() == 0, s.output()

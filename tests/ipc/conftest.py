"""Fixtures for the ipc tests: repo root on sys.path, and a leak check after every test."""
from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ipc.segment import list_segments  # noqa: E402


def _ours() -> set[str]:
    """Ring files owned by this process (named rsring-<pid>-...). In these tests every ring is
    created by the test process; children only attach. Other projects' live rings are ignored."""
    prefix = f"rsring-{os.getpid()}-"
    return {name for name in list_segments() if name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_leaks():
    """After each test: no ring file of ours in /dev/shm and no child process left."""
    before = _ours()
    yield
    leftover = _ours() - before
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(5)
    assert not children, f"child processes left running: {children}"
    assert not leftover, f"ring files left in /dev/shm: {sorted(leftover)}"


@pytest.fixture
def spawn():
    return multiprocessing.get_context("spawn")

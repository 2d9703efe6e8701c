"""A CPU worker's thread count under load (engine/core_share.py): the rule, and the host's real
/proc/stat with a busy process beside."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine import core_share
from engine.core_share import CoreShare, threads_for


@pytest.mark.parametrize("configured, cores, others, expected", [
    (2, 2, 0.0, 2), (2, 2, 0.5, 2),          # the front end's bursts, a client: keep both
    (2, 2, 0.8, 1), (2, 2, 1.0, 1),          # a process keeping a core busy: one thread
    (2, 2, 2.0, 1),                          # never fewer than one
    (4, 8, 3.9, 4), (4, 8, 4.8, 3),          # the cores left free absorb others first
    (8, 8, 2.7, 6), (8, 8, 2.8, 5), (1, 1, 3.0, 1),
])
def test_a_thread_per_sustained_core_that_others_take(configured, cores, others, expected):
    assert threads_for(configured, cores, others) == expected


def test_between_windows_the_count_stands_without_reading_the_host(monkeypatch):
    share = CoreShare(2)
    calls = []
    monkeypatch.setattr(core_share, "_busy_ticks", lambda cpus: calls.append(cpus))
    assert share.threads() == 2 and not calls


def test_a_fixed_count_never_reads_the_host(monkeypatch):
    """--batch-invariant (adapt=False) and one-thread workers keep their count."""
    monkeypatch.setattr(core_share, "WINDOW_S", 0.0)
    shares = [CoreShare(2, adapt=False), CoreShare(1)]
    calls = []
    monkeypatch.setattr(core_share, "_busy_ticks", lambda cpus: calls.append(cpus))
    assert [s.threads() for s in shares] == [2, 1] and not calls


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat (not Linux)")
def test_a_busy_process_beside_costs_the_worker_a_thread(monkeypatch):
    monkeypatch.setattr(core_share, "WINDOW_S", 0.5)
    cpus = os.sched_getaffinity(0)
    share = CoreShare(len(cpus))
    if len(cpus) < 2:
        pytest.skip("one CPU: a one-thread worker never adapts")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.6)
        share.threads()              # a window with the hog running from its start
        time.sleep(0.6)
        assert share.threads() < len(cpus), f"others kept {share.others:.2f} cores busy"
        assert share.others > 0.75
    finally:
        hog.kill()
        hog.wait()

"""Signals whose effect a test must see before it goes on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _task_states(pid: int) -> list[str]:
    """The scheduler state letter of every thread of `pid` ("T" = stopped)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
    return states


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped: kill() only queues the
    signal, and a busy thread on a loaded machine can run on for a while (e.g. answer one more READ)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = _task_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} still running {timeout_s} s after SIGSTOP: {_task_states(pid)}")


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed server's orphaned worker stays a
    zombie until init reaps it, which a loaded machine can take a while to do)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def all_gone(pids, timeout_s: float = 10.0) -> bool:
    """Wait until none of `pids` runs any more (gone or a zombie); False if one still runs."""
    end = time.monotonic() + timeout_s
    while any(_running(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True

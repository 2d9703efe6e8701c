"""How many compute threads a CPU worker should use now: all it was given while the cores are its
own, fewer while other processes keep some of them busy.

A CPU decode step forks and joins its OpenMP team at every parallel kernel (~60 times a step on a
4-layer model). With the team's idle threads spinning between regions (libgomp's default), a
batch-1 step of the wide-fp8 test geometry took 4.3 ms on 2 free cores against 6.1 ms with them
sleeping (OMP_WAIT_POLICY=PASSIVE); but with one busy process beside it, a spinning thread waits on
a teammate the kernel has descheduled and the step took 19 ms (7.5 ms sleeping, 5.9 ms on one
thread). So the worker keeps libgomp's spin and drops threads instead while others need the cores
(perf/bench_cpu_decode.py; README "The CPU decode step as one compiled call").

Others' demand is read from /proc/stat over the CPUs this process may run on: their busy time
(steal included: a hypervisor's other guests take cores too) minus this process's own CPU time,
in cores, averaged over a window long enough that the server process's short bursts between
tokens do not count as a neighbour.
"""
from __future__ import annotations

import os
import time

# Seconds of each measurement window: the thread count changes at most this often.
WINDOW_S = 1.0
# Others' sustained use, in cores beyond those the worker leaves free, that costs the worker a
# thread: 0.75 tolerates the serving front end (a fraction of a core under streaming load) and a
# client on the same host, and catches a process that keeps a core busy.
THREAD_PER_CORES = 0.75


def threads_for(configured: int, cores: int, others: float) -> int:
    """Threads to use of `configured` on `cores` CPUs while other processes keep `others` cores
    busy: one fewer per core they take beyond the cores the worker leaves free, counting a
    sustained 0.75 of a core as one; never fewer than 1."""
    spare = max(0, cores - configured)
    taken = max(0.0, others - spare)
    return max(1, configured - int(taken + (1 - THREAD_PER_CORES)))


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks of `cpus` since boot from /proc/stat (all but idle and iowait), or None
    where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [int(v) for v in rest.split()[:8]]
        total += sum(ticks) - ticks[3] - ticks[4]
    return total


class CoreShare:
    """`threads()` before each step: the thread count for the newest finished window."""

    def __init__(self, configured: int, adapt: bool = True):
        self.configured = configured
        self.adapt = adapt and configured > 1  # False: the count stays `configured`
        self.cpus = os.sched_getaffinity(0)
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.current = configured
        self.others = 0.0  # others' busy cores in the last window (for logs and tests)
        self._mark = self._sample()

    @property
    def available(self) -> bool:
        """Whether the host tells CPU time per CPU (Linux); without it the count stays put."""
        return self._mark[1] is not None

    def _sample(self) -> tuple[float, int | None, float]:
        own = os.times()
        return time.monotonic(), _busy_ticks(self.cpus), own.user + own.system

    def threads(self) -> int:
        now = time.monotonic()
        if not self.adapt or not self.available or now - self._mark[0] < WINDOW_S:
            return self.current
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, sample
        self._mark = sample
        if busy1 is None:
            return self.current
        others = ((busy1 - busy0) * self.tick_s - (own1 - own0)) / (t1 - t0)
        self.others = max(0.0, others)
        self.current = threads_for(self.configured, len(self.cpus), self.others)
        return self.current

"""Worker processes: how the server starts one, and the child's first instructions.

The server starts `python -m server.worker_entry` with one JSON argument (`WorkerArgs`): plain
values the server wrote itself, decoded into a typed Struct (no object serialization). It watches the child through a pidfd
(readable the moment the child exits), so a death is seen within milliseconds.

In the child, SIGINT is ignored and the device chosen before anything heavy is imported: a
terminal's Ctrl-C reaches the whole process group, and stopping the workers is the server's job
(it drains, then sends Shutdown), so a worker must not die of that SIGINT, not even while still
importing torch; `CUDA_VISIBLE_DEVICES` is set before torch initialises CUDA, so that each rank
sees exactly its own GPU (as cuda:0). The CPU thread budget (`--threads-per-worker`) is set for
numba as well as torch, also before the import: numba's OpenMP pool otherwise starts with one
thread per core on its first parallel kernel and resets torch's count to match.

A CPU worker starts with glibc's malloc asked to back its large blocks with transparent huge
pages (`worker_env`): a prefill allocates and frees hundreds of MB of activations per step, which
glibc hands back to the kernel and takes again, one 4 KiB page fault at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec


class WorkerArgs(msgspec.Struct, frozen=True):
    rank: int
    model_dir: str
    engine_config: str  # EngineConfig JSON
    parallel_config: str  # ParallelConfig JSON
    request_ring: str
    control_ring: str
    output_ring: str
    status_ring: str
    num_threads: int
    device: str
    visible_device: str | None = None
    # The group's rendezvous (expert parallelism): the head's store and this start's generation.
    master_port: int = 0
    generation: str = ""


# glibc (2.35+) tunable: malloc madvises its mmapped blocks and heap growth MADV_HUGEPAGE, so
# they fault in 2 MiB at a time where transparent huge pages are `madvise` or `always`. On a
# 2-core Xeon (AMX) a 16 x 128-token prefill of wide-fp8 took ~0.8 M page faults and ~1.5 s of
# system time without it, 1.48x as long as with it (perf/bench_worker_malloc.py runs both side by
# side). Other C libraries ignore the variable; an operator's own setting of this tunable wins.
HUGE_PAGE_TUNABLE = ("glibc.malloc.hugetlb", "1")


THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages_mode() -> str:
    """The kernel's THP mode (`always`, `madvise`, `never`), or `absent` where it has none; the
    tunable changes anything only under `madvise` (under `always` every block is huge already)."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def worker_env(device: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker starts with: `base` (default: this process's) plus, for a CPU
    worker, HUGE_PAGE_TUNABLE in GLIBC_TUNABLES unless that tunable is already set there."""
    env = dict(os.environ if base is None else base)
    if device != "cpu":
        return env
    name, value = HUGE_PAGE_TUNABLE
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.split("=", 1)[0] == name for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{name}={value}"])
    return env


class WorkerProcess:
    """One started worker: its pid, a pollable exit fd (`sentinel`) and the usual controls."""

    def __init__(self, args: WorkerArgs, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "server.worker_entry", msgspec.json.encode(args).decode()]
        self._popen = subprocess.Popen(cmd, env=worker_env(args.device, env), close_fds=True)
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)  # readable once the child exits

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def pin_cpu_threads(n: int, device: str = "cpu") -> None:
    """Give this process `n` compute threads in numba and in every OpenMP pool (torch's too).
    Must run before numba is imported (it reads NUMBA_NUM_THREADS once). Without it a worker asked
    for 1 thread ran numba kernels on every core, and torch followed after the first of them."""
    if "numba" in sys.modules:
        raise RuntimeError("pin_cpu_threads must run before numba is imported")
    os.environ["NUMBA_NUM_THREADS"] = str(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    # Unless the operator says otherwise: a CPU worker keeps libgomp's default wait (idle threads
    # spin a few ms, then sleep), which a decode step's ~60 parallel regions need (1.4x at batch
    # 1 on 2 free cores), and gives threads up while other processes keep cores busy
    # (engine/core_share.py), where spinning collapses (19 ms against 4.3 ms a step). A GPU
    # worker's host threads only serve odd host ops: they sleep at once.
    if device != "cpu":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = msgspec.json.decode(argv[1], type=WorkerArgs)
    pin_cpu_threads(args.num_threads, args.device)
    device = args.device
    if args.visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.visible_device
        device = "cuda:0"
    from engine.worker_process import worker_main

    worker_main(args, device)


if __name__ == "__main__":
    main(sys.argv)

"""The worker processes' torch.distributed group for DEP (data-parallel attention, expert-parallel MoE).

`init_group` forms one group per (re)start of the server:
- rank 0 (the head) hosts a TCPStore at master_addr:master_port; every other rank connects to it;
- every key lives under `ringserve/<generation>/`, so a restarted group (new generation id) never
  meets a stale peer of an earlier one, even on the same store address;
- each rank first registers itself (`arrived/<rank>`, with its pid, host, world size and backend)
  and waits for all others: a rendezvous that does not complete in time raises one
  `RendezvousError` naming the ranks that never registered, instead of torch's anonymous timeout;
- then the main group (NCCL on GPU, gloo on CPU) and a gloo group for host-side coordination
  (step lockstep, EPLB loads) are formed, and a barrier on the gloo group proves both are usable.

There is one DistGroup per process at a time (it is torch's default group). `close()` destroys
both groups and releases the store; afterwards the process holds no socket of the group.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class RendezvousError(RuntimeError):
    """The group could not form. `missing` lists the ranks that did not arrive (empty when the
    cause is a disagreement: two processes claiming one rank, or different world sizes/backends)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass(eq=False)
class DistGroup:
    """A formed group. `group` is the data plane (NCCL on GPU, gloo on CPU: MoE all-to-all,
    weight migration); `cpu_group` is gloo for host-side control (lockstep counters, loads)."""

    rank: int
    world_size: int
    backend: str
    generation: str
    device: torch.device
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    store: dist.Store  # this generation's PrefixStore: a place for host-side keys of this group
    _tcp_store: dist.TCPStore | None = field(repr=False, default=None)
    _closed: bool = field(repr=False, default=False)

    def barrier(self) -> None:
        """Barrier on the gloo group (fails after the collective timeout if a peer is gone)."""
        dist.barrier(group=self.cpu_group)

    def close(self, grace_s: float = 2.0) -> None:
        """Destroy both groups and release the store. Rank 0 hosts the store, so it waits up to
        grace_s for the other ranks to say they are leaving before it shuts the store down (a dead
        peer never says so: the wait is bounded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self._depart(grace_s)
            # Drop our references so the groups' and the store's sockets and threads go now.
            self.group = self.cpu_group = self.store = None  # type: ignore[assignment]
            self._tcp_store = None

    def _depart(self, grace_s: float) -> None:
        try:
            if self.rank != 0:
                self.store.add("departed", 1)
                return
            deadline = time.monotonic() + grace_s
            while self.store.add("departed", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        except dist.DistError:
            pass  # the store (or its host) is already gone: nothing left to wait for

    def __enter__(self) -> DistGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on host right now (the OS's choice; another process may take it
    before it is bound again, so callers that race should retry on 'address in use')."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
               generation: str, timeout_s: float, *, local_rank: int | None = None,
               collective_timeout_s: float | None = None) -> DistGroup:
    """Form the group (see the module docstring). timeout_s bounds the whole rendezvous;
    collective_timeout_s (default timeout_s) bounds every collective afterwards, which is how long
    the survivors of a hung peer wait before they fail. local_rank picks the GPU for NCCL (default
    rank % device count)."""
    _check_args(rank, world_size, backend, generation, timeout_s)
    deadline = time.monotonic() + timeout_s
    tcp = _connect_store(rank, master_addr, master_port, world_size, timeout_s)
    store = dist.PrefixStore(f"ringserve/{generation}", tcp)  # keys: ringserve/<generation>/<key>
    try:
        _register_and_wait(store, rank, world_size, backend, generation, deadline, f"{master_addr}:{master_port}")
        device = _device(backend, rank, local_rank)
        timeout = timedelta(seconds=collective_timeout_s or timeout_s)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier(group=cpu_group)  # every rank has finished building both groups
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return DistGroup(rank, world_size, backend, generation, device, dist.group.WORLD, cpu_group, store, tcp)


def _check_args(rank: int, world_size: int, backend: str, generation: str, timeout_s: float) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if not generation or "/" in generation:
        raise ValueError(f"generation must be a non-empty string without '/', got {generation!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; close it first")


def _connect_store(rank: int, addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store; the others connect (torch retries until its timeout)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore(addr, port, world_size, rank == 0, timeout, wait_for_workers=False)
    except dist.DistError as e:
        if rank == 0:
            raise RendezvousError(f"rank 0 could not host the rendezvous store at {addr}:{port}: {e}", []) from e
        raise RendezvousError(
            f"rendezvous timed out after {timeout_s:g} s: rank {rank} could not reach the store of rank 0 at "
            f"{addr}:{port}; rank 0 did not arrive", [0]) from e


def _register_and_wait(store: dist.Store, rank: int, world_size: int, backend: str, generation: str,
                       deadline: float, where: str) -> None:
    # One process per rank and generation; the same process may retry (same host:pid).
    me_id = f"{socket.gethostname()}:{os.getpid()}"
    holder = store.compare_set(f"claims/{rank}", "", me_id).decode()
    if holder != me_id:
        raise RendezvousError(f"rank {rank} of generation {generation!r} at {where} is already claimed by {holder}", [])
    me = {"pid": os.getpid(), "host": socket.gethostname(), "world_size": world_size, "backend": backend}
    store.set(f"arrived/{rank}", json.dumps(me))
    keys = [f"arrived/{r}" for r in range(world_size)]
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        store.wait(keys, timedelta(seconds=remaining))
    except dist.DistNetworkError as e:
        raise RendezvousError(f"rendezvous of generation {generation!r} lost the store at {where} (rank 0 left)",
                              [0] if rank else []) from e
    except dist.DistStoreError as e:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RendezvousError(
            f"rendezvous of generation {generation!r} at {where} timed out: ranks {missing} of world size "
            f"{world_size} did not arrive", missing) from e
    _check_agreement(store, keys, world_size, backend, generation)


def _check_agreement(store: dist.Store, keys: list[str], world_size: int, backend: str, generation: str) -> None:
    """Every rank must have been started with the same world size and backend."""
    peers = [json.loads(store.get(key)) for key in keys]
    odd = [r for r, p in enumerate(peers) if (p["world_size"], p["backend"]) != (world_size, backend)]
    if odd:
        raise RendezvousError(
            f"generation {generation!r}: ranks {odd} disagree on world size/backend "
            f"({[(peers[r]['world_size'], peers[r]['backend']) for r in odd]} vs {(world_size, backend)})", [])


def _device(backend: str, rank: int, local_rank: int | None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    index = local_rank if local_rank is not None else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)

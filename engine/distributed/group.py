"""The worker processes' torch.distributed group for DEP (data-parallel attention, expert-parallel MoE).

`init_group` forms one group per (re)start of the server:
- rank 0 (the head) hosts the rendezvous store (engine/distributed/rendezvous_store.py) bound to exactly
  master_addr:master_port, keyed with the cluster key when there is one (ipc/cluster_auth.py);
  every rank connects to it. torch's TCPStore is not used: it listens on every interface and
  authenticates nobody, and gloo's and NCCL's own rendezvous go through this store;
- gloo (and NCCL) listen on the interface that reaches master_addr (GLOO_SOCKET_IFNAME /
  NCCL_SOCKET_IFNAME, unless set already), not on whatever the host name resolves to;
- every key lives under `ringserve/<generation>/`, so a restarted group (new generation id) never
  meets a stale peer of an earlier one, even on the same store address;
- each rank first registers itself (`arrived/<rank>`, with its pid, host, world size and backend)
  and waits for all others: a rendezvous that does not complete in time raises one
  `RendezvousError` naming the ranks that never registered, instead of torch's anonymous timeout;
- then the main group (NCCL on GPU, gloo on CPU) and a gloo group for host-side coordination
  (step lockstep, EPLB loads) are formed, and a barrier on the gloo group proves both are usable;
- a rank whose parent (the server that started it) is gone stops waiting at once: no worker is
  left behind holding the store's port for the rendezvous timeout.

There is one DistGroup per process at a time (it is torch's default group). `close()` destroys
both groups and releases the store; afterwards the process holds no socket of the group.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .rendezvous_store import ClusterStore, StoreError, StoreServer, StoreTimeout

logger = logging.getLogger(__name__)

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
    _client: ClusterStore | None = field(repr=False, default=None)
    _server: StoreServer | None = field(repr=False, default=None)  # rank 0 only
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
            _close_store(self._client, self._server)
            self._client = self._server = None
            gc.collect()  # a group still held by a reference cycle (a backend's closure) keeps its threads until GC

    def _depart(self, grace_s: float) -> None:
        try:
            if self.rank != 0:
                self.store.add("departed", 1)
                return
            deadline = time.monotonic() + grace_s
            while self.store.add("departed", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        except StoreError:
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
    server, client = _open_store(rank, master_addr, master_port, timeout_s)
    store = dist.PrefixStore(f"ringserve/{generation}", client)  # keys: ringserve/<generation>/<key>
    try:
        _register_and_wait(store, rank, world_size, backend, generation, deadline, f"{master_addr}:{master_port}")
        _listen_toward(master_addr, backend)
        device = _device(backend, rank, local_rank)
        timeout = timedelta(seconds=collective_timeout_s or timeout_s)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier(group=cpu_group)  # every rank has finished building both groups
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        _close_store(client, server)
        raise
    return DistGroup(rank, world_size, backend, generation, device, dist.group.WORLD, cpu_group, store, client, server)


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


def _open_store(rank: int, addr: str, port: int, timeout_s: float) -> tuple[StoreServer | None, ClusterStore]:
    """Rank 0 hosts the store; every rank connects to it (the connection retries in the
    background; a rank whose parent dies stops waiting)."""
    server = None
    if rank == 0:
        try:
            server = StoreServer(addr, port)
        except StoreError as e:
            raise RendezvousError(f"rank 0 could not host the rendezvous store at {addr}:{port}: {e}", []) from e
    parent = os.getppid()
    client = ClusterStore(addr, port, timedelta(seconds=timeout_s), stop_waiting=lambda: os.getppid() != parent)
    return server, client


def _close_store(client: ClusterStore | None, server: StoreServer | None) -> None:
    if client is not None:
        client.close()
    if server is not None:
        server.stop()


def _register_and_wait(store: dist.Store, rank: int, world_size: int, backend: str, generation: str,
                       deadline: float, where: str) -> None:
    # One process per rank and generation; the same process may retry (same host:pid).
    me_id = f"{socket.gethostname()}:{os.getpid()}"
    parent = os.getppid()
    try:
        holder = store.compare_set(f"claims/{rank}", "", me_id).decode()
    except StoreTimeout as e:
        if os.getppid() != parent:
            raise RendezvousError(f"rank {rank}: the server that started it is gone", []) from e
        raise RendezvousError(
            f"rendezvous timed out: rank {rank} could not reach the store of rank 0 at {where}; rank 0 did not arrive",
            [0] if rank else []) from e
    if holder != me_id:
        raise RendezvousError(f"rank {rank} of generation {generation!r} at {where} is already claimed by {holder}", [])
    me = {"pid": os.getpid(), "host": socket.gethostname(), "world_size": world_size, "backend": backend}
    store.set(f"arrived/{rank}", json.dumps(me))
    keys = [f"arrived/{r}" for r in range(world_size)]
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        store.wait(keys, timedelta(seconds=remaining))
    except StoreTimeout as e:
        if os.getppid() != parent:
            raise RendezvousError(f"rank {rank}: the server that started it is gone", []) from e
        try:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except StoreTimeout:
            raise RendezvousError(f"rendezvous of generation {generation!r} lost the store at {where} (rank 0 left)",
                                  [0] if rank else []) from e
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


def _listen_toward(master_addr: str, backend: str) -> None:
    """Make gloo (and NCCL) listen on the interface that reaches master_addr, unless the operator
    named one: by default they take the address the host name resolves to, whatever it is."""
    name = interface_toward(master_addr)
    if name is None:
        logger.info("no interface found for %s; gloo/NCCL pick their own", master_addr)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    if backend == "nccl":
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def interface_toward(host: str) -> str | None:
    """The name of the local IPv4 interface whose address routes to `host` (None if not found)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only asks the kernel for a route
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except OSError:
        pass
    return None


def _device(backend: str, rank: int, local_rank: int | None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    index = local_rank if local_rank is not None else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)

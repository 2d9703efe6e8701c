"""Block-indexed KV transfer over NIXL: register pools, connect with a compatibility check, READ.

`KVTransport` wraps one `nixl_agent`. Both sides register their regions (a region = one or
more tensors [num_blocks, …], e.g. one KV pool, one tensor per writer layer); registration
prepares one NIXL descriptor per (tensor, block), so a transfer names blocks by index. The
reader (decode) connects to the server (prefill):

  1. metadata over the KV side channel (side_channel.py): the reader sends its NIXL metadata
     and gets the server's (UCX connection info and memory keys) back, over a ZeroMQ socket
     that only holders of the cluster key can talk to;
  2. `Hello{compat_hash, nonce}` as a notification; the server compares the hash with its own
     and answers `HelloReply{ok, compat_hash, regions}`: the geometry (base address, block
     bytes, block count per tensor) to READ from, or a refusal with the reason. The reader
     checks the reply's hash against `expected_hash` and the geometry against its own regions,
     then prepares the remote descriptor list. A mismatch on either side is `IncompatiblePeer`.

Handshake messages carry `protocol.HANDSHAKE_MAGIC`, so the transport consumes them and
`notifications()` returns only the application's. The server answers side-channel requests and
handshakes from `notifications()` / `pump()`: its loop must call one of them regularly (every
engine step).

A `Transfer` is usable only once `poll()` says "done": a transfer that fails (peer killed:
NIXL reports `nixlRemoteDisconnectError` ≈50–150 ms later) or times out raises
`TransferFailed`, and may have landed part of its bytes. A timed-out peer is disconnected so
that nothing more can land; the local blocks stay the caller's to discard.

NIXL's own metadata listener stays off (it binds every interface and answers anyone); the side
channel listens on `listen_host` (the prefill's advertised address), port `listen_port`.
Not thread-safe: one thread (the engine loop) drives a transport.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from . import protocol as wire
from .config import NIXL_INSTALL, NIXL_MODULES
from .side_channel import MetadataFetch, SideChannelError, SideChannelServer, agent_name

log = logging.getLogger(__name__)
_HANDSHAKE_RESEND_S = 0.5
_PENDING_HELLO_S = 5.0
_LOG_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
               "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}  # how long a server waits for a reader's metadata before dropping its Hello


class TransportError(RuntimeError):
    """Base of the transport's failures."""


class PeerUnavailable(TransportError):
    """The peer did not answer (metadata or handshake timed out) or is disconnected."""


class IncompatiblePeer(TransportError):
    """The peer's compatibility hash or region geometry differs from ours."""


class TransferFailed(TransportError):
    """A READ did not complete; `cause` is the NIXL error or the reason. Its bytes are garbage."""

    def __init__(self, message: str, cause: BaseException | str | None = None):
        super().__init__(message)
        self.cause = cause


def _nixl():
    """(nixl_agent, nixl_agent_config, bindings) from whichever NIXL wheel is installed."""
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        # NIXL's Python logger prints INFO to stdout; default it to WARN, honour NIXL_LOG_LEVEL.
        level = os.environ.get("NIXL_LOG_LEVEL", "WARN").upper()
        logging.getLogger("nixl").setLevel(_LOG_LEVELS.get(level, logging.WARNING))
        return api.nixl_agent, api.nixl_agent_config, api.nixlBind
    raise ImportError(f"NIXL is not installed (tried {', '.join(NIXL_MODULES)}): {NIXL_INSTALL}")


def unique_name(prefix: str) -> str:
    """An agent name no other process will use: NIXL refuses to load metadata under a name it
    already holds, so a restarted process must not reuse its predecessor's name."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


def compat_hash(identity: Mapping[str, Any], geometry: Sequence[Sequence[Any]]) -> str:
    """SHA-256 (hex) of what must match between the two sides: the caller's identity (model,
    dtypes, layout …; JSON-able values) and each region's shape apart from its block count."""
    body = msgspec.json.encode({"identity": identity, "regions": sorted(geometry)}, order="sorted")
    return hashlib.sha256(b"ringserve-kv-transfer/1\0" + body).hexdigest()


# ---- local state ----------------------------------------------------------------------------
@dataclass
class _Region:
    name: str
    tensors: list[torch.Tensor]
    num_blocks: int
    block_bytes: int
    mem_type: str  # NIXL's: 'DRAM' (host) or 'VRAM' (device)
    device_id: int
    offset: int  # index of (tensor 0, block 0) in the local descriptor list

    def shape_key(self) -> list[Any]:
        t = self.tensors[0]
        return [self.name, len(self.tensors), self.block_bytes, str(t.dtype), list(t.shape[1:])]

    def geometry(self) -> wire.RegionGeometry:
        return wire.RegionGeometry(self.name, self.mem_type, self.device_id, self.block_bytes,
                                   self.num_blocks, [t.data_ptr() for t in self.tensors])


def _make_region(name: str, value: torch.Tensor | Sequence[torch.Tensor], offset: int) -> _Region:
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    if not tensors:
        raise ValueError(f"region {name!r} has no tensors")
    t0 = tensors[0]
    for t in tensors:
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError(f"region {name!r}: every tensor needs the same shape, dtype and device")
        if not t.is_contiguous() or t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(f"region {name!r}: tensors must be contiguous [num_blocks, ...]")
    block_bytes = t0[0].numel() * t0.element_size()
    mem_type = "VRAM" if t0.device.type == "cuda" else "DRAM"
    device_id = t0.device.index or 0
    return _Region(name, tensors, t0.shape[0], block_bytes, mem_type, device_id, offset)


def _strided_rows(regions: Sequence[tuple[int, int, int, Sequence[int]]]) -> np.ndarray:
    """NIXL's compressed descriptor list: one row (addr, len, dev, stride, count) per tensor,
    expanding to `count` blocks, so descriptor index = offset + tensor · count + block."""
    rows = [(addr, block_bytes, dev, block_bytes, count)
            for block_bytes, count, dev, addrs in regions for addr in addrs]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


@dataclass
class _Peer:
    """A server we READ from."""

    name: str
    host: str
    port: int
    geometry: dict[str, wire.RegionGeometry]
    offsets: dict[str, int]
    dlist: Any  # prepared remote descriptor list
    transfers: set = field(default_factory=set)


@dataclass
class _PendingHello:
    hello: wire.Hello
    since: float


# ---- transfers ------------------------------------------------------------------------------
class Transfer:
    """One READ in flight. `poll()` → 'pending' | 'done', or raises TransferFailed."""

    def __init__(self, transport: "KVTransport", peer: str, handle: Any, nbytes: int, timeout_s: float | None):
        self._transport, self.peer, self._handle, self.nbytes = transport, peer, handle, nbytes
        self.started = time.monotonic()
        self._deadline = None if timeout_s is None else self.started + timeout_s
        self.state = "pending"  # 'pending' | 'done' | 'failed'
        self.finished: float | None = None
        self._error: TransferFailed | None = None

    @classmethod
    def failed(cls, transport: "KVTransport", peer: str, error: TransferFailed) -> "Transfer":
        t = cls(transport, peer, None, 0, None)
        t.state, t._error, t.finished = "failed", error, t.started
        return t

    def poll(self) -> str:
        if self.state == "done":
            return "done"
        if self.state == "failed":
            raise self._error
        try:
            status = self._transport._agent.check_xfer_state(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            self._transport._transfer_failed(self, f"READ from {self.peer} failed: {type(exc).__name__}: {exc}",
                                             exc, drop_peer=True)
            raise self._error from None
        if status == "DONE":
            self._transport._transfer_done(self)
            return "done"
        if status == "ERR":
            self._transport._transfer_failed(self, f"READ from {self.peer} failed (NIXL status ERR)", "ERR",
                                             drop_peer=True)
            raise self._error
        if self._deadline is not None and time.monotonic() > self._deadline:
            # A peer that stops answering (SIGSTOP, partition) never errors out by itself: give
            # up, and disconnect it so that no byte of this READ can land later.
            self._transport._transfer_failed(self, f"READ from {self.peer} timed out after "
                                                   f"{self._deadline - self.started:.1f} s", "timeout", drop_peer=True)
            raise self._error
        return "pending"

    def wait(self, timeout_s: float | None = None, sleep_s: float = 0.001) -> None:
        """Poll until done (TransferFailed on failure, TimeoutError after `timeout_s`)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() == "pending":
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"READ from {self.peer} still pending after {timeout_s} s")
            time.sleep(sleep_s)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop a pending READ (NIXL cancels it); later polls raise TransferFailed(reason)."""
        if self.state == "pending":
            self._transport._transfer_failed(self, f"READ from {self.peer} {reason}", reason, drop_peer=False)


# ---- the transport --------------------------------------------------------------------------
class KVTransport:
    """One NIXL agent: regions registered once, peers connected by handshake, READs by block."""

    def __init__(self, name: str, listen_port: int | None = None, backends: Sequence[str] = ("UCX",),
                 identity: Mapping[str, Any] | None = None, listen_host: str = "127.0.0.1"):
        nixl_agent, nixl_agent_config, self._nixl = _nixl()
        config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, listen_port=0,
                                   backends=list(backends))
        try:
            self._agent = nixl_agent(name, config)
        except RuntimeError as exc:
            raise TransportError(f"cannot start NIXL agent {name!r}: {exc}") from None
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            self._agent = None
            raise TransportError(f"NIXL backends not available: {missing}")
        self.name, self.listen_port = name, listen_port
        self._zmq = zmq.Context()
        self._side: SideChannelServer | None = None
        if listen_port is not None:
            try:
                self.listen_at(listen_host)
            except TransportError as exc:
                self._zmq.destroy(linger=0)
                self._agent = None
                raise TransportError(f"cannot start NIXL agent {name!r} (listen port {listen_port}): {exc}") from None
        self.identity = dict(identity or {})
        self._regions: dict[str, _Region] = {}
        self._reg_descs: list[Any] = []
        self._local_dlist: Any = None
        self._peers: dict[str, _Peer] = {}  # servers we READ from
        self._served: dict[str, float] = {}  # readers we accepted → last time we heard from them
        self._connecting: dict[str, "Handshake"] = {}
        self._pending_hellos: dict[str, _PendingHello] = {}
        self._fetched: dict[str, float] = {}  # readers whose metadata the side channel loaded → when
        self._inbox: list[tuple[str, bytes]] = []
        self._pending: set[Transfer] = set()
        self._digest: str | None = None
        self.closed = False

    def listen_at(self, host: str) -> None:
        """Serve the side channel on `host`:`listen_port` (moving it there if it listens elsewhere)."""
        if self._side is not None:
            if self._side.host == host:
                return
            self._side.close()
            self._side = None
        try:
            self._side = SideChannelServer(self._zmq, self._agent, self.name, host, self.listen_port)
        except SideChannelError as exc:
            raise TransportError(str(exc)) from None

    # -- registration ------------------------------------------------------------------------
    def register(self, regions: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """Register every region's tensors with NIXL (host or device memory, by tensor.device)
        and prepare the local descriptor list of all their blocks. Once per transport."""
        self._check_open()
        if self._regions:
            raise TransportError("regions are already registered")
        offset = 0
        built: dict[str, _Region] = {}
        for name in sorted(regions):
            if not re.fullmatch(wire.NAME_PATTERN, name) or len(name) > 128:
                raise ValueError(f"region name {name!r} must match {wire.NAME_PATTERN}")
            region = built[name] = _make_region(name, regions[name], offset)
            offset += len(region.tensors) * region.num_blocks
        if offset > wire.MAX_DESCRIPTORS:
            raise ValueError(f"{offset} block descriptors exceed {wire.MAX_DESCRIPTORS}")
        mem = {(r.mem_type, r.device_id) for r in built.values()}
        if len(mem) != 1:  # one prepared list covers every region, so one memory type and device
            raise ValueError(f"regions span several memories {sorted(mem)}; use one transport per device")
        for region in built.values():
            self._reg_descs.append(self._agent.register_memory(region.tensors))
        self._regions = built
        rows = _strided_rows([(r.block_bytes, r.num_blocks, r.device_id, [t.data_ptr() for t in r.tensors])
                              for r in built.values()])
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem.pop()[0])
        self._digest = compat_hash(self.identity, [r.shape_key() for r in built.values()])

    def layout_digest(self) -> str:
        """The compatibility hash both sides must share (identity + region geometry)."""
        if self._digest is None:
            raise TransportError("register() the regions first")
        return self._digest

    # -- connecting (reader side) ------------------------------------------------------------
    def start_connect(self, peer: str, host: str, port: int, expected_hash: str | None = None,
                      timeout_s: float = 10.0) -> "Handshake":
        """Begin connecting to a server; drive it with `Handshake.poll()` (or use `connect`)."""
        self._check_open()
        expected = self.layout_digest() if expected_hash is None else expected_hash
        if peer in self._peers:
            p = self._peers[peer]
            if (p.host, p.port) == (host, port):
                return Handshake.connected(self, peer)
            self.disconnect(peer)
        if peer in self._connecting:
            return self._connecting[peer]
        hs = self._connecting[peer] = Handshake(self, peer, host, port, expected, timeout_s)
        return hs

    def connect(self, peer: str, host: str, port: int, expected_hash: str | None = None,
                timeout_s: float = 10.0) -> None:
        """Connect to a server and validate compatibility (blocking; ≈0.1–0.2 s on loopback).
        IncompatiblePeer on a hash or geometry mismatch, PeerUnavailable on timeout."""
        hs = self.start_connect(peer, host, port, expected_hash, timeout_s)
        while hs.poll() == "pending":
            time.sleep(0.002)

    def disconnect(self, peer: str, reason: str = "disconnected", say_bye: bool = False) -> None:
        """Forget a server: fail its pending READs, release its descriptors, drop its metadata.
        `say_bye`: tell it first, so that it forgets us at once instead of after its idle prune."""
        if say_bye and peer in self._peers:
            try:
                self._agent.send_notif(peer, wire.encode_handshake(wire.Bye()))
            except Exception:  # already gone: nothing to tell
                pass
        p = self._peers.pop(peer, None)
        if p is not None:
            for t in list(p.transfers):
                self._transfer_failed(t, f"READ from {peer} failed: {reason}", reason, drop_peer=False)
            _quietly(p.dlist.release)
        self._forget_agent(peer)

    def is_connected(self, peer: str) -> bool:
        """Whether the handshake with this server completed (and it was not dropped since)."""
        return peer in self._peers

    def peers(self) -> list[str]:
        """Servers this transport is connected to."""
        return sorted(self._peers)

    def served(self) -> list[str]:
        """Readers this transport accepted."""
        return sorted(self._served)

    # -- transfers ---------------------------------------------------------------------------
    def read(self, peer: str, region: str | Sequence[str], remote_block_ids: Sequence[int],
             local_block_ids: Sequence[int], notify: bytes = b"", timeout_s: float | None = 30.0) -> Transfer:
        """READ blocks `remote_block_ids` of the peer's region(s) into our `local_block_ids` (the
        same ids for every region given). NIXL sends `notify` to the peer once it completed."""
        names = [region] if isinstance(region, str) else list(region)
        return self.read_many(peer, [(r, remote_block_ids, local_block_ids) for r in names], notify, timeout_s)

    def read_many(self, peer: str, items: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  notify: bytes = b"", timeout_s: float | None = 30.0) -> Transfer:
        """One READ for several (region, remote ids, local ids): one completion, one notify."""
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            return Transfer.failed(self, peer, TransferFailed(f"not connected to {peer}", "not connected"))
        local_idx, remote_idx, nbytes = self._indices(p, items)
        if not local_idx.size:
            if notify:
                self.send_notification(peer, notify)
            t = Transfer(self, peer, None, 0, None)
            t.state, t.finished = "done", t.started
            return t
        try:
            handle = self._agent.make_prepped_xfer("READ", self._local_dlist, local_idx, p.dlist, remote_idx, notify)
        except Exception as exc:
            self.disconnect(peer, f"{type(exc).__name__}: {exc}")
            return Transfer.failed(self, peer, TransferFailed(f"READ from {peer} not created: {exc}", exc))
        return self._post(p, handle, nbytes, timeout_s)

    def read_spans(self, peer: str, spans: Sequence[tuple[str, int, int, int, int]], notify: bytes = b"",
                   timeout_s: float | None = 30.0) -> Transfer:
        """One READ of byte ranges inside blocks: each span (region, local block, remote block,
        byte offset, bytes) is read in every tensor of the region. For moving exactly the rows
        a request needs (a partial last block, the trailing window) rather than whole blocks;
        it builds its descriptors per call instead of using the prepared lists."""
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            return Transfer.failed(self, peer, TransferFailed(f"not connected to {peer}", "not connected"))
        local, remote = self._span_rows(p, spans)
        nbytes = int(local[:, 1].sum()) if len(local) else 0
        if not nbytes:
            if notify:
                self.send_notification(peer, notify)
            t = Transfer(self, peer, None, 0, None)
            t.state, t.finished = "done", t.started
            return t
        mem = self._regions[spans[0][0]].mem_type
        try:
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, mem),
                                                 self._agent.get_xfer_descs(remote, mem), peer, notify)
        except Exception as exc:
            self.disconnect(peer, f"{type(exc).__name__}: {exc}")
            return Transfer.failed(self, peer, TransferFailed(f"READ from {peer} not created: {exc}", exc))
        return self._post(p, handle, nbytes, timeout_s)

    def _span_rows(self, p: _Peer, spans) -> tuple[np.ndarray, np.ndarray]:
        """[N, 3] (address, bytes, device) descriptor rows, local and remote, one per (span, tensor)."""
        local, remote = [], []
        for name, lblock, rblock, offset, nbytes in spans:
            region, geo = self._regions.get(name), p.geometry.get(name)
            if region is None or geo is None:
                raise KeyError(f"unknown region {name!r}")
            if not (0 <= lblock < region.num_blocks and 0 <= rblock < geo.num_blocks):
                raise ValueError(f"region {name}: block {lblock} (local) or {rblock} (remote) out of range")
            if offset < 0 or nbytes < 0 or offset + nbytes > region.block_bytes:
                raise ValueError(f"region {name}: span [{offset}, {offset + nbytes}) outside a "
                                 f"{region.block_bytes} B block")
            if not nbytes:
                continue
            for t, base in zip(region.tensors, geo.base_addrs):
                local.append((t.data_ptr() + lblock * region.block_bytes + offset, nbytes, region.device_id))
                remote.append((base + rblock * geo.block_bytes + offset, nbytes, geo.device_id))
        return np.array(local, dtype=np.uint64).reshape(-1, 3), np.array(remote, dtype=np.uint64).reshape(-1, 3)

    def _post(self, p: _Peer, handle: Any, nbytes: int, timeout_s: float | None) -> Transfer:
        t = Transfer(self, p.name, handle, nbytes, timeout_s)
        self._pending.add(t)
        p.transfers.add(t)
        try:
            status = self._agent.transfer(handle)
        except Exception as exc:
            self._transfer_failed(t, f"READ from {p.name} not posted: {type(exc).__name__}: {exc}", exc,
                                  drop_peer=True)
            return t
        if status == "ERR":
            self._transfer_failed(t, f"READ from {p.name} not posted (NIXL status ERR)", "ERR", drop_peer=True)
        return t

    def _indices(self, p: _Peer, items) -> tuple[np.ndarray, np.ndarray, int]:
        """Descriptor indices of every (tensor, block) of the items, local and remote."""
        local, remote, seen, nbytes = [], [], set(), 0
        for name, remote_ids, local_ids in items:
            region, geo = self._regions.get(name), p.geometry.get(name)
            if region is None or geo is None:
                raise KeyError(f"unknown region {name!r}")
            rid = _block_ids(remote_ids, geo.num_blocks, f"{name} remote")
            lid = _block_ids(local_ids, region.num_blocks, f"{name} local")
            if rid.size != lid.size:
                raise ValueError(f"region {name}: {rid.size} remote blocks but {lid.size} local blocks")
            if name in seen or np.unique(lid).size != lid.size:
                raise ValueError(f"region {name}: a local block is written twice")
            seen.add(name)
            for t in range(len(region.tensors)):
                local.append(region.offset + t * region.num_blocks + lid)
                remote.append(p.offsets[name] + t * geo.num_blocks + rid)
            nbytes += rid.size * len(region.tensors) * region.block_bytes
        return _int32(local), _int32(remote), nbytes

    def _transfer_done(self, t: Transfer) -> None:
        _quietly(t._handle.release)
        self._retire(t, "done")

    def _transfer_failed(self, t: Transfer, message: str, cause: Any, drop_peer: bool) -> None:
        t._error = TransferFailed(message, cause)
        if t._handle is not None:
            _quietly(t._handle.release)  # cancels a READ still in flight
        self._retire(t, "failed")
        if drop_peer and t.peer in self._peers:
            self.disconnect(t.peer, message)

    def _retire(self, t: Transfer, state: str) -> None:
        t.state, t.finished, t._handle = state, time.monotonic(), None
        self._pending.discard(t)
        p = self._peers.get(t.peer)
        if p is not None:
            p.transfers.discard(t)

    # -- notifications -----------------------------------------------------------------------
    def send_notification(self, peer: str, data: bytes) -> None:
        """Send application bytes to a connected server or an accepted reader."""
        self._check_open()
        if wire.is_handshake(data) or len(data) > wire.MAX_NOTIFICATION_BYTES:
            raise ValueError("notification is reserved (handshake prefix) or too large")
        if peer not in self._peers and peer not in self._served:
            raise PeerUnavailable(f"no connection with {peer}")
        try:
            self._agent.send_notif(peer, data)
        except Exception as exc:
            self._drop(peer, f"{type(exc).__name__}: {exc}")
            raise PeerUnavailable(f"notification to {peer} failed: {exc}") from None

    def notifications(self) -> list[tuple[str, bytes]]:
        """Application notifications received since the last call, as (peer, bytes); this also
        answers handshakes, so a server calls it every step."""
        self.pump()
        out, self._inbox = self._inbox, []
        return out

    def pump(self) -> None:
        """Answer side-channel requests; collect notifications: handle handshakes, queue the rest
        for `notifications()`."""
        self._check_open()
        if self._side is not None:
            now = time.monotonic()
            for reader in self._side.serve():
                self._fetched[reader] = now
        for peer, messages in self._agent.get_new_notifs().items():
            for data in messages:
                if wire.is_handshake(data):
                    self._on_handshake(peer, data)
                else:
                    if peer in self._served:
                        self._served[peer] = time.monotonic()
                    self._inbox.append((peer, data))
        self._answer_hellos()

    # -- handshake, server side --------------------------------------------------------------
    def _on_handshake(self, peer: str, data: bytes) -> None:
        try:
            msg = wire.decode_handshake(data)
        except wire.ProtocolError as exc:
            log.warning("dropping a malformed handshake from %s: %s", peer, exc)
            return
        if isinstance(msg, wire.Hello):
            self._pending_hellos[peer] = _PendingHello(msg, time.monotonic())
        elif isinstance(msg, wire.HelloReply):
            hs = self._connecting.get(peer)
            if hs is not None:
                hs._on_reply(msg)
        else:  # Bye
            self._drop(peer, "peer closed")

    def _answer_hellos(self) -> None:
        for peer, pending in list(self._pending_hellos.items()):
            if not self._agent.check_remote_metadata(peer):  # its metadata is still on its way
                if time.monotonic() - pending.since > _PENDING_HELLO_S:
                    del self._pending_hellos[peer]
                continue
            del self._pending_hellos[peer]
            self._answer(peer, pending.hello)

    def _answer(self, peer: str, hello: wire.Hello) -> None:
        ours = self.layout_digest()
        ok = hello.version == wire.HANDSHAKE_VERSION and hello.compat_hash == ours
        if ok:
            reply = wire.HelloReply(hello.nonce, True, ours, "",
                                    [r.geometry() for r in self._regions.values()])
        else:
            why = (f"handshake version {hello.version} != {wire.HANDSHAKE_VERSION}"
                   if hello.version != wire.HANDSHAKE_VERSION else
                   f"compatibility hash {hello.compat_hash[:16]}… != ours {ours[:16]}…")
            log.warning("refusing KV reader %s: %s", peer, why)
            reply = wire.HelloReply(hello.nonce, False, ours, why)
        try:
            self._agent.send_notif(peer, wire.encode_handshake(reply))
        except Exception as exc:  # stale metadata of an earlier incarnation: drop it, it will resend
            log.info("cannot answer %s (%s); dropping its metadata", peer, exc)
            self._forget_agent(peer)
            self._served.pop(peer, None)
            return
        if ok:
            self._served[peer] = time.monotonic()
        else:
            self._served.pop(peer, None)
            self._forget_agent(peer)

    def prune(self, idle_s: float) -> list[str]:
        """Forget accepted readers silent for `idle_s` (a decode that died without a Bye leaves
        its metadata and an endpoint behind); returns their names."""
        now = time.monotonic()
        gone = [p for p, seen in self._served.items() if now - seen > idle_s]
        for p in gone:
            self._drop(p, "idle")
        # Readers that fetched our metadata but never completed a handshake: forget them too.
        for p, since in list(self._fetched.items()):
            if p in self._served or p in self._pending_hellos:
                self._fetched.pop(p)
            elif now - since > idle_s:
                self._fetched.pop(p)
                self._forget_agent(p)
        return gone

    def _drop(self, peer: str, reason: str) -> None:
        self._served.pop(peer, None)
        self._pending_hellos.pop(peer, None)
        if peer in self._peers:
            self.disconnect(peer, reason)
        else:
            self._forget_agent(peer)

    def _forget_agent(self, peer: str) -> None:
        if self._agent is not None and self._agent.check_remote_metadata(peer):
            _quietly(lambda: self._agent.remove_remote_agent(peer))

    # -- lifecycle ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the transport holds (for tests and /debug)."""
        return {"regions": sorted(self._regions), "peers": self.peers(), "served": self.served(),
                "connecting": sorted(self._connecting), "pending_transfers": len(self._pending),
                "closed": self.closed}

    def close(self) -> None:
        """Tell peers goodbye, cancel READs, release descriptors, remove remote agents,
        deregister memory and drop the agent (its destructor stops NIXL's threads)."""
        if self.closed:
            return
        try:
            self.pump()  # peers that already said Bye are dropped, not sent one back
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        bye = wire.encode_handshake(wire.Bye())
        for peer in set(self._peers) | set(self._served):
            try:
                self._agent.send_notif(peer, bye)
            except Exception:  # already gone (it may have said Bye first): nothing to tell
                pass
        if self._peers or self._served:
            time.sleep(0.02)  # let the progress thread put the Byes on the wire
        for hs in list(self._connecting.values()):
            hs._fail(PeerUnavailable(f"connect to {hs.peer}: transport closed"))
        for peer in list(self._peers):
            self.disconnect(peer, "transport closed")
        for peer in list(self._served) + list(self._pending_hellos):
            self._forget_agent(peer)
        self._served.clear()
        self._pending_hellos.clear()
        if self._local_dlist is not None:
            _quietly(self._local_dlist.release)
        for descs in self._reg_descs:
            _quietly(lambda: self._agent.deregister_memory(descs))
        self._reg_descs.clear()
        self._regions.clear()
        self._local_dlist = None
        if self._side is not None:
            self._side.close()
            self._side = None
        self._zmq.destroy(linger=0)
        self._agent = None
        self.closed = True

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError("transport is closed")


# ---- handshake, reader side -----------------------------------------------------------------
class Handshake:
    """A connection in progress: metadata fetch, then Hello until a HelloReply comes back."""

    def __init__(self, transport: KVTransport, peer: str, host: str, port: int, expected: str, timeout_s: float):
        self.t, self.peer, self.host, self.port, self.expected = transport, peer, host, port, expected
        self.nonce = secrets.randbits(63)
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.stage = "metadata"  # → 'hello' → 'done' | 'failed'
        self.error: TransportError | None = None
        self._last_send = 0.0
        self._reply: wire.HelloReply | None = None
        transport._forget_agent(peer)  # stale metadata under this name would block loading the new
        # One request, queued until ZeroMQ connects (it retries in the background until the deadline).
        self._fetch: MetadataFetch | None = None
        self._unreachable: str | None = None  # raised by the first poll (never from here)
        try:
            self._fetch = MetadataFetch(transport._zmq, host, port, transport.name,
                                        transport._agent.get_agent_metadata())
        except (OSError, zmq.ZMQError) as exc:
            self._unreachable = f"connect to {peer} at {host}:{port}: {exc}"

    @classmethod
    def connected(cls, transport: KVTransport, peer: str) -> "Handshake":
        hs = cls.__new__(cls)
        hs.t, hs.peer, hs.stage, hs.error, hs._fetch = transport, peer, "done", None, None
        return hs

    def _load_metadata(self, reply) -> None:
        """The server's metadata came: load it under the name the params gave us, or fail."""
        if reply.name != self.peer:
            raise PeerUnavailable(f"{self.host}:{self.port} is KV server {reply.name!r}, not {self.peer!r}")
        loaded = agent_name(self.t._agent.add_remote_agent(reply.metadata))
        if loaded != self.peer:
            self.t._agent.remove_remote_agent(loaded)
            raise PeerUnavailable(f"{self.host}:{self.port} sent the metadata of {loaded!r}, not {self.peer!r}")
        self._close_fetch()

    def _close_fetch(self) -> None:
        if self._fetch is not None:
            self._fetch.close()
            self._fetch = None

    def _hello(self) -> None:
        self._last_send = time.monotonic()
        hello = wire.Hello(wire.HANDSHAKE_VERSION, self.expected, self.nonce)
        self.t._agent.send_notif(self.peer, wire.encode_handshake(hello))

    def poll(self) -> str:
        if self.stage == "done":
            return "done"
        if self.stage == "failed":
            raise self.error
        try:
            self._advance()
        except TransportError as exc:
            self._fail(exc)
        except Exception as exc:  # NIXL errors while fetching or notifying
            self._fail(PeerUnavailable(f"connect to {self.peer} at {self.host}:{self.port}: "
                                       f"{type(exc).__name__}: {exc}"))
        if self.stage == "failed":
            raise self.error
        return "pending" if self.stage != "done" else "done"

    def _advance(self) -> None:
        now = time.monotonic()
        if self.stage == "metadata":
            if self._unreachable is not None:
                raise PeerUnavailable(self._unreachable)
            try:
                reply = self._fetch.poll()
            except SideChannelError as exc:
                raise PeerUnavailable(f"connect to {self.peer}: {exc}") from None
            if reply is not None:
                self._load_metadata(reply)
                self.stage = "hello"
                self._hello()
        if self.stage == "hello":
            self.t.pump()
            if self._reply is not None:
                self._finish(self._reply)
                return
            if now - self._last_send > _HANDSHAKE_RESEND_S:
                self._hello()
        if self.stage != "done" and now > self.deadline:
            what = "metadata" if self.stage == "metadata" else "handshake reply"
            raise PeerUnavailable(f"no {what} from {self.peer} at {self.host}:{self.port} within "
                                  f"{self.deadline - self.started:.1f} s (wrong name or port, or not running)")

    def _on_reply(self, reply: wire.HelloReply) -> None:
        if reply.nonce == self.nonce and self.stage == "hello":
            self._reply = reply

    def _finish(self, reply: wire.HelloReply) -> None:
        if not reply.ok:
            raise IncompatiblePeer(f"{self.peer} refused us: {reply.reason}")
        if reply.compat_hash != self.expected:
            raise IncompatiblePeer(f"{self.peer} compatibility hash {reply.compat_hash[:16]}… != "
                                   f"expected {self.expected[:16]}…")
        geometry = {g.name: g for g in reply.regions}
        _check_geometry(self.peer, self.t._regions, geometry)
        offsets, offset = {}, 0
        for name in self.t._regions:  # our region order, so indices line up with our dlist
            offsets[name] = offset
            offset += len(geometry[name].base_addrs) * geometry[name].num_blocks
        rows = _strided_rows([(g.block_bytes, g.num_blocks, g.device_id, g.base_addrs)
                              for g in (geometry[n] for n in self.t._regions)])
        mem = {geometry[n].mem_type for n in self.t._regions}
        if len(mem) != 1:
            raise IncompatiblePeer(f"{self.peer} mixes host and device regions")
        dlist = self.t._agent.prep_xfer_dlist(self.peer, rows, mem.pop())
        self.t._peers[self.peer] = _Peer(self.peer, self.host, self.port, geometry, offsets, dlist)
        self.t._connecting.pop(self.peer, None)
        self.stage = "done"

    def _fail(self, error: TransportError) -> None:
        self.stage, self.error = "failed", error
        self._close_fetch()
        self.t._connecting.pop(self.peer, None)
        if self.t._agent is not None:
            self.t._forget_agent(self.peer)


def _check_geometry(peer: str, ours: Mapping[str, _Region], theirs: Mapping[str, wire.RegionGeometry]) -> None:
    if set(ours) != set(theirs):
        raise IncompatiblePeer(f"{peer} has regions {sorted(theirs)}, we have {sorted(ours)}")
    for name, r in ours.items():
        g = theirs[name]
        if (len(g.base_addrs), g.block_bytes) != (len(r.tensors), r.block_bytes):
            raise IncompatiblePeer(f"{peer} region {name}: {len(g.base_addrs)} tensors of {g.block_bytes} B "
                                   f"blocks, we have {len(r.tensors)} of {r.block_bytes} B")


def _block_ids(ids: Sequence[int], num_blocks: int, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{what} block ids must be in [0, {num_blocks})")
    return arr


def _int32(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def _quietly(fn) -> None:
    """Cleanup that must not stop the cleanup after it; failures are logged."""
    try:
        fn()
    except Exception as exc:
        log.warning("KV transport cleanup step failed: %s: %s", type(exc).__name__, exc)

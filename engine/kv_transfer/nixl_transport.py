"""NIXL as a KV transport: the data-plane primitives of `PeerTransport` over one `nixl_agent`.

Registration prepares one NIXL descriptor per (tensor, block) of every region (NIXL's strided
"compressed" rows), and connecting to a peer prepares the same list of its blocks, so the
block-indexed `read` / `read_many` (tests, perf/bench_kv_transfer.py) name blocks by index;
`read_spans` (what the connector uses) builds its descriptors per call. Notifications are NIXL
notifications; a READ's completion notifies the peer with the caller's bytes.

NIXL's own metadata listener stays off (it binds every interface and answers anyone): the KV
side channel (side_channel.py) carries the agent metadata. A failed READ shows as
`nixlRemoteDisconnectError` ≈50–150 ms after its peer died.
"""
from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import protocol as wire
from .peer_transport import PeerTransport, quietly
from .transfer import Transfer
from .regions import Region, unique_name
from .registry import NIXL_INSTALL, NIXL_MODULES
from .transport import TransferFailed, TransportError

__all__ = ["NixlTransport", "unique_name"]

_LOG_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
               "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def _nixl():
    """(nixl_agent, nixl_agent_config) from whichever NIXL wheel is installed."""
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        # NIXL's Python logger prints INFO to stdout; default it to WARN, honour NIXL_LOG_LEVEL.
        level = os.environ.get("NIXL_LOG_LEVEL", "WARN").upper()
        logging.getLogger("nixl").setLevel(_LOG_LEVELS.get(level, logging.WARNING))
        return api.nixl_agent, api.nixl_agent_config
    raise ImportError(f"NIXL is not installed (tried {', '.join(NIXL_MODULES)}): {NIXL_INSTALL}")


def _strided_rows(regions: Sequence[tuple[int, int, int, Sequence[int]]]) -> np.ndarray:
    """NIXL's compressed descriptor list: one row (addr, len, dev, stride, count) per tensor,
    expanding to `count` blocks, so descriptor index = offset + tensor · count + block."""
    rows = [(addr, block_bytes, dev, block_bytes, count)
            for block_bytes, count, dev, addrs in regions for addr in addrs]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


@dataclass
class _Remote:
    """A peer's prepared descriptor list and where each region starts in it."""

    dlist: Any
    offsets: dict[str, int]


class NixlTransport(PeerTransport):
    """One NIXL agent (UCX by default)."""

    kind = "NIXL"

    def __init__(self, name: str, listen_port: int | None = None, backends: Sequence[str] = ("UCX",),
                 identity: Mapping[str, Any] | None = None, listen_host: str = "127.0.0.1"):
        nixl_agent, nixl_agent_config = _nixl()
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
        self._reg_descs: list[Any] = []
        self._local_dlist: Any = None
        super().__init__(name, listen_port, identity, listen_host)

    # -- metadata ------------------------------------------------------------------------------
    def own_metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def has_remote(self, peer: str) -> bool:
        return self._agent.check_remote_metadata(peer)

    def load_remote(self, metadata: bytes) -> str:
        loaded = self._agent.add_remote_agent(metadata)
        return loaded.decode() if isinstance(loaded, bytes) else loaded  # bytes in the wheels we use

    def remove_remote(self, peer: str) -> None:
        self._agent.remove_remote_agent(peer)

    # -- notifications -------------------------------------------------------------------------
    def _send(self, peer: str, data: bytes) -> None:
        self._agent.send_notif(peer, data)

    def _receive(self) -> Mapping[str, Sequence[bytes]]:
        return self._agent.get_new_notifs()

    # -- memory --------------------------------------------------------------------------------
    def _register_memory(self, regions: dict[str, Region], mem_type: str) -> None:
        for region in regions.values():
            self._reg_descs.append(self._agent.register_memory(region.tensors))
        rows = _strided_rows([(r.block_bytes, r.num_blocks, r.device_id, [t.data_ptr() for t in r.tensors])
                              for r in regions.values()])
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type)

    def _connect_memory(self, peer: str, geometry: dict[str, wire.RegionGeometry], mem_type: str) -> _Remote:
        offsets, offset = {}, 0
        for name, g in geometry.items():  # our region order, so indices line up with our dlist
            offsets[name] = offset
            offset += len(g.base_addrs) * g.num_blocks
        rows = _strided_rows([(g.block_bytes, g.num_blocks, g.device_id, g.base_addrs) for g in geometry.values()])
        return _Remote(self._agent.prep_xfer_dlist(peer, rows, mem_type), offsets)

    def _release_remote(self, remote: _Remote) -> None:
        remote.dlist.release()

    # -- READs ---------------------------------------------------------------------------------
    def _create_span_read(self, peer: str, local: np.ndarray, remote: np.ndarray, mem_type: str,
                          notify: bytes) -> Any:
        return self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, mem_type),
                                           self._agent.get_xfer_descs(remote, mem_type), peer, notify)

    def _start_read(self, handle: Any) -> str:
        return self._agent.transfer(handle)

    def _read_state(self, handle: Any) -> str:
        return self._agent.check_xfer_state(handle)

    def _release_read(self, handle: Any) -> None:
        handle.release()

    def read(self, peer: str, region: str | Sequence[str], remote_block_ids: Sequence[int],
             local_block_ids: Sequence[int], notify: bytes = b"", timeout_s: float | None = 30.0) -> Transfer:
        """READ blocks `remote_block_ids` of the peer's region(s) into our `local_block_ids` (the
        same ids for every region given). NIXL sends `notify` to the peer once it completed."""
        names = [region] if isinstance(region, str) else list(region)
        return self.read_many(peer, [(r, remote_block_ids, local_block_ids) for r in names], notify, timeout_s)

    def read_many(self, peer: str, items: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  notify: bytes = b"", timeout_s: float | None = 30.0) -> Transfer:
        """One READ for several (region, remote ids, local ids), through the prepared lists:
        one completion, one notify."""
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            return Transfer.failed(self, peer, TransferFailed(f"not connected to {peer}", "not connected"))
        local_idx, remote_idx, nbytes = self._indices(p.geometry, p.remote, items)
        if not local_idx.size:
            if notify:
                self.send_notification(peer, notify)
            return Transfer.empty(self, peer)
        try:
            handle = self._agent.make_prepped_xfer("READ", self._local_dlist, local_idx, p.remote.dlist, remote_idx,
                                                   notify)
        except Exception as exc:
            return self._not_created(peer, exc)
        return self._post(p, handle, nbytes, timeout_s)

    def _indices(self, geometry: Mapping[str, wire.RegionGeometry], remote: _Remote,
                 items) -> tuple[np.ndarray, np.ndarray, int]:
        """Descriptor indices of every (tensor, block) of the items, local and remote."""
        local, remote_idx, seen, nbytes = [], [], set(), 0
        for name, remote_ids, local_ids in items:
            region, geo = self._regions.get(name), geometry.get(name)
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
                remote_idx.append(remote.offsets[name] + t * geo.num_blocks + rid)
            nbytes += rid.size * len(region.tensors) * region.block_bytes
        return _int32(local), _int32(remote_idx), nbytes

    # -- lifecycle -----------------------------------------------------------------------------
    def _close_backend(self) -> None:
        """Release the local descriptors, deregister memory, drop the agent (its destructor stops
        NIXL's threads)."""
        if self._local_dlist is not None:
            quietly(self._local_dlist.release)
        for descs in self._reg_descs:
            quietly(lambda: self._agent.deregister_memory(descs))
        self._reg_descs.clear()
        self._local_dlist = None
        self._agent = None


def _block_ids(ids: Sequence[int], num_blocks: int, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{what} block ids must be in [0, {num_blocks})")
    return arr


def _int32(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

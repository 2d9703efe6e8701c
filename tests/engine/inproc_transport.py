"""An in-process KV transport for tests: `PeerTransport`'s protocol (the keyed side channel, the
Hello / HelloReply handshake, the geometry and compatibility-hash checks, the transfer states)
over a data plane that is a dict of endpoints in this process and `ctypes.memmove`. Registered
under `--kv-transfer inproc`, it is what "adding a transport" takes: one module and one
registry line. Nothing here imports NIXL.

Knobs a test turns: `stall` (READs never complete), and closing the server (its endpoint leaves
the fabric: a READ from it then fails the way a dead NIXL peer does).
"""
from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.kv_transfer import protocol as wire
from engine.kv_transfer.peer_transport import PeerTransport
from engine.kv_transfer.regions import Region
from engine.kv_transfer.registry import TransportEntry, register_transport

NAME = "inproc"
_FABRIC: dict[str, "InProcTransport"] = {}  # the "network": endpoint name → endpoint
_PREFIX = b"inproc:"


class PeerGone(ConnectionError):
    pass


@dataclass
class _Read:
    peer: str
    local: np.ndarray  # [N, 3] (address, bytes, device)
    remote: np.ndarray
    notify: bytes
    polls: int = 0


class InProcTransport(PeerTransport):
    kind = "in-process"

    def __init__(self, name: str, listen_port: int | None = None, identity: Mapping[str, Any] | None = None,
                 listen_host: str = "127.0.0.1"):
        self._known: set[str] = set()  # peers whose metadata is loaded
        self._mailbox: dict[str, list[bytes]] = {}
        self.stall = False
        self.reads_posted = 0
        _FABRIC[name] = self
        super().__init__(name, listen_port, identity, listen_host)

    # -- metadata ------------------------------------------------------------------------------
    def own_metadata(self) -> bytes:
        return _PREFIX + self.name.encode()

    def has_remote(self, peer: str) -> bool:
        return peer in self._known

    def load_remote(self, metadata: bytes) -> str:
        if not metadata.startswith(_PREFIX):
            raise ValueError("not an in-process endpoint's metadata")
        name = metadata[len(_PREFIX):].decode()
        self._known.add(name)
        return name

    def remove_remote(self, peer: str) -> None:
        self._known.discard(peer)

    # -- notifications -------------------------------------------------------------------------
    def _send(self, peer: str, data: bytes) -> None:
        if peer not in self._known or peer not in _FABRIC:
            raise PeerGone(f"{peer} is not reachable")
        _FABRIC[peer]._mailbox.setdefault(self.name, []).append(bytes(data))

    def _receive(self) -> Mapping[str, Sequence[bytes]]:
        out, self._mailbox = self._mailbox, {}
        return out

    # -- memory and READs ----------------------------------------------------------------------
    def _register_memory(self, regions: dict[str, Region], mem_type: str) -> None:
        if mem_type != "DRAM":
            raise ValueError("the in-process transport moves host memory only")

    def _connect_memory(self, peer: str, geometry: dict[str, wire.RegionGeometry], mem_type: str) -> Any:
        return None  # addresses come with each READ's rows

    def _release_remote(self, remote: Any) -> None:
        pass

    def _create_span_read(self, peer: str, local: np.ndarray, remote: np.ndarray, mem_type: str,
                          notify: bytes) -> _Read:
        return _Read(peer, local.copy(), remote.copy(), notify)

    def _start_read(self, handle: _Read) -> str:
        self.reads_posted += 1
        return "PROC"

    def _read_state(self, handle: _Read) -> str:
        if handle.peer not in _FABRIC:
            raise PeerGone(f"{handle.peer} went away during a READ")
        handle.polls += 1
        if self.stall or handle.polls == 1:  # in flight for at least one poll, as a real READ is
            return "PROC"
        for (dst, nbytes, _), (src, _, _) in zip(handle.local.tolist(), handle.remote.tolist()):
            ctypes.memmove(dst, src, nbytes)
        if handle.notify:
            self._send(handle.peer, handle.notify)
        return "DONE"

    def _release_read(self, handle: _Read) -> None:
        pass

    def _close_backend(self) -> None:
        _FABRIC.pop(self.name, None)


register_transport(TransportEntry(NAME, f"{__name__}:InProcTransport", "nothing"))

"""`--kv-transfer NAME` → the KV transport that implements it (transport.py `KVTransport`).

Adding a transport is one module with a `PeerTransport` subclass (or any `KVTransport`) and one
`register_transport` line below. Entries name their class as "module:Class", imported only when
an engine opens one: the HTTP process validates flags and checks the library is installed
without importing it (no torch here either).
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport import KVTransport


@dataclass(frozen=True)
class TransportEntry:
    name: str  # the --kv-transfer value
    target: str  # "module:Class" of the KVTransport
    library: str  # what it needs, in messages
    modules: tuple[str, ...] = ()  # importable modules, any one of which provides the library
    install: str = ""  # how to install it


TRANSPORTS: dict[str, TransportEntry] = {}


def register_transport(entry: TransportEntry) -> None:
    TRANSPORTS[entry.name] = entry


def transport_names() -> tuple[str, ...]:
    return tuple(TRANSPORTS)


def entry(name: str) -> TransportEntry:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; one of {', '.join(TRANSPORTS)}") from None


def check_installed(name: str) -> None:
    """ValueError naming the flag, the library and its install line when it is missing."""
    e = entry(name)
    if e.modules and not any(importlib.util.find_spec(m) for m in e.modules):
        raise ValueError(f"--kv-transfer {name} needs {e.library}, which is not installed: {e.install}")


def transport_class(name: str) -> type["KVTransport"]:
    module, cls = entry(name).target.split(":")
    return getattr(importlib.import_module(module), cls)


def open_transport(name: str, agent_name: str, listen_port: int | None, *,
                   identity: Mapping[str, Any] | None = None, listen_host: str = "127.0.0.1") -> "KVTransport":
    """A started transport of kind `name` (listening on `listen_port` unless None)."""
    return transport_class(name)(agent_name, listen_port, identity=identity, listen_host=listen_host)


# The NIXL wheels ringserve can use (the CUDA 12 one is what the `pd` extra installs).
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
NIXL_INSTALL = "pip install 'ringserve[pd]' (or: pip install nixl-cu12)"
register_transport(TransportEntry("nixl", "engine.kv_transfer.nixl_transport:NixlTransport", "NIXL",
                                  NIXL_MODULES, NIXL_INSTALL))

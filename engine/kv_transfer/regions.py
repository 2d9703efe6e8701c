"""Registered KV regions and their geometry: what the two ends of a transfer must agree on,
whatever moves the bytes.

A region is one or more tensors [num_blocks, …] of one shape, dtype and device (ringserve: one
KV pool, one tensor per writer layer). Tensor t's block b lives at data_ptr(t) + b · block_bytes;
a peer learns the same numbers of ours from `RegionGeometry` (protocol.py) in the handshake.
The compatibility hash covers the caller's identity (model, layout, …) and every region's shape
apart from its block count.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from . import protocol as wire
from .transport import IncompatiblePeer


@dataclass
class Region:
    name: str
    tensors: list[torch.Tensor]
    num_blocks: int
    block_bytes: int
    mem_type: str  # 'DRAM' (host) or 'VRAM' (device)
    device_id: int
    offset: int  # index of (tensor 0, block 0) among all regions' blocks, in name order

    def shape_key(self) -> list[Any]:
        t = self.tensors[0]
        return [self.name, len(self.tensors), self.block_bytes, str(t.dtype), list(t.shape[1:])]

    def geometry(self) -> wire.RegionGeometry:
        return wire.RegionGeometry(self.name, self.mem_type, self.device_id, self.block_bytes,
                                   self.num_blocks, [t.data_ptr() for t in self.tensors])


def make_region(name: str, value: torch.Tensor | Sequence[torch.Tensor], offset: int) -> Region:
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
    return Region(name, tensors, t0.shape[0], block_bytes, mem_type, device_id, offset)


def build_regions(regions: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> dict[str, Region]:
    """{name: Region} in name order (both sides order regions so), checked: names the wire
    accepts, a bounded number of blocks, and one memory (type, device) for all of them."""
    offset = 0
    built: dict[str, Region] = {}
    for name in sorted(regions):
        if not re.fullmatch(wire.NAME_PATTERN, name) or len(name) > 128:
            raise ValueError(f"region name {name!r} must match {wire.NAME_PATTERN}")
        region = built[name] = make_region(name, regions[name], offset)
        offset += len(region.tensors) * region.num_blocks
    if offset > wire.MAX_DESCRIPTORS:
        raise ValueError(f"{offset} block descriptors exceed {wire.MAX_DESCRIPTORS}")
    mem = {(r.mem_type, r.device_id) for r in built.values()}
    if len(mem) != 1:  # one transfer covers every region, so one memory type and device
        raise ValueError(f"regions span several memories {sorted(mem)}; use one transport per device")
    return built


def compat_hash(identity: Mapping[str, Any], geometry: Sequence[Sequence[Any]]) -> str:
    """SHA-256 (hex) of what must match between the two sides: the caller's identity (model,
    dtypes, layout …; JSON-able values) and each region's shape apart from its block count."""
    body = msgspec.json.encode({"identity": identity, "regions": sorted(geometry)}, order="sorted")
    return hashlib.sha256(b"ringserve-kv-transfer/1\0" + body).hexdigest()


def check_geometry(peer: str, ours: Mapping[str, Region], theirs: Mapping[str, wire.RegionGeometry]) -> None:
    """IncompatiblePeer unless the peer has our regions, each with our tensor count and block size."""
    if set(ours) != set(theirs):
        raise IncompatiblePeer(f"{peer} has regions {sorted(theirs)}, we have {sorted(ours)}")
    for name, r in ours.items():
        g = theirs[name]
        if (len(g.base_addrs), g.block_bytes) != (len(r.tensors), r.block_bytes):
            raise IncompatiblePeer(f"{peer} region {name}: {len(g.base_addrs)} tensors of {g.block_bytes} B "
                                   f"blocks, we have {len(r.tensors)} of {r.block_bytes} B")


def span_rows(ours: Mapping[str, Region], theirs: Mapping[str, wire.RegionGeometry],
              spans: Sequence[tuple[str, int, int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """[N, 3] uint64 (address, bytes, device) rows, local and remote, one per (span, tensor):
    each span (region, local block, remote block, byte offset, bytes) in every tensor of the
    region. KeyError for an unknown region, ValueError for a block or byte range outside it."""
    local, remote = [], []
    for name, lblock, rblock, offset, nbytes in spans:
        region, geo = ours.get(name), theirs.get(name)
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


def unique_name(prefix: str) -> str:
    """An agent name no other process will use: a transport may refuse to load metadata under a
    name it already holds, so a restarted process must not reuse its predecessor's name."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"

"""Per-block digests of KV rows: computed by the prefill at hand-off, re-computed by the decode
after its READ and compared before any row is used.

A block's digest is CRC32C (hardware, ≈4 GB/s here) over that block's bytes in every tensor of
the group, in the order given, chained. CRC32C detects every single-bit flip and every burst
up to 32 bits, and a stale or reused block (other content entirely) with probability 1 − 2⁻³².
It is an integrity check against accidents (a slot reused while a transfer was in flight, a
torn or partial transfer, a wrong block id), not a MAC: a peer that lies is out of scope
(the params MAC in `protocol` covers the ids and digests themselves).

Whole blocks are digested, rows past the prompt's last token included: the READ copies them
too, so both sides see the same bytes as long as nobody writes a held block.
"""
from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np
import torch


class DigestMismatch(RuntimeError):
    """Blocks whose bytes differ from what the sender digested; `positions` index the block list."""

    def __init__(self, positions: list[int], block_ids: Sequence[int]):
        shown = ", ".join(f"#{p} (block {block_ids[p]})" for p in positions[:8])
        more = f" and {len(positions) - 8} more" if len(positions) > 8 else ""
        super().__init__(f"{len(positions)} of {len(block_ids)} blocks fail their digest: {shown}{more}")
        self.positions = positions


def _host_rows(t: torch.Tensor, block_ids: Sequence[int]) -> np.ndarray:
    """[len(ids), block bytes] uint8 on the host; a zero-copy view per block on CPU tensors."""
    rows = t[torch.as_tensor(list(block_ids), dtype=torch.long, device=t.device)]  # [n, ...]
    return rows.contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()


def block_digests(tensors: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[int]:
    """One CRC32C per block id over `tensors[0][b], tensors[1][b], …` (each tensor
    [num_blocks, …], block-major and contiguous)."""
    crcs = [0] * len(block_ids)
    if not block_ids:
        return crcs
    for t in tensors:
        if t.device.type == "cpu" and t.is_contiguous():
            flat = t.view(torch.uint8).reshape(t.shape[0], -1).numpy()  # [num_blocks, block bytes]
            for i, b in enumerate(block_ids):
                crcs[i] = crc32c.crc32c(flat[b], crcs[i])
        else:  # device memory: one gather and one copy per tensor, then the same CRC
            rows = _host_rows(t, block_ids)
            for i in range(len(block_ids)):
                crcs[i] = crc32c.crc32c(rows[i], crcs[i])
    return crcs


def mismatches(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
    """Positions in `block_ids` whose digest is not `expected`."""
    if len(expected) != len(block_ids):
        raise ValueError(f"{len(expected)} digests for {len(block_ids)} blocks")
    got = block_digests(tensors, block_ids)
    return [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]


def verify(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], expected: Sequence[int]) -> None:
    """Raise DigestMismatch unless every block matches its digest."""
    bad = mismatches(tensors, block_ids, expected)
    if bad:
        raise DigestMismatch(bad, block_ids)


def span_digests(pieces: Sequence[tuple[Sequence[torch.Tensor], Sequence[tuple[int, int, int]]]],
                 num_blocks: int) -> list[int]:
    """One CRC32C per block of a group's block list (length `num_blocks`) over exactly the bytes
    that cross. `pieces`: per pool, (its tensors in layer order, its spans as (position in the
    block list, physical block id, byte offset in the block, bytes)). Chained pool by pool in
    the given order, then layer by layer, so both sides get one value from the same bytes."""
    crcs = [0] * num_blocks
    for tensors, spans in pieces:
        for t in tensors:
            flat = _flat_bytes(t, sorted({block for _, block, _, _ in spans}))
            for pos, block, offset, nbytes in spans:
                crcs[pos] = crc32c.crc32c(flat[block][offset:offset + nbytes], crcs[pos])
    return crcs


def _flat_bytes(t: torch.Tensor, block_ids: Sequence[int]):
    """{block id: uint8 row of its bytes}: zero-copy views on host memory, one gather for device memory."""
    if t.device.type == "cpu" and t.is_contiguous():
        flat = t.view(torch.uint8).reshape(t.shape[0], -1).numpy()  # [num_blocks, block bytes]
        return {b: flat[b] for b in block_ids}
    rows = _host_rows(t, block_ids) if block_ids else np.zeros((0, 0), np.uint8)
    return dict(zip(block_ids, rows))

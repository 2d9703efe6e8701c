"""Exactly which KV bytes cross from a prefill to a decode for a prompt of n tokens.

Per pool (`engine/kv_layout.py`), a range of the sequence's records:
  * full pools (compressed KV, index keys): every complete record, [0, ⌊n / m⌋) — an entry
    summarises m positions and exists once all m are computed;
  * sliding pools (one record per position): the rows the maths at positions ≥ n still reads
    (engine/v4/attention.py), with k = ⌊n / m⌋:
      swa                 window KV           [n − W + 1, n)       W − 1 rows
      state_c{m}_csa,     overlapping         [m·(k − 1), n)       m + n mod m rows (the
      state_idx{m}        compressors                              previous window and the partial one)
      state_c{m}_hca      plain compressor    [m·k, n)             n mod m rows (the partial window)
    (clipped at 0); a sliding pool of another name moves its whole window, a safe superset.
So the bytes per request are the layout's global bytes per token (`kv-report`) × n, up to the
incomplete last record of each compressed pool, plus that fixed state, which is at most
`kv-report`'s per-sequence state; nothing of a block that the decode would not read moves.

A record range becomes byte spans per logical block (a block of a pool tensor is
`records_per_block` records of `record_bytes`), the same for every tensor (layer) of the pool.
Both sides derive the plan from (layout, n) alone; only block ids cross. Digests are per
(group, logical block): CRC32C chained over that block's spans, pools by name, layers in order.

With `replay_tokens` > 0 (V4.1: window rows are rebuilt, not moved) the sliding pools are left
out and the decode resumes computing at `resume_from` = n − replay_tokens, rounded down to a
multiple of `align`. `replay_policy` picks both: for V4.1 by default the receptive field of the
window stack, block-aligned, which makes the replay exact (engine/prefix_cache.py: rows before
the replay point read as zeros and their error dies out before n; the global records below n are
the prefill's, never rewritten); a smaller `--kv-replay-tokens` is the bounded approximation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipc.kv_transfer_params import GROUPS

from ..models import registry
from .protocol import expected_blocks

if TYPE_CHECKING:
    from engine.kv_layout import KVLayout


@dataclass(frozen=True)
class PoolRange:
    """Records [first, end) of one pool for one sequence."""

    pool: str
    group: str
    first: int
    end: int
    record_bytes: int
    records_per_block: int
    num_layers: int

    @property
    def nbytes(self) -> int:
        return (self.end - self.first) * self.record_bytes * self.num_layers

    def spans(self) -> list[tuple[int, int, int]]:
        """(logical block, byte offset in the block, bytes) covering the range, block by block."""
        rpb, rb = self.records_per_block, self.record_bytes
        out = []
        r = self.first
        while r < self.end:
            block = r // rpb
            stop = min(self.end, (block + 1) * rpb)
            out.append((block, (r - block * rpb) * rb, (stop - r) * rb))
            r = stop
        return out


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int
    block_size: int
    ranges: tuple[PoolRange, ...]  # pools sorted by name
    blocks: dict[str, tuple[int, int]]  # group → logical blocks [first, end) whose ids cross
    resume_from: int  # the decode computes from this position (n, or n − replay)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    def group_bytes(self, group: str) -> int:
        return sum(r.nbytes for r in self.ranges if r.group == group)

    def range(self, pool: str) -> PoolRange:
        return next(r for r in self.ranges if r.pool == pool)


def sliding_rows(pool: str, window: int, n: int) -> int:
    """First position of a sliding pool that the steps after n tokens still read (table above)."""
    if pool == "swa":
        return max(0, n - window + 1)
    if pool.startswith("state_idx") or (pool.startswith("state_c") and pool.endswith("_csa")):
        m = window // 2  # an overlapping compressor keeps two windows
        return m * max(0, n // m - 1)
    if pool.startswith("state_c") and pool.endswith("_hca"):
        return window * (n // window)
    return max(0, n - window)


def sliding_window(layout: "KVLayout") -> int:
    """Trailing positions a sliding pool can be read back (the widest pool window)."""
    return max((p.window for p in layout.pools if p.group == "sliding"), default=0)


def replay_policy(layout: "KVLayout", arch: str, requested: int, receptive_field: int) -> tuple[int, int]:
    """(replay tokens, alignment of the replay point) for an engine: V4 moves the sliding rows
    unless asked to replay (`requested` > 0); V4.1 always replays: `requested` positions if
    given (bounded, approximate), else the receptive field from a block boundary (exact)."""
    if not registry.get(arch).capabilities.pd_replays_sliding_state or requested > 0:
        return requested, 1
    return max(1, receptive_field), layout.block_size


def make_plan(layout: "KVLayout", num_tokens: int, replay_tokens: int = 0, align: int = 1) -> TransferPlan:
    """The plan for a prompt of `num_tokens` tokens (≥ 1)."""
    if num_tokens < 1:
        raise ValueError(f"a transfer needs at least one prompt token, got {num_tokens}")
    n, b = num_tokens, layout.block_size
    ranges = []
    for p in sorted(layout.pools, key=lambda p: p.name):
        if p.group == "full":
            first, end = 0, n // p.tokens_per_record
        elif replay_tokens:
            continue  # rebuilt on the decode by replaying its last prompt positions
        else:
            if p.tokens_per_record != 1:
                raise ValueError(f"sliding pool {p.name} must hold one record per position")
            first, end = sliding_rows(p.name, p.window, n), n
        ranges.append(PoolRange(p.name, p.group, first, end, p.record_bytes, b // p.tokens_per_record,
                                len(p.layers)))
    blocks = expected_blocks(n, b, sliding_window(layout))
    if replay_tokens:
        blocks["sliding"] = (blocks["sliding"][1], blocks["sliding"][1])  # no sliding block crosses
    assert set(blocks) == set(GROUPS)
    resume = max(0, n - replay_tokens) // align * align if replay_tokens else n
    return TransferPlan(n, b, tuple(ranges), blocks, resume)

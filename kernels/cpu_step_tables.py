"""The slot tables of a static decode step (engine/v4/step_meta.py's `StepMeta`) built in numba, for
the compiled CPU step (kernels/cpu_step.py).

Same tables, same integers: where each query's window keys live, where this step's keys and
compressor rows go, which entry a token completes, which entries a query may see. The batch
arrives as the views of one `DecodeBatch` buffer (int64); a slot of −1 means "nothing there",
an invalid write position maps to slot 0 (the dummy block), exactly as `DecodeBatch.sliding_slots`
and `entry_slots` compute them with torch ops. Everything here is integer arithmetic, so the
tables equal StepMeta's bit for bit (tests/kernels/test_cpu_step.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, error_model="numpy")
def sliding_slot(pos, b, sliding_table, sliding_first, block):
    """(slot, valid) of position pos of sequence b in the sliding pools (DecodeBatch.sliding_slots)."""
    logical = pos // block - sliding_first[b]          # numba's // and % on ints floor, as torch's
    width = sliding_table.shape[1]
    valid = pos >= 0 and 0 <= logical < width
    clamped = min(max(logical, 0), width - 1)
    slot = sliding_table[b, clamped] * block + pos % block
    return (slot if valid else 0), valid


@njit(cache=True, error_model="numpy")
def entry_slot(entry, b, full_table, block, tokens_per_record):
    """Slot of entry `entry` of sequence b in a full pool of records of `tokens_per_record`
    positions each (DecodeBatch.entry_slots)."""
    per_block = block // tokens_per_record
    return full_table[b, entry // per_block] * per_block + entry % per_block


@njit(cache=True, error_model="numpy")
def window_tables(positions, start, sliding_table, sliding_first, block, window, writes, slots):
    """writes [B·q] int64: this step's window slots; slots [B·q, W−1] int32: positions
    start−W+1 .. start−1 inside each query's window, −1 elsewhere (StepMeta.window_*)."""
    b_n = start.shape[0]
    q = positions.shape[0] // b_n
    for b in range(b_n):
        for j in range(q):
            r = b * q + j
            pos = positions[r]
            writes[r] = sliding_slot(pos, b, sliding_table, sliding_first, block)[0]
            for i in range(window - 1):
                hist = start[b] - (window - 1) + i
                slot, valid = sliding_slot(hist, b, sliding_table, sliding_first, block)
                slots[r, i] = slot if valid and hist > pos - window else -1


@njit(cache=True, error_model="numpy")
def span_rows(start, sliding_table, sliding_first, block, span, q, rows):
    """rows [B, span−1+q] int64: compressor-state slots of positions start−span+1 .. start+q−1,
    −1 where invalid (StepMeta.rows[span])."""
    for b in range(start.shape[0]):
        for i in range(span - 1 + q):
            slot, valid = sliding_slot(start[b] - (span - 1) + i, b, sliding_table, sliding_first, block)
            rows[b, i] = slot if valid else -1


@njit(cache=True, error_model="numpy")
def ratio_tables(positions, start, full_table, block, ratio, completes, counts, entry_pos, visible):
    """For compression ratio m: completes [B, q] (the entry slot a token completes, or −1),
    counts [B] (entries after the step), entry_pos [B, q] (the position whose compress RoPE an
    entry takes: entry·m) and, when visible has columns, visible [B·q, E] (every entry a query
    may see, −1 past it). StepMeta.completes / counts / entry_rope / visible."""
    b_n = start.shape[0]
    q = positions.shape[0] // b_n
    n_entries = visible.shape[1]
    for b in range(b_n):
        counts[b] = (start[b] + q) // ratio
        for j in range(q):
            r = b * q + j
            pos = positions[r]
            entry = pos // ratio
            entry_pos[b, j] = entry * ratio
            completes[b, j] = entry_slot(entry, b, full_table, block, ratio) if (pos + 1) % ratio == 0 else -1
            seen = (pos + 1) // ratio
            for e in range(n_entries):
                visible[r, e] = entry_slot(e, b, full_table, block, ratio) if e < seen else -1


@njit(cache=True, error_model="numpy")
def rope_rows(table_cos, table_sin, positions, cos, sin):
    """cos/sin [N, r/2] = rows `positions` [N] of a precomputed RotaryTable (kernels/cpu_step_plan.py
    fills the table with the RotaryTable's own values)."""
    for i in range(positions.shape[0]):
        cos[i] = table_cos[positions[i]]
        sin[i] = table_sin[positions[i]]

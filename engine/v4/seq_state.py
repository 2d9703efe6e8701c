"""Per-sequence attention state, indexed by absolute token position.

A sequence's state after `num_tokens` tokens holds, for every layer:
  * window rows   — post-RoPE KV of the last `sliding_window − 1` positions (+ slack),
  * compressor    — raw (C, Z + ape) rows of the positions the next compressed entry still needs:
                    the partial window, and for the overlapping (CSA) compressor the previous
                    window too (its Ca half feeds the next entry),
  * entries       — compressed KV entries, entry w summarising positions [m·w, m·w + m),
  * index keys    — the lightning indexer's compressed keys (CSA layers).

Invariant: every quantity is a function of (position → row). Nothing is "consumed": the number
of complete entries after n tokens is ⌊n / m⌋ and the rows a step needs are looked up by
position, so the state keeps no counter of its own (the caller knows each step's positions).
Rolling back a speculative step is just computing from a lower position again, provided the
rings were sized with `slack` ≥ the tokens written per step. The paged KV pools keep the same
position → slot contract, so the attention maths does not change when the storage does.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


class PositionRing:
    """Rows for the most recent `capacity` positions, slot = position mod capacity."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device | str):
        self.capacity = capacity
        self.buf = torch.zeros(capacity, width, dtype=dtype, device=device)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store rows for positions [start, start + len(rows)); only the last `capacity` survive."""
        n = rows.shape[0]
        if n > self.capacity:
            start, rows, n = start + n - self.capacity, rows[-self.capacity :], self.capacity
        slots = torch.arange(start, start + n, device=self.buf.device) % self.capacity
        self.buf[slots] = rows.to(self.buf.dtype)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end); the caller guarantees they are among the last `capacity` written."""
        assert 0 <= end - start <= self.capacity, (start, end, self.capacity)
        slots = torch.arange(start, end, device=self.buf.device) % self.capacity
        return self.buf[slots]


class GrowingRows:
    """Append-by-index rows (compressed entries); row i lives at index i, capacity doubles."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str, initial: int = 16):
        self.buf = torch.zeros(initial, width, dtype=dtype, device=device)

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self.buf.shape[0]:
            grown = torch.zeros(max(end, 2 * self.buf.shape[0]), self.buf.shape[1], dtype=self.buf.dtype,
                                device=self.buf.device)
            grown[: self.buf.shape[0]] = self.buf
            self.buf = grown
        self.buf[start:end] = rows.to(self.buf.dtype)

    def read(self, count: int) -> torch.Tensor:
        return self.buf[:count]


class CompressorState:
    """Raw rows awaiting compression plus the entries emitted so far for one compressor."""

    def __init__(self, ratio: int, overlap: bool, row_width: int, entry_width: int, slack: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.ratio = ratio
        self.overlap = overlap
        # Enough history to rebuild the newest partial window (and its predecessor when overlapping).
        self.rows = PositionRing((2 if overlap else 1) * ratio + slack, row_width, torch.float32, device)
        self.entries = GrowingRows(entry_width, dtype, device)


class LayerState:
    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, slack: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.window = PositionRing(max(cfg.sliding_window - 1, 1) + slack, cfg.head_dim, dtype, device)
        self.compressor: CompressorState | None = None
        self.indexer: CompressorState | None = None
        if kind != "swa":
            overlap = kind == "csa"
            width = (2 if overlap else 1) * cfg.head_dim
            # Row = [C | Z + ape], kept in fp32 because the pooling softmax is defined in fp32.
            self.compressor = CompressorState(ratio, overlap, 2 * width, cfg.head_dim, slack, dtype, device)
        if kind == "csa":
            width = 2 * cfg.index_head_dim
            self.indexer = CompressorState(ratio, True, 2 * width, cfg.index_head_dim, slack, dtype, device)


class SequenceState:
    """All layers' state of one sequence (the model's layers, then its MTP layers), dense."""

    def __init__(self, cfg: ModelConfig, kinds: list[str], ratios: list[int], dtype: torch.dtype,
                 device: torch.device | str = "cpu", slack: int = 8):
        self.layers = [LayerState(cfg, k, r, slack, dtype, device) for k, r in zip(kinds, ratios)]

    def layer(self, index: int) -> LayerState:
        return self.layers[index]

"""Applying grammar bitmasks to logits on their device.

A bitmask row holds ceil(V / 32) int32 words; bit (i mod 32) of word i // 32 is set when token
i is allowed (xgrammar's layout). Disallowed logits become −inf. Pure tensor ops on the logits'
device: no host read, fixed shapes, so it runs inside a captured step as well.
"""

from __future__ import annotations

import torch


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 words → [R, vocab] bool (True: allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made on the device: no copy
    return ((bitmask[..., None] >> bits) & 1).flatten(-2)[..., :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] with rows `rows` [R] (all N when None) masked by `bitmask` [R, W]:
    disallowed tokens set to −inf. Returns the masked logits (a new tensor)."""
    allowed = unpack(bitmask, logits.shape[-1])  # [R, V]
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out

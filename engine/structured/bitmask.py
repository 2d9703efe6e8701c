"""Applying grammar bitmasks to logits on their device.

A bitmask row holds ceil(V / 32) int32 words; bit (i mod 32) of word i // 32 is set when token
i is allowed (xgrammar's layout). Disallowed logits become −inf. On a GPU: pure tensor ops on the
logits' device (no host read, fixed shapes, so it runs inside a captured step as well). On the
CPU: xgrammar's own CPU kernel, one pass in C++ — the five small torch ops cost 0.2–0.4 ms alone
but 50–170 ms inside a CPU decode step, where each waited on torch's thread pool beside numba's.
"""

from __future__ import annotations

import numpy as np
import torch


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 words → [R, vocab] bool (True: allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made on the device: no copy
    return ((bitmask[..., None] >> bits) & 1).flatten(-2)[..., :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] with rows `rows` [R] (all N when None) masked by `bitmask` [R, W]:
    disallowed tokens set to −inf. Returns the masked logits (a new tensor)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.device.type == "cpu":
        return _apply_on_cpu(logits, bitmask, rows)
    return apply_bitmask_ops(logits, bitmask, rows)


def apply_bitmask_ops(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """apply_bitmask as torch ops on the logits' device (the GPU's path; capturable)."""
    allowed = unpack(bitmask, logits.shape[-1])  # [R, V]
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def _apply_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """xgrammar's CPU kernel, with every copy and placement in numpy: inside a CPU decode step a
    small torch op (a clone, an index_put) waited up to tens of milliseconds on torch's thread
    pool beside numba's."""
    import xgrammar as xgr

    out = torch.from_numpy(logits.detach().numpy().copy())  # [N, V]
    vocab = logits.shape[-1]
    if rows is None:
        xgr.apply_token_bitmask_inplace(out, bitmask.contiguous(), vocab_size=vocab)
        return out
    # xgrammar reads bitmask row i for logits row i: ours go to their logits rows
    index = rows.numpy()
    placed = np.full((logits.shape[0], bitmask.shape[-1]), -1, dtype=np.int32)  # [N, W]: all allowed
    placed[index] = bitmask.numpy()
    xgr.apply_token_bitmask_inplace(out, torch.from_numpy(placed), vocab_size=vocab, indices=index.tolist())
    return out

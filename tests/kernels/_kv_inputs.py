"""Input builders shared by the KV format tests (random and adversarial rows)."""
from __future__ import annotations

import torch

FORMAT_DIMS = {"bf16": 512, "fp8_ds_mla": 512, "fp4_kv": 512, "fp4_index": 128}
FLT_MAX = torch.finfo(torch.float32).max


def random_rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, 1, generator=g) * 3)          # block magnitudes over decades
    return torch.randn(n, dim, generator=g) * scale


def adversarial_rows(dim: int) -> torch.Tensor:
    """Rows of special values: zeros, huge, NaN/Inf, subnormals, scale and rounding boundaries."""
    specials = torch.tensor([
        0.0, -0.0, 1e-45, -1e-45, 1e-40, 1e-38, 1e-4, 1e-5, FLT_MAX, -FLT_MAX, 1e30, -1e38,
        float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 449.0, 6.0, 2688.0, 2700.0,
        0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10,
        2.0 ** -9, 2.0 ** -7, 448.0 * 2 ** -20, 6.0 * 2 ** 10, 0.0448, 1.0 + 2 ** -23])
    rows = [torch.zeros(dim), specials.repeat(dim // specials.numel() + 1)[:dim],
            -specials.flip(0).repeat(dim // specials.numel() + 1)[:dim]]
    for value in specials:
        rows.append(torch.full((dim,), float(value)))
        row = torch.linspace(-1, 1, dim)
        row[::7] = value
        rows.append(row)
    # Rounding ties of every scale: amax pins the scale, the rest sit on code midpoints.
    for amax in (6.0, 448.0, 3.0, 0.75):
        row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 1.0625, -1.1875, 0.0])
        row = row.repeat(dim // row.numel() + 1)[:dim] * (amax / 6.0)
        row[::16] = amax
        rows.append(row)
    return torch.stack(rows)

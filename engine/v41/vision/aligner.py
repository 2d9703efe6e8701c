"""The aligner: the ViT's patch grid, downsampled r × r, projected to the language model's width.

The *ViT output* grid is zero-padded at the bottom and right up to multiples of r (so the last
row / column of tokens can mix real and zero features), then every r × r cell becomes one
feature vector ordered channel-major, then kernel row, then kernel column (`F.unfold`'s order),
→ Linear(r²·vision_dim, dim) → exact (erf) GELU → Linear(dim, dim), both with bias, bf16.
Tokens come out in row-major order of the cell grid. Names: `aligner.w1`, `aligner.w2`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .vit import _linear


class Aligner(nn.Module):
    def __init__(self, cfg: VisionConfig, lm_dim: int):
        super().__init__()
        self.ratio = cfg.downsample_ratio
        self.w1 = _linear(cfg.dim * self.ratio ** 2, lm_dim, bias=True)
        self.w2 = _linear(lm_dim, lm_dim, bias=True)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """ViT output [n_h·n_w, vision_dim] → [⌈n_h/r⌉·⌈n_w/r⌉, dim] bf16."""
        r = self.ratio
        grid = x.view(n_h, n_w, -1).permute(2, 0, 1)  # [C, n_h, n_w]
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))  # zeros after the last column / row
        cells = F.unfold(grid[None], r, stride=r)[0].transpose(0, 1)  # [cells, C·r·r]
        return self.w2(F.gelu(self.w1(cells)))

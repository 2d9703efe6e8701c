"""DeepSeek-V4.1's ViT: a Linear patch embedding, pre-norm blocks with full bidirectional
attention over one image under a 2-D rotary embedding, SwiGLU MLPs, a final RMSNorm. No class
token, no absolute positions.

Numerics (the reference's): activations bf16; `nn.Linear` products with bias in bf16;
RMSNorm in fp32 with fp32 weights, eps 1e-6, one rounding; the rotary in fp32, rounded back;
attention is scaled dot-product softmax(q·kᵀ/√head_dim)·v without a mask (on a GPU through a
fused kernel, `attend`).

2-D rotary (rotate-half pairing): channel i pairs with i + d/2 (i < d/2). The first d/4 pairs
turn by the patch's row times θ_j, the next d/4 by its column times θ_j, θ_j = theta^(−4j/d)
for j < d/4.

Parameter names are the release's under `vision.`: patch_embed.proj, blocks.N.{norm1, attn.wqkv
(q|k|v stacked along out), attn.wo, norm2, mlp.w1 (gate|up stacked along out), mlp.w2}, norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig

NORM_EPS = 1e-6


class VisionNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS))).to(x.dtype)


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=torch.bfloat16)
    layer.requires_grad_(False)
    return layer


def rotary_angles(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [n_h·n_w, 1, head_dim/2] of the patch grid in row-major order: the first
    head_dim/4 angles from the row, the rest from the column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter))
    rows = torch.arange(n_h, device=device)[:, None].expand(n_h, n_w)
    cols = torch.arange(n_w, device=device)[None, :].expand(n_h, n_w)
    pos = torch.stack([rows, cols], dim=-1).reshape(-1, 2, 1).float()  # [N, 2, 1]
    angles = (pos * inv_freq).flatten(1)  # [N, head_dim/2]: row angles, then column angles
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, head_dim] → rotated, each channel i < d/2 paired with i + d/2, in fp32."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = _linear(cfg.patch_values, cfg.dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, 3, p, p] bf16 → [N, dim]: each patch flattened channel, row, column."""
        return self.proj(patches.flatten(1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: bool) -> torch.Tensor:
    """[H, N, hd] each → [H, N, hd]. Unfused (the reference's call: 3-D inputs, torch's math
    kernel, bit for bit on a CPU) materialises the [H, N, N] scores; fused adds a batch dim so
    torch may pick a flash / memory-efficient kernel that never does. Fused is for GPUs: an image
    at the release's 1024-token budget has ~9,200 patches, ~2.7 GB of bf16 scores per layer
    unfused (the golden README: GPU-style attention keeps the reference's tokens)."""
    if fused:
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    return F.scaled_dot_product_attention(q, k, v)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = _linear(cfg.dim, 3 * cfg.dim, bias=True)
        self.wo = _linear(cfg.dim, cfg.dim, bias=True)
        self.fused: bool | None = None  # None: fused on a GPU, the reference's kernel elsewhere

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        fused = x.is_cuda if self.fused is None else self.fused
        o = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), fused)  # [H, N, hd]
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.w1 = _linear(cfg.dim, 2 * cfg.inter_dim, bias=False)
        self.w2 = _linear(cfg.inter_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.attn = VisionNorm(cfg.dim), VisionAttention(cfg)
        self.norm2, self.mlp = VisionNorm(cfg.dim), VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = VisionNorm(cfg.dim)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One image's patches [n_h·n_w, 3, p, p] bf16 (row-major) → [n_h·n_w, dim] bf16."""
        x = self.patch_embed(patches)
        cos, sin = rotary_angles(n_h, n_w, self.cfg.head_dim, self.cfg.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

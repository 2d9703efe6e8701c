"""Stateless building blocks of DeepSeek-V4: norms, interleaved RoPE (plain and YaRN), mHC.

Every function here is pure tensor maths; weights are passed in. Reductions that the model
defines in fp32 (RMSNorm statistics, RoPE rotation, mHC mixing weights) are done in fp32
whatever the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.sinkhorn import sinkhorn

from .config import YarnParams


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics and the weight product in fp32, result in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(x.dtype)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm whose scale factor is cast to x.dtype before the product (as the reference)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- rotary embeddings ------------------------------------------------------------------


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnParams | None) -> torch.Tensor:
    """Inverse frequencies, one per interleaved channel pair: [rope_dim // 2], fp32.

    YaRN blends interpolated (÷factor) and original frequencies with a linear ramp between the
    correction dims of beta_fast and beta_slow; its attention scaling is fixed at 1.0 for V4.
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    pos_freqs = theta**exponents
    inv_freq = 1.0 / pos_freqs
    if yarn is None:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = 1.0 / (yarn.factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight


class RotaryTable:
    """cos/sin lookup for integer positions, computed on demand in fp32 (no max-length table)."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnParams | None, device: torch.device | str = "cpu"):
        self.inv_freq = rope_inv_freq(rope_dim, theta, yarn).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, rope_dim/2]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope slice of x by interleaved pairs (even, odd) in fp32.

    x: [T, ..., D]; cos/sin: [T, rope_dim/2]. `inverse` rotates by −θ (used on attention outputs,
    since V = K carried the key's rotation).
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    extra = x.dim() - 2  # broadcast cos/sin over head dims
    shape = (cos.shape[0],) + (1,) * extra + (half,)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rope = x[..., -rope_dim:].float().unflatten(-1, (half, 2))
    even, odd = rope[..., 0], rope[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rotated), dim=-1)


# ---- manifold-constrained hyper-connections (mHC) ----------------------------------------


def hc_mix_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of one mHC site.

    streams: [T, n, D]. Returns pre [T, n], post [T, n] and comb [T, n, n] (fp32), where comb is
    projected towards a doubly-stochastic matrix by Sinkhorn: columns first, then
    (rows, columns) × (iters − 1), each division by (sum + eps).
    """
    n = streams.shape[1]
    flat = streams.flatten(1).float()  # [T, n*D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = F.linear(flat, fn.float())  # [T, (2+n)*n]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_k pre_k · H_k: [T, n, D] → [T, D] in streams.dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_k = post_k · y + Σ_j comb[j, k] · H_j (comb used transposed). Returns [T, n, D]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # [T, n, D]
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head_collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the n streams before the output norm: [T, n, D] → [T, D]."""
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = F.linear(flat, fn.float())  # [T, n]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return hc_collapse(streams, pre)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) · clamp(up, −limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

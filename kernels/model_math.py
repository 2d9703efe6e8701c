"""The maths DeepSeek-V4 and V4.1 share, written once: RMSNorm, RoPE frequencies (plain and
YaRN), interleaved RoPE, and mHC (mixing weights, collapse, expand, head collapse).

Pure tensor functions (weights are passed in), below the engine: the model code of both
architectures (engine/v4/layers.py, engine/v41/numerics.py) and the kernels' torch references
(kernels/decode_reference.py) call them. Where the two architectures' references round
differently, an argument names the variant:
  * `yarn_inv_freq(quotient=...)`: V4 (as transformers) forms the interpolated frequency as
    1 / (factor · θ^e); V4.1's reference as (1 / θ^e) / factor — the last bit differs for
    factors that are not powers of two;
  * `hc_expand(accumulate=...)`: V4 mixes the streams in their own dtype (a matmul, then the
    post term added in that dtype); V4.1 sums every term in fp32 and rounds once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .sinkhorn import sinkhorn

# ---- norms ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics and the weight product in fp32, one rounding to x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(x.dtype)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm whose scale factor is cast to x.dtype before the product (as the reference)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- rotary embeddings ----------------------------------------------------------------------


def yarn_inv_freq(rope_dim: int, theta: float, yarn, quotient: bool = False) -> torch.Tensor:
    """Inverse frequencies, one per interleaved channel pair: [rope_dim // 2], fp32.

    `yarn` (factor, original_max_position_embeddings, beta_fast, beta_slow; None: plain RoPE)
    blends interpolated (÷ factor) and original frequencies with a linear ramp between the
    correction dims of beta_fast and beta_slow; no attention scaling (mscale 1). `quotient`:
    V4.1's rounding of the interpolated frequency (module docstring)."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim)
    inv_freq = 1.0 / pos_freqs
    if yarn is None:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    # a zero-width ramp gets width 0.001 (V4.1's reference also clamps an inverted one)
    width = max(high - low, 1e-3) if quotient else (high + 0.001 if low == high else high) - low
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / width).clamp(0, 1)
    keep = 1 - ramp  # the weight of the original (extrapolated) frequency
    interpolated = inv_freq / yarn.factor if quotient else 1.0 / (yarn.factor * pos_freqs)
    return interpolated * (1 - keep) + inv_freq * keep


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope slice of x by interleaved pairs (even, odd) in fp32 (V4's form;
    V4.1's reference rotates by a complex product, engine/v41/numerics.py).

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


# ---- manifold-constrained hyper-connections (mHC) -------------------------------------------


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
    """Σ_k pre_k · H_k, summed in fp32 (pre is fp32), rounded to streams.dtype: [T, n, D] → [T, D]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              accumulate: str = "dtype") -> torch.Tensor:
    """H'_k = post_k · y + Σ_j comb[j, k] · H_j (comb used transposed): [T, n, D]. accumulate
    'dtype' (V4): the mix as a matmul in streams.dtype, the result in it; 'fp32' (V4.1): every
    term summed in fp32, one rounding to block_out.dtype (bf16, as the stream)."""
    if accumulate == "fp32":
        mixed = torch.sum(comb[..., None] * streams[:, :, None, :].float(), dim=1)
        return (post[..., None] * block_out[:, None, :].float() + mixed).to(block_out.dtype)
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

"""Counter-based noise for sampling on the device: a value is a pure function of its coordinates.

Every random number the sampler uses is hash(seed, token position, purpose, index) mapped to
(0, 1): no generator state lives anywhere, so draws need no host round trip, cost the same
under a CUDA graph, and a seeded request gets the same tokens whatever shares its batch, after a
preemption (the recompute hashes the same coordinates) and on any device. The hash is the 32-bit
integer finaliser `x = ((x >> 16) ^ x) · 0x45d9f3b` applied twice, then `(x >> 16) ^ x`, in
int64 arithmetic (the multiplier is below 2^31, so no product overflows) — a full-avalanche
mixer, plenty for sampling. Purposes keep the streams of one token apart.
"""

from __future__ import annotations

import torch

from kernels import cpu_sampling
from kernels.cpu_sampling import GOLDEN as _GOLDEN, MASK as _MASK, MUL as _MUL

SAMPLE, ACCEPT, RECOVER, DRAFT = 1, 2, 3, 4  # purposes


def _mix(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche hash of int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, counters: torch.Tensor, purpose: int) -> torch.Tensor:
    """One 32-bit key per row from its 64-bit seed, its counter (token position) and the purpose.

    seeds, counters: [R] int64 (any values; negative seeds are fine). Returns [R] int64."""
    if on_host(seeds, counters):  # one numba call instead of ~35 dispatches, the same bits
        out = torch.empty(seeds.shape[0], dtype=torch.int64)
        cpu_sampling.row_keys(seeds.contiguous().numpy(), counters.contiguous().numpy(), purpose, out.numpy())
        return out
    return row_keys_ops(seeds, counters, purpose)


def row_keys_ops(seeds: torch.Tensor, counters: torch.Tensor, purpose: int) -> torch.Tensor:
    """row_keys as torch ops, on any device (what CUDA graphs capture)."""
    key = _mix(seeds & _MASK)
    key = _mix(key ^ ((seeds >> 32) & _MASK))
    key = _mix(key ^ (counters & _MASK))
    return _mix(key ^ ((purpose * _GOLDEN) & _MASK))


def uniform(keys: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Uniform (0, 1) fp32 noise: [R] from the keys, or [R, width] (one value per index)."""
    if width is not None and on_host(keys):
        out = torch.empty(keys.shape[0], width, dtype=torch.float32)
        cpu_sampling.uniform_grid(keys.contiguous().numpy(), out.numpy())
        return out
    return uniform_ops(keys, width)


def uniform_ops(keys: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """uniform as torch ops, on any device."""
    x = keys if width is None else _mix(keys[:, None] ^ ((torch.arange(width, device=keys.device) * _GOLDEN) & _MASK))
    # 23 bits + ½: every value is exact in fp32 and strictly inside (0, 1).
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def exponential(keys: torch.Tensor, width: int) -> torch.Tensor:
    """Exp(1) noise [R, width] (−log of the uniform): the exponential race's denominators."""
    return -torch.log(uniform(keys, width))


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race: one token per row of probs [R, V], argmax(p / E) with E ~ Exp(1)
    from keys [R], which picks token i with probability p_i. [R] int64."""
    if on_host(probs, keys):  # the division and the argmax fused, the same token
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        log_u = torch.log(uniform(keys, probs.shape[-1]))
        cpu_sampling.race_argmax(probs.float().contiguous().numpy(), log_u.numpy(), out.numpy())
        return out
    return (probs / exponential(keys, probs.shape[-1])).argmax(-1)


def on_host(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors numpy can view (not fake, meta or traced ones): the CPU kernels' inputs."""
    return all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)

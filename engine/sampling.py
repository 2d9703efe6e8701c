"""Sampling parameters and the per-step sampler.

Logprobs are reported from the model's raw distribution (log-softmax of the unprocessed
logits), as vLLM does by default, whatever temperature / top-k / top-p shaped the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None = no logprobs; N ≥ 0 = sampled token (+ top N alternatives)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer ≥ 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be ≥ 0"),
            (math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer ≥ 0"),
            (math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "must be in [-2, 2]"),
            (math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "must be in [-2, 2]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]"),
            (self.seed is None or isinstance(self.seed, int), "seed", "must be an integer"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise SamplingError(f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_distribution(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from fp32 logits [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `token`, top-n (token, logprob) pairs) under the raw distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = logp.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), top

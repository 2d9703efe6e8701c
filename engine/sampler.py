"""Batched sampling on the device: logits → the distribution each row samples from → tokens.

`SamplingRows` holds one step's per-row parameters as tensors. `probs_device` turns every row
into a probability vector: penalties first, then greedy rows into a one-hot on the argmax, the
others by temperature, top-k, top-p and min-p. `sample_device` draws tokens by an exponential
race, argmax(p / E) with E ~ Exp(1), which picks token i with probability p_i; E is counter noise
(engine/counter_rng.py) keyed by the request's seed and position, so a seed gives the same tokens
whatever else shares the batch, and no generator state lives on a request. One-hot rows ignore
the noise, so greedy stays deterministic. Speculative verification (engine/speculative.py) uses
the same distributions. `logprobs_of` / `ranks_of` report on the raw distribution.
"""

from __future__ import annotations

import torch

from ipc.messages import SamplingParams


def ranks_of(logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """1 + how many tokens each row rates strictly above its given token (vLLM's rank)."""
    chosen = logits.float().gather(1, tokens[:, None])  # [R, 1]
    return ((logits.float() > chosen).sum(dim=-1) + 1).tolist()


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw-distribution logprob of each row's token, and its top-n alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    if not top_n:
        return chosen, [[] for _ in chosen]
    values, ids = logp.topk(top_n, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


# ---- on the device, for a whole step at once -------------------------------------------------------


class SamplingRows:
    """Per-row sampling parameters of one step as device tensors [R], plus the host-known facts
    that choose which ops run (all greedy, any shaping). Built with one host→device copy per
    dtype; reading nothing back. `penalty`, set by the caller for rows with presence/frequency
    penalties: (rows [Rp], the token counts [Rp, V] fp32 each row penalizes with), from
    engine/output_counts.py."""

    def __init__(self, params: list[SamplingParams], seeds: list[int], counters: list[int], device):
        self.num_rows = len(params)
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self.any_shaping = any(p.shapes_distribution and not p.greedy for p in params)
        self.penalty: tuple[torch.Tensor, torch.Tensor] | None = None
        floats = torch.tensor([[p.temperature if not p.greedy else 1.0 for p in params],
                               [p.top_p for p in params], [p.min_p for p in params],
                               [p.frequency_penalty for p in params], [p.presence_penalty for p in params]],
                              dtype=torch.float32)
        ints = torch.tensor([[int(p.greedy) for p in params], [p.top_k for p in params], seeds, counters],
                            dtype=torch.long)
        floats, ints = _to_device(floats, device), _to_device(ints, device)
        self.temperature, self.top_p, self.min_p = floats[0], floats[1], floats[2]  # [R]
        self.frequency_penalty, self.presence_penalty = floats[3], floats[4]
        self.greedy, self.top_k, self.seeds, self.counters = ints[0].bool(), ints[1], ints[2], ints[3]


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host → device without a blocking copy (pinned staging on CUDA)."""
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def probs_device(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[R, V] logits → [R, V] sampling distributions, every row by its own parameters:
    penalties first (greedy rows too, as in vLLM), then one-hot argmax for greedy rows; else
    softmax(l / T), then top-k/top-p/min-p."""
    if rows.penalty is not None:  # OpenAI presence/frequency penalties over each row's token counts
        at, counts = rows.penalty
        frequency, presence = rows.frequency_penalty[at, None], rows.presence_penalty[at, None]
        logits = logits.clone()
        logits[at] = logits[at] - (frequency * counts + presence * (counts > 0).float())
    one_hot = None
    if rows.any_greedy:  # (host-known: a step of sampled rows only skips the argmax and the select)
        one_hot = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if rows.all_greedy:
        return one_hot
    probs = torch.softmax(logits.float() / rows.temperature[:, None], dim=-1)
    if rows.any_shaping:
        probs = shape_rows(probs, rows.top_k, rows.top_p, rows.min_p)
    return probs if one_hot is None else torch.where(rows.greedy[:, None], one_hot, probs)


def shape_rows(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, top-p (the smallest prefix reaching p; the top token always survives) and min-p
    (drop tokens below min_p × the top probability) with per-row tensors [R] (top_k 0 = off;
    top_p 1 and min_p 0 keep everything), then renormalise."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = (rank >= k) | (sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]) | (sorted_p < min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample_device(probs: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    """One token per row of [R, V] probabilities by the exponential race argmax(p / E) with
    counter noise E (engine/counter_rng.py) from `keys` [R]; keys None: every row is one-hot."""
    if keys is None:
        return probs.argmax(-1)
    from .counter_rng import race

    return race(probs, keys)

"""Host-side references for the engine's on-device sampling (engine/sampler.py `probs_device`,
engine/speculative.py `verify_batch`): per-request parameters and generators, one row or one
request at a time, written for reading rather than speed. Only tests use them."""

from __future__ import annotations

import torch

from ipc.messages import SamplingParams


def to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] fp32 logits → [R, V] sampling distributions (one-hot for greedy rows; else
    softmax(l / T), then top-k, top-p, min-p)."""
    probs = torch.empty_like(logits, dtype=torch.float32)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx] = 0.0
        probs[idx, logits[idx].argmax(-1)] = 1.0
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        p = torch.softmax(logits[idx].float() / temps[:, None], dim=-1)
        shaping = [j for j, i in enumerate(sampled) if params[i].shapes_distribution]
        if shaping:
            p[shaping] = shape([params[sampled[j]] for j in shaping], p[shaping])
        probs[idx] = p
    return probs


def shape(params: list[SamplingParams], probs: torch.Tensor) -> torch.Tensor:
    """Top-k, top-p (smallest prefix reaching p; the top token always survives) and min-p (drop
    tokens below min_p × the top probability), then renormalise."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=probs.device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)[:, None]
    drop = (rank >= top_k) | (sorted_p.cumsum(-1) - sorted_p >= top_p) | (sorted_p < min_p * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def exponential_noise(vocab: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[R, V] Exp(1) noise; rows with a generator draw from it, the rest share the global RNG."""
    noise = torch.empty(len(generators), vocab, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(vocab).exponential_(generator=g).to(device)
    return noise


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of [R, V] probabilities by the exponential race argmax(p / E), which
    picks token i with probability p_i; one-hot rows take their argmax."""
    one_hot = probs.max(-1).values == 1.0
    if bool(one_hot.all()):
        return probs.argmax(-1)
    noise = exponential_noise(probs.shape[-1], generators, probs.device)
    return torch.where(one_hot, probs.argmax(-1), (probs / noise).argmax(-1))


def verify(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """Speculative sampling for one request: target_probs [k+1, V], draft_probs [k, V] (None =
    one-hot drafts). Accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection
    emit a token from normalise(max(p − q, 0)); if all survive, a bonus token from p after them.
    Returns the accepted drafts followed by that one token."""
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        if p_d >= q_d or float(torch.rand((), generator=generator)) * q_d < p_d:
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0  # q is one-hot on d
        else:
            residual = (residual - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(sample(residual[None], [generator])[0]))
        return out
    out.append(int(sample(target_probs[len(draft_tokens)][None], [generator])[0]))
    return out

"""Lossless verification of draft tokens (speculative sampling).

Vocabulary (as vLLM's rejection sampler): *accepted* drafts, then one *recovered* token at the
first rejection, or a *bonus* token when every draft survives. With target distribution p and
draft distribution q at draft position i:
    accept d_i            with probability min(1, p(d_i) / q(d_i))
    on rejection, emit    r ~ normalise(max(p − q, 0))        (recovered)
    all accepted, emit    b ~ p at the position after the last draft   (bonus)
The emitted sequence is distributed exactly as sampling from p step by step. Greedy rows have
one-hot p and q, so this reduces to: accept while d_i == argmax p_i, then emit argmax p.
"""

from __future__ import annotations

import torch

from .sampler import sample


def verify(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """target_probs [k+1, V]; draft_probs [k, V] (None = one-hot drafts, e.g. greedy drafting).

    Returns the accepted drafts followed by one recovered or bonus token."""
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        if p_d >= q_d or _uniform(generator) * q_d < p_d:
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


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))

"""Lossless verification of draft tokens (speculative sampling).

Vocabulary (as vLLM's rejection sampler): *accepted* drafts, then one *recovered* token at the
first rejection, or a *bonus* token when every draft survives. With target distribution p and
draft distribution q at draft position i:
    accept d_i            with probability min(1, p(d_i) / q(d_i))
    on rejection, emit    r ~ normalise(max(p − q, 0))        (recovered)
    all accepted, emit    b ~ p at the position after the last draft   (bonus)
The emitted sequence is distributed exactly as sampling from p step by step. Greedy rows have
one-hot p and q, so this reduces to: accept while d_i == argmax p_i, then emit argmax p.
`verify_batch` does it for a whole step on the device (engine/step_sampling.py calls it).
"""

from __future__ import annotations

import torch


def verify_batch(target: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                 num_drafts: torch.Tensor, accept_u: torch.Tensor, recover_keys: torch.Tensor | None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of P requests at once, on the device, with no host sync.

    target [P, Q, V]: the distributions at each request's Q = 1 + D rows; drafts [P, D] int64;
    draft_probs [P, D, V] (None: every draft one-hot); num_drafts [P] (drafts past it are never
    accepted); accept_u [P, D] uniform noise for the acceptance tests; recover_keys [P, Q] counter
    keys (engine/counter_rng.py) for the token drawn at each row (None when every row is one-hot).
    Returns (emitted [P, Q] int64:
    the accepted drafts, then the recovered or bonus token, then −1; num_accepted [P] int64).
    """
    p_count, q_len, vocab = target.shape
    d = q_len - 1
    rows = torch.arange(p_count, device=target.device)
    if d:
        p_d = target[:, :d].gather(-1, drafts[..., None]).squeeze(-1)  # [P, D]
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        ok = (p_d >= q_d) | (accept_u * q_d < p_d)  # accept d_i with probability min(1, p/q)
        ok &= torch.arange(d, device=target.device)[None, :] < num_drafts[:, None]
        num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # the accepted prefix
    else:
        num_accepted = torch.zeros(p_count, dtype=torch.long, device=target.device)
    p_sel = target[rows, num_accepted]  # [P, V] the distribution after the accepted prefix
    if d:
        at = num_accepted.clamp(max=d - 1)
        if draft_probs is None:  # q one-hot on the draft
            q_sel = torch.zeros_like(p_sel).scatter_(-1, drafts[rows, at][:, None], 1.0)
        else:
            q_sel = draft_probs[rows, at]
        residual = (p_sel - q_sel).clamp(min=0.0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_sel)
        rejected = (num_accepted < num_drafts)[:, None]
        p_sel = torch.where(rejected, residual, p_sel)  # recovered on a rejection, else the bonus
    if recover_keys is None:  # every row one-hot (greedy): the draw is the argmax
        token = p_sel.argmax(-1)
    else:
        from .counter_rng import race

        token = race(p_sel, recover_keys[rows, num_accepted])  # [P]
    j = torch.arange(q_len, device=target.device)[None, :]
    padded = torch.cat((drafts, drafts.new_zeros(p_count, 1)), dim=1) if d else drafts.new_zeros(p_count, 1)
    emitted = torch.where(j < num_accepted[:, None], padded, -1)
    emitted = emitted.scatter(1, num_accepted[:, None], token[:, None])
    return emitted, num_accepted

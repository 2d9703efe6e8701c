"""Speculative verification preserves the target distribution (a statistical test of the host
reference tests/sampling_reference.py `verify`, against which test_device_sampling.py checks the
engine's `verify_batch`)."""

from __future__ import annotations

import torch

from tests.sampling_reference import sample, verify

TRIALS = 20000


def test_rejection_sampling_preserves_the_target_distribution():
    """Draft from q, verify against p: the first and second emitted tokens are distributed as p.

    Tolerance: every category frequency within 5 standard errors of p (sqrt(p(1-p)/N)); a correct
    sampler fails this with probability < 1e-5 per category."""
    g = torch.Generator().manual_seed(1234)
    vocab, k = 6, 3
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    target = p.expand(k + 1, vocab)
    draft_probs = q.expand(k, vocab)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    n_second = 0
    for _ in range(TRIALS):
        drafts = [int(sample(q[None], [g])[0]) for _ in range(k)]
        out = verify(target, drafts, draft_probs, g)
        assert 0 < len(out) <= k + 1 and out[:-1] == drafts[: len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            n_second += 1
    for counts, n in ((first, TRIALS), (second, n_second)):
        freq = counts / n
        stderr = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 5 * stderr).all(), (freq, p)
    assert n_second > TRIALS * 0.3  # drafts were actually accepted


def test_greedy_verification_accepts_the_argmax_prefix():
    target = torch.zeros(4, 5)
    target[torch.arange(4), torch.tensor([2, 4, 1, 3])] = 1.0
    assert verify(target, [2, 4, 0], None, None) == [2, 4, 1]  # third draft wrong: recovered = argmax
    assert verify(target, [2, 4, 1], None, None) == [2, 4, 1, 3]  # all accepted: bonus
    assert verify(target, [0, 4, 1], None, None) == [2]

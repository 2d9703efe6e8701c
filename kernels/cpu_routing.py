"""CPU (numba) MoE routing and expert permutation; semantics in kernels/reference.py.

The scores s = sqrt(softplus(logits)) come from the reference's torch function itself: torch's
vectorized softplus is fast, and sharing it keeps the weights bit-identical to the reference
(numba's libm exp/log1p may differ from torch's by an ulp). Selection, normalisation and the
counting-sort permutation are numba; they repeat the reference's fp32 operations in order.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from kernels import checks
from kernels.reference import router_scores

_F32 = np.float32


@njit(cache=True)
def select_topk_row(scores, bias, top_k, ids):
    """ids [k] = the top_k experts of scores [E] + bias, key descending, ties to the lower id."""
    keys = np.empty(top_k, dtype=np.float32)
    count = 0
    for e in range(scores.shape[0]):
        key = scores[e] + bias[e]
        if key != key:
            key = _F32(-np.inf)
        if count == top_k:
            if not key > keys[top_k - 1]:
                continue
            p = top_k - 1
        else:
            p = count
            count += 1
        while p > 0 and keys[p - 1] < key:      # equal keys stay ahead: lower id wins
            keys[p] = keys[p - 1]
            ids[p] = ids[p - 1]
            p -= 1
        keys[p] = key
        ids[p] = e


@njit(parallel=True, cache=True)
def _select_topk(scores, bias, top_k, ids):
    """ids[t] = the top_k experts of scores[t] + bias (select_topk_row per token)."""
    for t in prange(scores.shape[0]):
        select_topk_row(scores[t], bias, top_k, ids[t])


@njit(cache=True)
def normalise_row(scores, ids, scaling, weights):
    """weights[j] = s[ids[j]] / (sum_j s + 1e-20) * scaling for one token, summed left to right."""
    top_k = ids.shape[0]
    denom = scores[ids[0]]
    for j in range(1, top_k):
        denom = denom + scores[ids[j]]
    denom = denom + _F32(1e-20)
    for j in range(top_k):
        weights[j] = scores[ids[j]] / denom * scaling


@njit(parallel=True, cache=True)
def _normalise(scores, ids, scaling, weights):
    """normalise_row per token."""
    for t in prange(ids.shape[0]):
        normalise_row(scores[t], ids[t], scaling, weights[t])


@njit(cache=True)
def _counting_sort(flat, num_experts, counts, offsets, order, inverse):
    for f in range(flat.shape[0]):
        counts[flat[f]] += 1
    offsets[0] = 0
    for e in range(num_experts):
        offsets[e + 1] = offsets[e] + counts[e]
    cursor = offsets[:num_experts].copy()
    for f in range(flat.shape[0]):
        p = cursor[flat[f]]
        order[p] = f
        inverse[f] = p
        cursor[flat[f]] = p + 1


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_route(logits, bias, top_k, token_ids, tid2eid)
    scores = router_scores(logits).contiguous()                        # [T, E]
    num_tokens, num_experts = scores.shape
    if tid2eid is not None:
        ids = tid2eid[token_ids.long()].to(torch.int32).contiguous()   # [T, k]
    else:
        ids = torch.empty((num_tokens, top_k), dtype=torch.int32)
        b = torch.zeros(num_experts) if bias is None else bias.contiguous()
        _select_topk(scores.numpy(), b.numpy(), top_k, ids.numpy())
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32)
    _normalise(scores.numpy(), ids.numpy(), _F32(routed_scaling_factor), weights.numpy())
    return weights, ids


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_expert_ids(expert_ids, num_experts, check_range=True)
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous().numpy()
    counts = np.zeros(num_experts, dtype=np.int32)
    offsets = np.empty(num_experts + 1, dtype=np.int32)
    order = np.empty(flat.shape[0], dtype=np.int32)
    inverse = np.empty(flat.shape[0], dtype=np.int32)
    _counting_sort(flat, num_experts, counts, offsets, order, inverse)
    return (torch.from_numpy(counts), torch.from_numpy(offsets), torch.from_numpy(order),
            torch.from_numpy(inverse))

"""kernels/cpu_indexer.py (numba indexer top-k) against the torch reference it replaces on CPU.

Exact cases use dyadic q / k / w and dI = 64 (1/√dI = 1/8): every score is exact in fp32 in any
summation order, so both implementations must pick the same entries in the same order, ties
included (and the data is built to have many). Random cases at the real head width compare the
picked sets, allowing differences only between entries whose scores (fp64) are within the fp32
tolerance of each other.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.cpu_indexer import _select, indexer_topk
from kernels.formats import get_format
from kernels.triton import kv_codec
from kernels.triton.indexer_topk import indexer_topk_reference
from kernels.triton.sparse_mla_decode import read_records

PER_BLOCK = 8
TOPK = 5
# 0, 1, topk - 1, topk, topk + 1, exactly a pool block, one over, several blocks
LENGTHS = [0, 1, TOPK - 1, TOPK, TOPK + 1, PER_BLOCK, PER_BLOCK + 1, 23]


def make_pool(fmt: str, values: torch.Tensor) -> torch.Tensor:
    """A pool of PER_BLOCK-entry blocks whose slot i holds values[i]."""
    n, d = values.shape
    if fmt in kv_codec.RAW_DTYPES:
        return values.to(kv_codec.RAW_DTYPES[fmt]).view(n // PER_BLOCK, PER_BLOCK, d).clone()
    pool = torch.zeros(n // PER_BLOCK, PER_BLOCK, get_format(fmt, d).record_bytes, dtype=torch.uint8)
    reference.quantize_scatter(values, pool, torch.arange(n), fmt)
    return pool


def exact_case(fmt: str, lengths=LENGTHS, q: int = 2, hi: int = 6, di: int = 64, seed: int = 0,
               table_dtype=torch.int32) -> dict:
    """Dyadic values (fp4_index-exact keys, values in 0.5·[-4, 4]); shuffled tables padded with
    dummy block 0; the last query row of each sequence sees all n entries, the first one fewer
    ((p + 1) // 4), and sequence 7's first row sits early in the sequence (sees 2 of 23)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    width = max(1, max(-(-n // PER_BLOCK) for n in lengths)) + 1
    blocks = b * width + 1
    keys = torch.randint(-4, 5, (blocks * PER_BLOCK, di), generator=g).float() * 0.5
    table = torch.zeros(b, width, dtype=torch.long)
    perm = torch.randperm(blocks - 1, generator=g) + 1
    for s, n in enumerate(lengths):
        used = -(-n // PER_BLOCK)
        table[s, :used] = perm[s * width:s * width + used]
    lens = torch.tensor(lengths)
    positions = 4 * lens[:, None] + 3 - 5 * (q - 1 - torch.arange(q))  # row q-1 sees n, earlier rows n-1
    if b > 7 and q > 1:
        positions[7, 0] = 9
    return dict(q=torch.randint(-3, 4, (b, q, hi, di), generator=g).float() * 0.25,
                weights=torch.randint(-2, 3, (b, q, hi), generator=g).float() * 0.5,
                pool=make_pool(fmt, keys), fmt=fmt, block_table=table.to(table_dtype), lengths=lens,
                positions=positions, ratio=4)


def check_same(case: dict, topk: int = TOPK, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    idx, slots = indexer_topk(**case, topk=topk, **kw)
    ref_idx, ref_slots = indexer_topk_reference(**case, topk=topk, **kw)
    assert idx.dtype == slots.dtype == torch.int32 and idx.shape == ref_idx.shape
    assert torch.equal(idx, ref_idx) and torch.equal(slots, ref_slots)
    return idx, slots


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp4_index"])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_exact_scores_pick_what_the_reference_picks(fmt, table_dtype):
    case = exact_case(fmt, table_dtype=table_dtype)
    idx, slots = check_same(case, weight_scale=0.5)
    visible = (idx >= 0).sum(-1)                                      # [B, q]
    expect = torch.tensor([[0, 0], [0, 1], [3, 4], [4, 5], [5, 5], [5, 5], [5, 5], [2, 5]])
    assert torch.equal(visible, expect)
    assert ((slots >= 0) == (idx >= 0)).all()
    assert torch.equal(check_same(case, topk=32)[0][..., :TOPK], idx)  # k beyond every length
    check_same(case, topk=1)


@pytest.mark.parametrize("hi,q", [(4, 1), (6, 2), (5, 1)])
def test_batch_one_and_head_counts(hi, q):
    """B = 1 and 3, q = 1 and 2, Hi a multiple of 4 and not (the padded head rows never count)."""
    case = exact_case("fp4_index", lengths=[23], q=q, hi=hi, seed=1)
    check_same(case)
    check_same(exact_case("bf16", lengths=[9, 0, 23], q=q, hi=hi, seed=2), topk=7)


def test_max_entries_caps_the_entry_axis():
    case = exact_case("fp32", seed=3)
    idx, _ = check_same(case, topk=32, max_entries=7)
    assert idx.max() == 6 and ((idx >= 0).sum(-1) <= 7).all()
    with pytest.raises(ValueError):
        indexer_topk(**case, topk=4, max_entries=case["block_table"].shape[1] * PER_BLOCK + 1)


def test_ties_go_to_the_lower_entry_and_signed_zeros_tie():
    case = exact_case("fp32", seed=4)
    case["pool"][:] = case["pool"][1, 0]                              # every key equal: every score ties
    idx, _ = check_same(case, topk=3)
    assert torch.equal(idx[7, 1], torch.arange(3, dtype=torch.int32))
    zeros = exact_case("fp32", seed=5)
    zeros["weights"] = -zeros["weights"].abs() - 0.5                  # every w · ReLU(·) <= 0
    zeros["q"][6, 1] = -zeros["q"][6, 1].abs()
    zeros["pool"] = zeros["pool"].abs()                               # q · k <= 0 -> ReLU zeros -> -0 / +0 scores
    idx, _ = check_same(zeros, topk=5)
    assert torch.equal(idx[6, 1], torch.arange(5, dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp4_index"])
def test_nan_and_inf_keys(fmt):
    """A NaN key ranks below every number but above nothing visible; Inf keys give ±Inf or NaN
    scores whatever the summation order, so the picks stay exact."""
    case = exact_case(fmt, seed=6)
    slot = int(case["block_table"][7, 1]) * PER_BLOCK + 2             # entry 10 of sequence 7
    flat = case["pool"].view(-1, case["pool"].shape[-1])
    if fmt == "fp4_index":
        flat[slot, 32:] = 0xFF                                        # ue8m0 NaN scales: the key reads NaN
    else:
        flat[slot] = float("nan")
    idx, _ = check_same(case, topk=32)
    seen = idx[7, 1][idx[7, 1] >= 0]
    assert seen.numel() == 23 and seen[-1] == 10
    if fmt != "fp4_index":
        flat[slot, :3] = torch.tensor([float("inf"), -float("inf"), 1.0])
        flat[slot + 1, 0] = float("inf")
        check_same(case, topk=32)
        check_same(case, topk=3)


def _scores_f64(case: dict) -> torch.Tensor:
    """Independent fp64 scores [B, q, E] over the addressable entries (same keys)."""
    e = torch.arange(case["block_table"].shape[1] * PER_BLOCK)
    slots = case["block_table"].long()[:, e // PER_BLOCK] * PER_BLOCK + e % PER_BLOCK
    keys = read_records(case["pool"], case["fmt"], slots, case["q"].shape[-1]).double()
    dots = torch.einsum("bqhd,bed->bqhe", case["q"].double(), keys).relu() * case["q"].shape[-1] ** -0.5
    return (dots * case["weights"].double()[..., None]).sum(2)


@pytest.mark.parametrize("fmt", ["bf16", "fp4_index"])
def test_random_inputs_pick_the_same_up_to_near_ties(fmt):
    g = torch.Generator().manual_seed(7)
    b, q, hi, di, n, topk = 3, 2, 8, 128, 300, 64
    width = -(-n // PER_BLOCK)
    table = (torch.randperm(b * width, generator=g) + 1).view(b, width)
    case = dict(q=torch.randn(b, q, hi, di, generator=g).bfloat16(), weights=torch.randn(b, q, hi, generator=g),
                pool=make_pool(fmt, torch.randn((b * width + 1) * PER_BLOCK, di, generator=g)), fmt=fmt,
                block_table=table, lengths=torch.tensor([n, 200, 37]), positions=torch.tensor([[1203, 1204]] * b),
                ratio=4)
    idx, _ = indexer_topk(**case, topk=topk, weight_scale=hi**-0.5)
    ref, _ = indexer_topk_reference(**case, topk=topk, weight_scale=hi**-0.5)
    exact = _scores_f64(case) * hi**-0.5                                           # [B, q, E]
    tol = 1e-5 * exact.abs().amax()
    for s in range(b):
        for t in range(q):
            ours, theirs = idx[s, t][idx[s, t] >= 0], ref[s, t][ref[s, t] >= 0]
            assert ours.numel() == theirs.numel()
            ours_scores = exact[s, t][ours.long()]
            assert (ours_scores[1:] <= ours_scores[:-1] + tol).all()              # descending up to tol
            differ = set(ours.tolist()) ^ set(theirs.tolist())
            kth = exact[s, t][theirs.long()].min()
            assert all(abs(exact[s, t][e] - kth) <= tol for e in differ)
    assert (idx == ref).float().mean() > 0.9                                      # near-ties are rare


@pytest.mark.parametrize("k", [1, 7, 40, 64])
def test_selection_is_the_stable_descending_sort(k):
    """The selection alone on scores the reference's masks would produce: few distinct values
    (ties), -0 next to +0 (they tie), NaN and -inf (they tie, ranking last)."""
    g = torch.Generator().manual_seed(8)
    values = torch.tensor([0.0, -0.0, 1.5, -2.0, float("nan"), float("-inf"), float("inf"), 3.0])
    scores = values[torch.randint(0, len(values), (50,), generator=g)]
    picked = torch.empty(k, dtype=torch.int64)
    _select(scores.numpy(), scores.shape[0], np.empty(50, np.uint64), picked.numpy())
    ranked = torch.where(scores.isnan(), float("-inf"), scores)
    expect = ranked.sort(descending=True, stable=True).indices[:k]
    assert torch.equal(picked[:expect.shape[0]], expect) and (picked[expect.shape[0]:] == -1).all()
    assert ((scores == 0) & scores.signbit()).any() and ((scores == 0) & ~scores.signbit()).any()

"""Fused Triton decode kernels against their torch references (under Triton's interpreter on CPU).

Every kernel is checked on edge cases the decode path meets: no keys / entries, one, exactly a
key block (16) and one over, -1 masked slots, padding rows whose tables point at dummy block 0,
exact ties, and NaN records (NaN stays inside the sequence that owns it). Sizes are tiny: the
interpreter runs every program in Python.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _kv_inputs import adversarial_rows, random_rows
from kernels import reference
from kernels.formats import get_format
from kernels.triton import kv_codec
from kernels.triton.compressor_step import compressor_step, compressor_step_reference
from kernels.triton.indexer_topk import indexer_topk, indexer_topk_reference
from kernels.triton.mhc_mix import mhc_mix, mhc_mix_reference
from kernels.triton.sparse_mla_decode import read_records, sparse_mla_decode, sparse_mla_decode_reference

# Dequantizing FLT_MAX-scaled records overflows to Inf in numpy, as intended.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:All-NaN slice encountered:RuntimeWarning")

BLOCK_N = 16  # sparse_mla_decode's default key block


def make_pool(fmt: str, values: torch.Tensor, per_block: int) -> torch.Tensor:
    """A pool whose slot i holds values[i] (len(values) a multiple of per_block)."""
    n, d = values.shape
    if fmt in kv_codec.RAW_DTYPES:
        return values.to(kv_codec.RAW_DTYPES[fmt]).view(n // per_block, per_block, d).clone()
    pool = torch.zeros(n // per_block, per_block, get_format(fmt, d).record_bytes, dtype=torch.uint8)
    reference.quantize_scatter(values, pool, torch.arange(n), fmt)
    return pool


def same(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    """Equal up to atol, NaN where the other is NaN."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.allclose(
        a.nan_to_num(0.0), b.nan_to_num(0.0), atol=atol, rtol=atol)


# ---- codecs: the in-register decode/encode rules, bit for bit --------------------------------------

@pytest.mark.parametrize("fmt,dim", [("fp8_ds_mla", 128), ("fp4_kv", 64), ("fp4_index", 64)])
def test_codec_matches_reference_bit_for_bit(fmt, dim):
    x = torch.cat([adversarial_rows(dim)[::2], random_rows(8, dim, seed=1)])     # NaN/Inf/ties/subnormals
    per_block = 4
    n = x.shape[0]
    blocks = n // per_block + 2
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(blocks * per_block, generator=g)[:n]
    slots[::5] = -1
    start = torch.randint(0, 256, (blocks, per_block, get_format(fmt, dim).record_bytes), generator=g,
                          dtype=torch.uint8)
    ours, ref = start.clone(), start.clone()
    kv_codec.quantize_scatter(x, ours, slots, fmt)
    reference.quantize_scatter(x, ref, slots, fmt)
    assert torch.equal(ours, ref)
    read = torch.cat([slots, torch.tensor([-1, 0])])
    assert same(kv_codec.gather_dequantize(ref, read, fmt, dim), reference.gather_dequantize(ref, read, fmt), 0.0)


# ---- sparse_mla_decode --------------------------------------------------------------------------

def _attention_case(window_fmt: str, entry_fmt: str, b: int = 3, q: int = 2, h: int = 3, d: int = 128, seed: int = 0):
    """Pools of 8 blocks x 4 records, slot tables with per-query valid counts 0, 1, 16, 17."""
    g = torch.Generator().manual_seed(seed)
    per_block, blocks = 4, 8
    wpool = make_pool(window_fmt, torch.randn(blocks * per_block, d, generator=g), per_block)
    epool = make_pool(entry_fmt, torch.randn(blocks * per_block, d, generator=g), per_block)
    counts = torch.tensor([0, 1, BLOCK_N, BLOCK_N + 1, 5, 9])[: b * q].view(b, q)
    width = BLOCK_N + 1

    def table(shift: int) -> torch.Tensor:
        slots = torch.randint(4, blocks * per_block, (b, q, width), generator=g)  # block 0 is the dummy
        keep = torch.arange(width) < counts.roll(shift).view(b, q, 1)
        return torch.where(keep, slots, -1)

    return dict(q=torch.randn(b, q, h, d, generator=g), sink=torch.randn(h, generator=g), window_pool=wpool,
                window_fmt=window_fmt, window_slots=table(0), entry_pool=epool, entry_fmt=entry_fmt,
                entry_slots=table(1).flip(-1))  # masked slots first in the entry table


@pytest.mark.parametrize("window_fmt,entry_fmt", [("fp32", "fp32"), ("bf16", "fp8_ds_mla"),
                                                  ("fp8_ds_mla", "fp4_kv")])
@pytest.mark.parametrize("with_new", [False, True])
def test_sparse_mla_decode_matches_reference(window_fmt, entry_fmt, with_new):
    case = _attention_case(window_fmt, entry_fmt)
    if with_new:  # this step's own keys, causal within the step
        case["new_kv"] = torch.randn(*case["q"].shape[:2], case["q"].shape[-1])
    out = sparse_mla_decode(**case)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert same(out, sparse_mla_decode_reference(**case))


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_sparse_mla_decode_tensor_core_precisions(precision):
    """The GPU modes: bf16 operands (exact for quantized keys; p rounded) stay within bf16 error."""
    case = _attention_case("fp8_ds_mla", "fp4_kv")
    case["q"] = case["q"].bfloat16()
    out = sparse_mla_decode(**case, precision=precision)
    ref = sparse_mla_decode_reference(**case)
    assert (out - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())


def test_sparse_mla_decode_fully_masked_rows_give_zero():
    case = _attention_case("fp8_ds_mla", "fp4_kv")
    case["window_slots"][0, 0] = -1
    case["entry_slots"][0, 0] = -1
    out = sparse_mla_decode(**case)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))               # only the sink: exactly 0
    assert out[1:].abs().sum() > 0
    window_only = sparse_mla_decode(case["q"], case["sink"], case["window_pool"], "fp8_ds_mla",
                                    torch.full_like(case["window_slots"], -1))
    assert torch.equal(window_only, torch.zeros_like(window_only))


def test_sparse_mla_decode_nan_stays_in_its_sequence():
    """A NaN record read by sequence 0 only makes sequence 0 NaN (as the reference); a NaN in a
    slot nobody reads (the dummy block, masked tails) changes nothing."""
    case = _attention_case("fp32", "fp8_ds_mla")
    slots = case["entry_slots"]
    poisoned = slots[0, 0, -1].item()                                   # sequence 0's first query's last entry
    assert poisoned >= 0
    slots[1:][slots[1:] == poisoned] = 4 if poisoned != 4 else 5        # read by sequence 0 only
    slots[0, 1][slots[0, 1] == poisoned] = 4 if poisoned != 4 else 5
    clean = sparse_mla_decode(**case)
    nan_row = torch.full((1, case["q"].shape[-1]), float("nan"))
    reference.quantize_scatter(nan_row, case["entry_pool"], torch.tensor([poisoned]), "fp8_ds_mla")
    assert read_records(case["entry_pool"], "fp8_ds_mla", torch.tensor([poisoned]), 128).isnan().all()
    case["window_pool"][0] = float("nan")                               # dummy block: never read
    out = sparse_mla_decode(**case)
    assert same(out, sparse_mla_decode_reference(**case))
    assert out[0, 0].isnan().all() and torch.equal(out[0, 1], clean[0, 1])
    assert torch.equal(out[1:], clean[1:])


def test_sparse_mla_decode_padding_rows_change_nothing():
    live = _attention_case("bf16", "fp4_kv", b=2)
    padded = dict(live)
    for name in ("q", "window_slots", "entry_slots"):
        pad = torch.full_like(live[name][:2], -1) if name != "q" else torch.randn_like(live[name][:2])
        padded[name] = torch.cat([live[name], pad])
    out = sparse_mla_decode(**padded)
    assert torch.equal(out[:2], sparse_mla_decode(**live))
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def _shared_case(window_fmt: str, entry_fmt: str, b: int, q: int, h: int, d: int = 128, seed: int = 0):
    """Tables laid out as engine/v4/step_meta.py lays them: one slot per column for all of a
    sequence's rows. The window's columns are positions start−W+1 .. start−1, token t seeing
    columns ≥ t (history before the sequence began: −1 for every row); HCA's entries a prefix
    that grows by one every few tokens (token t sees n_b + t // 2 of them, n_b from 0)."""
    g = torch.Generator().manual_seed(seed)
    per_block, blocks = 4, 12
    wpool = make_pool(window_fmt, torch.randn(blocks * per_block, d, generator=g), per_block)
    epool = make_pool(entry_fmt, torch.randn(blocks * per_block, d, generator=g), per_block)
    width = BLOCK_N + 3  # two key blocks, the second partial
    cols = torch.arange(width)
    t = torch.arange(q)[:, None]

    def table(sees: torch.Tensor) -> torch.Tensor:  # sees [B, q, width] bool
        slots = torch.stack([torch.randperm((blocks - 1) * per_block, generator=g)[:width] for _ in range(b)])
        slots = slots[:, None, :] + per_block  # [B, 1, width] distinct within a sequence
        return torch.where(sees, slots, -1)  # block 0 is the dummy

    history = torch.tensor([0, 3, width, 11, 7, 1])[:b]  # columns that hold a position of the sequence
    window = table((cols >= t) & (cols >= width - history.view(b, 1, 1)))
    seen = torch.tensor([0, 5, BLOCK_N, 2, 9, 17])[:b].view(b, 1, 1) + t // 2
    entries = table(cols < seen)
    return dict(q=torch.randn(b, q, h, d, generator=g), sink=torch.randn(h, generator=g), window_pool=wpool,
                window_fmt=window_fmt, window_slots=window, entry_pool=epool, entry_fmt=entry_fmt, entry_slots=entries,
                new_kv=torch.randn(b, q, d, generator=g))


@pytest.mark.parametrize("q,h", [(1, 20), (2, 5), (3, 20), (5, 12)])  # M = 16, 32, 32 (8 heads), 32 (4 heads)
@pytest.mark.parametrize("window_fmt,entry_fmt", [("fp32", "fp32"), ("fp8_ds_mla", "fp4_kv")])
def test_sparse_mla_decode_shared_tables_read_once_per_sequence(q, h, window_fmt, entry_fmt):
    """A verify step's tokens in one program: shared window and entry tables read per sequence
    give the reference's answer, and the same bits as reading the same tables row by row."""
    case = _shared_case(window_fmt, entry_fmt, b=4, q=q, h=h)
    shared = sparse_mla_decode(**case, window_shared=True, entries_shared=True)
    assert torch.isfinite(shared).all()
    assert same(shared, sparse_mla_decode_reference(**case))
    assert torch.equal(shared, sparse_mla_decode(**case))  # per-row reads of the same tables
    mixed = sparse_mla_decode(**case, window_shared=True)  # the CSA layout: window shared, top-k per row
    assert torch.equal(mixed, shared)


@pytest.mark.parametrize("block_d,block_dv", [(32, 64), (128, 32)])
def test_sparse_mla_decode_chunked_scores_and_column_parts(block_d, block_dv):
    """The GPU's shape of the work at D = 512, at test size: scores summed over D in chunks and
    the output columns split across programs give the reference's answer, and shared tables the
    same bits as per-row reads."""
    case = _shared_case("fp8_ds_mla", "fp4_kv", b=3, q=3, h=5)
    blocks = dict(block_d=block_d, block_dv=block_dv)
    shared = sparse_mla_decode(**case, window_shared=True, entries_shared=True, **blocks)
    assert torch.isfinite(shared).all()
    assert same(shared, sparse_mla_decode_reference(**case))
    assert torch.equal(shared, sparse_mla_decode(**case, **blocks))
    with pytest.raises(ValueError, match="block_dv"):
        sparse_mla_decode(**case, block_dv=48)


@pytest.mark.parametrize("block_dv", [None, 32])
def test_sparse_mla_decode_nan_in_a_shared_column_stays_in_the_rows_that_see_it(block_dv):
    """The oldest window column is token 0's only: a NaN record there makes token 0 NaN and no
    other row (a masked row's p = 0 must not meet the NaN in the shared dot), as the reference,
    in every column part of the output."""
    case = _shared_case("fp32", "fp8_ds_mla", b=3, q=3, h=4)
    clean = sparse_mla_decode(**case, window_shared=True, entries_shared=True, block_dv=block_dv)
    slot = case["window_slots"][2, 0, 0].item()  # sequence 2 (a full window), token 0, column 0
    assert slot >= 0 and (case["window_slots"][2, 1:, 0] < 0).all()
    case["window_pool"].view(-1, case["q"].shape[-1])[slot] = float("nan")
    out = sparse_mla_decode(**case, window_shared=True, entries_shared=True, block_dv=block_dv)
    assert same(out, sparse_mla_decode_reference(**case))
    assert out[2, 0].isnan().all() and torch.equal(out[2, 1:], clean[2, 1:]) and torch.equal(out[:2], clean[:2])


# ---- indexer_topk -------------------------------------------------------------------------------

def _index_case(fmt: str, seed: int = 0, hi: int = 4, di: int = 64, per_block: int = 4):
    """Dyadic values, so every score is exact in fp32 whatever the summation order, and many tie.

    Six sequences x 2 queries with 17, 16 (the score kernel's entry block, 16, and one over), 13,
    4 (exactly a table block), 1 and 0 entries (a padding row: table all dummy block 0); the
    13-entry sequence's first query sees only 12 ((p + 1) // m).
    """
    g = torch.Generator().manual_seed(seed)
    blocks = 16
    keys = torch.randint(-4, 5, (blocks * per_block, di), generator=g).float() * 0.5   # fp4_index-exact
    table = torch.tensor([[3, 1, 5, 7, 11], [2, 4, 6, 8, 0], [9, 10, 12, 13, 0], [14, 0, 0, 0, 0],
                          [15, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    lengths = torch.tensor([17, 16, 13, 4, 1, 0])
    positions = torch.tensor([[67, 68], [64, 65], [50, 51], [16, 17], [4, 5], [0, 1]])
    b, q = positions.shape
    return dict(q=torch.randint(-3, 4, (b, q, hi, di), generator=g).float() * 0.25,
                weights=torch.randint(-2, 3, (b, q, hi), generator=g).float() * 0.5,
                pool=make_pool(fmt, keys, per_block), fmt=fmt, block_table=table, lengths=lengths,
                positions=positions, ratio=4)


@pytest.mark.parametrize("fmt,topk", [("fp4_index", 1), ("fp4_index", 5), ("fp4_index", 16), ("bf16", 3),
                                      ("fp32", 4), ("fp32", 16)])
def test_indexer_topk_matches_reference(fmt, topk):
    case = _index_case(fmt)
    idx, slots = indexer_topk(**case, topk=topk)
    ref_idx, ref_slots = indexer_topk_reference(**case, topk=topk)
    assert idx.dtype == slots.dtype == torch.int32 and idx.shape == (6, 2, topk)
    assert torch.equal(idx, ref_idx) and torch.equal(slots, ref_slots)
    assert (idx[5] == -1).all()                                          # padding row: nothing visible
    assert (idx[4, :, 1:] == -1).all() and (idx[4, :, 0] == 0).all()      # one entry
    if topk >= 13:                                                       # the visible rule, per query
        assert ((idx[2, 0] >= 0).sum(), (idx[2, 1] >= 0).sum()) == (12, 13)
    scores = _exact_scores(case)
    assert (scores[0, 0][:-1] == scores[0, 0][1:]).any()                 # the data really has ties


def _exact_scores(case: dict) -> torch.Tensor:
    """Sorted visible scores [B, q, E] of sequence rows (exact: dyadic inputs)."""
    e = torch.arange(case["block_table"].shape[1] * 4)
    slots = case["block_table"][:, e // 4] * 4 + e % 4
    keys = read_records(case["pool"], case["fmt"], slots, case["q"].shape[-1])
    s = torch.einsum("bqhd,bed->bqhe", case["q"], keys).relu() * case["q"].shape[-1] ** -0.5
    return (s * case["weights"][..., None]).sum(2).sort(dim=-1, descending=True).values


def test_indexer_topk_ties_go_to_the_lower_entry():
    """Identical keys: every score ties, so the top-k are the lowest indices, in order. ReLU
    zeros with negative weights are -0, which must tie with +0."""
    case = _index_case("fp32")
    case["pool"][:] = case["pool"][1, 0]
    idx, _ = indexer_topk(**case, topk=3)
    assert torch.equal(idx[0], torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32))
    zeros = _index_case("fp32")
    zeros["weights"] = -zeros["weights"].abs() - 0.5                     # every product w · ReLU(·) is ≤ 0
    zeros["q"][0, 0] = -zeros["q"][0, 0].abs()
    zeros["pool"] = zeros["pool"].abs()                                  # q · k ≤ 0 → ReLU zeros → -0 scores
    idx, _ = indexer_topk(**zeros, topk=5)
    assert torch.equal(idx[0, 0], torch.arange(5, dtype=torch.int32))
    assert torch.equal(idx, indexer_topk_reference(**zeros, topk=5)[0])


def test_indexer_topk_chunked_selection_is_exact():
    """Merging several chunks (chunk 4 < 13 visible) picks exactly what one chunk does."""
    case = _index_case("fp4_index", seed=3)
    whole, _ = indexer_topk(**case, topk=4)
    chunked, _ = indexer_topk(**case, topk=4, chunk=4)
    assert torch.equal(whole, chunked)
    assert torch.equal(chunked, indexer_topk_reference(**case, topk=4)[0])


def test_indexer_topk_nan_ranks_last_within_its_sequence():
    case = _index_case("bf16")
    clean, _ = indexer_topk(**case, topk=32)
    case["pool"][1, 2] = float("nan")                                    # entry 6 of sequence 0 (block 1)
    idx, slots = indexer_topk(**case, topk=32)
    assert torch.equal(idx, indexer_topk_reference(**case, topk=32)[0])
    visible = idx[0, 0][idx[0, 0] >= 0]
    assert visible.numel() == 17 and visible[-1] == 6                    # NaN ranks below every number
    assert torch.equal(idx[1:], clean[1:])


# ---- compressor_step ----------------------------------------------------------------------------

def _compressor_case(overlap: bool, ratio: int, entry_fmt: str, dim: int = 64, rope: int = 16, seed: int = 0):
    """Five sequences, q = 2. For m = 4: start 2 (the first entry completes; CSA's Ca half lies
    before position 0), start 6 (entry 1 completes), start 5 (nothing completes), start 0 (an empty
    history) and a padding row (all slots -1). m = 1 completes an entry at every token."""
    g = torch.Generator().manual_seed(seed)
    b, q = 5, 2
    width = (2 if overlap else 1) * dim
    span = (2 if overlap else 1) * ratio
    per_block, blocks = 8, 12
    start = torch.tensor([max(ratio - 2, 1), max(2 * ratio - 2, 3), ratio + 1, 0, 0])
    pos = start[:, None] - (span - 1) + torch.arange(span - 1 + q)            # [B, span-1+q]
    row_slots = torch.randperm(blocks * per_block - per_block, generator=g)[: b * pos.shape[1]].view(b, -1) + per_block
    row_slots = torch.where(pos >= 0, row_slots, -1)
    row_slots[4] = -1                                                        # padding: reads and writes nothing
    positions = start[:, None] + torch.arange(q)
    completes = (positions + 1) % ratio == 0
    completes[4] = False
    entry_slots = torch.where(completes, 4 + torch.arange(b * q).view(b, q), -1)
    if entry_fmt in kv_codec.RAW_DTYPES:
        entry_pool = torch.zeros(8, 4, dim, dtype=kv_codec.RAW_DTYPES[entry_fmt])
    else:
        entry_pool = torch.zeros(8, 4, get_format(entry_fmt, dim).record_bytes, dtype=torch.uint8)
    freqs = ((positions // ratio) * ratio)[..., None].float() / 100.0 ** (torch.arange(rope // 2) / (rope // 2))
    return dict(rows=torch.randn(b, q, 2 * width, generator=g),
                state_pool=torch.randn(blocks, per_block, 2 * width, generator=g), row_slots=row_slots,
                entry_pool=entry_pool, entry_fmt=entry_fmt, entry_slots=entry_slots,
                norm_weight=1 + 0.1 * torch.randn(dim, generator=g), eps=1e-6, cos=freqs.cos(), sin=freqs.sin(),
                ratio=ratio, overlap=overlap)


def _run(fn, case: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run on copies of the pools; return (state_pool, entry_pool) after the step."""
    case = dict(case, **kw)
    case["state_pool"], case["entry_pool"] = case["state_pool"].clone(), case["entry_pool"].clone()
    fn(**case)
    return case["state_pool"], case["entry_pool"]


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 4), (False, 1)])
@pytest.mark.parametrize("entry_fmt,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_compressor_step_matches_reference(overlap, ratio, entry_fmt, dtype):
    case = _compressor_case(overlap, ratio, entry_fmt)
    state, entries = _run(compressor_step, case, dtype=dtype)
    ref_state, ref_entries = _run(compressor_step_reference, case, dtype=dtype)
    assert torch.equal(state, ref_state)                                # rows appended bit for bit
    tol = 1e-5 if dtype == torch.float32 else 2**-7                     # one bf16 ulp (relative)
    assert same(entries.float(), ref_entries.float(), tol)
    written = case["entry_slots"][case["entry_slots"] >= 0]
    assert written.numel() >= 2 and entries.view(-1, entries.shape[-1])[written].abs().sum() > 0
    assert torch.equal(entries[0], torch.zeros_like(entries[0]))        # padding touched no dummy slot


@pytest.mark.parametrize("entry_fmt", ["fp8_ds_mla", "fp4_kv"])
def test_compressor_step_quantizes_its_own_candidates_exactly(entry_fmt):
    """The quantized record equals reference.quantize of the kernel's raw fp32 candidate."""
    dim = 128 if entry_fmt == "fp8_ds_mla" else 64
    case = _compressor_case(True, 4, "fp32", dim=dim, rope=64 if entry_fmt == "fp8_ds_mla" else 16)
    _, raw = _run(compressor_step, case)
    quant = _compressor_case(True, 4, entry_fmt, dim=dim, rope=64 if entry_fmt == "fp8_ds_mla" else 16)
    _, records = _run(compressor_step, quant)
    written = case["entry_slots"][case["entry_slots"] >= 0]
    expected = torch.zeros_like(records)
    reference.quantize_scatter(raw.view(-1, dim)[written], expected, written, entry_fmt)
    assert written.numel() >= 2 and torch.equal(records, expected)
    # Against the reference's own candidates: equal up to a rounding flip of a code.
    ref_records = _run(compressor_step_reference, quant)[1]
    assert same(read_records(records, entry_fmt, written, dim), read_records(ref_records, entry_fmt, written, dim),
                0.3)


def test_compressor_step_nan_history_poisons_only_its_sequence():
    case = _compressor_case(True, 4, "fp32")
    clean = _run(compressor_step, case)[1]
    hist = case["row_slots"][1, 0].item()                                    # sequence 1's oldest row
    case["state_pool"].view(-1, case["state_pool"].shape[-1])[hist] = float("nan")
    entries = _run(compressor_step, case)[1].view(-1, 64)
    ref = _run(compressor_step_reference, case)[1].view(-1, 64)
    assert same(entries, ref)
    seq1 = case["entry_slots"][1][case["entry_slots"][1] >= 0]
    others = case["entry_slots"][0][case["entry_slots"][0] >= 0]
    assert entries[seq1].isnan().all() and torch.equal(entries[others], clean.view(-1, 64)[others])


def test_compressor_reference_equals_the_engine_step():
    """compressor_step_reference on slot tables == engine.v4.attention_decode.compress on a DecodeBatch."""
    from engine.decode_batch import DecodeBatch
    from engine.kv_cache import Pool, PoolRef
    from engine.kv_layout import PoolSpec
    from engine.v4.attention_decode import compress
    from engine.v4.layers import RotaryTable

    m, d, block = 4, 128, 8                                                  # fp8_ds_mla: d - 64 = 64
    cache = SimpleNamespace(layout=SimpleNamespace(block_size=block), device="cpu")
    batch = DecodeBatch.allocate(cache, 3, 2, full_blocks=3, sliding_blocks=3)
    batch.fill([([5, 6], 2, [1, 2], [1, 2], 0), ([7, 8], 14, [3, 4], [3, 5], 0)])  # row 2: padding
    g = torch.Generator().manual_seed(0)
    comp = SimpleNamespace(ratio=m, out_dim=d, overlap=True, span=2 * m, norm=1 + 0.1 * torch.randn(d, generator=g),
                           eps=1e-6)
    state = Pool(PoolSpec("state", "sliding", "fp32", 4 * d, 1, 2 * m, (0,)), 6, block, "cpu")
    entries = Pool(PoolSpec("c4", "full", "fp8_ds_mla", d, m, 0, (0,)), 6, block, "cpu")
    state.tensors[0].copy_(torch.randn(state.tensors[0].shape, generator=g))
    entries.tensors[0].zero_()
    rows = torch.randn(3, 2, 4 * d, generator=g)
    rope = RotaryTable(16, 10000.0, None)
    ours_state, ours_entries = state.tensors[0].clone(), entries.tensors[0].clone()
    compress(comp, rows, batch, (PoolRef(state, 0, torch.float32), PoolRef(entries, 0, torch.float32)), rope,
             torch.float32)

    span = 2 * m
    hist = batch.start[:, None] - (span - 1) + torch.arange(span - 1 + 2)
    row_slots, valid = batch.sliding_slots(hist)
    row_slots = torch.where(valid, row_slots, -1)
    row_slots[2] = -1                                                        # padding row
    pos = batch.positions.view(3, 2)
    entry_slots = torch.where((pos + 1) % m == 0, batch.entry_slots(pos // m, m), -1)
    entry_slots[2] = -1
    cos, sin = rope((pos // m * m).flatten())
    compressor_step_reference(rows, ours_state, row_slots, ours_entries, "fp8_ds_mla", entry_slots, comp.norm, 1e-6,
                              cos.view(3, 2, -1), sin.view(3, 2, -1), m, True)
    live = slice(1, None)                                                    # block 0: the engine's dummy writes
    assert (entry_slots >= 0).sum() == 2
    assert torch.equal(ours_entries[live], entries.tensors[0][live])
    assert torch.equal(ours_state[live], state.tensors[0][live])


# ---- mhc_mix ------------------------------------------------------------------------------------

def _mhc_case(t: int, dtype: torch.dtype, n: int = 4, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, d, generator=g).to(dtype), torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5,
            0.5 * torch.randn((2 + n) * n, generator=g), 1 + 0.2 * torch.randn(3, generator=g))


@pytest.mark.parametrize("t", [0, 1, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 20])
def test_mhc_mix_matches_hc_mix_weights(t, dtype, iters):
    args = (*_mhc_case(t, dtype), iters, 1e-6, 1e-6)
    pre, post, comb, collapsed = mhc_mix(*args, collapse=True)
    ref = mhc_mix_reference(*args, collapse=True)
    for got, want in zip((pre, post, comb), ref[:3]):
        assert got.dtype == torch.float32 and same(got, want, 1e-5)
    assert collapsed.dtype == dtype
    assert same(collapsed.float(), ref[3].float(), 1e-5 if dtype == torch.float32 else 2**-7)
    assert all(same(a, b, 0.0) for a, b in zip(mhc_mix(*args), (pre, post, comb)))


def test_mhc_mix_nan_token_stays_in_its_row():
    streams, fn, base, scale = _mhc_case(17, torch.float32)
    clean = mhc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6, collapse=True)
    streams[3, 2, 5] = float("nan")
    out = mhc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6, collapse=True)
    ref = mhc_mix_reference(streams, fn, base, scale, 20, 1e-6, 1e-6, collapse=True)
    others = torch.arange(17) != 3
    for got, want, before in zip(out, ref, clean):
        assert got[3].isnan().all() and want[3].isnan().all()
        assert torch.equal(got[others], before[others])

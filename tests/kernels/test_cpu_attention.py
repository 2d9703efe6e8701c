"""The numba sparse_mla_decode (kernels/cpu_attention.py) against the torch reference of
kernels/triton/sparse_mla_decode.py.

Cases the decode step meets: raw (fp32, bf16) and quantized (fp8_ds_mla, fp4_kv) pools, per-row
and shared tables (laid out as engine/v4/step_meta.py does), valid counts 0, 1, a pool block (4),
one over, the kernel's key block (16) and one over, −1 holes, no entries, this step's own keys,
NaN records (only rows that read one turn NaN), int32 / int64 slots, bf16 queries, and the
serial (1 thread) and parallel paths.

Tolerance: atol = rtol = 1e-5. Both sides are fp32, but the kernel reassociates the 512-term
q·k dots and the Σ p·k sums (vectorised) and runs an online softmax with its own exp (relative
error < 3e-7), where the reference uses einsum and one softmax; observed differences are ~1e-7
absolute on outputs of magnitude ~0.1–1, so 1e-5 has two orders of margin yet would catch any
wrong key, mask or weight.
"""
from __future__ import annotations

import numba
import pytest
import torch

from kernels import reference
from kernels.cpu_attention import BLOCK, sparse_mla_decode
from kernels.formats import get_format
from kernels.triton.sparse_mla_decode import sparse_mla_decode_reference

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

RAW = {"fp32": torch.float32, "bf16": torch.bfloat16}
PER_BLOCK = 4          # pool records per block (small pools keep the file fast)
COUNTS = (0, 1, PER_BLOCK, PER_BLOCK + 1, BLOCK, BLOCK + 1)


def make_pool(fmt: str, values: torch.Tensor) -> torch.Tensor:
    """A [n / PER_BLOCK, PER_BLOCK, record] pool whose slot i holds values[i]."""
    n, d = values.shape
    if fmt in RAW:
        return values.to(RAW[fmt]).view(n // PER_BLOCK, PER_BLOCK, d).clone()
    pool = torch.zeros(n // PER_BLOCK, PER_BLOCK, get_format(fmt, d).record_bytes, dtype=torch.uint8)
    reference.quantize_scatter(values, pool, torch.arange(n), fmt)
    return pool


def same(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Equal within tol, NaN exactly where the other is NaN."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.allclose(
        a.nan_to_num(0.0), b.nan_to_num(0.0), atol=tol, rtol=tol)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values, NaN where the other is NaN."""
    return same(a, b, 0.0) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.fixture
def one_thread():
    """Run the serial kernel (the parallel one runs whenever numba has more than one thread)."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


def _per_row_case(window_fmt: str, entry_fmt: str | None, b: int, q: int, h: int, d: int, seed: int = 0,
                  with_new: bool = False) -> dict:
    """Per-row tables: row i sees COUNTS[...] valid slots (random, block 0 never), with −1 holes."""
    g = torch.Generator().manual_seed(seed)
    blocks = 12
    n = blocks * PER_BLOCK
    width = BLOCK + 3

    def table(shift: int) -> torch.Tensor:
        counts = torch.tensor(COUNTS).roll(shift).repeat(b * q)[: b * q].view(b, q, 1)
        slots = torch.randint(PER_BLOCK, n, (b, q, width), generator=g)
        slots = torch.where(torch.arange(width) < counts + 1, slots, -1)
        slots[..., 1] = -1                                                 # a hole: counts stay as named
        return slots.int()

    case = dict(q=torch.randn(b, q, h, d, generator=g), sink=torch.randn(h, generator=g),
                window_pool=make_pool(window_fmt, torch.randn(n, d, generator=g)), window_fmt=window_fmt,
                window_slots=table(0))
    if entry_fmt is not None:
        case.update(entry_pool=make_pool(entry_fmt, torch.randn(n, d, generator=g)), entry_fmt=entry_fmt,
                    entry_slots=table(2).flip(-1))                       # masked slots first
    if with_new:
        case["new_kv"] = torch.randn(b, q, d, generator=g)
    return case


def _shared_case(window_fmt: str, entry_fmt: str, b: int, q: int, h: int, d: int, seed: int = 0) -> dict:
    """Shared tables as engine/v4/step_meta.py builds them: one slot per column for all of a sequence's
    rows, −1 where a row does not see it. Window columns are positions start−W+1 .. start−1 (token
    t sees columns ≥ t; a short history leaves the leading columns −1 for every row); entries are a
    prefix that grows by one every two tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks = 16
    n = blocks * PER_BLOCK
    width = BLOCK + 3
    cols, t = torch.arange(width), torch.arange(q)[:, None]

    def table(sees: torch.Tensor) -> torch.Tensor:
        slots = torch.stack([torch.randperm(n - PER_BLOCK, generator=g)[:width] for _ in range(b)]) + PER_BLOCK
        return torch.where(sees, slots[:, None, :], -1).int()

    history = torch.tensor([width, 0, 3, 11])[:b].view(b, 1, 1)
    seen = torch.tensor([BLOCK, 0, 5, 2])[:b].view(b, 1, 1) + t // 2
    return dict(q=torch.randn(b, q, h, d, generator=g), sink=torch.randn(h, generator=g),
                window_pool=make_pool(window_fmt, torch.randn(n, d, generator=g)), window_fmt=window_fmt,
                window_slots=table((cols >= t) & (cols >= width - history)),
                entry_pool=make_pool(entry_fmt, torch.randn(n, d, generator=g)), entry_fmt=entry_fmt,
                entry_slots=table(cols < seen), new_kv=torch.randn(b, q, d, generator=g))


SHAPES = [(1, 1, 16), (1, 2, 1), (3, 3, 16), (3, 1, 1), (3, 2, 16)]  # (B, q, H)
FORMATS = [("fp32", "fp32", 64), ("bf16", "bf16", 512), ("bf16", "fp8_ds_mla", 128), ("fp8_ds_mla", "fp4_kv", 128),
           ("fp32", None, 512)]


@pytest.mark.parametrize("window_fmt,entry_fmt,d", FORMATS)
@pytest.mark.parametrize("b,q,h", SHAPES)
@pytest.mark.parametrize("with_new", [False, True])
def test_matches_reference_per_row_tables(window_fmt, entry_fmt, d, b, q, h, with_new):
    case = _per_row_case(window_fmt, entry_fmt, b, q, h, d, seed=b * 10 + q, with_new=with_new)
    out = sparse_mla_decode(**case)
    ref = sparse_mla_decode_reference(**case)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert same(out, ref)
    zero_rows = [(i, j) for i in range(b) for j in range(q)
                 if not with_new and (case["window_slots"][i, j] < 0).all()
                 and (entry_fmt is None or (case["entry_slots"][i, j] < 0).all())]
    for i, j in zero_rows:                                                # the sink alone: exactly 0
        assert torch.equal(out[i, j], torch.zeros_like(out[i, j]))


@pytest.mark.parametrize("window_fmt,entry_fmt,d", [("fp32", "fp32", 64), ("bf16", "bf16", 512),
                                                    ("fp8_ds_mla", "fp4_kv", 128)])
@pytest.mark.parametrize("b,q,h", [(1, 1, 16), (3, 2, 16), (3, 3, 1)])
def test_shared_tables_match_reference_and_per_row_reads(window_fmt, entry_fmt, d, b, q, h):
    case = _shared_case(window_fmt, entry_fmt, b, q, h, d)
    shared = sparse_mla_decode(**case, window_shared=True, entries_shared=True)
    assert torch.isfinite(shared).all()
    assert same(shared, sparse_mla_decode_reference(**case))
    assert torch.equal(shared, sparse_mla_decode(**case))                 # the same tables read per row
    assert torch.equal(shared, sparse_mla_decode(**case, window_shared=True))  # CSA: top-k per row


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_fully_masked_rows_are_exactly_zero(fmt):
    case = _per_row_case(fmt, fmt, b=2, q=2, h=16, d=128)
    case["window_slots"][0, 1] = -1
    case["entry_slots"][0, 1] = -1
    out = sparse_mla_decode(**case)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert same(out, sparse_mla_decode_reference(**case))
    masked = torch.full_like(case["window_slots"], -1)
    for extra in ({}, {"entry_pool": None}, {"entry_slots": masked[..., :0]}):
        args = {**case, "window_slots": masked, "entry_slots": masked, **extra}
        assert torch.equal(sparse_mla_decode(**args), torch.zeros(2, 2, 16, 128))


def test_no_entries_attends_the_window_only():
    case = _per_row_case("bf16", "bf16", b=3, q=2, h=16, d=512, with_new=True)
    window_only = {k: v for k, v in case.items() if not k.startswith("entry")}
    out = sparse_mla_decode(**window_only)
    assert same(out, sparse_mla_decode_reference(**window_only))
    assert torch.equal(out, sparse_mla_decode(**{**case, "entry_slots": case["entry_slots"][..., :0]}))
    assert torch.equal(out, sparse_mla_decode(**{**case, "entry_pool": None}))


def test_new_keys_alone_are_causal():
    """An empty window and no entries: token t attends exactly new keys 0..t (and the sink)."""
    case = _per_row_case("fp32", None, b=2, q=3, h=4, d=64, with_new=True)
    case["window_slots"] = case["window_slots"][..., :0]
    out = sparse_mla_decode(**case)
    assert same(out, sparse_mla_decode_reference(**case))
    later = dict(case, new_kv=case["new_kv"].clone())
    later["new_kv"][:, 2] += 1.0                                          # token 2's own key
    moved = sparse_mla_decode(**later)
    assert torch.equal(moved[:, :2], out[:, :2]) and not torch.equal(moved[:, 2], out[:, 2])


def _poisoned_rows(out: torch.Tensor, clean: torch.Tensor, sees: torch.Tensor) -> bool:
    """Rows [B, q] that read the NaN record are NaN over every head and all of D; every other
    row is bit for bit the clean result."""
    return bool(out[sees].isnan().all()) and torch.equal(out[~sees], clean[~sees])


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_ds_mla"])
def test_nan_record_poisons_only_the_rows_that_read_it(fmt):
    """Shared window: its oldest column is token 0's only; a NaN record there makes token 0 NaN,
    and no row that does not read it (a masked row's p = 0 must never meet the NaN); a NaN in a
    slot nobody reads (the dummy block 0) changes nothing."""
    case = _shared_case(fmt, "fp32", b=3, q=3, h=16, d=128)
    flags = dict(window_shared=True, entries_shared=True)
    clean = sparse_mla_decode(**case, **flags)
    slot = case["window_slots"][0, 0, 0].item()                           # sequence 0 (full window), token 0
    sees = (case["window_slots"] == slot).any(-1)                         # [B, q]
    assert slot >= 0 and sees[0, 0] and not sees[0, 1:].any()
    nan_rows = torch.full((1, 128), float("nan"))
    if fmt in RAW:
        case["window_pool"].view(-1, 128)[slot] = nan_rows
        case["window_pool"][0] = float("nan")                             # dummy block: never read
    else:
        reference.quantize_scatter(nan_rows, case["window_pool"], torch.tensor([slot]), fmt)
        reference.quantize_scatter(nan_rows.expand(PER_BLOCK, -1), case["window_pool"],
                                   torch.arange(PER_BLOCK), fmt)
    out = sparse_mla_decode(**case, **flags)
    assert same(out, sparse_mla_decode_reference(**case))
    assert _poisoned_rows(out, clean, sees)
    assert identical(sparse_mla_decode(**case), out)                      # per-row reads: the same


def test_nan_in_a_per_row_entry_table():
    """One NaN value in an entry record read by row (1, 0) only."""
    case = _per_row_case("bf16", "fp32", b=2, q=2, h=16, d=64)
    slots = case["entry_slots"]
    slot = slots[1, 0][slots[1, 0] >= 0][0].item()
    own = torch.zeros(slots.shape, dtype=torch.bool)
    own[1, 0] = True
    case["entry_slots"] = torch.where(~own & (slots == slot), -1, slots)  # nobody else reads it
    clean = sparse_mla_decode(**case)
    case["entry_pool"].view(-1, 64)[slot, 5] = float("nan")
    out = sparse_mla_decode(**case)
    assert same(out, sparse_mla_decode_reference(**case))
    assert _poisoned_rows(out, clean, own[..., 0])


def test_slot_dtypes_query_dtypes_and_threads_agree(one_thread):
    case = _per_row_case("bf16", "fp8_ds_mla", b=3, q=3, h=16, d=128, with_new=True)
    serial = sparse_mla_decode(**case)
    assert same(serial, sparse_mla_decode_reference(**case))
    wide = dict(case, window_slots=case["window_slots"].long(), entry_slots=case["entry_slots"].long())
    assert torch.equal(sparse_mla_decode(**wide), serial)
    low = dict(case, q=case["q"].bfloat16(), new_kv=case["new_kv"].bfloat16())
    assert same(sparse_mla_decode(**low), sparse_mla_decode_reference(**low))
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    assert torch.equal(sparse_mla_decode(**case), serial)                 # same order per head
    single = {k: (v[:1, :1] if k in ("q", "window_slots", "entry_slots", "new_kv") else v) for k, v in case.items()}
    assert torch.equal(sparse_mla_decode(**single), serial[:1, :1])      # heads split across threads


def test_out_of_range_slots_raise():
    case = _per_row_case("bf16", None, b=1, q=1, h=1, d=64)
    case["window_slots"][0, 0, 0] = case["window_pool"].shape[0] * PER_BLOCK
    with pytest.raises(ValueError, match="beyond"):
        sparse_mla_decode(**case)

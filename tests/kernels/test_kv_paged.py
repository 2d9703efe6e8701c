"""Paged scatter/gather: CPU implementation vs reference, vLLM's fp8_ds_mla block layout, errors."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from _kv_inputs import FORMAT_DIMS, random_rows

FORMATS = list(FORMAT_DIMS)


def random_pool(fmt: str, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    nbytes = kernels.get_format(fmt, FORMAT_DIMS[fmt]).record_bytes
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_size, nbytes), generator=g).to(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_scatter_gather_match_reference(fmt, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, n = 5, 40
    x = random_rows(n, FORMAT_DIMS[fmt], seed=block_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    if slots.numel() < n:
        slots = torch.cat([slots, torch.full((n - slots.numel(),), -1)])
    slots[torch.rand(n, generator=g) < 0.2] = -1
    pool_cpu = random_pool(fmt, num_blocks, block_size, seed=7)
    pool_ref = pool_cpu.clone()
    kernels.quantize_scatter(x, pool_cpu, slots, fmt)
    reference.quantize_scatter(x, pool_ref, slots, fmt)
    assert torch.equal(pool_cpu, pool_ref)

    read = torch.cat([slots, torch.tensor([-1, 0])])
    got = kernels.gather_dequantize(pool_cpu, read, fmt)
    assert torch.equal(got.nan_to_num(5.0), reference.gather_dequantize(pool_ref, read, fmt).nan_to_num(5.0))
    valid = slots >= 0
    assert torch.equal(got[:n][valid], kernels.dequantize(kernels.quantize(x[valid], fmt), fmt))
    assert (got[:n][~valid] == 0).all() and (got[n] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_scatter_touches_only_its_slots(fmt):
    pool = random_pool(fmt, 3, 8, seed=1)
    before = pool.clone()
    kernels.quantize_scatter(random_rows(2, FORMAT_DIMS[fmt]), pool, torch.tensor([9, -1]), fmt)
    f = kernels.get_format(fmt, FORMAT_DIMS[fmt])
    changed = (pool != before).view(-1).nonzero().flatten()
    data, scales = kernels.formats.slot_offsets(f, 9, 8)
    allowed = set(range(data, data + f.data_bytes)) | set(range(scales, scales + f.scale_bytes))
    assert set(changed.tolist()) <= allowed


def test_fp8_ds_mla_block_layout_is_vllm():
    """Block of B tokens: B x 576 data bytes, then B x 8 scale bytes (cache_utils.py)."""
    block_size, slot = 4, 6                       # block 1, offset 2
    x = random_rows(1, 512, seed=4)
    pool = torch.zeros(2, block_size, 584, dtype=torch.uint8)
    kernels.quantize_scatter(x, pool, torch.tensor([slot]), "fp8_ds_mla")
    record = kernels.quantize(x, "fp8_ds_mla")[0]
    flat = pool.view(-1)
    block = block_size * 584
    assert torch.equal(flat[block + 2 * 576: block + 3 * 576], record[:576])
    assert torch.equal(flat[block + block_size * 576 + 2 * 8: block + block_size * 576 + 3 * 8], record[576:])
    assert int((flat != 0).sum()) == int((record != 0).sum())


def test_fp8_ds_mla_record_order():
    x = torch.zeros(1, 512)
    x[0, 448:] = torch.arange(64) + 1.0
    x[0, 0] = 448.0
    record = kernels.quantize(x, "fp8_ds_mla")[0]
    assert record[0] == 0x7E                                  # nope codes first
    rope = record[448:576].view(torch.bfloat16).float()       # then the bf16 rope part
    assert torch.equal(rope, torch.arange(64) + 1.0)
    assert record[576:].tolist() == [127] + [105] * 6 + [0]   # then 7 ue8m0 scales and a pad byte


def test_bad_arguments_raise():
    x = torch.zeros(4, 512)
    pool = torch.zeros(2, 4, 584, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slots must be -1"):
        kernels.quantize_scatter(x, pool, torch.tensor([0, 1, 2, 8]), "fp8_ds_mla")
    with pytest.raises(ValueError, match="-1 or in"):
        kernels.gather_dequantize(pool, torch.tensor([-2]), "fp8_ds_mla")
    with pytest.raises(ValueError, match="288-byte"):
        kernels.quantize_scatter(x, pool, torch.arange(4), "fp4_kv")
    with pytest.raises(ValueError, match="4 rows"):
        kernels.quantize_scatter(x, pool, torch.arange(3), "fp8_ds_mla")
    with pytest.raises(ValueError, match="int64"):
        kernels.quantize_scatter(x, pool, torch.arange(4, dtype=torch.int32), "fp8_ds_mla")
    with pytest.raises(ValueError, match="x must be"):
        kernels.quantize(x.double(), "bf16")
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.dequantize(kernels.quantize(x, "bf16"), "bf16", torch.int32)
    with pytest.raises(ValueError, match="unknown KV format"):
        kernels.quantize(x, "fp8")
    with pytest.raises(ValueError, match="records"):
        kernels.dequantize(torch.zeros(2, 583, dtype=torch.uint8), "fp8_ds_mla")


def test_empty_inputs():
    pool = torch.zeros(1, 4, 68, dtype=torch.uint8)
    kernels.quantize_scatter(torch.zeros(0, 128), pool, torch.zeros(0, dtype=torch.int64), "fp4_index")
    assert kernels.gather_dequantize(pool, torch.zeros(0, dtype=torch.int64), "fp4_index").shape == (0, 128)
    assert kernels.quantize(torch.zeros(0, 128), "fp4_index").shape == (0, 68)

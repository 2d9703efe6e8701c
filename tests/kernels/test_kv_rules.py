"""The stated numeric rules of each KV format, checked on hand-made blocks."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

INF, NAN = float("inf"), float("nan")


def quantize_both(x: torch.Tensor, fmt: str) -> torch.Tensor:
    records = kernels.quantize(x, fmt)
    assert torch.equal(records, reference.quantize(x, fmt))
    return records


def test_record_sizes():
    assert kernels.get_format("fp8_ds_mla", 512).record_bytes == 584
    assert kernels.get_format("fp4_kv", 512).record_bytes == 288
    assert kernels.get_format("fp4_index", 128).record_bytes == 68
    assert kernels.get_format("bf16", 512).record_bytes == 1024
    assert kernels.get_format("fp8_ds_mla", 576).record_bytes == 512 + 128 + 8


@pytest.mark.parametrize("fmt,dim", [("fp8_ds_mla", 500), ("fp8_ds_mla", 64), ("fp4_kv", 40),
                                     ("fp4_index", 48), ("fp9", 128), ("bf16", 0)])
def test_unsupported_dims_raise(fmt, dim):
    with pytest.raises(ValueError):
        kernels.get_format(fmt, dim)


def test_all_zero_blocks():
    r = quantize_both(torch.zeros(1, 512), "fp8_ds_mla")[0]
    assert (r[:576] == 0).all() and r[576:583].tolist() == [105] * 7 and r[583] == 0   # 2^-22
    r = quantize_both(torch.zeros(1, 512), "fp4_kv")[0]
    assert (r[:256] == 0).all() and (r[256:] == 0x01).all()                          # 2^-9
    r = quantize_both(torch.zeros(1, 128), "fp4_index")[0]
    assert (r[:64] == 0).all() and (r[64:] == 112).all()          # ceil(log2(1e-4 / 6)) = -15
    for fmt, dim in (("fp8_ds_mla", 512), ("fp4_kv", 512), ("fp4_index", 128)):
        assert (kernels.dequantize(kernels.quantize(torch.zeros(2, dim), fmt), fmt) == 0).all()


def test_ue8m0_scale_is_exact_ceil_log2():
    x = torch.zeros(3, 512)
    x[0, 0] = 448.0                       # ratio exactly 1 -> 2^0
    x[1, 0] = 448.0 * (1 + 2 ** -23)      # just above -> 2^1
    x[2, 0] = 448.0 * 2 ** -10            # exactly 2^-10
    r = quantize_both(x, "fp8_ds_mla")
    assert r[:, 576].tolist() == [127, 128, 117]


def test_e4m3_round_to_nearest_even_and_sign():
    x = torch.zeros(1, 512)
    x[0, :7] = torch.tensor([448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -12, 464.0])
    r = quantize_both(x, "fp8_ds_mla")[0]
    assert r[576] == 128                  # amax 464 > 448: scale 2^1, codes hold x / 2
    # 224 = 0x76; 0.53125 ties -> 0.5 (0x30); 0.59375 ties -> 0.625 (0x32);
    # 2^-11 is a quarter of the 2^-9 subnormal step -> 0; 3 * 2^-11 -> 2^-9 (0x01);
    # a tiny negative keeps its sign (-0 = 0x80); 232 ties between 224 and 240 -> 224 (0x76).
    assert r[:7].tolist() == [0x76, 0x30, 0x32, 0x00, 0x01, 0x80, 0x76]
    assert kernels.dequantize(r[None], "fp8_ds_mla")[0, 6] == 448.0


def test_e2m1_ties_go_to_even_codes():
    x = torch.zeros(1, 128)
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                              -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 7.0])
    r = quantize_both(x, "fp4_index")[0]   # amax 7 -> scale 2^ceil(log2(7/6)) = 2
    assert r[64] == 128
    x[0, 15] = 0.0                         # amax 6 -> scale 1
    r = quantize_both(x, "fp4_index")[0]
    codes = torch.stack([r[:8] & 15, r[:8] >> 4], dim=1).flatten().tolist()
    assert r[64] == 127
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]


def test_huge_values_saturate():
    x = torch.full((1, 512), 1e6)
    y = kernels.dequantize(quantize_both(x, "fp4_kv"), "fp4_kv")
    assert (y == 6 * 448.0).all()                       # e4m3 scale saturates at 448
    x = torch.linspace(-1, 1, 512)[None] * 1e30
    y = kernels.dequantize(quantize_both(x, "fp8_ds_mla"), "fp8_ds_mla")
    assert ((y[:, :448] - x[:, :448]).abs() <= x[:, :448].abs() / 16 + 1e30 / 2 ** 20).all()


@pytest.mark.parametrize("fmt,dim,group", [("fp8_ds_mla", 512, 64), ("fp4_kv", 512, 16), ("fp4_index", 128, 32)])
def test_inf_saturates_its_block(fmt, dim, group):
    x = torch.ones(1, dim) * 0.5
    x[0, 1], x[0, group + 1] = INF, -INF
    y = kernels.dequantize(quantize_both(x, fmt), fmt)[0]
    big = 6 * 448.0 if fmt == "fp4_kv" else INF          # ue8m0 blocks round FLT_MAX up to 2^128
    assert y[1] == big and y[group + 1] == -big
    assert y[0] == 0 and y[group] == 0                   # the rest of an Inf block flushes to 0
    assert torch.equal(y[2 * group:3 * group], kernels.dequantize(kernels.quantize(torch.full((1, dim), 0.5), fmt), fmt)[0, :group])


def test_nan_is_elementwise_for_e4m3():
    x = torch.ones(1, 512)
    x[0, 3], x[0, 500] = NAN, NAN
    r = quantize_both(x, "fp8_ds_mla")
    assert r[0, 3] == 0x7F
    y = kernels.dequantize(r, "fp8_ds_mla")[0]
    assert torch.isnan(y).nonzero().flatten().tolist() == [3, 500]   # 500: bf16 rope NaN


@pytest.mark.parametrize("fmt,dim,group,nan_code", [("fp4_kv", 512, 16, 0x7F), ("fp4_index", 128, 32, 0xFF)])
def test_nan_poisons_fp4_block(fmt, dim, group, nan_code):
    x = torch.ones(1, dim)
    x[0, group + 2] = NAN
    r = quantize_both(x, fmt)
    assert r[0, dim // 2 + 1] == nan_code
    y = kernels.dequantize(r, fmt)[0]
    assert torch.isnan(y[group:2 * group]).all() and not torch.isnan(y[:group]).any()
    assert not torch.isnan(y[2 * group:]).any()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_bf16_parts_round_to_nearest_even(fmt):
    x = torch.zeros(1, 512)
    x[0, -3:] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -INF])   # ties: to 1.0 and to 1 + 2^-6
    y = kernels.dequantize(quantize_both(x, fmt), fmt)[0, -3:]
    assert y.tolist() == [1.0, 1 + 2 ** -6, -INF]


def test_subnormal_inputs_flush_with_sign():
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([1e-40, -1e-40, 1e-45, -1e-45])
    r = quantize_both(x, "fp4_index")[0]
    assert r[:2].tolist() == [0x80, 0x80]

"""The V4.1 QAT quantizers against their written definitions (golden README "Kernel stand-ins").

Expected codes and scales are derived by hand in the comments; torch's float8_e4m3fn cast is
an independent reference for e4m3 rounding inside its range.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.v41.quant import (E2M1, E4M3, fake_fp4_e4m3, fake_fp4_e8m0, fake_fp8, pow2_ceil, quantize_fp4_e4m3,
                             quantize_fp4_e8m0, quantize_fp8, round_to_grid)

NAN = float("nan")


def grid(values, g):
    return round_to_grid(torch.tensor(values, dtype=torch.float32), g).tolist()


def test_e2m1_rounds_half_to_even_and_saturates():
    # grid 0, .5, 1, 1.5, 2, 3, 4, 6; codes 0..7, "even" = code 0, 2, 4, 6 = 0, 1, 2, 4
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    assert grid(ties, E2M1) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert grid([0.2, 0.3, 1.4, 2.9, 5.1, 6.0, 6.375, 7.0, 1e9], E2M1) == [0.0, 0.5, 1.5, 3.0, 6.0, 6.0, 6.0, 6.0, 6.0]
    assert grid([-0.75, -5.0, -6.2], E2M1) == [-1.0, -4.0, -6.0]


def test_e4m3_hand_cases():
    # normals: 3 mantissa bits; 17 is the tie between 16 (mantissa 0) and 18 (mantissa 1) → 16
    # subnormals: quantum 2^-9; 2^-10 ties between 0 and 2^-9 → 0; 3·2^-10 ties → 2·2^-9
    cases = {17.0: 16.0, 19.0: 20.0, 448.0: 448.0, 464.0: 448.0, 1e6: 448.0,
             2**-9: 2**-9, 2**-10: 0.0, 3 * 2**-10: 2**-8, 1.0625: 1.0, 1.1875: 1.25}
    assert grid(list(cases), E4M3) == list(cases.values())


def test_e4m3_matches_torch_cast_in_range():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.sort(codes[torch.isfinite(codes)].unique()).values  # every e4m3 value
    midpoints = (finite[1:] + finite[:-1]) / 2
    torch.manual_seed(0)
    rand = (torch.randn(20000) * torch.exp2(torch.randint(-12, 9, (20000,)).float())).clamp(-448, 448)
    for x in (finite, midpoints, rand):
        assert torch.equal(round_to_grid(x, E4M3), x.to(torch.float8_e4m3fn).float())


def test_nan_propagates_through_grid():
    assert math.isnan(grid([NAN], E4M3)[0]) and math.isnan(grid([NAN], E2M1)[0])


def test_pow2_ceil_is_exact_at_powers_of_two():
    v = torch.tensor([1.0, 2**-22, 0.75, 1.0000001, 3 * 2**-130])
    assert pow2_ceil(v).tolist() == [1.0, 2**-22, 1.0, 2.0, 2**-128]


def test_fp8_act_quant_blocks():
    x = torch.zeros(4, 32)
    x[1, 0] = 448.0  # amax 448 → scale 2^ceil(log2 1) = 1: codes are the values
    x[1, 1] = 17.0
    x[2, 0] = 3.5  # 3.5/448 = 2^-7 exactly → scale 2^-7 (not 2^-6); 3.5 → code 448
    x[2, 1] = 1.0  # 1·2^7 = 128
    x[3, 0] = 1.0  # 1/448 → 2^ceil(-8.81) = 2^-8; 1 → 256, 0.3 → 76.8 → e4m3 (quantum 8) → 80
    x[3, 1] = 0.3
    codes, scale = quantize_fp8(x)
    # zero block: amax floored to 1e-4 → 2^ceil(log2(1e-4/448)) = 2^ceil(-22.09) = 2^-22, codes 0
    assert scale.flatten().tolist() == [2**-22, 1.0, 2**-7, 2**-8]
    assert codes[0].abs().sum() == 0
    assert codes[1, 0, :2].tolist() == [448.0, 16.0]
    assert codes[2, 0, :2].tolist() == [448.0, 128.0]
    assert codes[3, 0, :2].tolist() == [256.0, 80.0]
    deq = fake_fp8(x.bfloat16())
    assert deq.dtype == torch.bfloat16 and deq[3, 1].item() == 80.0 / 256


def test_fp8_nonfinite_block_poisons_only_its_block():
    x = torch.ones(3, 32)
    x[0, 5], x[1, 7] = NAN, float("inf")
    codes, scale = quantize_fp8(x)
    assert torch.isnan(codes[:2]).all() and torch.isnan(scale[:2]).all()
    assert codes[2].eq(256.0).all() and scale[2].item() == 2**-8  # amax 1 → 2^-8, 1 → 256


def test_fp4_e8m0_index_quant():
    x = torch.zeros(3, 32)
    x[1, :4] = torch.tensor([6.0, 2.5, -0.75, 0.2])  # amax 6 → scale 1; RNE codes 6, 2, -1, 0
    x[2, :2] = torch.tensor([1.0, 0.3])  # amax 1: 1/6 → 2^ceil(-2.58) = 0.25; 1 → 4, 0.3 → 1.2 → 1
    codes, scale = quantize_fp4_e8m0(x)
    assert scale.flatten().tolist() == [2**-126, 1.0, 0.25]  # zero block: floor 6·2^-126 → 2^-126
    assert codes[1, 0, :4].tolist() == [6.0, 2.0, -1.0, 0.0]
    assert codes[2, 0, :2].tolist() == [4.0, 1.0]
    assert fake_fp4_e8m0(x)[2, :2].tolist() == [1.0, 0.25]


def test_fp4_e4m3_compressed_kv_quant():
    x = torch.zeros(4, 16)
    x[1, :2] = torch.tensor([6.0, -1.3])  # amax/6 = 1 → scale 1; -1.3 → -1.5
    # amax 7: 7/6 = 1.1667 → e4m3 1.125 (quantum 1/8); 7/1.125 = 6.22 saturates to 6 → 6.75
    x[2, :2] = torch.tensor([7.0, 1.0])  # 1/1.125 = 0.889 → 1 → 1.125
    # amax 0.02: 0.02/6 = 0.00333 is e4m3-subnormal (quantum 2^-9): 1.71 quanta → 2 → 2^-8;
    # 0.02/2^-8 = 5.12 → 6 → 0.0234375
    x[3, 0] = 0.02
    codes, scale = quantize_fp4_e4m3(x)
    assert scale.flatten().tolist() == [2**-9, 1.0, 1.125, 2**-8]  # zero block: floor 6·2^-9 → 2^-9
    assert codes[1, 0, :2].tolist() == [6.0, -1.5]
    assert codes[2, 0, :2].tolist() == [6.0, 1.0]
    assert fake_fp4_e4m3(x)[2, :2].tolist() == [6.75, 1.125]
    assert fake_fp4_e4m3(x)[3, 0].item() == 0.0234375


@pytest.mark.parametrize("fn", [quantize_fp8, quantize_fp4_e8m0, quantize_fp4_e4m3])
def test_dequantized_values_are_on_the_grid_and_close(fn):
    torch.manual_seed(1)
    x = torch.randn(64, 64).bfloat16()
    codes, scale = fn(x)
    deq = (codes * scale).flatten(-2)
    rel = ((deq - x.float()).abs() / scale.expand_as(codes).flatten(-2)).max()
    assert rel <= (0.5 * 32 if fn is quantize_fp8 else 1.0)  # half a quantum at the top of the grid
    assert torch.equal(deq.bfloat16().float(), deq)  # codes·scale is exact in bf16


def test_block_length_must_divide():
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(2, 40))

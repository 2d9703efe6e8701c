"""Device rules of every kernels op: one device per call, no silent CPU fall-back for CUDA
tensors, GPU launches on the tensors' device and torch's current stream (GPU tests skip here)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import devices, reference

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


# ---- choose_backend on plain device objects -------------------------------------------------

def test_cpu_tensors_run_the_cpu_path():
    assert devices.choose_backend("op", {"x": CPU, "y": CPU}, "cupy", toolkit_ok=False) == "cpu"
    assert devices.choose_backend("op", {}, "cupy", toolkit_ok=False) == "cpu"


def test_cuda_tensors_run_the_gpu_path_when_the_toolkit_imports():
    assert devices.choose_backend("op", {"x": CUDA1, "y": CUDA1}, "triton", toolkit_ok=True) == "cuda"


@pytest.mark.parametrize("toolkit", ["cupy", "triton"])
def test_cuda_without_toolkit_is_an_error_not_a_cpu_fallback(toolkit):
    with pytest.raises(RuntimeError, match=rf"my_op: .*cuda:0.*{'CuPy' if toolkit == 'cupy' else 'Triton'}"):
        devices.choose_backend("my_op", {"x": CUDA0}, toolkit, toolkit_ok=False)


@pytest.mark.parametrize("second", [CPU, CUDA1])
def test_mixed_devices_name_the_op_and_the_devices(second):
    with pytest.raises(ValueError, match=rf"gather_dequantize: .*pool on cuda:0, slots on {second}"):
        devices.choose_backend("gather_dequantize", {"pool": CUDA0, "slots": second}, "cupy", toolkit_ok=True)


def test_other_device_types_are_rejected():
    with pytest.raises(ValueError, match="op: tensors on meta"):
        devices.backend("op", "cupy", x=torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="x on meta, y on cpu"):
        devices.backend("op", "cupy", x=torch.empty(2, device="meta"), y=torch.empty(2))
    assert devices.backend("op", "cupy", x=torch.empty(2), bias=None) == "cpu"


# ---- every public op applies the rules ----------------------------------------------------------

def _fake_cuda() -> SimpleNamespace:
    """Stands in for a CUDA tensor up to the device check (the check reads only .is_cpu and
    .device)."""
    return SimpleNamespace(device=CUDA0, is_cpu=False)


def _cpu(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# Each op called with its first tensor argument on "cuda:0" and the others on the CPU.
OPS = {
    "quantize": lambda g: kernels.quantize(g, "bf16"),
    "dequantize": lambda g: kernels.dequantize(g, "bf16"),
    "quantize_scatter": lambda g: kernels.quantize_scatter(g, _cpu(1, 1, 4, dtype=torch.uint8),
                                                           _cpu(1, dtype=torch.int64), "bf16"),
    "gather_dequantize": lambda g: kernels.gather_dequantize(g, _cpu(1, dtype=torch.int64), "bf16"),
    "route": lambda g: kernels.route(g, _cpu(4), 2, 1.0),
    "permute": lambda g: kernels.permute(g, 4),
    "act_quant_fp8": lambda g: kernels.act_quant_fp8(g),
    "fp8_linear": lambda g: kernels.fp8_linear(g, _cpu(16, 32, dtype=torch.uint8), _cpu(1, 1, dtype=torch.uint8)),
    "fp4_linear": lambda g: kernels.fp4_linear(g, _cpu(16, 16, dtype=torch.int8), _cpu(16, 1, dtype=torch.uint8)),
    "fp8_grouped_mm": lambda g: kernels.fp8_grouped_mm(g, _cpu(2, 16, 32, dtype=torch.uint8),
                                                       _cpu(2, 1, 1, dtype=torch.uint8), _cpu(2, dtype=torch.int32)),
    "fp4_grouped_mm": lambda g: kernels.fp4_grouped_mm(g, _cpu(2, 16, 16, dtype=torch.int8),
                                                       _cpu(2, 16, 1, dtype=torch.uint8), _cpu(2, dtype=torch.int32)),
}
SINGLE_TENSOR_OPS = {"quantize", "dequantize", "permute", "act_quant_fp8"}


@pytest.mark.parametrize("name", sorted(OPS))
def test_public_op_rejects_cuda_without_toolkit(name, monkeypatch):
    monkeypatch.setattr(devices, "importable", lambda module: False)
    call = OPS[name]
    if name in SINGLE_TENSOR_OPS:
        with pytest.raises(RuntimeError, match=rf"^{name}: the inputs are on cuda:0"):
            call(_fake_cuda())
    else:
        with pytest.raises(ValueError, match=rf"^{name}: all tensor arguments must be on one device, .*cuda:0.*cpu"):
            call(_fake_cuda())


# ---- GPU behaviour (skipped without a GPU) ----------------------------------------------------

def _gpu_ops(device: torch.device):
    """(name, run(x) on device, expected from the CPU reference) for a CuPy op and a Triton op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g)
    w = (torch.randn(128, 512, generator=g) * 20).to(torch.float8_e4m3fn)
    s = torch.full((1, 4), 127, dtype=torch.uint8)
    return [
        ("quantize", lambda t: kernels.quantize(t, "fp8_ds_mla"), reference.quantize(x, "fp8_ds_mla")),
        ("fp8_linear", lambda t: kernels.fp8_linear(t, w.to(device), s.to(device), (128, 128), out_dtype=torch.float32),
         reference.fp8_linear(x, w, s, (128, 128), out_dtype=torch.float32)),
    ], x


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    if out.dtype == torch.uint8:
        return torch.equal(out.cpu(), expected)
    return torch.allclose(out.cpu(), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ops_run_on_torchs_current_stream():
    """On a side stream that is still busy (a long sleep), the input is written and then the op
    runs: the op sees the written input only if it launched on that same stream."""
    ops, x = _gpu_ops(CUDA0)
    side = torch.cuda.Stream()
    for name, run, expected in ops:
        buf = torch.zeros_like(x, device=CUDA0)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)                           # ~0.1 s of GPU time on the side stream
            buf.copy_(x.to(CUDA0, non_blocking=True))
            out = run(buf)
        side.synchronize()
        assert _close(out, expected), name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_ops_run_on_the_tensors_device():
    ops, x = _gpu_ops(CUDA1)
    with torch.cuda.device(0):                                       # current device is not the tensors' one
        for name, run, expected in ops:
            out = run(x.to(CUDA1))
            assert out.device == CUDA1 and _close(out, expected), name

"""The fake CUDA device catches each GPU first-day fault it exists to catch, so it cannot quietly
stop checking: a host read (.item(), .tolist(), bool(t), .cpu()) or a synchronize while a graph
is captured, a CPU tensor mixed into a CUDA op, mixed dtypes into a GEMM, an index of the wrong
dtype, mask indexing and other data-dependent shapes, host data copied into a captured region,
a Triton launch with a CPU tensor or an illegal grid, a CuPy launch with a host pointer. And it
lets through what a GPU allows: pinned host mirrors copied without blocking, list indices,
0-dim CPU scalars, reads outside capture (counted)."""

from __future__ import annotations

import pytest
import torch

from tests.fake_cuda import FakeCudaFault


def _capture(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("inference_mode", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("read", ["item", "tolist", "bool", "cpu", "int"])
def test_a_host_read_inside_capture_is_a_fault(fake_device, read, inference_mode):
    """(inference mode dispatches .item() as aten.item, not _local_scalar_dense)"""
    with torch.inference_mode(inference_mode):
        x = torch.ones(4, device="cuda")
        op = {"item": lambda: x.sum().item(), "tolist": lambda: x.tolist(), "bool": lambda: bool(x.sum() > 0),
              "cpu": lambda: x.cpu(), "int": lambda: int(x[0])}[read]
        with pytest.raises(FakeCudaFault, match="host-read-in-capture"):
            _capture(op)
        mark = fake_device.mark()
        op()  # outside capture: counted
        assert fake_device.since(mark, "d2h")


def test_reads_outside_capture_are_counted_not_faults(fake_device):
    x = torch.ones(4, device="cuda")
    mark = fake_device.mark()
    x.sum().item()
    host = torch.empty(4, pin_memory=True)
    host.copy_(x, non_blocking=True)
    reads = fake_device.since(mark, "d2h")
    assert len(reads) == 2 and all(r.where.startswith("tests/gpu_dry_run/") for r in reads)
    assert host.is_pinned() and torch.equal(host, torch.ones(4))  # read back as the placeholder


def test_a_synchronize_inside_capture_is_a_fault(fake_device):
    with pytest.raises(FakeCudaFault, match="sync-in-capture"):
        _capture(torch.cuda.synchronize)
    event = torch.cuda.Event()
    with pytest.raises(FakeCudaFault, match="sync-in-capture"):
        _capture(event.synchronize)


def test_a_cpu_tensor_mixed_into_a_cuda_op_is_a_fault(fake_device):
    x = torch.ones(4, device="cuda")
    with pytest.raises(FakeCudaFault, match="cpu-tensor"):
        x + torch.ones(4)
    assert (x + torch.tensor(2.0)).device.type == "cuda"  # a 0-dim CPU scalar is allowed, as on CUDA


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_gemm_dtypes_are_a_fault(fake_device, dtypes):
    a = torch.ones(4, 8, device="cuda", dtype=dtypes[0])
    b = torch.ones(8, 3, device="cuda", dtype=dtypes[1])
    with pytest.raises(FakeCudaFault, match=r"\[dtype\]"):
        a @ b
    with pytest.raises(FakeCudaFault, match=r"\[dtype\]"):
        torch.nn.functional.linear(a, b.T)


def test_wrong_index_dtypes_are_a_fault(fake_device):
    x = torch.ones(4, 8, device="cuda")
    with pytest.raises(FakeCudaFault, match=r"\[dtype\]"):
        x.gather(1, torch.zeros(4, 2, dtype=torch.int32, device="cuda"))
    with pytest.raises(FakeCudaFault, match=r"\[dtype\]"):
        x[torch.zeros(2, dtype=torch.float32, device="cuda").long().float()]  # float index


@pytest.mark.parametrize("op", ["mask", "nonzero", "repeat_interleave", "unique", "mask_assign"])
def test_data_dependent_shapes_are_faults(fake_device, op):
    x = torch.ones(4, device="cuda")
    fn = {"mask": lambda: x[x > 0], "nonzero": lambda: x.nonzero(),
          "repeat_interleave": lambda: torch.repeat_interleave(torch.ones(3, dtype=torch.long, device="cuda")),
          "unique": lambda: torch.unique(x), "mask_assign": lambda: x.__setitem__(x > 0, 0.0)}[op]
    with pytest.raises(FakeCudaFault, match="data-dependent-shape"):
        fn()


def test_host_data_copied_into_a_captured_region_is_a_fault(fake_device):
    buf = torch.zeros(4, device="cuda")
    host = torch.arange(4.0)
    with pytest.raises(FakeCudaFault, match="host-data-in-capture"):
        _capture(lambda: buf.copy_(host))
    with pytest.raises(FakeCudaFault, match="host-data-in-capture"):
        _capture(lambda: torch.tensor([1, 2, 3], device="cuda"))
    with pytest.raises(FakeCudaFault, match="host-data-in-capture"):
        _capture(lambda: torch.tensor(5, device="cuda"))  # 0-dim: still a copy from the host
    buf.copy_(host)  # outside capture: one host-to-device copy
    assert fake_device.transfers[-1].kind == "h2d"


def test_fp32_grouped_mm_reads_its_offsets_on_the_host(fake_device):
    """CUDA's grouped GEMM takes bf16 only; its fallback copies the offsets to the host."""
    x = torch.ones(6, 8, device="cuda")
    w = torch.ones(2, 4, 8, device="cuda").transpose(1, 2)  # [E, K, N], as the engine passes it
    offs = torch.tensor([2, 6], dtype=torch.int32, device="cuda")
    with pytest.raises(FakeCudaFault, match="host-read-in-capture"):
        _capture(lambda: torch.nn.functional.grouped_mm(x, w, offs=offs))
    out = torch.nn.functional.grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)  # the fast path
    assert out.dtype == torch.bfloat16 and out.shape == (6, 4)


def test_triton_launch_checks(fake_device):
    """A launch with a CPU tensor or a grid beyond CUDA's limits is a fault; a good one is recorded."""
    from kernels.triton import moe_ops

    x = torch.ones(4, 8, device="cuda")
    order = torch.zeros(8, dtype=torch.int32, device="cuda")
    moe_ops.gather_rows(x, order, 2)
    launch = fake_device.launches[-1]
    assert launch.toolkit == "triton" and launch.kernel.endswith("_gather_rows_kernel")
    assert any(kind == "*fp32" for _, kind in launch.signature) and all(g >= 1 for g in launch.grid)
    with pytest.raises(FakeCudaFault, match="launch-arg"):
        moe_ops._gather_rows_kernel[(1,)](torch.ones(4, 8), order, torch.empty(8, 8, device="cuda"), 8, 8, 2,
                                          BLOCK=16)
    with pytest.raises(FakeCudaFault, match=r"\[grid\]"):
        moe_ops._gather_rows_kernel[(1, 70000)](x, order, torch.empty(8, 8, device="cuda"), 8, 8, 2, BLOCK=16)


def test_cupy_launch_checks(fake_device):
    """The .cu kernels: a launch records its grid; a host pointer is a fault."""
    import kernels
    from kernels import cuda_kv

    x = torch.ones(3, 64, device="cuda")
    pool = torch.zeros(2, 4, kernels.get_format("bf16", 64).record_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.tensor([0, 1, 5], device="cuda")
    kernels.quantize_scatter(x, pool, slots, "bf16")
    assert fake_device.launches[-1].toolkit == "cupy" and "scatter" in fake_device.launches[-1].kernel
    with pytest.raises(FakeCudaFault, match="launch-arg"):
        cuda_kv._launch("scatter_bf16<float>", pool, 3, (cuda_kv._ptr(torch.ones(3, 64)),))

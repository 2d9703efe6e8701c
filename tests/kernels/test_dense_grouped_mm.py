"""Grouped GEMM over dense expert weights (kernels/triton/dense_grouped_mm.py, kernels.dense_grouped_mm).

The Triton kernel runs under the interpreter on a machine without a GPU (tests/conftest.py sets
TRITON_INTERPRET) and compiled on one; it is checked against the plain-torch reference
(kernels.reference.dense_grouped_mm) and against torch's own F.grouped_mm on CPU, on offsets with
empty experts, one busy expert, padding rows past the last expert and no rows at all. A
subprocess compiles it for sm_90a (no GPU needed) and reports registers and spills.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference

pytest.importorskip("triton")
from kernels.triton import dense_grouped_mm as triton_grouped  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the interpreter takes CPU tensors
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (S, ends): cumulative row ends per expert; rows from ends[-1] on belong to no expert.
OFFSET_CASES = {
    "mixed": (50, [3, 3, 30, 30, 45]),            # empty experts, several tiles, padding rows
    "one-expert": (37, [0, 0, 37, 37]),          # every row in one middle expert
    "first-expert": (20, [20, 20, 20]),
    "all-padding": (9, [0, 0]),                  # no row belongs to an expert
    "no-rows": (0, [0, 0, 0]),
}


def inputs(s: int, ends: list[int], n: int = 36, k: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=g).to(dtype)                        # [S, K]
    w = torch.randn(len(ends), n, k, generator=g).to(dtype)             # [E, N, K]
    return x, w, torch.tensor(ends, dtype=torch.int32)


def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
                             zero_tail: bool = True) -> None:
    """Within 1e-4 of the products' absolute sums (fp32 sums in any order; TF32 would miss it),
    plus an output ulp for 16-bit outputs; rows past ends[-1] exactly zero (unless `zero_tail`
    is False: torch's CUTLASS path leaves them unwritten)."""
    ref = reference.dense_grouped_mm(x, w, ends).float()
    magnitude = reference.dense_grouped_mm(x.abs(), w.abs(), ends).float()   # sum |x||w| per element
    end = int(ends[-1]) if ends.numel() else 0
    out = out.float().cpu() if zero_tail else torch.cat([out[:end].float().cpu(), torch.zeros_like(ref[end:])])
    assert out.shape == ref.shape and torch.isfinite(out).all()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[x.dtype]
    err = (out - ref).abs()
    bound = 1e-4 * magnitude + ulp * ref.abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors, so an output row no tile writes shows up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


# ---- the Triton kernel ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_kernel_matches_reference_and_torch(case, dtype, poisoned_empty):
    s, ends = OFFSET_CASES[case]
    x, w, offs = inputs(s, ends, dtype=dtype)
    out = triton_grouped.dense_grouped_mm(*on_device(x, w, offs))
    assert out.dtype == dtype and out.shape == (s, w.shape[1])
    assert_matches_reference(out, x, w, offs)
    end = ends[-1]
    expected = F.grouped_mm(x.float(), w.float().transpose(1, 2), offs=offs)[:end]   # torch's own fp32 product
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(out[:end].float().cpu(), expected, rtol=ulp, atol=1e-4)


def _weight_layouts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    big = torch.randn(w.shape[0], 2 * w.shape[1], w.shape[2] + 8, generator=torch.Generator().manual_seed(2))
    return {
        "k-major": w.transpose(1, 2).contiguous().transpose(1, 2),         # the CPU relayout: (N·K, 1, N)
        "every-other-row": big.to(w.dtype)[:, ::2, :w.shape[2]],            # (2N·(K+8), 2(K+8), 1)
        "expert-interleaved": w.permute(1, 0, 2).contiguous().permute(1, 0, 2),   # (K, E·K, 1)
    }


def _x_layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"contiguous": x, "column-major": x.t().contiguous().t(),
            "every-other-column": x.repeat_interleave(2, dim=1)[:, ::2]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("w_layout", ["k-major", "every-other-row", "expert-interleaved"])
@pytest.mark.parametrize("x_layout", ["contiguous", "column-major", "every-other-column"])
def test_kernel_takes_any_strides(x_layout, w_layout, dtype):
    """Expert stacks and activations that are views (the CPU engine's relayout, strided slices):
    the kernel reads them through their strides."""
    x, w, offs = inputs(44, [10, 10, 33, 40], dtype=dtype, seed=1)
    xv, wv = _x_layouts(x)[x_layout], _weight_layouts(w)[w_layout]
    assert not wv.is_contiguous() and torch.equal(xv, x) and (x_layout == "contiguous") == xv.is_contiguous()
    out = triton_grouped.dense_grouped_mm(*on_device(xv, wv, offs))
    assert_matches_reference(out, xv, wv, offs)


def test_kernel_k_and_n_edges(poisoned_empty):
    """K = 0 (empty sums), N not a multiple of the tile, one row per expert."""
    x, w, offs = inputs(6, [2, 4, 5], n=5, k=0)
    assert torch.equal(triton_grouped.dense_grouped_mm(*on_device(x, w, offs)).cpu(), torch.zeros(6, 5))
    x, w, offs = inputs(5, [1, 2, 3, 4, 5], n=17, k=3)
    assert_matches_reference(triton_grouped.dense_grouped_mm(*on_device(x, w, offs)), x, w, offs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the interpreter's numpy matmul notes the NaN
def test_kernel_propagates_nan_and_inf_only_to_their_rows():
    x, w, offs = inputs(40, [20, 40])
    x[3, 5] = float("nan")
    x[25, 0] = float("inf")
    out = triton_grouped.dense_grouped_mm(*on_device(x, w, offs)).cpu()
    ref = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    assert torch.isnan(out[3]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=1e-5)


# ---- the public entry point -----------------------------------------------------------------------

@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_entry_point_on_cpu_is_torch_grouped_mm(case):
    """CPU: F.grouped_mm bit for bit on the experts' rows (what the engine's CPU path computed
    before); rows past ends[-1] are unspecified there, as torch leaves them."""
    s, ends = OFFSET_CASES[case]
    x, w, offs = inputs(s, ends, dtype=torch.float32)
    w = w.transpose(1, 2).contiguous().transpose(1, 2)                  # GroupedWeight.relayout on CPU
    out = kernels.dense_grouped_mm(x, w, offs)
    end = ends[-1]
    assert torch.equal(out[:end], F.grouped_mm(x, w.transpose(1, 2), offs=offs)[:end])


def test_entry_point_runs_triton_inside_triton_on_cpu(monkeypatch):
    """devices.triton_on_cpu() (perf/bench_gpu_ops.py's GPU model) sends CPU tensors to the kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel takes CPU tensors only interpreted")
    from kernels.devices import triton_on_cpu

    calls = []
    launch = triton_grouped.dense_grouped_mm
    monkeypatch.setattr(triton_grouped, "dense_grouped_mm", lambda *a: calls.append(1) or launch(*a))
    x, w, offs = inputs(50, [3, 3, 30, 30, 45])
    with triton_on_cpu():
        out = kernels.dense_grouped_mm(x, w, offs)
    assert calls == [1]
    assert_matches_reference(out, x, w, offs)


@pytest.mark.parametrize("k,n", [(40, 36), (36, 40), (40, 12)])
@pytest.mark.parametrize("w_layout", ["row-major", "k-major", "every-other-row"])
def test_cutlass_layout_rule_matches_torch_stride_checks(k, n, w_layout):
    """kernels' rule for handing bf16 to torch's CUTLASS kernel accepts exactly the layouts whose
    strides torch's grouped GEMM accepts (its CPU build runs the same stride checks)."""
    x, w, offs = inputs(8, [4, 8], n=n, k=k, dtype=torch.bfloat16)
    w = _weight_layouts(w)[w_layout] if w_layout != "row-major" else w
    try:
        F.grouped_mm(x, w.transpose(1, 2), offs=offs)
        torch_takes = True
    except RuntimeError as exc:
        assert "strides" in str(exc)
        torch_takes = False
    assert (kernels._tma_aligned(x) and kernels._tma_aligned(w.transpose(1, 2))) == torch_takes


def test_grouped_weight_dense_branch_uses_the_entry_point():
    from engine.linear import GroupedWeight

    x, w, offs = inputs(30, [4, 4, 26], n=12, k=16)
    gw = GroupedWeight(3, 16, 12)
    gw.weight = torch.nn.Parameter(w, requires_grad=False)
    gw.relayout()
    out = gw.grouped_mm(x, offs)
    assert torch.equal(out[:26], F.grouped_mm(x, gw.weight.transpose(1, 2), offs=offs)[:26])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CuPy not needed)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_entry_point_is_capturable_in_a_cuda_graph(dtype):
    """Captured once, replayed on new offsets and rows (the static decode step's use): no host
    sync while capturing, and each replay equals the reference."""
    x, w, offs = inputs(64, [10, 10, 40, 50], n=96, k=128, dtype=dtype)
    x, w, offs = x.cuda(), w.cuda(), offs.cuda()
    kernels.dense_grouped_mm(x, w, offs)                       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.dense_grouped_mm(x, w, offs)
    for ends, seed in (([10, 10, 40, 50], 3), ([0, 64, 64, 64], 4), ([5, 6, 7, 8], 5)):
        x_new, _, offs_new = inputs(64, ends, n=96, k=128, dtype=dtype, seed=seed)
        x.copy_(x_new)
        offs.copy_(offs_new)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, x_new, w.cpu(), offs_new, zero_tail=not kernels._cutlass_grouped_mm(x, w))


# ---- bad input ------------------------------------------------------------------------------------

def _bad_cases():
    x, w, offs = inputs(10, [4, 10])
    return {
        "x 3-D": ((x[None], w, offs), "x must be \\[S, K\\]"),
        "int x": ((x.int(), w.int(), offs), "x must be \\[S, K\\]"),
        "weight 2-D": ((x, w[0], offs), "weight must be \\[E, N, K\\]"),
        "weight dtype": ((x, w.bfloat16(), offs), "weight must be .* of x's dtype"),
        "K mismatch": ((x[:, :39], w, offs), "x has K=39 but the weight has K=40"),
        "int64 offsets": ((x, w, offs.long()), "offsets must be int32"),
        "offsets length": ((x, w, offs[:1]), "offsets must be int32 \\[2\\]"),
        "decreasing": ((x, w, torch.tensor([6, 4], dtype=torch.int32)), "non-decreasing"),
        "past S": ((x, w, torch.tensor([4, 11], dtype=torch.int32)), "within \\[0, 10\\]"),
        "negative": ((x, w, torch.tensor([-1, 4], dtype=torch.int32)), "non-decreasing"),
        "two devices": ((x, w, offs.to("meta")), "one device"),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
@pytest.mark.parametrize("impl", ["triton", "entry", "reference"])
def test_bad_inputs_raise_clear_errors(impl, name):
    args, message = _bad_cases()[name]
    fn = {"triton": triton_grouped.dense_grouped_mm, "entry": kernels.dense_grouped_mm,
          "reference": reference.dense_grouped_mm}[impl]
    with pytest.raises(ValueError, match=message):
        fn(*args)


# ---- compiled for Hopper --------------------------------------------------------------------------

# Runs without TRITON_INTERPRET (triton.jit picks interpreted or compiled at import): the launch
# the wrapper makes for meta tensors of each shape, compiled with the JIT's specialisation (ints
# equal to 1 as constexprs, 16-divisible ints and every pointer marked divisible by 16).
COMPILE_SCRIPT = r"""
import sys, tempfile, re, subprocess
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from kernels.triton import dense_grouped_mm as m

POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int16: "*i16",
            torch.int32: "*i32"}

def usage(ptx):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                               "--gpu-name=" + sm_arch_from_capability(90), str(Path(tmp) / "k.ptx"),
                               "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
    log = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert done.returncode == 0 and regs and spills, log
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))

def compile_case(label, s, e, n, k, dtype):
    x = torch.empty(s, k, dtype=dtype, device="meta")
    w = torch.empty(e, n, k, dtype=dtype, device="meta")
    offs = torch.empty(e, dtype=torch.int32, device="meta")
    out = torch.empty(s, n, dtype=dtype, device="meta")
    tiles = m.gpu_tiles(s, e, dtype)
    grid, args, meta = m.launch_plan(x, w, offs, out, tiles, interpreted=False)
    fn = m._dense_grouped_mm_kernel
    options = {"num_warps": meta.pop("num_warps")}
    signature, constexprs, attrs = {}, dict(meta), {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTERS[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in meta})
    src = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    regs, stores, loads = usage(ptx)
    mma = sorted(set(re.findall(r"\b(w?gmma\.\S+|mma\.sync\.\S+)", ptx)))
    print(f"ok {label} {str(dtype)[6:]} BM={tiles.bm} BN={tiles.bn} BK={tiles.bk} grid={grid} "
          f"regs={regs} spill_stores={stores} spill_loads={loads} smem={compiled.metadata.shared} "
          f"mma={','.join(mma) or 'none'}", flush=True)

compile_case("unit", 50, 5, 36, 40, torch.float32)
# DeepSeek-V4-Flash w13 (N = 2·2048, K = 4096) over 256 experts: decode (64 tokens x 6) and prefill.
compile_case("v4-decode", 384, 256, 4096, 4096, torch.float32)
compile_case("v4-prefill", 32768, 256, 4096, 4096, torch.float32)
compile_case("v4-decode", 384, 256, 4096, 4096, torch.float16)
compile_case("v4-prefill", 32768, 256, 4096, 4096, torch.bfloat16)
"""


@pytest.mark.slow
def test_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"       # Triton's default, stated (it warns when unset)
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("ok ") for line in lines), done.stdout
    for line in lines:
        assert "spill_stores=0 " in line, line
        if " float32 " in line:
            assert "mma=none" in line, f"fp32 must stay fp32 FMAs, never TF32 tensor cores: {line}"
        else:
            assert ".f32.f16.f16" in line or ".f32.bf16.bf16" in line, f"16-bit operands, fp32 sums: {line}"

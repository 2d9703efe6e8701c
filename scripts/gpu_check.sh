#!/usr/bin/env bash
# The one device run for a task that is lent a GPU (one H200; no network; the image's torch
# 2.11+cu130 and cupy-cuda13x, CUDA 13 headers). Installs nothing: the machine's python3 with this
# checkout on PYTHONPATH. Everything lands under $OUT (or ./gpu_out); the summary is table.txt.
#   scripts/gpu_check.sh [seconds cap of the step benchmark, default 80]
# Worst case by the timeouts: 30 + 60 + 210 + 80 + 40 + 60 = 480 s, 8 minutes.
# Steps, each with its own timeout so the whole run stays under 8 minutes:
#   1. device + toolchain facts; the kernel loader's CUDA headers (must be CUDA 13 for NVRTC 13)
#   2. the .cu kernels build for sm_90, sm_100a and sm_103a (NVRTC, and nvcc when present)
#   3. every gpu-marked test: kernel parity vs the references (CuPy kernels), the compiled fused
#      decode step vs the static torch path, CUDA graph replay vs eager logits (teacher forcing)
#      and vs the uncaptured static path (bit for bit), one host sync per captured step and none
#      in an async-scheduled launch, MTP included (torch.cuda.set_sync_debug_mode); DeepSeek-V4.1's
#      captured decode/verify step (with and without DSpark) against its golden tokens
#      (tests/v41/test_static_decode_gpu.py, when ../shared/golden is carried), one sync per step
#   4. decode step time at batch 1/32/128 x context 4k/64k (small preset, captured), its split by
#      component, launches per step (torch.profiler), KV and MoE bandwidth vs the copy bandwidth
#   4b. verify-step attention with shared window reads vs per-token reads (perf/bench_sparse_mla.py)
#   5. launches per layer and KV bytes read vs needed, counted (perf/bench_gpu_ops.py)
# It cannot pass by accident: non-zero when any test fails or errors, when none ran or any was
# skipped (on a GPU machine every gpu test must run), or when any step fails or times out.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
cap=${1:-80}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
table="$out/table.txt"
: > "$table"
note() { echo "$*" | tee -a "$table"; }
fail() { note "FAILED: $*"; status=1; }

# 1. facts
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
timeout 30 python3 - <<'EOF' 2>&1 | tee -a "$out/device.txt" || status=1
import sys
import torch, cupy, triton
from kernels import loader
print("torch", torch.__version__, "cuda", torch.version.cuda, "| cupy", cupy.__version__, "| triton", triton.__version__)
dirs, major = loader.cuda_include_dirs(), loader.nvrtc_major()
print("NVRTC major", major, "| kernel headers", dirs)
if not dirs or loader.header_major(__import__("pathlib").Path(dirs[0])) != major:
    sys.exit("gpu_check: no CUDA headers matching NVRTC's major version")
EOF
cat "$out/device.txt" >> "$table"

# 2. the .cu kernels for every target
timeout 60 python3 -m kernels.compile_check 2>&1 | tee "$out/compile.txt" || fail "kernels.compile_check"
note "compile: $(grep -c '^ok' "$out/compile.txt") (file, arch) builds ok"

# 3. gpu tests
timeout 210 python3 -m pytest -q -rs -p no:cacheprovider -m gpu --junitxml="$out/tests.xml" tests \
    2>&1 | tee "$out/tests.log"
python3 - "$out/tests.xml" <<'EOF' 2>&1 | tee -a "$table" || status=1
import sys
import xml.etree.ElementTree as ET
try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    sys.exit(f"gpu_check: no test report ({exc})")
suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"gpu tests: {tests} collected, {failures} failed, {errors} errors, {skipped} skipped")
if tests == 0 or failures or errors or skipped:
    sys.exit("gpu_check: FAILED (every gpu test must run and pass on a GPU machine)")
EOF

# 4. step time, breakdown, launches, bandwidth
timeout "$cap" python3 perf/bench_step_breakdown.py --preset small --batches 1 32 128 --contexts 4096 65536 \
    --steps 3 2>&1 | tee "$out/step.txt" || fail "bench_step_breakdown"
cat "$out/step.txt" >> "$table"

# 4b. verify-step attention: shared window reads vs per-token reads (the M = 32 program's spill
#     against the union read)
timeout 40 python3 perf/bench_sparse_mla.py --batch 32 --q 1 2 4 2>&1 | tee "$out/mla.txt" \
    || fail "bench_sparse_mla"
tail -n 4 "$out/mla.txt" >> "$table"

# 5. launches per layer, bytes read vs needed (counted on the CPU path, Triton interpreted)
TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= timeout 60 python3 perf/bench_gpu_ops.py --batch 4 2>&1 \
    | tee "$out/ops.txt" || fail "bench_gpu_ops"
tail -n 12 "$out/ops.txt" >> "$table"

note "gpu_check: exit status $status"
exit $status

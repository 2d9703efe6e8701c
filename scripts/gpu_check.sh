#!/usr/bin/env bash
# The one device run for a task that is lent a GPU: the gpu-marked tests, then the graph and kernel
# benchmarks, each log under $OUT (or ./gpu_out). Installs nothing: it uses the machine's python3
# (torch + CuPy), with this checkout on PYTHONPATH. Usage: scripts/gpu_check.sh [bench seconds cap]
#
# It cannot pass by accident: the exit status is non-zero when any GPU test fails or errors, or
# when none ran or any was skipped (on a GPU machine every gpu test must run). Graph replay vs
# eager is one of those tests (logits under teacher forcing, tests/engine/test_cuda_graphs_gpu.py),
# as is replay vs the uncaptured static path, bit for bit; a benchmark that fails exits non-zero too.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
cap=${1:-150}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)' | tee -a "$out/device.txt"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m gpu --junitxml="$out/tests.xml" tests \
    2>&1 | tee "$out/tests.log"
python3 - "$out/tests.xml" <<'EOF' || status=1
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
timeout "$cap" python3 perf/bench_cuda_graphs.py --batch 1 8 32 --steps 16 2>&1 | tee "$out/graphs.txt" || status=1
timeout "$cap" python3 perf/bench_cuda_graphs.py --batch 1 4 --steps 16 --speculative-tokens 3 2>&1 \
    | tee -a "$out/graphs.txt" || status=1
timeout "$cap" python3 perf/bench_kernels.py --repeats 5 2>&1 | tee "$out/kernels.txt" || status=1
echo "gpu_check: exit status $status"
exit $status

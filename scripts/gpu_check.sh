#!/usr/bin/env bash
# The one device run for a task that is lent a GPU: the gpu-marked tests, then the graph and kernel
# benchmarks, each log under $OUT (or ./gpu_out). Installs nothing: it uses the machine's python3
# (torch + CuPy), with this checkout on PYTHONPATH. Usage: scripts/gpu_check.sh [bench seconds cap]
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
cap=${1:-150}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)' | tee -a "$out/device.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gpu.py \
    tests/engine/test_cuda_graphs_gpu.py 2>&1 | tee "$out/tests.log"
timeout "$cap" python3 perf/bench_cuda_graphs.py --batch 1 8 32 --steps 16 2>&1 | tee "$out/graphs.txt"
timeout "$cap" python3 perf/bench_cuda_graphs.py --batch 1 4 --steps 16 --speculative-tokens 3 2>&1 \
    | tee -a "$out/graphs.txt"
timeout "$cap" python3 perf/bench_kernels.py --repeats 5 2>&1 | tee "$out/kernels.txt"

#!/usr/bin/env bash
# The one prepared check for a lent NVIDIA H200 (Python 3.12 with torch 2.11+cu130, nvcc 13.0,
# ninja, compute-sanitizer; no network). Run from the repository root through the device tool,
# carrying .whl (made here by scripts/fetch_gpu_wheels.sh):
#     bash scripts/gpu_check.sh            (results under $OUT, or benchmarks/results/gpu when unset)
# Steps: install the carried wheels and this project; JIT-build the CUDA op through the builder
# and check it (scripts/check_cuda_jit.py); the exact test suite with the CUDA targets (large
# 64-bit-index test included; the hardware fp8 conversion against the PTX definition the CPU
# emulation assumes; the emulation tests themselves are left to CI); compute-sanitizer memcheck
# on a short run (the GEMV of the quantized linear included); the benchmark table
# (bf16 -> e4m3/e5m2/e2m1, G=128, 256 MiB and 2 GiB, against a device copy and torch composite
# ops); the quantized linear against bf16 nn.Linear, model-sized, CUDA graphs for M <= 16
# (scripts/bench_linear_cuda.py), and the tensor-core GEMV alone for M = 1..16 against bf16 cuBLAS and the
# panels + cuBLAS path at the same M, on 4096x4096 and 11008x4096, with the achieved HBM bandwidth (issue 37).
# Every step runs even if an earlier one failed; the summary says which passed.
# Step time limits add up to 555 s, so one call stays under 9.5 minutes (guesses until the first run on a
# device: a step that runs out is reported as rc=124 in the summary and the next one starts).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" DS_FPQUANT_LARGE_TESTS=1
py=python3
status=()
step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    status+=("$name: rc=$rc, $((SECONDS - t0)) s")
    tail -n 25 "$out/$name.log"
}

{ nvidia-smi; $py -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version; } > "$out/environment.txt" 2>&1
step install 60 bash -c "$py -m pip install -q --no-index --no-deps .whl/*.whl && $py -m pip install -q --no-deps --no-build-isolation -e ."
step build 120 $py scripts/check_cuda_jit.py
# the CPU emulation tests of the same kernels run in CI; here the kernels run for real
step tests 100 $py -m pytest -q -x tests/unit/ops tests/unit/linear/test_cuda_linear.py -k "not emulation" -p no:cacheprovider --junitxml="$out/junit.xml"
step sanitizer 60 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 $py scripts/sanitize_run.py
step bench 45 $py -m ds_fpquant bench --device cuda --sizes 256 2048 --formats e4m3 e5m2 e2m1 --group-sizes 128 --json "$out/bench.json"
step bench_linear 90 $py scripts/bench_linear_cuda.py --repeat 10 --json "$out/bench_linear.json"
# issue 37: the GEMV (M <= 16) against bf16 cuBLAS (nn.Linear) and against the panels + cuBLAS path at the same M
step bench_gemv 80 $py scripts/bench_linear_cuda.py --tokens $(seq 1 16) --shapes 4096x4096 11008x4096 --formats e4m3 e2m1 e3m2 e4m7 nvfp4 --paths gemv panels --repeat 10 --json "$out/bench_gemv.json"
printf '%s\n' "${status[@]}" | tee "$out/summary.txt"

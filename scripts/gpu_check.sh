#!/usr/bin/env bash
# The one prepared check for a lent NVIDIA H200 (Python 3.12 with torch 2.11+cu130, nvcc 13.0, ninja,
# compute-sanitizer, pytest-xdist; no network), issue 42. Run from the repository root through the device tool,
# carrying .whl (made here by scripts/fetch_gpu_wheels.sh):
#     bash scripts/gpu_check.sh
# Everything goes to a work folder that is packed into ONE archive, $OUT/gpu_check.tgz, next to $OUT/summary.txt
# (two files: the device tool returns at most 8). Both are rewritten after every step and by an EXIT/INT/TERM trap,
# so a failing step, the global deadline or a kill leaves the latest archive. Without $OUT they go to
# benchmarks/results/gpu.
#
# Steps, in order:
#   environment   nvidia-smi, versions; whether torch sees a CUDA device (without one every GPU step fails at once)
#   install       the carried wheels and this project
#   build         the CUDA op JIT-built through the builder (MAX_JOBS = the cores) and checked (check_cuda_jit.py)
#   then concurrently, two lanes:
#     tests       the CUDA-target tests only: the torch-cuda / cuda-cuda targets of every exact test,
#                 test_cuda_kernel.py (the large 64-bit-index test included), test_cuda_linear.py; xdist -n 8,
#                 --continue-on-collection-errors, no -x, -v (a killed run keeps its per-test lines)
#     memcheck, racecheck, synccheck   compute-sanitizer on scripts/sanitize_run.py (quantize kernels, and the GEMV
#                 of every format family at M = 1, 8, 16 for bf16 / fp16 / fp32 x), one after the other
#   [extra]       GPU_CHECK_EXTRA, if set: one more command (the dry-run test's step that sleeps past the deadline)
#   bench         scripts/bench_linear_cuda.py alone on the GPU: GEMV and peers, quantize / dequantize throughput
#
# The global deadline (GPU_CHECK_DEADLINE_S, default 480 s after the start) caps every step's own limit; a step
# that would start with less than GPU_CHECK_MIN_STEP_S (default 5 s) left is not started and the summary says the
# deadline skipped it. Each summary line: the step, its exit status (124: its limit or the deadline cut it), seconds.
# Exit status 0 when every step that ran passed, else 1. Other knobs: GPU_CHECK_PY (python, default python3),
# GPU_CHECK_SKIP (step names not to run, e.g. "install" where the project is installed already; the summary says so).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
py="${GPU_CHECK_PY:-python3}"
deadline_s="${GPU_CHECK_DEADLINE_S:-480}"
min_step_s="${GPU_CHECK_MIN_STEP_S:-5}"
skip=" ${GPU_CHECK_SKIP:-} "
t_start=$SECONDS
t_end=$((t_start + deadline_s))
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$work/status"
export PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" DS_FPQUANT_LARGE_TESTS=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# every step, in the order the summary lists them
steps=(environment install build tests memcheck racecheck synccheck)
[ -n "${GPU_CHECK_EXTRA:-}" ] && steps+=(extra)
steps+=(bench)

summarize() {  # summary.txt from the status files, then the archive; both replace the previous ones atomically
    (flock 9; write_summary) 9> "$work/status/lock"
}
write_summary() {
    {
        echo "gpu_check: deadline ${deadline_s} s, $((SECONDS - t_start)) s elapsed; $(date -u +%FT%TZ)"
        local name
        for name in "${steps[@]}"; do
            if [ -f "$work/status/$name" ]; then
                echo "$name: $(cat "$work/status/$name")"
            else
                echo "$name: not run (yet)"
            fi
        done
    } > "$work/summary.txt"
    # a log past 4 MiB keeps its first and last 2 MiB (the archive must stay under the tool's 16 MiB a file)
    local f
    for f in "$work"/*.log; do
        [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 4194304 ] || continue
        { head -c 2097152 "$f"; printf '\n[... cut by gpu_check ...]\n'; tail -c 2097152 "$f"; } > "$f.cut" && mv "$f.cut" "$f"
    done
    cp "$work/summary.txt" "$out/summary.txt.tmp" && mv "$out/summary.txt.tmp" "$out/summary.txt"
    # tar's status 1: a log grew while it was read (the other lane's step); the archive is still whole
    tar -czf "$out/gpu_check.tgz.tmp" -C "$work" --exclude=./status . 2> /dev/null
    if [ $? -le 1 ]; then mv "$out/gpu_check.tgz.tmp" "$out/gpu_check.tgz"; fi
}

on_exit() {
    trap - EXIT INT TERM
    local name
    for name in "${steps[@]}"; do  # a step a signal cut while it ran
        if [ -f "$work/status/$name.running" ] && [ ! -f "$work/status/$name" ]; then
            echo "interrupted" > "$work/status/$name"
        fi
    done
    summarize
    rm -rf "$work"
}
trap on_exit EXIT
trap 'jobs -p | xargs -r kill 2>/dev/null; exit 143' INT TERM

# The GPU steps run through gpu_cmd: without a CUDA device visible to torch they fail at once (rc 3).
no_gpu() { echo "no CUDA device visible to torch (see environment.log): not run"; return 3; }
gpu_cmd() { if [ "$gpu" = yes ]; then "$@"; else no_gpu; fi; }
sanitize() {  # sanitize TOOL: compute-sanitizer's TOOL on the short run of scripts/sanitize_run.py
    local leak=()
    [ "$1" = memcheck ] && leak=(--leak-check no)
    gpu_cmd compute-sanitizer --tool "$1" "${leak[@]}" --error-exitcode 9 --print-limit 50 \
        "$py" scripts/sanitize_run.py --tool "$1"
}
export -f no_gpu gpu_cmd sanitize

step() {  # step NAME LIMIT_S COMMAND...: COMMAND (a command or an exported function) under min(LIMIT_S, time to
          # the deadline), its output in NAME.log
    local name=$1 limit=$2; shift 2
    local left=$((t_end - SECONDS))
    if [[ "$skip" == *" $name "* ]]; then
        echo "skipped (GPU_CHECK_SKIP)" > "$work/status/$name"
    elif [ "$left" -lt "$min_step_s" ]; then
        echo "skipped by the deadline (${left} s left)" > "$work/status/$name"
    else
        local cut="" t0=$SECONDS rc
        if [ "$left" -lt "$limit" ]; then limit=$left cut=" (the deadline)"; fi
        touch "$work/status/$name.running"
        echo "== $name (limit ${limit} s$cut)"
        timeout -k 5 "$limit" bash -c '"$@"' "$name" "$@" > "$work/$name.log" 2>&1 &
        wait $!  # (in the background: a signal to this script is handled at once, not when the step ends)
        rc=$?
        echo "rc=$rc, $((SECONDS - t0)) s, limit ${limit} s$cut" > "$work/status/$name"
        tail -n 15 "$work/$name.log"
    fi
    summarize
}

step environment 30 bash -c "nvidia-smi; $py -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'; nvcc --version; compute-sanitizer --version; echo nproc=\$(nproc) MAX_JOBS=\$MAX_JOBS"
gpu=no
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1 && gpu=yes
echo "gpu=$gpu" >> "$work/environment.log"
export gpu py

step install 60 bash -c "$py -m pip install -q --no-index --no-deps --no-build-isolation .whl/*.whl && $py -m pip install -q --no-index --no-deps --no-build-isolation -e ."
step build 150 "$py" scripts/check_cuda_jit.py

# correctness and sanitizers side by side (both load the op the build step left in the JIT cache)
tests_lane() {
    step tests 240 gpu_cmd "$py" -m pytest -n 8 -v --continue-on-collection-errors -p no:cacheprovider \
        -k "(torch-cuda or cuda-cuda or test_cuda_kernel or test_cuda_linear) and not emulation" \
        --junitxml="$work/junit.xml" tests/unit
}
sanitizer_lane() {
    step memcheck 90 sanitize memcheck
    step racecheck 120 sanitize racecheck
    step synccheck 60 sanitize synccheck
}
tests_lane &
sanitizer_lane &
wait

if [ -n "${GPU_CHECK_EXTRA:-}" ]; then step extra 600 bash -c "$GPU_CHECK_EXTRA"; fi
# timing alone on the GPU; each row is one JSON line (in bench.log and bench.jsonl) the moment it is measured
step bench 200 gpu_cmd "$py" scripts/bench_linear_cuda.py --repeat 10 --json "$work/bench.jsonl"
cat "$work/summary.txt"
# exit status: 0 when every step that ran passed
! grep -q 'rc=[1-9]' "$work/summary.txt"

#!/usr/bin/env bash
# The GPU check for the CUDA kernels, in one command (run on a machine with an NVIDIA GPU,
# sm_80+, torch and CuPy installed):
#   1. the GPU test suite (pytest -m cuda tests/; the multi_gpu tests run where there are two GPUs),
#   2. compute-sanitizer memcheck and racecheck over scripts/sanitize_gemm.py's sweep (every GEMM
#      path and decode schedule, bits 2..5, fp16/bf16, M = 1..300, small and Llama-sized shapes);
#      any error or hazard fails the step,
#   3. the timing table (scripts/kernel_bench.py) with the host-overhead measurement.
# Logs go to $OUT (or ./gpu_check_out); a summary is printed last. Exit status: non-zero if
# any step failed.
#   Usage: scripts/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-gpu_check_out}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
QUICK=${1:-}
declare -A STATUS

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__)"

echo "== 1. GPU tests"
timeout ${T_TESTS:-900} python3 -m pytest -q -m cuda tests/ -p no:cacheprovider --maxfail=40 --durations=5 2>&1 | tee "$LOG/tests.txt" | tail -25
STATUS[tests]=${PIPESTATUS[0]}

echo "== 2. compute-sanitizer"
# One process per bit width, side by side (the sanitizers are slow); only this package's kernels.
for tool in memcheck racecheck; do
    for bits in 2 3 4 5; do
        timeout ${T_SAN:-900} compute-sanitizer --tool "$tool" --kernel-name kns=kbit_ --error-exitcode 3 \
            python3 scripts/sanitize_gemm.py $QUICK --bits $bits > "$LOG/sanitizer_${tool}_k$bits.txt" 2>&1 &
    done
    wait
    STATUS[$tool]=0
    for bits in 2 3 4 5; do
        f="$LOG/sanitizer_${tool}_k$bits.txt"
        # A clean run says so in its summary line and checks every launch's result.
        if ! grep -qE "(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)" "$f" || ! grep -q " 0 wrong" "$f"; then
            STATUS[$tool]=4
        fi
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|GEMM launches|WRONG|Error" "$f" | sed "s/^/k$bits: /" | head -6
    done
done

echo "== 3. timings"
timeout ${T_BENCH:-300} python3 scripts/kernel_bench.py $QUICK --json "$LOG/bench.json" 2>&1 | tee "$LOG/bench.txt"
STATUS[bench]=${PIPESTATUS[0]}

echo "== summary"
grep -E "passed|failed|error" "$LOG/tests.txt" | tail -1
rc=0
for k in tests memcheck racecheck bench; do
    echo "$k: exit ${STATUS[$k]}"
    [ "${STATUS[$k]}" = 0 ] || rc=1
done
exit $rc

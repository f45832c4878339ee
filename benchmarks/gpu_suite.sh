#!/usr/bin/env bash
# The one GPU run, on a lent H200 (Python 3.12, torch 2.11 CUDA 13.0, triton 3.6, nvcc 13.0,
# compute-sanitizer, pytest-xdist/-timeout, no network), in one call and within 8 minutes. Steps, each
# with its own timeout so a hang cannot eat the next step's time, results written as they come:
#   1. device, versions, python -m kvattn.env;
#   2. the CUDA module alone for sm_90 (the CPU harness is for machines without a GPU);
#   3. compute-sanitizer --tool memcheck over every CUDA kernel instantiation on small inputs
#      (benchmarks/cuda_smoke.py; the kernels have never run on a GPU before); the smoke alone
#      where the sanitizer cannot run;
#   4. the tests that use GPU tensors (-m "not host_only"), with a per-test timeout;
#   5. the tuning sweep (benchmarks/tune.py), about 100 s;
#   6. the decode, MLA decode and extend benchmark sweeps in what is left, each point's rows written
#      as soon as it is measured (rows.jsonl), slow providers sized by a first timed call.
# Everything goes under $OUT (at most 8 files: the device tool's limit) and benchmarks/results/.
#
#   KVATTN_COMMIT=$(git rev-parse --short=10 HEAD) bash benchmarks/gpu_suite.sh
#
# KVATTN_COMMIT names the commit (the copy on the GPU machine has no .git). SUITE_BUDGET_S (default
# 470) bounds the whole script. Exits non-zero, and says so in its last lines, when the build, the
# smoke, the tests or a kvattn benchmark provider failed. Dry run on a CPU (nothing built, the
# harness for the smoke, the tiny presets, run folders elsewhere): SUITE_SKIP_BUILD=1
# SUITE_SKIP_TESTS=1 SUITE_PRESET=cpu-tiny SUITE_RESULTS=/tmp (tests/test_gpu_suite.py does this).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-470}
OUTDIR=${OUT:-benchmarks/results/gpu-suite-$(date -u +%Y%m%d-%H%M%S)}
RESULTS=${SUITE_RESULTS:-benchmarks/results}  # where the run folders are copied (commit them)
mkdir -p "$OUTDIR"
LOG="$OUTDIR/suite.log"
exec > >(tee -a "$LOG") 2>&1
step() { echo "== [$SECONDS s] $*"; }
left() { echo $(( BUDGET - SECONDS )); }
# A step's timeout: what it asks for, never more than what the budget has left (less 30 s to wrap up).
cap() { local l=$(( $(left) - 30 )); [ "$l" -lt 5 ] && l=5; echo $(( $1 < l ? $1 : l )); }
on_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step "device and versions (commit ${KVATTN_COMMIT:-unknown})"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
nvcc --version | tail -2 || true
timeout "$(cap 60)" "$PY" -m kvattn.env || true

build_rc=skipped
if [ "${SUITE_SKIP_BUILD:-0}" = 1 ]; then
  step "build skipped (SUITE_SKIP_BUILD=1)"
else
  step "build the CUDA module for sm_90 (ptxas report in build/cuda/)"
  KVATTN_CUDA_ARCHS=90 KVATTN_SKIP_HARNESS_BUILD=1 timeout "$(cap 200)" "$PY" setup.py build_ext --inplace \
    > "$OUTDIR/build.log" 2>&1
  build_rc=$?
  tail -20 "$OUTDIR/build.log"
  [ -f build/cuda/resources.json ] && cp build/cuda/resources.json "$OUTDIR/resources.json"
fi

step "every CUDA kernel once on small inputs, under compute-sanitizer memcheck when it runs here"
smoke_backend=cuda
[ "$on_gpu" = 1 ] || smoke_backend=cuda_sim
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
smoke_rc=skipped
if [ -n "$sanitizer" ] && [ "$on_gpu" = 1 ]; then
  timeout "$(cap 120)" "$sanitizer" --tool memcheck --error-exitcode 3 "$PY" -m benchmarks.cuda_smoke \
    --backend cuda > "$OUTDIR/smoke.log" 2>&1
  smoke_rc=$?
  if grep -q "Device not supported\|Unable to\|error 999" "$OUTDIR/smoke.log"; then
    echo "compute-sanitizer cannot run on this machine (see smoke.log); the smoke without it:"
    timeout "$(cap 60)" "$PY" -m benchmarks.cuda_smoke --backend cuda >> "$OUTDIR/smoke.log" 2>&1
    smoke_rc=$?
  fi
else
  timeout "$(cap 120)" "$PY" -m benchmarks.cuda_smoke --backend "$smoke_backend" > "$OUTDIR/smoke.log" 2>&1
  smoke_rc=$?
fi
tail -15 "$OUTDIR/smoke.log"

tests_rc=skipped
if [ "${SUITE_SKIP_TESTS:-0}" != 1 ]; then
  step "tests on GPU tensors (-m 'not host_only'), 60 s per test"
  opts=(-m "not host_only" -p no:cacheprovider -q)
  "$PY" -c "import xdist" 2>/dev/null && opts+=(-n 8)
  "$PY" -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 60)
  timeout "$(cap 170)" "$PY" -m pytest tests "${opts[@]}" > "$OUTDIR/tests.log" 2>&1
  tests_rc=$?
  tail -25 "$OUTDIR/tests.log"
fi

scratch=$(mktemp -d)
tune_rc=skipped
tune_s=$(( $(left) > 400 ? 100 : $(left) / 4 ))
if [ "$tune_s" -gt 20 ]; then
  step "tuning sweep (budget $tune_s s)"
  timeout "$(cap $(( tune_s + 20 )))" "$PY" -m benchmarks.tune --time-budget-s "$tune_s" --out-dir "$scratch/tune"
  tune_rc=$?
  cat "$scratch"/tune/*/tune.md 2>/dev/null | head -40
fi

collect() {  # $1: run folder, $2: prefix of the summary's copy in $OUTDIR ("none": into the log)
  cp -r "$1" "$RESULTS/"
  if [ "$2" = none ]; then
    [ -f "$1/summary.md" ] && sed -n '/^## Targets/,$p' "$1/summary.md"
  else
    [ -f "$1/summary.md" ] && cp "$1/summary.md" "$OUTDIR/${2}summary.md"
  fi
  echo "results: $RESULTS/$(basename "$1")"
}
sweep() {  # $1: decode, mla or extend, $2: its budget (s), $3: the least worth starting, $4: as collect's $2
  sweep_rc=skipped
  if [ "$2" -gt "$3" ]; then
    local preset=${SUITE_PRESET:-gpu-suite}
    step "$1 benchmark sweep ($preset preset, budget $2 s)"
    timeout "$(cap $(( $2 + 20 )))" "$PY" -m "benchmarks.$1" --preset "$preset" --time-budget-s "$2" \
      --out-dir "$scratch/$1"
    sweep_rc=$?
    for run_dir in "$scratch/$1"/*; do
      [ -d "$run_dir" ] && collect "$run_dir" "$4"
    done
  else
    step "no time left for the $1 sweep ($2 s)"
  fi
}
bench_left=$(( $(left) - 40 ))
extend_left=$(( bench_left * 2 / 5 ))
[ $extend_left -gt 100 ] && extend_left=100
# MLA decode: a sixth, at most 60 s; its summary goes into suite.log (the 8 files of $OUTDIR are taken).
mla_left=$(( bench_left / 6 ))
[ $mla_left -gt 60 ] && mla_left=60
sweep decode $(( bench_left - extend_left - mla_left )) 30 ""
decode_rc=$sweep_rc
sweep mla $mla_left 20 none
mla_rc=$sweep_rc
sweep extend $(( $(left) - 35 )) 20 extend-
extend_rc=$sweep_rc

for run_dir in "$scratch"/tune/*; do [ -d "$run_dir" ] && cp -r "$run_dir" "$RESULTS/"; done
[ -n "$(ls -A "$scratch" 2>/dev/null)" ] && tar -czf "$OUTDIR/results.tar.gz" -C "$scratch" .
step "done: build=$build_rc smoke=$smoke_rc tests=$tests_rc tune=$tune_rc decode=$decode_rc extend=$extend_rc mla=$mla_rc"
ls -la "$OUTDIR"
[ -f "$OUTDIR/summary.md" ] && sed -n '/^## Targets/,/^## Decode/p' "$OUTDIR/summary.md"
[ -f "$OUTDIR/extend-summary.md" ] && sed -n '/^## Targets/,/^## Extend/p' "$OUTDIR/extend-summary.md"
ok() { [ "$1" = 0 ] || [ "$1" = skipped ]; }
failed=()
ok "$build_rc" || failed+=("build")
ok "$smoke_rc" || failed+=("cuda smoke (see smoke.log)")
ok "$tests_rc" || failed+=("tests (see tests.log)")
ok "$decode_rc" || failed+=("decode sweep (a kvattn provider failed or the sweep stopped)")
ok "$extend_rc" || failed+=("extend sweep (a kvattn provider failed or the sweep stopped)")
ok "$mla_rc" || failed+=("MLA decode sweep (a kvattn provider failed or the sweep stopped)")
if [ ${#failed[@]} -gt 0 ]; then
  echo "GPU SUITE FAILED: ${failed[*]}"
  exit 1
fi
echo "GPU suite passed"

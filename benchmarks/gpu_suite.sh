#!/usr/bin/env bash
# The one GPU script: on a lent H200 (Python 3.12, torch 2.11 CUDA 13.0, triton 3.6, nvcc 13.0, no
# network), in one call and under 8 minutes: build the CUDA extension for sm_90, run the whole test
# suite on the device, run the decode and extend benchmark sweeps sized to what time is left, and
# write everything under $OUT (when set) and benchmarks/results/. Needs no package beyond that
# machine's image.
#
#   KVATTN_COMMIT=$(git rev-parse --short=10 HEAD) bash benchmarks/gpu_suite.sh
#
# KVATTN_COMMIT names the commit when the tree travels without .git. SUITE_BUDGET_S (default 470)
# bounds the whole script; each step has its own timeout so a hang cannot eat the next step's time.
# For a dry run of the script itself on a CPU: SUITE_SKIP_BUILD=1 SUITE_SKIP_TESTS=1
# SUITE_PRESET=cpu-tiny.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-470}
OUTDIR=${OUT:-benchmarks/results/gpu-suite-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/suite.log"
exec > >(tee -a "$LOG") 2>&1
step() { echo "== [$SECONDS s] $*"; }

step "device and versions"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
nvcc --version | tail -2 || true

build_rc=skipped
if [ "${SUITE_SKIP_BUILD:-0}" = 1 ]; then
  step "build skipped (SUITE_SKIP_BUILD=1)"
elif grep -q "build_ext" setup.py; then
  step "build extensions (sm_90 via setup.py, ptxas report in build/cuda/)"
  timeout 180 "$PY" setup.py build_ext --inplace > "$OUTDIR/build.log" 2>&1
  build_rc=$?
  tail -40 "$OUTDIR/build.log"
  [ -f build/cuda/resources.json ] && cp build/cuda/resources.json "$OUTDIR/resources.json"
else
  step "setup.py has no build_ext: no extension to build"
fi
"$PY" -c "import kvattn.backends as b; print('backends loadable:', \
{n: (b.load(n)[1] or 'ok') for n in b.names()})" || true

tests_rc=skipped
if [ "${SUITE_SKIP_TESTS:-0}" != 1 ]; then
  step "test suite on the device"
  xdist=""
  "$PY" -c "import xdist" 2>/dev/null && xdist="-n 8"
  timeout 200 "$PY" -m pytest -q tests $xdist -p no:cacheprovider > "$OUTDIR/tests.log" 2>&1
  tests_rc=$?
  tail -25 "$OUTDIR/tests.log"
fi

left=$(( BUDGET - SECONDS - 25 ))
[ $left -gt 240 ] && left=240
# The decode sweep gets two thirds of what is left (its whole gpu-suite preset is estimated at about
# 140 s), the extend sweep the rest, at most 80 s (its preset is estimated at about 60 s; see
# benchmarks/results/README.md). Each sweep has its own timeout.
extend_left=$(( left / 3 ))
[ $extend_left -gt 80 ] && extend_left=80
decode_left=$(( left - extend_left ))
scratch=$(mktemp -d)
# The device tool brings back at most 8 files from $OUT: suite.log, build.log, tests.log,
# resources.json, the two summaries and one results.tar.gz holding every run folder (CSV, JSON, plots).
collect() {  # $1: run folder, $2: prefix of the summary's copy in $OUTDIR
  cp -r "$1" benchmarks/results/
  cp "$1/summary.md" "$OUTDIR/${2}summary.md"
  echo "results: benchmarks/results/$(basename "$1")"
}
sweep() {  # $1: decode or extend, $2: its budget (s), $3: the least worth starting, $4: as collect's $2
  sweep_rc=skipped
  if [ "$2" -gt "$3" ]; then
    local preset=${SUITE_PRESET:-gpu-suite}
    step "$1 benchmark sweep ($preset preset, budget $2 s)"
    timeout $(( $2 + 20 )) "$PY" -m "benchmarks.$1" --preset "$preset" \
      --time-budget-s "$2" --out-dir "$scratch/$1"
    sweep_rc=$?
    for run_dir in "$scratch/$1"/*; do
      [ -f "$run_dir/summary.md" ] && collect "$run_dir" "$4"
    done
  else
    step "no time left for the $1 sweep ($2 s)"
  fi
}
sweep decode "$decode_left" 30 ""
bench_rc=$sweep_rc
sweep extend "$extend_left" 20 extend-
extend_rc=$sweep_rc

runs=$(ls "$scratch"/*/ -d 2>/dev/null | wc -l)
[ "$runs" -gt 0 ] && tar -czf "$OUTDIR/results.tar.gz" -C "$scratch" .
step "done: build=$build_rc tests=$tests_rc bench=$bench_rc extend=$extend_rc; files in $OUTDIR"
ls -la "$OUTDIR"
[ -f "$OUTDIR/summary.md" ] && sed -n '/^## Targets/,/^## Decode/p' "$OUTDIR/summary.md"
[ -f "$OUTDIR/extend-summary.md" ] && sed -n '/^## Targets/,/^## Extend/p' "$OUTDIR/extend-summary.md"
ok() { [ "$1" = 0 ] || [ "$1" = skipped ]; }
ok "$build_rc" && ok "$tests_rc" && [ "$bench_rc" = 0 ] && ok "$extend_rc"

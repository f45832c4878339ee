#!/usr/bin/env bash
# The one GPU run: a single command of about 8 minutes on the GPU machine (one H200; Python 3.12,
# torch 2.11 for CUDA 13.0, triton 3.6, nvcc 13.0, compute-sanitizer, Nsight Compute, 16 cores, no
# network). GPU time is scarce, so the steps come in the order that settles the goals first (what
# the check costs, checked against unchecked), and a run stopped at any minute keeps everything it
# measured before that minute:
#    0. second 0: the CUDA module for sm_90 starts building in the background, its translation
#       units compiled in parallel (KVATTN_BUILD_JOBS); nothing before step 4 needs it;
#    1. device and versions;
#    2. the headline points, Triton checked, unchecked and (decode) through a verdict resolved
#       outside the timing, CUDA-graph replay, 5 repeats (a spread): decode at batch 16 and 64 x 8K
#       and 32K and batch 1 x 4K and 32K, extend of a 4K prefill and of a 512-token chunk over 8K
#       (bf16, 32/8 heads, head dim 128, page 16; extend's rows carry their TFLOP/s); then the
#       keyed transfer digest on the device beside a copy of the same bytes (GB/s; 512 pages of a
#       32-layer model, benchmarks/transfer_digest.py); then kvattn's ops (stamping writes, the
#       step's verdict, checked Triton decodes) of a 4-layer decode step captured in one CUDA
#       graph and replayed with the ledger's buffer refill between replays, bit for bit against
#       eager, a page re-tagged between replays caught on replay, a skipped refill reading nothing
#       (benchmarks/graph_replay.py: at most 45 s, about 20 s of them for the steps; its rows say
#       which check failed);
#    3. tuning of the Triton decode and extend (benchmarks/tune.py: a time share per op and point,
#       the default configuration first, then its neighbours and the split counts that fill the
#       slots);
#    4. the build, waited for; its duration is in build.log;
#    5. when it built: tuning of the CUDA decode's split count, then the CUDA rows of the headline
#       (decode checked, unchecked and through a verdict);
#    6. FlexAttention on two headline shapes, its compile timed apart and the step bounded (60 s);
#    7. the decode, MLA decode and extend sweeps (gpu-suite presets, less the headline points), in
#       what is left less the smoke's time and 30 s: the first thing a slow run drops;
#    8. every CUDA kernel instantiation on small inputs under compute-sanitizer memcheck
#       (benchmarks/cuda_smoke.py; alone where the sanitizer cannot run);
#    9. the tests on GPU tensors (-m "not host_only"), with what is left;
#   10. when 40 s or more remain: Nsight Compute's speed-of-light and warp-state sections of the
#       Triton decode (checked, unchecked) and extend (benchmarks/ncu_kernels.py).
# Every step runs under `timeout -k`, its time bounded by what is left of one budget, and writes
# into $OUT as it goes. $OUT holds at most 8 files, none in a folder (all the GPU machine gives back):
#   suite.log       everything printed; each step's start, exit status and seconds;
#   build.log       the CUDA build's output, then its exit status and duration;
#   rows.jsonl      every row measured by every step (benchmarks, tuning, FlexAttention) and the
#                   build's duration, appended as each point or configuration is measured;
#   summary.md      each benchmark and tuning summary, appended as its step ends;
#   results.tar.gz  this run's folders (the benchmarks' own files, the build's ptxas figures),
#                   packed again after every step: commit them under benchmarks/results/;
#   smoke.log, tests.log, ncu.txt.
#
#   KVATTN_COMMIT=$(git rev-parse --short=10 HEAD) bash benchmarks/gpu_suite.sh
#
# KVATTN_COMMIT names the commit (the copy on the GPU machine has no .git). SUITE_BUDGET_S (default
# 470) bounds the whole script; SUITE_TIME_SCALE (default 1) multiplies every step's own time.
# Exits non-zero, and says which steps in its last lines, when the build, a benchmark or tuning step
# (a kvattn provider failed or the step was stopped), the graph replay's checks, the smoke or the
# tests failed. Dry run on a CPU (nothing built, the harness for the smoke, the tiny presets, the
# run folders elsewhere):
# SUITE_SKIP_BUILD=1 SUITE_SKIP_TESTS=1 SUITE_PRESET=cpu-tiny SUITE_RESULTS=<a folder>
# (tests/benchmarks/test_gpu_suite.py does this, with a large budget and time scale).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-470}
SCALE=${SUITE_TIME_SCALE:-1}
PRESET=${SUITE_PRESET:-gpu-suite}
TUNE_S=$(( ${SUITE_TUNE_S:-90} * SCALE ))  # three quarters for the Triton ops, a quarter for CUDA
SMOKE_S=75  # kept for the CUDA smoke when the sweeps are sized
OUTDIR=${OUT:-benchmarks/results/gpu-suite-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
RUNS=${SUITE_RESULTS:-$(mktemp -d)}  # parent of the run folders
mkdir -p "$RUNS" && RUNS=$(cd "$RUNS" && pwd)
SCRATCH=$(mktemp -d)
ROWS="$OUTDIR/rows.jsonl"
SUMMARY="$OUTDIR/summary.md"
exec > >(tee -a "$OUTDIR/suite.log") 2>&1
TEE_PID=$!
# On exit, the log's last lines are written before the script ends.
trap 'exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

step() { echo "== [$SECONDS s] $*"; }
left() { echo $(( BUDGET - SECONDS )); }
# A step's time: what it asks for (times SCALE), never more than the budget has left less $2
# (default 30 s, to wrap up), never under 5 s.
cap() {
  local want=$(( $1 * SCALE )) l=$(( $(left) - ${2:-30} ))
  [ "$l" -lt 5 ] && l=5
  echo $(( want < l ? want : l ))
}

declare -A RC SUMMARIZED
EXISTING=$(ls -A "$RUNS")  # folders already there belong to other runs
# This run's folders into results.tar.gz, and the summaries not yet in summary.md, after each step.
pack() {
  local names=() dir name f
  for dir in "$RUNS"/*/; do
    [ -d "$dir" ] || continue
    name=$(basename "$dir")
    grep -qxF -- "$name" <<<"$EXISTING" && continue
    names+=("$name")
    [ -n "${SUMMARIZED[$name]:-}" ] && continue
    for f in summary.md tune.md; do
      if [ -f "$dir/$f" ]; then
        printf '\n<!-- %s/%s -->\n' "$name" "$f" >> "$SUMMARY"
        cat "$dir/$f" >> "$SUMMARY"
        SUMMARIZED[$name]=1
      fi
    done
  done
  [ ${#names[@]} -gt 0 ] || return 0
  tar -czf "$SCRATCH/results.tar.gz" -C "$RUNS" "${names[@]}" && cp "$SCRATCH/results.tar.gz" "$OUTDIR/"
}
# run NAME LIMIT OUTPUT COMMAND...: COMMAND under `timeout -k` for at most LIMIT seconds (from cap),
# its output appended to OUTPUT (- : the log); its exit status in RC[NAME]; then pack.
run() {
  local name=$1 limit=$2 output=$3 t0=$SECONDS rc
  shift 3
  step "$name: start (at most $limit s)"
  if [ "$output" = - ]; then
    timeout -k 10 "$limit" "$@"
  else
    timeout -k 10 "$limit" "$@" >> "$output" 2>&1
  fi
  rc=$?
  RC[$name]=$rc
  step "$name: rc=$rc in $(( SECONDS - t0 )) s$( { [ $rc = 124 ] || [ $rc = 137 ]; } && echo ' (stopped by its timeout)')"
  pack
}
skip() { RC[$1]=skipped; step "$1: skipped ($2)"; }

# 0. The CUDA build, in the background from second 0.
BUILD_JOBS=${SUITE_BUILD_JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}  # 2 cores left to Python
build_pid=
if [ "${SUITE_SKIP_BUILD:-0}" = 1 ]; then
  skip cuda-build "SUITE_SKIP_BUILD=1"
else
  build_limit=$(cap 300)
  step "cuda-build: start in the background (sm_90, $BUILD_JOBS build jobs, at most $build_limit s; build.log)"
  (
    t0=$SECONDS
    KVATTN_CUDA_BUILD=1 KVATTN_CUDA_ARCHS=90 KVATTN_SKIP_HARNESS_BUILD=1 KVATTN_BUILD_JOBS=$BUILD_JOBS \
      timeout -k 10 "$build_limit" "$PY" setup.py build_ext --inplace >> "$OUTDIR/build.log" 2>&1
    rc=$?
    echo "cuda-build: rc=$rc in $(( SECONDS - t0 )) s ($BUILD_JOBS build jobs)" >> "$OUTDIR/build.log"
    printf '{"step": "cuda-build", "rc": %d, "seconds": %d, "build_jobs": %d, "started_at_s": %d}\n' \
      "$rc" $(( SECONDS - t0 )) "$BUILD_JOBS" "$t0" >> "$ROWS"
    exit "$rc"
  ) &
  build_pid=$!
fi

# 1. Device and versions.
COMMIT=${KVATTN_COMMIT:-$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)}
STAMP=$(date -u +%Y%m%d-%H%M%S)
SLUG=$(timeout -k 5 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
       | tr 'A-Z' 'a-z' | sed -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
SLUG=${SLUG:-cpu}  # as the benchmarks name the device in their folders
step "versions: start (commit $COMMIT, budget $BUDGET s, preset $PRESET)"
timeout -k 5 "$(cap 20)" nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
timeout -k 5 "$(cap 20)" nvcc --version | tail -2 || true
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
echo "ncu: ${NCU:-not found}; compute-sanitizer: ${SANITIZER:-not found}"
timeout -k 5 "$(cap 60)" "$PY" -m kvattn.env || true
on_gpu=$(timeout -k 5 "$(cap 60)" "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
step "versions: rc=0 (GPU: $on_gpu)"

BENCH=(--out-dir "$RUNS" --stream "$ROWS" --no-plots)
if [ "$PRESET" = cpu-tiny ]; then HEAD=(--preset cpu-tiny --max-points 2); else HEAD=(--preset headline); fi
TRITON=(--providers kvattn-triton-checked kvattn-triton-unchecked)
TRITON_DECODE=("${TRITON[@]}" kvattn-triton-verdict)
CUDA=(--providers kvattn-cuda-checked kvattn-cuda-unchecked)
CUDA_DECODE=("${CUDA[@]}" kvattn-cuda-verdict)

# 2. The headline, Triton only, while the CUDA module builds.
t=$(cap 170); run headline-triton-decode "$t" - "$PY" -m benchmarks.decode "${HEAD[@]}" "${BENCH[@]}" \
  "${TRITON_DECODE[@]}" --repeats 5 --time-budget-s $(( t - 10 ))
t=$(cap 75); run headline-triton-extend "$t" - "$PY" -m benchmarks.extend "${HEAD[@]}" "${BENCH[@]}" \
  "${TRITON[@]}" --repeats 5 --time-budget-s $(( t - 10 ))
if [ "$PRESET" = cpu-tiny ]; then
  DIGEST=(--layers 2 --pages 3 --page-size 4 --kv-heads 1 --head-dim 8 --repeats 1)
else
  DIGEST=(--pages 512 --repeats 5)
fi
digest_device=cpu; [ "$on_gpu" = 1 ] && digest_device=cuda
t=$(cap 40); run digest "$t" - "$PY" -m benchmarks.transfer_digest --keyed "$digest_device" \
  "${DIGEST[@]}" --out-dir "$RUNS" --stream "$ROWS"
# The Triton kernels (the CUDA module may still be building). The script's budget bounds its decode
# steps (two at least) from its first kernel on; the other 25 s are for the imports and, when they
# are slow, the compiles.
GRAPH=(--backend triton); [ "$PRESET" = cpu-tiny ] && GRAPH+=(--steps 2)
t=$(cap 45); run graph-replay "$t" - "$PY" -m benchmarks.graph_replay "${GRAPH[@]}" \
  --time-budget-s $(( t > 30 ? t - 25 : 5 )) --out-dir "$RUNS" --stream "$ROWS"

# 3. Tuning, Triton ops.
# tune_s QUARTERS: seconds of TUNE_S for a tuning step, at most what is left less 25 s to start up.
tune_s() { local t=$(( TUNE_S * $1 / 4 )) r=$(( $(left) - 30 - 25 * SCALE )); echo $(( t < r ? t : r )); }
t=$(tune_s 3)
if [ "$t" -gt 10 ]; then
  run tune-triton "$(cap $(( t / SCALE + 25 )))" - "$PY" -m benchmarks.tune --ops triton-decode triton-extend \
    --time-budget-s "$t" --out-dir "$RUNS" --stream "$ROWS"
else
  skip tune-triton "$t s left"
fi

# 4. The build, waited for (its own timeout bounds the wait).
if [ -n "$build_pid" ]; then
  step "cuda-build: waiting"
  wait "$build_pid"
  RC[cuda-build]=$?
  step "cuda-build: rc=${RC[cuda-build]}; $(tail -1 "$OUTDIR/build.log")"
  tail -12 "$OUTDIR/build.log"
  build_dir="$RUNS/${STAMP}_${SLUG}_${COMMIT}_build"
  mkdir -p "$build_dir"
  cp "$OUTDIR/build.log" "$build_dir/"
  for f in build/cuda/ptxas.log build/cuda/resources.json kvattn/_build.json; do
    [ -f "$f" ] && cp "$f" "$build_dir/"
  done
  pack
fi

# 5. CUDA: split tuning, then the headline rows (also when the build was skipped: a module built
# before runs, and without one the providers say why they skip).
if [ "${RC[cuda-build]}" = 0 ] || [ "${RC[cuda-build]}" = skipped ]; then
  t=$(tune_s 1)
  if [ "$t" -gt 5 ]; then
    run tune-cuda "$(cap $(( t / SCALE + 25 )))" - "$PY" -m benchmarks.tune --ops cuda-decode --time-budget-s "$t" \
      --out-dir "$RUNS" --stream "$ROWS"
  else
    skip tune-cuda "$t s left"
  fi
  t=$(cap 75); run headline-cuda-decode "$t" - "$PY" -m benchmarks.decode "${HEAD[@]}" "${BENCH[@]}" \
    "${CUDA_DECODE[@]}" --repeats 5 --time-budget-s $(( t - 10 ))
  t=$(cap 45); run headline-cuda-extend "$t" - "$PY" -m benchmarks.extend "${HEAD[@]}" "${BENCH[@]}" \
    "${CUDA[@]}" --repeats 5 --time-budget-s $(( t - 10 ))
else
  for s in tune-cuda headline-cuda-decode headline-cuda-extend; do skip "$s" "the CUDA build failed"; done
fi

# 6. FlexAttention: one process, the shapes in order, each started only if its compile can fit.
if [ "$PRESET" = cpu-tiny ]; then FLEX=(--preset cpu-tiny); else FLEX=(--preset headline); fi
t=$(cap 60); run flex "$t" - "$PY" -m benchmarks.flex "${FLEX[@]}" "${BENCH[@]}" --time-budget-s $(( t - 10 ))

# 7. The sweeps, in what is left after the smoke's time and 30 s for the tests; FlexAttention is not
# among their providers (it would compile for every shape, outside every budget).
SWEEP=(--preset "$PRESET" --skip-preset headline "${BENCH[@]}" --providers kvattn-triton-checked
       kvattn-triton-unchecked kvattn-cuda-checked kvattn-cuda-unchecked torch-sdpa-gather flashinfer
       kvattn-reference)
bench=$(( $(left) - 30 - SMOKE_S * SCALE - 30 * SCALE ))
extend_s=$(( bench * 2 / 5 )); [ "$extend_s" -gt $(( 100 * SCALE )) ] && extend_s=$(( 100 * SCALE ))
mla_s=$(( bench / 6 )); [ "$mla_s" -gt $(( 60 * SCALE )) ] && mla_s=$(( 60 * SCALE ))
decode_s=$(( bench - extend_s - mla_s ))
sweep() {  # NAME SECONDS LEAST ARGS...: the sweep when SECONDS is at least LEAST
  local name=$1 s=$2 least=$3
  shift 3
  if [ "$s" -ge "$least" ]; then
    run "sweep-$name" "$(cap $(( s / SCALE + 20 )))" - "$PY" -m "benchmarks.$name" "$@" --time-budget-s "$s"
  else
    skip "sweep-$name" "$s s for it"
  fi
}
sweep decode "$decode_s" 30 "${SWEEP[@]}"
sweep mla "$mla_s" 20 --preset "$PRESET" "${BENCH[@]}"
sweep extend "$extend_s" 20 "${SWEEP[@]}"

# 8. The CUDA smoke, under compute-sanitizer where it runs.
if [ "$on_gpu" = 1 ] && [ -n "$SANITIZER" ]; then
  run smoke "$(cap $SMOKE_S)" "$OUTDIR/smoke.log" "$SANITIZER" --tool memcheck --error-exitcode 3 "$PY" -m benchmarks.cuda_smoke \
    --backend cuda
  if grep -q "Device not supported\|Unable to\|error 999" "$OUTDIR/smoke.log"; then
    echo "compute-sanitizer cannot run on this machine (see smoke.log); the smoke without it:"
    run smoke "$(cap 60)" "$OUTDIR/smoke.log" "$PY" -m benchmarks.cuda_smoke --backend cuda
  fi
else
  backend=cuda; [ "$on_gpu" = 1 ] || backend=cuda_sim
  run smoke "$(cap $SMOKE_S)" "$OUTDIR/smoke.log" "$PY" -m benchmarks.cuda_smoke --backend "$backend"
fi
tail -15 "$OUTDIR/smoke.log"

# 9. The tests, with what is left (less 45 s for ncu when it can run).
if [ "${SUITE_SKIP_TESTS:-0}" = 1 ]; then
  skip tests "SUITE_SKIP_TESTS=1"
else
  keep=30; [ "$on_gpu" = 1 ] && [ -n "$NCU" ] && keep=75
  opts=(-m "not host_only" -p no:cacheprovider -q)
  "$PY" -c "import xdist" 2>/dev/null && opts+=(-n 8)
  "$PY" -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 60)
  run tests "$(cap 100000 "$keep")" "$OUTDIR/tests.log" "$PY" -m pytest tests "${opts[@]}"
  tail -25 "$OUTDIR/tests.log"
fi

# 10. Nsight Compute, when 40 s or more remain.
if [ "$on_gpu" != 1 ] || [ -z "$NCU" ]; then
  skip ncu "no GPU or no ncu"
elif [ "$(left)" -lt 40 ]; then
  skip ncu "$(left) s left"
else
  run ncu "$(cap 100000 5)" "$OUTDIR/ncu.txt" "$NCU" --clock-control none --profile-from-start off --nvtx \
    --section SpeedOfLight --section WarpStateStats "$PY" -m benchmarks.ncu_kernels
fi

pack
summary=""
for s in cuda-build headline-triton-decode headline-triton-extend digest graph-replay tune-triton \
         tune-cuda headline-cuda-decode headline-cuda-extend flex sweep-decode sweep-mla sweep-extend smoke \
         tests ncu; do
  summary+=" $s=${RC[$s]:-none}"
done
step "done:$summary"
ls -la "$OUTDIR"
failed=()
for s in cuda-build headline-triton-decode headline-triton-extend digest graph-replay tune-triton \
         tune-cuda headline-cuda-decode headline-cuda-extend flex sweep-decode sweep-mla sweep-extend smoke \
         tests; do
  rc=${RC[$s]:-skipped}
  [ "$rc" = 0 ] || [ "$rc" = skipped ] && continue
  # FlexAttention's step is bounded on purpose: its timeout stops a slow compile, not the suite.
  [ "$s" = flex ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && continue
  failed+=("$s (rc=$rc)")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "GPU SUITE FAILED: ${failed[*]}"
  exit 1
fi
echo "GPU suite passed"

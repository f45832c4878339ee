"""Extend (chunked prefill) benchmark, checked against unchecked:
``python -m benchmarks.extend [--quick | --full | --preset NAME]``.

A point is ``batch`` sequences with ``prefix`` cached tokens and ``chunk`` new query tokens each,
whose K/V are already in the pages (what :func:`kvattn.paged_extend` reads). The pool, rotation
sets, NaN poison, correctness check and timing are those of :mod:`benchmarks.decode`; every
provider is checked against ``kvattn.reference.paged_extend`` on a sample of query rows before it
is timed. Results go to ``<out-dir>/<date>_<device>_<commit>_extend/``: ``extend.csv``, ``run.json``,
``summary.md``, ``log.txt`` and PNG plots when matplotlib is importable;
``benchmarks/results/README.md`` says how each figure is obtained.
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from . import providers as prov_mod
from .common import (Device, ExtendPoint, TimingConfig, bandwidth_columns, bytes_moved,
                     check_provider, copy_bandwidth, extend_check_rows, extend_reference,
                     git_commit, make_extend_inputs, measure, prepare_providers, rotation_sets,
                     synchronize, versions)
from .decode import CPU_LABEL, RESULTS, estimate_point_seconds
from .outputs import write_extend_outputs

CHECK_SEQS = 2  # sequences (besides the last) whose sampled rows are compared with the reference
# Compute rate assumed by the wall-time estimate of a GPU point (a conservative figure for a
# 16-bit attention kernel on an H200, used only to size the sweep, never reported).
ESTIMATE_TFLOPS = 200.0


def _grid(batches, chunks, prefixes, pages=(16,), heads=((32, 8),), dims=(128,), dtypes=("bf16",)):
    return [ExtendPoint(b, c, pre, p, h, kv, d, t) for t, d, (h, kv), p, b, c, pre in
            itertools.product(dtypes, dims, heads, pages, batches, chunks, prefixes)]


def preset_points(name: str) -> list[ExtendPoint]:
    """The sweeps. ``gpu-suite`` is ordered by importance (a long-prefix chunk first), so a run
    stopped by its time budget keeps the points that matter most."""
    if name == "cpu-tiny":
        return [ExtendPoint(1, 16, 0, 16, 4, 2, 32, "fp16"), ExtendPoint(2, 24, 40, 16, 8, 2, 32, "fp16"),
                ExtendPoint(1, 8, 20, 1, 4, 4, 32, "bf16"), ExtendPoint(2, 40, 24, 64, 4, 2, 32, "fp16")]
    if name == "gpu-suite":
        return (_grid([8], [2048], [8192]) + _grid([8], [512], [32768]) + _grid([1], [4096], [0])
                + _grid([32], [128], [4096]) + _grid([8], [2048], [8192], dtypes=("fp16",))
                + _grid([8], [1024], [4096], pages=(1, 64))
                + _grid([8], [1024], [4096], heads=((32, 32),)))
    if name == "full":
        return _grid([1, 4, 32], [128, 512, 4096], [0, 4096, 32768], pages=(1, 16, 64),
                     heads=((32, 8), (32, 32)), dtypes=("fp16", "bf16"))
    raise ValueError(f"--preset: expected one of {PRESETS}, got {name!r}")


PRESETS = ("cpu-tiny", "gpu-suite", "full")


def call_seconds(p: ExtendPoint, copy_tbps: float = 4.0) -> float:
    """One call's time for the estimate: the larger of its bytes at the copy bandwidth and its
    FLOPs at ``ESTIMATE_TFLOPS``."""
    return max(bytes_moved(p.pool_point(), True, p.q_tokens)["total"] / (copy_tbps * 1e12),
               p.flops() / (ESTIMATE_TFLOPS * 1e12))


def extend_columns(p: ExtendPoint, checked: bool, median_ms: float, copy_tbps: float) -> dict:
    tflops = p.flops() / (median_ms * 1e-3) / 1e12
    return dict(flops=p.flops(), tflops=tflops,
                **bandwidth_columns(bytes_moved(p.pool_point(), checked, p.q_tokens), median_ms,
                                    copy_tbps))


def run_point(p: ExtendPoint, providers, device: Device, cfg: TimingConfig, copy_tbps: float,
              log) -> list[dict]:
    dev = device.torch_device
    pool = p.pool_point()
    sets = rotation_sets(pool, device.l2_bytes) if device.is_gpu else 2
    inp = make_extend_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    picks = extend_check_rows(p, CHECK_SEQS)
    rows_idx = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
    refs = {i: extend_reference(inp, i, picks) for i in sorted({0, sets - 1})}
    base = dict(asdict(p), context=p.context, rows_checked=len(picks), sets=sets,
                pool_bytes=inp.pool_bytes())
    rows, live = prepare_providers(
        providers, inp,
        lambda run, out_buf: check_provider(run, out_buf, refs, p.dtype, p.pages_per_seq, rows_idx),
        base, log)
    synchronize(dev)
    rows += measure(live, sets, device, cfg,
                    lambda prov, med: extend_columns(p, prov.checked, med, copy_tbps))
    del inp, live
    if device.is_gpu:
        torch.cuda.empty_cache()
    return rows


def run(args) -> Path:
    device = Device.current()
    preset = args.preset or ("full" if args.full else ("gpu-suite" if device.is_gpu else "cpu-tiny"))
    points = preset_points(preset)
    if args.max_points:
        points = points[:args.max_points]
    cfg = TimingConfig(repeats=args.repeats) if device.is_gpu else \
        TimingConfig(cpu_runs=1, repeats=2, graphs=False)
    providers = prov_mod.select(args.providers, op="extend")
    started = time.monotonic()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    commit = git_commit()
    run_dir = Path(args.out_dir) / f"{stamp}_{device.slug}_{commit}_extend"
    log_lines = []

    def log(msg: str) -> None:
        log_lines.append(msg)
        print(msg, flush=True)

    def estimate(p: ExtendPoint) -> float:
        return estimate_point_seconds(p.pool_point(), len(providers) - 1, cfg, device,
                                      call_s=call_seconds(p))

    label = "GPU measurement" if device.is_gpu else CPU_LABEL
    log(f"kvattn extend benchmark: preset {preset}, {len(points)} points, device {device.name} "
        f"({label}), commit {commit}")
    if device.is_gpu:
        log(f"estimated wall time of the extend sweep: {sum(map(estimate, points)):.0f} s "
            f"(budget {args.time_budget_s} s)")
    copy = copy_bandwidth(device, cfg)
    log(f"copy bandwidth: {copy['tbps']:.3f} TB/s ({copy['bytes'] / 1e9:.2f} GB in "
        f"{copy['median_ms']:.3f} ms)")

    rows, skipped = [], []
    for n, p in enumerate(points):
        elapsed = time.monotonic() - started
        need = estimate(p) if device.is_gpu else 0
        if args.time_budget_s and elapsed + need > args.time_budget_s:
            skipped.append({"point": p.label(), "reason": f"time budget ({elapsed:.0f} s used)"})
            continue
        pool = p.pool_point()
        if device.is_gpu and 2 * rotation_sets(pool, device.l2_bytes) * pool.kv_set_bytes() * 1.25 > \
                0.4 * device.memory_bytes:
            skipped.append({"point": p.label(), "reason": "pool over 40% of device memory"})
            continue
        t0 = time.monotonic()
        point_rows = run_point(p, providers, device, cfg, copy["tbps"], log)
        rows += point_rows
        log(f"[{n + 1}/{len(points)}] {p.label()}: {time.monotonic() - t0:.1f} s; "
            + ", ".join(f"{r['provider']}/{r['mode']} {r['median_ms'] * 1e3:.1f} us"
                        for r in point_rows if r.get("status") == "ok"))
    copy_end = copy_bandwidth(device, cfg)

    meta = dict(run=run_dir.name, op="extend", preset=preset, date_utc=stamp, commit=commit,
                device=asdict(device), gpu_measurement=device.is_gpu,
                label=label, versions=versions(), timing=cfg.as_dict(),
                copy_bandwidth_start=copy, copy_bandwidth_end=copy_end,
                providers=[p.name for p in providers], skipped=skipped,
                wall_s=time.monotonic() - started, command=" ".join(sys.argv))
    write_extend_outputs(run_dir, meta, rows, log_lines, plots=not args.no_plots)
    log(f"results: {run_dir} ({time.monotonic() - started:.0f} s)")
    return run_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.extend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the small sweep: cpu-tiny on a CPU, gpu-suite on a GPU (the default)")
    ap.add_argument("--full", action="store_true", help="the full sweep of the issue (GPU, hours)")
    ap.add_argument("--preset", choices=PRESETS, help="a named sweep (overrides --quick/--full)")
    ap.add_argument("--out-dir", default=str(RESULTS), help="parent of the run folder")
    ap.add_argument("--providers", nargs="*", help="only these providers")
    ap.add_argument("--max-points", type=int, default=0, help="only the first N points")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per measurement (GPU)")
    ap.add_argument("--time-budget-s", type=float, default=0,
                    help="start no point whose estimate would end past this many seconds")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

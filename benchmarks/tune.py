"""Tuning sweep of the launch configurations: ``python -m benchmarks.tune [--time-budget-s S]``.

What the configuration tables (``kvattn/backends/triton/configs.py``, the CUDA decode's split
target in ``kvattn/backends/cuda/launch.py``) should hold is a GPU measurement; this sweep brings
it back. For a few points of the decode and extend sweeps it times, checked and unchecked:

- Triton decode: ``block_n`` x ``num_warps`` x ``num_stages`` x split target (resident programs
  per SM the planner aims for; the split count is a run-time value, so it costs no recompile);
- CUDA decode: the split target (blocks per SM; the tile is a template);
- Triton extend: a few ``(block_m, block_n, num_warps, num_stages)`` tiles.

Each configuration is first compared with the float32 reference on the first rotation set (a
configuration that computes wrong results is reported, never ranked), then timed as the median
CUDA-graph replay over every rotation set (``triton.testing.do_bench``, short budgets). Rows go to
``<out-dir>/<date>_<device>_<commit>_tune/tune.csv`` as they are measured, and ``tune.md`` ranks
the configurations of each (point, kernel, variant) against the table's default. On a CPU the sweep
runs one tiny point through the interpreter, to show it works: NOT a GPU measurement.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import itertools
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

# benchmarks.common chooses the Triton interpreter on a machine without a GPU: before triton loads.
from .common import (MAX_ABS_ERR, Device, ExtendPoint, GraphTimer, Point, TimingConfig,
                     extend_check_rows, extend_reference, git_commit, make_decode_inputs,
                     make_extend_inputs, reference_output, rotation_sets, time_eager)
from .sweep import CPU_LABEL, RESULTS

import kvattn  # noqa: E402
from kvattn.backends.triton import configs as triton_configs  # noqa: E402

COLUMNS = ["op", "point", "backend", "variant", "config", "default", "status", "median_us", "max_abs_err"]
TIMING = TimingConfig(warmup_ms=5.0, rep_ms=15.0, repeats=1)


def decode_points(device: Device) -> list[Point]:
    if not device.is_gpu:
        return [Point(2, 96, 16, 4, 2, 32, "fp16")]
    return [Point(16, 8192, 16, 32, 8, 128, "bf16"), Point(1, 32768, 16, 32, 8, 128, "bf16"),
            Point(64, 4096, 16, 32, 8, 128, "bf16")]


def extend_points(device: Device) -> list[ExtendPoint]:
    if not device.is_gpu:
        return [ExtendPoint(1, 32, 16, 16, 4, 2, 32, "fp16")]
    return [ExtendPoint(8, 2048, 8192, 16, 32, 8, 128, "bf16")]


def triton_decode_grid(device: Device) -> list[dict]:
    if not device.is_gpu:
        return [dict(block_n=16, num_warps=4, num_stages=3, programs_per_sm=8)]
    return [dict(block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps)
            for bn, w, st, pps in itertools.product((16, 32), (2, 4), (3, 4, 5), (4, 8, 16))]


def triton_extend_grid(device: Device) -> list[dict]:
    if not device.is_gpu:
        return [dict(block_m=16, block_n=16, num_warps=4, num_stages=2)]
    return [dict(block_m=m, block_n=n, num_warps=w, num_stages=st) for m, n, w, st in
            ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 128, 4, 3))]


CUDA_BLOCKS_PER_SM = (1, 2, 4, 8)


def timed(fn_of_set, sets: int, device: Device) -> float:
    """Median microseconds per call: CUDA-graph replay over every set on a GPU, the host clock on
    the CPU."""
    if device.is_gpu:
        return 1e3 * GraphTimer(fn_of_set, sets, device.torch_device).time(TIMING)
    return 1e3 * time_eager(lambda: fn_of_set(0), device.torch_device, TimingConfig(cpu_runs=1))


class Writer:
    """tune.csv, appended row by row (a run cut short keeps every measured configuration)."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "tune.csv"
        self.rows: list[dict] = []
        with open(self.path, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(row)
        print(f"  {row['op']} {row['point']} {row['backend']}-{row['variant']} {row['config']}: "
              f"{row['status']} {row.get('median_us', '')}", flush=True)


def tune_decode(p: Point, device: Device, out: Writer, deadline: float) -> None:
    dev = device.torch_device
    sets = rotation_sets(p, device.l2_bytes) if device.is_gpu else 1
    inp = make_decode_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    ref = reference_output(inp, 0, min(p.batch, 4))
    args = [kvattn.layout.validate_decode(*inp.args(i), scale=inp.scale, validate=False) for i in range(sets)]
    default = triton_configs.decode_config(dev, args[0].q.dtype, p.head_dim, p.page_size)
    from kvattn.backends import triton as triton_backend
    candidates = [("triton", c, triton_configs.DecodeConfig(**c)) for c in triton_decode_grid(device)]
    if device.is_gpu and kvattn.backends.explain(args[0])["cuda"] is None:
        candidates += [("cuda", dict(blocks_per_sm=n), n) for n in CUDA_BLOCKS_PER_SM]
    for backend, label, config in candidates:
        for check in (True, False):
            if time.monotonic() > deadline:
                return
            out_buf = torch.empty_like(inp.q)
            if backend == "triton":
                def call(i, config=config, check=check):
                    return triton_backend.decode(args[i], check=check, out=out_buf, lse=None, config=config)
                is_default = config == default
            else:
                from kvattn.backends import cuda
                splits, _, _ = cuda.launch.plan_splits(args[0], blocks_per_sm=config)

                def call(i, splits=splits, check=check):
                    return cuda.decode(args[i], check=check, out=out_buf, lse=None, num_splits=splits)
                is_default = config == cuda.launch.decode_blocks_per_sm(p.head_dim)
            out.add(_measure("decode", p.label(), backend, check, label, is_default, call, out_buf, ref,
                             slice(0, ref.shape[0]), p.dtype, sets, device))


def tune_extend(p: ExtendPoint, device: Device, out: Writer, deadline: float) -> None:
    dev = device.torch_device
    sets = rotation_sets(p.pool_point(), device.l2_bytes) if device.is_gpu else 1
    inp = make_extend_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    picks = extend_check_rows(p, 2)
    ref = extend_reference(inp, 0, picks)
    rows = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
    args = [kvattn.layout.validate_extend(*inp.args(i), scale=inp.scale, validate=False) for i in range(sets)]
    default = triton_configs.extend_config(dev, args[0].q.dtype, p.head_dim, p.page_size)
    from kvattn.backends import triton as triton_backend
    for label in triton_extend_grid(device):
        config = triton_configs.ExtendConfig(**label)
        for check in (True, False):
            if time.monotonic() > deadline:
                return
            out_buf = torch.empty_like(inp.q)

            def call(i, config=config, check=check):
                return triton_backend.extend(args[i], check=check, out=out_buf, lse=None, config=config)
            out.add(_measure("extend", p.label(), "triton", check, label, config == default, call, out_buf,
                             ref, rows, p.dtype, sets, device))


def _measure(op, point, backend, check, label, is_default, call, out_buf, ref, rows, dtype, sets,
             device) -> dict:
    row = dict(op=op, point=point, backend=backend, variant="checked" if check else "unchecked",
               config=" ".join(f"{k}={v}" for k, v in label.items()), default=is_default)
    try:
        out_buf.fill_(float("nan"))
        call(0)
        err = float((out_buf[rows].float() - ref).abs().max())
        if not err <= MAX_ABS_ERR[dtype]:
            return dict(row, status=f"failed: max |out - ref| = {err:.3g}", max_abs_err=err)
        return dict(row, status="ok", max_abs_err=err, median_us=round(timed(call, sets, device), 2))
    except Exception as e:  # a configuration that cannot compile or launch is reported
        return dict(row, status=f"failed: {type(e).__name__}: {e}"[:200])


def summary(rows: list[dict], header: list[str]) -> str:
    lines = header + ["", "| op | point | kernel | variant | best config | best us | default us | "
                      "default / best |", "|---|---|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["point"], r["backend"], r["variant"]), []).append(r)
    for key, group in groups.items():
        ok = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["median_us"])
        if not ok:
            lines.append(f"| {' | '.join(key)} | none ran | | | |")
            continue
        default = next((r for r in ok if r["default"]), None)
        d_us = f"{default['median_us']:.2f}" if default else "not in the grid"
        ratio = f"{default['median_us'] / ok[0]['median_us']:.3f}" if default else ""
        lines.append(f"| {' | '.join(key)} | {ok[0]['config']} | {ok[0]['median_us']:.2f} | {d_us} | {ratio} |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", f"{len(failed)} configuration(s) did not run or were wrong:"]
        lines += [f"- {r['op']} {r['point']} {r['backend']}-{r['variant']} {r['config']}: {r['status']}"
                  for r in failed]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-budget-s", type=float, default=120.0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    device = Device.current()
    started = time.monotonic()
    deadline = started + args.time_budget_s
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out_dir) / f"{stamp}_{device.slug}_{git_commit()}_tune"
    out = Writer(run_dir)
    label = "GPU measurement" if device.is_gpu else CPU_LABEL
    print(f"tuning sweep on {device.name} ({label}), budget {args.time_budget_s:.0f} s", flush=True)
    for p in decode_points(device):
        tune_decode(p, device, out, deadline)
    for p in extend_points(device):
        tune_extend(p, device, out, deadline)
    header = [f"# Tuning sweep: {device.name}, commit {git_commit()}, {stamp} UTC", "",
              f"**{label}.** Median CUDA-graph replay per call (microseconds), one measurement per "
              f"configuration (do_bench {TIMING.warmup_ms:g} / {TIMING.rep_ms:g} ms); "
              f"{time.monotonic() - started:.0f} s. Defaults: the tables in "
              f"kvattn/backends/triton/configs.py and kvattn/backends/cuda/launch.py.",
              "", f"Device: {asdict(device)}"]
    (run_dir / "tune.md").write_text(summary(out.rows, header))
    print(f"results: {run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tuning sweep of the launch configurations: ``python -m benchmarks.tune [--ops OP ...]
[--time-budget-s S]``.

What the configuration tables (``kvattn/backends/triton/configs.py``, the CUDA decode's split
target in ``kvattn/backends/cuda/launch.py``) and the split planner (``kvattn/backends/grids.py``)
should give is a GPU measurement; this sweep brings it back. Three ops, checked and unchecked, at
a few headline points each:

- ``triton-decode``: the table's configuration at the planner's split count first, then other
  split counts (a run-time value, no recompile): the one that fills the resident slots in one
  wave, one more than that, half and twice the planner's; then the configuration's neighbours
  (``block_n``, ``num_warps``, ``num_stages`` one step each way), each at the planner's count;
- ``triton-extend``: the table's tile first, then its neighbours (``block_m``, ``block_n``,
  ``num_warps``, ``num_stages``);
- ``cuda-decode``: the planner's split count first, then the same other split counts (the tile is
  a template).

The planner's own answer is the default whatever the planner is, and the slots are the
configuration's resident programs per SM times the SMs. Time is shared out so that no point
starves the rest: the budget left goes to each op by weight (``OP_WEIGHTS``) when it starts, and an
op's time to its points equally, what a point leaves passing on; a point's default configuration
is measured even when its share is spent (while the budget lasts).

Each configuration is first compared with the float32 reference on the first rotation set (a
configuration that computes wrong results is reported, never ranked), then timed as the median
CUDA-graph replay over every rotation set (``triton.testing.do_bench``, short budgets). Rows go to
``<out-dir>/<date>_<device>_<commit>_tune/tune.csv`` (suffixed with the ops when not all run) as
they are measured, and to ``--stream`` as JSON lines; ``tune.md`` ranks the configurations of each
(point, kernel, variant) against the default. On a CPU the sweep runs one tiny point per op through
the interpreter with a few candidates, to show it works: NOT a GPU measurement.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import sys
import time
import zlib
from dataclasses import asdict, replace
from pathlib import Path

import torch

import kvattn  # noqa: E402
from kvattn.backends import grids  # noqa: E402
from kvattn.backends.triton import configs as triton_configs  # noqa: E402

# benchmarks.common chooses the Triton interpreter on a machine without a GPU: before triton loads.
from .common import (
    MAX_ABS_ERR,
    Device,
    ExtendPoint,
    GraphTimer,
    Point,
    TimingConfig,
    extend_check_rows,
    extend_reference,
    git_commit,
    make_decode_inputs,
    make_extend_inputs,
    reference_output,
    rotation_sets,
    time_eager,
)
from .sweep import CPU_LABEL, RESULTS, append_rows

OPS = ("triton-decode", "triton-extend", "cuda-decode")
# Shares of the budget: the Triton decode has the most configurations (and compiles), the CUDA
# decode only split counts.
OP_WEIGHTS = {"triton-decode": 2.0, "triton-extend": 1.0, "cuda-decode": 1.0}
COLUMNS = [
    "op",
    "point",
    "backend",
    "variant",
    "config",
    "rule",
    "splits",
    "waves",
    "default",
    "status",
    "median_us",
    "max_abs_err",
]
TIMING = TimingConfig(warmup_ms=5.0, rep_ms=15.0, repeats=1)


def decode_points(device: Device) -> list[Point]:
    if not device.is_gpu:
        return [Point(2, 96, 16, 4, 2, 32, "fp16")]
    return [
        Point(16, 8192, 16, 32, 8, 128, "bf16"),
        Point(64, 8192, 16, 32, 8, 128, "bf16"),
        Point(1, 32768, 16, 32, 8, 128, "bf16"),
    ]


def extend_points(device: Device) -> list[ExtendPoint]:
    if not device.is_gpu:
        return [ExtendPoint(1, 32, 16, 16, 4, 2, 32, "fp16")]
    return [
        ExtendPoint(1, 512, 8192, 16, 32, 8, 128, "bf16"),
        ExtendPoint(1, 4096, 0, 16, 32, 8, 128, "bf16"),
    ]


class Shares:
    """Deadlines per (op, point) out of one budget: :meth:`start_op` gives the op its weight's
    share of what is left among the ops not started yet, :meth:`point_deadline` the next point an
    equal share of what is left of its op."""

    def __init__(
        self,
        budget_s: float,
        ops: list[str],
        weights: dict[str, float] = OP_WEIGHTS,
        clock=time.monotonic,
    ):
        self.clock = clock
        self.end = clock() + budget_s
        self.waiting = list(ops)
        self.weights = weights
        self.op_end = self.end
        self.points_left = 0

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def start_op(self, op: str, points: int) -> float:
        """The op's deadline (monotonic seconds)."""
        total = sum(self.weights[o] for o in self.waiting)
        self.waiting.remove(op)
        self.op_end = self.clock() + self.left() * self.weights[op] / total
        self.points_left = points
        return self.op_end

    def point_deadline(self) -> float:
        now = self.clock()
        deadline = now + max(0.0, self.op_end - now) / max(1, self.points_left)
        self.points_left -= 1
        return deadline


def split_candidates(
    planner: int, units: int, slots: int | None, cap: int
) -> list[tuple[str, int]]:
    """``[(rule, num_splits)]``, the planner's first: the count that fills ``slots`` resident
    programs in one wave (``units`` = batch x KV heads programs per split), one more (the first
    count past one wave), half and twice the planner's; each within ``[1, cap]``, no count twice.
    Without ``slots`` (the CPU) only the planner's and twice it."""
    wanted = [("planner", planner)]
    if slots is not None:
        fill = max(1, slots // units)
        wanted += [("fills the slots", fill), ("one past a wave", fill + 1), ("half", planner // 2)]
    wanted.append(("double", 2 * planner))
    out, seen = [], set()
    for rule, n in wanted:
        n = min(max(1, n), cap)
        if n not in seen:
            seen.add(n)
            out.append((rule, n))
    return out


def decode_neighbours(
    default: triton_configs.DecodeConfig, gpu: bool
) -> list[triton_configs.DecodeConfig]:
    """The table's decode configuration one step away in each of ``block_n`` (16 <-> 32),
    ``num_warps`` (halved, doubled; 2 to 8) and ``num_stages`` (one fewer, one more; at least 2).
    One of them on the CPU."""
    out = [replace(default, block_n=32 if default.block_n == 16 else 16)]
    out += [
        replace(default, num_warps=w)
        for w in (default.num_warps // 2, default.num_warps * 2)
        if 2 <= w <= 8
    ]
    out += [
        replace(default, num_stages=s)
        for s in (default.num_stages - 1, default.num_stages + 1)
        if s >= 2
    ]
    return out if gpu else out[-1:]


def triton_decode_candidates(
    default: triton_configs.DecodeConfig,
    planner: int,
    units: int,
    slots: int | None,
    cap: int,
    gpu: bool,
) -> list[tuple]:
    """``[(rule, config, num_splits)]`` in the order timed: the table's configuration at the
    planner's count (the default), at the other split counts (:func:`split_candidates`), then its
    neighbours (:func:`decode_neighbours`; ``num_splits`` None: the planner's count for each)."""
    out = [(rule, default, n) for rule, n in split_candidates(planner, units, slots, cap)]
    return out + [("neighbour", c, None) for c in decode_neighbours(default, gpu)]


def extend_neighbours(
    default: triton_configs.ExtendConfig, gpu: bool
) -> list[triton_configs.ExtendConfig]:
    """The table's extend tile one step away in each of ``block_m`` (64 <-> 128), ``block_n``
    (halved, doubled; 16 to 128), ``num_warps`` (4 <-> 8) and ``num_stages`` (one more, one fewer
    down to 1). One of them on the CPU."""
    out = [replace(default, block_m=64 if default.block_m == 128 else 128)]
    out += [
        replace(default, block_n=n)
        for n in (default.block_n // 2, default.block_n * 2)
        if 16 <= n <= 128
    ]
    out += [replace(default, num_warps=8 if default.num_warps == 4 else 4)]
    out += [
        replace(default, num_stages=s)
        for s in (default.num_stages + 1, default.num_stages - 1)
        if s >= 1
    ]
    return out if gpu else out[-1:]


def _label(config) -> str:
    return " ".join(f"{k}={v}" for k, v in asdict(config).items())


def timed(fn_of_set, sets: int, device: Device) -> float:
    """Median microseconds per call: CUDA-graph replay over every set on a GPU, the host clock on
    the CPU."""
    if device.is_gpu:
        return 1e3 * GraphTimer(fn_of_set, sets, device.torch_device).time(TIMING)
    return 1e3 * time_eager(lambda: fn_of_set(0), device.torch_device, TimingConfig(cpu_runs=1))


class Writer:
    """tune.csv, appended row by row (a run cut short keeps every measured configuration), and
    the stream, when there is one, as JSON lines naming the run."""

    def __init__(self, run_dir: Path, stream: Path | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = run_dir.name
        self.path = run_dir / "tune.csv"
        self.stream = stream
        self.rows: list[dict] = []
        self.notes: list[str] = []
        with open(self.path, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(row)
        if self.stream is not None:
            append_rows(self.stream, [{"run": self.run, **row}])
        splits = f" splits={row['splits']} ({row['rule']})" if row.get("splits") else ""
        print(
            f"  {row['op']} {row['point']} {row['backend']}-{row['variant']} {row['config']}{splits}: "
            f"{row['status']} {row.get('median_us', '')}",
            flush=True,
        )

    def note(self, line: str) -> None:
        self.notes.append(line)
        print(line, flush=True)


def _pairs(
    candidates, measure_pair, deadline: float, hard_end: float, out: Writer, what: str
) -> None:
    """``measure_pair(candidate)`` for each candidate, the first (the default) while the budget
    lasts, the others while the point's share lasts."""
    for n, candidate in enumerate(candidates):
        now = time.monotonic()
        if now > hard_end or (n > 0 and now > deadline):
            out.note(
                f"{what}: {len(candidates) - n} of {len(candidates)} candidates not timed "
                f"(the {'budget' if now > hard_end else 'share of this point'} is spent)"
            )
            return
        measure_pair(candidate)


def tune_triton_decode(
    p: Point, device: Device, out: Writer, deadline: float, hard_end: float
) -> None:
    from kvattn.backends import triton as triton_backend
    from kvattn.backends.triton import paged_decode

    dev = device.torch_device
    sets = rotation_sets(p, device.l2_bytes) if device.is_gpu else 1
    inp = make_decode_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    ref = reference_output(inp, 0, min(p.batch, 4))
    args = [
        kvattn.layout.validate_decode(*inp.args(i), scale=inp.scale, validate=False)
        for i in range(sets)
    ]
    default = triton_configs.decode_config(dev, args[0].q.dtype, p.head_dim, p.page_size)
    planner, min_chunk, _ = paged_decode.plan_splits(args[0], default)
    units = p.batch * p.num_kv_heads
    sms = grids.device_sms(dev)
    slots = (
        default.programs_per_sm * sms if sms and getattr(default, "programs_per_sm", None) else None
    )
    cap = max(1, -(-args[0].max_pages * p.page_size // min_chunk))
    out.note(
        f"triton-decode {p.label()}: default {_label(default)}, planner {planner} splits "
        f"({units * planner} programs"
        + (f" for {slots} slots, {units * planner / slots:.2f} waves)" if slots else ")")
    )
    candidates = triton_decode_candidates(default, planner, units, slots, cap, device.is_gpu)

    def pair(candidate):
        rule, config, splits = candidate
        if splits is None:
            splits = paged_decode.plan_splits(args[0], config)[0]
        for check in (True, False):
            out_buf = inp.new_out()

            def call(i, config=config, check=check, splits=splits):
                return triton_backend.decode(
                    args[i], check=check, out=out_buf, lse=None, config=config, num_splits=splits
                )

            is_default = config == default and splits == planner
            out.add(
                _measure(
                    "triton-decode",
                    p.label(),
                    "triton",
                    check,
                    _label(config),
                    rule,
                    splits,
                    units * splits / slots if slots else None,
                    is_default,
                    call,
                    out_buf,
                    ref,
                    slice(0, ref.shape[0]),
                    p.dtype,
                    sets,
                    device,
                )
            )

    _pairs(candidates, pair, deadline, hard_end, out, f"triton-decode {p.label()}")


def tune_cuda_decode(
    p: Point, device: Device, out: Writer, deadline: float, hard_end: float
) -> None:
    from kvattn.backends import cuda

    dev = device.torch_device
    sets = rotation_sets(p, device.l2_bytes) if device.is_gpu else 1
    inp = make_decode_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    args = [
        kvattn.layout.validate_decode(*inp.args(i), scale=inp.scale, validate=False)
        for i in range(sets)
    ]
    why = kvattn.backends.explain(args[0])["cuda"]
    if why is not None:
        out.note(f"cuda-decode {p.label()}: not run ({why})")
        out.add(
            dict(
                op="cuda-decode",
                point=p.label(),
                backend="cuda",
                variant="",
                config="",
                rule="",
                default=True,
                status=f"skipped: {why}"[:200],
            )
        )
        return
    ref = reference_output(inp, 0, min(p.batch, 4))
    planner, min_chunk, _ = cuda.launch.plan_splits(args[0])
    per_split = getattr(
        cuda.launch, "decode_blocks_per_split", None
    )  # where the planner counts them
    units = per_split(args[0]) if per_split else p.batch * p.num_kv_heads
    sms = grids.device_sms(dev)
    per_sm = getattr(cuda.launch, "decode_blocks_per_sm", None)  # the planner's occupancy target
    slots = per_sm(p.head_dim) * sms if sms and per_sm else None
    cap = max(1, -(-args[0].max_pages * p.page_size // min_chunk))
    out.note(
        f"cuda-decode {p.label()}: planner {planner} splits ({units * planner} blocks"
        + (f" for {slots} slots, {units * planner / slots:.2f} waves)" if slots else ")")
    )

    def pair(candidate):
        rule, splits = candidate
        for check in (True, False):
            out_buf = inp.new_out()

            def call(i, check=check, splits=splits):
                return cuda.decode(args[i], check=check, out=out_buf, lse=None, num_splits=splits)

            out.add(
                _measure(
                    "cuda-decode",
                    p.label(),
                    "cuda",
                    check,
                    f"num_splits={splits}",
                    rule,
                    splits,
                    units * splits / slots if slots else None,
                    splits == planner,
                    call,
                    out_buf,
                    ref,
                    slice(0, ref.shape[0]),
                    p.dtype,
                    sets,
                    device,
                )
            )

    _pairs(
        split_candidates(planner, units, slots, cap),
        pair,
        deadline,
        hard_end,
        out,
        f"cuda-decode {p.label()}",
    )


def tune_triton_extend(
    p: ExtendPoint, device: Device, out: Writer, deadline: float, hard_end: float
) -> None:
    from kvattn.backends import triton as triton_backend

    dev = device.torch_device
    sets = rotation_sets(p.pool_point(), device.l2_bytes) if device.is_gpu else 1
    inp = make_extend_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    picks = extend_check_rows(p, 2)
    ref = extend_reference(inp, 0, picks)
    rows = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
    args = [
        kvattn.layout.validate_extend(*inp.args(i), scale=inp.scale, validate=False)
        for i in range(sets)
    ]
    default = triton_configs.extend_config(dev, args[0].q.dtype, p.head_dim, p.page_size)
    out.note(f"triton-extend {p.label()}: default {_label(default)}")
    candidates = [("default", default)] + [
        ("neighbour", c) for c in extend_neighbours(default, device.is_gpu)
    ]

    def pair(candidate):
        rule, config = candidate
        for check in (True, False):
            out_buf = inp.new_out()

            def call(i, config=config, check=check):
                return triton_backend.extend(
                    args[i], check=check, out=out_buf, lse=None, config=config
                )

            out.add(
                _measure(
                    "triton-extend",
                    p.label(),
                    "triton",
                    check,
                    _label(config),
                    rule,
                    None,
                    None,
                    config == default,
                    call,
                    out_buf,
                    ref,
                    rows,
                    p.dtype,
                    sets,
                    device,
                )
            )

    _pairs(candidates, pair, deadline, hard_end, out, f"triton-extend {p.label()}")


def _measure(
    op,
    point,
    backend,
    check,
    label,
    rule,
    splits,
    waves,
    is_default,
    call,
    out_buf,
    ref,
    rows,
    dtype,
    sets,
    device,
) -> dict:
    row = dict(
        op=op,
        point=point,
        backend=backend,
        variant="checked" if check else "unchecked",
        config=label,
        rule=rule,
        splits=splits,
        waves=None if waves is None else round(waves, 3),
        default=is_default,
    )
    try:
        out_buf.fill_(float("nan"))
        call(0)
        err = float((out_buf[rows].float() - ref).abs().max())
        if not err <= MAX_ABS_ERR[dtype]:
            return dict(row, status=f"failed: max |out - ref| = {err:.3g}", max_abs_err=err)
        return dict(
            row, status="ok", max_abs_err=err, median_us=round(timed(call, sets, device), 2)
        )
    except Exception as e:  # a configuration that cannot compile or launch is reported
        return dict(row, status=f"failed: {type(e).__name__}: {e}"[:200])


def summary(rows: list[dict], header: list[str], notes: list[str]) -> str:
    lines = header + [
        "",
        "| op | point | kernel | variant | best config | best rule | best us | "
        "default us | default / best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in rows:
        if r.get("variant"):
            groups.setdefault((r["op"], r["point"], r["backend"], r["variant"]), []).append(r)
    for key, group in groups.items():
        ok = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["median_us"])
        if not ok:
            lines.append(f"| {' | '.join(key)} | none ran | | | | |")
            continue
        best = ok[0]
        default = next((r for r in ok if r["default"]), None)
        d_us = f"{default['median_us']:.2f}" if default else "not timed"
        ratio = f"{default['median_us'] / best['median_us']:.3f}" if default else ""
        config = best["config"] + (f" splits={best['splits']}" if best.get("splits") else "")
        lines.append(
            f"| {' | '.join(key)} | {config} | {best['rule']} | {best['median_us']:.2f} | "
            f"{d_us} | {ratio} |"
        )
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", f"{len(failed)} configuration(s) did not run or were wrong:"]
        lines += [
            f"- {r['op']} {r['point']} {r['backend']}-{r['variant']} {r['config']}: {r['status']}"
            for r in failed
        ]
    return "\n".join(lines) + "\n"


TUNERS = {
    "triton-decode": (tune_triton_decode, decode_points),
    "triton-extend": (tune_triton_extend, extend_points),
    "cuda-decode": (tune_cuda_decode, decode_points),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="in this order")
    ap.add_argument("--time-budget-s", type=float, default=120.0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument(
        "--stream", metavar="FILE", help="also append each row, as a JSON line, to FILE"
    )
    args = ap.parse_args(argv)
    ops = list(dict.fromkeys(args.ops))
    device = Device.current()
    started = time.monotonic()
    shares = Shares(args.time_budget_s, ops)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    suffix = "_tune" if set(ops) == set(OPS) else "_tune-" + "-".join(ops)
    run_dir = Path(args.out_dir) / f"{stamp}_{device.slug}_{git_commit()}{suffix}"
    out = Writer(run_dir, Path(args.stream) if args.stream else None)
    label = "GPU measurement" if device.is_gpu else CPU_LABEL
    print(
        f"tuning sweep of {', '.join(ops)} on {device.name} ({label}), budget {args.time_budget_s:.0f} s",
        flush=True,
    )
    for op in ops:
        tune, points_of = TUNERS[op]
        points = points_of(device)
        op_end = shares.start_op(op, len(points))
        out.note(f"{op}: {op_end - time.monotonic():.0f} s for {len(points)} point(s)")
        for p in points:
            deadline = shares.point_deadline()
            try:
                tune(p, device, out, deadline, shares.end)
            except Exception as e:  # inputs that do not fit, a planner that changed: the next point
                out.note(f"{op} {p.label()}: stopped by {type(e).__name__}: {e}"[:300])
            if device.is_gpu:
                torch.cuda.empty_cache()
    header = [
        f"# Tuning sweep: {device.name}, commit {git_commit()}, {stamp} UTC",
        "",
        f"**{label}.** Median per call (microseconds; CUDA-graph replay on a GPU), one "
        f"measurement per configuration (do_bench {TIMING.warmup_ms:g} / {TIMING.rep_ms:g} ms); "
        f"{time.monotonic() - started:.0f} s. Defaults: the tables in "
        f"kvattn/backends/triton/configs.py and kvattn/backends/cuda/launch.py at the split count "
        f"of the planner (kvattn/backends/grids.py).",
        "",
        f"Device: {asdict(device)}",
    ]
    (run_dir / "tune.md").write_text(summary(out.rows, header, out.notes))
    print(f"results: {run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

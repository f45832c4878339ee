"""What the decode and extend command lines share: their options, the run folder and log, the loop
over a preset's points under the time budget and the memory limit, and the run's metadata."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import providers as prov_mod
from .common import Device, TimingConfig, copy_bandwidth, git_commit, rotation_sets, versions

RESULTS = Path(__file__).resolve().parent / "results"
CPU_LABEL = "NOT a GPU measurement (CPU; Triton kernels run under the interpreter)"
PRESETS = ("cpu-tiny", "gpu-suite", "full")
# The decode and extend benchmarks also have the headline points alone (what the GPU suite times
# first, while the CUDA module builds).
HEADLINE_PRESETS = PRESETS + ("headline",)


def parse_args(prog: str, doc: str, argv=None, presets=PRESETS) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the small sweep: cpu-tiny on a CPU, gpu-suite on a GPU (the default)",
    )
    ap.add_argument("--full", action="store_true", help="the full sweep (GPU, hours)")
    ap.add_argument("--preset", choices=presets, help="a named sweep (overrides --quick/--full)")
    ap.add_argument(
        "--skip-preset",
        choices=presets,
        help="leave out the points of this preset (measured by an earlier command)",
    )
    ap.add_argument("--out-dir", default=str(RESULTS), help="parent of the run folder")
    ap.add_argument("--providers", nargs="*", help="only these providers")
    ap.add_argument("--max-points", type=int, default=0, help="only the first N points")
    ap.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats per measurement (GPU)"
    )
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=0,
        help="start no point whose estimate would end past this many seconds",
    )
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--stream",
        metavar="FILE",
        help="also append each point's rows, as JSON lines naming the run, to FILE",
    )
    return ap.parse_args(argv)


@dataclass
class Sweep:
    """One run of a benchmark command: its settings, run folder and log (kept for ``log.txt``)."""

    device: Device
    preset: str
    points: list
    cfg: TimingConfig
    providers: list
    budget_s: float
    run_dir: Path
    stamp: str
    commit: str
    started: float  # time.monotonic() at the start
    log_lines: list[str] = field(default_factory=list)
    stream: Path | None = None  # a file shared with other commands, rows appended as measured
    op: str = ""  # the providers' op: each row names it, unless the row names its own

    @classmethod
    def start(cls, args, preset_points, op: str, folder_suffix: str = "") -> Sweep:
        """``preset_points(name)``: the points of a preset; ``op``: the providers' op."""
        device = Device.current()
        preset = args.preset or (
            "full" if args.full else ("gpu-suite" if device.is_gpu else "cpu-tiny")
        )
        points = preset_points(preset)
        if args.skip_preset:
            done = {p.label() for p in preset_points(args.skip_preset)}
            points = [p for p in points if p.label() not in done]
        if args.max_points:
            points = points[: args.max_points]
        cfg = (
            TimingConfig(repeats=args.repeats)
            if device.is_gpu
            else TimingConfig(cpu_runs=1, repeats=2, graphs=False)
        )
        providers = prov_mod.select(args.providers, op=op)
        started = time.monotonic()
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        commit = git_commit()
        # The headline points have folders of their own (the suite times them before the sweeps).
        suffix = folder_suffix + ("_headline" if preset == "headline" else "")
        run_dir = Path(args.out_dir) / f"{stamp}_{device.slug}_{commit}{suffix}"
        return cls(
            device,
            preset,
            points,
            cfg,
            providers,
            args.time_budget_s,
            run_dir,
            stamp,
            commit,
            started,
            stream=Path(args.stream) if args.stream else None,
            op=op,
        )

    @property
    def label(self) -> str:
        return "GPU measurement" if self.device.is_gpu else CPU_LABEL

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, msg: str) -> None:
        self.log_lines.append(msg)
        print(msg, flush=True)

    def begin(self, title: str, op: str, estimate) -> dict:
        """Logs what runs (with the sweep's estimated wall time on a GPU) and measures the copy
        bandwidth at the start, which it returns."""
        self.log(
            f"{title}: preset {self.preset}, {len(self.points)} points, device "
            f"{self.device.name} ({self.label}), commit {self.commit}"
        )
        if self.device.is_gpu:
            self.log(
                f"estimated wall time of the {op} sweep: {sum(map(estimate, self.points)):.0f} s "
                f"(budget {self.budget_s} s)"
            )
        copy = copy_bandwidth(self.device, self.cfg)
        self.log(
            f"copy bandwidth: {copy['tbps']:.3f} TB/s ({copy['bytes'] / 1e9:.2f} GB in "
            f"{copy['median_ms']:.3f} ms)"
        )
        return copy

    def run_points(
        self, run_point, estimate, pool_point=lambda p: p
    ) -> tuple[list[dict], list[dict]]:
        """``run_point(p)`` for every point that fits the time budget (by ``estimate(p)`` seconds on
        a GPU) and whose pool (of the decode point ``pool_point(p)``) fits in 40% of the device
        memory. Returns the rows and the points skipped, with why."""
        rows, skipped = [], []
        for n, p in enumerate(self.points):
            elapsed = self.elapsed()
            need = estimate(p) if self.device.is_gpu else 0
            if self.budget_s and elapsed + need > self.budget_s:
                skipped.append(
                    {"point": p.label(), "reason": f"time budget ({elapsed:.0f} s used)"}
                )
                continue
            pool = pool_point(p)
            if (
                self.device.is_gpu
                and 2 * rotation_sets(pool, self.device.l2_bytes) * pool.kv_set_bytes() * 1.25
                > 0.4 * self.device.memory_bytes
            ):
                skipped.append({"point": p.label(), "reason": "pool over 40% of device memory"})
                continue
            t0 = time.monotonic()
            point_rows = run_point(p)
            self.checkpoint(point_rows)
            if self.device.is_gpu:
                # The point's pool is garbage now; hand it back so the next point's free-memory
                # checks (SDPA's gather) see the device as it is.
                torch.cuda.empty_cache()
            rows += point_rows
            self.log(
                f"[{n + 1}/{len(self.points)}] {p.label()}: {time.monotonic() - t0:.1f} s; "
                + ", ".join(
                    f"{r['provider']}/{r['mode']} {r['median_ms'] * 1e3:.1f} us"
                    for r in point_rows
                    if r.get("status") == "ok"
                )
            )
        return rows, skipped

    @property
    def deadline(self) -> float | None:
        """Monotonic time the sweep's budget ends (None without a budget)."""
        return self.started + self.budget_s if self.budget_s else None

    def checkpoint(self, rows: list[dict]) -> None:
        """Appends one point's rows to ``rows.jsonl`` as soon as they are measured, so a run cut
        short (a timeout) keeps every finished point; to the stream too, each row with the run
        folder's name and the preset. Every row names its op (the sweep's, unless its own)."""
        rows = [{"op": self.op, **r} for r in rows]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        append_rows(self.run_dir / "rows.jsonl", rows)
        if self.stream is not None:
            append_rows(
                self.stream, [{"run": self.run_dir.name, "preset": self.preset, **r} for r in rows]
            )

    def meta(self, copy: dict, skipped: list[dict], **first) -> dict:
        """The run's metadata, measuring the copy bandwidth again at the end; ``first``: keys that
        follow ``run``."""
        copy_end = copy_bandwidth(self.device, self.cfg)
        return dict(
            run=self.run_dir.name,
            **first,
            preset=self.preset,
            date_utc=self.stamp,
            commit=self.commit,
            device=asdict(self.device),
            gpu_measurement=self.device.is_gpu,
            label=self.label,
            versions=versions(),
            timing=self.cfg.as_dict(),
            copy_bandwidth_start=copy,
            copy_bandwidth_end=copy_end,
            providers=[p.name for p in self.providers],
            skipped=skipped,
            wall_s=self.elapsed(),
            command=" ".join(sys.argv),
        )

    def finish(self) -> Path:
        self.log(f"results: {self.run_dir} ({self.elapsed():.0f} s)")
        return self.run_dir


def append_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines at the end of ``path``, flushed before returning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))


def kvattn_failures(rows: list[dict]) -> list[str]:
    """``provider point: status`` of every kvattn provider that failed (a wrong result, an error):
    the run exits non-zero when there is one."""
    return [
        f"{r['provider']} {r.get('mode', '')}: {r['status']}"
        for r in rows
        if r.get("provider", "").startswith("kvattn-")
        and str(r.get("status", "")).startswith("failed")
    ]


def exit_code(sweep: Sweep, rows: list[dict]) -> int:
    failures = kvattn_failures(rows)
    for line in failures:
        sweep.log(f"KVATTN PROVIDER FAILED: {line}")
    return 1 if failures else 0

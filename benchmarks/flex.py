"""FlexAttention (``flex-paged``: PyTorch's paged attention) against kvattn's Triton kernels on one
or two headline shapes, its compile time logged apart: ``python -m benchmarks.flex [--preset NAME]``.

``torch.compile`` specialises FlexAttention per shape (5-60 s each on an H200 host), and past
dynamo's recompile limit it would silently run the eager version, which reads every key: so this
command compiles for few shapes, with ``fullgraph=True`` (a graph break or the recompile limit
raises and the row says so, nothing eager is timed), and records for each shape the first call's
seconds (compile and one call) and the graphs dynamo compiled during it. A shape is started only
when its estimate with a typical compile (``FLEX_COMPILE_S``) fits the time budget; the suite also
bounds the whole command. Rows go to ``<out-dir>/<date>_<device>_<commit>_flex/rows.jsonl`` as each
shape is measured (and to ``--stream``), ``summary.md`` at the end.
"""

from __future__ import annotations

import sys
import time
import warnings
import zlib
from dataclasses import asdict

import torch

from . import decode, extend, providers
from .common import (
    Device,
    ExtendPoint,
    Point,
    bandwidth_columns,
    bytes_moved,
    check_provider,
    extend_check_rows,
    extend_reference,
    make_decode_inputs,
    make_extend_inputs,
    measure,
    prepare_providers,
    reference_output,
    rotation_sets,
    synchronize,
)
from .sweep import Sweep, exit_code, parse_args

FLEX_COMPILE_S = 30.0  # a typical compile of one shape, for the estimate only
KVATTN = ("kvattn-triton-checked", "kvattn-triton-unchecked")


def preset_points(name: str) -> list:
    """``headline``: decode at batch 16 x 8K, extend of a 512-token chunk over 8K (bf16, 32/8
    heads, head dim 128, page 16); ``cpu-tiny``: one tiny decode point (FlexAttention skips the
    CPU; the kvattn rows show the command runs)."""
    if name == "headline":
        return [
            Point(16, 8192, 16, 32, 8, 128, "bf16"),
            ExtendPoint(1, 512, 8192, 16, 32, 8, 128, "bf16"),
        ]
    if name == "cpu-tiny":
        return [Point(1, 64, 16, 8, 2, 64, "fp16")]
    raise ValueError(f"--preset: expected 'headline' or 'cpu-tiny', got {name!r}")


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return -1
    return int(counters["stats"]["unique_graphs"])


def first_call_timed(prov: providers.Provider, record: dict) -> providers.Provider:
    """``prov`` whose first call is timed apart (``record``: ``compile_s``, ``dynamo_graphs``,
    ``warnings``): for FlexAttention that call compiles."""

    def build(inp):
        run, out = prov.build(inp)
        state = {"first": True}

        def timed(i):
            if not state["first"]:
                return run(i)
            state["first"] = False
            # Said before the call: a compile stopped by the step's limit still shows in the log.
            print(f"  {prov.name}: first call (the compile) starts", flush=True)
            graphs = _dynamo_graphs()
            t0 = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = run(i)
                synchronize(inp.q.device)
            record.update(
                compile_s=round(time.monotonic() - t0, 2),
                dynamo_graphs=_dynamo_graphs() - graphs,
                warnings=[str(w.message)[:200] for w in caught][:3],
            )
            return result

        return timed, out

    return providers.Provider(prov.name, prov.family, prov.checked, prov.why_not, build)


def run_point(p, device: Device, cfg, copy_tbps: float, log, deadline) -> list[dict]:
    dev = device.torch_device
    op = "extend" if isinstance(p, ExtendPoint) else "decode"
    pool = p.pool_point() if op == "extend" else p
    sets = rotation_sets(pool, device.l2_bytes) if device.is_gpu else 2
    seed = zlib.crc32(p.label().encode())
    compile_record: dict = {}
    chosen = providers.select(["flex-paged", *KVATTN], op=op)
    chosen = [
        first_call_timed(prov, compile_record) if prov.name == "flex-paged" else prov
        for prov in chosen
    ]
    if op == "decode":
        inp = make_decode_inputs(p, dev, sets, seed=seed)
        rows_ref = min(p.batch, decode.CHECK_ROWS)
        refs = {i: reference_output(inp, i, rows_ref) for i in sorted({0, sets - 1})}
        base = dict(asdict(p), op=op, sets=sets, pool_bytes=inp.pool_bytes())

        def check(run, out_buf):
            return check_provider(run, out_buf, refs, p.dtype, p.pages_checked)

        def columns(prov, med):
            return bandwidth_columns(bytes_moved(p, prov.checked), med, copy_tbps)
    else:
        inp = make_extend_inputs(p, dev, sets, seed=seed)
        picks = extend_check_rows(p, extend.CHECK_SEQS)
        rows_idx = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
        refs = {i: extend_reference(inp, i, picks) for i in sorted({0, sets - 1})}
        base = dict(asdict(p), op=op, context=p.context, sets=sets, pool_bytes=inp.pool_bytes())

        def check(run, out_buf):
            return check_provider(run, out_buf, refs, p.dtype, p.pages_checked, rows_idx)

        def columns(prov, med):
            return extend.extend_columns(p, prov.checked, med, copy_tbps)

    skipped, live = prepare_providers(chosen, inp, check, base, log)
    if compile_record:
        log(
            f"  flex-paged first call (compile and one call): {compile_record['compile_s']:.1f} s, "
            f"{compile_record['dynamo_graphs']} graph(s) compiled by dynamo"
            + (f"; warnings: {compile_record['warnings']}" if compile_record["warnings"] else "")
        )
    synchronize(dev)
    rows = skipped + measure(live, inp.sets, device, cfg, columns, deadline, log)
    for r in rows:
        if r["provider"] == "flex-paged":
            r.update(compile_record)
            if compile_record.get("dynamo_graphs") == 0:
                r["note"] = "dynamo counted no graph compiled during the first call"
    return rows


def summary(sweep: Sweep, rows: list[dict], skipped: list[dict]) -> str:
    mode = "graph" if sweep.device.is_gpu else "cpu"
    lines = [
        f"# FlexAttention against kvattn: {sweep.device.name}, commit {sweep.commit}, "
        f"{sweep.stamp} UTC",
        "",
        f"**{sweep.label}.** Median per call in microseconds "
        f"({mode} rows); the first call of FlexAttention (compile and one call) is timed apart.",
        "",
        "| point | flex first call s | dynamo graphs | flex us | triton checked us | "
        "flex / checked | flex status |",
        "|---|---|---|---|---|---|---|",
    ]
    by_point: dict = {}
    for r in rows:
        by_point.setdefault(r.get("label"), []).append(r)

    def timed(group, name):
        return next(
            (
                r
                for r in group
                if r["provider"] == name and r.get("mode") == mode and r["status"] == "ok"
            ),
            None,
        )

    for label, group in by_point.items():
        first = next((r for r in group if r["provider"] == "flex-paged"), {})
        flex, checked = timed(group, "flex-paged"), timed(group, "kvattn-triton-checked")
        cells = [
            label,
            first.get("compile_s", ""),
            first.get("dynamo_graphs", ""),
            f"{flex['median_ms'] * 1e3:.1f}" if flex else "",
            f"{checked['median_ms'] * 1e3:.1f}" if checked else "",
            f"{flex['median_ms'] / checked['median_ms']:.2f}" if flex and checked else "",
            first.get("status", "not run"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [f"- {s['point']}: not run ({s['reason']})" for s in skipped]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args("python -m benchmarks.flex", __doc__, argv, ("headline", "cpu-tiny"))
    if args.preset is None:
        args.preset = "headline" if torch.cuda.is_available() else "cpu-tiny"
    sweep = Sweep.start(args, preset_points, "decode", folder_suffix="_flex")
    sweep.run_dir.mkdir(parents=True, exist_ok=True)
    device, cfg = sweep.device, sweep.cfg

    def estimate(p) -> float:
        if isinstance(p, ExtendPoint):
            seconds = decode.estimate_point_seconds(
                p.pool_point(), 3, cfg, device, call_s=extend.call_seconds(p)
            )
        else:
            seconds = decode.estimate_point_seconds(p, 3, cfg, device)
        return seconds + FLEX_COMPILE_S

    copy = sweep.begin("FlexAttention against kvattn", "flex", estimate)

    def one(p):
        rows = run_point(p, device, cfg, copy["tbps"], sweep.log, sweep.deadline)
        return [dict(r, label=p.label()) for r in rows]

    rows, skipped = sweep.run_points(
        one, estimate, lambda p: p.pool_point() if isinstance(p, ExtendPoint) else p
    )
    (sweep.run_dir / "summary.md").write_text(summary(sweep, rows, skipped))
    (sweep.run_dir / "log.txt").write_text("\n".join(sweep.log_lines) + "\n")
    sweep.finish()
    return exit_code(sweep, rows)


if __name__ == "__main__":
    sys.exit(main())

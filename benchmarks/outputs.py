"""Writes a benchmark run: CSV per table, one JSON with everything, a markdown summary that checks
the targets of the benchmark issue, and the plots. Decode runs and extend runs share the format."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .plot import plot_extend_run, plot_mla_run, plot_run, row_dims

# Targets (benchmark figures on an H200, never test assertions).
CHECK_TOL_LONG = 0.01  # checked within 1% of unchecked at context >= LONG_CONTEXT
CHECK_TOL_ANY = 0.03  # and within 3% everywhere
LONG_CONTEXT = 4096
BW_TARGET_PCT = 85.0  # unchecked at >= 85% of the copy bandwidth ...
BW_MIN_BATCH, BW_MIN_CONTEXT = 16, 8192  # ... for batch >= 16 and context >= 8K
WRITER_TOL = 0.02  # stamping within 2% of the unstamped write
SHORT_CALL_MS = 0.02  # calls this short are dominated by fixed per-launch costs
MATMUL_TARGET_PCT = 50.0  # extend at >= 50% of the bf16 matrix rate ...
MATMUL_MIN_PREFIX = 8192  # ... at a prefix of 8K and more
PEER = "flex-paged"  # the peer kvattn's decode must be ahead of
# Targets are judged on graph replays: eager rows include the host's launch time.
TARGET_MODE = "graph"

DECODE_COLUMNS = [
    "provider",
    "mode",
    "status",
    "batch",
    "context",
    "page_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "head_dim_v",
    "dtype",
    "variant",
    "median_ms",
    "spread_pct",
    "repeats",
    "kv_bytes",
    "other_bytes",
    "total_bytes",
    "tbps",
    "pct_copy_bw",
    "ratio_vs_unchecked",
    "ratio_min",
    "ratio_max",
    "max_abs_err",
    "sets",
    "pool_bytes",
    "times_ms",
]
EXTEND_COLUMNS = [
    "provider",
    "mode",
    "status",
    "batch",
    "chunk",
    "prefix",
    "context",
    "page_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "head_dim_v",
    "dtype",
    "variant",
    "median_ms",
    "spread_pct",
    "repeats",
    "flops",
    "tflops",
    "kv_bytes",
    "other_bytes",
    "total_bytes",
    "tbps",
    "pct_copy_bw",
    "ratio_vs_unchecked",
    "ratio_min",
    "ratio_max",
    "max_abs_err",
    "rows_checked",
    "sets",
    "pool_bytes",
    "times_ms",
]
WRITER_COLUMNS = [
    "provider",
    "mode",
    "status",
    "pattern",
    "tokens",
    "page_size",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "median_ms",
    "spread_pct",
    "total_bytes",
    "tbps",
    "pct_copy_bw",
    "ratio_vs_unstamped",
    "ratio_min",
    "ratio_max",
    "times_ms",
]


def _write_csv(path: Path, rows: list[dict], columns: list[str], meta: dict) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(
            f, fieldnames=["run", "device", "measurement"] + columns, extrasaction="ignore"
        )
        w.writeheader()
        for r in rows:
            r = dict(r, run=meta["run"], device=meta["device"]["name"], measurement=meta["label"])
            if "times_ms" in r:
                r["times_ms"] = " ".join(f"{t:.6g}" for t in r["times_ms"])
            w.writerow(r)


def _fmt(x, spec: str, missing: str = "") -> str:
    return missing if x is None else format(x, spec)


CPU_NO_TARGETS = [
    "Targets are H200 figures; this run is on a CPU and is NOT a GPU measurement, so "
    "no target is evaluated."
]


def _tally(misses: list, total: int, what: str) -> str:
    return ("met at all " if not misses else f"missed at {len(misses)} of ") + f"{total} {what}."


def _overhead_lines(rows: list[dict], point, claim: str, short_note: bool) -> list[str]:
    """The check-overhead target on the checked rows that carry a ratio: ``claim`` states it,
    ``point(row)`` names a missing point; ``short_note`` explains misses on very short calls."""
    ratios = [r for r in _judged(rows) if r.get("ratio_vs_unchecked") is not None]
    misses = []
    for r in ratios:
        tol = CHECK_TOL_LONG if r["context"] >= LONG_CONTEXT else CHECK_TOL_ANY
        over = r["ratio_vs_unchecked"] - 1
        if over > tol:
            noise = " (inside the run-to-run range)" if r["ratio_min"] - 1 <= tol else ""
            short = ""
            if short_note and r["median_ms"] < SHORT_CALL_MS:
                short = (
                    "; calls of a few microseconds, where fixed per-launch costs of the check "
                    "(report allocation and zeroing) weigh most"
                )
            misses.append(
                f"  - {r['provider']} {r['mode']} {point(r)}: +{100 * over:.2f}% "
                f"(target {100 * tol:.0f}%, range {100 * (r['ratio_min'] - 1):+.2f}.."
                f"{100 * (r['ratio_max'] - 1):+.2f}%){noise}{short}"
            )
    return [
        f"- {claim}: " + _tally(misses, len(ratios), "measured (point, backend, mode) pairs")
    ] + misses


def _judged(rows: list[dict]) -> list[dict]:
    """The measured rows targets are judged on: graph replays."""
    return [r for r in rows if r.get("status") == "ok" and r.get("mode") == TARGET_MODE]


def _peer_lines(rows: list[dict], point, what: str) -> list[str]:
    """kvattn (each backend, checked) against the peer at the same point and mode."""
    by_point = {}
    for r in _judged(rows):
        by_point.setdefault(point(r), {})[r["provider"]] = r
    compared, misses = 0, []
    for label, provs in by_point.items():
        peer = provs.get(PEER)
        if peer is None:
            continue
        for name, r in provs.items():
            if name.startswith("kvattn-") and name.endswith("-checked"):
                compared += 1
                if r["median_ms"] >= peer["median_ms"]:
                    misses.append(
                        f"  - {name} {label}: {r['median_ms'] * 1e3:.1f} us vs {PEER} "
                        f"{peer['median_ms'] * 1e3:.1f} us"
                    )
    if not compared:
        return [
            f"- Checked {what} ahead of {PEER} on the same shapes: not measured ({PEER} did not run)."
        ]
    return [
        f"- Checked {what} ahead of {PEER} on the same shapes: "
        + _tally(misses, compared, "(point, backend) pairs")
    ] + misses


def evaluate_targets(meta: dict, decode: list[dict], writer: list[dict]) -> list[str]:
    """Markdown lines: each target, whether this run meets it, and by how much it misses. Judged
    on graph-replay rows only."""
    if not meta["gpu_measurement"]:
        return list(CPU_NO_TARGETS)
    lines = _overhead_lines(
        decode,
        _point,
        f"Checked within {100 * CHECK_TOL_LONG:.0f}% of unchecked "
        f"at context >= {LONG_CONTEXT}, within {100 * CHECK_TOL_ANY:.0f}% everywhere",
        short_note=True,
    )
    bw = [
        r
        for r in _judged(decode)
        if r["provider"].endswith("-unchecked")
        and r["batch"] >= BW_MIN_BATCH
        and r["context"] >= BW_MIN_CONTEXT
    ]
    bw_miss = [r for r in bw if r["pct_copy_bw"] < BW_TARGET_PCT]
    lines.append(
        f"- Unchecked decode at >= {BW_TARGET_PCT:.0f}% of the copy bandwidth for batch >= "
        f"{BW_MIN_BATCH} and context >= {BW_MIN_CONTEXT}: "
        + _tally(bw_miss, len(bw), "measured points")
    )
    lines += [
        f"  - {r['provider']} {r['mode']} {_point(r)}: {r['pct_copy_bw']:.1f}% "
        f"({r['tbps']:.2f} TB/s), {BW_TARGET_PCT - r['pct_copy_bw']:.1f} points short"
        for r in bw_miss
    ]
    lines += _peer_lines(decode, _point, "decode")
    wr = [
        r
        for r in writer
        if r.get("ratio_vs_unstamped") is not None and r.get("mode") == TARGET_MODE
    ]
    w_miss = [r for r in wr if r["ratio_vs_unstamped"] - 1 > WRITER_TOL]
    lines.append(
        f"- Stamped write within {100 * WRITER_TOL:.0f}% of the unstamped write: "
        + _tally(w_miss, len(wr), "measured points")
    )
    lines += [
        f"  - {r['mode']} {r['pattern']} {r['tokens']} tokens: "
        f"+{100 * (r['ratio_vs_unstamped'] - 1):.1f}% (range "
        f"{100 * (r['ratio_min'] - 1):+.1f}..{100 * (r['ratio_max'] - 1):+.1f}%); write_kv "
        f"is a sequence of PyTorch ops (tag reads, run detection, masked scatter, stamp), "
        f"each a kernel launch, against two index_put launches"
        for r in w_miss
    ]
    return lines


def _point(r: dict) -> str:
    return (
        f"B={r['batch']} ctx={r['context']} page={r['page_size']} "
        f"heads={r['num_heads']}/{r['num_kv_heads']} d={row_dims(r)} {r['dtype']}"
    )


def _header_lines(meta: dict) -> list[str]:
    """Title, the CPU warning, device, date, commit, versions, copy bandwidth, timing, command."""
    v = meta["versions"]
    lines = [f"# kvattn benchmark run {meta['run']}", ""]
    if not meta["gpu_measurement"]:
        lines += [
            "**NOT a GPU measurement.** This run is on a CPU; the Triton kernels run under the "
            "Triton interpreter. Its times say nothing about GPU speed; they only show that "
            "the harness runs end to end.",
            "",
        ]
    lines += [
        f"- device: {meta['device']['name']} ({meta['label']})",
        f"- date (UTC): {meta['date_utc']}; commit: {meta['commit']}; preset: {meta['preset']}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- copy bandwidth (read + write, same run): {meta['copy_bandwidth_start']['tbps']:.3f}"
        f" TB/s at start, {meta['copy_bandwidth_end']['tbps']:.3f} TB/s at end",
        f"- timing: {meta['timing']}; wall {meta['wall_s']:.0f} s",
        f"- command: `{meta['command']}`",
        "",
        "## Targets",
        "",
    ]
    return lines


def _not_measured_lines(meta: dict, rows: list[dict]) -> list[str]:
    not_run = sorted({(r["provider"], r["status"]) for r in rows if r.get("status") != "ok"})
    if not not_run and not meta["skipped"]:
        return []
    return (
        ["", "## Not measured", ""]
        + [f"- {name}: {status}" for name, status in not_run]
        + [f"- point {s['point']}: {s['reason']}" for s in meta["skipped"]]
    )


def _ratio(r: dict, key: str, digits: int) -> str:
    if r.get(key) is None:
        return ""
    return f"{r[key]:.{digits}f} ({r['ratio_min']:.{digits}f}..{r['ratio_max']:.{digits}f})"


def _summary(meta: dict, targets: list[str], tables, rows: list[dict]) -> str:
    """``tables``: (title, rows, column headers, cells of a row given the time unit's scale); only
    the rows measured go in, the others are listed under "Not measured"."""
    gpu = meta["gpu_measurement"]
    unit, scale = ("us", 1e3) if gpu else ("ms", 1.0)
    caption = "" if gpu else " (NOT a GPU measurement)"
    lines = _header_lines(meta) + targets
    for title, table_rows, columns, cells in tables:
        columns = [c.format(unit=unit) for c in columns]
        lines += [
            "",
            f"## {title}{caption}",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
        ]
        lines += [
            "| " + " | ".join(cells(r, scale)) + " |" for r in table_rows if r.get("status") == "ok"
        ]
    lines += _not_measured_lines(meta, rows)
    return "\n".join(lines) + "\n"


def _timing_cells(r: dict, scale: float) -> list[str]:
    return [r["provider"], r["mode"], f"{r['median_ms'] * scale:.2f}", f"{r['spread_pct']:.1f}"]


def summary_markdown(meta: dict, decode: list[dict], writer: list[dict]) -> str:
    return _summary(
        meta,
        evaluate_targets(meta, decode, writer),
        [
            (
                "Decode",
                decode,
                [
                    "point",
                    "provider",
                    "mode",
                    "median {unit}",
                    "spread %",
                    "TB/s",
                    "% copy",
                    "checked/unchecked (range)",
                    "max err",
                ],
                lambda r, scale: [
                    _point(r),
                    *_timing_cells(r, scale),
                    f"{r['tbps']:.3g}",
                    f"{r['pct_copy_bw']:.1f}",
                    _ratio(r, "ratio_vs_unchecked", 4),
                    f"{r['max_abs_err']:.2g}",
                ],
            ),
            (
                "Writer",
                writer,
                [
                    "pattern",
                    "tokens",
                    "provider",
                    "mode",
                    "median {unit}",
                    "spread %",
                    "TB/s",
                    "stamped/unstamped (range)",
                ],
                lambda r, scale: [
                    r["pattern"],
                    str(r["tokens"]),
                    *_timing_cells(r, scale),
                    f"{r['tbps']:.3g}",
                    _ratio(r, "ratio_vs_unstamped", 3),
                ],
            ),
        ],
        decode + writer,
    )


def _write_run(
    run_dir: Path, meta: dict, tables: dict, summary: str, log_lines: list[str], plot
) -> list[Path]:
    """``tables``: name -> (rows, CSV columns), each written to ``<name>.csv`` and under its name in
    ``run.json``; ``plot()`` draws the figures (None: no plots)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, (rows, columns) in tables.items():
        _write_csv(run_dir / f"{name}.csv", rows, columns, meta)
    (run_dir / "run.json").write_text(
        json.dumps(
            dict(meta=meta, **{name: rows for name, (rows, _) in tables.items()}),
            indent=1,
            default=str,
        )
    )
    (run_dir / "summary.md").write_text(summary)
    (run_dir / "log.txt").write_text("\n".join(log_lines) + "\n")
    written = [run_dir / f"{name}.csv" for name in tables]
    written += [run_dir / n for n in ("run.json", "summary.md", "log.txt")]
    if plot is not None:
        written += plot()
    return written


def write_outputs(
    run_dir: Path,
    meta: dict,
    decode: list[dict],
    writer: list[dict],
    log_lines: list[str],
    plots: bool = True,
) -> list[Path]:
    return _write_run(
        run_dir,
        meta,
        {"decode": (decode, DECODE_COLUMNS), "writer": (writer, WRITER_COLUMNS)},
        summary_markdown(meta, decode, writer),
        log_lines,
        (lambda: plot_run(run_dir, meta, decode)) if plots else None,
    )


def _extend_point(r: dict) -> str:
    return (
        f"B={r['batch']} chunk={r['chunk']} prefix={r['prefix']} page={r['page_size']} "
        f"heads={r['num_heads']}/{r['num_kv_heads']} d={row_dims(r)} {r['dtype']}"
    )


def evaluate_extend_targets(meta: dict, rows: list[dict]) -> list[str]:
    """The decode check-overhead target applied to extend, by context (prefix + chunk): extend has
    no target of its own, so the tolerance is decode's."""
    if not meta["gpu_measurement"]:
        return list(CPU_NO_TARGETS)
    lines = _overhead_lines(
        rows,
        _extend_point,
        f"Checked extend within {100 * CHECK_TOL_LONG:.0f}% of unchecked at prefix + "
        f"chunk >= {LONG_CONTEXT}, within {100 * CHECK_TOL_ANY:.0f}% everywhere "
        f"(decode's tolerance)",
        short_note=False,
    )
    rate = (meta.get("matmul_rate") or {}).get("tflops")
    fast = [
        r
        for r in _judged(rows)
        if r["provider"].startswith("kvattn-") and r["prefix"] >= MATMUL_MIN_PREFIX
    ]
    if rate:
        miss = [r for r in fast if 100 * r["tflops"] / rate < MATMUL_TARGET_PCT]
        lines.append(
            f"- kvattn extend at >= {MATMUL_TARGET_PCT:.0f}% of the bf16 matrix rate measured in "
            f"this run ({rate:.0f} TFLOP/s) at prefix >= {MATMUL_MIN_PREFIX}: "
            + _tally(miss, len(fast), "measured (point, provider) pairs")
        )
        lines += [
            f"  - {r['provider']} {_extend_point(r)}: {r['tflops']:.0f} TFLOP/s "
            f"({100 * r['tflops'] / rate:.1f}%)"
            for r in miss
        ]
    return lines + _peer_lines(rows, _extend_point, "extend")


def extend_summary_markdown(meta: dict, rows: list[dict]) -> str:
    return _summary(
        meta,
        evaluate_extend_targets(meta, rows),
        [
            (
                "Extend",
                rows,
                [
                    "point",
                    "provider",
                    "mode",
                    "median {unit}",
                    "spread %",
                    "TFLOP/s",
                    "TB/s",
                    "checked/unchecked (range)",
                    "max err",
                ],
                lambda r, scale: [
                    _extend_point(r),
                    *_timing_cells(r, scale),
                    f"{r['tflops']:.3g}",
                    f"{r['tbps']:.3g}",
                    _ratio(r, "ratio_vs_unchecked", 4),
                    f"{r['max_abs_err']:.2g}",
                ],
            ),
        ],
        rows,
    )


def write_extend_outputs(
    run_dir: Path, meta: dict, rows: list[dict], log_lines: list[str], plots: bool = True
) -> list[Path]:
    return _write_run(
        run_dir,
        meta,
        {"extend": (rows, EXTEND_COLUMNS)},
        extend_summary_markdown(meta, rows),
        log_lines,
        (lambda: plot_extend_run(run_dir, meta, rows)) if plots else None,
    )


MLA_COLUMNS = [
    "provider",
    "mode",
    "status",
    "batch",
    "context",
    "q_len",
    "page_size",
    "num_heads",
    "kv_lora_rank",
    "rope_dim",
    "dtype",
    "median_ms",
    "spread_pct",
    "repeats",
    "kv_bytes",
    "other_bytes",
    "total_bytes",
    "tbps",
    "pct_copy_bw",
    "ratio_vs_unchecked",
    "ratio_min",
    "ratio_max",
    "max_abs_err",
    "sets",
    "pool_bytes",
    "times_ms",
]


def _mla_point(r: dict) -> str:
    rows = f" q_len={r['q_len']}" if r.get("q_len", 1) > 1 else ""
    return (
        f"B={r['batch']} ctx={r['context']}{rows} page={r['page_size']} heads={r['num_heads']} "
        f"latent={r['kv_lora_rank']}+{r['rope_dim']} {r['dtype']}"
    )


def evaluate_mla_targets(meta: dict, rows: list[dict]) -> list[str]:
    """Decode's check-overhead target on the MLA rows (GPU runs, graph replays)."""
    if not meta["gpu_measurement"]:
        return list(CPU_NO_TARGETS)
    return _overhead_lines(
        rows,
        _mla_point,
        f"Checked MLA decode within {100 * CHECK_TOL_LONG:.0f}% "
        f"of unchecked at context >= {LONG_CONTEXT}, within "
        f"{100 * CHECK_TOL_ANY:.0f}% everywhere (decode's tolerance)",
        short_note=True,
    )


def mla_summary_markdown(meta: dict, rows: list[dict]) -> str:
    return _summary(
        meta,
        evaluate_mla_targets(meta, rows),
        [
            (
                "MLA decode and extend",
                rows,
                [
                    "point",
                    "provider",
                    "mode",
                    "median {unit}",
                    "spread %",
                    "TB/s",
                    "% copy",
                    "checked/unchecked (range)",
                    "max err",
                ],
                lambda r, scale: [
                    _mla_point(r),
                    *_timing_cells(r, scale),
                    f"{r['tbps']:.3g}",
                    f"{r['pct_copy_bw']:.1f}",
                    _ratio(r, "ratio_vs_unchecked", 4),
                    f"{r['max_abs_err']:.2g}",
                ],
            ),
        ],
        rows,
    )


def write_mla_outputs(
    run_dir: Path, meta: dict, rows: list[dict], log_lines: list[str], plots: bool = True
) -> list[Path]:
    return _write_run(
        run_dir,
        meta,
        {"mla": (rows, MLA_COLUMNS)},
        mla_summary_markdown(meta, rows),
        log_lines,
        (lambda: plot_mla_run(run_dir, meta, rows)) if plots else None,
    )

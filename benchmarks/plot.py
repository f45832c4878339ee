"""Plots of a benchmark run: check overhead and achieved bandwidth (decode, MLA decode) or TFLOP/s
(extend) against context.

``python -m benchmarks.plot RUN_DIR`` redraws them from ``RUN_DIR/run.json``. Without matplotlib
nothing is drawn and the run says so; the CSV/JSON/markdown outputs do not depend on it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _series(rows: list[dict], value, key) -> dict[str, list[tuple[int, float]]]:
    """One line per ``key(row)``, points sorted by context."""
    series = defaultdict(list)
    for r in rows:
        y = value(r)
        if r.get("status") != "ok" or y is None:
            continue
        series[key(r)].append((r["context"], y))
    return {k: sorted(v) for k, v in series.items()}


def row_dims(r: dict) -> str:
    """A row's head dim, ``192/128`` when V has its own (rows of older runs lack the column)."""
    dv = r.get("head_dim_v")
    return f"{r['head_dim']}" + (f"/{dv}" if dv not in (None, "") else "")


def _decode_key(r: dict) -> str:
    return (
        f"{r['provider']} {r['mode']} B={r['batch']} p{r['page_size']} "
        f"h{r['num_heads']}/{r['num_kv_heads']} d{row_dims(r)} {r['dtype']}"
    )


def _extend_key(r: dict) -> str:
    return (
        f"{r['provider']} {r['mode']} B={r['batch']} chunk={r['chunk']} p{r['page_size']} "
        f"h{r['num_heads']}/{r['num_kv_heads']} d{row_dims(r)} {r['dtype']}"
    )


def _overhead(r: dict) -> float | None:
    return None if r.get("ratio_vs_unchecked") is None else 100 * (r["ratio_vs_unchecked"] - 1)


def _draw(run_dir: Path, meta: dict, rows: list[dict], figures, key, xlabel: str) -> list[Path]:
    """``figures``: (file name, y label, value of a row, horizontal ceiling or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plots drawn", flush=True)
        return []
    tag = "" if meta["gpu_measurement"] else "\nNOT a GPU measurement (CPU, Triton interpreter)"
    title = f"{meta['device']['name']}, {meta['commit']}, {meta['date_utc']}{tag}"
    written = []
    for name, ylabel, value, ceiling in figures:
        series = _series(rows, value, key)
        fig, ax = plt.subplots(figsize=(10, 6))
        for label, pts in series.items():
            ax.plot([c for c, _ in pts], [y for _, y in pts], marker="o", label=label)
        if ceiling is not None:
            ax.axhline(ceiling, color="black", linestyle="--", label="copy bandwidth (same run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        if series or ceiling is not None:
            ax.legend(fontsize=6, loc="best")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=110)
        plt.close(fig)
        written.append(run_dir / name)
    return written


def plot_run(run_dir: Path, meta: dict, decode: list[dict]) -> list[Path]:
    figures = [
        ("overhead.png", "checked / unchecked - 1 (%)", _overhead, None),
        (
            "bandwidth.png",
            "achieved TB/s (useful bytes / median time)",
            lambda r: r.get("tbps"),
            meta["copy_bandwidth_start"]["tbps"],
        ),
    ]
    return _draw(run_dir, meta, decode, figures, _decode_key, "context (tokens)")


def plot_extend_run(run_dir: Path, meta: dict, extend: list[dict]) -> list[Path]:
    figures = [
        ("extend_overhead.png", "checked / unchecked - 1 (%)", _overhead, None),
        (
            "extend_tflops.png",
            "achieved TFLOP/s (causal FLOPs / median time)",
            lambda r: r.get("tflops"),
            None,
        ),
    ]
    return _draw(run_dir, meta, extend, figures, _extend_key, "prefix + chunk (tokens)")


def _mla_key(r: dict) -> str:
    rows = f" q{r['q_len']}" if r.get("q_len", 1) > 1 else ""
    return (
        f"{r['provider']} {r['mode']} B={r['batch']}{rows} p{r['page_size']} h{r['num_heads']} "
        f"mla{r['kv_lora_rank']}+{r['rope_dim']} {r['dtype']}"
    )


def plot_mla_run(run_dir: Path, meta: dict, rows: list[dict]) -> list[Path]:
    figures = [
        ("mla_overhead.png", "checked / unchecked - 1 (%)", _overhead, None),
        (
            "mla_bandwidth.png",
            "achieved TB/s (useful bytes / median time)",
            lambda r: r.get("tbps"),
            meta["copy_bandwidth_start"]["tbps"],
        ),
    ]
    return _draw(run_dir, meta, rows, figures, _mla_key, "context (tokens)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.plot RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    data = json.loads((run_dir / "run.json").read_text())
    if "extend" in data:
        paths = plot_extend_run(run_dir, data["meta"], data["extend"])
    elif "mla" in data:
        paths = plot_mla_run(run_dir, data["meta"], data["mla"])
    else:
        paths = plot_run(run_dir, data["meta"], data["decode"])
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

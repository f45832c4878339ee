"""Plots of a benchmark run: check overhead and achieved bandwidth against context.

``python -m benchmarks.plot RUN_DIR`` redraws them from ``RUN_DIR/run.json``. Without matplotlib
nothing is drawn and the run says so; the CSV/JSON/markdown outputs do not depend on it.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _series(rows: list[dict], value) -> dict[str, list[tuple[int, float]]]:
    """One line per (provider, mode, batch, shape, dtype), points sorted by context."""
    series = defaultdict(list)
    for r in rows:
        y = value(r)
        if r.get("status") != "ok" or y is None:
            continue
        key = (f"{r['provider']} {r['mode']} B={r['batch']} p{r['page_size']} "
               f"h{r['num_heads']}/{r['num_kv_heads']} d{r['head_dim']} {r['dtype']}")
        series[key].append((r["context"], y))
    return {k: sorted(v) for k, v in series.items()}


def plot_run(run_dir: Path, meta: dict, decode: list[dict]) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plots drawn", flush=True)
        return []
    tag = "" if meta["gpu_measurement"] else "\nNOT a GPU measurement (CPU, Triton interpreter)"
    title = f"{meta['device']['name']}, {meta['commit']}, {meta['date_utc']}{tag}"
    figures = [
        ("overhead.png", "checked / unchecked - 1 (%)",
         lambda r: None if r.get("ratio_vs_unchecked") is None else 100 * (r["ratio_vs_unchecked"] - 1),
         None),
        ("bandwidth.png", "achieved TB/s (useful bytes / median time)", lambda r: r.get("tbps"),
         meta["copy_bandwidth_start"]["tbps"]),
    ]
    written = []
    for name, ylabel, value, ceiling in figures:
        series = _series(decode, value)
        fig, ax = plt.subplots(figsize=(10, 6))
        for key, pts in series.items():
            ax.plot([c for c, _ in pts], [y for _, y in pts], marker="o", label=key)
        if ceiling is not None:
            ax.axhline(ceiling, color="black", linestyle="--", label="copy bandwidth (same run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.plot RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    data = json.loads((run_dir / "run.json").read_text())
    for path in plot_run(run_dir, data["meta"], data["decode"]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

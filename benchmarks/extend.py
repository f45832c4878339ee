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

import itertools
import sys
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from .common import (
    EXTEND_VARIANTS,
    VARIANTS,
    Device,
    ExtendPoint,
    TimingConfig,
    bandwidth_columns,
    bytes_moved,
    check_and_measure,
    check_provider,
    extend_check_rows,
    extend_reference,
    make_extend_inputs,
    matmul_rate,
    rotation_sets,
)
from .decode import estimate_point_seconds
from .outputs import write_extend_outputs
from .sweep import HEADLINE_PRESETS, Sweep, exit_code, parse_args

CHECK_SEQS = 2  # sequences (besides the last) whose sampled rows are compared with the reference
# Compute rate assumed by the wall-time estimate of a GPU point (a conservative figure for a
# 16-bit attention kernel on an H200, used only to size the sweep, never reported).
ESTIMATE_TFLOPS = 200.0


def _grid(batches, chunks, prefixes, pages=(16,), heads=((32, 8),), dims=(128,), dtypes=("bf16",)):
    return [
        ExtendPoint(b, c, pre, p, h, kv, d, t)
        for t, d, (h, kv), p, b, c, pre in itertools.product(
            dtypes, dims, heads, pages, batches, chunks, prefixes
        )
    ]


def variant_points(batch: int, chunk: int, prefix: int) -> list[ExtendPoint]:
    """One point per attention variant (checked vs unchecked on the same kernel switch), and one
    with a V head dim of its own (DeepSeek's non-absorbed prefill: 192-dim keys, 128-dim
    values)."""
    return [
        ExtendPoint(batch, chunk, prefix, 16, 32, 8, 128, "bf16", v)
        for v in (*VARIANTS, *EXTEND_VARIANTS)
        if v != "plain"
    ] + [ExtendPoint(batch, chunk, prefix, 16, 32, 8, 192, "bf16", head_dim_v=128)]


def preset_points(name: str) -> list[ExtendPoint]:
    """The sweeps. ``gpu-suite`` is ordered by importance (a long-prefix chunk first), so a run
    stopped by its time budget keeps the points that matter most; the variant rows come last.
    ``headline``: the goals' points alone (a prefill of 4K tokens, a chunk of 512 over 8K), which
    the GPU suite times first."""
    if name == "headline":
        return _grid([1], [4096], [0]) + _grid([1], [512], [8192])
    if name == "cpu-tiny":
        return [
            ExtendPoint(1, 16, 0, 16, 4, 2, 32, "fp16"),
            ExtendPoint(2, 24, 40, 16, 8, 2, 32, "fp16"),
            ExtendPoint(1, 8, 20, 1, 4, 4, 32, "bf16"),
            ExtendPoint(2, 40, 24, 64, 4, 2, 32, "fp16"),
            # A window shorter than the prefix: the pages before it neither read nor counted.
            ExtendPoint(1, 8, 150, 16, 4, 2, 16, "fp16", "window128"),
            ExtendPoint(2, 7, 30, 16, 4, 2, 16, "fp16", "tree"),
            ExtendPoint(2, 8, 20, 16, 4, 2, 32, "fp16", head_dim_v=16),
        ]
    if name == "gpu-suite":
        return (
            _grid([8], [2048], [8192])
            + _grid([8], [512], [32768])
            + _grid([1], [4096], [0])
            + _grid([32], [128], [4096])
            + _grid([8], [2048], [8192], dtypes=("fp16",))
            + _grid([8], [1024], [4096], pages=(1, 64))
            + _grid([8], [1024], [4096], heads=((32, 32),))
            + variant_points(8, 512, 32768)
        )
    if name == "full":
        return (
            _grid(
                [1, 4, 32],
                [128, 512, 4096],
                [0, 4096, 32768],
                pages=(1, 16, 64),
                heads=((32, 8), (32, 32)),
                dtypes=("fp16", "bf16"),
            )
            + variant_points(8, 512, 32768)
            + variant_points(8, 2048, 131072)
        )
    raise ValueError(f"--preset: expected one of {HEADLINE_PRESETS}, got {name!r}")


def call_seconds(p: ExtendPoint, copy_tbps: float = 4.0) -> float:
    """One call's time for the estimate: the larger of its bytes at the copy bandwidth and its
    FLOPs at ``ESTIMATE_TFLOPS``."""
    return max(
        bytes_moved(p.pool_point(), True, p.q_tokens)["total"] / (copy_tbps * 1e12),
        p.flops() / (ESTIMATE_TFLOPS * 1e12),
    )


def extend_columns(p: ExtendPoint, checked: bool, median_ms: float, copy_tbps: float) -> dict:
    tflops = p.flops() / (median_ms * 1e-3) / 1e12
    return dict(
        flops=p.flops(),
        tflops=tflops,
        **bandwidth_columns(bytes_moved(p.pool_point(), checked, p.q_tokens), median_ms, copy_tbps),
    )


def run_point(
    p: ExtendPoint,
    providers,
    device: Device,
    cfg: TimingConfig,
    copy_tbps: float,
    log,
    deadline: float | None = None,
) -> list[dict]:
    dev = device.torch_device
    pool = p.pool_point()
    sets = rotation_sets(pool, device.l2_bytes) if device.is_gpu else 2
    inp = make_extend_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    picks = extend_check_rows(p, CHECK_SEQS)
    rows_idx = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
    refs = {i: extend_reference(inp, i, picks) for i in sorted({0, sets - 1})}
    base = dict(
        asdict(p),
        context=p.context,
        rows_checked=len(picks),
        sets=sets,
        pool_bytes=inp.pool_bytes(),
    )
    return check_and_measure(
        providers,
        inp,
        lambda run, out_buf: check_provider(run, out_buf, refs, p.dtype, p.pages_checked, rows_idx),
        base,
        device,
        cfg,
        lambda prov, med: extend_columns(p, prov.checked, med, copy_tbps),
        log,
        deadline,
    )


def run(args) -> tuple[Path, int]:
    """The sweep; returns its run folder and the exit code (1 when a kvattn provider failed)."""
    sweep = Sweep.start(args, preset_points, "extend", folder_suffix="_extend")
    device, cfg = sweep.device, sweep.cfg

    def estimate(p: ExtendPoint) -> float:
        return estimate_point_seconds(
            p.pool_point(), len(sweep.providers) - 1, cfg, device, call_s=call_seconds(p)
        )

    copy = sweep.begin("kvattn extend benchmark", "extend", estimate)
    matmul = matmul_rate(device, cfg) if device.is_gpu else None
    if matmul is not None:
        sweep.log(
            f"bf16 matrix rate: {matmul['tflops']:.0f} TFLOP/s ({matmul['n']}^3 product in "
            f"{matmul['median_ms']:.3f} ms)"
        )
    rows, skipped = sweep.run_points(
        lambda p: run_point(
            p, sweep.providers, device, cfg, copy["tbps"], sweep.log, sweep.deadline
        ),
        estimate,
        ExtendPoint.pool_point,
    )
    code = exit_code(sweep, rows)
    write_extend_outputs(
        sweep.run_dir,
        sweep.meta(copy, skipped, op="extend", matmul_rate=matmul),
        rows,
        sweep.log_lines,
        plots=not args.no_plots,
    )
    return sweep.finish(), code


def main(argv=None) -> int:
    return run(parse_args("python -m benchmarks.extend", __doc__, argv, HEADLINE_PRESETS))[1]


if __name__ == "__main__":
    sys.exit(main())

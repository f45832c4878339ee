"""MLA paged decode and extend benchmark, checked against unchecked:
``python -m benchmarks.mla [--quick | --full | --preset NAME]``.

A point is ``batch`` sequences of ``context`` tokens over a latent pool ``[num_pages, page_size, 1,
kv_lora_rank + rope_dim]`` (DeepSeek V2/V3: 512 + 64, pages of 64) read by ``num_heads`` query
heads absorbed into the latent space, with ``q_len`` new query rows per sequence (1: decode; more:
the causal MLA extend of a speculative verify or a prefill chunk). The pool, rotation sets, NaN
poison, committed tags, correctness check and timing are those of :mod:`benchmarks.decode`; every
provider is checked against the reference (``kvattn.reference.paged_mla_decode`` or
``paged_mla_extend``) before it is timed. Results go to
``<out-dir>/<date>_<device>_<commit>_mla/``: ``mla.csv``, ``run.json``, ``summary.md``, ``log.txt``
and PNG plots when matplotlib is importable; ``benchmarks/results/README.md`` says how each figure
is obtained.
"""

from __future__ import annotations

import itertools
import sys
import zlib
from dataclasses import asdict
from pathlib import Path

from .common import (
    Device,
    MLAPoint,
    TimingConfig,
    bandwidth_columns,
    check_and_measure,
    check_provider,
    make_mla_inputs,
    mla_bytes_moved,
    mla_reference_output,
    rotation_sets,
)
from .decode import CHECK_ROWS, estimate_point_seconds
from .outputs import write_mla_outputs
from .sweep import PRESETS, Sweep, exit_code, parse_args


def _grid(batches, contexts, pages=(64,), heads=(16,), dtypes=("bf16",), q_lens=(1,)):
    return [
        MLAPoint(b, c, p, h, 512, 64, t, q)
        for t, h, p, q, b, c in itertools.product(dtypes, heads, pages, q_lens, batches, contexts)
    ]


def preset_points(name: str) -> list[MLAPoint]:
    """The sweeps, DeepSeek V2/V3's latent (512 + 64, bf16, pages of 64) unless named; 16 query heads
    is a V3 layer's share on 8-way tensor parallelism, 128 the whole layer. Extend points: 4 rows a
    sequence (a speculative verify of 3 drafts and the bonus token) and 512 (a prefill chunk over
    a cached prefix). ``gpu-suite`` is ordered by importance, so a run stopped by its time budget
    keeps the points that matter most."""
    if name == "cpu-tiny":
        return [
            MLAPoint(1, 40, 16, 4, 64, 16, "fp16"),
            MLAPoint(2, 100, 64, 16, 512, 64, "bf16"),
            MLAPoint(1, 40, 16, 4, 64, 16, "fp16", q_len=3),
        ]
    if name == "gpu-suite":
        return (
            _grid([64], [4096])
            + _grid([16], [8192, 32768])
            + _grid([1], [8192])
            + _grid([64], [4096], q_lens=(4,))
            + _grid([4], [4096], q_lens=(512,))
            + _grid([16], [4096], heads=(128,))
            + _grid([128], [4096])
            + _grid([64], [4096], dtypes=("fp16",))
            + _grid([64], [4096], pages=(16,))
        )
    if name == "full":
        return (
            _grid([1, 16, 64, 128], [1024, 4096, 16384, 65536], heads=(16, 32, 64, 128))
            + _grid([16, 64], [4096, 16384], pages=(1, 16), dtypes=("fp16", "bf16"))
            + _grid([16, 64], [4096, 16384], q_lens=(2, 4, 8), heads=(16, 128))
            + _grid([1, 4], [4096, 16384], q_lens=(512, 2048))
        )
    raise ValueError(f"--preset: expected one of {PRESETS}, got {name!r}")


def call_seconds(p: MLAPoint, copy_tbps: float = 4.0) -> float:
    """One call's time for the estimate: its bytes at ``copy_tbps``."""
    return mla_bytes_moved(p, True)["total"] / (copy_tbps * 1e12)


def run_point(
    p: MLAPoint,
    providers,
    device: Device,
    cfg: TimingConfig,
    copy_tbps: float,
    log,
    deadline: float | None = None,
) -> list[dict]:
    dev = device.torch_device
    sets = rotation_sets(p, device.l2_bytes) if device.is_gpu else 2
    inp = make_mla_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    rows_ref = min(p.batch, CHECK_ROWS)
    refs = {i: mla_reference_output(inp, i, rows_ref) for i in sorted({0, sets - 1})}
    op = "mla_decode" if p.q_len == 1 else "mla_extend"
    base = dict(asdict(p), op=op, sets=sets, pool_bytes=inp.pool_bytes())
    return check_and_measure(
        providers,
        inp,
        lambda run, out_buf: check_provider(run, out_buf, refs, p.dtype, p.pages_per_seq),
        base,
        device,
        cfg,
        lambda prov, med: bandwidth_columns(mla_bytes_moved(p, prov.checked), med, copy_tbps),
        log,
        deadline,
    )


def run(args) -> tuple[Path, int]:
    """The sweep; returns its run folder and the exit code (1 when a kvattn provider failed)."""
    sweep = Sweep.start(args, preset_points, "mla_decode", folder_suffix="_mla")
    device, cfg = sweep.device, sweep.cfg

    def estimate(p: MLAPoint) -> float:
        return estimate_point_seconds(
            p, len(sweep.providers) - 1, cfg, device, call_s=call_seconds(p)
        )

    copy = sweep.begin("kvattn MLA decode and extend benchmark", "mla_decode", estimate)
    rows, skipped = sweep.run_points(
        lambda p: run_point(
            p, sweep.providers, device, cfg, copy["tbps"], sweep.log, sweep.deadline
        ),
        estimate,
    )
    code = exit_code(sweep, rows)
    write_mla_outputs(
        sweep.run_dir,
        sweep.meta(copy, skipped, op="mla_decode"),
        rows,
        sweep.log_lines,
        plots=not args.no_plots,
    )
    return sweep.finish(), code


def main(argv=None) -> int:
    return run(parse_args("python -m benchmarks.mla", __doc__, argv))[1]


if __name__ == "__main__":
    sys.exit(main())

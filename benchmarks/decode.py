"""Decode and writer benchmarks: ``python -m benchmarks.decode [--quick | --full | --preset NAME]``.

Per point, every provider is first checked against :mod:`kvattn.reference` (poisoned output buffer,
NaN in every slot it must not read), then timed: interleaved repeats of a median measurement, in
eager mode (``triton.testing.do_bench``) and, on a GPU, from a CUDA graph that runs the call once on
every rotation set. Results go to ``<out-dir>/<date>_<device>_<commit>/``: ``decode.csv``,
``writer.csv``, ``run.json``, ``summary.md`` and PNG plots when matplotlib is importable.
``benchmarks/results/README.md`` says how each figure is obtained.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kvattn

from .common import (
    DTYPES,
    VARIANTS,
    Device,
    GraphTimer,
    Point,
    TimingConfig,
    bandwidth_columns,
    bytes_moved,
    check_and_measure,
    check_provider,
    make_decode_inputs,
    reference_output,
    rotation_sets,
    spread_pct,
    time_eager,
)
from .outputs import write_outputs
from .sweep import HEADLINE_PRESETS, Sweep, exit_code, parse_args

CHECK_ROWS = 4  # sequences compared with the reference per checked set


def _grid(batches, contexts, pages=(16,), heads=((32, 8),), dims=(128,), dtypes=("bf16",)):
    return [
        Point(b, c, p, h, kv, d, t)
        for t, d, (h, kv), p, b, c in itertools.product(
            dtypes, dims, heads, pages, batches, contexts
        )
    ]


def variant_points(batch: int, context: int, **shape) -> list[Point]:
    """One point per attention variant (checked vs unchecked on the same kernel switch), and one
    with a V head dim of its own (DeepSeek's 192-dim keys, 128-dim values)."""
    base = dict(page_size=16, num_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16")
    base.update(shape)
    return [Point(batch, context, variant=v, **base) for v in VARIANTS if v != "plain"] + [
        Point(batch, context, **dict(base, head_dim=192, head_dim_v=128))
    ]


def preset_points(name: str) -> list[Point]:
    """The sweeps. ``gpu-suite`` is ordered by importance (the target region first), so a run
    stopped by its time budget keeps the points that matter most; the variant rows come last.
    ``headline``: the goals' points alone (batch 16 and 64 at 8K and 32K, batch 1 at 4K and 32K),
    which the GPU suite times first."""
    if name == "headline":
        return _grid([16, 64], [8192, 32768]) + _grid([1], [4096, 32768])
    if name == "cpu-tiny":
        return [
            Point(1, 64, 16, 8, 2, 64, "fp16"),
            Point(2, 100, 16, 8, 2, 32, "fp16"),
            Point(1, 48, 16, 4, 4, 32, "bf16"),
            Point(1, 40, 1, 8, 2, 32, "fp16"),
            # A window at a context past it (pages before the window neither read nor counted);
            # the other variants' CPU cases are in tests/benchmarks/test_benchmarks_smoke.py.
            Point(1, 160, 16, 4, 2, 16, "fp16", "window128"),
            Point(1, 40, 16, 4, 2, 32, "fp16", head_dim_v=16),
        ]
    if name == "gpu-suite":
        return (
            _grid([16, 64], [8192, 32768])
            + _grid([16], [4096, 131072])
            + _grid([1], [4096, 32768])
            + _grid([16], [1024])
            + _grid([256], [4096])
            + _grid([64], [32768], dtypes=("fp16",))
            + _grid([16], [8192], pages=(1, 64))
            + _grid([16], [8192], heads=((64, 8), (32, 32)))
            + _grid([16], [8192], dims=(64, 256))
            + _grid([16], [8192], dtypes=("fp16",))
            + variant_points(16, 32768)
        )
    if name == "full":
        main = _grid(
            [1, 4, 16, 64, 256],
            [1024, 4096, 16384, 65536, 131072],
            pages=(1, 16, 64),
            heads=((32, 8), (64, 8), (32, 32)),
            dtypes=("fp16", "bf16"),
        )
        extra = _grid([1, 16, 64], [4096, 32768], dims=(64, 256), dtypes=("fp16", "bf16"))
        return main + extra + variant_points(16, 32768) + variant_points(64, 131072)
    raise ValueError(f"--preset: expected one of {HEADLINE_PRESETS}, got {name!r}")


@dataclass(frozen=True)
class WriterPoint:
    """``tokens`` new tokens written by ``write_kv``: ``append`` = one token for each of ``tokens``
    sequences (decode), ``chunk`` = one sequence's consecutive tokens (prefill)."""

    tokens: int
    pattern: str
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


def writer_points(preset: str) -> list[WriterPoint]:
    if preset == "headline":
        return []
    if preset == "cpu-tiny":
        return [
            WriterPoint(8, "append", 16, 2, 64, "fp16"),
            WriterPoint(64, "chunk", 16, 2, 64, "fp16"),
        ]
    tokens = [16, 256, 4096] if preset == "gpu-suite" else [1, 16, 64, 256, 1024, 4096, 16384]
    return [WriterPoint(t, pat, 16, 8, 128, "bf16") for pat in ("append", "chunk") for t in tokens]


def estimate_point_seconds(
    p: Point,
    providers: int,
    cfg: TimingConfig,
    device: Device,
    copy_tbps: float = 4.0,
    call_s: float | None = None,
) -> float:
    """Wall-time estimate of one GPU point, documented in benchmarks/results/README.md: filling the
    pool (~0.3 TB/s for randn), one reference check, and per measurement do_bench's budgets (at
    least one call each) plus its first five calls, doubled for host overhead; one kernel compile
    (~2 s) per kvattn variant. ``call_s``: one call's time (default: the checked decode's bytes at
    ``copy_tbps``)."""
    sets = rotation_sets(p, device.l2_bytes)
    if call_s is None:
        call_s = bytes_moved(p, True)["total"] / (copy_tbps * 1e12)
    fill_s = 2 * sets * p.kv_set_bytes() * 1.25 / 0.3e12
    per_measurement = 2 * (
        max(cfg.warmup_ms / 1e3, call_s) + max(cfg.rep_ms / 1e3, call_s) + 5 * call_s
    )
    measurements = providers * cfg.repeats * (2 if cfg.graphs else 1)
    return 1.0 + fill_s + measurements * per_measurement + 2 * 2.0


def run_point(
    p: Point,
    providers,
    device: Device,
    cfg: TimingConfig,
    copy_tbps: float,
    log,
    deadline: float | None = None,
) -> list[dict]:
    dev = device.torch_device
    sets = rotation_sets(p, device.l2_bytes) if device.is_gpu else 2
    inp = make_decode_inputs(p, dev, sets, seed=zlib.crc32(p.label().encode()))
    rows_ref = min(p.batch, CHECK_ROWS)
    refs = {i: reference_output(inp, i, rows_ref) for i in sorted({0, sets - 1})}
    base = dict(asdict(p), sets=sets, pool_bytes=inp.pool_bytes())
    return check_and_measure(
        providers,
        inp,
        lambda run, out_buf: check_provider(run, out_buf, refs, p.dtype, p.pages_checked),
        base,
        device,
        cfg,
        lambda prov, med: bandwidth_columns(bytes_moved(p, prov.checked), med, copy_tbps),
        log,
        deadline,
    )


def make_writer(w: WriterPoint, dev: torch.device) -> dict:
    """Pool, tags and new tokens of a writer point; ``stamped`` is ``kvattn.write_kv`` (scatter,
    then stamp the tags), ``unstamped`` the same scatter (index math and two ``index_put_``) alone."""
    dtype = DTYPES[w.dtype]
    gen = torch.Generator(device=dev).manual_seed(w.tokens)
    num_pages = 4 * w.tokens
    shape = (num_pages, w.page_size, w.num_kv_heads, w.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    tags = torch.zeros(num_pages, dtype=torch.int64, device=dev)
    perm = torch.randperm(num_pages, generator=gen, device=dev)
    if w.pattern == "append":
        pages = perm[: w.tokens]
        slots = torch.randint(0, w.page_size, (w.tokens,), generator=gen, device=dev)
        owners = torch.arange(1, w.tokens + 1, device=dev)
        kvattn.reserve_pages(tags, pages, owners)
        kvattn.commit_pages(
            tags, pages, owners, slots, w.page_size
        )  # the append extends the prefix
    else:
        n = -(-w.tokens // w.page_size)
        pages = perm[:n].repeat_interleave(w.page_size)[: w.tokens]
        slots = torch.arange(w.tokens, device=dev) % w.page_size
        owners = torch.ones(w.tokens, dtype=torch.int64, device=dev)
        kvattn.reserve_pages(tags, perm[:n], 1)
    slot_mapping = pages * w.page_size + slots
    k = torch.randn(w.tokens, w.num_kv_heads, w.head_dim, generator=gen, device=dev, dtype=dtype)
    v = torch.randn(w.tokens, w.num_kv_heads, w.head_dim, generator=gen, device=dev, dtype=dtype)

    def stamped():
        return kvattn.write_kv(k, v, k_cache, v_cache, slot_mapping, tags, owners)

    def unstamped():
        page = torch.div(slot_mapping, w.page_size, rounding_mode="floor")
        slot = slot_mapping - page * w.page_size
        k_cache.index_put_((page, slot), k)
        v_cache.index_put_((page, slot), v)

    return dict(
        stamped=stamped,
        unstamped=unstamped,
        pages=pages,
        slots=slots,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
    )


def run_writer(w: WriterPoint, device: Device, cfg: TimingConfig, copy_tbps: float) -> list[dict]:
    """Times the stamped write against the unstamped one, after checking both write every token."""
    dev = device.torch_device
    dtype = DTYPES[w.dtype]
    m = make_writer(w, dev)
    stamped, unstamped, pages, slots = m["stamped"], m["unstamped"], m["pages"], m["slots"]
    k, v, k_cache, v_cache = m["k"], m["v"], m["k_cache"], m["v_cache"]
    result = stamped()
    base = dict(asdict(w))
    if int(result.dropped) != 0 or not torch.equal(k_cache[pages, slots], k):
        return [
            dict(base, provider="kvattn-write_kv", status="failed: tokens dropped or not written")
        ]
    k_cache[pages, slots] = float("nan")
    unstamped()
    if not torch.equal(v_cache[pages, slots], v) or not torch.equal(k_cache[pages, slots], k):
        return [dict(base, provider="index_put", status="failed: tokens not written")]
    elt = torch.finfo(dtype).bits // 8
    kv = 2 * 2 * w.tokens * w.num_kv_heads * w.head_dim * elt  # new K/V read, pool slots written
    fns = {
        "kvattn-write_kv": (stamped, kv + 8 * w.tokens + 2 * 8 * w.tokens),
        "index_put": (unstamped, kv + 8 * w.tokens),
    }
    modes = {"eager": {n: (lambda f=f: time_eager(f, dev, cfg)) for n, (f, _) in fns.items()}}
    if device.is_gpu and cfg.graphs:
        modes["graph"] = {}
        for n, (f, _) in fns.items():
            try:
                modes["graph"][n] = GraphTimer(lambda i, f=f: f(), 1, dev).time
            except Exception as e:  # capture is not supported by every op
                modes["graph"][n] = e
    rows = []
    for mode, timers in modes.items():
        label = mode if device.is_gpu else "cpu"
        times = {n: [] for n, t in timers.items() if not isinstance(t, Exception)}
        for r in range(cfg.repeats):
            for n in list(times) if r % 2 == 0 else list(reversed(times)):
                times[n].append(timers[n]() if mode == "eager" else timers[n](cfg))
        for n, t in timers.items():
            if isinstance(t, Exception):
                rows.append(
                    dict(base, provider=n, mode=label, status=f"failed: graph capture: {t}"[:300])
                )
        for n, ts in times.items():
            med = statistics.median(ts)
            tbps = fns[n][1] / (med * 1e-3) / 1e12
            rows.append(
                dict(
                    base,
                    provider=n,
                    mode=label,
                    status="ok",
                    median_ms=med,
                    spread_pct=spread_pct(ts),
                    total_bytes=fns[n][1],
                    tbps=tbps,
                    pct_copy_bw=100 * tbps / copy_tbps,
                    times_ms=ts,
                )
            )
        if "kvattn-write_kv" in times and "index_put" in times:
            ratios = [a / b for a, b in zip(times["kvattn-write_kv"], times["index_put"])]
            stamped_row = next(
                r
                for r in rows
                if r["provider"] == "kvattn-write_kv" and r["mode"] == label and r["status"] == "ok"
            )
            stamped_row.update(
                ratio_vs_unstamped=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
            )
    return rows


def run(args) -> tuple[Path, int]:
    """The sweep; returns its run folder and the exit code (1 when a kvattn provider failed)."""
    sweep = Sweep.start(args, preset_points, "decode")
    sweep.run_dir.mkdir(parents=True, exist_ok=True)
    device, cfg = sweep.device, sweep.cfg

    def estimate(p: Point) -> float:
        return estimate_point_seconds(p, len(sweep.providers) - 1, cfg, device)

    copy = sweep.begin("kvattn benchmarks", "decode", estimate)
    decode_rows, skipped = sweep.run_points(
        lambda p: run_point(
            p, sweep.providers, device, cfg, copy["tbps"], sweep.log, sweep.deadline
        ),
        estimate,
    )
    writer_rows = []
    for w in writer_points(sweep.preset):
        if sweep.budget_s and sweep.elapsed() > sweep.budget_s:
            skipped.append({"point": f"writer {w}", "reason": "time budget"})
            continue
        writer_rows += run_writer(w, device, cfg, copy["tbps"])
    code = exit_code(sweep, decode_rows)
    write_outputs(
        sweep.run_dir,
        sweep.meta(copy, skipped),
        decode_rows,
        writer_rows,
        sweep.log_lines,
        plots=not args.no_plots,
    )
    return sweep.finish(), code


def main(argv=None) -> int:
    return run(parse_args("python -m benchmarks.decode", __doc__, argv, HEADLINE_PRESETS))[1]


if __name__ == "__main__":
    sys.exit(main())

"""pytest-benchmark cases for the decode providers and the writer (``python -m pytest
benchmarks/test_bench_decode.py``; ``--benchmark-json=FILE`` keeps the numbers).

Each case first checks the provider against the reference, exactly as the sweep does, then lets
pytest-benchmark time it (host clock around a synchronised call: it includes launch overhead, so the
sweep's device-event figures are the ones to quote). Nothing here asserts a time.
"""

import itertools

import pytest
import torch

from benchmarks import common, decode, providers
from benchmarks.common import VARIANTS, Device, Point

DEVICE = Device.current()
# Every attention variant and a V head dim of its own, checked and unchecked, after the plain
# points.
POINTS = (
    [
        Point(16, 8192, 16, 32, 8, 128, "bf16"),
        Point(64, 32768, 16, 32, 8, 128, "bf16"),
        Point(1, 32768, 16, 32, 8, 128, "bf16"),
    ]
    + decode.variant_points(16, 32768)
    if DEVICE.is_gpu
    else [Point(1, 40, 16, 4, 2, 32, "fp16")]
    + [
        Point(1, 160 if v.startswith("window") else 40, 16, 4, 2, 32, "fp16", v)
        for v in VARIANTS
        if v != "plain"
    ]
    + [Point(1, 40, 16, 4, 2, 32, "fp16", head_dim_v=16)]
)
PROVIDERS = providers.all_providers()


@pytest.fixture(scope="module", params=POINTS, ids=lambda p: p.label())
def inputs(request):
    p = request.param
    sets = common.rotation_sets(p, DEVICE.l2_bytes) if DEVICE.is_gpu else 2
    inp = common.make_decode_inputs(p, DEVICE.torch_device, sets)
    refs = {
        i: common.reference_output(inp, i, min(p.batch, decode.CHECK_ROWS)) for i in {0, sets - 1}
    }
    yield inp, refs
    del inp
    if DEVICE.is_gpu:
        torch.cuda.empty_cache()


@pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)
def test_decode(benchmark, inputs, provider):
    inp, refs = inputs
    reason = provider.why_not(inp)
    if reason is not None:
        pytest.skip(reason)
    run, out = provider.build(inp)
    err = common.check_provider(run, out, refs, inp.point.dtype, inp.point.pages_checked)
    benchmark.extra_info.update(
        max_abs_err=err,
        total_bytes=common.bytes_moved(inp.point, provider.checked)["total"],
        gpu_measurement=DEVICE.is_gpu,
    )
    counter = itertools.count()

    def call():
        run(next(counter) % inp.sets)
        common.synchronize(DEVICE.torch_device)

    benchmark.pedantic(
        call, rounds=20 if DEVICE.is_gpu else 2, warmup_rounds=2 if DEVICE.is_gpu else 0
    )


@pytest.mark.parametrize("pattern", ["append", "chunk"])
def test_write_kv(benchmark, pattern):
    w = decode.WriterPoint(
        256 if DEVICE.is_gpu else 8,
        pattern,
        16,
        8 if DEVICE.is_gpu else 2,
        128 if DEVICE.is_gpu else 32,
        "bf16" if DEVICE.is_gpu else "fp16",
    )
    cfg = common.TimingConfig(cpu_runs=1, repeats=1, graphs=False)
    rows = decode.run_writer(w, DEVICE, cfg, copy_tbps=1.0)  # checks that every token lands
    assert all(r["status"] == "ok" for r in rows), rows
    stamped = decode.make_writer(w, DEVICE.torch_device)["stamped"]

    def call():
        stamped()
        common.synchronize(DEVICE.torch_device)

    benchmark.pedantic(call, rounds=20 if DEVICE.is_gpu else 2, warmup_rounds=1)

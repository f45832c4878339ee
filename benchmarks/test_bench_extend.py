"""pytest-benchmark cases for the extend providers (``python -m pytest benchmarks/test_bench_extend.py``;
``--benchmark-json=FILE`` keeps the numbers).

Each case first checks the provider against ``kvattn.reference.paged_extend``, exactly as the sweep
does, then lets pytest-benchmark time it (host clock around a synchronised call, launch overhead
included: the sweep's device-event figures are the ones to quote). Nothing here asserts a time.
"""

import itertools

import pytest
import torch

from benchmarks import common, extend, providers
from benchmarks.common import EXTEND_VARIANTS, VARIANTS, Device, ExtendPoint

DEVICE = Device.current()
# Every attention variant and a V head dim of its own, checked and unchecked, after the plain
# points.
POINTS = (
    [
        ExtendPoint(8, 2048, 8192, 16, 32, 8, 128, "bf16"),
        ExtendPoint(1, 4096, 0, 16, 32, 8, 128, "bf16"),
        ExtendPoint(32, 128, 4096, 16, 32, 8, 128, "bf16"),
    ]
    + extend.variant_points(8, 512, 32768)
    if DEVICE.is_gpu
    else [ExtendPoint(1, 8, 12, 16, 4, 2, 32, "fp16")]
    + [
        ExtendPoint(1, 8, 150 if v.startswith("window") else 12, 16, 4, 2, 32, "fp16", v)
        for v in (*VARIANTS, *EXTEND_VARIANTS)
        if v != "plain"
    ]
    + [ExtendPoint(1, 8, 12, 16, 4, 2, 32, "fp16", head_dim_v=16)]
)
PROVIDERS = providers.all_providers("extend")


@pytest.fixture(scope="module", params=POINTS, ids=lambda p: p.label())
def inputs(request):
    p = request.param
    sets = common.rotation_sets(p.pool_point(), DEVICE.l2_bytes) if DEVICE.is_gpu else 2
    inp = common.make_extend_inputs(p, DEVICE.torch_device, sets)
    picks = common.extend_check_rows(p, extend.CHECK_SEQS)
    rows = torch.tensor([b * p.chunk + j for b, j in picks], device=DEVICE.torch_device)
    refs = {i: common.extend_reference(inp, i, picks) for i in {0, sets - 1}}
    yield inp, refs, rows
    del inp
    if DEVICE.is_gpu:
        torch.cuda.empty_cache()


@pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)
def test_extend(benchmark, inputs, provider):
    inp, refs, rows = inputs
    p = inp.point
    reason = provider.why_not(inp)
    if reason is not None:
        pytest.skip(reason)
    run, out = provider.build(inp)
    err = common.check_provider(run, out, refs, p.dtype, p.pages_checked, rows)
    benchmark.extra_info.update(
        max_abs_err=err,
        flops=p.flops(),
        total_bytes=common.bytes_moved(p.pool_point(), provider.checked, p.q_tokens)["total"],
        gpu_measurement=DEVICE.is_gpu,
    )
    counter = itertools.count()

    def call():
        run(next(counter) % inp.sets)
        common.synchronize(DEVICE.torch_device)

    benchmark.pedantic(
        call, rounds=20 if DEVICE.is_gpu else 2, warmup_rounds=2 if DEVICE.is_gpu else 0
    )

"""Three Triton kernels for Nsight Compute: ``ncu --profile-from-start off ... python -m
benchmarks.ncu_kernels``.

The decode checked and unchecked at batch 16 x 8K and the checked extend of a 512-token chunk over
8K (bf16, 32/8 heads, head dim 128, page 16: headline points), each called once between
``cudaProfilerStart`` and ``cudaProfilerStop`` inside an NVTX range that names it, after a warm-up
call outside (the compile), so that ncu profiles those launches alone (``--nvtx`` shows the range
of each kernel). ``benchmarks/gpu_suite.sh`` runs it under the speed-of-light and warp-state
sections. Without a GPU it runs the same calls on tiny CPU points through the interpreter (no
profiler), to show it works.
"""

from __future__ import annotations

import sys

import torch

import kvattn  # noqa: E402

from .common import ExtendPoint, Point, make_decode_inputs, make_extend_inputs, synchronize


def calls(gpu: bool) -> list[tuple[str, object]]:
    dev = torch.device("cuda" if gpu else "cpu")
    p = Point(16, 8192, 16, 32, 8, 128, "bf16") if gpu else Point(1, 64, 16, 4, 2, 32, "fp16")
    e = (
        ExtendPoint(1, 512, 8192, 16, 32, 8, 128, "bf16")
        if gpu
        else ExtendPoint(1, 16, 32, 16, 4, 2, 32, "fp16")
    )
    d_inp = make_decode_inputs(p, dev, 1, seed=1)
    e_inp = make_extend_inputs(e, dev, 1, seed=2)
    d_out, e_out = d_inp.new_out(), e_inp.new_out()

    def decode(check):
        return lambda: kvattn.paged_decode(
            *d_inp.args(0), scale=d_inp.scale, check=check, backend="triton", out=d_out
        )

    def extend():
        return kvattn.paged_extend(
            *e_inp.args(0), scale=e_inp.scale, check=True, backend="triton", out=e_out
        )

    return [
        (f"decode-checked {p.label()}", decode(True)),
        (f"decode-unchecked {p.label()}", decode(False)),
        (f"extend-checked {e.label()}", extend),
    ]


def main() -> int:
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    todo = calls(gpu)
    for _, fn in todo:
        fn()  # compile outside the profiled range
    synchronize(dev)
    for name, fn in todo:
        if gpu:
            torch.cuda.nvtx.range_push(name)
            torch.cuda.profiler.start()
        fn()
        synchronize(dev)
        if gpu:
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
        print(f"{'profiled' if gpu else 'ran (no GPU, no profiler)'}: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ownership check's cost on this machine's CPU: kvattn's compiled CPU decode (the ``cpu``
backend) checked, unchecked and through a verdict, in one run, beside the PyTorch-ops readers
(``torch``). A script, not a test: the figures belong to the machine it runs on.

    python -m benchmarks.cpu_decode [--repeats 21] [--markdown FILE]

Shapes: SmolLM-135M's attention as vLLM's CPU tests run it (9 query heads over 3 KV heads of 64,
32-token pages, float32) at the batches and lengths of ``make vllm-speed``, and a Llama-8B-like
layer (32 over 8 heads of 128, 16-token pages, bfloat16) at batch 1 and 8 of 4K. Each call on one
thread (the compiled decode runs on the caller's); the verdict is resolved once per shape, outside
the timing, as an engine resolves it once per forward for all its layers. Median of the repeats,
the variants interleaved in a shuffled order in each repeat.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import subprocess
import time

import torch

import kvattn

SHAPES = [
    # (label, batch, seq_len, heads, kv_heads, head_dim, page, dtype)
    ("SmolLM-135M, batch 4 x 288", 4, 288, 9, 3, 64, 32, torch.float32),
    ("SmolLM-135M, batch 16 x 1040", 16, 1040, 9, 3, 64, 32, torch.float32),
    ("Llama-8B layer, batch 1 x 4096", 1, 4096, 32, 8, 128, 16, torch.bfloat16),
    ("Llama-8B layer, batch 8 x 4096", 8, 4096, 32, 8, 128, 16, torch.bfloat16),
]
VARIANTS = ("cpu unchecked", "cpu checked", "cpu verdict", "torch checked")


def inputs(batch, seq_len, heads, kv_heads, head_dim, page, dtype, seed=0):
    """A shuffled pool whose pages are WRITTEN for owners 1..batch up to ``seq_len``."""
    g = torch.Generator().manual_seed(seed)
    per = -(-seq_len // page)
    num_pages = 2 * batch * per + 8
    k = torch.randn(num_pages, page, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_pages, page, kv_heads, head_dim, generator=g).to(dtype)
    tags = torch.zeros(num_pages, dtype=torch.int64)
    perm = torch.randperm(num_pages, generator=g)[: batch * per].view(batch, per)
    for b in range(batch):
        for i in range(per):
            tags[perm[b, i]] = kvattn.written_tag(b + 1, min(page, seq_len - i * page))
    table = perm.to(torch.int32).contiguous()
    lens = torch.full((batch,), seq_len, dtype=torch.int32)
    expected = torch.arange(1, batch + 1, dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, k, v, table, lens, tags, expected


def measure(shape, repeats: int) -> dict:
    label, *dims = shape
    q, k, v, table, lens, tags, expected = inputs(*dims)
    verdict = kvattn.resolve_pages(table, lens, tags, expected, page_size=k.shape[1])
    calls = {
        "cpu unchecked": dict(backend="cpu", check=False),
        "cpu checked": dict(backend="cpu"),
        "cpu verdict": dict(backend="cpu", verdict=verdict),
        "torch checked": dict(backend="torch"),
    }
    out = torch.empty_like(q)
    samples = {name: [] for name in calls}
    for kwargs in calls.values():  # warm
        kvattn.paged_decode(q, k, v, table, lens, tags, expected, out=out, **kwargs)
    order = list(calls.items())
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)  # no variant always follows the one that last evicted the caches
        for name, kwargs in order:
            start = time.perf_counter()
            kvattn.paged_decode(q, k, v, table, lens, tags, expected, out=out, **kwargs)
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    return dict(label=label, **medians)


def markdown(rows: list[dict], repeats: int) -> str:
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# The check's cost on the CPU: kvattn's compiled CPU decode (not a GPU measurement)",
        "",
        f"`python -m benchmarks.cpu_decode`, {when}, commit {commit}, {cpu}, one thread, torch "
        f"{torch.__version__}; ms per call, median of {repeats} interleaved repeats; in brackets "
        "the time over the unchecked call.",
        "",
        "| shape | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    for r in rows:
        base = r["cpu unchecked"]
        cells = [f"{base:.3f}"] + [f"{r[v]:.3f} ({r[v] / base:.3f}x)" for v in VARIANTS[1:]]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes")
    parser.add_argument("--markdown", help="write the table here as well")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    text = markdown([measure(s, args.repeats) for s in SHAPES[: args.shapes]], args.repeats)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

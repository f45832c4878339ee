"""CPU time of the torch backend's readers against the reference at vLLM-like shapes (SmolLM-135M's
9 query heads, 3 KV heads, head dim 64; 32-token pages; float32; a block table as wide as a
2048-token max_model_len). A script, not a test: the figures belong to the machine it runs on.

    python -m benchmarks.torch_reader_speed [--repeat 5] [--threads N]

Each row: the median wall time of one call per backend and the ratio.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

# This checkout's kvattn also when run by path (python benchmarks/torch_reader_speed.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import kvattn  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE, TABLE = 9, 3, 64, 32, 64


def pool(lens, seed=0):
    """Pages of ``lens`` sequences (owners 1..B) in a shuffled pool, tags WRITTEN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    num_pages = 2 * sum(need) + 8
    k = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g)
    v = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g)
    tags = torch.zeros(num_pages, dtype=torch.int64)
    table = torch.zeros(len(lens), TABLE, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    for b, (n, c) in enumerate(zip(lens, need)):
        for i in range(c):
            p = perm.pop()
            table[b, i] = p
            tags[p] = kvattn.written_tag(b + 1, min(PAGE, n - i * PAGE))
    expected = torch.arange(1, len(lens) + 1, dtype=torch.int64)
    return k, v, table, torch.tensor(lens, dtype=torch.int32), tags, expected


def timed(fn, repeat):
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{HEADS} heads / {KV_HEADS} KV heads x {DIM}, page {PAGE}, table {TABLE} pages, float32"
    )
    cases = []
    for lens in ([288] * 4, [1040] * 16, [40, 300, 900, 2000]):
        k, v, table, seq_lens, tags, expected = pool(lens)
        q = torch.randn(len(lens), HEADS, DIM)
        cases.append(
            (
                f"decode  batch {len(lens)}, seq_lens {sorted(set(lens))}",
                "paged_decode",
                (q, k, v, table, seq_lens, tags, expected),
            )
        )
    for q_lens, prefixes in (([256] * 4, [0] * 4), ([64] * 4, [448] * 4), ([1024], [0])):
        lens = [p + n for p, n in zip(prefixes, q_lens)]
        k, v, table, seq_lens, tags, expected = pool(lens)
        q = torch.randn(sum(q_lens), HEADS, DIM)
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        cases.append(
            (
                f"extend  q_lens {q_lens[0]} x {len(q_lens)}, prefix {prefixes[0]}",
                "paged_extend",
                (q, k, v, cu, table, seq_lens, tags, expected),
            )
        )
    print(f"  {'call':48s} {'reference':>10s} {'torch':>10s} {'ratio':>7s}")
    for label, op, inputs in cases:
        times = {
            name: timed(lambda: getattr(kvattn, op)(*inputs, backend=name), args.repeat)
            for name in ("reference", "torch")
        }
        print(
            f"  {label:48s} {times['reference'] * 1e3:8.2f} ms {times['torch'] * 1e3:8.2f} ms "
            f"{times['reference'] / times['torch']:6.1f}x"
        )


if __name__ == "__main__":
    main()

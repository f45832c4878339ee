"""The checked receive's cost (kvattn.transfer) on this machine's CPU, side by side with a plain copy
of the same bytes, in one run.

    python -m benchmarks.transfer_digest [--markdown FILE] [--layers N] [--pages N] [--repeats N]

A Llama-8B-like page (32 layers, 8 KV heads of 128, bfloat16, 16-token pages: 64 KiB of K and V per
layer, 2 MiB per page over the layers) by default. For 1 thread and for every core, per pass over
all pages: a copy of their bytes (``index_select`` into a host buffer with that many torch threads:
the memory bandwidth the digest is held against), each hash alone over the same bytes spread over
that many threads (BLAKE2b, the digest before BLAKE3; BLAKE3, the digest; XXH3-128 where the
``xxhash`` package is installed, a non-cryptographic reference), then kvattn's own calls
(``attest_pages``, ``verify_arrived``, ``verify_arrived_async``) with
``set_digest_threads(threads)``. Host clock, median of ``--repeats``; no time is asserted anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvattn import transfer, written_tag

try:
    import blake3
except ImportError:
    blake3 = None
try:
    import xxhash
except ImportError:
    xxhash = None


def _median_s(fn, repeats: int) -> float:
    fn()  # warm: thread pools, first touch of the buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _spread(executor, threads: int, items: list, work) -> None:
    chunks = [items[i::threads] for i in range(threads)]
    if threads == 1:
        work(chunks[0])
    else:
        list(executor.map(work, chunks))


def measure(layers, pages, page_size, kv_heads, head_dim, repeats, threads) -> dict:
    shape = (pages, page_size, kv_heads, head_dim)
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    pools = [p for pair in zip(k, v) for p in pair]
    tags = torch.full((layers, pages), written_tag(1, page_size))
    ids = list(range(pages))
    nbytes = 2 * layers * pages * page_size * kv_heads * head_dim * 2
    index = torch.tensor(ids)
    copies = [torch.empty_like(p) for p in pools]
    views = [[p[i].reshape(-1).view(torch.uint8).numpy() for p in pools] for i in ids]

    def copy():
        for pool, out in zip(pools, copies):
            torch.index_select(pool, 0, index, out=out)

    def hash_alone(new):
        def work(chunk):
            for page in chunk:
                h = new()
                for view in views[page]:
                    h.update(view)
                h.digest()

        return work

    hashes = {
        "blake2b": lambda: hashlib.blake2b(digest_size=16),
        "blake3": blake3.blake3 if blake3 else None,
        "xxh3_128": xxhash.xxh3_128 if xxhash else None,
    }
    row = dict(threads=threads)
    torch.set_num_threads(threads)
    row["memcpy"] = _median_s(copy, repeats)
    transfer.set_digest_threads(threads)
    with ThreadPoolExecutor(threads) as executor:
        for name, new in hashes.items():
            if new is not None:
                work = hash_alone(new)
                row[name] = _median_s(lambda w=work: _spread(executor, threads, ids, w), repeats)
    claims = transfer.attest_pages(tags, 1, ids, k, v)
    row["attest"] = _median_s(lambda: transfer.attest_pages(tags, 1, ids, k, v), repeats)
    row["verify"] = _median_s(lambda: transfer.verify_arrived(claims, ids, k, v), repeats)
    row["verify_async"] = _median_s(
        lambda: transfer.verify_arrived_async(claims, ids, k, v).result(), repeats
    )
    lens, _ = transfer.verify_arrived(claims, ids, k, v)
    assert lens == [page_size] * pages
    gb = nbytes / 1e9
    return {key: (gb / value if key != "threads" else value) for key, value in row.items()}


COLUMNS = [
    ("memcpy", "copy of the same bytes"),
    ("blake2b", "BLAKE2b alone"),
    ("blake3", "BLAKE3 alone"),
    ("xxh3_128", "XXH3-128 alone"),
    ("attest", "`attest_pages`"),
    ("verify", "`verify_arrived`"),
    ("verify_async", "`verify_arrived_async`"),
]


def markdown(rows: list[dict], shape: str, gb: float) -> str:
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    columns = [(key, label) for key, label in COLUMNS if key in rows[0]]
    lines = [
        "# Checked receive: the transfer digest on the CPU (not a GPU measurement)",
        "",
        f"`python -m benchmarks.transfer_digest`, {when}, commit {commit}, {cpu}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, blake3 "
        f"{getattr(blake3, '__version__', 'absent')}.",
        "",
        f"{shape}: {gb:.3f} GB per pass; GB/s, median of the passes; in brackets the share of the "
        "copy of the same bytes with as many threads.",
        "",
        "| threads | " + " | ".join(label for _, label in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [f"{row['memcpy']:.2f}"] + [
            f"{row[key]:.2f} ({100 * row[key] / row['memcpy']:.0f}%)" for key, _ in columns[1:]
        ]
        lines.append(f"| {row['threads']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--markdown", help="write the table here as well")
    args = parser.parse_args(argv)
    geometry = (args.layers, args.pages, args.page_size, args.kv_heads, args.head_dim)
    counts = sorted({1, os.cpu_count() or 1})
    rows = [measure(*geometry, args.repeats, threads) for threads in counts]
    shape = (
        f"{args.layers} layers x {args.pages} pages of {args.page_size} tokens x "
        f"{args.kv_heads} KV heads x {args.head_dim} (bfloat16, K and V)"
    )
    text = markdown(
        rows,
        shape,
        2 * args.layers * args.pages * args.page_size * args.kv_heads * args.head_dim * 2 / 1e9,
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

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
import pathlib
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


def _median_device_s(fn, repeats: int, device: torch.device) -> float:
    def timed():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _median_s(timed, repeats)


def measure_keyed(layers, pages, page_size, kv_heads, head_dim, repeats, device) -> dict:
    """The keyed digest where the pages lie (``device``), beside a copy of the same bytes on that
    device: the NH kernel alone (on a GPU; on a CPU the compiled NH, or NumPy's where the CPU
    module is not built), then kvattn's keyed ``attest_pages`` and
    ``verify_arrived`` (kernel, the 32 bytes per page to the host, BLAKE3 there), and the keyless
    BLAKE3 calls, which stage device pools on the host."""
    shape = (pages, page_size, kv_heads, head_dim)
    g = torch.Generator(device=device).manual_seed(0)
    k = [torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in range(layers)]
    pools = [p for pair in zip(k, v) for p in pair]
    tags = torch.full((layers, pages), written_tag(1, page_size), device=device)
    ids = list(range(pages))
    index = torch.tensor(ids, device=device)
    copies = [torch.empty_like(p) for p in pools]
    key = transfer.DigestKey.new()

    def copy():
        for pool, out in zip(pools, copies):
            torch.index_select(pool, 0, index, out=out)

    row = dict(device=str(device))
    row["copy"] = _median_device_s(copy, repeats, device)
    if device.type == "cuda":
        from kvattn.backends.triton import digest

        words = key.words(digest.key_words(pools), device)
        lens = torch.full((pages,), page_size, device=device)
        row["nh_kernel"] = _median_device_s(
            lambda: digest.nh(pools, index, lens, words), repeats, device
        )
    else:
        from kvattn.backends.triton import digest

        words = key.words(digest.key_words(pools), device)
        lens = [page_size] * pages
        row["nh_kernel"] = _median_s(lambda: transfer._nh_cpu(pools, ids, lens, words), repeats)
    claims = transfer.attest_pages(tags, 1, ids, k, v, key=key)
    row["attest_keyed"] = _median_s(
        lambda: transfer.attest_pages(tags, 1, ids, k, v, key=key), repeats
    )
    row["verify_keyed"] = _median_s(
        lambda: transfer.verify_arrived(claims, ids, k, v, key=key), repeats
    )
    lens_ok, _ = transfer.verify_arrived(claims, ids, k, v, key=key)
    assert lens_ok == [page_size] * pages
    row["attest_blake3"] = _median_s(lambda: transfer.attest_pages(tags, 1, ids, k, v), repeats)
    gb = 2 * layers * pages * page_size * kv_heads * head_dim * 2 / 1e9
    return {key_: (gb / value if key_ != "device" else value) for key_, value in row.items()}


KEYED_COLUMNS = [
    ("copy", "copy of the same bytes on the device"),
    ("nh_kernel", "NH alone"),
    ("attest_keyed", "`attest_pages(key=)`"),
    ("verify_keyed", "`verify_arrived(key=)`"),
    ("attest_blake3", "`attest_pages` (BLAKE3 on the host)"),
]


def keyed_markdown(row: dict, shape: str, gb: float) -> str:
    columns = [(key, label) for key, label in KEYED_COLUMNS if key in row]
    cells = [f"{row['copy']:.2f}"] + [
        f"{row[key]:.2f} ({100 * row[key] / row['copy']:.0f}%)" for key, _ in columns[1:]
    ]
    return "\n".join(
        [
            f"## The keyed digest on {row['device']} (GB/s; in brackets the share of the copy)",
            "",
            f"{shape}: {gb:.3f} GB per pass, median of the passes.",
            "",
            "| " + " | ".join(label for _, label in columns) + " |",
            "|" + "---|" * len(columns),
            "| " + " | ".join(cells) + " |",
            "",
        ]
    )


COLUMNS = [
    ("memcpy", "copy of the same bytes"),
    ("blake2b", "BLAKE2b alone"),
    ("blake3", "BLAKE3 alone"),
    ("xxh3_128", "XXH3-128 alone"),
    ("attest", "`attest_pages`"),
    ("verify", "`verify_arrived`"),
    ("verify_async", "`verify_arrived_async`"),
]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(rows: list[dict], shape: str, gb: float) -> str:
    commit = _commit()
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
    parser.add_argument(
        "--keyed",
        metavar="DEVICE",
        help="time the keyed digest with the pages on DEVICE (cuda, cpu) instead",
    )
    parser.add_argument("--out-dir", help="with --keyed: a run folder here, rows and summary")
    parser.add_argument("--stream", help="with --keyed: append each row, as a JSON line, here")
    args = parser.parse_args(argv)
    geometry = (args.layers, args.pages, args.page_size, args.kv_heads, args.head_dim)
    gb = 2 * args.layers * args.pages * args.page_size * args.kv_heads * args.head_dim * 2 / 1e9
    shape = (
        f"{args.layers} layers x {args.pages} pages of {args.page_size} tokens x "
        f"{args.kv_heads} KV heads x {args.head_dim} (bfloat16, K and V)"
    )
    if args.keyed:
        row = measure_keyed(*geometry, args.repeats, torch.device(args.keyed))
        text = keyed_markdown(row, shape, gb)
        rows = [
            dict(
                op="digest",
                unit="GB/s",
                **dict(zip(("layers", "pages", "page_size", "kv_heads", "head_dim"), geometry)),
                **row,
            )
        ]
        if args.out_dir:
            from .sweep import append_rows

            commit = _commit()
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
            name = os.environ.get("KVATTN_COMMIT", commit)
            device = row["device"].replace(":", "")
            if args.keyed.startswith("cuda") and torch.cuda.is_available():
                device = "-".join(torch.cuda.get_device_name().lower().split())
            run_dir = pathlib.Path(args.out_dir) / f"{stamp}_{device}_{name}_digest"
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.md").write_text(text)
            append_rows(run_dir / "rows.jsonl", rows)
            if args.stream:
                append_rows(pathlib.Path(args.stream), [dict(run=run_dir.name, **r) for r in rows])
    else:
        counts = sorted({1, os.cpu_count() or 1})
        text = markdown([measure(*geometry, args.repeats, n) for n in counts], shape, gb)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

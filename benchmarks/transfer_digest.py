"""The checked receive's cost (kvattn.transfer): how long the sender's attestation and the
receiver's verification take per GB of KV, on this machine's CPU (where the digest runs).

    python -m benchmarks.transfer_digest [--markdown FILE] [--layers N] [--pages N] [--repeats N]

A Llama-8B-like page (32 layers, 8 KV heads of 128, bfloat16, 16-token pages: 64 KiB of K and V per
layer, 2 MiB per page over the layers) by default. Host clock, median of ``--repeats``; no time is
asserted anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time

import torch

from kvattn import written_tag
from kvattn.transfer import attest_pages, verify_arrived


def measure(
    layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, repeats: int
) -> dict:
    shape = (pages, page_size, kv_heads, head_dim)
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    tags = torch.full((layers, pages), written_tag(1, page_size))
    ids = list(range(pages))
    nbytes = 2 * layers * pages * page_size * kv_heads * head_dim * 2
    attest_s, verify_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        claims = attest_pages(tags, 1, ids, k, v)
        attest_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        lens, _ = verify_arrived(claims, ids, k, v)
        verify_s.append(time.perf_counter() - start)
        assert lens == [page_size] * pages
    gb = nbytes / 1e9
    return dict(
        layers=layers,
        pages=pages,
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        bytes=nbytes,
        attest_s_per_gb=statistics.median(attest_s) / gb,
        verify_s_per_gb=statistics.median(verify_s) / gb,
    )


def markdown(row: dict) -> str:
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
    return "\n".join(
        [
            "# Checked receive: digest cost on CPU (not a GPU measurement)",
            "",
            f"`python -m benchmarks.transfer_digest`, {when}, commit {commit}, "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}.",
            "",
            f"{row['layers']} layers x {row['pages']} pages of {row['page_size']} tokens x "
            f"{row['kv_heads']} KV heads x {row['head_dim']} (bfloat16, K and V): "
            f"{row['bytes'] / 1e9:.3f} GB per pass, median of the passes.",
            "",
            "| step | seconds per GB | GB per second |",
            "| --- | --- | --- |",
            f"| sender: `attest_pages` (tags + digest) | {row['attest_s_per_gb']:.3f} | "
            f"{1 / row['attest_s_per_gb']:.2f} |",
            f"| receiver: `verify_arrived` (digest + compare) | {row['verify_s_per_gb']:.3f} | "
            f"{1 / row['verify_s_per_gb']:.2f} |",
            "",
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", help="write the table here as well")
    args = parser.parse_args(argv)
    row = measure(
        args.layers, args.pages, args.page_size, args.kv_heads, args.head_dim, args.repeats
    )
    text = markdown(row)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

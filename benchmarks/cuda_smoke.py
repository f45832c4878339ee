"""Every CUDA kernel instantiation once, on small inputs, against the reference:
``python -m benchmarks.cuda_smoke [--backend cuda|cuda_sim]``.

Meant to run under ``compute-sanitizer --tool memcheck`` (benchmarks/gpu_suite.sh): decode for each
padded head dim (64, 128, 256), both 16-bit dtypes and both variants, with one split and several
(the merge kernel), pages of 1 and 16 tokens, a refused page and an out-of-range entry in the
table; extend (the page pre-pass and the kernel) for the same; the stamping writer. Pools are
NaN-poisoned wherever a reader must not look. Exits 1 and names the case when an output or a
report differs from the reference. ``--backend cuda_sim`` runs the same cases on the CPU harness.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

import kvattn

TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


def pool(batch_lens, page, kv_heads, dim, dtype, device, seed):
    """Sequence b owns ceil(len / page) pages of a randomly permuted pool, WRITTEN for owner b + 1;
    everything else is NaN and FREE."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in batch_lens]
    num_pages = 3 * sum(pages_per) + 3
    k = torch.full((num_pages, page, kv_heads, dim), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    tags = torch.zeros(num_pages, dtype=torch.int64)
    table = torch.zeros(len(batch_lens), max(pages_per), dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    for b, (n, count) in enumerate(zip(batch_lens, pages_per)):
        for i in range(count):
            p = perm.pop()
            filled = min(page, n - i * page)
            k[p, :filled] = torch.randn(filled, kv_heads, dim, generator=g).to(dtype)
            v[p, :filled] = torch.randn(filled, kv_heads, dim, generator=g).to(dtype)
            tags[p] = kvattn.written_tag(b + 1, filled)
            table[b, i] = p
    expected = torch.arange(1, len(batch_lens) + 1, dtype=torch.int64)
    to = dict(device=device)
    return (
        k.to(**to),
        v.to(**to),
        table.to(**to),
        torch.tensor(batch_lens, dtype=torch.int32, device=device),
        tags.to(**to),
        expected.to(**to),
    )


def compare(name, out, ref, report, ref_report, dtype) -> list[str]:
    errors = []
    if not torch.isfinite(out).all():
        errors.append(f"{name}: NaN in the output")
    elif float((out.float().cpu() - ref.float().cpu()).abs().max()) > TOL[dtype]:
        errors.append(
            f"{name}: max error {float((out.float().cpu() - ref.float().cpu()).abs().max()):.3g}"
        )
    if report is not None:
        for field in ("violations", "reasons", "pages_checked", "page_reasons", "beyond_table"):
            if not torch.equal(getattr(report, field).cpu(), getattr(ref_report, field).cpu()):
                errors.append(f"{name}: report field {field} differs")
    return errors


def run(backend: str) -> list[str]:
    device = torch.device("cpu" if backend == "cuda_sim" else "cuda")
    errors = []
    for dim, dtype, page, check in itertools.product(
        (64, 128, 256), (torch.float16, torch.bfloat16), (1, 16), (True, False)
    ):
        lens = [37, 5, 70]
        k, v, table, seq_lens, tags, expected = pool(
            lens, page, 2, dim, dtype, device, seed=dim + page
        )
        if check:
            tags[table[0, 1].long()] = kvattn.reserved_tag(1)  # refused (RESERVED)
            table[2, 0] = 10**6  # out of range: never dereferenced
        g = torch.Generator().manual_seed(dim)
        q = torch.randn(len(lens), 8, dim, generator=g).to(dtype).to(device)
        inputs = (q, k, v, table, seq_lens, tags, expected)
        ref, ref_report = kvattn.reference.paged_decode(*inputs, check=check)
        for splits in (1, 3):
            args = kvattn.layout.validate_decode(*inputs)
            out = torch.full_like(q, float("nan"))
            report = kvattn.backends.load(backend)[0].decode(
                args, check=check, out=out, lse=None, num_splits=splits
            )
            errors += compare(
                f"decode d{dim} {dtype} page {page} check={check} splits={splits}",
                out,
                ref,
                report,
                ref_report,
                dtype,
            )
        q_lens = [4, 1, 9]
        cu = torch.tensor([0, 4, 5, 14], dtype=torch.int32, device=device)
        qx = torch.randn(sum(q_lens), 8, dim, generator=g).to(dtype).to(device)
        ext = (qx, k, v, cu, table, seq_lens, tags, expected)
        ref, ref_report = kvattn.reference.paged_extend(*ext, check=check)
        args = kvattn.layout.validate_extend(*ext)
        out = torch.full_like(qx, float("nan"))
        report = kvattn.backends.load(backend)[0].extend(args, check=check, out=out, lse=None)
        errors += compare(
            f"extend d{dim} {dtype} page {page} check={check}", out, ref, report, ref_report, dtype
        )
    k, v, table, seq_lens, tags, expected = pool([20], 16, 2, 128, torch.float16, device, seed=1)
    kvattn.reserve_pages(tags, [int(table[0, 1])], owner=1)
    new = torch.randn(3, 2, 128).half().to(device)
    slots = table[0, 1].long() * 16 + torch.arange(3, device=device)
    result = kvattn.write_kv(new, new, k, v, slots, tags, owner=1, backend=backend)
    if result.dropped_count() != 0 or not torch.equal(k[table[0, 1].long(), :3].cpu(), new.cpu()):
        errors.append("write_kv: tokens dropped or not written")
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cuda_smoke", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cuda_sim"))
    errors = run(ap.parse_args(argv).backend)
    for e in errors:
        print("CUDA SMOKE FAILED:", e, flush=True)
    print(f"cuda smoke: {'ok' if not errors else f'{len(errors)} failure(s)'}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

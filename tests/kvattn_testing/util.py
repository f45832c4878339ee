"""Shared test helpers: paged batches built from a random permutation of an oversized pool, NaN
poison in every slot that must not be read, the backends under test and what each claims, and
precision-based tolerances."""

from __future__ import annotations

import inspect
import pathlib
from dataclasses import dataclass

import pytest
import torch

import kvattn
from kvattn import backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: tests/kvattn_testing/util.py


def backends_under_test(op: str = "decode") -> list[str]:
    """Every registered backend that can run ``op`` (decode or extend) on this machine (the
    reference included)."""
    probe = Batch.random(
        batch=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        seq_lens=[3],
        dtype=torch.float16,
    )
    args = probe.args()
    if op == "extend":
        args = kvattn.layout.validate_extend(
            probe.q,
            probe.k_cache,
            probe.v_cache,
            torch.tensor([0, 1], dtype=torch.int32, device=probe.q.device),
            probe.block_table,
            probe.seq_lens,
            probe.page_tags,
            probe.expected,
        )
    reasons = backends.explain(args, op)
    return [name for name, reason in reasons.items() if reason is None]


def claims(args, op: str) -> list[str]:
    """The registered backends that claim ``args`` (validated inputs of ``op``), in the registry's
    order: every one that could run the call here."""
    return [n for n, why in backends.explain(args, op=op).items() if why is None]


def runs_float32(backend: str) -> bool:
    """Whether ``backend`` runs float32 pools (the CUDA kernels are fp16/bf16 tensor-core kernels)."""
    probe = Batch.random(
        batch=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        seq_lens=[3],
        dtype=torch.float32,
    )
    return backends.explain(probe.args())[backend] is None


def precise_dtype(backend: str) -> torch.dtype:
    """The most precise dtype ``backend`` runs: float32, else float16."""
    return torch.float32 if runs_float32(backend) else torch.float16


def tolerance(dtype: torch.dtype) -> dict:
    """atol/rtol for a kernel output against the float32/float64 reference.

    The output is a convex combination of V rows (|v| <= ~4 for randn data). A kernel stores the
    output once in ``dtype`` and, for 16-bit inputs, rounds the softmax weights to ``dtype`` before
    the P @ V product, so its error is a few units of ``dtype``'s epsilon times max|v|: fp16 eps =
    2**-10, bf16 eps = 2**-7. fp32 kernels differ from the reference only by summation order.
    A masked-in foreign slot (NaN, or the 100x sentinel of the scenario tests) moves the output by
    far more than these bounds.
    """
    return {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=8e-3, rtol=8e-3),
        torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
    }[dtype]


@dataclass
class Batch:
    """A decode batch over a NaN-poisoned pool: every slot not written for its reader holds NaN."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor

    @classmethod
    def random(
        cls,
        *,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        seq_lens,
        dtype=torch.float16,
        pool_factor: int = 3,
        extra_pages: int = 0,
        layout: str = "NHD",
        seed: int = 0,
        device=DEVICE,
        head_dim_v: int | None = None,
    ) -> Batch:
        """Sequence ``b`` owns ``ceil(seq_lens[b] / page_size)`` (+ ``extra_pages``) physical pages
        drawn from a random permutation of a pool ``pool_factor`` times larger than needed. Its
        pages are WRITTEN for owner ``b + 1`` with ``valid_len`` covering exactly its tokens; the
        tail of its last page, every unused page and every unused table entry hold NaN / FREE.
        ``head_dim_v``: V's own head dim (default ``head_dim``)."""
        g = torch.Generator().manual_seed(seed)
        seq_lens = [int(s) for s in seq_lens]
        pages_per_seq = [-(-s // page_size) + extra_pages for s in seq_lens]
        max_pages = max(1, max(pages_per_seq))
        num_pages = max(4, pool_factor * sum(pages_per_seq))
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        shape_v = (num_pages, page_size, num_kv_heads, head_dim_v)
        if layout == "HND":
            shape = (num_pages, num_kv_heads, page_size, head_dim)
            shape_v = (num_pages, num_kv_heads, page_size, head_dim_v)
        k = torch.full(shape, float("nan"), dtype=dtype)
        v = torch.full(shape_v, float("nan"), dtype=dtype)
        if layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        tags = torch.zeros(num_pages, dtype=torch.int64)
        table = torch.zeros(batch, max_pages, dtype=torch.int32)
        perm = torch.randperm(num_pages, generator=g).tolist()
        for b, (length, n) in enumerate(zip(seq_lens, pages_per_seq)):
            pages = [perm.pop() for _ in range(n)]
            table[b, :n] = torch.tensor(pages, dtype=torch.int32)
            for i, p in enumerate(pages):
                filled = min(page_size, max(0, length - i * page_size))
                k[p, :filled] = torch.randn(filled, num_kv_heads, head_dim, generator=g).to(dtype)
                v[p, :filled] = torch.randn(filled, num_kv_heads, head_dim_v, generator=g).to(dtype)
                tags[p] = (
                    kvattn.written_tag(b + 1, filled) if filled else kvattn.reserved_tag(b + 1)
                )
        q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
        expected = torch.arange(1, batch + 1, dtype=torch.int64)
        to = dict(device=device)
        return cls(
            q.to(**to),
            k.to(**to),
            v.to(**to),
            table.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            tags.to(**to),
            expected.to(**to),
        )

    def args(self) -> kvattn.DecodeArgs:
        return kvattn.layout.validate_decode(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.page_tags,
            self.expected,
        )

    def decode(self, backend: str, **kwargs):
        return kvattn.paged_decode(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.page_tags,
            self.expected,
            backend=backend,
            **kwargs,
        )

    def reference(self, **kwargs):
        return kvattn.reference.paged_decode(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.page_tags,
            self.expected,
            **kwargs,
        )


def assert_reports_equal(report, ref) -> None:
    for field in ("violations", "reasons", "pages_checked", "beyond_table", "page_reasons"):
        got, want = getattr(report, field).cpu(), getattr(ref, field).cpu()
        assert torch.equal(got, want), f"{field}: got {got}, expected {want}"


# LSE is a float32 log of a float32 sum of exponentials of float32 logits; the logits are dot products
# of dtype-exact inputs accumulated in float32, so backends differ from the reference by float32
# rounding of order 1e-6 relative. 1e-4 leaves room for approximate exp2/log2 on GPUs.
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def assert_float32_read_as_reference(out, lse, report, ref_out, ref_lse, ref_report) -> None:
    """A float32 reader's ``(out, lse, report)`` against the float64 reference's: every output
    finite (NaN is planted in what must not be read), outputs within float32's summation error,
    LSE -inf exactly where the reference's is, the rest within float32 rounding, equal reports."""
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.float32))
    finite = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~finite]).all()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)


def lse_tolerance(dtype: torch.dtype) -> dict:
    """LSE_TOLERANCE for a kernel that saw the reference's values. For float32 data a backend ran in
    float16 (:func:`decode`), each logit also carries the inputs' float16 rounding: 2**-11 relative
    per factor, over head_dim products of randn values and the 1/sqrt(head_dim) scale, a few 1e-3
    at the test sizes. A slot wrongly added or dropped moves the LSE of these short rows by far more."""
    return LSE_TOLERANCE if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def kernel_backends() -> list[str]:
    """The backends under test other than the reference (those compared against it)."""
    return [name for name in backends_under_test() if name != "reference"]


def split_kv_backends() -> list[str]:
    """The backends under test whose decode launcher splits the keys (takes ``num_splits``); the
    torch backend and the reference attend over a sequence's keys in one piece."""
    return [
        name
        for name in kernel_backends()
        if "num_splits" in inspect.signature(launcher(name).decode).parameters
    ]


def launcher(backend: str):
    """The backend module of ``backend`` (its ``decode(args, *, check, out, lse, ...)``)."""
    module, reason = backends.load(backend)
    assert module is not None, reason
    return module


def poisoned_pool(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype=torch.float32,
    device=DEVICE,
):
    """``(k_cache, v_cache, page_tags)``: NaN in every slot, every page FREE."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v = torch.full(shape, float("nan"), dtype=dtype, device=device)
    return k, v, torch.zeros(num_pages, dtype=torch.int64, device=device)


def decode(backend: str, q, k_cache, v_cache, block_table, seq_lens, page_tags, expected, **kwargs):
    """:func:`kvattn.paged_decode` on ``backend``; index lists become int32/int64 tensors. Float32
    inputs run in float16 on a backend without float32 (compare with ``tolerance(out.dtype)``)."""
    device = q.device
    if q.dtype == torch.float32 and not runs_float32(backend):
        q, k_cache, v_cache = (t.to(torch.float16) for t in (q, k_cache, v_cache))
    if not isinstance(block_table, torch.Tensor):
        block_table = torch.tensor(block_table, dtype=torch.int32, device=device)
    if not isinstance(seq_lens, torch.Tensor):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if not isinstance(expected, torch.Tensor):
        expected = torch.tensor(expected, dtype=torch.int64, device=device)
    return kvattn.paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, page_tags, expected, backend=backend, **kwargs
    )


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` finite and within :func:`tolerance` of ``ref``, and ``ref`` large enough that a wrong
    kernel (garbage, zeros, a NaN-poisoned slot masked in) could not pass by accident."""
    assert torch.isfinite(out).all(), "output holds NaN/inf: a poisoned slot was read"
    tol = tolerance(dtype)
    assert ref.abs().max() > 2 * tol["atol"], "reference output too small to tell right from wrong"
    torch.testing.assert_close(out.to(ref.dtype), ref, **tol)


def raises(error, *words):
    """``pytest.raises`` of exactly ``error`` (not a subclass) whose message holds every word."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(error)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            assert type(self.info.value) is error, repr(self.info.value)
            for word in words:
                assert word in str(self.info.value), f"{word!r} not in {self.info.value}"
            return suppressed

    return Check()

"""Paged extend (chunked prefill) batches and their oracles, for every test of an extend call:
:class:`Extend` (a ragged batch over a NaN-poisoned pool), :func:`dense_extend` (float64
attention from the definition), the ownership scenarios on a prefix page (:func:`corrupt`) and
what a run over one must give (:func:`assert_prefix_scenario`), the extend backends that run here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

import kvattn
from kvattn import Violation, backends, reserved_tag, written_tag
from kvattn_testing.util import DEVICE, Batch, assert_reports_equal, tolerance

LSE_TOL = dict(atol=1e-4, rtol=1e-4)  # float32 log-sum-exp of float32 logits


@dataclass
class Extend:
    """A ragged extend batch over a NaN-poisoned pool (built by :meth:`kvattn_testing.util.Batch.random`
    with ``seq_lens = prefix + q_len``): sequence ``b`` is owner ``b + 1``, its pages WRITTEN
    exactly over its tokens; ``q`` holds ``q_lens[b]`` new query rows per sequence."""

    q: torch.Tensor
    cu: torch.Tensor
    pages: Batch

    @classmethod
    def random(
        cls,
        q_lens,
        prefix_lens,
        *,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        dtype=torch.float16,
        seed=0,
        **kwargs,
    ) -> Extend:
        seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
        pages = Batch.random(
            batch=len(q_lens),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            seq_lens=seq_lens,
            dtype=dtype,
            seed=seed,
            **kwargs,
        )
        g = torch.Generator().manual_seed(seed + 1)
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
        return cls(q, cu, pages)

    def inputs(self):
        p = self.pages
        return (
            self.q,
            p.k_cache,
            p.v_cache,
            self.cu,
            p.block_table,
            p.seq_lens,
            p.page_tags,
            p.expected,
        )

    def run(self, backend="auto", **kwargs):
        return kvattn.paged_extend(*self.inputs(), backend=backend, **kwargs)

    def launch(self, check=True, causal=True, block_m=16, block_n=16):
        """The Triton launcher with small tiles; returns ``(out, lse, report)``."""
        args = kvattn.layout.validate_extend(*self.inputs(), causal=causal)
        out = torch.empty_like(self.q)
        lse = torch.empty(self.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = TRITON_EXTEND.extend(
            args, check=check, out=out, lse=lse, block_m=block_m, block_n=block_n
        )
        return out, lse, report

    def reference(self, **kwargs):
        return kvattn.reference.paged_extend(*self.inputs(), return_lse=True, **kwargs)

    def tokens(self, b: int):
        """K/V ``[seq_len, Hkv, D]`` of sequence ``b`` read by plain indexing, ignoring tags (an
        entry outside the pool reads page 0 here; such tokens must be disallowed by the caller)."""
        p = self.pages
        n = int(p.seq_lens[b])
        num_pages, size = p.k_cache.shape[:2]
        idx = torch.arange(n)
        phys = p.block_table[b].long().cpu()[idx // size]
        phys = torch.where((phys >= 0) & (phys < num_pages), phys, 0)
        return p.k_cache.cpu()[phys, idx % size], p.v_cache.cpu()[phys, idx % size]


def dense_extend(q, cu, keys, values, allowed, scale, causal=True):
    """Float64 attention written from the definition, one query row at a time: row ``j`` of
    sequence ``b`` sits at ``len(keys[b]) - q_len + j`` and reads the allowed keys up to it."""
    total_q, num_heads, head_dim = q.shape
    out = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((total_q, num_heads), float("-inf"), dtype=torch.float64)
    starts = cu.cpu().tolist()
    for b, (k, v, ok) in enumerate(zip(keys, values, allowed)):
        group = num_heads // k.shape[1]
        q_len = starts[b + 1] - starts[b]
        for j in range(q_len):
            pos = len(k) - q_len + j
            sel = [t for t in range(len(k)) if ok[t] and (not causal or t <= pos)]
            if not sel:
                continue
            row = starts[b] + j
            for h in range(num_heads):
                kk = k[sel, h // group].double()
                logits = (kk @ q[row, h].cpu().double()) * scale
                lse[row, h] = torch.logsumexp(logits, 0)
                out[row, h] = torch.softmax(logits, 0) @ v[sel, h // group].double()
    return out, lse


def assert_close(out, ref, dtype):
    """``out`` finite and within the dtype's tolerance of ``ref``, which must be large enough that
    zeros or garbage could not pass."""
    assert torch.isfinite(out).all(), "output holds NaN/inf: a poisoned slot was read"
    tol = tolerance(dtype)
    assert ref.abs().max() > 10 * tol["atol"], "reference output too small to tell right from wrong"
    torch.testing.assert_close(out.cpu().to(ref.dtype), ref.cpu(), **tol)


def _extend_backends() -> list[str]:
    probe = Extend.random([2], [3], dtype=torch.float32)
    args = kvattn.layout.validate_extend(*probe.inputs())
    return [name for name, why in backends.explain(args, op="extend").items() if why is None]


EXTEND_BACKENDS = _extend_backends()


KERNELS = [name for name in EXTEND_BACKENDS if name != "reference"]


# The package re-exports the launcher under the module's name, so import the module by path.
TRITON_EXTEND = (
    importlib.import_module("kvattn.backends.triton.paged_extend") if "triton" in KERNELS else None
)


def corrupt(e: Extend, scenario: str):
    """Apply ``scenario`` to logical page 1 (a prefix page) of sequence 0, filling its K/V with NaN
    where the page has memory. Returns (reason expected, tokens of sequence 0 still allowed)."""
    p = e.pages
    size = p.k_cache.shape[1]
    page = int(p.block_table[0, 1])
    n = int(p.seq_lens[0])
    allowed = [True] * n
    if scenario == "none":
        return Violation.NONE, allowed
    if scenario == "unwritten":
        # Right owner, but only 1 slot written: the rest is stale (NaN) and must stay out.
        p.page_tags[page] = written_tag(1, 1)
        p.k_cache[page, 1:] = float("nan")
        p.v_cache[page, 1:] = float("nan")
        for t in range(size + 1, 2 * size):
            allowed[t] = False
        return Violation.UNWRITTEN, allowed
    for t in range(size, 2 * size):
        allowed[t] = False
    if scenario in ("out_of_range", "negative"):
        p.block_table[0, 1] = p.k_cache.shape[0] + 3 if scenario == "out_of_range" else -1
        return Violation.OUT_OF_RANGE, allowed
    p.k_cache[page] = float("nan")
    p.v_cache[page] = float("nan")
    p.page_tags[page] = {
        "foreign": written_tag(77, size),
        "reserved": reserved_tag(1),
        "free": kvattn.FREE_TAG,
    }[scenario]
    return {
        "foreign": Violation.OWNER_MISMATCH,
        "reserved": Violation.RESERVED,
        "free": Violation.FREE,
    }[scenario], allowed


def assert_prefix_scenario(e, out, lse, report, reason, allowed) -> None:
    """What a run over a batch prepared by :func:`corrupt` must give: attention over exactly the
    allowed slots (dense float64 oracle) and page 1 of sequence 0 reported with ``reason``."""
    keys, values = zip(*(e.tokens(b) for b in range(2)))
    keys = [torch.nan_to_num(k) for k in keys]  # dense oracle never selects refused tokens anyway
    values = [torch.nan_to_num(v) for v in values]
    want, want_lse = dense_extend(
        e.q, e.cu, keys, values, [allowed, [True] * len(keys[1])], e.q.shape[-1] ** -0.5
    )
    assert_close(out, want, torch.float16)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **LSE_TOL)
    expected_pages = torch.zeros(2, e.pages.block_table.shape[1], dtype=torch.int8)
    expected_pages[0, 1] = int(reason)
    assert torch.equal(report.page_reasons.cpu(), expected_pages)
    assert report.violations.tolist() == [int(reason != 0), 0]
    assert report.reasons.tolist() == [int(reason), 0]
    assert report.pages_checked.tolist() == [4, 2]
    assert_reports_equal(report, e.reference()[2])

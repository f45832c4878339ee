"""The report is written whole by every kernel: no memset precedes a call, so buffers start as
whatever memory held. Poisoned report buffers must come back equal to the reference's report, on
every backend, for decode with one split and several and for extend, with and without refusals."""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn.report import OwnershipReport
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    Batch,
    assert_reports_equal,
    backends_under_test,
    kernel_backends,
    precise_dtype,
    split_kv_backends,
)


@pytest.fixture
def poisoned_reports(monkeypatch):
    real = OwnershipReport.allocate.__func__

    def allocate(cls, batch, max_pages, device):
        report = real(cls, batch, max_pages, device)
        for field in ("violations", "reasons", "pages_checked", "beyond_table"):
            getattr(report, field).fill_(-7)
        report.page_reasons.fill_(99)
        return report

    monkeypatch.setattr(OwnershipReport, "allocate", classmethod(allocate))


def launcher(backend):
    module, reason = kvattn.backends.load(backend)
    assert module is not None, reason
    return module


@pytest.mark.parametrize("refused", [False, True], ids=["clean", "refused"])
@pytest.mark.parametrize(
    "backend,splits",
    [(b, s) for b in kernel_backends() for s in ([1, 3] if b in split_kv_backends() else [None])],
)
def test_decode_writes_every_report_entry(poisoned_reports, backend, splits, refused):
    batch = Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[0, 9, 30],
        dtype=precise_dtype(backend),
        extra_pages=2,
    )
    if refused:
        batch.page_tags[int(batch.block_table[2, 3])] = kvattn.reserved_tag(3)
        batch.seq_lens[1] = 4 * batch.block_table.shape[1] + 5  # past the table
    args = kvattn.layout.validate_decode(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.page_tags,
        batch.expected,
        validate=False,
    )
    out = torch.empty_like(batch.q)
    split = {} if splits is None else dict(num_splits=splits)
    report = launcher(backend).decode(args, check=True, out=out, lse=None, **split)
    _, ref = kvattn.reference.paged_decode(
        *[
            getattr(args, n)
            for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "page_tags", "expected")
        ]
    )
    assert_reports_equal(report, ref)
    assert bool(report.any()) == refused


@pytest.mark.parametrize("refused", [False, True], ids=["clean", "refused"])
@pytest.mark.parametrize(
    "backend", [b for b in kernel_backends() if b in backends_under_test("extend")]
)
def test_extend_writes_every_report_entry(poisoned_reports, backend, refused):
    e = Extend.random(
        [3, 1],
        [5, 0],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=precise_dtype(backend),
        extra_pages=2,
    )
    if refused:
        e.pages.page_tags[int(e.pages.block_table[0, 1])] = kvattn.FREE_TAG
    args = kvattn.layout.validate_extend(*e.inputs())
    out = torch.empty_like(e.q)
    report = launcher(backend).extend(args, check=True, out=out, lse=None)
    ref = e.reference()[2]
    assert_reports_equal(report, ref)
    assert bool(report.any()) == refused


def test_every_kernel_backend_is_covered():
    assert set(kernel_backends()) == set(backends_under_test()) - {"reference"}

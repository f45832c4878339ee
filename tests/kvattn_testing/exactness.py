"""Running decode and extend alike on every reader, and comparing them: the readers under test
(:data:`READERS`, :data:`SPLIT_READERS`), :func:`validated` and :func:`run` of either op, and the
checks that a call agrees with the reference (:func:`assert_agrees`) or reads nothing
(:func:`assert_reads_nothing`)."""

from __future__ import annotations

import torch

import kvattn
from kvattn_testing.util import (
    LSE_TOLERANCE,
    assert_reports_equal,
    backends_under_test,
    split_kv_backends,
    tolerance,
)

F16 = torch.float16
READERS = backends_under_test()
SPLIT_READERS = sorted(set(split_kv_backends()) & set(READERS))


def validated(op: str, x, **kwargs):
    """The validated inputs (``DecodeArgs``, ``ExtendArgs``) of decode (``x`` a Batch) or extend
    (``x`` an Extend) with ``kwargs``."""
    if op == "decode":
        return kvattn.layout.validate_decode(
            x.q, x.k_cache, x.v_cache, x.block_table, x.seq_lens, x.page_tags, x.expected, **kwargs
        )
    return kvattn.layout.validate_extend(*x.inputs(), **kwargs)


def run(op: str, x, backend: str, **kwargs):
    """``(out, lse, report)`` of decode (``x`` a Batch) or extend (``x`` an Extend)."""
    if op == "decode":
        return x.decode(backend, return_lse=True, **kwargs)
    return x.run(backend, return_lse=True, **kwargs)


def assert_agrees(got, want, dtype=F16) -> None:
    """``got`` and ``want`` are ``(out, lse, report)``: the output finite and within the dtype's
    tolerance, the lse -inf exactly where the reference's is and close elsewhere, the reports
    equal."""
    out, lse, report = got
    want_out, want_lse, want_report = want
    assert torch.isfinite(out).all(), "output holds NaN/inf: a slot that is not read reached it"
    torch.testing.assert_close(out.float(), want_out.float(), **tolerance(dtype))
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), (lse, want_lse)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite].float(), want_lse[finite].float(), **LSE_TOLERANCE)
    if want_report is not None:
        assert_reports_equal(report, want_report)


def assert_reads_nothing(out, lse, rows, heads) -> None:
    """Rows ``rows`` of query heads ``heads`` have output 0 exactly and lse -inf."""
    block = out[rows][:, heads]
    assert torch.equal(block, torch.zeros_like(block)), block
    assert torch.isneginf(lse[rows][:, heads]).all(), lse

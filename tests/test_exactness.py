"""Every variant fails closed identically on every backend (issue 18).

Each test poisons (NaN) what the contract says a call does not read, or passes a switch value it
refuses, and compares every reader backend (reference, torch, triton under the interpreter,
cuda_sim) with the reference: report fields exactly, outputs and LSEs within the tolerances of
tests/util.py. Each has a twin where the same poison is read, or the same value is valid, so a test
that passed by accident would show. One section per item of the issue:

- 1, 2: a sliding window never loads the slots of a straddling page before every query's window
  (decode and extend).
"""
from __future__ import annotations

import math

import pytest
import torch

from test_extend import Extend
from util import LSE_TOLERANCE, Batch, assert_reports_equal, backends_under_test, tolerance

F16 = torch.float16
HEADS, KV_HEADS, DIM = 4, 2, 16
READERS = backends_under_test()
NAN = math.nan


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


def decode_batch(seq_lens, page_size=4, seed=0, **kwargs) -> Batch:
    return Batch.random(batch=len(seq_lens), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                        page_size=page_size, seq_lens=seq_lens, pool_factor=2, seed=seed, **kwargs)


def extend_batch(q_lens, prefixes, page_size=4, seed=0) -> Extend:
    return Extend.random(q_lens, prefixes, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                         page_size=page_size, pool_factor=2, seed=seed)


def run(op: str, x, backend: str, **kwargs):
    """``(out, lse, report)`` of decode (``x`` a Batch) or extend (``x`` an Extend)."""
    if op == "decode":
        return x.decode(backend, return_lse=True, **kwargs)
    return x.run(backend, return_lse=True, **kwargs)


def poison_slots(pages: Batch, b: int, first: int, last: int) -> None:
    """NaN into K and V of sequence ``b``'s tokens ``[first, last)``, tags untouched (the slots stay
    certified as written: only the window decides they are not read)."""
    size = pages.k_cache.shape[1]
    for t in range(first, last):
        page = int(pages.block_table[b, t // size])
        pages.k_cache[page, t % size] = NAN
        pages.v_cache[page, t % size] = NAN


# --- 1, 2: slots of a straddling page before every query's window ---------------------------------

DECODE_WINDOWS = [(5, 23, 0), (4, 18, 2), (3, 31, 4)]  # (page size, seq_len, window_left)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("page, seq_len, window", DECODE_WINDOWS)
def test_decode_window_never_reads_the_head_of_its_first_page(backend, page, seq_len, window):
    """The query at seq_len - 1 reads keys from seq_len - 1 - window on; the slots of that key's
    page before it hold NaN (written for the owner: stale, as a sliding-window cache leaves them)
    and must not reach the output."""
    clean = decode_batch([seq_len], page)
    first = seq_len - 1 - window
    assert first % page, "the window must start inside a page"
    want = clean.reference(return_lse=True, window_left=window)
    pages = decode_batch([seq_len], page)
    poison_slots(pages, 0, first // page * page, first)
    got = run("decode", pages, backend, window_left=window)
    assert_agrees(got, want)
    assert want[2].pages_checked.tolist() == [-(-seq_len // page) - first // page]


@pytest.mark.parametrize("backend", READERS)
def test_decode_window_reaching_the_poison_reads_it(backend):
    """The twin: one key wider, the window covers the last poisoned slot, and every backend's output
    is NaN there (the poison is placed where a window edge one slot off would read it)."""
    page, seq_len, window = DECODE_WINDOWS[0]
    pages = decode_batch([seq_len], page)
    first = seq_len - 1 - window
    poison_slots(pages, 0, first // page * page, first)
    out, _, _ = run("decode", pages, backend, window_left=window + 1)
    assert torch.isnan(out).all()


EXTEND_WINDOWS = [(3, 26, 5, 4), (4, 13, 3, 2)]  # (page size, prefix, q_len, window_left)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page, prefix, q_len, window", EXTEND_WINDOWS)
def test_extend_window_never_reads_before_every_rows_window(backend, causal, page, prefix, q_len,
                                                            window):
    """Row 0 sits at position prefix and reads keys from prefix - window on, every later row from
    further on: the slots of that key's page before it are read by no row. Poisoned, they must
    reach no row (a kernel that loads them for the tile gives every row 0 * NaN)."""
    first = prefix - window
    assert first % page, "the window must start inside a page"
    want = extend_batch([q_len], [prefix], page).reference(causal=causal, window_left=window)
    ext = extend_batch([q_len], [prefix], page)
    poison_slots(ext.pages, 0, first // page * page, first)
    got = run("extend", ext, backend, causal=causal, window_left=window)
    assert_agrees(got, want)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extend_window_reaching_the_poison_reads_it(backend, causal):
    """The twin: one key wider, row 0's window covers the last poisoned slot: its output is NaN on
    every backend."""
    page, prefix, q_len, window = EXTEND_WINDOWS[0]
    ext = extend_batch([q_len], [prefix], page)
    first = prefix - window
    poison_slots(ext.pages, 0, first // page * page, first)
    out, _, _ = run("extend", ext, backend, causal=causal, window_left=window + 1)
    assert torch.isnan(out[0]).all()

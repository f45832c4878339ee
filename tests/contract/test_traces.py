"""Random traces against a model of page states (docs/ownership.md 6.8).

Each operation (allocate, append, transfer receive + commit, abort with a write or commit left in
flight, replay of that late operation after its pages were reused, free, share prefix, stray writes
with wrong slots or owners) is applied to the real tensors through kvattn's cache and writers and to
:class:`kvattn_testing.page_model.PageModel`, side by side in :class:`kvattn_testing.traces.Trace`.
After every step the tags, every byte of the pool and the allocator's bookkeeping must match the
model, and a decode over live (and stale) leases, with randomly corrupted block tables, must report
exactly what the model's reader rule predicts and output exactly attention over the slots the model
allows. Every token's K/V is a unique signature and never-written slots are NaN, so a slot that
contributed without the model's leave shows in the output.
"""

import functools
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from kvattn import Violation
from kvattn_testing.page_model import FREE
from kvattn_testing.traces import NUM_PAGES, Trace, _decode_step, _prefill, _step
from kvattn_testing.util import backends_under_test

# --- scripted traces: the paths a random trace may miss, with their outcome spelled out ---------

NOT_HELD = int(kvattn.WriteDrop.NOT_HELD)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_late_write_replayed_after_reuse_is_dropped(layout):
    t = Trace(page_size=4, layout=layout)
    a = t.allocate(0)
    t.append(a, 5)
    t.abort(a, "write", 3)  # slots 5..7 of a's pages in flight
    late_slots = t.pending[0][2]
    b = t.allocate(0)
    t.append(b, 8)
    assert {s // 4 for s in late_slots} <= set(t.model.leases[b].pages)  # b reuses those pages
    t.check_state()
    clean = t.check_decode([b])
    result = t.replay(0)
    assert result.drop_reasons.tolist() == [NOT_HELD] * 3
    t.check_state()
    assert t.check_decode([b]) == clean == [[0, 0]]
    stale = t.check_decode([a, b])
    assert stale[0] == [int(Violation.OWNER_MISMATCH)] * 2


def test_late_commit_replayed_after_reuse_is_dropped():
    t = Trace(page_size=2)
    a = t.allocate(4)
    t.transfer(a, accounted=1, extra=1)
    t.abort(a, "commit", 2)
    b = t.allocate(4)
    t.transfer(b, accounted=3, extra=0)
    result = t.replay(0)
    assert result.drop_reasons.tolist() == [NOT_HELD] * len(result.landed)
    t.check_state()
    assert t.check_decode([b]) == [[0, 0]]
    reasons = t.check_decode([b], [("overlong", 0)])
    assert reasons == [[0, int(Violation.UNWRITTEN)]]


def test_shared_prefix_outlives_its_parent_and_checks_owners():
    t = Trace(page_size=2)
    a = t.allocate(0)
    t.append(a, 5)
    c = t.share(a, 4, capacity=6)
    t.append(c, 1)
    t.free(a)
    t.check_state()
    assert t.check_decode([c]) == [[0, 0, 0]]
    assert t.check_decode([c], [("owner", 0, 1, c)]) == [[0, int(Violation.OWNER_MISMATCH), 0]]
    t.free(c)
    t.check_state()
    assert t.model.free_page_count() == NUM_PAGES


def test_corrupted_tables_are_reported_and_masked():
    t = Trace(page_size=2)
    a, b = t.allocate(0), t.allocate(0)
    t.append(a, 3)
    t.append(b, 4)
    t.check_state()
    assert t.check_decode([a, b]) == [[0, 0], [0, 0]]
    mismatch = int(Violation.OWNER_MISMATCH)
    assert t.check_decode([a, b], [("swap", 0, 1)]) == [[mismatch] * 2, [mismatch] * 2]
    oor = int(Violation.OUT_OF_RANGE)
    assert t.check_decode([a, b], [("oor", 0, 1, NUM_PAGES), ("oor", 1, 0, -1)]) == [
        [0, oor],
        [oor, 0],
    ]
    free_page = next(p for p in range(NUM_PAGES) if t.model.pages[p].state == FREE)
    assert t.check_decode([a, b], [("stale", 1, 1, free_page)]) == [
        [0, 0],
        [0, int(Violation.FREE)],
    ]
    c = t.allocate(2)
    reserved = int(Violation.RESERVED)
    assert t.check_decode([c], [("overlong", 0)]) == [[reserved]]


# --- random traces -------------------------------------------------------------------------------


@settings(max_examples=30)
@given(data=st.data(), page_size=st.sampled_from([2, 4]), layout=st.sampled_from(["NHD", "HND"]))
def test_random_traces_match_the_model(data, page_size, layout):
    t = Trace(page_size, layout)
    _prefill(t, data)
    for step in range(data.draw(st.integers(2, 8), label="steps")):
        _step(t, data)
        t.check_state()
        _decode_step(t, data, seed=step)


# The kernel writers (every write of a trace: appends, late writes, stray writes) against the model.
KERNEL_WRITERS = ["triton"] + [w for w in ("cuda_sim", "cpu") if w in backends_under_test()]


@pytest.mark.parametrize("writer", KERNEL_WRITERS)
@settings(max_examples=8)
@given(data=st.data(), page_size=st.sampled_from([2, 4]))
def test_random_traces_with_kernel_writers(writer, data, page_size):
    real = kvattn.writers.write_kv
    with (
        mock.patch.object(kvattn.writers, "write_kv", functools.partial(real, backend=writer)),
        mock.patch.object(kvattn.cache, "write_kv", functools.partial(real, backend=writer)),
        mock.patch.object(kvattn, "write_kv", functools.partial(real, backend=writer)),
    ):
        t = Trace(page_size, "NHD")
        _prefill(t, data)
        for step in range(data.draw(st.integers(2, 5), label="steps")):
            _step(t, data)
            t.check_state()
            _decode_step(t, data, seed=step)

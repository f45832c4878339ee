"""Property-based hostile input (docs/ownership.md section 8) for every public op and writer, on every
CPU backend, against oracles written here from the documented bit layout and rules with Python ints
(they share nothing with kvattn but the flag values).

Properties: a call either raises ValueError/TypeError or returns; what it returns equals the
oracle (outputs within the dtype's tolerance, reports and tags exactly, pools bit for bit); every
slot no sequence may read holds NaN, so a slot let in shows; the report buffers start poisoned, so
an entry a kernel never wrote shows. Plus random traces where one writer's call is interleaved
with another's on the same pages.

``KVATTN_FUZZ_EXAMPLES`` sets the examples per property (default 12: the CI budget; the Triton
interpreter costs tens of milliseconds per call, so shapes stay tiny). Run with e.g.
``KVATTN_FUZZ_EXAMPLES=500`` to search harder.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvattn
from kvattn import OwnershipReport, Violation, WriteDrop
from kvattn.backends.torch import writer as torch_writer
from kvattn_testing.traces import Interleave, Trace, _decode_step, _prefill, _step, _stray_slots
from kvattn_testing.util import backends_under_test, tolerance

EXAMPLES = int(os.environ.get("KVATTN_FUZZ_EXAMPLES", "12"))
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
READERS = backends_under_test()
WRITERS = [w for w in ("torch", "triton", "cuda_sim", "cpu") if w == "torch" or w in READERS]
F16 = torch.float16
HEAD_DIM = 16
POISON = 0x55  # not a Violation value: a page_reasons entry still holding it was never written

# The bit layout of docs/ownership.md section 2, restated.
OWNER_MAX = (1 << 47) - 1
FREE, RESERVED, WRITTEN = 0, 1, 2
OOR, V_FREE, V_RESERVED, MISMATCH, UNWRITTEN = 1, 2, 4, 8, 16
D_OOR, D_NOT_HELD, D_GAP, D_BAD_LENGTH = 1, 2, 4, 8
assert [OOR, V_FREE, V_RESERVED, MISMATCH, UNWRITTEN] == [
    Violation.OUT_OF_RANGE,
    Violation.FREE,
    Violation.RESERVED,
    Violation.OWNER_MISMATCH,
    Violation.UNWRITTEN,
]
assert [D_OOR, D_NOT_HELD, D_GAP, D_BAD_LENGTH] == [
    WriteDrop.OUT_OF_RANGE,
    WriteDrop.NOT_HELD,
    WriteDrop.GAP,
    WriteDrop.BAD_LENGTH,
]


def state(tag: int) -> int:
    return FREE if tag < 0 or tag & 3 == 3 else tag & 3


def owner_of(tag: int) -> int:
    return (tag >> 16) & OWNER_MAX


def valid_len(tag: int) -> int:
    return (tag >> 2) & ((1 << 14) - 1)


def good_owner(owner: int) -> bool:
    return 1 <= owner <= OWNER_MAX


def held(tag: int, owner: int) -> bool:
    return state(tag) in (RESERVED, WRITTEN) and good_owner(owner) and owner_of(tag) == owner


def int64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


# --- hostile values ------------------------------------------------------------------------------

OWNERS = [1, 2, 3, OWNER_MAX]
BAD_OWNERS = [0, -1, OWNER_MAX + 1, (1 << 48) + 1, -(1 << 63), (1 << 63) - 1]


def owners(valid_only=False):
    return st.sampled_from(OWNERS if valid_only else OWNERS + BAD_OWNERS)


def tags(page_size: int):
    """Tags a writer produces (valid lengths up to the page and past it) and words none does."""
    written = st.builds(
        lambda o, n: (o << 16) | (n << 2) | WRITTEN,
        st.sampled_from(OWNERS),
        st.integers(0, page_size) | st.integers(0, (1 << 14) - 1),
    )
    reserved = st.builds(lambda o: (o << 16) | RESERVED, st.sampled_from(OWNERS))
    malformed = st.one_of(
        st.builds(lambda t: int64(t | (1 << 63)), written | reserved),
        st.builds(lambda t: (t & ~3) | 3, written),
        st.builds(lambda n: int64((-1 << 16) | (n << 2) | WRITTEN), st.integers(0, page_size)),
        st.integers(-(1 << 63), (1 << 63) - 1),
    )
    return st.one_of(st.just(0), reserved, written, written, malformed)


@st.composite
def pool_world(draw, max_pages=5):
    """Pool geometry and tags: ``(num_pages, page_size, num_kv_heads, group, tag list)``."""
    num_pages = draw(st.integers(1, max_pages))
    page_size = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    return (
        num_pages,
        page_size,
        kv_heads,
        group,
        draw(st.lists(tags(page_size), min_size=num_pages, max_size=num_pages)),
    )


@st.composite
def read_world(draw):
    """A hostile reader batch: tables with entries in and out of the pool (and the int32 extremes),
    lengths in and out of the table, expected owners in and out of range, per sequence or entry."""
    num_pages, page_size, kv_heads, group, tag_list = draw(pool_world())
    batch = draw(st.integers(1, 3))
    max_pages = draw(st.integers(1, 3))
    entry = st.integers(-2, num_pages + 1) | st.sampled_from([-(1 << 31), (1 << 31) - 1])
    table = draw(
        st.lists(
            st.lists(entry, min_size=max_pages, max_size=max_pages), min_size=batch, max_size=batch
        )
    )
    capacity = max_pages * page_size
    length = st.integers(-2, capacity + 2) | st.sampled_from([-(1 << 31), (1 << 31) - 1])
    seq_lens = draw(st.lists(length, min_size=batch, max_size=batch))
    per_entry = draw(st.booleans())
    shape = (batch, max_pages) if per_entry else (batch,)
    flat = draw(st.lists(owners(), min_size=math.prod(shape), max_size=math.prod(shape)))
    seed = draw(st.integers(0, 2**16))
    return dict(
        num_pages=num_pages,
        page_size=page_size,
        kv_heads=kv_heads,
        group=group,
        tags=tag_list,
        table=table,
        seq_lens=seq_lens,
        expected=flat,
        per_entry=per_entry,
        max_pages=max_pages,
        seed=seed,
    )


# --- the reader's rule ---------------------------------------------------------------------------


def reader_oracle(w):
    """``(allowed, report)``: ``allowed[b]`` the ``(page, slot, key position)`` a sequence may read,
    ``report`` the expected report fields as lists."""
    size, num_pages, max_pages = w["page_size"], w["num_pages"], w["max_pages"]
    capacity = max_pages * size
    allowed, rows = [], []
    for b, row in enumerate(w["table"]):
        length = min(max(w["seq_lens"][b], 0), capacity)
        reasons, mine = [], []
        for i, p in enumerate(row):
            exp = w["expected"][b * max_pages + i] if w["per_entry"] else w["expected"][b]
            slots_read = min(max(length - i * size, 0), size)
            if slots_read == 0:
                reasons.append(0)
                continue
            if not 0 <= p < num_pages:
                reasons.append(OOR)
                continue
            tag = w["tags"][p]
            s = state(tag)
            reason = (
                V_FREE
                if s == FREE
                else V_RESERVED
                if s == RESERVED
                else MISMATCH
                if not good_owner(exp) or owner_of(tag) != exp
                else UNWRITTEN
                if valid_len(tag) < slots_read
                else 0
            )
            reasons.append(reason)
            if s == WRITTEN and good_owner(exp) and owner_of(tag) == exp:
                mine += [
                    (p, slot, i * size + slot) for slot in range(min(slots_read, valid_len(tag)))
                ]
        beyond = int(w["seq_lens"][b] > capacity)
        bits = functools.reduce(lambda x, y: x | y, reasons, 0) | (OOR if beyond else 0)
        rows.append(
            (
                sum(r != 0 for r in reasons) + beyond,
                bits,
                sum(min(max(length - i * size, 0), size) > 0 for i in range(max_pages)),
                reasons,
                beyond,
            )
        )
        allowed.append(mine)
    report = dict(
        violations=[r[0] for r in rows],
        reasons=[r[1] for r in rows],
        pages_checked=[r[2] for r in rows],
        page_reasons=[r[3] for r in rows],
        beyond_table=[r[4] for r in rows],
    )
    return allowed, report


def materialise(w):
    """Tensors of a world: pools with values in every slot some sequence may read and NaN in all
    others, the table, lengths, tags and expected owners."""
    allowed, _ = reader_oracle(w)
    g = torch.Generator().manual_seed(w["seed"])
    shape = (w["num_pages"], w["page_size"], w["kv_heads"], HEAD_DIM)
    k = torch.full(shape, math.nan, dtype=F16)
    v = torch.full(shape, math.nan, dtype=F16)
    for p, slot, _ in {(p, s, 0) for mine in allowed for p, s, _ in mine}:
        k[p, slot] = torch.randn(w["kv_heads"], HEAD_DIM, generator=g).to(F16)
        v[p, slot] = torch.randn(w["kv_heads"], HEAD_DIM, generator=g).to(F16)
    exp = torch.tensor(w["expected"], dtype=torch.int64)
    return dict(
        k_cache=k,
        v_cache=v,
        block_table=torch.tensor(w["table"], dtype=torch.int32),
        seq_lens=torch.tensor(w["seq_lens"], dtype=torch.int32),
        page_tags=torch.tensor(w["tags"], dtype=torch.int64),
        expected=exp.view(len(w["table"]), -1) if w["per_entry"] else exp,
    )


def attend(q, keys, values, scale):
    """float64 attention of ``q`` ``[H, D]`` over ``keys``/``values`` ``[N, Hkv, D]`` (GQA);
    ``(zeros, -inf)`` over nothing."""
    heads = q.shape[0]
    if keys.shape[0] == 0:
        return torch.zeros(heads, HEAD_DIM, dtype=torch.float64), torch.full(
            (heads,), -math.inf, dtype=torch.float64
        )
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), v), torch.logsumexp(logits, -1)


@contextlib.contextmanager
def poisoned_reports():
    """Report buffers as kernels receive them, but with every page_reasons entry poisoned."""
    real = OwnershipReport.allocate.__func__

    def allocate(cls, batch, max_pages, device):
        report = real(cls, batch, max_pages, device)
        report.page_reasons.fill_(POISON)
        return report

    with mock.patch.object(OwnershipReport, "allocate", classmethod(allocate)):
        yield


def assert_report(report, want, backend):
    for field, value in want.items():
        got = getattr(report, field).tolist()
        assert got == value, f"{backend}: {field} {got}, expected {value}"


def values_valid(w, q_lens=None) -> bool:
    """Whether validate=True accepts the values (docs/ownership.md section 3)."""
    capacity = w["max_pages"] * w["page_size"]
    for b, length in enumerate(w["seq_lens"]):
        if not 0 <= length <= capacity or (q_lens is not None and q_lens[b] > length):
            return False
        for i in range(-(-length // w["page_size"])):
            exp = w["expected"][b * w["max_pages"] + i] if w["per_entry"] else w["expected"][b]
            if not good_owner(exp):
                return False
    return True


@pytest.mark.parametrize("backend", READERS)
@fuzz
@given(w=read_world(), validate=st.sampled_from([False, True]), scale=st.sampled_from([None, 0.3]))
def test_decode_on_hostile_batches_matches_the_oracle(backend, w, validate, scale):
    t = materialise(w)
    batch = len(w["table"])
    heads = w["kv_heads"] * w["group"]
    q = torch.randn(batch, heads, HEAD_DIM, generator=torch.Generator().manual_seed(w["seed"] + 1))
    q = q.to(F16)
    args = (
        q,
        t["k_cache"],
        t["v_cache"],
        t["block_table"],
        t["seq_lens"],
        t["page_tags"],
        t["expected"],
    )
    if validate and not values_valid(w):
        with pytest.raises(ValueError, match="seq_lens|expected"):
            kvattn.paged_decode(*args, backend=backend, validate=True)
        return
    with poisoned_reports():
        out, lse, report = kvattn.paged_decode(
            *args, backend=backend, validate=validate, scale=scale, return_lse=True
        )
    allowed, want = reader_oracle(w)
    assert_report(report, want, backend)
    scale = HEAD_DIM**-0.5 if scale is None else scale
    assert torch.isfinite(out).all(), f"{backend}: a refused (NaN) slot reached the output"
    for b, mine in enumerate(allowed):
        keys = (
            torch.stack([t["k_cache"][p, s] for p, s, _ in mine]) if mine else torch.zeros(0, 1, 1)
        )
        vals = (
            torch.stack([t["v_cache"][p, s] for p, s, _ in mine]) if mine else torch.zeros(0, 1, 1)
        )
        want_out, want_lse = attend(q[b], keys, vals, scale)
        torch.testing.assert_close(out[b].double(), want_out, **tolerance(F16))
        torch.testing.assert_close(lse[b].double(), want_lse, atol=1e-2, rtol=1e-2)


@st.composite
def extend_world(draw):
    w = draw(read_world())
    batch = len(w["table"])
    total_q = draw(st.integers(0, 5))
    if draw(st.booleans()):  # well formed
        cuts = sorted(
            draw(st.lists(st.integers(0, total_q), min_size=batch - 1, max_size=batch - 1))
        )
        cu = [0] + cuts + [total_q]
    else:
        cu = draw(st.lists(st.integers(-3, total_q + 3), min_size=batch + 1, max_size=batch + 1))
    w.update(total_q=total_q, cu=cu, causal=draw(st.booleans()))
    return w


def extend_oracle(w, q, k_cache, v_cache, scale):
    """``(out, lse)`` float64 of every row; rows no sequence covers are 0 / -inf."""
    total_q, heads = q.shape[:2]
    allowed, _ = reader_oracle(w)
    offsets, top = [], 0
    for c in w["cu"]:
        top = max(top, min(max(c, 0), total_q))
        offsets.append(top)
    out = torch.zeros(total_q, heads, HEAD_DIM, dtype=torch.float64)
    lse = torch.full((total_q, heads), -math.inf, dtype=torch.float64)
    for b, mine in enumerate(allowed):
        lo, hi = offsets[b], offsets[b + 1]
        length = w["seq_lens"][b]
        if hi == lo or hi - lo > length:
            continue
        for j in range(hi - lo):
            pos = length - (hi - lo) + j
            keys = [(p, s) for p, s, key in mine if not w["causal"] or key <= pos]
            kk = torch.stack([k_cache[p, s] for p, s in keys]) if keys else torch.zeros(0, 1, 1)
            vv = torch.stack([v_cache[p, s] for p, s in keys]) if keys else torch.zeros(0, 1, 1)
            out[lo + j], lse[lo + j] = attend(q[lo + j], kk, vv, scale)
    return out, lse


def offsets_valid(w) -> bool:
    cu = w["cu"]
    return cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] == w["total_q"]


@pytest.mark.parametrize("backend", backends_under_test("extend"))
@fuzz
@given(w=extend_world(), validate=st.sampled_from([False, True]))
def test_extend_on_hostile_batches_matches_the_oracle(backend, w, validate):
    t = materialise(w)
    heads = w["kv_heads"] * w["group"]
    g = torch.Generator().manual_seed(w["seed"] + 2)
    q = torch.randn(w["total_q"], heads, HEAD_DIM, generator=g).to(F16)
    cu = torch.tensor(w["cu"], dtype=torch.int32)
    args = (
        q,
        t["k_cache"],
        t["v_cache"],
        cu,
        t["block_table"],
        t["seq_lens"],
        t["page_tags"],
        t["expected"],
    )
    q_lens = [b - a for a, b in zip(w["cu"], w["cu"][1:])]
    if validate and not (offsets_valid(w) and values_valid(w, q_lens)):
        with pytest.raises(ValueError, match="cu_seqlens_q|seq_lens|expected"):
            kvattn.paged_extend(*args, backend=backend, validate=True, causal=w["causal"])
        return
    with poisoned_reports():
        out, lse, report = kvattn.paged_extend(
            *args, backend=backend, validate=validate, causal=w["causal"], return_lse=True
        )
    assert_report(report, reader_oracle(w)[1], backend)
    assert torch.isfinite(out).all(), (
        f"{backend}: a refused (NaN) slot or stale memory in the output"
    )
    want_out, want_lse = extend_oracle(w, q, t["k_cache"], t["v_cache"], HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), want_out, **tolerance(F16))
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-2, rtol=1e-2)


# --- hostile arguments: only ValueError or TypeError ---------------------------------------------


def _base_call(op):
    """A valid decode or extend call as a dict of arguments (fp16, 16-byte aligned pools)."""
    k = torch.randn(3, 2, 1, HEAD_DIM).to(F16)
    base = dict(
        k_cache=k,
        v_cache=k.clone(),
        block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([3, 2], dtype=torch.int32),
        page_tags=torch.tensor(
            [(1 << 16) | (2 << 2) | 2, (1 << 16) | (2 << 2) | 2, (2 << 16) | (2 << 2) | 2]
        ),
        expected=torch.tensor([1, 2]),
    )
    if op == "decode":
        base["q"] = torch.randn(2, 2, HEAD_DIM).to(F16)
    else:
        base["q"] = torch.randn(3, 2, HEAD_DIM).to(F16)
        base["cu_seqlens_q"] = torch.tensor([0, 2, 3], dtype=torch.int32)
    return base


def _hostile(name, t):
    """Replacements of a tensor argument a caller might pass by mistake or on purpose."""
    out = [
        None,
        3,
        "x",
        t.tolist(),
        t.double(),
        t.to(torch.int16),
        t.unsqueeze(0),
        t.flatten()[:1],
        t[:0],
        t.to("meta"),
        torch.empty(0),
    ]
    if t.dim() >= 1 and t.shape[0] > 1:
        out.append(t[:1].expand(t.shape))  # stride 0 over dim 0
    if t.dim() >= 2:
        out.append(t.transpose(0, -1))
    if t.is_floating_point() and t.dim() == 3:
        out.append(torch.cat([t, t], -1)[..., ::2])
    return out


def _hostile_calls(op):
    calls = []
    for name in _base_call(op):
        for i in range(len(_hostile(name, _base_call(op)[name]))):
            calls.append(("tensor", name, i))
    for key, values in (
        ("scale", [0, -1, math.inf, math.nan, 10**400, 1e-300, "0.1", True, 1j]),
        ("out", ["q", "k_cache", "page_tags", "expected", "stride0", "wrong_dtype"]),
        ("check", [1, None]),
        ("on_violation", ["warn", None]),
        ("backend", ["tpu", 3]),
        ("causal", [1, "yes"]),
        ("return_lse", [True]),
    ):
        if key != "causal" or op == "extend":
            calls += [("kwarg", key, v) for v in values]
    return calls


def _apply(op, kind, key, value):
    args = _base_call(op)
    kwargs = {}
    if kind == "tensor":
        args[key] = _hostile(key, args[key])[value]
    elif key == "out":
        q = args["q"]
        if value == "stride0":
            kwargs["out"] = torch.zeros(1, *q.shape[1:], dtype=q.dtype).expand(q.shape)
        elif value == "wrong_dtype":
            kwargs["out"] = torch.zeros(q.shape)
        else:
            t = args[value]
            buf = torch.zeros(
                max(t.numel() * t.element_size(), q.numel() * 2) + 16, dtype=torch.uint8
            )
            args[value] = buf[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            args[value].copy_(t)
            kwargs["out"] = buf[: q.numel() * 2].view(q.dtype).view(q.shape)
    else:
        kwargs[key] = value
    return args, kwargs


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_hostile_arguments_raise_only_value_or_type_errors(backend, op):
    """Every replacement of every argument, on every backend: a ValueError/TypeError or a result,
    never another exception; a result must have a report whose entries were all written."""
    for kind, key, value in _hostile_calls(op):
        args, kwargs = _apply(op, kind, key, value)
        fn = kvattn.paged_decode if op == "decode" else kvattn.paged_extend
        order = (
            ["q", "k_cache", "v_cache"]
            + (["cu_seqlens_q"] if op == "extend" else [])
            + ["block_table", "seq_lens", "page_tags", "expected"]
        )
        try:
            with poisoned_reports():
                result = fn(
                    *(args[n] for n in order), backend=kwargs.pop("backend", backend), **kwargs
                )
        except (ValueError, TypeError):
            continue
        except Exception as e:  # noqa: BLE001 - the property is about the exception's type
            raise AssertionError(f"{op} with {key} = {value!r}: {type(e).__name__}: {e}") from e
        report = result[-1]
        assert not (report.page_reasons == POISON).any(), (key, value)


# --- the writers -------------------------------------------------------------------------------


@st.composite
def write_world(draw):
    num_pages, page_size, kv_heads, _, tag_list = draw(pool_world())
    n = draw(st.integers(0, 8))
    slot = st.integers(-2, (num_pages + 1) * page_size) | st.sampled_from(
        [-(1 << 31), (1 << 31) - 1]
    )
    slots = []
    for _ in range(n):
        if slots and slots[-1] >= 0 and draw(st.booleans()):
            slots.append(slots[-1] + 1)
        else:
            slots.append(draw(slot))
    # Two landed tokens aimed at one slot keep either value (documented race): pad repeats.
    seen, unique = set(), []
    for s in slots:
        unique.append(s if s < 0 or s not in seen else -1)
        seen.add(s)
    per_token = draw(st.booleans())
    own = draw(st.lists(owners(), min_size=n, max_size=n)) if per_token else draw(owners())
    stride = draw(st.sampled_from([1, 1, 2, 3]))
    # A single valid owner goes in as a Python int as often as in a tensor.
    as_int = not per_token and good_owner(own) and draw(st.booleans())
    return dict(
        num_pages=num_pages,
        page_size=page_size,
        kv_heads=kv_heads,
        tags=tag_list,
        slots=unique,
        owners=own,
        stride=stride,
        seed=draw(st.integers(0, 2**16)),
        as_int=as_int,
        int32=draw(st.booleans()) and all(-(1 << 31) <= s < (1 << 31) for s in unique),
    )


def write_oracle(w):
    """``(landed, reasons, new tags)`` of write_kv on a world."""
    size, num_pages, slots = w["page_size"], w["num_pages"], w["slots"]
    n = len(slots)
    own = w["owners"] if isinstance(w["owners"], list) else [w["owners"]] * n
    page = [s // size for s in slots]
    slot = [s % size for s in slots]
    in_range = [s >= 0 and page[i] < num_pages for i, s in enumerate(slots)]
    hold = [in_range[i] and held(w["tags"][page[i]], own[i]) for i in range(n)]
    start = list(range(n))
    for i in range(1, n):
        if hold[i] and hold[i - 1] and page[i] == page[i - 1] and slot[i] == slot[i - 1] + 1:
            start[i] = start[i - 1]

    def prefix(i):
        tag = w["tags"][page[i]]
        return valid_len(tag) if state(tag) == WRITTEN else 0

    landed = [hold[i] and slot[start[i]] <= prefix(i) for i in range(n)]
    reasons = [
        0
        if slots[i] < 0 or landed[i]
        else D_OOR
        if not in_range[i]
        else D_NOT_HELD
        if not hold[i]
        else D_GAP
        for i in range(n)
    ]
    tags_after = list(w["tags"])
    for i in range(n):
        if landed[i]:
            stamp = (own[i] << 16) | ((slot[i] + 1) << 2) | WRITTEN
            tags_after[page[i]] = max(tags_after[page[i]], stamp)
    return landed, reasons, tags_after


@pytest.mark.parametrize("writer", WRITERS)
@fuzz
@given(w=write_world(), validate=st.sampled_from([None, False]), device_path=st.booleans())
def test_write_kv_on_hostile_inputs_matches_the_oracle(writer, w, validate, device_path):
    n = len(w["slots"])
    size, heads = w["page_size"], w["kv_heads"]
    g = torch.Generator().manual_seed(w["seed"])
    k = torch.randn(n, heads, HEAD_DIM, generator=g).to(F16)
    v = torch.randn(n, heads, HEAD_DIM, generator=g).to(F16)
    shape = (w["num_pages"], size, heads, HEAD_DIM)
    k_cache, v_cache = (
        torch.full(shape, math.nan, dtype=F16),
        torch.full(shape, math.nan, dtype=F16),
    )
    page_tags = torch.tensor(w["tags"], dtype=torch.int64)
    dtype = torch.int32 if w["int32"] else torch.int64
    wide = torch.full((max(n, 1), w["stride"]), -7, dtype=dtype)
    wide[:n, 0] = torch.tensor(w["slots"], dtype=dtype)
    mapping = wide[:n, 0]
    owner = w["owners"] if w["as_int"] else torch.tensor(w["owners"], dtype=torch.int64)
    all_owners = w["owners"] if isinstance(w["owners"], list) else [w["owners"]]
    bad_owner = not all(good_owner(o) for o in all_owners)
    with mock.patch.object(torch_writer, "rows_on_host", lambda t: not device_path):
        if bad_owner and validate is None:
            with pytest.raises(ValueError, match="owner"):
                kvattn.write_kv(
                    k,
                    v,
                    k_cache,
                    v_cache,
                    mapping,
                    page_tags,
                    owner,
                    backend=writer,
                    validate=validate,
                )
            assert page_tags.tolist() == w["tags"] and torch.isnan(k_cache).all()
            return
        result = kvattn.write_kv(
            k, v, k_cache, v_cache, mapping, page_tags, owner, backend=writer, validate=validate
        )
    landed, reasons, tags_after = write_oracle(w)
    assert result.landed.tolist() == landed and result.drop_reasons.tolist() == reasons, writer
    assert result.dropped_count() == sum(r != 0 for r in reasons)
    assert page_tags.tolist() == tags_after, writer
    want_k = torch.full(shape, math.nan, dtype=F16)
    want_v = want_k.clone()
    for i, ok in enumerate(landed):
        if ok:
            want_k[w["slots"][i] // size, w["slots"][i] % size] = k[i]
            want_v[w["slots"][i] // size, w["slots"][i] % size] = v[i]
    assert torch.equal(k_cache.view(torch.int16), want_k.view(torch.int16)), writer
    assert torch.equal(v_cache.view(torch.int16), want_v.view(torch.int16)), writer


# --- the page-level writers ----------------------------------------------------------------------


@st.composite
def page_calls(draw):
    num_pages, page_size, _, _, tag_list = draw(pool_world())
    fn = draw(st.sampled_from(["reserve", "release", "commit", "reassign"]))
    n = draw(st.integers(0, 4))
    pages = draw(st.lists(st.integers(-2, num_pages + 1), min_size=n, max_size=n))
    own = draw(st.lists(owners(), min_size=n, max_size=n))
    heirs = draw(st.lists(owners(), min_size=n, max_size=n))
    lens = draw(st.lists(st.integers(-2, page_size + 2), min_size=n, max_size=n))
    return dict(
        num_pages=num_pages,
        page_size=page_size,
        tags=tag_list,
        fn=fn,
        pages=pages,
        owners=own,
        heirs=heirs,
        lens=lens,
    )


def page_oracle(c):
    """``(result (landed, reasons) or None, new tags)`` of an unchecked page-level call."""
    tags_after = list(c["tags"])
    num_pages, fn = c["num_pages"], c["fn"]
    landed, reasons = [], []
    for i, p in enumerate(c["pages"]):
        if not 0 <= p < num_pages:
            landed.append(False)
            reasons.append(D_OOR)
            continue
        tag, owner = c["tags"][p], c["owners"][i]
        if fn == "reserve":
            tags_after[p] = (owner << 16) | RESERVED if good_owner(owner) else 0
        elif fn == "release":
            tags_after[p] = 0
        elif fn == "commit":
            ok = held(tag, owner) and 0 <= c["lens"][i] <= c["page_size"]
            landed.append(ok)
            reasons.append(0 if ok else D_NOT_HELD if not held(tag, owner) else D_BAD_LENGTH)
            if ok:
                tags_after[p] = max(tags_after[p], (owner << 16) | (c["lens"][i] << 2) | WRITTEN)
        else:
            heir = c["heirs"][i]
            ok = held(tag, owner) and good_owner(heir)
            landed.append(ok)
            reasons.append(0 if ok else D_NOT_HELD)
            if held(tag, owner):
                tags_after[p] = (heir << 16) | (tag & 0xFFFF) if good_owner(heir) else 0
    return (landed, reasons) if fn in ("commit", "reassign") else None, tags_after


@fuzz
@given(c=page_calls(), device_path=st.booleans())
def test_page_writers_on_hostile_inputs_match_the_oracle(c, device_path):
    """Unchecked (validate=False): the oracle; checked: a ValueError exactly when an id is bad."""
    pages = torch.tensor(c["pages"], dtype=torch.int64)
    own, heirs = (
        torch.tensor(c["owners"], dtype=torch.int64),
        torch.tensor(c["heirs"], dtype=torch.int64),
    )
    lens = torch.tensor(c["lens"], dtype=torch.int64)

    def call(tags, validate):
        return {
            "reserve": lambda: kvattn.reserve_pages(tags, pages, own, validate=validate),
            "release": lambda: kvattn.release_pages(tags, pages, validate=validate),
            "commit": lambda: kvattn.commit_pages(
                tags, pages, own, lens, c["page_size"], validate=validate
            ),
            "reassign": lambda: kvattn.reassign_pages(tags, pages, own, heirs, validate=validate),
        }[c["fn"]]()

    # Duplicate pages set outright race (either value wins): keep the oracle's single answer.
    duplicates = len(set(c["pages"])) != len(c["pages"])
    with mock.patch.object(torch_writer, "rows_on_host", lambda t: not device_path):
        tags = torch.tensor(c["tags"], dtype=torch.int64)
        result = call(tags, False)
        want_result, want_tags = page_oracle(c)
        if not duplicates or c["fn"] in ("release", "commit"):
            assert tags.tolist() == want_tags, c
        if want_result is not None:
            assert (result.landed.tolist(), result.drop_reasons.tolist()) == want_result, c
        checked = torch.tensor(c["tags"], dtype=torch.int64)
        bad_pages = c["fn"] in ("reserve", "release") and any(
            not 0 <= p < c["num_pages"] for p in c["pages"]
        )
        bad_ids = (c["fn"] != "release" and not all(map(good_owner, c["owners"]))) or (
            c["fn"] == "reassign" and not all(map(good_owner, c["heirs"]))
        )
        if bad_pages or bad_ids:
            with pytest.raises(ValueError, match="pages|owner|new_owner"):
                call(checked, None)
            assert checked.tolist() == c["tags"]


# --- traces with interleaved writers -------------------------------------------------------------


@pytest.mark.parametrize("device_path", [False, True])
@fuzz
@given(data=st.data(), page_size=st.sampled_from([2, 4]))
def test_random_traces_with_interleaved_writers(device_path, data, page_size):
    """Random traces (tests/contract/test_traces.py) where, at random steps, one write's call is
    interrupted just before its first store and another write on the same pages runs whole: an
    append of one lease over a stray or late write of another owner (or the same). Model: the
    interrupted write's verdicts come from the state before, its stores land after. After every step
    the tags, every byte and the allocator match the model; a decode over live and stale leases
    matches it."""
    with mock.patch.object(torch_writer, "rows_on_host", lambda t: not device_path):
        t = Trace(page_size, "NHD")
        _prefill(t, data)
        for step in range(data.draw(st.integers(2, 6), label="steps")):
            if t.live() and data.draw(st.booleans(), label="interleave"):
                _interleaved_writes(t, data)
            else:
                _step(t, data)
            t.check_state()
            _decode_step(t, data, seed=step)


def _interleaved_writes(t, data):
    live = t.live()
    first_owner = data.draw(st.sampled_from(live), label="first")
    issued = sorted(t.model.leases)
    target = data.draw(st.sampled_from(issued), label="target")
    second_owner = data.draw(st.sampled_from(issued + [first_owner]), label="second")
    m = t.model.leases[first_owner]
    count = data.draw(st.integers(1, t.page_size + 1), label="count")
    if t.model.pages_needed(m, m.num_tokens + count) > t.model.free_page_count():
        return
    before = len(t.leases[first_owner].pages)
    t.cache.grow(t.leases[first_owner], m.num_tokens + count)
    t.model.take(m, t.leases[first_owner].pages[before:])
    first_slots = t.model.slot_ids(m, m.num_tokens, count)
    second_slots = _stray_slots(t, data, target)
    first_ids, second_ids = t.tokens(count), t.tokens(len(second_slots))
    verdict = t.model.decide_write(first_slots, [first_owner] * count)
    results = {}

    def second():
        k, v = t.signatures(second_ids)
        mapping = torch.tensor(second_slots, dtype=torch.int64)
        results["second"] = kvattn.write_kv(
            k,
            v,
            t.cache.k_cache,
            t.cache.v_cache,
            mapping,
            t.cache.page_tags,
            second_owner,
            backend="torch",
        )

    k, v = t.signatures(first_ids)
    spy = Interleave(t.cache.k_cache, second)
    with spy:
        results["first"] = kvattn.write_kv(
            k,
            v,
            t.cache.k_cache,
            t.cache.v_cache,
            torch.tensor(first_slots, dtype=torch.int64),
            t.cache.page_tags,
            first_owner,
            backend="torch",  # the spy interrupts the PyTorch writer's stores
        )
    spy.finish()
    t.assert_result(
        results["second"],
        *t.model.write(second_slots, [second_owner] * len(second_slots), second_ids),
    )
    t.model.apply_write(first_slots, [first_owner] * count, first_ids, verdict[0])
    t.assert_result(results["first"], *verdict)
    m.num_tokens += count
    t.leases[first_owner].num_tokens += count

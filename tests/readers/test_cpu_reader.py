"""The compiled CPU readers (csrc/cpu/attention_cpu.h, backend ``cpu``) where their work differs
from the reference's: query rows cut into tiles of several positions times the GQA group, keys
and values read a page at a time in blocks of 4 rows x 16 keys (head dims and page sizes that are
not multiples of the blocking), and a call's tiles spread over threads. The shared suites
(scenarios, variants, shapes, hardening, fuzz) run this backend too; here the inputs are shaped
so these paths are taken, compared with the float64 reference, NaN in every slot that must not be
read, and the threaded call compared bit for bit with the same call on one thread (tiles are
independent: each output row is computed by one thread, in one order).

Tolerances: float32 data and float32 compute against float64, so outputs differ by summation
order and the kernel's exp (Cephes' expf, within 2 ulp) only (``tolerance(float32)``), LSEs by
float32 rounding (``LSE_TOLERANCE``).
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn.backends import cpu as cpu_backend
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    Batch,
    assert_close_to_reference,
    assert_float32_read_as_reference,
    assert_reports_equal,
)
from kvattn_testing.variants import plant_foreign_page

pytestmark = pytest.mark.skipif(
    cpu_backend.STATUS.module is None or cpu_backend._cpu is None,
    reason=f"the compiled CPU readers are not built: {cpu_backend.STATUS.line()}",
)

HEADS, KV_HEADS, DIM = 6, 2, 20  # D = 20: one full block of 16 and a tail
F32 = torch.float32
VARIANTS = {
    "plain": {},
    "window": dict(window_left=29),
    "soft_cap": dict(logits_soft_cap=3.0),
}
# Sequence 0 alone is over the threshold that spreads a call over threads.
Q_LENS, PREFIX_LENS, PAGE = [150, 7, 40, 0], [61, 0, 5, 9], 12


def with_threads(n: int, run):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def work(q_lens, seq_lens, heads, dim) -> float:
    """The kernel's estimate of a call's work (attend() in csrc/cpu/attention_cpu.h)."""
    return sum(q * (n + 1) * heads * 2 * dim for q, n in zip(q_lens, seq_lens))


def ragged_extend(foreign: bool) -> Extend:
    """The ragged float32 batch of Q_LENS over PREFIX_LENS; ``foreign``: a foreign page (NaN)
    that only the later rows of sequence 0 reach (tokens 180-191: rows 119 on)."""
    ext = Extend.random(
        Q_LENS,
        PREFIX_LENS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=PAGE,
        dtype=F32,
        pool_factor=2,
        seed=11,
    )
    if foreign:
        plant_foreign_page(ext.pages, 0, 15)
    return ext


@pytest.mark.parametrize("foreign", [True, False], ids=["foreign", "twin"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_extend_over_threads(name, causal, foreign):
    """A ragged batch over two threads equals the same call on one, and the reference; a foreign
    page (NaN) that only the later rows of sequence 0 reach is refused and never contributes,
    its twin has none."""
    variant = VARIANTS[name]
    seq_lens = [p + q for p, q in zip(PREFIX_LENS, Q_LENS)]
    assert work(Q_LENS, seq_lens, HEADS, DIM) > cpu_backend._cpu.THREAD_WORK
    ext = ragged_extend(foreign)

    def run():
        return ext.run("cpu", causal=causal, return_lse=True, **variant)

    out, lse, report = with_threads(2, run)
    one_out, one_lse, one_report = with_threads(1, run)
    assert torch.equal(out, one_out) and torch.equal(lse, one_lse)
    assert_reports_equal(report, one_report)
    ref = ext.reference(causal=causal, compute_dtype=torch.float64, **variant)
    assert_float32_read_as_reference(out, lse, report, *ref)
    assert report.violations.tolist() == ([1, 0, 0, 0] if foreign else [0, 0, 0, 0])


@pytest.mark.parametrize("foreign", [True, False], ids=["foreign", "twin"])
@pytest.mark.parametrize("page_size", [5, 40])
@pytest.mark.parametrize("group", [1, 3, 5, 8, 9])
def test_decode_of_groups_around_the_row_blocking(group, page_size, foreign):
    """GQA groups of 1 to 8 query heads per KV head (rows padded to blocks of 4; keys in the
    lanes, softmax_few) and of 9 (the rows in the lanes), pages of 5 keys (one partial block of
    16) and of 40 (two whole blocks and a partial one), a batch large enough for two threads; a
    foreign page (NaN) in one sequence, its twin has none."""
    lens = [0, 1, 4, 33, 2900, 6110, 77]
    heads = 4 * group
    assert work([1] * len(lens), lens, heads, 64) > cpu_backend._cpu.THREAD_WORK
    pages = Batch.random(
        batch=len(lens),
        num_heads=heads,
        num_kv_heads=4,
        head_dim=64,
        page_size=page_size,
        seq_lens=lens,
        dtype=F32,
        seed=group,
    )
    if foreign:
        plant_foreign_page(pages, 5, 3000 // page_size)  # token 3000

    def run():
        return pages.decode("cpu", return_lse=True)

    out, lse, report = with_threads(2, run)
    one = with_threads(1, run)
    assert torch.equal(out, one[0]) and torch.equal(lse, one[1])
    ref = pages.reference(return_lse=True, compute_dtype=torch.float64)
    assert_float32_read_as_reference(out, lse, report, *ref)
    assert report.violations.tolist() == [0, 0, 0, 0, 0, int(foreign), 0]


@pytest.mark.parametrize("isa", cpu_backend.ISA_NAMES[1:])
def test_each_instruction_set_reads_as_the_reference(isa, monkeypatch):
    """The kernels are compiled once per instruction set from one source; a call runs the widest
    the CPU has (the suites above), and the narrower ones here, capped as KVATTN_CPU_MAX_ISA caps
    them: a decode through softmax_few (group 3) and through the rows in the lanes (group 9), and
    a windowed causal extend, each with a foreign page refused and never read."""
    monkeypatch.setattr(cpu_backend, "MAX_ISA", cpu_backend.ISA_NAMES.index(isa))
    if cpu_backend.isa() != isa:
        pytest.skip(f"this CPU runs {cpu_backend.isa()} at most under the cap, not {isa}")
    lens = [0, 33, 2900, 77]
    for group in (3, 9):
        pages = Batch.random(
            batch=len(lens),
            num_heads=2 * group,
            num_kv_heads=2,
            head_dim=64,
            page_size=40,
            seq_lens=lens,
            dtype=F32,
            seed=group,
        )
        plant_foreign_page(pages, 2, 10)
        out, lse, report = pages.decode("cpu", return_lse=True)
        ref = pages.reference(return_lse=True, compute_dtype=torch.float64)
        assert_float32_read_as_reference(out, lse, report, *ref)
        assert report.violations.tolist() == [0, 0, 1, 0]
    # Pools of 16-bit floats go through the set's conversion (whole vectors of 16, then a tail:
    # head dim 40), output rounded to the dtype.
    for dtype in (torch.bfloat16, torch.float16):
        pages = Batch.random(
            batch=len(lens),
            num_heads=6,
            num_kv_heads=2,
            head_dim=40,
            page_size=40,
            seq_lens=lens,
            dtype=dtype,
            seed=5,
        )
        plant_foreign_page(pages, 2, 10)
        out, report = pages.decode("cpu")
        ref_out, ref_report = pages.reference(compute_dtype=torch.float64)
        assert_close_to_reference(out, ref_out, dtype)
        assert_reports_equal(report, ref_report)
    ext = ragged_extend(foreign=True)
    out, lse, report = ext.run("cpu", causal=True, return_lse=True, window_left=29)
    ref = ext.reference(causal=True, compute_dtype=torch.float64, window_left=29)
    assert_float32_read_as_reference(out, lse, report, *ref)
    assert report.violations.tolist() == [1, 0, 0, 0]


def test_the_binding_refuses_a_null_pointer_its_mode_reads(monkeypatch):
    """The launcher's argument dict, passed on to the binding with one pointer null at a time
    (while the launcher's tensors are alive): what the mode reads raises ValueError naming it,
    instead of a read through address 0; lse may be null (not asked); the twin, the dict as the
    launcher built it, runs."""
    pages = Batch.random(
        batch=2, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, seq_lens=[5, 9], dtype=F32
    )
    ext = cpu_backend._cpu
    null = {}

    class Nulling:
        def __getattr__(self, name):
            return getattr(ext, name)

        def attend(self, call, dtype, mode):
            return ext.attend({**call, **null}, dtype, mode)

    monkeypatch.setattr(cpu_backend, "_cpu", Nulling())
    reads = ("q", "k", "v", "block_table", "seq_lens", "out", "tags", "expected")
    writes = ("violations", "reasons", "checked", "beyond", "page_reasons")
    for name in reads + writes:
        null.clear()
        null[name] = 0
        with pytest.raises(ValueError, match=f"{name} is null"):
            pages.decode("cpu")
    null.clear()
    null["lse"] = 0
    pages.decode("cpu")
    null.clear()
    out, report = pages.decode("cpu")
    assert report.violations.tolist() == [0, 0]
    verdict = kvattn.resolve_pages(
        pages.block_table, pages.seq_lens, pages.page_tags, pages.expected, page_size=8
    )
    null["verdict"] = 0
    with pytest.raises(ValueError, match="verdict is null"):
        pages.decode("cpu", verdict=verdict)
    null.clear()
    assert pages.decode("cpu", verdict=verdict)[1].violations.tolist() == [0, 0]


def test_cpu_max_isa_is_checked(monkeypatch):
    monkeypatch.setenv("KVATTN_CPU_MAX_ISA", "avx2")
    assert cpu_backend._max_isa() == 1
    monkeypatch.setenv("KVATTN_CPU_MAX_ISA", "sse9")
    with pytest.raises(ValueError, match="KVATTN_CPU_MAX_ISA: expected one of avx512, avx2"):
        cpu_backend._max_isa()


def test_exp_within_two_ulp():
    """The readers' exp (Cephes' expf, vectorizable) against float64 exp over the range softmax
    weights take, x in [-87, 0]: within 2 float32 ulp; 0 below the range and at -inf, 1 at 0."""
    exp = cpu_backend._cpu.exp_nonpositive
    xs = torch.cat([-torch.logspace(-8, 1.9395, 4000, dtype=torch.float64), torch.zeros(1)])
    xs = xs.float().double()  # the float32 inputs the kernel sees
    got = torch.tensor([exp(float(x)) for x in xs], dtype=torch.float64)
    want = torch.exp(xs)
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want.float()).exponent - 24)
    assert ((got - want).abs() <= 2 * ulp).all(), float(((got - want).abs() / ulp).max())
    assert exp(0.0) == 1.0 and exp(-88.0) == 0.0 and exp(float("-inf")) == 0.0


def _one_page(page_size: int, values: torch.Tensor):
    """A pool of one page WRITTEN in full for owner 1: K zero (every score equal), V ``values``
    ``[page_size, dim]`` under one KV head."""
    k = torch.zeros(1, page_size, 1, values.shape[1])
    v = values[:, None, :].clone()[None]
    tags = torch.tensor([kvattn.written_tag(1, page_size)], dtype=torch.int64)
    return k, v, tags


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1.0], ids=["inf", "nan", "twin"])
def test_a_key_no_row_of_the_tile_may_read_adds_nothing(value):
    """A causal tile of two rows over two keys: row 0 may not read key 1, row 1 does. Whatever
    key 1's value holds (inf, NaN: the sequence's own slot), row 0 is key 0's value; the twin
    with a finite value shows row 1 reading key 1."""
    values = torch.tensor([[2.0, -3.0], [value, value]])
    k, v, tags = _one_page(2, values)
    q = torch.zeros(2, 1, 2)
    out, lse, report = kvattn.paged_extend(
        q,
        k,
        v,
        torch.tensor([0, 2], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        tags,
        torch.ones(1, 1, dtype=torch.int64),
        backend="cpu",
        return_lse=True,
    )
    assert out[0, 0].tolist() == [2.0, -3.0] and lse[0, 0].item() == 0.0
    assert not report.any()
    if value == 1.0:
        torch.testing.assert_close(out[1, 0], torch.tensor([1.5, -1.0]))


def test_positions_past_float_precision():
    """A decode and an extend at 2**24 + 5 and + 6 tokens under a window of 0 (each row reads its
    own key only) over one page repeated in every entry: positions compared as float32 would
    round 2**24 + 5 to 2**24 + 4 and drop the row's own key. Each row is exactly its key's value."""
    page = 1024
    values = torch.arange(page, dtype=torch.float32)[:, None].repeat(1, 2)
    k, v, tags = _one_page(page, values)
    length = 2**24 + 6
    pages = -(-length // page)
    table = torch.zeros(2, pages, dtype=torch.int32)
    expected = torch.ones(2, pages, dtype=torch.int64)
    lens = torch.tensor([length - 1, length], dtype=torch.int32)
    out, report = kvattn.paged_decode(
        torch.zeros(2, 1, 2), k, v, table, lens, tags, expected, backend="cpu", window_left=0
    )
    assert out[:, 0, 0].tolist() == [(length - 2) % page, (length - 1) % page]
    assert report.violations.tolist() == [0, 0]
    out, report = kvattn.paged_extend(
        torch.zeros(2, 1, 2),
        k,
        v,
        torch.tensor([0, 2], dtype=torch.int32),
        table[:1],
        lens[1:],
        tags,
        expected[:1],
        backend="cpu",
        window_left=0,
    )
    assert out[:, 0, 0].tolist() == [(length - 2) % page, (length - 1) % page]
    assert report.violations.tolist() == [0]

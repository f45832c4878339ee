"""The shapes peers' kernel tests feed: page sizes that are not powers of two and up to 1024 tokens,
head dims from 1 to 512 (odd ones included), and non-causal extend with more query rows than keys.

Every case runs on every backend against the reference and against :func:`test_extend.dense_extend`
(float64 attention written from the definition, told which tokens are allowed by the test rather
than by the tag rule), with a NaN-filled foreign page placed where a sequence reads it.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import Violation, backends
from kvattn_testing.extend import Extend, assert_close, dense_extend
from kvattn_testing.util import (
    DEVICE,
    LSE_TOLERANCE,
    Batch,
    assert_reports_equal,
    backends_under_test,
)

FOREIGN_OWNER = 99


def boundary_lens(page: int) -> list[int]:
    """P - 1, P, P + 1 and 2P + 1 tokens (P - 1 dropped for one-token pages)."""
    return [n for n in (page - 1, page, page + 1, 2 * page + 1) if n >= 1]


def plant_foreign_page(pages: Batch, b: int, i: int) -> int:
    """Entry ``i`` of sequence ``b`` now names a page written in full for another owner and filled
    with NaN: what a reused page looks like to a reader it does not belong to. Returns the page."""
    num_pages = pages.k_cache.shape[0]
    used = set(pages.block_table.flatten().tolist())
    spare = next(p for p in range(num_pages) if p not in used)
    pages.k_cache[spare] = float("nan")
    pages.v_cache[spare] = float("nan")
    pages.page_tags[spare] = kvattn.written_tag(FOREIGN_OWNER, pages.k_cache.shape[1])
    pages.block_table[b, i] = spare
    return spare


def gather(pages: Batch, b: int):
    """K/V ``[seq_len, Hkv, D]`` of sequence ``b`` by plain indexing, and which tokens the test
    allows: those not on a foreign page."""
    n = int(pages.seq_lens[b])
    size = pages.k_cache.shape[1]
    idx = torch.arange(n)
    phys = pages.block_table[b].long().cpu()[idx // size]
    allowed = [
        int(pages.page_tags[p]) >> kvattn.tags.OWNER_SHIFT != FOREIGN_OWNER for p in phys.tolist()
    ]
    return pages.k_cache.cpu()[phys, idx % size], pages.v_cache.cpu()[phys, idx % size], allowed


def dense_decode(pages: Batch):
    """Decode as extend with one query row per sequence, computed from the definition."""
    batch = pages.q.shape[0]
    keys, values, allowed = zip(*(gather(pages, b) for b in range(batch)))
    cu = torch.arange(batch + 1, dtype=torch.int32)
    return dense_extend(pages.q.cpu(), cu, keys, values, allowed, pages.q.shape[-1] ** -0.5)


def backends_for(dtype, op="decode", **shape) -> list[str]:
    """Backends that run this shape here; the probe batch is tiny."""
    probe = Batch.random(batch=1, seq_lens=[1], dtype=dtype, **shape)
    args = probe.args()
    if op == "extend":
        cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
        args = kvattn.layout.validate_extend(
            probe.q,
            probe.k_cache,
            probe.v_cache,
            cu,
            probe.block_table,
            probe.seq_lens,
            probe.page_tags,
            probe.expected,
        )
    return [name for name, why in backends.explain(args, op=op).items() if why is None]


def check_decode(pages: Batch, backend: str, refused: dict[int, int]):
    """Output finite and equal to the reference and the formula; the report names exactly the
    ``refused`` {sequence: entry} pages as OWNER_MISMATCH."""
    out, lse, report = pages.decode(backend, return_lse=True)
    ref_out, ref_lse, ref_report = pages.reference(return_lse=True, compute_dtype=torch.float64)
    want_out, want_lse = dense_decode(pages)
    assert_close(out, ref_out, pages.q.dtype)
    assert_close(out, want_out, pages.q.dtype)
    torch.testing.assert_close(ref_out.cpu(), want_out, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(lse.double().cpu(), want_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    want = [1 if b in refused else 0 for b in range(pages.q.shape[0])]
    assert report.violations.tolist() == want
    for b, i in refused.items():
        assert int(report.page_reasons[b, i]) == int(Violation.OWNER_MISMATCH)


# --- page sizes ---------------------------------------------------------------------------------

PAGE_SIZES = [3, 5, 48, 80, 512, 1000, 1024]


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("backend", backends_under_test())
def test_decode_any_page_size_at_page_boundaries(backend, page):
    lens = boundary_lens(page)
    pages = Batch.random(
        batch=len(lens) + 1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=page,
        seq_lens=lens + [2 * page + 1],
        pool_factor=2,
    )
    plant_foreign_page(pages, len(lens), 1)
    check_decode(pages, backend, refused={len(lens): 1})


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("backend", backends_under_test())
def test_decode_any_page_size_without_the_foreign_page_is_clean(backend, page):
    """The twin: the same lengths with every page the reader's own report nothing."""
    lens = boundary_lens(page)
    pages = Batch.random(
        batch=len(lens),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=page,
        seq_lens=lens,
        pool_factor=2,
    )
    check_decode(pages, backend, refused={})


def test_page_size_bounds_are_named():
    for page in (0, kvattn.layout.MAX_PAGE_SIZE + 1):
        pool = torch.zeros(2, page, 1, 16, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"k_cache: .*page_size \(dim 1\) in \[1, 1024\]"):
            kvattn.layout.check_kv_pools(pool, pool)


# --- head dims ----------------------------------------------------------------------------------

HEAD_DIMS = [1, 13, 59, 72, 192, 320, 512]


@pytest.mark.parametrize("page", [16, 5])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_any_head_dim(head_dim, page):
    shape = dict(num_heads=4, num_kv_heads=1, head_dim=head_dim, page_size=page)
    names = backends_for(torch.float16, **shape)
    assert names == backends_under_test(), "every backend runs head dims 1 to 512"
    lens = boundary_lens(page) + [2 * page + 1]
    for backend in names:
        pages = Batch.random(batch=len(lens), seq_lens=lens, pool_factor=2, **shape)
        plant_foreign_page(pages, len(lens) - 1, 0)
        check_decode(pages, backend, refused={len(lens) - 1: 0})


def test_head_dim_past_512_is_refused_by_the_kernels_with_the_reason():
    probe = Batch.random(
        batch=1, num_heads=1, num_kv_heads=1, head_dim=520, page_size=4, seq_lens=[3]
    ).args()
    reasons = backends.explain(probe)
    # PyTorch ops and the compiled CPU decode (plain loops over a row) have no register tile to
    # outgrow.
    untiled = {"reference", "torch", "cpu"}
    assert all(reasons[name] is None for name in untiled & set(backends_under_test()))
    for name in set(backends_under_test()) - untiled:
        assert "head_dim 520" in reasons[name], (name, reasons[name])


# --- extend -------------------------------------------------------------------------------------


def check_extend(ext: Extend, backend: str, causal: bool, refused: dict[int, int]):
    out, lse, report = ext.run(backend, causal=causal, return_lse=True)
    ref_out, ref_lse, ref_report = ext.reference(causal=causal, compute_dtype=torch.float64)
    p = ext.pages
    keys, values, allowed = zip(*(gather(p, b) for b in range(len(ext.cu) - 1)))
    want_out, want_lse = dense_extend(
        ext.q, ext.cu, keys, values, allowed, ext.q.shape[-1] ** -0.5, causal=causal
    )
    assert_close(out, want_out, ext.q.dtype)
    torch.testing.assert_close(ref_out.cpu(), want_out, atol=1e-9, rtol=1e-9)
    finite = torch.isfinite(want_lse)
    assert torch.isneginf(lse.cpu()[~finite]).all()
    torch.testing.assert_close(lse.double().cpu()[finite], want_lse[finite], **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert report.violations.tolist() == [1 if b in refused else 0 for b in range(len(ext.cu) - 1)]


def extend_backends(dtype, **shape) -> list[str]:
    return backends_for(dtype, op="extend", **shape)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page,head_dim", [(5, 13), (48, 16), (3, 512)])
def test_extend_new_shapes(page, head_dim, causal):
    q_lens = [1, page + 1, 2, 3]
    prefixes = [page - 1, 0, 2 * page - 1, page]
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=page)
    names = extend_backends(torch.float16, **shape)
    assert names == backends_under_test("extend"), "every backend extends at these shapes"
    for backend in names:
        ext = Extend.random(q_lens, prefixes, pool_factor=2, **shape)
        plant_foreign_page(ext.pages, 3, 0)
        check_extend(ext, backend, causal, refused={3: 0})


def more_queries_than_keys(head_dim=16, page=5) -> Extend:
    """Sequence 0: 7 query rows over 3 keys; 1: 6 rows, no key at all; 2: 2 rows over 9 keys."""
    q_lens, seq_lens = [7, 6, 2], [3, 0, 9]
    pages = Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        page_size=page,
        seq_lens=seq_lens,
        pool_factor=2,
    )
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), 4, head_dim, generator=g).to(torch.float16).to(DEVICE)
    cu = torch.tensor([0, 7, 13, 15], dtype=torch.int32, device=DEVICE)
    return Extend(q, cu, pages)


@pytest.mark.parametrize(
    "backend", extend_backends(torch.float16, num_heads=4, num_kv_heads=1, head_dim=16, page_size=5)
)
def test_non_causal_extend_with_more_queries_than_keys(backend):
    """Every row reads every key of its sequence; rows of a sequence without keys give 0 and
    LSE -inf. A foreign page in sequence 2 is refused for all its rows."""
    ext = more_queries_than_keys()
    plant_foreign_page(ext.pages, 2, 1)
    check_extend(ext, backend, causal=False, refused={2: 1})
    out, lse, _ = ext.run(backend, causal=False, return_lse=True)
    assert torch.equal(out[7:13], torch.zeros_like(out[7:13])) and torch.isneginf(lse[7:13]).all()


def test_causal_extend_with_more_queries_than_keys_stays_an_error():
    """Causal rows at negative positions would have no keys in any page: named, not guessed."""
    ext = more_queries_than_keys()
    with pytest.raises(ValueError, match=r"seq_lens: .*seq_lens\[0\] = 3 with 7 query tokens"):
        ext.run("reference", causal=True)
    ext.run("reference", causal=False)


# --- writers at any page size --------------------------------------------------------------------


def writer_backends() -> list[str]:
    from kvattn.write_args import validate_write_kv

    pool = torch.zeros(2, 5, 1, 16)
    tags = torch.zeros(2, dtype=torch.int64)
    args = validate_write_kv(
        pool[0, :1], pool[0, :1], pool, pool.clone(), torch.zeros(1, dtype=torch.int64), tags, 1
    )
    return [n for n, why in backends.explain(args, op="write_kv").items() if why is None]


# The Triton writer walks each token's run back to the page's written prefix, one slot per step:
# under the interpreter a 1000-token page costs minutes, so it runs the smaller pages only.
WRITER_CASES = [
    (b, p) for b in writer_backends() for p in (5, 48, 1000) if (b, p) != ("triton", 1000)
]


@pytest.mark.parametrize("backend,page", WRITER_CASES)
def test_write_kv_stamps_exact_lengths_at_any_page_size(backend, page):
    """Two sequences appended through ``write_kv`` across page boundaries (2P + 1 and P - 1 tokens),
    a late writer refused; every tag's ``valid_len`` is exactly what landed, and decode over the
    written pages reads only those slots (the rest of every page stays NaN)."""
    num_pages, heads, dim = 6, 2, 16
    k_cache = torch.full((num_pages, page, heads, dim), float("nan"), dtype=torch.float16)
    v_cache = k_cache.clone()
    tags = torch.zeros(num_pages, dtype=torch.int64)
    pages = {1: [4, 0, 2], 2: [5]}
    lens = {1: 2 * page + 1, 2: page - 1}
    g = torch.Generator().manual_seed(page)
    for owner, own in pages.items():
        kvattn.reserve_pages(tags, own, owner=owner)
        n = lens[owner]
        pos = torch.arange(n)
        mapping = torch.tensor(own)[pos // page] * page + pos % page
        k = torch.randn(n, heads, dim, generator=g).half()
        result = kvattn.write_kv(k, -k, k_cache, v_cache, mapping, tags, owner, backend=backend)
        assert result.dropped_count() == 0 and bool(result.landed.all())
        assert torch.equal(k_cache.view(-1, heads, dim)[mapping], k)
    late = kvattn.write_kv(
        k[:1],
        k[:1],
        k_cache,
        v_cache,
        torch.tensor([5 * page + page - 1]),
        tags,
        1,
        backend=backend,
    )
    assert late.dropped_count() == 1  # owner 1 does not hold page 5
    assert [kvattn.tag_valid_len(int(t)) for t in tags[[4, 0, 2, 5]]] == [page, page, 1, page - 1]
    q = torch.randn(2, 4, dim, generator=g).half()
    table = torch.tensor([[4, 0, 2], [5, 5, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([lens[1], lens[2]], dtype=torch.int32)
    expected = torch.tensor([1, 2])
    out, report = kvattn.paged_decode(
        q, k_cache, v_cache, table, seq_lens, tags, expected, backend="reference"
    )
    assert torch.isfinite(out).all() and not report.any()

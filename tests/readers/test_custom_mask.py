"""The extend's custom mask (kvattn.variants ``custom_mask``: FlashInfer's layout, tree attention
for speculative decoding) on every backend that claims it, against the float64
definition of tests/kvattn_testing/variants.py (:func:`dense`, with the mask's blocks).

Every slot a row must not use holds NaN: foreign pages (refused, and reported as without a mask),
the unwritten tails of pages, and keys the mask removes from every row of their sequence (never
loaded). A mask only removes keys: one that selects a refused page's keys still reads nothing of
it, and an all-True mask is the call without one.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn_testing.extend import Extend
from kvattn_testing.scenarios import SCENARIOS, SENTINEL_V
from kvattn_testing.util import (
    DEVICE,
    LSE_TOLERANCE,
    assert_reports_equal,
    backends_under_test,
    claims,
    launcher,
    tolerance,
)
from kvattn_testing.variants import DIM, HEADS, KV_HEADS, dense, inputs, plant_foreign_page, tokens


def tree_rows(prefix: int, parents: list[int]) -> torch.Tensor:
    """``[len(parents), prefix + len(parents)]`` bool: the verify step of tree speculative decoding.
    Draft node ``j`` (parent ``parents[j]``, -1 for the root, a parent always before its child)
    sits at position ``prefix + j`` and reads the prefix, itself and its ancestors."""
    n = len(parents)
    rows = torch.zeros(n, prefix + n, dtype=torch.bool)
    rows[:, :prefix] = True
    for j in range(n):
        node = j
        while node >= 0:
            rows[j, prefix + node] = True
            node = parents[node]
    return rows


def flatten(blocks: list[torch.Tensor]) -> torch.Tensor:
    """FlashInfer's layout: the ``[q_len, seq_len]`` blocks row-major, one after the other."""
    return torch.cat([b.flatten() for b in blocks]).to(DEVICE)


def poison_unread(ext: Extend, blocks: list[torch.Tensor]) -> int:
    """NaN into every key the mask removes from all rows of its sequence (its page stays WRITTEN
    for the sequence: only the mask keeps it out); returns how many."""
    page = ext.pages.k_cache.shape[1]
    poisoned = 0
    for b, block in enumerate(blocks):
        for t in torch.nonzero(~block.any(dim=0)).flatten().tolist():
            p = int(ext.pages.block_table[b, t // page])
            ext.pages.k_cache[p, t % page] = float("nan")
            ext.pages.v_cache[p, t % page] = float("nan")
            poisoned += 1
    return poisoned


def assert_matches(out, lse, want_out, want_lse, dtype):
    assert torch.isfinite(out).all(), "a refused, unwritten or masked-out slot was read"
    torch.testing.assert_close(out.cpu().double(), want_out, **tolerance(dtype))
    finite = torch.isfinite(want_lse)
    assert torch.isneginf(lse.cpu()[~finite]).all()
    torch.testing.assert_close(lse.cpu().double()[finite], want_lse[finite], **LSE_TOLERANCE)


def tree_batch(page=4, seed=0):
    """Four sequences in a verify step: trees of 1, 5, 7 and 4 draft nodes over prefixes of 3, 0,
    9 and 12 tokens, a foreign page in the last sequence's prefix (refused: every row reads the
    prefix)."""
    trees = [[-1], [-1, 0, 0, 1, 1], [-1, 0, 1, 0, 3, 3, 2], [-1, 0, 0, 2]]
    prefixes = [3, 0, 9, 12]
    ext = Extend.random(
        [len(t) for t in trees],
        prefixes,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        pool_factor=2,
        seed=seed,
    )
    plant_foreign_page(ext.pages, 3, 1)
    return ext, [tree_rows(p, t) for p, t in zip(prefixes, trees)]


def random_batch(density: float, seed=0):
    """Random masks over four sequences (one without query rows); keys no row reads are poisoned."""
    q_lens, prefixes = [3, 6, 0, 2], [5, 2, 4, 13]
    ext = Extend.random(
        q_lens,
        prefixes,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=seed,
    )
    g = torch.Generator().manual_seed(seed + 5)
    blocks = [torch.rand(n, n + p, generator=g) < density for n, p in zip(q_lens, prefixes)]
    plant_foreign_page(ext.pages, 3, 2)
    return ext, blocks


@pytest.mark.parametrize("page", [4, 5])
def test_tree_masks_match_the_definition(page):
    ext, blocks = tree_batch(page)
    mask = flatten(blocks)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    names = claims(args, "extend")
    assert {"reference", "torch"} <= set(names)
    seqs = [tokens(ext.pages, b) for b in range(4)]
    want_out, want_lse = dense(ext.q, ext.cu, seqs, DIM**-0.5, blocks=blocks)
    unmasked = ext.run("reference")[1]
    for backend in names:
        out, lse, report = ext.run(backend, return_lse=True, custom_mask=mask)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        # Pages are checked and reported as without a mask.
        assert_reports_equal(report, unmasked)
    assert unmasked.violations.tolist() == [0, 0, 0, 1]


def test_a_tree_mask_changes_the_answer():
    """The twin of the test above: the same batch without its mask differs from the definition
    with it (siblings read each other), so a backend ignoring the mask would fail there."""
    ext, blocks = tree_batch()
    seqs = [tokens(ext.pages, b) for b in range(4)]
    want_out, _ = dense(ext.q, ext.cu, seqs, DIM**-0.5, blocks=blocks)
    out = ext.run("reference")[0]
    assert (out.cpu().double() - want_out).abs().max() > 0.1


@pytest.mark.parametrize("window_left", [-1, 3], ids=["no-window", "window3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("density", [0.2, 0.7])
def test_random_masks_with_the_other_masks(density, causal, window_left):
    ext, blocks = random_batch(density, seed=int(density * 10))
    assert poison_unread(ext, blocks) > 0
    mask = flatten(blocks)
    kwargs = dict(causal=causal, window_left=window_left, custom_mask=mask)
    args = kvattn.layout.validate_extend(*ext.inputs(), **kwargs)
    seqs = [tokens(ext.pages, b) for b in range(4)]
    want_out, want_lse = dense(
        ext.q, ext.cu, seqs, DIM**-0.5, blocks=blocks, causal=causal, window_left=window_left
    )
    plain = ext.run("reference", causal=causal, window_left=window_left)[1]
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, **kwargs)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert_reports_equal(report, plain)


def test_an_all_true_mask_is_no_mask():
    ext, _ = random_batch(0.5)
    lens = ext.pages.seq_lens.tolist()
    q_lens = (ext.cu[1:] - ext.cu[:-1]).tolist()
    mask = torch.ones(sum(n * s for n, s in zip(q_lens, lens)), dtype=torch.bool, device=DEVICE)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, custom_mask=mask)
        want_out, want_lse, want_report = ext.run(backend, return_lse=True)
        torch.testing.assert_close(out, want_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
        assert_reports_equal(report, want_report)


def test_a_mask_never_makes_a_refused_page_readable():
    """Rows whose mask selects only the foreign page's keys read nothing (0, lse -inf); the page
    is refused and counted once, as without the mask."""
    ext, blocks = tree_batch()
    page = ext.pages.k_cache.shape[1]
    only_foreign = torch.zeros_like(blocks[3])
    only_foreign[:, page : 2 * page] = True  # logical page 1 of sequence 3: the foreign one
    blocks[3] = only_foreign
    mask = flatten(blocks)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    rows = slice(int(ext.cu[3]), int(ext.cu[4]))
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, custom_mask=mask)
        assert torch.isfinite(out).all()
        assert (out[rows] == 0).all() and torch.isneginf(lse[rows]).all()
        assert report.violations.tolist() == [0, 0, 0, 1]
        assert report.reasons[3].item() == int(Violation.OWNER_MISMATCH)


def test_a_short_mask_reads_as_false_and_fails_validation():
    ext, blocks = tree_batch()
    mask = flatten(blocks)
    need = mask.numel()
    with pytest.raises(ValueError, match=rf"custom_mask: expected {need} elements.*got {need - 4}"):
        ext.run("reference", custom_mask=mask[:-4])
    # Unvalidated (a GPU's default), the last row's last 4 entries are past the end: False. The
    # same as a mask whose last 4 entries are False.
    cut = mask.clone()
    cut[-4:] = False
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask[:-4], validate=False)
    for backend in claims(args, "extend"):
        out, lse, _ = ext.run(backend, return_lse=True, custom_mask=mask[:-4], validate=False)
        want_out, want_lse, _ = ext.run("reference", return_lse=True, custom_mask=cut)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), want_out.double(), **tolerance(ext.q.dtype))
    empty = mask[:0]
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=empty, validate=False)
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, custom_mask=empty, validate=False)
        assert (out == 0).all() and torch.isneginf(lse).all()
        assert report.violations.tolist() == [0, 0, 0, 1]


def test_malformed_masks_name_the_argument():
    ext, blocks = tree_batch()
    mask = flatten(blocks)
    with pytest.raises(TypeError, match="custom_mask: expected dtype bool, got uint8"):
        ext.run("reference", custom_mask=mask.to(torch.uint8))
    with pytest.raises(ValueError, match="custom_mask: expected a 1-D tensor"):
        ext.run("reference", custom_mask=mask[None])
    with pytest.raises(ValueError, match="custom_mask: expected a contiguous last dimension"):
        ext.run(
            "reference",
            custom_mask=torch.ones(2 * mask.numel(), dtype=torch.bool, device=DEVICE)[::2],
        )


def test_kernels_across_query_and_key_tiles():
    """Sequences longer than one query tile and one key tile on the kernels' own launchers: Triton
    with 16-row, 16-key tiles; the CUDA source (on the CPU harness) with 3 query tokens a block and
    its 64-key tiles. Keys no row of a tile reads are NaN only where no row of the sequence reads
    them; a key is read by some tile and skipped by the others."""
    q_lens, prefixes = [21, 2], [110, 40]
    ext = Extend.random(
        q_lens,
        prefixes,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=3,
    )
    g = torch.Generator().manual_seed(9)
    blocks = []
    for n, p in zip(q_lens, prefixes):
        block = torch.rand(n, n + p, generator=g) < 0.5
        block[:, 60:70] = False  # a run no row reads: poisoned below
        block[: n // 2, 80:100] = False  # read by the later rows only
        blocks.append(block)
    assert poison_unread(ext, blocks) >= 20
    plant_foreign_page(ext.pages, 0, 30)  # tokens 120-123: some rows select them
    mask = flatten(blocks)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    want_out, want_lse = dense(
        ext.q, ext.cu, [tokens(ext.pages, b) for b in range(2)], DIM**-0.5, blocks=blocks
    )
    ref = ext.run("reference")[1]
    launches = {"triton": dict(block_m=16, block_n=16), "cuda_sim": dict(tokens_per_tile=3)}
    ran = 0
    for name, tiles in launches.items():
        if name not in backends_under_test() or name not in claims(args, "extend"):
            continue
        out = torch.empty_like(ext.q)
        lse = torch.empty(ext.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = launcher(name).extend(args, check=True, out=out, lse=lse, **tiles)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert_reports_equal(report, ref)
        ran += 1
    if not ran:
        pytest.skip("no kernel backend runs here")
    assert ref.violations.tolist() == [1, 0]


def test_unchecked_kernels_apply_the_mask():
    """``check=False`` (the unchecked variant) masks as the checked one: the same output on a
    batch with nothing to refuse, masked-out keys poisoned."""
    q_lens, prefixes = [3, 6, 0, 2], [5, 2, 4, 13]
    ext = Extend.random(
        q_lens,
        prefixes,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=2,
    )
    g = torch.Generator().manual_seed(4)
    blocks = [torch.rand(n, n + p, generator=g) < 0.4 for n, p in zip(q_lens, prefixes)]
    assert poison_unread(ext, blocks) > 0
    mask = flatten(blocks)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    for backend in claims(args, "extend"):
        checked, report = ext.run(backend, custom_mask=mask)
        unchecked, none = ext.run(backend, custom_mask=mask, check=False)
        assert not report.any() and none is None
        assert torch.isfinite(unchecked).all()
        torch.testing.assert_close(unchecked, checked, atol=0, rtol=0)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ownership_scenarios_under_a_mask(scenario):
    """docs/ownership.md section 6's scenarios (tests/contract/test_variant_scenarios.py) as extend
    calls of one query row per sequence under a random mask: every claiming backend gives the
    reference's output with the mask, and the report of the plain decode: the mask changes nothing
    refused."""
    batch = SCENARIOS[scenario]()
    plain = kvattn.paged_decode(*inputs(batch), backend="reference")[1]
    assert plain.any(), "the scenario refuses something"
    rows = batch.q.shape[0]
    cu = torch.arange(rows + 1, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(rows)
    lens = batch.seq_lens.tolist()
    mask = flatten([torch.rand(1, n, generator=g) < 0.6 for n in lens])
    q, k, v, table, seq_lens, tags, expected = inputs(batch)
    call = (q, k, v, cu, table, seq_lens, tags, expected)
    ref_out, ref_lse, _ = kvattn.reference.paged_extend(
        *call, return_lse=True, custom_mask=mask, compute_dtype=torch.float64
    )
    args = kvattn.layout.validate_extend(*call, custom_mask=mask)
    names = claims(args, "extend")
    assert {"reference", "triton", "torch"} <= set(names)
    for backend in names:
        out, lse, report = kvattn.paged_extend(
            *call, backend=backend, return_lse=True, custom_mask=mask
        )
        assert torch.isfinite(out).all(), f"{backend}: a refused slot was read"
        torch.testing.assert_close(out.double(), ref_out, **tolerance(q.dtype))
        finite = torch.isfinite(ref_lse)
        assert torch.isneginf(lse[~finite]).all()
        torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **LSE_TOLERANCE)
        assert_reports_equal(report, plain)
        assert out.float().abs().max() < 0.5 * SENTINEL_V, f"{backend}: sentinel influence"


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim", [(6, 2, 96), (8, 1, 256)], ids=["gqa3-d96", "gqa8-d256"]
)
def test_groups_and_head_dims_of_the_kernels(num_heads, num_kv_heads, head_dim):
    """A GQA group of 3 (the Triton tile pads it to 4 rows a token under a mask) and the wide
    heads' layouts (CUDA tiles of 128 and 256: 64- and 32-key tiles, two blocks per head at 256)."""
    q_lens, prefixes = [5, 1, 3], [9, 30, 0]
    ext = Extend.random(
        q_lens,
        prefixes,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=4,
        pool_factor=2,
        seed=6,
    )
    g = torch.Generator().manual_seed(8)
    blocks = [torch.rand(n, n + p, generator=g) < 0.5 for n, p in zip(q_lens, prefixes)]
    assert poison_unread(ext, blocks) > 0
    plant_foreign_page(ext.pages, 1, 3)
    mask = flatten(blocks)
    args = kvattn.layout.validate_extend(*ext.inputs(), custom_mask=mask)
    want_out, want_lse = dense(
        ext.q, ext.cu, [tokens(ext.pages, b) for b in range(3)], head_dim**-0.5, blocks=blocks
    )
    plain = ext.run("reference")[1]
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, custom_mask=mask)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert_reports_equal(report, plain)
    assert plain.violations.tolist() == [0, 1, 0]

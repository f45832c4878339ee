"""The torch backend's readers (kvattn/backends/torch/attention.py) where their work differs from
the reference's: decode sequences batched into gathers by length, extend query rows cut into tiles
that each read only their causal/window key range, pages before a window not gathered at all. The
shared suites (scenarios, variants, shapes, hardening, fuzz) run this backend too; here the inputs
are shaped so those paths are taken, compared with the float64 reference, NaN in every slot that
must not be read.

Tolerances: float32 data and float32 compute on both sides of the comparison, so outputs differ by
summation order only (``tolerance(float32)``) and LSEs by float32 rounding (``LSE_TOLERANCE``).
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn.backends.torch import attention as torch_attention
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    DEVICE,
    Batch,
    assert_float32_read_as_reference,
)
from kvattn_testing.variants import plant_foreign_page

HEADS, KV_HEADS, DIM = 6, 2, 16
F32 = torch.float32
VARIANTS = {
    "plain": {},
    "window": dict(window_left=9),
    "all": dict(
        window_left=21,
        logits_soft_cap=4.0,
        alibi_slopes=torch.linspace(0.05, 0.3, HEADS),
        sinks=torch.linspace(-1.0, 1.0, HEADS),
    ),
}
LENS = [0, 1, 3, 17, 40, 90, 200, 7]


def decode_inputs(b: Batch) -> tuple:
    return b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.page_tags, b.expected


def on_device(variant: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in variant.items()}


@pytest.mark.parametrize("foreign", [True, False], ids=["foreign", "twin"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_of_mixed_lengths_in_several_gathers(name, foreign):
    """Lengths from 0 to 50 pages fall into several gathers; one sequence's every page and
    another's page inside every window are foreign (NaN), the twin has none."""
    variant = on_device(VARIANTS[name])
    pages = Batch.random(
        batch=len(LENS),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        seq_lens=LENS,
        dtype=F32,
        pool_factor=2,
        seed=3,
    )
    counts = [-(-n // 4) for n in LENS]
    assert len(torch_attention._buckets(counts, [b for b in range(len(LENS)) if counts[b]])) > 2
    if foreign:
        for i in range(counts[3]):
            plant_foreign_page(pages, 3, i)
        plant_foreign_page(pages, 6, counts[6] - 2)
    out, lse, report = pages.decode("torch", return_lse=True, **variant)
    ref = pages.reference(return_lse=True, compute_dtype=torch.float64, **variant)
    assert_float32_read_as_reference(out, lse, report, *ref)
    read = report.pages_checked.tolist()  # sequence 3 reads fewer of its pages under a window
    assert report.violations.tolist() == ([0, 0, 0, read[3], 0, 0, 1, 0] if foreign else [0] * 8)
    if foreign:
        assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_extend_in_query_tiles(monkeypatch, name, causal):
    """Tiles of a few query rows (the tile budget shrunk): each tile slices the keys its rows can
    read, and a foreign page read by some rows only is refused and never contributes."""
    variant = on_device(VARIANTS[name])
    monkeypatch.setattr(torch_attention, "TILE_ELEMENTS", 3 * HEADS * 48)
    ext = Extend.random(
        [23, 3, 9, 0],
        [37, 29, 0, 5],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        dtype=F32,
        pool_factor=2,
        seed=5,
    )
    plant_foreign_page(ext.pages, 0, 13)  # tokens 52-55: read by the later rows of sequence 0
    out, lse, report = ext.run("torch", causal=causal, return_lse=True, **variant)
    ref = ext.reference(causal=causal, compute_dtype=torch.float64, **variant)
    assert_float32_read_as_reference(out, lse, report, *ref)
    assert report.violations.tolist() == [1, 0, 0, 0]


def test_decode_does_not_gather_pages_before_the_window(monkeypatch):
    """A 50-page sequence with a 9-key window gathers its last 3 pages only (the table entries
    before the window name pages outside the pool: never dereferenced, never reported)."""
    pages = Batch.random(
        batch=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        seq_lens=[200],
        dtype=F32,
        pool_factor=2,
        seed=8,
    )
    pages.block_table[0, :40] = pages.k_cache.shape[0] + 7
    gathered = []
    real = torch_attention._gather

    def spy(a, pool, scale, index, allowed):
        gathered.append(index.shape[1])
        return real(a, pool, scale, index, allowed)

    monkeypatch.setattr(torch_attention, "_gather", spy)
    out, lse, report = pages.decode("torch", return_lse=True, window_left=9)
    assert_float32_read_as_reference(
        out,
        lse,
        report,
        *pages.reference(return_lse=True, compute_dtype=torch.float64, window_left=9),
    )
    assert gathered == [3, 3] and report.pages_checked.tolist() == [3]
    assert not report.any()


def test_auto_reads_cpu_tensors_with_the_torch_backend(monkeypatch):
    """``auto`` on CPU tensors takes the torch readers before the reference (the compiled CPU
    readers, when built, and the Triton interpreter, when a test run turns it on, come first)."""
    monkeypatch.delenv("KVATTN_BACKEND", raising=False)
    probe = Batch.random(
        batch=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        seq_lens=[3],
        device=torch.device("cpu"),
    )
    ext = Extend.random([2], [3])
    for op, args in (
        ("decode", probe.args()),
        ("extend", kvattn.layout.validate_extend(*(t.cpu() for t in ext.inputs()))),
    ):
        name, refused = kvattn.backends.auto_choice(args, op)
        assert name in ("cpu", "triton", "torch") and "torch" not in refused, (op, name, refused)

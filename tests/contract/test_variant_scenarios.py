"""The ownership scenarios of docs/ownership.md section 6 with each attention variant switched on:
no switch may let a refused page contribute or change what is refused. Every backend that claims
the switch must give the reference's output (with the same switch) and the report of the plain
call; every slot a reader must not use holds NaN or a sentinel engineered to dominate attention.

The window used here covers every sequence (what a window refuses is in
tests/readers/test_variants.py).
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn_testing.scenarios import SCENARIOS, SENTINEL_V
from kvattn_testing.util import DEVICE, LSE_TOLERANCE, Batch, assert_reports_equal, tolerance
from kvattn_testing.variants import inputs

HEADS = 4


def per_sequence_slopes(batch: int, kv_heads: int) -> dict:
    """One row of slopes per sequence, of both signs (the switches take the scenario's shape)."""
    g = torch.Generator().manual_seed(2)
    return dict(alibi_slopes=(torch.rand(batch, HEADS, generator=g) - 0.25).to(DEVICE))


def per_sequence_scales(batch: int, kv_heads: int) -> dict:
    """Around the "fp8" switch's scales, so the sentinels keep dominating."""
    g = torch.Generator().manual_seed(3)
    k, v = (1 + 0.25 * torch.rand(2, batch, kv_heads, generator=g)).to(DEVICE)
    return dict(k_scale=0.5 * k, v_scale=0.25 * v)


def query_scales(batch: int, kv_heads: int) -> dict:
    """fp8 queries over the "fp8" switch's pools: the query codes are twice the query
    (:func:`as_fp8_q`), read back at 0.5 per KV head."""
    return dict(k_scale=0.5, v_scale=0.25, q_scale=torch.full((kv_heads,), 0.5, device=DEVICE))


def per_sequence_query_scales(batch: int, kv_heads: int) -> dict:
    """Per-sequence query scales around 0.5 beside per-head K/V scales (widened with it)."""
    g = torch.Generator().manual_seed(4)
    q = (0.5 * (1 + 0.25 * torch.rand(batch, kv_heads, generator=g))).to(DEVICE)
    return dict(k_scale=torch.full((kv_heads,), 0.5, device=DEVICE), v_scale=0.25, q_scale=q)


def switches():
    g = torch.Generator().manual_seed(1)
    return {
        "window": dict(window_left=64),
        "softcap": dict(logits_soft_cap=5.0),
        "sinks": dict(sinks=(torch.rand(HEADS, generator=g) * 2).to(DEVICE)),
        "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)),
        "fp8": dict(k_scale=0.5, v_scale=0.25),
        # Per sequence (kvattn.variants): one row per sequence of the scenario, each different.
        "alibi-per-seq": per_sequence_slopes,
        "fp8-per-seq": per_sequence_scales,
        "fp8-q": query_scales,
        "fp8-q-per-seq": per_sequence_query_scales,
        # V's own head dim (kvattn.layout): the pools change (POOLS), no keyword does.
        "v-narrow": {},
        "v-wide": {},
    }


SWITCHES = switches()


def as_fp8(batch: Batch) -> Batch:
    """The batch over e4m3 pools (NaN stays NaN); values stored at twice their size, read back at
    the scales of the "fp8" switch, so the sentinels keep dominating."""
    batch.k_cache = (batch.k_cache.float() * 2).to(torch.float8_e4m3fn)
    batch.v_cache = (batch.v_cache.float() * 4).to(torch.float8_e4m3fn)
    return batch


def as_fp8_q(batch: Batch) -> Batch:
    """:func:`as_fp8` with the query as e4m3 codes too, stored at twice its size."""
    batch.q = (batch.q.float() * 2).to(torch.float8_e4m3fn)
    return as_fp8(batch)


def with_v(batch: Batch, v_cache: torch.Tensor) -> Batch:
    batch.v_cache = v_cache
    return batch


# Switches that change the pools: fp8 codes, or a value pool of another head dim than K's (its
# first half, a strided view; or every column twice), NaN and sentinels staying where they were.
POOLS = {
    "fp8": as_fp8,
    "fp8-per-seq": as_fp8,
    "fp8-q": as_fp8_q,
    "fp8-q-per-seq": as_fp8_q,
    "v-narrow": lambda b: with_v(b, b.v_cache[..., : b.v_cache.shape[3] // 2]),
    "v-wide": lambda b: with_v(b, torch.cat([b.v_cache, b.v_cache], dim=3)),
}


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_under_each_switch(scenario, switch):
    batch = SCENARIOS[scenario]()
    plain = kvattn.paged_decode(*inputs(batch), backend="reference")[1]
    assert plain.any(), "the scenario refuses something"
    if switch in POOLS:
        batch = POOLS[switch](batch)
    kwargs = SWITCHES[switch]
    if callable(kwargs):
        kwargs = kwargs(batch.q.shape[0], batch.k_cache.shape[2])
    ref_out, ref_lse, ref_report = kvattn.reference.paged_decode(
        *inputs(batch), return_lse=True, compute_dtype=torch.float64, **kwargs
    )
    assert_reports_equal(ref_report, plain)
    args = kvattn.layout.validate_decode(*inputs(batch), **kwargs)
    names = [n for n, why in backends.explain(args).items() if why is None]
    assert "reference" in names
    for backend in names:
        out, lse, report = kvattn.paged_decode(
            *inputs(batch), backend=backend, return_lse=True, **kwargs
        )
        assert torch.isfinite(out).all(), f"{backend}: a refused slot was read"
        torch.testing.assert_close(out.double(), ref_out, **tolerance(out.dtype))
        torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
        assert_reports_equal(report, plain)
        assert out.float().abs().max() < 0.5 * SENTINEL_V, f"{backend}: sentinel influence"

"""``write_kv`` picks its implementation through the backend registry, like the readers, and says
why it refused the others."""

from __future__ import annotations

import logging

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn.backends.triton.paged_decode import interpreted
from kvattn.write_args import validate_write_kv
from kvattn_testing.util import Batch

PAGE, HEADS, DIM = 4, 1, 16


def _write_inputs(device="cpu"):
    k_cache = torch.full((3, PAGE, HEADS, DIM), float("nan"), device=device)
    v_cache = k_cache.clone()
    tags = torch.zeros(3, dtype=torch.int64, device=device)
    kvattn.reserve_pages(tags, [1], owner=5)
    k = torch.randn(2, HEADS, DIM, device=device)
    slots = torch.tensor([PAGE, PAGE + 1], device=device)
    return k, k.clone(), k_cache, v_cache, slots, tags


def test_explain_gives_a_reason_for_every_writer_it_refuses():
    args = validate_write_kv(*_write_inputs(), 5)
    reasons = backends.explain(args, op="write_kv")
    assert set(reasons) == set(backends.names())
    assert reasons["torch"] is None
    assert reasons["reference"] == "no write_kv kernel"
    assert reasons["cuda"]  # CPU tensors
    assert (reasons["triton"] is None) == interpreted()
    # The compiled CPU writer first where it is built, else the PyTorch ops.
    compiled = reasons["cpu"] is None
    assert backends.auto_choice(args, "write_kv") == (
        ("cpu", {}) if compiled else ("torch", {"cpu": reasons["cpu"]})
    )


def test_auto_on_cpu_takes_the_compiled_writer_and_logs_it_once(monkeypatch, caplog):
    """The compiled CPU writer where it is built (else the PyTorch ops), said once."""
    monkeypatch.delenv("KVATTN_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_logged", set())
    compiled = backends.explain(validate_write_kv(*_write_inputs(), 5), "write_kv")["cpu"]
    with caplog.at_level(logging.INFO, logger="kvattn"):
        for _ in range(2):
            k, v, k_cache, v_cache, slots, tags = _write_inputs()
            result = kvattn.write_kv(k, v, k_cache, v_cache, slots, tags, 5)
            assert result.dropped_count() == 0
    said = (
        "kvattn: write_kv uses backend 'cpu' on cpu (first choice)"
        if compiled is None
        else f"kvattn: write_kv uses backend 'torch' on cpu (cpu: {compiled})"
    )
    assert [r.getMessage() for r in caplog.records].count(said) == 1
    assert kvattn.describe_tag(int(tags[1])) == "WRITTEN(owner=5, valid_len=2)"
    assert torch.equal(k_cache[1, :2], k)


def test_a_named_writer_that_cannot_run_raises_with_its_reason(monkeypatch):
    monkeypatch.delenv("KVATTN_BACKEND", raising=False)
    inputs = _write_inputs()
    with pytest.raises(
        ValueError, match="backend 'reference' cannot run these inputs: no write_kv kernel"
    ):
        kvattn.write_kv(*inputs, 5, backend="reference")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run these inputs"):
        kvattn.write_kv(*inputs, 5, backend="cuda")
    with pytest.raises(
        ValueError, match=r"backend argument: expected 'auto' or one of .*'torch'.*got 'tpu'"
    ):
        kvattn.write_kv(*inputs, 5, backend="tpu")
    assert kvattn.describe_tag(int(inputs[-1][1])) == "RESERVED(owner=5)"  # nothing written


def test_kvattn_backend_forces_the_writer_only_where_that_backend_has_one(monkeypatch):
    args = validate_write_kv(*_write_inputs(), 5)
    decode_args = Batch.random(
        batch=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        seq_lens=[3],
        dtype=torch.float32,
        device="cpu",
    ).args()
    monkeypatch.setenv("KVATTN_BACKEND", "reference")
    assert backends.select(decode_args, "auto", op="decode").NAME == "reference"
    # The reference has no writer: auto's writer.
    compiled = backends.explain(args, op="write_kv")["cpu"] is None
    assert backends.select(args, "auto", op="write_kv").NAME == ("cpu" if compiled else "torch")
    monkeypatch.setenv("KVATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="KVATTN_BACKEND: backend 'cuda' cannot run these inputs"):
        backends.select(args, "auto", op="write_kv")
    if interpreted():
        monkeypatch.setenv("KVATTN_BACKEND", "triton")
        assert backends.select(args, "auto", op="write_kv").NAME == "triton"


def test_an_unknown_op_is_refused():
    args = validate_write_kv(*_write_inputs(), 5)
    with pytest.raises(
        ValueError,
        match=r"op: expected one of \['decode', 'extend', 'write_kv', 'mla_decode', "
        r"'mla_extend'\], got 'prefill'",
    ):
        backends.select(args, "auto", op="prefill")

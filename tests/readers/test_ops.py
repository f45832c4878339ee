"""The torch custom ops of :mod:`kvattn.ops`: ``torch.library.opcheck`` (schema, fake tensors,
AOT dispatch), equality with the direct calls (outputs bit-identical, reports equal, a violation
twin), and torch.compile with ``fullgraph=True`` on the CPU.

The op bodies run the same backends as the direct calls on the same inputs, so outputs are compared
exactly. Shapes are tiny: the Triton kernels run under the interpreter here.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import ops
from kvattn_testing.util import DEVICE, Batch, assert_reports_equal


def _batch(**kwargs):
    return Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[5, 9, 1],
        dtype=torch.float32,
        **kwargs,
    )


def _args(b: Batch):
    return (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.page_tags, b.expected)


def _extend_inputs():
    b = _batch()
    q_lens = [2, 3, 1]
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=DEVICE)
    return (q, b.k_cache, b.v_cache, cu, b.block_table, b.seq_lens, b.page_tags, b.expected)


# The op's variant arguments with every switch off: window_left, logits_soft_cap, sinks,
# alibi_slopes, k_scale, v_scale, q_scale; the extend's also custom_mask and window_right.
PLAIN = (-1, 0.0, None, None, None, None, None)
PLAIN_EXTEND = PLAIN + (None, -1)


def _tree_mask(inputs) -> torch.Tensor:
    """A mask over the extend inputs' blocks that removes each sequence's first key from its rows
    but the last (so it changes the answer)."""
    q, cu, lens = inputs[0], inputs[3].tolist(), inputs[5].tolist()
    blocks = []
    for b, n in enumerate(lens):
        block = torch.ones(cu[b + 1] - cu[b], n, dtype=torch.bool)
        block[:-1, 0] = False
        blocks.append(block.flatten())
    return torch.cat(blocks).to(q.device)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck_paged_decode(backend):
    torch.library.opcheck(
        torch.ops.kvattn.paged_decode.default,
        _args(_batch()) + (None, True, backend, True, None) + PLAIN,
    )


def test_opcheck_paged_extend():
    inputs = _extend_inputs()
    torch.library.opcheck(
        torch.ops.kvattn.paged_extend.default,
        inputs + (None, True, True, "reference", False, None) + PLAIN_EXTEND,
    )
    torch.library.opcheck(
        torch.ops.kvattn.paged_extend.default,
        inputs + (None, True, True, "reference", False, None) + PLAIN + (_tree_mask(inputs), -1),
    )


def test_opcheck_write_kv():
    k_cache, v_cache, tags = (
        torch.zeros(4, 4, 2, 16),
        torch.zeros(4, 4, 2, 16),
        torch.zeros(4, dtype=torch.int64),
    )
    kvattn.reserve_pages(tags, [1, 2], 7)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([4, 5, 12])  # page 1 slots 0-1 land; page 3 is not held by owner 7
    owner = torch.tensor(7, dtype=torch.int64)
    torch.library.opcheck(
        torch.ops.kvattn.write_kv.default, (k, v, k_cache, v_cache, slots, tags, owner)
    )


@pytest.mark.parametrize("corrupt", [False, True])
def test_decode_op_equals_direct_call(corrupt):
    b = _batch()
    if corrupt:  # sequence 0 reads sequence 1's first page: OWNER_MISMATCH
        b.block_table[0, 0] = b.block_table[1, 0]
    out, lse, report = ops.paged_decode(*_args(b), backend="reference", return_lse=True)
    ref_out, ref_lse, ref_report = kvattn.paged_decode(
        *_args(b), backend="reference", return_lse=True
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert_reports_equal(report, ref_report)
    assert bool(report.violations[0]) == corrupt
    if corrupt:
        with pytest.raises(kvattn.KVOwnershipError, match="OWNER_MISMATCH"):
            ops.paged_decode(*_args(b), backend="reference", on_violation="raise")


def test_extend_and_write_ops_equal_direct_calls():
    inputs = _extend_inputs()
    out, report = ops.paged_extend(*inputs, backend="reference")
    ref_out, ref_report = kvattn.paged_extend(*inputs, backend="reference")
    assert torch.equal(out, ref_out)
    assert_reports_equal(report, ref_report)
    # The custom mask reaches the op (its twin: the same call without it answers otherwise).
    mask = _tree_mask(inputs)
    masked, masked_report = ops.paged_extend(*inputs, backend="reference", custom_mask=mask)
    direct = kvattn.paged_extend(*inputs, backend="reference", custom_mask=mask)[0]
    assert torch.equal(masked, direct)
    assert (masked - out).abs().max() > 1e-3
    assert_reports_equal(masked_report, ref_report)
    # So does the window's right edge (non-causal: with causality it changes nothing).
    full = ops.paged_extend(*inputs, backend="reference", causal=False)[0]
    right, _ = ops.paged_extend(*inputs, backend="reference", causal=False, window_right=0)
    direct = kvattn.paged_extend(*inputs, backend="reference", causal=False, window_right=0)[0]
    assert torch.equal(right, direct)
    assert (right - full).abs().max() > 1e-3

    results = []
    for write in (ops.write_kv, kvattn.write_kv):
        k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
        tags = torch.zeros(4, dtype=torch.int64)
        kvattn.reserve_pages(tags, [1], 7)
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
        result = write(k, v, k_cache, v_cache, torch.tensor([4, 5, 12]), tags, 7)
        results.append((k_cache, v_cache, tags, result))
    (k1, v1, t1, r1), (k2, v2, t2, r2) = results
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(t1, t2)
    assert r1.landed.tolist() == r2.landed.tolist() == [True, True, False]
    assert r1.dropped_count() == r2.dropped_count() == 1


def test_write_op_has_write_kv_s_signature():
    """The op's wrapper takes every argument of kvattn.write_kv, with its defaults (vLLM's
    toward-zero fp8 codes included)."""
    import inspect

    assert inspect.signature(ops.write_kv).parameters.keys() == (
        inspect.signature(kvattn.write_kv).parameters.keys()
    )
    for name, param in inspect.signature(kvattn.write_kv).parameters.items():
        assert inspect.signature(ops.write_kv).parameters[name].default == param.default, name


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_write_op_rounds_fp8_codes_as_write_kv(rounding):
    results = {}
    for name, write in (("op", ops.write_kv), ("direct", kvattn.write_kv)):
        for rule in ("nearest", "toward_zero"):
            k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
            v_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
            tags = torch.zeros(4, dtype=torch.int64)
            kvattn.reserve_pages(tags, [1], 7)
            g = torch.Generator().manual_seed(0)
            k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
            write(
                k, v, k_cache, v_cache, torch.tensor([4, 5, 6]), tags, 7,
                backend="torch", validate=True, k_scale=0.5, v_scale=0.25, fp8_rounding=rule,
            )  # fmt: skip
            results[name, rule] = k_cache.view(torch.uint8)
    assert torch.equal(results["op", rounding], results["direct", rounding])
    # The twin: the other rule writes other codes, so the rule did reach the writer.
    other = "nearest" if rounding == "toward_zero" else "toward_zero"
    assert not torch.equal(results["op", rounding], results["op", other])
    with pytest.raises(ValueError, match="fp8_rounding: expected one of"):
        ops.write_kv(k, v, k_cache, v_cache, torch.tensor([4]), tags, 7, fp8_rounding="up")
    with pytest.raises(TypeError, match="backend: expected a str"):
        ops.write_kv(k, v, k_cache, v_cache, torch.tensor([4]), tags, 7, backend=None)


def test_ops_validate_like_direct_calls():
    b = _batch()
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_decode(
            b.q,
            b.k_cache,
            b.v_cache,
            b.block_table,
            b.seq_lens + 100,
            b.page_tags,
            b.expected,
            backend="reference",
        )
    with pytest.raises(TypeError, match="block_table"):
        ops.paged_decode(
            b.q,
            b.k_cache,
            b.v_cache,
            b.block_table.long(),
            b.seq_lens,
            b.page_tags,
            b.expected,
            backend="reference",
        )
    with pytest.raises(ValueError, match="owner"):
        ops.write_kv(
            b.q[:1, :2], b.q[:1, :2], b.k_cache, b.v_cache, torch.tensor([0]), b.page_tags, 0
        )


def test_torch_compile_fullgraph_on_cpu():
    """The op is opaque to dynamo, so its body (here the Triton kernel under the interpreter on a
    CPU) runs eagerly inside the compiled graph; fullgraph=True proves there is no graph break."""
    b = _batch()
    b.block_table[2, 0] = b.block_table[0, 0]  # one violation, so the report is not trivially 0

    def attend(*args):
        out, report = ops.paged_decode(*args, backend="triton")
        return out * 2, report.violations, report.page_reasons

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    out, violations, page_reasons = compiled(*_args(b))
    ref_out, ref_report = kvattn.paged_decode(*_args(b), backend="triton")
    assert torch.equal(out, ref_out * 2)
    assert torch.equal(violations, ref_report.violations)
    assert torch.equal(page_reasons, ref_report.page_reasons)
    assert violations.tolist() == [0, 0, 1]

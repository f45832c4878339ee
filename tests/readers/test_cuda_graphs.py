"""The CUDA-graph rule of docs/cuda_graphs.md: in report mode nothing in a call reads device memory
on the host or depends on host values that change between replays.

On every machine: the host side of each call runs under a dispatch spy that records every aten op
that reads a tensor's value on the host (``.item()``, ``nonzero``, ...); report-mode calls with
``validate=False`` must record none. On a GPU: capture a call in a CUDA graph, change block tables,
lengths and tags in place, replay, and compare with an eager call on the new inputs (outputs and
reports), including a replay where a changed tag turns into a reported violation.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvattn
from kvattn_testing.util import Batch, backends_under_test

HOST_READS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.is_nonzero",
    "aten.equal",
    "aten.item",
    "aten.repeat_interleave.Tensor",
)


class HostReadSpy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(HOST_READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _batch(device=None):
    kwargs = {} if device is None else dict(device=device)
    return Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[5, 9, 1],
        dtype=torch.float16,
        extra_pages=1,
        **kwargs,
    )


def _decode(b: Batch, **kwargs):
    return kvattn.paged_decode(
        b.q,
        b.k_cache,
        b.v_cache,
        b.block_table,
        b.seq_lens,
        b.page_tags,
        b.expected,
        validate=False,
        **kwargs,
    )


def _extend(b: Batch, q, cu, **kwargs):
    return kvattn.paged_extend(
        q,
        b.k_cache,
        b.v_cache,
        cu,
        b.block_table,
        b.seq_lens,
        b.page_tags,
        b.expected,
        validate=False,
        **kwargs,
    )


def _extend_query(b: Batch):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 16, generator=g).to(b.q.dtype).to(b.q.device)
    return q, torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=b.q.device)


def _kernel_backend() -> str:
    return "cuda" if torch.cuda.is_available() and kvattn.backends.load("cuda")[0] else "triton"


# The CUDA launchers' host side runs here through the CPU harness (same launcher code as on a GPU).
SPIED_BACKENDS = [n for n in ("triton", "cuda_sim") if n in backends_under_test()]


@pytest.mark.parametrize("backend", SPIED_BACKENDS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_report_mode_reads_nothing_on_the_host(op, backend):
    b = _batch()
    b.block_table[0, 0] = b.block_table[1, 0]  # a violation must not need a host read either
    q, cu = _extend_query(b)
    with HostReadSpy() as spy:
        if op == "decode":
            _, report = _decode(b, backend=backend)
        else:
            _, report = _extend(b, q, cu, backend=backend)
    assert spy.reads == []
    assert int(report.violations[0]) == 1  # the check ran and saw the swapped entry


def test_spy_sees_host_reads():
    """The twin: the same spy flags a call that synchronises (validation and raise mode)."""
    b = _batch()
    with HostReadSpy() as spy:
        kvattn.paged_decode(
            b.q,
            b.k_cache,
            b.v_cache,
            b.block_table,
            b.seq_lens,
            b.page_tags,
            b.expected,
            backend="triton",
            validate=True,
        )
    assert spy.reads


def _write_two_tokens(b: Batch, **kwargs):
    page = b.block_table[0, 1]
    slots = torch.stack([page * 4 + 1, page * 4 + 2]).long()
    owner = torch.ones(2, dtype=torch.int64, device=b.k_cache.device)
    k = torch.randn(2, 2, 16).to(b.k_cache.dtype).to(b.k_cache.device)
    return kvattn.write_kv(k, k, b.k_cache, b.v_cache, slots, b.page_tags, owner, **kwargs)


def test_write_kv_reads_nothing_on_the_host(monkeypatch):
    """The device path of the torch writer (CPU tensors pick their rows on the host, where that
    waits for nothing, so it is forced here), with the owner values unchecked."""
    monkeypatch.setattr(kvattn.backends.torch.writer, "rows_on_host", lambda t: False)
    b = _batch()
    with HostReadSpy() as spy:
        result = _write_two_tokens(b, validate=False)
    assert spy.reads == []
    assert result.landed.tolist() == [True, True]


def test_write_kv_on_cpu_tensors_reads_on_the_host():
    """The twin: by default CPU tensors' owners are checked and rows picked on the host."""
    b = _batch()
    with HostReadSpy() as spy:
        result = _write_two_tokens(b)
    assert spy.reads and result.landed.tolist() == [True, True]


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _assert_same(graph_result, eager_result):
    out, report = graph_result
    ref_out, ref_report = eager_result
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for field in ("violations", "reasons", "pages_checked", "beyond_table", "page_reasons"):
        assert torch.equal(getattr(report, field), getattr(ref_report, field)), field


def _mutations(b: Batch, other: Batch):
    """In-place changes between replays: new tables, lengths and tags; then one page's tag freed."""

    def new_inputs():
        b.block_table.copy_(other.block_table)
        b.seq_lens.copy_(other.seq_lens)
        b.page_tags.copy_(other.page_tags)
        b.k_cache.copy_(other.k_cache)
        b.v_cache.copy_(other.v_cache)

    def free_a_page():
        b.page_tags[b.block_table[1, 0].long()] = kvattn.FREE_TAG

    return [new_inputs, free_a_page]


@requires_gpu
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_capture_then_replay_with_changed_inputs(op):
    device = torch.device("cuda")
    b = _batch(device)
    # Same shapes, other contents: different pages, lengths and owners' layout.
    other = Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[8, 10, 3],
        dtype=torch.float16,
        extra_pages=1,
        seed=7,
        device=device,
    )
    assert other.block_table.shape == b.block_table.shape
    assert other.k_cache.shape == b.k_cache.shape
    q, cu = _extend_query(b)
    backend = _kernel_backend()

    def call():
        return _decode(b, backend=backend) if op == "decode" else _extend(b, q, cu, backend=backend)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and autotune outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    _assert_same(captured, call())

    saw_violation = False
    for mutate in _mutations(b, other):
        mutate()
        graph.replay()
        eager = call()
        _assert_same(captured, eager)
        saw_violation |= bool(eager[1].violations.any())
    assert saw_violation

"""The transformers adapter's ownership error, from the per-layer reports and writer results of one
forward: summarised per request across layers, the writer's dropped writes (usually the cause)
before the refused reads. Needs no transformers install: the summary is plain kvattn code."""
import torch

import kvattn
from kvattn import Violation, WriteDrop
from kvattn.integrations import transformers as adapter

NOT_HELD = int(WriteDrop.NOT_HELD)


def _adapter_batch(layers: int, drop: bool, refuse: bool):
    """A forward of ``layers`` layers where request 1's new tokens were dropped NOT_HELD in every
    layer (an early free) and its two pages then refused as UNWRITTEN and RESERVED in every layer;
    request 0 is clean."""
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    b = adapter._Batch(request_ids=["req_0", "req_1"], decode_only=True, cu_seqlens_q=cu,
                       block_table=torch.zeros(2, 3, dtype=torch.int32),
                       seq_lens=torch.tensor([1, 6], dtype=torch.int32),
                       expected=torch.zeros(2, 3, dtype=torch.int64),
                       token_owner=torch.tensor([1, 2]), token_row=torch.tensor([0, 1]),
                       refused_pages=torch.zeros(2, dtype=torch.int32),
                       pages_checked=torch.zeros(2, dtype=torch.int32),
                       dropped_tokens=torch.zeros(2, dtype=torch.int32))
    for layer in range(layers):
        reasons = torch.tensor([[0, 0, 0], [int(Violation.UNWRITTEN), int(Violation.RESERVED), 0]]
                               if refuse else [[0, 0, 0], [0, 0, 0]], dtype=torch.int8)
        count = (reasons != 0).sum(1).to(torch.int32)
        bits = torch.tensor([0, int(Violation.UNWRITTEN | Violation.RESERVED) if refuse else 0],
                            dtype=torch.int32)
        b.reports.append((layer, kvattn.OwnershipReport(count, bits, torch.tensor([1, 2]),
                                                        reasons, torch.zeros(2, dtype=torch.int32))))
        b.drops.append((layer, torch.tensor([0, NOT_HELD if drop else 0], dtype=torch.int8)))
    return b


def test_adapter_error_names_the_dropped_writes_of_every_layer():
    message = str(adapter._error(_adapter_batch(30, drop=True, refuse=True), 1))
    assert "30 NOT_HELD dropped write(s)" in message and "in 30 of 30 layer(s)" in message
    assert "reads: RESERVED on logical page(s) 1, in 30 of 30 layer(s)" in message
    assert "reads: UNWRITTEN on logical page(s) 0, in 30 of 30 layer(s)" in message
    assert message.index("writes:") < message.index("reads:")
    assert len(message.splitlines()) == 4  # heading, writes, two read lines: not one per layer


def test_adapter_error_without_drops_shows_reads_only():
    """The twin: a request whose writes all landed shows no writes line; one with drops only shows
    no reads line."""
    reads_only = str(adapter._error(_adapter_batch(3, drop=False, refuse=True), 1))
    assert "writes:" not in reads_only and "in 3 of 3 layer(s)" in reads_only
    writes_only = str(adapter._error(_adapter_batch(3, drop=True, refuse=False), 1))
    assert "reads:" not in writes_only and "3 NOT_HELD dropped write(s)" in writes_only

"""The engine ledger (kvattn/integrations/ledger.py): its failure of one request, from the
per-layer reports and writer results of one forward: summarised per request across layers, the
writer's dropped writes (usually the cause) before the refused reads, read back once by
``Ledger.finish``. Needs no engine install: the ledger is plain kvattn code. The adapters' own
set-up checks: vllm/test_vllm_setup.py, sglang/test_sglang_setup.py."""

import pytest
import torch

import kvattn
from kvattn import Violation, WriteDrop
from kvattn.integrations.ledger import Ledger, cache_domain, prefix_digests
from kvattn_testing.util import backends_under_test

NOT_HELD = int(WriteDrop.NOT_HELD)


def _failed_step(layers: int, drop: bool, refuse: bool) -> dict:
    """A forward of ``layers`` layers where request 1's new tokens were dropped NOT_HELD in every
    layer (an early free) and its two pages then refused as UNWRITTEN and RESERVED in every layer;
    request 0 is clean. Returns what ``finish`` says of it."""
    ledger = Ledger(16)
    step = ledger.start_step(
        ["req_0", "req_1"],
        [1, 2],
        [1, 1],
        torch.tensor([[3, 0, 0], [5, 6, 0]], dtype=torch.int32),
        torch.zeros(2, 3, dtype=torch.int64),
        [1, 6],
    )
    for layer in range(layers):
        reasons = torch.tensor(
            [[0, 0, 0], [int(Violation.UNWRITTEN), int(Violation.RESERVED), 0]]
            if refuse
            else [[0, 0, 0], [0, 0, 0]],
            dtype=torch.int8,
        )
        count = (reasons != 0).sum(1).to(torch.int32)
        bits = torch.tensor(
            [0, int(Violation.UNWRITTEN | Violation.RESERVED) if refuse else 0], dtype=torch.int32
        )
        step.reports.append(
            (
                f"layer {layer}",
                kvattn.OwnershipReport(
                    count, bits, torch.tensor([1, 2]), reasons, torch.zeros(2, dtype=torch.int32)
                ),
            )
        )
        step.refused += count
        drops = torch.tensor([0, NOT_HELD if drop else 0], dtype=torch.int8)
        step.drops.append((f"layer {layer}", drops))
        step.dropped += (drops != 0).to(torch.int32)
    failed = ledger.finish()
    assert list(failed) == ["req_1"] and ledger.failures[0][0] == "req_1"
    assert ledger.counts["refused_pages"] == (2 * layers if refuse else 0)
    assert ledger.counts["dropped_writes"] == (layers if drop else 0)
    return failed["req_1"][2]


def test_failure_names_the_dropped_writes_of_every_layer():
    message = _failed_step(30, drop=True, refuse=True)
    assert "30 NOT_HELD dropped write(s)" in message and "in 30 of 30 layer(s)" in message
    assert "reads: RESERVED on logical page(s) 1 (page 6), in 30 of 30 layer(s)" in message
    assert "reads: UNWRITTEN on logical page(s) 0 (page 5), in 30 of 30 layer(s)" in message
    assert "layer 0, layer 1, layer 2, layer 3, ... (26 more)" in message
    assert message.index("writes:") < message.index("reads:")
    assert len(message.splitlines()) == 4  # heading, writes, two read lines: not one per layer


def test_failure_without_drops_shows_reads_only():
    """The twin: a request whose writes all landed shows no writes line; one with drops only shows
    no reads line."""
    reads_only = _failed_step(3, drop=False, refuse=True)
    assert "writes:" not in reads_only and "in 3 of 3 layer(s)" in reads_only
    writes_only = _failed_step(3, drop=True, refuse=False)
    assert "reads:" not in writes_only and "3 NOT_HELD dropped write(s)" in writes_only


def test_a_clean_step_fails_nobody_and_counts_its_checks():
    ledger = Ledger(16)
    step = ledger.start_step(
        ["a"],
        [7],
        [1],
        torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int64),
        [1],
    )
    step.pages_checked += 4
    assert ledger.finish() == {} and ledger.failures == []
    assert ledger.pages_checked == 4 and ledger.forwards == 1
    assert ledger.finish() == {} and ledger.forwards == 1  # no step: nothing read


def _hit_across(writer: bytes, reader: bytes) -> int:
    """The owner a reader in domain ``reader`` must find on the first page of the same tokens
    written by owner 9 in domain ``writer``."""
    ledger = Ledger(4)
    tokens = torch.arange(10)
    ledger.remember(3, 9, ledger.digests(tokens, domain=writer)[0])
    return ledger.hit_owner(3, ledger.digests(tokens, domain=reader)[0])


def test_a_prefix_hit_in_the_writer_s_own_domain_expects_the_writer():
    """Same tokens, same adapter and salt (named in any order): the writer's owner, as for a
    plain request."""
    assert _hit_across(b"", b"") == 9
    a = cache_domain(lora=("a", 1, "/adapters/a"), cache_salt="tenant-1")
    assert _hit_across(a, cache_domain(cache_salt="tenant-1", lora=("a", 1, "/adapters/a"))) == 9
    assert cache_domain(lora=None, cache_salt="") == b""  # absent parts: a plain request


def test_a_prefix_hit_across_domains_fails_closed():
    """The twin: the same tokens under another adapter, another salt, or with a part missing on
    one side never prove the writer's KV is the reader's (owner 0: the read is refused), and
    moving bytes between parts (SGLang appends the LoRA id to its extra key) does not collide."""
    a = cache_domain(lora=("a", 1, "/adapters/a"))
    assert _hit_across(a, cache_domain(lora=("b", 2, "/adapters/b"))) == 0
    assert _hit_across(a, cache_domain(lora=("a", 1, "/adapters/a2"))) == 0
    assert _hit_across(a, b"") == 0 and _hit_across(b"", a) == 0
    assert _hit_across(cache_domain(cache_salt="s1"), cache_domain(cache_salt="s2")) == 0
    assert _hit_across(cache_domain(cache_salt="x"), cache_domain(extra_key="x")) == 0
    assert cache_domain(extra_key="ab", lora="c") != cache_domain(extra_key="a", lora="bc")


# An image of 6 placeholder tokens at positions 5..10 of a 16-token prompt (pages of 4).
IMAGE = ((5, 6, "img-a"),)


def test_pages_without_media_keep_their_token_digests():
    """A request's media enters only the digests of the pages its placeholders cover, and the
    chain after them: a page before the image keeps the digest of its tokens, so a text prefix is
    still shared with a request without images; the same image at the same place digests alike."""
    tokens = torch.arange(16)
    plain = prefix_digests(tokens, 4)
    with_image = prefix_digests(tokens, 4, media=IMAGE)
    assert with_image[0] == plain[0]
    assert all(a != b for a, b in zip(with_image[1:], plain[1:]))
    assert prefix_digests(tokens, 4, media=IMAGE) == with_image
    # Digested in steps (known pages kept), as a decode extends the chain.
    assert prefix_digests(tokens, 4, with_image[:2], media=IMAGE) == with_image


def test_a_page_of_another_image_or_placed_elsewhere_digests_apart():
    """The twin: the same placeholder tokens behind another image, or the same image starting
    one token later, never share a digest from the first page the image covers on."""
    tokens = torch.arange(16)
    with_image = prefix_digests(tokens, 4, media=IMAGE)
    other = prefix_digests(tokens, 4, media=((5, 6, "img-b"),))
    moved = prefix_digests(tokens, 4, media=((6, 5, "img-a"),))
    for digests in (other, moved):
        assert digests[0] == with_image[0]
        assert all(a != b for a, b in zip(digests[1:], with_image[1:]))
    ledger = Ledger(4)
    ledger.remember(3, 9, with_image[1])
    assert ledger.hit_owner(3, other[1]) == 0 and ledger.hit_owner(3, with_image[1]) == 9


def _decode_forward(
    resolve_once: bool, monkeypatch, fault: bool, backend: str = "auto", dtype=torch.float32
):
    """One decode forward of two requests over 4 layers through ``Step.write``/``Step.attend``;
    with ``fault``, request 1's first page is handed to a stranger before the step. Returns the
    outputs per layer, what ``finish`` failed and how many resolves ran."""
    import kvattn.integrations.ledger as ledger_module

    layers, page, heads, dim = 4, 4, 2, 8
    ledger = Ledger(page, backend=backend)
    ledger.resolve_once = resolve_once
    ledger.allocate_tags(layers, 16, "cpu")
    g = torch.Generator().manual_seed(0)
    pools = torch.full((layers, 2, 16, page, heads, dim), float("nan"), dtype=dtype)
    owners, pages, lens = [], [[1, 2], [5, 6]], [7, 6]
    for b, held in enumerate(pages):
        lease = ledger.open_lease(f"req_{b}")
        owners.append(lease.owner)
        ledger.reserve(held, lease.owner)
        for layer in range(layers):  # the prompt's KV, written in an earlier forward
            slots = torch.tensor([held[i // page] * page + i % page for i in range(lens[b] - 1)])
            kv = torch.randn(2, len(slots), heads, dim, generator=g).to(dtype)
            kvattn.write_kv(
                kv[0],
                kv[1],
                pools[layer, 0],
                pools[layer, 1],
                slots,
                ledger.tags[layer],
                lease.owner,
            )
    if fault:
        ledger.reserve([5], kvattn.tags.new_owner_id())
    calls = []
    real = ledger_module.resolve_pages
    monkeypatch.setattr(
        ledger_module, "resolve_pages", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    table = torch.tensor(pages, dtype=torch.int32)
    step = ledger.start_step(
        ["req_0", "req_1"],
        owners,
        [1, 1],
        table,
        torch.tensor(owners)[:, None].expand(2, 2).contiguous(),
        lens,
    )
    slots = torch.tensor(
        [pages[b][(n - 1) // page] * page + (n - 1) % page for b, n in enumerate(lens)]
    )
    outs = []
    for layer in range(layers):
        new = torch.randn(3, 2, heads, dim, generator=g).to(dtype)
        step.write(
            f"layer {layer}",
            new[0],
            new[1],
            pools[layer, 0],
            pools[layer, 1],
            slots,
            ledger.tags[layer],
        )
        q = torch.randn(2, heads, dim, generator=g).to(dtype)
        outs.append(
            step.attend(f"layer {layer}", q, pools[layer, 0], pools[layer, 1], ledger.tags[layer])
        )
    return outs, ledger.finish(), len(calls)


# The backends a ledger's step reads through, by their readers: auto's on CPU tensors, and the CUDA
# kernels' logic (fp16 rows of 16 bytes) where the harness is built.
READERS = [("auto", torch.float32)] + (
    [("cuda_sim", torch.float16)] if "cuda_sim" in backends_under_test() else []
)


@pytest.mark.parametrize("backend, dtype", READERS)
def test_a_decode_forward_resolves_once_and_reads_as_each_layer_s_check(
    monkeypatch, backend, dtype
):
    once, failed_once, resolves = _decode_forward(True, monkeypatch, False, backend, dtype)
    each, failed_each, none = _decode_forward(False, monkeypatch, False, backend, dtype)
    assert (resolves, none) == (1, 0)
    assert failed_once == failed_each == {}
    for a, b in zip(once, each):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("backend, dtype", READERS)
def test_a_decode_forward_through_the_verdict_fails_the_victim_alone(monkeypatch, backend, dtype):
    """The twin: request 1's first page belongs to a stranger; through the verdict as per call,
    request 1 alone fails, request 0's output is unchanged."""
    once, failed_once, resolves = _decode_forward(True, monkeypatch, True, backend, dtype)
    each, failed_each, _ = _decode_forward(False, monkeypatch, True, backend, dtype)
    assert resolves == 1
    assert list(failed_once) == list(failed_each) == ["req_1"]
    assert "RESERVED on logical page(s) 0" in failed_once["req_1"][2]
    for a, b in zip(once, each):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def _transfer_pair(pools=None):
    """A sender's and a receiver's ledger over copies of two layers of pools (4 pages of 4 slots,
    2 heads of 8): the sender's request (owner 9) wrote logical pages 0 and 1 (4 and 3 tokens)
    into its pages 2 and 0; the receiver holds them, arrived, in its pages 1 and 3."""
    g = torch.Generator().manual_seed(3)
    k = [torch.randn(4, 4, 2, 8, generator=g) for _ in range(2)]
    v = [torch.randn(4, 4, 2, 8, generator=g) for _ in range(2)]
    sender, receiver = Ledger(4), Ledger(4)
    for ledger in (sender, receiver):
        ledger.allocate_tags(2, 4, "cpu")
    sender.tags[:, 2] = kvattn.written_tag(9, 4)
    sender.tags[:, 0] = kvattn.written_tag(9, 3)
    rk, rv = [t.clone() for t in k], [t.clone() for t in v]
    for src, dst in ((k, rk), (v, rv)):
        for a, b in zip(src, dst):
            b[1], b[3] = a[2], a[0]
    return sender, receiver, (k, v), (rk, rv)


def test_a_keyed_transfer_between_ledgers_commits_the_attested_lengths():
    from kvattn.transfer import DigestKey

    sender, receiver, pools, arrived = _transfer_pair()
    tokens = list(range(100, 107))
    key = DigestKey.new()
    claims = sender.attest([9, 9], [2, 0], [0, 1], tokens, *pools, key=key)
    wire = [c.to_json() for c in claims]
    lens, reasons = receiver.verify(wire, [0, 1], [1, 3], tokens, *arrived, key=key)
    assert lens == [4, 3] and reasons == [None, None]
    # The keyless twin of the same transfer names other digests.
    keyless = sender.attest([9, 9], [2, 0], [0, 1], tokens, *pools)
    assert [c.digest for c in keyless] != [c.digest for c in claims]


def test_a_keyed_transfer_checked_with_another_key_or_none_commits_nothing():
    from kvattn.transfer import DigestKey

    sender, receiver, pools, arrived = _transfer_pair()
    tokens = list(range(100, 107))
    wire = [
        c.to_json()
        for c in sender.attest([9, 9], [2, 0], [0, 1], tokens, *pools, key=DigestKey.new())
    ]
    for key in (DigestKey.new(), None):
        lens, reasons = receiver.verify(wire, [0, 1], [1, 3], tokens, *arrived, key=key)
        assert lens == [0, 0] and reasons == ["digest mismatch"] * 2
    # With the digests off the lengths alone are committed, whatever the key.
    lens, _ = receiver.verify(
        wire, [0, 1], [1, 3], tokens, *arrived, check_bytes=False, key=DigestKey.new()
    )
    assert lens == [4, 3]

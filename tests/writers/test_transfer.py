"""kvattn.transfer, the checked receive: the sender's attestation follows its tags (written slots
for the request's owner, nothing for a page it does not hold), the receiver commits a page only by
an attested length whose digest its own bytes reproduce; every refusal beside its clean twin."""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn.transfer import PageAttestation, attest_pages, page_digest, verify_arrived

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 6, 8, 2, 16
OWNER, OTHER = 7, 9


def pools(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (PAGES, PAGE, HEADS, DIM)
    return (
        [
            torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for _ in range(LAYERS)
        ],
        [
            torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for _ in range(LAYERS)
        ],
    )


def sender_tags():
    """Page 0 full and page 1 five slots WRITTEN for OWNER in both layers; page 2 written for
    OTHER; page 3 RESERVED for OWNER; page 4 FREE; page 5 written 6 slots in layer 0, 3 in 1."""
    row = torch.tensor(
        [
            kvattn.written_tag(OWNER, PAGE),
            kvattn.written_tag(OWNER, 5),
            kvattn.written_tag(OTHER, PAGE),
            kvattn.reserved_tag(OWNER),
            0,
            kvattn.written_tag(OWNER, 6),
        ]
    )
    tags = torch.stack([row, row.clone()])
    tags[1, 5] = kvattn.written_tag(OWNER, 3)
    return tags


def copy_of(k, v):
    return [t.clone() for t in k], [t.clone() for t in v]


def test_the_attestation_follows_the_senders_tags():
    k, v = pools()
    got = attest_pages(sender_tags(), OWNER, range(PAGES), k, v)
    assert [a.valid_len for a in got] == [PAGE, 5, 0, 0, 0, 3]
    assert got[1].digest == page_digest(k, v, 1, 5)
    # Per-page owners: page 2 is a prefix hit written by OTHER.
    hits = attest_pages(sender_tags(), [OWNER, OTHER, OTHER], [0, 2, 1], k, v)
    assert [a.valid_len for a in hits] == [PAGE, PAGE, 0]
    # A one-row tag array (one layer) is taken as such.
    single = attest_pages(sender_tags()[0], OWNER, [5], k[:1], v[:1])
    assert single[0].valid_len == 6


def test_the_digest_covers_only_the_written_slots_of_every_layer():
    k, v = pools()
    base = page_digest(k, v, 1, 5)
    k[1][1, 5:] = 0  # past the written slots: not covered
    assert page_digest(k, v, 1, 5) == base
    v[1][1, 4, 0, 0] += 1  # a written slot of layer 1's V
    assert page_digest(k, v, 1, 5) != base
    assert page_digest(k, v, 1, 4) != page_digest(k, v, 1, 5)  # the length is part of it


def test_bytes_that_arrived_whole_are_committed_by_the_attested_length():
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0, 1], k, v)
    rk, rv = copy_of(k, v)
    lens, reasons = verify_arrived(claims, [0, 1], rk, rv)
    assert lens == [PAGE, 5] and reasons == [None, None]


@pytest.mark.parametrize("case", ["torn", "unattested", "bad_length"])
def test_a_page_that_cannot_be_verified_is_not_committed(case):
    """The twin: what arrived differs from what was attested, no attestation came, or the
    attested length cannot be a page's."""
    k, v = pools()
    claims: list = attest_pages(sender_tags(), OWNER, [0, 1], k, v)
    rk, rv = copy_of(k, v)
    if case == "torn":
        rk[0][1, 2, 1, 3] = -rk[0][1, 2, 1, 3] - 1
        want = "digest mismatch"
    elif case == "unattested":
        claims[1] = None
        want = "not attested"
    else:
        claims[1] = PageAttestation(PAGE + 1, claims[1].digest)
        want = f"attested length {PAGE + 1} outside [0, {PAGE}]"
    lens, reasons = verify_arrived(claims, [0, 1], rk, rv)
    assert lens == [PAGE, 0] and reasons == [None, want]


def test_a_stale_page_of_the_sender_is_attested_as_empty():
    """A page the sender's list names but the request does not hold (another owner's, or only
    reserved) comes with length 0: nothing of it is committed."""
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [2, 3, 4], k, v)
    lens, reasons = verify_arrived(claims, [2, 3, 4], *copy_of(k, v))
    assert lens == [0, 0, 0] and reasons == [None, None, None]


def test_attestations_travel_as_json_and_refuse_anything_else():
    a = PageAttestation(5, "ab" * 16)
    assert PageAttestation.from_json(a.to_json()) == a
    for bad in ([5], [True, "ab"], ["5", "ab"], [5, 7], "5,ab", None):
        with pytest.raises(ValueError, match="attestation: expected"):
            PageAttestation.from_json(bad)


def test_without_byte_checks_the_lengths_alone_are_committed():
    """A deployment that turns the digest off: the sender sends no digests, the receiver commits
    by the attested lengths (a torn page then goes unnoticed; its stale twin still does not)."""
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0, 2], k, v, digests=False)
    assert [c.digest for c in claims] == ["", ""]
    rk, rv = copy_of(k, v)
    rk[0][0, 0, 0, 0] += 1
    lens, reasons = verify_arrived(claims, [0, 2], rk, rv, check_bytes=False)
    assert lens == [PAGE, 0] and reasons == [None, None]


def test_a_page_verifies_only_in_its_context():
    """The sender's context (its digest of the tokens through the page, in vLLM) is part of the
    digest: the same bytes received where the receiver's context differs (other tokens, another
    position) are refused; in the same context they are committed."""
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0, 1], k, v, contexts=[b"tokens a", b"tokens b"])
    ok, _ = verify_arrived(claims, [0, 1], k, v, contexts=[b"tokens a", b"tokens b"])
    assert ok == [PAGE, 5]
    lens, reasons = verify_arrived(claims, [0, 1], k, v, contexts=[b"tokens a", b"tokens c"])
    assert lens == [PAGE, 0] and reasons == [None, "digest mismatch"]


# The transfer API is a trust boundary: each wrong argument raises naming it, before any tag or
# byte is read; each refusal below has a clean twin that the same call with the argument put right
# passes.


def test_a_tag_row_per_layer_is_required():
    """One tag row for two layers would attest the second layer's page without reading its tag
    (there, the page may be FREE and hold another request's bytes)."""
    k, v = pools()
    tags = sender_tags()
    with pytest.raises(
        ValueError, match=r"page_tags: expected one row per layer of the pools \(2\)"
    ):
        attest_pages(tags[:1], OWNER, [0], k, v)
    with pytest.raises(ValueError, match=r"page_tags: expected shape \(6,\) or \(2, 6\)"):
        attest_pages(tags[:, :4], OWNER, [0], k, v)
    with pytest.raises(TypeError, match="page_tags: expected dtype int64, got int32"):
        attest_pages(tags.to(torch.int32), OWNER, [0], k, v)
    # A 1-D row is one tag per page for every layer; two rows are one per layer.
    assert attest_pages(tags[0], OWNER, [0], k, v)[0].valid_len == PAGE
    assert attest_pages(tags, OWNER, [5], k, v)[0].valid_len == 3


@pytest.mark.parametrize("page", [-1, -PAGES, PAGES, 2**40])
def test_a_page_id_outside_the_pools_is_refused_never_wrapped(page):
    """-1 (engines pad block lists with it) is not the pools' last page."""
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0, PAGES - 1], k, v)
    with pytest.raises(ValueError, match=rf"pages\[1\]: expected an int in \[0, {PAGES - 1}\]"):
        attest_pages(sender_tags(), OWNER, [0, page], k, v)
    with pytest.raises(ValueError, match=rf"pages\[1\]: expected an int in \[0, {PAGES - 1}\]"):
        verify_arrived(claims, [0, page], k, v)
    with pytest.raises(ValueError, match=rf"page: expected an int in \[0, {PAGES - 1}\]"):
        page_digest(k, v, page, 1)
    lens, _ = verify_arrived(claims, [0, PAGES - 1], k, v)
    assert lens == [PAGE, 3]


@pytest.mark.parametrize(
    "owner, error, message",
    [
        (7.9, TypeError, r"owner: expected an int, got float"),
        ("7", TypeError, r"owner: expected an int, got str"),
        (None, TypeError, r"owner: expected an int, got NoneType"),
        (True, TypeError, r"owner: expected an int, got bool"),
        (-OWNER, ValueError, r"owner: expected an id in \[1, "),
        (2**64, ValueError, r"owner: expected an id in \[1, "),
        ([OWNER], ValueError, r"owner: expected one entry per page \(2\), got 1"),
        ([OWNER, -1], ValueError, r"owner\[1\]: expected an id in \[1, "),
        (torch.tensor([OWNER, OWNER], dtype=torch.int32), TypeError, r"owner: expected an int"),
    ],
)
def test_an_owner_that_is_not_an_id_is_refused(owner, error, message):
    k, v = pools()
    with pytest.raises(error, match=message):
        attest_pages(sender_tags(), owner, [0, 1], k, v)
    # The same pages for OWNER, as an int, a list and a tensor: the same attestation.
    want = attest_pages(sender_tags(), OWNER, [0, 1], k, v)
    assert attest_pages(sender_tags(), [OWNER, OWNER], [0, 1], k, v) == want
    assert attest_pages(sender_tags(), torch.tensor(OWNER), torch.tensor([0, 1]), k, v) == want


def test_owner_zero_attests_nothing_even_a_tag_whose_owner_field_is_zero():
    """Owner 0 (a page the request does not hold there) attests length 0, also over a WRITTEN word
    whose owner field is 0 (no lease holds owner 0)."""
    k, v = pools()
    tags = sender_tags()
    tags[:, 4] = 2 | (PAGE << 2)  # WRITTEN, PAGE slots, owner field 0
    assert [a.valid_len for a in attest_pages(tags, [0, 0, OWNER], [4, 0, 0], k, v)] == [0, 0, PAGE]


def test_a_claim_must_be_an_attestation():
    """The wire form is parsed by PageAttestation.from_json; a raw list, a non-integer length or a
    missing entry is a caller's error, named."""
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0, 1], k, v, digests=False)
    with pytest.raises(TypeError, match=r"attested\[0\]: expected a PageAttestation or None"):
        verify_arrived([c.to_json() for c in claims], [0, 1], k, v, check_bytes=False)
    with pytest.raises(TypeError, match=r"valid_len: expected an int, got float \(2.5\)"):
        PageAttestation(2.5, "")
    with pytest.raises(TypeError, match="digest: expected a hex str, got bytes"):
        PageAttestation(2, b"ab")
    with pytest.raises(ValueError, match=r"attested: expected one entry per page \(2\), got 1"):
        verify_arrived(claims[:1], [0, 1], k, v, check_bytes=False)
    with pytest.raises(TypeError, match="attested: expected a list with one entry per page"):
        verify_arrived(None, [0, 1], k, v, check_bytes=False)
    lens, _ = verify_arrived(claims, [0, 1], k, v, check_bytes=False)
    assert lens == [PAGE, 5]


def test_pools_and_contexts_are_checked():
    k, v = pools()
    claims = attest_pages(sender_tags(), OWNER, [0], k, v, contexts=[b"a"])
    # One 4-D pool is not a list of layers: its pages would be digested as layers.
    with pytest.raises(
        TypeError, match=r"k_caches: expected a list of per-layer pools .* \[pool\]"
    ):
        attest_pages(sender_tags()[0], OWNER, [0], k[0], v, contexts=[b"a"])
    with pytest.raises(
        ValueError, match=r"v_caches: expected one pool per layer of k_caches \(2\)"
    ):
        verify_arrived(claims, [0], k, v[:1], contexts=[b"a"])
    with pytest.raises(ValueError, match=r"k_caches\[1\]: expected 6 pages of 8 slots"):
        verify_arrived(claims, [0], [k[0], k[1][:3]], v, contexts=[b"a"])
    with pytest.raises(ValueError, match=r"k_caches\[0\]: expected a 4-D tensor"):
        verify_arrived(claims, [0], [k[0][0], k[1]], v, contexts=[b"a"])
    with pytest.raises(TypeError, match=r"contexts\[0\]: expected bytes, got str"):
        verify_arrived(claims, [0], k, v, contexts=["a"])
    with pytest.raises(ValueError, match=r"contexts: expected one entry per page \(1\), got 2"):
        verify_arrived(claims, [0], k, v, contexts=[b"a", b"b"])
    with pytest.raises(ValueError, match=rf"valid_len: expected an int in \[0, {PAGE}\]"):
        page_digest(k, v, 0, PAGE + 1)
    assert verify_arrived(claims, [0], k, v, contexts=[b"a"]) == ([PAGE], [None])


def _layout_digest(k, v, page: int, valid_len: int, context: bytes = b"") -> str:
    """The digest as docs/transfer.md lays it out, from the bytes alone."""
    blake3 = pytest.importorskip("blake3")
    h = blake3.blake3()
    for kl, vl in zip(k, v):
        for pool in (kl, vl):
            h.update(pool[page, :valid_len].contiguous().view(torch.uint8).numpy().tobytes())
    h.update(context + valid_len.to_bytes(4, "little") + len(context).to_bytes(4, "little"))
    return h.hexdigest(length=16)


@pytest.mark.parametrize("layout", ["NHD", "HND view", "fp8"])
def test_the_digest_is_blake3_of_the_documented_layout(layout):
    k, v = pools()
    if layout == "HND view":
        k = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in k]
        v = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in v]
    if layout == "fp8":
        k = [t.to(torch.float8_e4m3fn) for t in k]
        v = [t.to(torch.float8_e5m2) for t in v]
    for page, n, context in ((0, PAGE, b""), (1, 5, b"ctx"), (2, 0, b"x" * 40)):
        assert page_digest(k, v, page, n, context) == _layout_digest(k, v, page, n, context)
    assert page_digest(k, v, 1, 5) != page_digest(k, v, 1, 4)


def test_digests_do_not_depend_on_threads_or_staging(monkeypatch):
    from kvattn import transfer

    k, v = pools(3)
    tags = torch.full((LAYERS, PAGES), kvattn.written_tag(OWNER, PAGE))
    default = transfer._threads
    transfer.set_digest_threads(1)
    one = attest_pages(tags, OWNER, list(range(PAGES)) * 3, k, v)
    transfer.set_digest_threads(3)
    try:
        three = attest_pages(tags, OWNER, list(range(PAGES)) * 3, k, v)
        # Device pools are staged on the host a batch of pages at a time: the same digests.
        monkeypatch.setattr(transfer, "STAGE_BYTES", 1)
        pools_ = [p for pair in zip(k, v) for p in pair]
        staged = list(transfer._staged(pools_, [4, 1, 5]))
        assert len(staged) == 3
        for host, local, where in staged:
            page = [4, 1, 5][where[0]]
            host = [transfer._Bytes(p) for p in host]
            assert transfer._one(host, local[0], PAGE, b"") == page_digest(k, v, page, PAGE)
    finally:
        transfer.set_digest_threads(default)
    assert one == three and len({a.digest for a in one}) == PAGES


def test_the_async_forms_check_here_and_digest_there():
    from kvattn.transfer import attest_pages_async, verify_arrived_async

    k, v = pools()
    claims = attest_pages_async(sender_tags(), OWNER, range(PAGES), k, v).result()
    assert claims == attest_pages(sender_tags(), OWNER, range(PAGES), k, v)
    rk, rv = copy_of(k, v)
    rk[1][1, 2] += 1  # layer 1's K of page 1 differs inside the attested slots
    lens, reasons = verify_arrived_async(claims, range(PAGES), rk, rv).result()
    assert lens == [PAGE, 0, 0, 0, 0, 3] and reasons[1] == "digest mismatch"
    with pytest.raises(ValueError, match="pages"):
        verify_arrived_async(claims, [PAGES] * PAGES, rk, rv)
    with pytest.raises(TypeError, match="owner"):
        attest_pages_async(sender_tags(), "7", range(PAGES), k, v)


def test_a_tag_longer_than_its_page_is_refused_by_the_receiver():
    """A malformed tag (valid_len past the page; no writer makes one) is attested as it says, and
    the receiver refuses that length: nothing past the page is read on either side."""
    k, v = pools()
    tags = sender_tags()
    tags[:, 0] = kvattn.tags.accept_key(OWNER) | (200 << kvattn.tags.VALID_LEN_SHIFT)
    claims = attest_pages(tags, OWNER, [0, 1], k, v)
    assert claims[0].valid_len == 200
    lens, reasons = verify_arrived(claims, [0, 1], *copy_of(k, v))
    assert lens == [0, 5] and "outside" in reasons[0]

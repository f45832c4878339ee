"""The keyed transfer digest (kvattn.transfer.DigestKey; docs/transfer.md, "The keyed digest"): NH
in four Toeplitz instances over the pages where they lie, on the device (the Triton kernel, run
here under the interpreter) and on the host (NumPy), both equal to a slow reference in Python
integers; then the checked receive with a key, and what a key buys: a collision made with one
key is none with the key's other instances, or with another key."""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import transfer
from kvattn.backends import cpu as cpu_backend
from kvattn.backends.triton import digest

pytest.importorskip("blake3")

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 5, 4, 2, 8
OWNER = 5


def pools(dtype=torch.bfloat16, seed=0, interleaved=False, heads=HEADS):
    """K and V pools per layer; ``interleaved``: views of one ``[pages, 2, page, heads, dim]``
    tensor per layer (a page stride twice the page's size), as some engines allocate, or with
    ``"slots"`` of one ``[pages, page, 2, heads, dim]`` (a slot stride twice the row's size);
    ``"hnd"``: head-major pools (``[pages, heads, page, dim]`` in memory); ``"heads"``: K and V
    halves of one head-major ``[pages, heads, page, 2 * dim]`` tensor (vLLM's CPU cache), so a
    slot's head rows lie apart."""
    g = torch.Generator().manual_seed(seed)
    k, v = [], []
    for _ in range(LAYERS):
        data = torch.randn(PAGES, 2, PAGE, heads, DIM, generator=g).to(dtype)
        if interleaved == "slots":
            data = data.transpose(1, 2).contiguous()
            k.append(data[:, :, 0])
            v.append(data[:, :, 1])
        elif interleaved == "hnd":
            k.append(data[:, 0].transpose(1, 2).contiguous().transpose(1, 2))
            v.append(data[:, 1].transpose(1, 2).contiguous().transpose(1, 2))
        elif interleaved == "heads":
            data = torch.cat([data[:, 0], data[:, 1]], dim=-1).transpose(1, 2).contiguous()
            k.append(data[..., :DIM].transpose(1, 2))
            v.append(data[..., DIM:].transpose(1, 2))
        elif interleaved:
            k.append(data[:, 0])
            v.append(data[:, 1])
        else:
            k.append(data[:, 0].contiguous())
            v.append(data[:, 1].contiguous())
    return k, v


def reference_nh(k, v, page: int, valid_len: int, key: kvattn.transfer.DigestKey) -> list[int]:
    """docs/transfer.md's NH, in Python integers: per layer K then V, slots [0, valid_len) as
    32-bit words, chunk c's key from its page-sized stretch on, instance j shifted by 4 j."""
    chunks = [pool for pair in zip(k, v) for pool in pair]
    words = key.words(digest.key_words(chunks), "cpu").tolist()
    words = [w & 0xFFFFFFFF for w in words]
    sums = [0] * digest.INSTANCES
    at = 0
    for pool in chunks:
        rows = pool[page, :valid_len].contiguous().view(torch.int32).flatten().tolist()
        m = [w & 0xFFFFFFFF for w in rows]
        for j in range(digest.INSTANCES):
            kk = words[at + digest.SHIFT * j :]
            sums[j] += sum(
                ((m[2 * i] + kk[2 * i]) % 2**32) * ((m[2 * i + 1] + kk[2 * i + 1]) % 2**32)
                for i in range(len(m) // 2)
            )
        at += pool[0].numel() * pool.element_size() // 4
    return [s % 2**64 for s in sums]


def as_int32(x: int) -> int:
    x %= 2**32
    return x - 2**32 if x >= 2**31 else x


def as_unsigned(values) -> list[int]:
    return [int(x) % 2**64 for x in values]


# Rows of 8 (bfloat16), 16 (float32) and 4 (fp8) words, or with 3 heads 12, 24 and 6 words (the
# kernel's masked words past the row): the compiled host NH's pair-by-pair and 16-word paths;
# slots back to back (one message run per page) or not ("slots"), head rows apart ("hnd",
# "heads"; fp8's 8-byte head rows are refused there, below).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("interleaved", [False, True, "slots", "hnd", "heads"])
@pytest.mark.parametrize("heads", [HEADS, 3])
def test_nh_on_the_device_and_the_host_is_the_reference(dtype, interleaved, heads):
    if dtype == torch.float8_e4m3fn and (interleaved in ("hnd", "heads") or heads == 3):
        pytest.skip("rows of 16-byte units only")
    k, v = pools(dtype, interleaved=interleaved, heads=heads)
    transfer._keyable([pool for pair in zip(k, v) for pool in pair])
    key = transfer.DigestKey(bytes(range(32)))
    chunks = [pool for pair in zip(k, v) for pool in pair]
    pages, lens = [3, 0, 4, 1], [PAGE, 1, 3, 0]
    words = key.words(digest.key_words(chunks), "cpu")
    device = digest.nh(chunks, torch.tensor(pages), torch.tensor(lens), words)
    host = [transfer._Bytes(pool) for pool in chunks]
    key_np = words.numpy().view("uint32")
    for i, (page, n) in enumerate(zip(pages, lens)):
        want = reference_nh(k, v, page, n, key)
        assert as_unsigned(device[i].tolist()) == want
        got = torch.frombuffer(
            bytearray(transfer._nh_host(host, page, n, key_np)), dtype=torch.int64
        )
        assert as_unsigned(got.tolist()) == want
    if cpu_backend._cpu is not None:
        compiled = transfer._nh_cpu(chunks, pages, lens, words)
        for value, page, n in zip(compiled, pages, lens):
            got = torch.frombuffer(bytearray(value), dtype=torch.int64)
            assert as_unsigned(got.tolist()) == reference_nh(k, v, page, n, key)
    assert len({tuple(device[i].tolist()) for i in range(len(pages))}) == len(pages)


@pytest.mark.skipif(cpu_backend._cpu is None, reason="the compiled CPU module is not built")
def test_the_compiled_host_nh_refuses_reads_outside_the_pools_and_the_key():
    """The binding's own guards, behind kvattn.transfer's validation: a page past the pool and a
    key shorter than the pages it covers raise instead of reading past them; their twin runs."""
    k, v = pools(torch.float32)
    chunks = [pool for pair in zip(k, v) for pool in pair]
    words = transfer.DigestKey(bytes(32)).words(digest.key_words(chunks), "cpu")
    assert len(transfer._nh_cpu(chunks, [PAGES - 1], [PAGE], words)) == 1
    with pytest.raises(ValueError, match="a page outside the pool"):
        transfer._nh_cpu(chunks, [PAGES], [PAGE], words)
    with pytest.raises(ValueError, match="the key is shorter"):
        transfer._nh_cpu(chunks, [0], [PAGE], words[:-1])


def _tags():
    row = torch.tensor([kvattn.written_tag(OWNER, n) for n in (PAGE, 3, PAGE, 1, 2)])
    return torch.stack([row] * LAYERS)


def test_a_keyed_transfer_commits_what_arrived_whole_and_refuses_the_rest():
    k, v = pools()
    key = transfer.DigestKey.new()
    claims = transfer.attest_pages(_tags(), OWNER, range(PAGES), k, v, key=key)
    assert claims[0].digest != transfer.page_digest(k, v, 0, PAGE)  # another scheme than BLAKE3
    assert claims[1].digest == transfer.page_digest(k, v, 1, 3, key=key)
    rk, rv = [t.clone() for t in k], [t.clone() for t in v]
    lens, reasons = transfer.verify_arrived(claims, range(PAGES), rk, rv, key=key)
    assert lens == [PAGE, 3, PAGE, 1, 2] and reasons == [None] * PAGES
    rv[1][2, 0, 1, 3] += 1  # layer 1's V of page 2, inside the attested slots
    rk[0][1, 3] = float("nan")  # page 1's slot 3: past its 3 attested slots, not covered
    lens, reasons = transfer.verify_arrived(claims, range(PAGES), rk, rv, key=key)
    assert lens == [PAGE, 3, 0, 1, 2] and reasons[2] == "digest mismatch"
    # The twin: the same bytes under another key, or checked without one, verify nothing.
    lens, _ = transfer.verify_arrived(claims, range(PAGES), k, v, key=transfer.DigestKey.new())
    assert lens == [0] * PAGES
    lens, _ = transfer.verify_arrived(claims, range(PAGES), k, v)
    assert lens == [0] * PAGES


def test_a_collision_made_with_the_key_holds_for_one_instance_only():
    """Whoever knows the key can swap a word pair so that instance 0's products are unchanged;
    the other instances read the key shifted and tell the pages apart, and a receiver's fresh key
    makes the construction impossible beforehand."""
    k, v = pools(torch.float32)
    key = transfer.DigestKey(bytes(32))
    chunks = [pool for pair in zip(k, v) for pool in pair]
    words = [w & 0xFFFFFFFF for w in key.words(digest.key_words(chunks), "cpu").tolist()]
    forged = [t.clone() for t in k]
    m = forged[0][0].view(torch.int32).flatten()
    a, b = int(m[0]) & 0xFFFFFFFF, int(m[1]) & 0xFFFFFFFF
    # (a' + k0)(b' + k1) = (b + k1)(a + k0): instance 0 sees the same product.
    m[0] = as_int32(b + words[1] - words[0])
    m[1] = as_int32(a + words[0] - words[1])
    honest = reference_nh(k, v, 0, PAGE, key)
    faked = reference_nh(forged, v, 0, PAGE, key)
    assert faked[0] == honest[0] and faked[1:] != honest[1:]
    assert transfer.page_digest(forged, v, 0, PAGE, key=key) != transfer.page_digest(
        k, v, 0, PAGE, key=key
    )


def test_digest_keys_are_checked_and_travel_as_hex():
    key = transfer.DigestKey.new()
    assert transfer.DigestKey.from_hex(key.hex()) == key and key != transfer.DigestKey.new()
    assert torch.equal(key.words(9, "cpu"), transfer.DigestKey(key.seed).words(9, "cpu"))
    for bad in ("00" * 31, "zz" * 32, 7):
        with pytest.raises(ValueError, match="digest key"):
            transfer.DigestKey.from_hex(bad)
    with pytest.raises(TypeError, match="seed"):
        transfer.DigestKey(b"short")
    k, v = pools()
    with pytest.raises(TypeError, match="key"):
        transfer.attest_pages(_tags(), OWNER, [0], k, v, key=key.hex())
    with pytest.raises(TypeError, match="key"):
        transfer.verify_arrived_async([None], [0], k, v, key=b"x")


def test_pools_the_keyed_digest_cannot_read_as_words_are_refused():
    k, v = pools()
    odd = [torch.zeros(PAGES, PAGE, 1, 3, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="k_caches\\[0\\].*slot rows of 16-byte units"):
        transfer.page_digest(odd, odd, 0, 1, key=transfer.DigestKey.new())
    # Head rows apart must each be 16-byte units: 4 bfloat16 are 8 bytes.
    narrow = [t[..., :4].transpose(1, 2).contiguous().transpose(1, 2) for t in v]
    with pytest.raises(ValueError, match="v_caches\\[0\\].*head rows of 16-byte units"):
        transfer.page_digest(
            [t[..., :4].contiguous() for t in k], narrow, 0, 1, key=transfer.DigestKey.new()
        )
    strided = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in v]
    with pytest.raises(ValueError, match="v_caches\\[0\\].*contiguous head rows"):
        transfer.page_digest(k, strided, 0, 1, key=transfer.DigestKey.new())
    # Their twins: the same bytes as head rows of 16-byte units digest, whatever the layout.
    hnd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in v]
    key = transfer.DigestKey.new()
    assert transfer.page_digest(k, hnd, 0, 2, key=key) == transfer.page_digest(k, v, 0, 2, key=key)


def test_a_key_is_drawn_only_for_pools_the_keyed_digest_reads_at_speed(monkeypatch):
    k, v = pools()
    first, second = transfer.DigestKey.for_pools(k, v), transfer.DigestKey.for_pools(k, v)
    if cpu_backend._cpu is None:
        assert first is None  # host pools: NumPy's NH is slower than BLAKE3
    else:
        assert isinstance(first, transfer.DigestKey) and first != second
    odd = [torch.zeros(PAGES, PAGE, 1, 3, dtype=torch.bfloat16) for _ in range(LAYERS)]
    assert transfer.DigestKey.for_pools(odd, odd) is None
    monkeypatch.setattr(cpu_backend, "_cpu", None)
    assert transfer.DigestKey.for_pools(k, v) is None
    with pytest.raises(TypeError, match="k_caches"):
        transfer.DigestKey.for_pools(k[0], v)

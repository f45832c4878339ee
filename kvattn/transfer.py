"""The checked receive of a KV transfer, for any transfer engine: what the sender attests about
the pages it sends, and what the receiver verifies before :func:`kvattn.commit_pages` stamps them.

A transfer moves whole pages. What a receiver can prove about a page it received is only what
arrived; what it must also know is how many leading slots of that page the sender had written for
the request, because the rest of a sender's page is whatever an earlier request left there (pages
are reused, never zeroed). So the sender attests, per page it sends, from its own tags:

- ``valid_len``: the leading slots its tags hold WRITTEN for the request's owner in every layer
  (0 for a page the request does not hold: a padded or stale entry in the sender's list);
- ``digest``: :func:`page_digest` of those slots' K and V bytes in every layer.

The receiver, once the transfer engine reports a page's bytes arrived, recomputes the digest of
the same slots of its own copy (:func:`verify_arrived`) and commits the page by the attested
``valid_len`` only if the digests are equal: bytes that differ (a torn or misdirected write, a
sender that attests bytes it did not send) leave the page RESERVED, and a read of it is refused.
A page without an attestation is not committed. The attestation travels beside the transfer's own
metadata (``kvattn.integrations.vllm_connector`` puts it in vLLM's ``kv_transfer_params``); it is
as trustworthy as the sender's tags, which is the point: the sender's ledger, not its scheduler's
token count, says what its pages hold.

The digest is BLAKE2b (16 bytes) over the length and the length of a context as 4 little-endian
bytes each, the context (bytes both sides derive on their own, such as a digest of the token prefix
through the page: then a page verifies only for the tokens and the position it was written for),
then, per layer in order, the K then the V bytes of slots ``[0, valid_len)`` of the page in the
pools' logical NHD order ``[slot, kv_head, head_dim]``. It is computed on the host (the pages are
copied there); both sides must lay the pages out alike (same dtype, heads and head dim).

Both functions are a trust boundary (the attestation arrives from another machine, the page lists
from an engine's bookkeeping): every argument is validated and a wrong one raises ``TypeError`` or
``ValueError`` naming it, before any tag or byte is read. A page id outside the pools (``-1``, the
padding engines put in block lists, included) is refused, never wrapped around.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import check_tensor
from .tags import STATE_WRITTEN, check_owner, tag_owner, tag_state, tag_valid_len

DIGEST_BYTES = 16


@dataclass(frozen=True)
class PageAttestation:
    """What the sender says of one page it sends: written slots and their digest (hex)."""

    valid_len: int
    digest: str

    def __post_init__(self):
        if isinstance(self.valid_len, bool) or not isinstance(self.valid_len, int):
            raise TypeError(
                f"valid_len: expected an int, got {type(self.valid_len).__name__} "
                f"({self.valid_len!r})"
            )
        if not isinstance(self.digest, str):
            raise TypeError(f"digest: expected a hex str, got {type(self.digest).__name__}")

    def to_json(self) -> list:
        return [self.valid_len, self.digest]

    @classmethod
    def from_json(cls, value) -> PageAttestation:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or isinstance(value[0], bool)
            or not isinstance(value[0], int)
            or not isinstance(value[1], str)
        ):
            raise ValueError(f"attestation: expected [valid_len, digest hex], got {value!r}")
        return cls(int(value[0]), value[1])


def _check_pools(k_caches, v_caches) -> tuple[int, int]:
    """``(num_pages, page_size)`` of the layers' K and V pools, each ``[num_pages, page_size,
    kv_heads, head_dim]``, one per layer in a list (one 4-D tensor is not a list of layers: its
    pages would be digested as layers)."""
    for name, pools in (("k_caches", k_caches), ("v_caches", v_caches)):
        if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence):
            raise TypeError(
                f"{name}: expected a list of per-layer pools [num_pages, page_size, kv_heads, "
                f"head_dim], got {type(pools).__name__}"
                + (" (one tensor: pass [pool] for one layer)" if torch.is_tensor(pools) else "")
            )
        if not pools:
            raise ValueError(f"{name}: expected at least one layer, got an empty list")
        for i, pool in enumerate(pools):
            check_tensor(f"{name}[{i}]", pool, ndim=4)
    if len(k_caches) != len(v_caches):
        raise ValueError(
            f"v_caches: expected one pool per layer of k_caches ({len(k_caches)}), "
            f"got {len(v_caches)}"
        )
    pages_and_size = tuple(k_caches[0].shape[:2])
    for name, pools in (("k_caches", k_caches), ("v_caches", v_caches)):
        for i, pool in enumerate(pools):
            if tuple(pool.shape[:2]) != pages_and_size:
                raise ValueError(
                    f"{name}[{i}]: expected {pages_and_size[0]} pages of {pages_and_size[1]} slots "
                    f"(k_caches[0]'s), got shape {tuple(pool.shape)}"
                )
    return pages_and_size


def _check_pages(pages, num_pages: int) -> list[int]:
    """``pages`` as a list of ids in ``[0, num_pages)``: a sequence of ints or a 1-D integer
    tensor."""
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
            raise TypeError(
                f"pages: expected a 1-D integer tensor or a list of ints, got a "
                f"{pages.dim()}-D {str(pages.dtype).replace('torch.', '')} tensor"
            )
        pages = pages.tolist()
    if isinstance(pages, (str, bytes)) or not isinstance(pages, Sequence):
        raise TypeError(f"pages: expected a list of page ids, got {type(pages).__name__}")
    return [_check_int(f"pages[{i}]", page, 0, num_pages - 1) for i, page in enumerate(pages)]


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value


def _check_per_page(name: str, values, count: int) -> list:
    """``values`` (one per page) as a list of ``count``."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name}: expected a list with one entry per page, got {type(values).__name__}"
        )
    if len(values) != count:
        raise ValueError(f"{name}: expected one entry per page ({count}), got {len(values)}")
    return list(values)


def _check_contexts(contexts, count: int) -> list[bytes]:
    if contexts is None:
        return [b""] * count
    out = _check_per_page("contexts", contexts, count)
    for i, context in enumerate(out):
        if not isinstance(context, (bytes, bytearray)):
            raise TypeError(f"contexts[{i}]: expected bytes, got {type(context).__name__}")
    return [bytes(c) for c in out]


def page_digest(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    page: int,
    valid_len: int,
    context: bytes = b"",
) -> str:
    """The digest of slots ``[0, valid_len)`` of ``page`` over every layer's K and V pools
    (NHD views ``[num_pages, page_size, kv_heads, head_dim]``, any strides), as hex.
    ``context``: bytes both sides derive on their own for this page (an engine's digest of the
    token prefix the page ends, say), so that the page verifies only where it belongs."""
    num_pages, page_size = _check_pools(k_caches, v_caches)
    _check_int("page", page, 0, num_pages - 1)
    _check_int("valid_len", valid_len, 0, page_size)
    (context,) = _check_contexts([context], 1)
    return _digest(k_caches, v_caches, page, valid_len, context)


def _digest(k_caches, v_caches, page: int, valid_len: int, context: bytes) -> str:
    h = hashlib.blake2b(
        int(valid_len).to_bytes(4, "little") + len(context).to_bytes(4, "little") + context,
        digest_size=DIGEST_BYTES,
    )
    for k, v in zip(k_caches, v_caches, strict=True):
        for pool in (k, v):
            rows = pool[page, :valid_len].contiguous().cpu()
            h.update(rows.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def attest_pages(
    page_tags: torch.Tensor,
    owner,
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    digests: bool = True,
    contexts: Sequence[bytes] | None = None,
) -> list[PageAttestation]:
    """The sender's attestation of ``pages`` for a request: ``owner`` is the owner each page must
    carry for it, an int or one per page (a prefix-cache hit carries the owner that wrote it);
    0 for a page the request does not hold there, which attests nothing whatever its tag says.

    ``page_tags``: ``[num_pages]`` or ``[num_layers, num_pages]`` (one row per layer of the
    pools). A page's ``valid_len`` is the smallest over the layers of its WRITTEN length for its
    owner (0 where a layer's tag is not WRITTEN for that owner). ``contexts``: one per page, for
    :func:`page_digest` (the receiver must pass the same). ``digests=False`` leaves the digests
    empty, for a deployment whose receivers commit by the lengths alone."""
    num_pages, _ = _check_pools(k_caches, v_caches)
    check_tensor("page_tags", page_tags, dtypes=(torch.int64,))
    layers = len(k_caches)
    if page_tags.dim() not in (1, 2) or page_tags.shape[-1] != num_pages:
        raise ValueError(
            f"page_tags: expected shape ({num_pages},) or ({layers}, {num_pages}) (the pools' "
            f"pages, one row per layer), got {tuple(page_tags.shape)}"
        )
    if page_tags.dim() == 2 and page_tags.shape[0] != layers:
        # Fewer rows than layers would attest layers whose tags nobody read.
        raise ValueError(
            f"page_tags: expected one row per layer of the pools ({layers}), got "
            f"{page_tags.shape[0]} rows"
        )
    pages = _check_pages(pages, num_pages)
    owners = _check_owners(owner, len(pages))
    contexts = _check_contexts(contexts, len(pages))
    tags = page_tags if page_tags.dim() == 2 else page_tags[None]
    index = torch.tensor(pages, dtype=torch.int64, device=tags.device)
    rows = tags[:, index]  # [num_layers, P]
    expected = torch.tensor(owners, dtype=torch.int64, device=tags.device)  # [P]
    # Owner 0 holds nothing, even a tag whose owner field is 0.
    mine = (tag_state(rows) == STATE_WRITTEN) & (tag_owner(rows) == expected) & (expected > 0)
    lens = torch.where(mine, tag_valid_len(rows), 0).min(dim=0).values.tolist()
    return [
        PageAttestation(n, _digest(k_caches, v_caches, p, n, c) if digests else "")
        for p, n, c in zip(pages, lens, contexts, strict=True)
    ]


def _check_owners(owner, count: int) -> list[int]:
    """``owner``, an int or one per page, as one owner per page: an id, or 0 for none."""
    if isinstance(owner, torch.Tensor):
        if owner.dtype != torch.int64 or owner.dim() > 1:
            raise TypeError(
                f"owner: expected an int, a list of ints or a 0-D/1-D int64 tensor, got a "
                f"{owner.dim()}-D {str(owner.dtype).replace('torch.', '')} tensor"
            )
        owner = owner.tolist()
    if isinstance(owner, (list, tuple)):
        owners = _check_per_page("owner", owner, count)
        return [_owner_or_none(o, f"owner[{i}]") for i, o in enumerate(owners)]
    return [_owner_or_none(owner, "owner")] * count


def _owner_or_none(value, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    return check_owner(value, name)


def verify_arrived(
    attested: Sequence[PageAttestation | None],
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    check_bytes: bool = True,
    contexts: Sequence[bytes] | None = None,
) -> tuple[list[int], list[str | None]]:
    """The receiver's side: for each of its ``pages`` (whose bytes the transfer engine reported
    arrived) and the sender's attestation of the page it came from, the length to commit and
    None, or 0 and why not (``"not attested"``, ``"digest mismatch"``). ``check_bytes=False``
    commits by the attested lengths without recomputing digests (the ownership half of the
    rule only: bytes that differ go unnoticed). ``contexts``: as the sender's, one per page
    (derived here: a page that arrived in the wrong place, or for other tokens, then differs)."""
    num_pages, page_size = _check_pools(k_caches, v_caches)
    pages = _check_pages(pages, num_pages)
    claims = _check_per_page("attested", attested, len(pages))
    for i, claim in enumerate(claims):
        if claim is not None and not isinstance(claim, PageAttestation):
            raise TypeError(
                f"attested[{i}]: expected a PageAttestation or None (PageAttestation.from_json "
                f"parses the wire form), got {type(claim).__name__}"
            )
    contexts = _check_contexts(contexts, len(pages))
    lens: list[int] = []
    reasons: list[str | None] = []
    for page, claim, context in zip(pages, claims, contexts, strict=True):
        if claim is None:
            lens.append(0)
            reasons.append("not attested")
        elif not 0 <= claim.valid_len <= page_size:
            lens.append(0)
            reasons.append(f"attested length {claim.valid_len} outside [0, {page_size}]")
        elif (
            check_bytes
            and _digest(k_caches, v_caches, page, claim.valid_len, context) != claim.digest
        ):
            lens.append(0)
            reasons.append("digest mismatch")
        else:
            lens.append(claim.valid_len)
            reasons.append(None)
    return lens, reasons


__all__ = ["DIGEST_BYTES", "PageAttestation", "attest_pages", "page_digest", "verify_arrived"]

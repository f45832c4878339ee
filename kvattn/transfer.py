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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tags import STATE_WRITTEN, tag_owner, tag_state, tag_valid_len

DIGEST_BYTES = 16


@dataclass(frozen=True)
class PageAttestation:
    """What the sender says of one page it sends: written slots and their digest (hex)."""

    valid_len: int
    digest: str

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
    carry for it, an int or one per page (a prefix-cache hit carries the owner that wrote it).

    ``page_tags``: ``[num_pages]`` or ``[num_layers, num_pages]`` (one row per layer of the
    pools). A page's ``valid_len`` is the smallest over the layers of its WRITTEN length for its
    owner (0 where a layer's tag is not WRITTEN for that owner). ``contexts``: one per page, for
    :func:`page_digest` (the receiver must pass the same). ``digests=False`` leaves the digests
    empty, for a deployment whose receivers commit by the lengths alone."""
    tags = page_tags if page_tags.dim() == 2 else page_tags[None]
    index = torch.as_tensor(list(pages), dtype=torch.int64, device=tags.device)
    rows = tags[:, index]  # [num_layers, P]
    owners = torch.as_tensor(owner, dtype=torch.int64, device=tags.device).expand(index.shape)
    mine = (tag_state(rows) == STATE_WRITTEN) & (tag_owner(rows) == owners)
    lens = torch.where(mine, tag_valid_len(rows), 0).min(dim=0).values.tolist()
    contexts = [b""] * len(lens) if contexts is None else list(contexts)
    return [
        PageAttestation(n, page_digest(k_caches, v_caches, p, n, c) if digests else "")
        for p, n, c in zip(pages, lens, contexts, strict=True)
    ]


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
    lens: list[int] = []
    reasons: list[str | None] = []
    page_size = k_caches[0].shape[1] if k_caches else 0
    contexts = [b""] * len(pages) if contexts is None else list(contexts)
    for page, claim, context in zip(pages, attested, contexts, strict=True):
        if claim is None:
            lens.append(0)
            reasons.append("not attested")
        elif not 0 <= claim.valid_len <= page_size:
            lens.append(0)
            reasons.append(f"attested length {claim.valid_len} outside [0, {page_size}]")
        elif (
            check_bytes
            and page_digest(k_caches, v_caches, page, claim.valid_len, context) != claim.digest
        ):
            lens.append(0)
            reasons.append("digest mismatch")
        else:
            lens.append(claim.valid_len)
            reasons.append(None)
    return lens, reasons


__all__ = ["DIGEST_BYTES", "PageAttestation", "attest_pages", "page_digest", "verify_arrived"]

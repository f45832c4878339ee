"""Where kvattn's transfer attestation rides on SGLang's prefill -> decode path.

SGLang's decode instance learns only that a transfer is done: the transfer engine's status frame
(``KVPoll.Success``) says nothing of which pages were written for the request. Under kvattn the
prefill instance therefore attests, per page it sends, what its own tags say the page holds for
the request (:meth:`kvattn.integrations.ledger.Ledger.attest`: the written length, and a digest
of those slots' bytes in the context of the request's tokens), and sends that attestation to the
decode instance on SGLang's own status channel, just before the Success it belongs to. The decode
instance commits each page by the length it verified against its own copy, when SGLang commits
the transfer to the request (``kvattn.integrations.sglang.commit_transfer_hook``); a page without
a verified attestation stays RESERVED, and a read of it is refused.

The frame: ``[ATTEST_TAG, room, prefill rank, JSON]``, JSON ``{"v": 2, "key": hex, "pages":
[[logical page, valid_len, digest hex], ...]}``: the digests are keyed
(:class:`kvattn.transfer.DigestKey`) by a key the prefill draws per room when it attests the
room's first chunk and sends only with the attestation, after the room's last chunk, so no byte
of the transfer can be chosen knowing it. Where the keyed digest would not read the pools at
speed (:meth:`~kvattn.transfer.DigestKey.for_pools`), or the digests are off, the frame is
``{"v": 1, "pages": ...}``, keyless (BLAKE3); a decode instance accepts both. Status frames on
that channel are ``[room, status, rank]`` (a tag first on NIXL and Mori); a stock decode instance
cannot parse ``ATTEST_TAG`` as a room and drops the frame with a warning, so a kvattn prefill
serves a stock decode unchanged. The channel is one
ZMQ PUSH socket per decode endpoint, used under a lock: frames sent in order arrive in order, so
the attestation arrives before its Success.

Hooks (``HookRegistry`` AROUND hooks registered by :func:`kvattn.integrations.sglang_backend.
register`; each acts only where a kvattn ledger lives in the process):

- prefill: ``SchedulerDisaggregationPrefillMixin._send_kv_chunk`` marks the request being sent;
  ``CommonKVSender.send`` attests the pages of the chunk before they are queued for the transfer
  engine; ``CommonKVManager.send_kv_status_message`` sends the attestation of a room before its
  Success (dropped with a Failed); ``CommonKVSender.clear`` drops what was never sent.
- decode: ``CommonKVManager.parse_kv_status_message`` takes attestation frames of rooms that are
  live (a late frame of a cleared room is dropped); ``CommonKVReceiver._clear`` drops a room's.

Attestation digests are on by default; ``KVATTN_SGLANG_CHECK_BYTES=0`` on both instances leaves
them out (the ownership half of the check: lengths from the sender's tags, bytes trusted to the
transport; ``docs/transfer.md``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field

from ..transfer import DigestKey

ATTEST_TAG = b"KVATTN_ATTEST"
CHECK_BYTES_ENV = "KVATTN_SGLANG_CHECK_BYTES"
KEYLESS, KEYED = 1, 2  # frame versions

logger = logging.getLogger("kvattn")


@dataclass
class _Room:
    """Prefill side: what a room's chunk sends attested, and the digests' key."""

    key: DigestKey | None
    pages: dict[int, list] = field(default_factory=dict)  # logical page -> [valid_len, digest]


_lock = threading.Lock()
# Prefill side: (id of the transfer manager, room) -> its attestation, from the chunk sends until
# the room's status goes out.
_pending: dict[tuple[int, int], _Room] = {}
# Decode side: room -> the attestation frames' JSON payloads that arrived for it.
_arrived: dict[int, list[bytes]] = {}
# The request whose chunk the scheduler thread is sending, with its ledger.
_sending = threading.local()


def check_bytes() -> bool:
    """Whether attestations carry (prefill) and are held to (decode) digests of the bytes."""
    return os.environ.get(CHECK_BYTES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# How the hooks find a kvattn ledger in this process (set by kvattn.integrations.sglang, which
# keeps the ledgers): the one of an engine by its request pool, and whether there is any.
_ledgers: dict[int, object] = {}


def use_ledgers(ledgers: dict[int, object]) -> None:
    """The ledgers of this process by the id of their engine's request pool."""
    global _ledgers
    _ledgers = ledgers


def _ledger_of(scheduler):
    return _ledgers.get(id(scheduler.req_to_token_pool))


def _any_ledger() -> bool:
    return bool(_ledgers)


# -- prefill side -------------------------------------------------------------------------------


def send_chunk_hook(original, scheduler, req, *args, **kwargs):
    """Around ``_send_kv_chunk``: the request whose pages the sender is about to be given."""
    state = _ledger_of(scheduler)
    _sending.current = (state, req) if state is not None else None
    try:
        return original(scheduler, req, *args, **kwargs)
    finally:
        _sending.current = None


def sender_send_hook(original, sender, kv_indices, *args, **kwargs):
    """Around ``CommonKVSender.send``: attest the chunk's pages (the request's logical pages from
    its ``start_send_idx``) before the transfer engine is given them."""
    current = getattr(_sending, "current", None)
    if current is not None and len(kv_indices):
        state, req = current
        pages = [int(p) for p in kv_indices]
        first = int(req.start_send_idx) // state.page_size
        slot = (id(sender.kv_mgr), int(sender.bootstrap_room))
        with _lock:
            room = _pending.get(slot)
        if room is None:  # the room's first chunk: its key, drawn once
            room = _Room(state.transfer_key() if check_bytes() else None)
        attested = state.attest_sent(
            req, list(range(first, first + len(pages))), pages, digests=check_bytes(), key=room.key
        )
        with _lock:
            _pending.setdefault(slot, room).pages.update(attested)
    return original(sender, kv_indices, *args, **kwargs)


def status_hook(original, manager, *args, **kwargs):
    """Around ``CommonKVManager.send_kv_status_message``: a room's attestation goes out on the
    same sockets just before its Success; a Failed drops it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room, status = kwargs.get("bootstrap_room"), kwargs.get("status")
    targets = kwargs.get("targets") or []
    if room is not None and status in (KVPoll.Success, KVPoll.Failed):
        with _lock:
            attested = _pending.pop((id(manager), int(room)), None)
        if attested is not None and status == KVPoll.Success:
            _send_frame(manager, int(room), attested, targets)
    return original(manager, *args, **kwargs)


def _send_frame(manager, room: int, attested: _Room, targets) -> None:
    from sglang.srt.utils.network import NetworkAddress

    pages = attested.pages
    value: dict = {"v": KEYLESS, "pages": [[i, *pages[i]] for i in sorted(pages)]}
    if attested.key is not None:
        value.update(v=KEYED, key=attested.key.hex())
    payload = json.dumps(value).encode()
    frame = [
        ATTEST_TAG,
        str(room).encode("ascii"),
        str(manager._prefill_unique_rank()).encode("ascii"),
        payload,
    ]
    for endpoint, port in targets:
        address = NetworkAddress(endpoint, port)
        try:
            manager._send_multipart_locked(address.to_tcp(), frame, is_ipv6=address.is_ipv6)
        except Exception as e:  # the decode then commits nothing for the room: fails closed
            logger.warning(
                "kvattn: the attestation of room %s did not go to %s: %s",
                room,
                address.to_host_port_str(),
                e,
            )


def sender_clear_hook(original, sender, *args, **kwargs):
    """Around ``CommonKVSender.clear``: an attestation whose status never went out is dropped."""
    try:
        return original(sender, *args, **kwargs)
    finally:
        with _lock:
            _pending.pop((id(sender.kv_mgr), int(sender.bootstrap_room)), None)


# -- decode side --------------------------------------------------------------------------------


def parse_status_hook(original, manager, msg, *args, **kwargs):
    """Around ``CommonKVManager.parse_kv_status_message``: an attestation frame is kept for its
    room (when the room is live and a kvattn ledger runs here) and is not a status."""
    if msg and msg[0] == ATTEST_TAG:
        _keep(manager, msg)
        return None
    return original(manager, msg, *args, **kwargs)


def _keep(manager, msg) -> None:
    if not _any_ledger():
        logger.warning("Dropping a kvattn attestation: this decode instance does not run kvattn")
        return
    try:
        room = int(msg[1].decode("ascii"))
        payload = bytes(msg[3])
    except (IndexError, ValueError, UnicodeDecodeError):
        logger.warning("kvattn: dropping a malformed attestation frame (%d parts)", len(msg))
        return
    if room not in manager.request_status:
        logger.info("kvattn: dropping the attestation of room %s, which is no longer live", room)
        return
    with _lock:
        _arrived.setdefault(room, []).append(payload)


def take(receiver) -> list[bytes] | None:
    """The attestation payloads that arrived for ``receiver``'s room, once; None for a receiver
    that is not a transfer engine's (SGLang's fake backend, a counting test receiver)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    if not isinstance(receiver, CommonKVReceiver):
        return None
    with _lock:
        return _arrived.pop(int(receiver.bootstrap_room), [])


def receiver_clear_hook(original, receiver, *args, **kwargs):
    """Around ``CommonKVReceiver._clear``: a cleared or aborted room's attestation is dropped."""
    try:
        return original(receiver, *args, **kwargs)
    finally:
        with _lock:
            _arrived.pop(int(receiver.bootstrap_room), None)


def parse(
    payloads: list[bytes],
) -> tuple[dict[int, list] | None, DigestKey | None, str | None]:
    """``({logical page: [valid_len, digest]}, key, None)`` from the frames of one transfer (the
    key of its digests, None for keyless ones), or ``(None, None, why)``: none arrived, several
    that disagree, or one that is not an attestation."""
    if not payloads:
        return (
            None,
            None,
            (
                "no attestation arrived from the prefill instance (one without kvattn, or "
                "a transfer it did not attest)"
            ),
        )
    if len(set(payloads)) > 1:
        return None, None, f"{len(set(payloads))} different attestations arrived for one transfer"
    try:
        value = json.loads(payloads[0])
        version = value.get("v") if isinstance(value, dict) else None
        if isinstance(version, bool) or version not in (KEYLESS, KEYED):
            raise ValueError("version")
        key = DigestKey.from_hex(value["key"]) if version == KEYED else None
        pages: dict[int, list] = {}
        for entry in value["pages"]:
            index, claim = entry[0], entry[1:]
            if isinstance(index, bool) or not isinstance(index, int) or index < 0 or index in pages:
                raise ValueError("index")
            pages[index] = claim
    except (ValueError, KeyError, TypeError, IndexError):
        return None, None, "a malformed attestation arrived"
    return pages, key, None


# (target, hook) pairs the plugin registers.
HOOKS = (
    (
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk",
        send_chunk_hook,
    ),
    ("sglang.srt.disaggregation.common.conn.CommonKVSender.send", sender_send_hook),
    ("sglang.srt.disaggregation.common.conn.CommonKVSender.clear", sender_clear_hook),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.send_kv_status_message", status_hook),
    (
        "sglang.srt.disaggregation.common.conn.CommonKVManager.parse_kv_status_message",
        parse_status_hook,
    ),
    ("sglang.srt.disaggregation.common.conn.CommonKVReceiver._clear", receiver_clear_hook),
)

__all__ = ["ATTEST_TAG", "CHECK_BYTES_ENV", "HOOKS", "check_bytes", "parse", "take"]

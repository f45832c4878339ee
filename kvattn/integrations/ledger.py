"""The ownership ledger every engine adapter feeds: what is the same for every engine.

An engine adapter (:mod:`~kvattn.integrations.transformers`, :mod:`~kvattn.integrations.vllm`,
:mod:`~kvattn.integrations.sglang`) only translates its engine's events into calls on a
:class:`Ledger` (it subclasses it): a request starts or ends, pages are handed to it or freed, a
forward begins, a prefix cache hits, a transfer arrives, a request must fail. The ledger holds:

- **leases**: one per request, keyed by the engine's handle of it, each with a fresh owner id
  (:func:`kvattn.tags.new_owner_id`, never reused), the pages it maps per KV cache group and the
  owner each logical page must carry;
- **tags**: one ``[num_layers, num_pages]`` int64 array, changed only through kvattn's writers
  (:meth:`Ledger.reserve`, :meth:`Ledger.release`, :meth:`Ledger.commit`, :meth:`Step.write`);
- **the prefix-hit rule**: a page another request wrote, which the engine maps into a request as a
  prefix-cache hit, is expected to carry its writer's owner only if the writer's key for it (a
  digest of the token prefix through the page, :func:`prefix_digests`, seeded by the request's
  :func:`cache_domain`: the LoRA adapter, cache salt and whatever else besides token ids its
  engine computes KV under or keys its cache on) equals the reader's; otherwise owner 0, which no
  tag carries, so the read fails closed;
- **the step** (:class:`Step`): one forward's block table, expected owners and per-token owners,
  and its three moves: write (:meth:`Step.write`), attend (:meth:`Step.attend`: a decode step
  resolves its pages once, at its first attention call, and every layer reads that
  :class:`kvattn.PageVerdict`; docs/ownership.md section 9), and finish (:meth:`Ledger.finish`),
  which reads every layer's refused pages and dropped writes back with one device read and names
  the requests to fail with one message each (:func:`failure_message`);
- **CUDA graphs** (:class:`GraphBuffers`): a decode step a graph replays reads fixed buffers
  that the ledger fills on the host before each replay (:meth:`Ledger.fill_graph_step`) and
  poisons to owner 0 after the forward's report is read, so a replay nobody refilled fails
  closed; padded rows read and write nothing;
- **transfers**: the sender's attestation and the receiver's verification of pages that arrived by
  a transfer engine (:meth:`Ledger.attest`, :meth:`Ledger.verify` or, off the engine's step,
  :meth:`Ledger.verify_async`, contexts from
  :meth:`Ledger.contexts`; the rules are :mod:`kvattn.transfer`'s), commits by verified length;
- counts, failures, version checks (:func:`check_version`) and setup refusals
  (:func:`refuse`, :class:`IntegrationError`).

It knows nothing of any engine's classes.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .. import api, backends
from ..report import WriteResult
from ..tags import Violation, WriteDrop, new_owner_id
from ..transfer import DigestKey, PageAttestation, attest_pages, verify_arrived_async
from ..verdict import PageVerdict, resolve_pages
from ..writers import commit_pages, release_pages, reserve_pages, write_kv

logger = logging.getLogger("kvattn")


class IntegrationError(RuntimeError):
    """An engine was configured in a way its adapter does not support, or called it out of order."""


def check_version(
    adapter: str, engine: str, version: str, supported: Sequence[str], advice: str
) -> None:
    """Raise RuntimeError unless ``version`` of ``engine`` is one ``adapter`` was tested with: the
    adapters hook private parts of their engines, which change between releases."""
    if version not in supported:
        raise RuntimeError(
            f"kvattn.integrations.{adapter}: {engine} {version} is not supported; the integration "
            f"hooks private parts of the engine and was tested with {list(supported)} only. "
            f"{advice}"
        )


def refuse(adapter: str, reasons: Sequence[str], advice: str = "") -> None:
    """Raise :class:`IntegrationError` naming every unsupported part of a configuration at once."""
    if reasons:
        raise IntegrationError(
            f"kvattn.integrations.{adapter} does not support " + "; ".join(reasons) + advice
        )


def cache_domain(**parts) -> bytes:
    """The seed of a request's prefix digests: every part of its KV's domain besides token ids
    (``lora=``, ``cache_salt=``, ...), each named and length-delimited, so that two requests
    share a digest only if every part is the same; a part that is None or empty is absent.
    ``b""`` when none is present: a plain request's digests are those of its tokens alone. The
    engine's own cache key is not reused: a hit the engine wrongly keys (an adapter or a salt
    left out of its key) must still fail here."""
    h = hashlib.blake2b(b"kvattn-domain", digest_size=16)
    present = False
    for name, value in sorted(parts.items()):
        if value is None or value == "" or value == b"":
            continue
        present = True
        for piece in (name.encode(), value if isinstance(value, bytes) else repr(value).encode()):
            h.update(len(piece).to_bytes(8, "little") + piece)
    return h.digest() if present else b""


def media_key(media, start: int, end: int) -> bytes:
    """What the media of a request (``media``: ``(offset, length, identifier)`` per image, audio
    clip or video, the positions of its placeholder tokens and the engine's hash of its content)
    put into the page of positions ``[start, end)``: per item overlapping the page, its identifier
    and where it starts relative to the page, length-delimited; ``b""`` for a page without media.
    Placeholder tokens are the same for every image: without this, two requests that differ only
    in their images would share every page's digest."""
    out = b""
    for offset, length, identifier in media:
        if offset < end and start < offset + length:
            ident = identifier if isinstance(identifier, bytes) else str(identifier).encode()
            out += len(ident).to_bytes(8, "little") + ident
            out += (offset - start).to_bytes(8, "little", signed=True)
    return out


def prefix_digests(
    tokens, page_size: int, known: list[bytes] | None = None, domain: bytes = b"", media=()
) -> list[bytes]:
    """Digest of the token prefix through each full page (a hash chain, like vLLM's block
    hashes); ``known`` digests of the first pages are kept. ``domain`` seeds the chain: KV computed
    under another domain (an adapter, a cache salt) never matches. ``media``: the request's media
    items (:func:`media_key`), each in the digests of the pages its placeholders cover, and so in
    every digest after them."""
    digests = list(known or ())
    parent = digests[-1] if digests else domain
    first, end = len(digests), len(tokens) // page_size
    # Only the pages not digested yet are read: a decode step adds at most one.
    new = torch.as_tensor(list(tokens[first * page_size : end * page_size]), dtype=torch.int64)
    for i in range(end - first):
        block = new[i * page_size : (i + 1) * page_size]
        start = (first + i) * page_size
        extra = media_key(media, start, start + page_size) if media else b""
        parent = hashlib.blake2b(parent + block.numpy().tobytes() + extra, digest_size=16).digest()
        digests.append(parent)
    return digests


@dataclass
class Lease:
    """A request's hold on pages, as its engine's events told it.

    ``pages[g][i]`` is logical page ``i`` of KV cache group ``g`` (one group for most engines),
    ``expected[g][i]`` the owner its tag must carry (the lease's own, a prefix hit's writer, or 0:
    never readable); ``keys[i]``: the prefix digest of full page ``i`` in the request's
    ``domain``. Adapters subclass it for
    what their engine adds."""

    owner: int
    pages: list[list[int]] = field(default_factory=lambda: [[]])
    expected: list[list[int]] = field(default_factory=lambda: [[]])
    keys: list[bytes] = field(default_factory=list)
    domain: bytes = b""  # the seed of ``keys`` (:func:`cache_domain`)
    media: tuple = ()  # the request's media items in ``keys`` (:func:`media_key`)


@dataclass
class Step:
    """What the attention calls of one forward share (one KV cache group), rows in the engine's
    batch order: the tables the kernels read, the owners the writer stamps, and what every layer
    refused or dropped, summed on the device until :meth:`Ledger.finish` reads it once."""

    ids: list  # the lease key of each row (None: a row no lease holds)
    names: list[str]  # the request each row is, for messages
    decode_only: bool
    block_table: torch.Tensor  # [B, W] int32
    expected: torch.Tensor  # [B, W] int64
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    token_owner: torch.Tensor  # [num_slots] int64 (0 past the batch's tokens: padding)
    token_row: torch.Tensor  # [T] int64, the batch row of each new token
    refused: torch.Tensor  # [B] int32, refused pages summed over layers
    dropped: torch.Tensor  # [B] int32, dropped writes summed over layers
    pages_checked: torch.Tensor  # [B] int32, summed over layers
    backend: str = "auto"  # the readers'
    write_backend: str = "auto"
    check: bool = True
    reports: list = field(default_factory=list)  # (layer name, OwnershipReport)
    drops: list = field(default_factory=list)  # (layer name, drop_reasons [num_slots])
    # The [layers, pages] tags a decode step's verdict is resolved against (None: every call
    # checks its pages itself), and the verdicts resolved, one per sliding window.
    layer_tags: torch.Tensor | None = None
    verdicts: dict = field(default_factory=dict)
    # A step a CUDA graph replays (:class:`GraphBuffers`): its tensors are views of fixed buffers,
    # ``padding`` marks the tokens of padded rows (their writes land nowhere) and ``slots``
    # receives the slot mapping with those at -1.
    padding: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    # A verify forward of speculative decoding: the draft trees' mask (kvattn.paged_extend's
    # ``custom_mask``), ANDed with causality.
    custom_mask: torch.Tensor | None = None

    def write(
        self,
        layer: str,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        slots: torch.Tensor,
        tags: torch.Tensor,
        **scales,
    ) -> WriteResult:
        """One layer's cache write of the step's new tokens (``slots``: ``page * page_size +
        slot`` per token, -1 padding) under each token's request owner: a write into a page its
        request does not hold is dropped and counted against that request."""
        n = slots.shape[0]
        if self.padding is not None:
            # Device ops into a fixed buffer: nothing read on the host inside a captured graph.
            slots = self.slots[:n].copy_(slots).masked_fill_(self.padding[:n], -1)
        result = write_kv(
            k[:n],
            v[:n],
            k_pages,
            v_pages,
            slots,
            tags,
            self.token_owner[:n],
            backend=self.write_backend,
            validate=False,
            **scales,
        )
        rows = self.token_row.shape[0]
        self.dropped.index_add_(
            0, self.token_row, (result.drop_reasons[:rows] != 0).to(torch.int32)
        )
        self.drops.append((layer, result.drop_reasons))
        return result

    def attend(
        self,
        layer: str,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        tags: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        """One layer's attention over the step's pages (``kwargs``: ``scale``, ``out`` and the
        switches of :mod:`kvattn.variants`): a causal extend, or a decode when every row has one
        new token; its report is added to the step's."""
        common = dict(check=self.check, backend=self.backend, validate=False, **kwargs)
        if self.decode_only:
            out, report = api.paged_decode(
                q,
                k_pages,
                v_pages,
                self.block_table,
                self.seq_lens,
                tags,
                self.expected,
                verdict=self._verdict(k_pages, kwargs.get("window_left", -1)),
                **common,
            )
        else:
            out, report = api.paged_extend(
                q,
                k_pages,
                v_pages,
                self.cu_seqlens_q,
                self.block_table,
                self.seq_lens,
                tags,
                self.expected,
                causal=True,
                custom_mask=self.custom_mask,
                **common,
            )
        self._add(layer, report)
        return out

    def attend_mla(
        self,
        layer: str,
        q: torch.Tensor,
        latent: torch.Tensor,
        tags: torch.Tensor,
        *,
        kv_lora_rank: int,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's MLA attention (absorbed queries ``q`` ``[T, H, kv_lora_rank + rope]`` over
        the ``latent`` pool ``[pages, P, 1, kv_lora_rank + rope]``) over the step's pages, as
        :meth:`attend`: a causal :func:`kvattn.paged_mla_extend`, or a
        :func:`kvattn.paged_mla_decode` when every row has one new token. Each call checks its
        pages itself (the MLA readers take no verdict)."""
        common = dict(
            kv_lora_rank=kv_lora_rank,
            scale=scale,
            check=self.check,
            backend=self.backend,
            validate=False,
            out=out,
        )
        table, lens, expected = self.block_table, self.seq_lens, self.expected
        if self.decode_only:
            out, report = api.paged_mla_decode(q, latent, table, lens, tags, expected, **common)
        else:
            out, report = api.paged_mla_extend(
                q, latent, self.cu_seqlens_q, table, lens, tags, expected, causal=True, **common
            )
        self._add(layer, report)
        return out

    def _add(self, layer: str, report) -> None:
        if report is not None:
            self.refused += report.violations
            self.pages_checked += report.pages_checked
            self.reports.append((layer, report))

    def _verdict(self, k_pages: torch.Tensor, window_left: int) -> PageVerdict | None:
        """The step's verdict for a window, resolved at its first attention call
        (docs/ownership.md section 9): every layer after reads it instead of the table and
        tags."""
        if not self.check or self.layer_tags is None:
            return None
        verdict = self.verdicts.get(window_left)
        if verdict is None:
            verdict = self.verdicts[window_left] = resolve_pages(
                self.block_table,
                self.seq_lens,
                self.layer_tags,
                self.expected,
                page_size=k_pages.shape[1],
                window_left=window_left,
            )
        return verdict

    def refusals(self, row: int) -> list[tuple[int, Violation]]:
        """Every ``(logical page, reason)`` a layer refused for ``row`` (host read)."""
        seen: set = set()
        for _, report in self.reports:
            seen.update(report.refusals().get(row, []))
        return sorted(seen)


@dataclass
class GraphBuffers:
    """The inputs of decode forwards an engine replays from CUDA graphs, at fixed addresses
    (docs/cuda_graphs.md): allocated once for the largest captured batch (one token per row),
    filled on the host before each replay (:meth:`Ledger.fill_graph_step`), read inside the graph
    by the kernels its capture recorded. Outside a filled forward, ``expected`` and
    ``token_owner`` hold owner 0, which no page carries: a replay nobody refilled reads nothing
    and writes nothing."""

    block_table: torch.Tensor  # [max_batch, width] int32
    expected: torch.Tensor  # [max_batch, width] int64
    seq_lens: torch.Tensor  # [max_batch] int32, 0 on a padded row: it reads nothing
    cu_seqlens_q: torch.Tensor  # [max_batch + 1] int32, one token per row
    token_owner: torch.Tensor  # [max_batch] int64
    token_row: torch.Tensor  # [max_batch] int64
    padding: torch.Tensor  # [max_batch] bool, the rows past the forward's own
    slots: torch.Tensor  # [max_batch] int64, the write's slot mapping, padding at -1
    refused: torch.Tensor  # [max_batch] int32
    dropped: torch.Tensor  # [max_batch] int32
    pages_checked: torch.Tensor  # [max_batch] int32
    steps: dict = field(default_factory=dict)  # padded batch size -> the Step its graph reads
    # (rows, columns) of ``expected`` the last fill wrote, poisoned after its forward: every
    # other entry is 0 already.
    filled: tuple[int, int] = (0, 0)

    @classmethod
    def allocate(cls, max_batch: int, width: int, device) -> GraphBuffers:
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            block_table=torch.full((max_batch, width), -1, dtype=torch.int32, device=device),
            expected=zeros(max_batch, width, dtype=torch.int64),
            seq_lens=zeros(max_batch),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            token_owner=zeros(max_batch, dtype=torch.int64),
            token_row=torch.arange(max_batch, dtype=torch.int64, device=device),
            padding=torch.ones(max_batch, dtype=torch.bool, device=device),
            slots=zeros(max_batch, dtype=torch.int64),
            refused=zeros(max_batch),
            dropped=zeros(max_batch),
            pages_checked=zeros(max_batch),
        )

    def poison(self) -> None:
        """Owner 0 wherever the last fill wrote owners (device ops, after its forward)."""
        rows, cols = self.filled
        self.expected[:rows, :cols].zero_()
        self.token_owner[:rows].zero_()
        self.filled = (0, 0)


def failure_message(
    name: str,
    row: int,
    token_row: torch.Tensor,
    drops: list,
    reports: list,
    table: list[int],
    received: list[str],
    unit: str = "page",
) -> str:
    """The failure of one request, summed over the layers of a forward: what its transfer did not
    commit (``received``, the adapter's lines), its dropped writes (usually the cause), then its
    refused reads by reason and logical page, with the physical page (``table``: the row's
    physical ids; ``unit`` names them: vLLM says block) and the layers.

    ``token_row`` ``[T]``: each token's batch row; ``drops``: ``(layer name, drop_reasons)``;
    ``reports``: ``(layer name, OwnershipReport)``."""
    counted: Counter = Counter()
    drop_layers = []
    for layer, reasons in drops:
        mine = reasons[: token_row.shape[0]][token_row == row]
        dropped = mine[mine != 0].tolist()
        if dropped:
            drop_layers.append(layer)
        counted.update(flags(WriteDrop(int(r))) for r in dropped)
    reads: dict[str, Counter] = {}
    read_layers: dict[str, list] = {}
    for layer, report in reports:
        for page, reason in report.refusals().get(row, []):
            name_ = flags(reason)
            reads.setdefault(name_, Counter())[page] += 1
            if layer not in read_layers.setdefault(name_, []):
                read_layers[name_].append(layer)
    lines = list(received)
    if counted:
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(counted.items()))
        lines.append(
            f"writes: {counts} dropped write(s) of its new tokens, in "
            f"{len(drop_layers)} of {len(drops)} layer(s): {names(drop_layers)}"
        )
    for reason, pages in sorted(reads.items()):
        shown = [("past the table" if p < 0 else f"{p} ({unit} {table[p]})") for p in sorted(pages)]
        more = f", ... ({len(shown) - 8} more)" if len(shown) > 8 else ""
        lines.append(
            f"reads: {reason} on logical page(s) {', '.join(shown[:8])}{more}, in "
            f"{max(pages.values())} of {len(reports)} layer(s): "
            f"{names(read_layers[reason])}"
        )
    return (
        f"kvattn ownership check failed for request {name!r}: its KV pages could not be "
        "proven to hold its own tokens, so the request was stopped.\n" + "\n".join(lines)
    )


def write_backend_for(backend: str) -> str:
    """The backend an adapter's writes use: its readers' backend where that has a writer (the
    reference reads only), else ``auto``."""
    module = None if backend == "auto" else backends.load(backend)[0]
    return backend if module is not None and hasattr(module, "write_kv") else "auto"


def names(layers: list) -> str:
    shown = [str(layer) for layer in layers[:4]]
    return ", ".join(shown) + (f", ... ({len(layers) - 4} more)" if len(layers) > 4 else "")


def flags(value) -> str:
    return "|".join(f.name for f in type(value) if f and f in value) or "NONE"


class Ledger:
    """kvattn's ownership state of one engine instance. Subclassed by each engine adapter, which
    feeds it its engine's events; ``engine`` and ``unit`` (the engine's word for a page) name
    them in messages and counts."""

    adapter = "ledger"  # the adapter module's name, in errors
    unit = "page"
    lease_type = Lease
    # A decode step resolves its pages once against every row of :attr:`tags`
    # (:meth:`Step.attend`); an adapter whose layers do not all hold every page's writes (KV cache
    # groups) turns it off, and each call checks its pages itself.
    resolve_once = True

    def __init__(
        self,
        page_size: int,
        *,
        backend: str = "auto",
        check: bool = True,
        prefix_caching: bool = True,
    ):
        self.page_size = page_size
        self.backend = backend
        self.check = check
        self.prefix_caching = prefix_caching
        self.tags: torch.Tensor | None = None  # [num_layers, num_pages] int64
        self.leases: dict[Hashable, Lease] = {}
        # Full pages a lease wrote: page -> (writer owner, its key), what a later hit must match.
        self.content: dict[int, tuple[int, Hashable]] = {}
        self.steps: dict[int, Step] = {}  # this forward's, per KV cache group
        # What the ledger followed, for tests and operators: leases, prefix hits, refused pages
        # (summed over layers), dropped writes (tokens, summed over layers), and each adapter's
        # own events.
        self.counts: Counter = Counter()
        self.forwards = 0
        self.pages_checked = 0
        self.failures: list[tuple[str, str]] = []  # (request, message), in order
        self.receive_notes: dict[Hashable, list[str]] = {}  # lease key -> its transfer's lines
        self.graph: GraphBuffers | None = None  # the inputs of CUDA-graph replays

    # -- tags ---------------------------------------------------------------------------------

    def allocate_tags(self, num_layers: int, num_pages: int, device) -> None:
        self.tags = torch.zeros(num_layers, num_pages, dtype=torch.int64, device=device)

    def reserve(self, pages: list[int], owner: int) -> None:
        """Pages handed to ``owner`` to write, in every layer: whatever they held before is no
        longer readable, and no longer a prefix hit's content."""
        for page in pages:
            if self.content.pop(page, None) is not None:
                self.counts[f"cached_{self.unit}s_reused"] += 1
        if pages:
            reserve_pages(self.tags, pages, owner)

    def release(self, pages: list[int], owners=None) -> None:
        """Pages freed by the engine, FREE in every layer: only where ``owners`` (an int or one
        per page: whom the engine freed them from) still hold them, or outright without."""
        if pages:
            if owners is not None:
                owners = torch.as_tensor(owners, dtype=torch.int64).to(self.tags.device)
            release_pages(self.tags, pages, owners)

    def commit(self, pages: list[int], owner: int, lens: list[int]) -> int:
        """Pages a transfer delivered for ``owner``, WRITTEN in every layer by the lengths the
        receiver verified (a transfer moves every layer of a page); returns how many landed."""
        landed = 0
        for row in self.tags if pages else ():
            landed = int(commit_pages(row, pages, owner, lens, self.page_size).landed.sum())
        return landed

    # -- leases -------------------------------------------------------------------------------

    def open_lease(self, key: Hashable, **fields) -> Lease:
        """A new lease for the engine's request ``key`` under a fresh owner id."""
        lease = self.lease_type(owner=new_owner_id(), **fields)
        self.leases[key] = lease
        self.counts["leases"] += 1
        return lease

    def close_lease(self, key: Hashable) -> Lease | None:
        return self.leases.pop(key, None)

    # -- the prefix-hit rule ------------------------------------------------------------------

    def digests(
        self, tokens, known: list[bytes] | None = None, domain: bytes = b"", media=()
    ) -> list[bytes]:
        return prefix_digests(tokens, self.page_size, known, domain, media)

    def remember(self, page: int, owner: int, key: Hashable) -> None:
        """``owner`` wrote full page ``page``, whose key (prefix digest) is ``key``."""
        self.content[page] = (owner, key)

    def writer_of(
        self, page: int, key: Hashable, pending: dict[int, tuple[int, Hashable]] | None = None
    ) -> int | None:
        """The owner a prefix-cache hit on ``page`` must carry for a reader whose key for it is
        ``key``: its writer's, if the writer's key is the same (``pending``: pages written in this
        very step, which every layer stores before it attends); None if nothing proves it."""
        now = pending.get(page) if pending else None
        written = now if now is not None else self.content.get(page)
        if written is None or key is None or written[1] != key:
            return None
        self.counts[f"prefix_hit_{self.unit}s"] += 1
        if now is not None:
            self.counts[f"same_step_hit_{self.unit}s"] += 1
        return written[0]

    def hit_owner(self, page: int, key: Hashable) -> int:
        """:meth:`writer_of`, failing closed: owner 0, which no tag carries, when unproven."""
        owner = self.writer_of(page, key)
        if owner is None:
            self.counts[f"unproven_hit_{self.unit}s"] += 1
            return 0
        return owner

    # -- one forward --------------------------------------------------------------------------

    def start_step(
        self,
        ids: list,
        owners: list[int],
        q_lens: list[int],
        block_table: torch.Tensor,
        expected: torch.Tensor,
        seq_lens,
        *,
        names: list[str] | None = None,
        decode_only: bool | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        num_slots: int | None = None,
        group: int = 0,
    ) -> Step:
        """This forward's :class:`Step` of KV cache group ``group``, built on the host: ``ids``
        the lease keys of the rows, ``owners`` their owners (0: no lease), ``q_lens`` their new
        tokens, ``block_table``/``expected`` ``[B, W]`` (moved to the table's device),
        ``seq_lens`` ``[B]`` (a list, or the engine's tensor), ``num_slots`` the length of the
        engine's slot mapping when it pads past the new tokens."""
        device = block_table.device
        counts = torch.tensor(q_lens, dtype=torch.int64)
        total = int(counts.sum())
        token_owner = torch.zeros(max(total, num_slots or 0), dtype=torch.int64)
        token_owner[:total] = torch.repeat_interleave(
            torch.tensor(owners, dtype=torch.int64), counts
        )
        if cu_seqlens_q is None:
            cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(counts, 0)
            cu_seqlens_q = cu.to(device)
        if not isinstance(seq_lens, torch.Tensor):
            seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        batch = len(q_lens)
        step = Step(
            ids=list(ids),
            names=[str(i) for i in ids] if names is None else list(names),
            decode_only=all(n == 1 for n in q_lens) if decode_only is None else decode_only,
            block_table=block_table,
            expected=expected.to(device),
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            token_owner=token_owner.to(device),
            token_row=torch.repeat_interleave(torch.arange(batch), counts).to(device),
            refused=torch.zeros(batch, dtype=torch.int32, device=device),
            dropped=torch.zeros(batch, dtype=torch.int32, device=device),
            pages_checked=torch.zeros(batch, dtype=torch.int32, device=device),
            backend=self.backend,
            write_backend=write_backend_for(self.backend),
            check=self.check,
            layer_tags=self.tags if self.resolve_once else None,
        )
        self.steps[group] = step
        return step

    # -- forwards replayed from CUDA graphs ----------------------------------------------------

    def allocate_graph(self, max_batch: int, width: int, device) -> GraphBuffers:
        """The fixed buffers of decode graphs of up to ``max_batch`` rows reading up to ``width``
        pages each (:class:`GraphBuffers`); once, before the engine captures."""
        if self.graph is None or self.graph.expected.shape != (max_batch, width):
            self.graph = GraphBuffers.allocate(max_batch, width, device)
        return self.graph

    def _graph(self) -> GraphBuffers:
        if self.graph is None:
            raise IntegrationError(
                f"kvattn.integrations.{self.adapter}: a CUDA-graph forward before its buffers "
                "were allocated (allocate_graph)"
            )
        return self.graph

    def capture_graph_step(self, batch: int) -> Step:
        """The step a graph of ``batch`` rows captures: views of the fixed buffers with every row
        padding (nothing read, nothing written), installed as this forward's."""
        graph = self._graph()
        if not 0 < batch <= graph.seq_lens.shape[0]:
            raise IntegrationError(
                f"kvattn.integrations.{self.adapter}: a CUDA graph of {batch} rows, but the "
                f"buffers hold 1 to {graph.seq_lens.shape[0]}"
            )
        graph.poison()
        graph.seq_lens[:batch].zero_()
        graph.padding[:batch].fill_(True)
        graph.block_table[:batch].fill_(-1)
        step = Step(
            ids=[None] * batch,
            names=[""] * batch,
            decode_only=True,
            block_table=graph.block_table[:batch],
            expected=graph.expected[:batch],
            seq_lens=graph.seq_lens[:batch],
            cu_seqlens_q=graph.cu_seqlens_q[: batch + 1],
            token_owner=graph.token_owner[:batch],
            token_row=graph.token_row[:batch],
            refused=graph.refused[:batch],
            dropped=graph.dropped[:batch],
            pages_checked=graph.pages_checked[:batch],
            backend=self.backend,
            write_backend=write_backend_for(self.backend),
            check=self.check,
            layer_tags=self.tags if self.resolve_once else None,
            padding=graph.padding[:batch],
            slots=graph.slots[:batch],
        )
        graph.steps[batch] = step
        self.steps[0] = step
        return step

    def fill_graph_step(
        self,
        batch: int,
        ids: list,
        owners: list[int],
        block_table: torch.Tensor,
        expected: torch.Tensor,
        seq_lens: list[int],
        *,
        names: list[str] | None = None,
    ) -> Step:
        """Before a replay of the graph of ``batch`` rows, on the host: its buffers get this
        forward's ``len(ids)`` decode rows (``block_table``/``expected`` ``[n, w]``, as for
        :meth:`start_step`), the rows after them padding; returns the captured step, installed
        as this forward's."""
        graph = self._graph()
        step = graph.steps.get(batch)
        if step is None:
            raise IntegrationError(
                f"kvattn.integrations.{self.adapter}: a replay of a CUDA graph of {batch} rows, "
                f"which was never captured (captured: {sorted(graph.steps)})"
            )
        n = len(ids)
        width = block_table.shape[1] if n else 0
        if n > batch or width > graph.expected.shape[1]:
            raise IntegrationError(
                f"kvattn.integrations.{self.adapter}: {n} rows of {width} pages do not fit a "
                f"graph of {batch} rows of {graph.expected.shape[1]} pages"
            )
        graph.poison()
        lens = torch.zeros(batch, dtype=torch.int32)
        lens[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        padding = torch.ones(batch, dtype=torch.bool)
        padding[:n] = False
        owner = torch.zeros(batch, dtype=torch.int64)
        owner[:n] = torch.tensor(owners, dtype=torch.int64)
        # Pages past a row's length are never read: only the columns this forward covers are
        # written (the table's older columns may stay as they were, its owners are 0 there).
        graph.block_table[:n, :width].copy_(block_table)
        graph.expected[:n, :width].copy_(expected)
        graph.seq_lens[:batch].copy_(lens)
        graph.padding[:batch].copy_(padding)
        graph.token_owner[:batch].copy_(owner)
        graph.filled = (n, width)
        step.ids = list(ids) + [None] * (batch - n)
        step.names = ([str(i) for i in ids] if names is None else list(names)) + [""] * (batch - n)
        step.verdicts.clear()
        self.steps[0] = step
        return step

    def graph_run(self) -> None:
        """At the start of each run of a graph step, inside the captured region: its sums are
        zeroed by device ops the graph records (so every replay starts from 0), and the layers'
        reports and verdicts are those of this run only."""
        step = self.steps.get(0)
        if step is None or step.padding is None:
            return
        step.refused.zero_()
        step.dropped.zero_()
        step.pages_checked.zero_()
        step.reports.clear()
        step.drops.clear()
        step.verdicts.clear()

    def step(self, group: int = 0) -> Step:
        step = self.steps.get(group)
        if step is None:
            raise IntegrationError(
                f"kvattn.integrations.{self.adapter}: a cache write or "
                "attention call came outside a forward; no request owns it"
            )
        return step

    def finish(self) -> dict[Hashable, tuple[Step, int, str]]:
        """After the forward: one device read of every group's refused pages, dropped writes and
        pages checked; returns, per lease key of a request that must fail, its step, row and
        message (the first group's, for a request failed in several), which is also logged and
        kept in :attr:`failures`."""
        steps, self.steps = self.steps, {}
        try:
            return self._finish(steps)
        finally:
            if self.graph is not None and any(s.padding is not None for s in steps.values()):
                self.graph.poison()

    def _finish(self, steps: dict[int, Step]) -> dict[Hashable, tuple[Step, int, str]]:
        if not steps:
            return {}
        self.forwards += 1
        groups = sorted(steps)
        sums = [
            t
            for g in groups
            for t in (steps[g].refused.sum(), steps[g].dropped.sum(), steps[g].pages_checked.sum())
        ]
        totals = torch.stack([t.to(torch.int64) for t in sums]).tolist()
        refused, dropped = sum(totals[0::3]), sum(totals[1::3])
        self.counts["refused_pages"] += refused
        self.counts["dropped_writes"] += dropped
        self.pages_checked += sum(totals[2::3])
        if not (refused or dropped):
            return {}
        failed = {}
        for g in groups:
            step = steps[g]
            for row in torch.nonzero((step.refused > 0) | (step.dropped > 0)).flatten().tolist():
                key = step.ids[row]
                if key is None or key in failed:
                    continue
                message = failure_message(
                    step.names[row],
                    row,
                    step.token_row,
                    step.drops,
                    step.reports,
                    step.block_table[row].tolist(),
                    self.receive_notes.get(key, []),
                    unit=self.unit,
                )
                failed[key] = (step, row, message)
                self.failures.append((step.names[row], message))
                logger.error("%s", message)
        return failed

    # -- KV that arrived by a transfer ----------------------------------------------------------

    def contexts(self, tokens: list[int], indices: list[int], lens: list[int]) -> list[bytes]:
        """Per logical page ``indices[k]`` holding ``lens[k]`` tokens: the digest of the token
        prefix through those tokens (the prefix digest for a full page), the context both sides
        of a transfer put in a page's digest (:func:`kvattn.transfer.page_digest`)."""
        P = self.page_size
        keys = self.digests(tokens)
        out = []
        for i, n in zip(indices, lens):
            if n == P and i < len(keys):
                out.append(keys[i])
                continue
            part = tokens[i * P : i * P + n]
            parent = keys[i - 1] if 0 < i <= len(keys) else b""
            out.append(
                hashlib.blake2b(
                    parent + torch.tensor(part, dtype=torch.int64).numpy().tobytes(), digest_size=16
                ).digest()
            )
        return out

    def attest(
        self,
        owners: list[int],
        pages: list[int],
        indices: list[int],
        tokens: list[int],
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        *,
        digests: bool = True,
        key: DigestKey | None = None,
    ) -> list[PageAttestation]:
        """The sending side: what this ledger's tags say ``pages`` (logical pages ``indices`` of a
        request whose tokens are ``tokens``; ``owners`` the owner each must carry) hold. With a
        ``key`` (one per transfer, :meth:`kvattn.transfer.DigestKey.for_pools`, sent with the
        attestation), the keyed digest."""
        # The lengths first: each page's context covers the tokens its tags hold.
        lens = [
            a.valid_len
            for a in attest_pages(self.tags, owners, pages, k_pools, v_pools, digests=False)
        ]
        return attest_pages(
            self.tags,
            owners,
            pages,
            k_pools,
            v_pools,
            digests=digests,
            contexts=self.contexts(tokens, indices, lens),
            key=key if digests else None,
        )

    def verify(
        self,
        attested: list | None,
        indices: list[int],
        pages: list[int],
        tokens: list[int],
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        *,
        check_bytes: bool = True,
        key: DigestKey | None = None,
    ) -> tuple[list[int], list[str | None]]:
        """The receiving side: ``pages`` (the request's logical pages ``indices``) arrived, each
        to be verified against the sender's attestation of the page it came from (``attested``:
        JSON values aligned with ``pages``, None where none came) in the context of the receiver's
        own ``tokens``, with the digest the sender used (``key``: the one sent with the
        attestation, None for the keyless digest). Returns per page the length to commit and
        None, or 0 and why not; a malformed entry refuses its page only."""
        future = self.verify_async(
            attested, indices, pages, tokens, k_pools, v_pools, check_bytes=check_bytes, key=key
        )
        return future.result()

    def verify_async(
        self,
        attested: list | None,
        indices: list[int],
        pages: list[int],
        tokens: list[int],
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        *,
        check_bytes: bool = True,
        key: DigestKey | None = None,
    ) -> Future:
        """:meth:`verify` with the digests on kvattn's transfer thread
        (:func:`kvattn.transfer.verify_arrived_async`): the claims are parsed and the contexts
        derived here; the future's result is :meth:`verify`'s."""
        claims: list[PageAttestation | None] = [None] * len(pages)
        malformed = set()
        for j, value in enumerate(attested or []):
            if j < len(pages) and value is not None:
                try:
                    claims[j] = PageAttestation.from_json(value)
                except ValueError:
                    malformed.add(j)
        contexts = self.contexts(tokens, indices, [c.valid_len if c else 0 for c in claims])
        digests = verify_arrived_async(
            claims,
            pages,
            k_pools,
            v_pools,
            check_bytes=check_bytes,
            contexts=contexts,
            key=key if check_bytes else None,
        )
        result: Future = Future()

        def explain(done: Future) -> None:
            if done.exception() is not None:
                result.set_exception(done.exception())
                return
            lens, reasons = done.result()
            result.set_result(
                (
                    lens,
                    [
                        "malformed attestation"
                        if j in malformed
                        else why
                        if why is not None or n
                        else "the sender attests no written slot"
                        for j, (why, n) in enumerate(zip(reasons, lens))
                    ],
                )
            )

        digests.add_done_callback(explain)
        return result


__all__ = [
    "GraphBuffers",
    "IntegrationError",
    "Lease",
    "Ledger",
    "Step",
    "cache_domain",
    "check_version",
    "failure_message",
    "media_key",
    "prefix_digests",
    "refuse",
]

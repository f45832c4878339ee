"""What a call says about what it refused, in device memory: :class:`OwnershipReport` for the
readers (pages refused by an attention call), :class:`WriteResult` for the writers (tokens or pages
a writer dropped). Contract: docs/ownership.md sections 3 and 4."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tags import Violation


class KVOwnershipError(RuntimeError):
    """A paged-attention call refused pages that a sequence would have read.

    ``refusals`` maps a sequence index to a list of ``(logical_page, Violation)`` pairs. Logical
    pages past the block table (``seq_len`` longer than the table) appear as page ``-1``.
    """

    def __init__(self, message: str, refusals: dict[int, list[tuple[int, Violation]]]):
        super().__init__(message)
        self.refusals = refusals


@dataclass
class OwnershipReport:
    """Per-sequence outcome of the ownership check, in device memory, written by the kernel.

    Tensors (``B`` = batch size, ``max_pages`` = block-table width):

    - ``violations`` ``[B]`` int32: logical pages refused for the sequence.
    - ``reasons`` ``[B]`` int32: OR of the :class:`~kvattn.Violation` flags of those pages.
    - ``pages_checked`` ``[B]`` int32: logical pages the check examined (``ceil(seq_len /
      page_size)`` clipped to the table), so a caller can prove the check ran.
    - ``page_reasons`` ``[B, max_pages]`` int8: the reason per logical page, 0 where accepted or
      not read. Every entry is written by the call.
    - ``beyond_table`` ``[B]`` int32: 1 where ``seq_len`` exceeded ``max_pages * page_size``; that
      overflow counts as one ``OUT_OF_RANGE`` violation and nothing past the table is read.

    Nothing here synchronises with the device except :meth:`raise_if_any`, :meth:`any` and
    :meth:`summary`.
    """

    violations: torch.Tensor
    reasons: torch.Tensor
    pages_checked: torch.Tensor
    page_reasons: torch.Tensor
    beyond_table: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, max_pages: int, device) -> OwnershipReport:
        """Buffers for a kernel, left uninitialised: the kernels store every entry (counters with
        plain stores, no accumulation), so a call launches no memset."""
        counts = torch.empty(4, batch, dtype=torch.int32, device=device)
        page_reasons = torch.empty(batch, max_pages, dtype=torch.int8, device=device)
        return cls(
            violations=counts[0],
            reasons=counts[1],
            pages_checked=counts[2],
            beyond_table=counts[3],
            page_reasons=page_reasons,
        )

    def ok(self) -> torch.Tensor:
        """``[B]`` bool on the device: True where the sequence had no refused page. No sync."""
        return self.violations == 0

    def any(self) -> bool:
        """True if any sequence had a refused page (synchronises)."""
        return bool((self.violations != 0).any().item())

    def refusals(self) -> dict[int, list[tuple[int, Violation]]]:
        """``{sequence: [(logical_page, reason), ...]}`` for every refused page (synchronises)."""
        violations = self.violations.cpu()
        page_reasons = self.page_reasons.cpu()
        beyond = self.beyond_table.cpu()
        out: dict[int, list[tuple[int, Violation]]] = {}
        for b in torch.nonzero(violations).flatten().tolist():
            pages = [
                (int(i), Violation(int(page_reasons[b, i])))
                for i in torch.nonzero(page_reasons[b]).flatten().tolist()
            ]
            if beyond[b]:
                pages.append((-1, Violation.OUT_OF_RANGE))
            out[b] = pages
        return out

    def summary(self, max_sequences: int = 8, max_pages: int = 8) -> str:
        """One line per refused sequence (synchronises)."""
        refusals = self.refusals()
        if not refusals:
            checked = int(self.pages_checked.sum().item())
            return f"no violation ({checked} pages checked)"
        lines = []
        for b, pages in list(refusals.items())[:max_sequences]:
            shown = ", ".join(f"page {i}: {_reason_name(r)}" for i, r in pages[:max_pages])
            more = f", ... ({len(pages) - max_pages} more)" if len(pages) > max_pages else ""
            lines.append(f"sequence {b}: {len(pages)} refused page(s): {shown}{more}")
        if len(refusals) > max_sequences:
            lines.append(f"... and {len(refusals) - max_sequences} more sequence(s)")
        return "\n".join(lines)

    def raise_if_any(self) -> None:
        """Synchronise and raise :class:`KVOwnershipError` if any page was refused."""
        refusals = self.refusals()
        if refusals:
            raise KVOwnershipError(
                "KV ownership check refused pages; their slots were masked out of attention:\n"
                + self.summary(),
                refusals,
            )


@dataclass
class WriteResult:
    """Outcome of :func:`kvattn.write_kv` or :func:`kvattn.commit_pages`, per item, in device memory.

    ``landed`` ``[n]`` bool: the item was written (and its page stamped). ``drop_reasons`` ``[n]``
    int8: a :class:`~kvattn.tags.WriteDrop` flag per refused item, 0 for landed items and padding.
    ``dropped`` 0-d int64: how many items were refused (padding is not counted).
    """

    landed: torch.Tensor
    drop_reasons: torch.Tensor
    dropped: torch.Tensor

    @classmethod
    def empty(cls, device) -> WriteResult:
        """The result of a call with no item."""
        landed = torch.zeros(0, dtype=torch.bool, device=device)
        return cls(landed, landed.to(torch.int8), torch.zeros((), dtype=torch.int64, device=device))

    def dropped_count(self) -> int:
        """Number of refused items (synchronises)."""
        return int(self.dropped.item())


def _reason_name(reason: Violation) -> str:
    return "|".join(flag.name for flag in Violation if flag and flag in reason) or "NONE"

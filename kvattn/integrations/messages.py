"""The failure message of one request under an engine adapter (vLLM, SGLang): summed over the
layers of a step, what its transfer did not commit (the adapter's lines), its dropped writes
(usually the cause), then its refused reads by reason and logical page, with the physical page and
the number of layers."""
from __future__ import annotations

from collections import Counter

import torch

from ..tags import WriteDrop


def failure_message(rid: str, row: int, token_row: torch.Tensor, drops: list, reports: list,
                    table: list[int], received: list[str], unit: str = "page") -> str:
    """``token_row`` ``[T]``: each token's batch row; ``drops``: ``(layer name, drop_reasons)``;
    ``reports``: ``(layer name, OwnershipReport)``; ``table``: the row's physical ids (``unit``
    names them: vLLM says block)."""
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
            name = flags(reason)
            reads.setdefault(name, Counter())[page] += 1
            if layer not in read_layers.setdefault(name, []):
                read_layers[name].append(layer)
    lines = list(received)
    if counted:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(counted.items()))
        lines.append(f"writes: {counts} dropped write(s) of its new tokens, in layer(s) "
                     f"{names(drop_layers)}")
    for name, pages in sorted(reads.items()):
        shown = [("past the table" if p < 0 else f"{p} ({unit} {table[p]})") for p in sorted(pages)]
        more = f", ... ({len(shown) - 8} more)" if len(shown) > 8 else ""
        lines.append(f"reads: {name} on logical page(s) {', '.join(shown[:8])}{more}, in "
                     f"{max(pages.values())} of {len(reports)} layer(s): "
                     f"{names(read_layers[name])}")
    return (f"kvattn ownership check failed for request {rid!r}: its KV pages could not be proven "
            "to hold its own tokens, so the request was stopped.\n" + "\n".join(lines))


def names(layers: list) -> str:
    return ", ".join(layers[:4]) + (f", ... ({len(layers) - 4} more)" if len(layers) > 4 else "")


def flags(value) -> str:
    return "|".join(f.name for f in type(value) if f and f in value) or "NONE"

"""The Triton backend: one module per kernel (``paged_decode``, ``paged_extend``,
``stamp_writer``), the reader's rule they share (``tag_rule``), and this facade for the registry."""
from __future__ import annotations

from .paged_decode import MAX_HEAD_DIM, decode, interpreted
from .paged_extend import extend

NAME = "triton"


def why_not(args) -> str | None:
    """None if this backend can run ``args``, else the reason it cannot."""
    if args.q.device.type == "cpu" and not interpreted():
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"
    if args.q.device.type not in ("cpu", "cuda"):
        return f"device {args.q.device.type} is not supported"
    if args.head_dim > MAX_HEAD_DIM:
        return f"head_dim {args.head_dim} > {MAX_HEAD_DIM}"
    return None


__all__ = ["NAME", "decode", "extend", "why_not"]

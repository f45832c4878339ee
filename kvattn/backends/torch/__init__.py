"""The ``torch`` backend: the ops as compositions of PyTorch ops, on any device, no kernel of its
own. ``backend="auto"`` takes it for CPU tensors (the writer, and the readers before the
reference). Its writer (:mod:`.writer`, whose row stores :mod:`kvattn.writers` shares) and its
readers (:mod:`.attention`), and this facade for the registry.

The package shares its name with PyTorch: its modules import siblings relatively and ``torch``
absolutely (PyTorch). Once imported it is the attribute ``torch`` of :mod:`kvattn.backends`, so
the registry binds no name ``torch`` of its own.
"""

from __future__ import annotations

from ...write_args import WriteArgs
from .attention import decode, extend
from .writer import write_kv

NAME = "torch"
# Switches of kvattn.variants this writer implements (the registry refuses the others).
WRITE_SWITCHES = frozenset({"fp8 KV", "fp8 toward_zero"})
# The readers take the reader's rule from kvattn.reference.readable_slots, which reads verdicts.
VERDICT_OPS = ("decode",)


def why_not(args: WriteArgs) -> str | None:
    return None


__all__ = ["NAME", "VERDICT_OPS", "WRITE_SWITCHES", "decode", "extend", "why_not", "write_kv"]

"""Backend registry: picks the backend that runs a call, and says why it refused the others.

A backend is a module with ``NAME``, one launcher per op it implements, named after the op
(``decode(args, *, check, out, lse)``, ``extend(args, *, check, out, lse)``, ``write_kv(args)``,
``mla_decode(args, *, check, out, lse)``, ``mla_extend(args, *, check, out, lse)``),
and ``why_not(args) -> str | None`` (None: it can run these inputs), or ``why_not_<op>(args)`` for
an op whose inputs it judges apart. A writer names the switches of its inputs it implements in
``WRITE_SWITCHES`` (today ``"fp8 KV"``: writing into fp8 pools, quantising on the way); the registry
refuses a writer whose set lacks a switch the inputs need
(:meth:`kvattn.write_args.WriteArgs.switches`), after the backend's own reasons (the readers'
switches are judged by each backend's ``why_not``). ``args`` is the op's validated record:
:class:`kvattn.layout.DecodeArgs`, :class:`~kvattn.layout.ExtendArgs`,
:class:`kvattn.write_args.WriteArgs`, :class:`~kvattn.layout.MLADecodeArgs` or
:class:`~kvattn.layout.MLAExtendArgs`. A backend
without a launcher for an op refuses that op, and one that does not name the op in ``VERDICT_OPS``
refuses a call given a :class:`kvattn.PageVerdict` (docs/ownership.md section 9).

``backend="auto"`` takes the first backend of :func:`auto_order` (``AUTO_ORDER[op]``, or
``AUTO_ORDER_CPU[op]`` for CPU tensors) that accepts the inputs, and logs once why it refused the
ones before it. Backends outside the order (test harnesses) run only when named. ``KVATTN_BACKEND``
names the backend for calls that say ``"auto"``, for every op that backend implements (an op it
lacks stays on auto). A named backend that cannot run the inputs raises ``ValueError`` with its
reason; it never falls back silently.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Annotations only: once the torch backend (the package kvattn.backends.torch) is imported, the
    # name ``torch`` in this module is that package, not PyTorch.
    import torch

logger = logging.getLogger("kvattn")

# name -> module path; imported lazily so a missing dependency only disables its backend.
_BACKENDS = {
    "cuda": "kvattn.backends.cuda",
    "triton": "kvattn.backends.triton",
    "reference": "kvattn.backends.oracle",
    "torch": "kvattn.backends.torch",
    "cuda_sim": "kvattn.backends.cuda_sim",
    "cpu": "kvattn.backends.cpu",
}
OPS = ("decode", "extend", "write_kv", "mla_decode", "mla_extend")
AUTO_ORDER = {
    "decode": ("cuda", "triton", "reference"),
    "extend": ("cuda", "triton", "reference"),
    "write_kv": ("cuda", "triton", "torch"),
    "mla_decode": ("cuda", "triton", "reference"),
    "mla_extend": ("triton", "reference"),
}
# The Triton interpreter would run the writer as one program per token; the PyTorch ops compute
# the same result in a few tensor ops.
# The readers' PyTorch ops read only the pages a sequence covers; the reference gathers the whole
# table per query row and stays the oracle, last. The compiled CPU decode and extend come before
# both (and before the Triton interpreter, which only tests run).
AUTO_ORDER_CPU = {
    **AUTO_ORDER,
    "write_kv": ("cpu", "torch"),
    "decode": ("cuda", "cpu", "triton", "torch", "reference"),
    "extend": ("cuda", "cpu", "triton", "torch", "reference"),
}
_logged: set = set()


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) or (None, why it cannot be imported)."""
    try:
        return importlib.import_module(_BACKENDS[name]), None
    except ImportError as e:
        return None, f"not importable ({e})"


def auto_order(op: str, device: torch.device) -> tuple[str, ...]:
    """The backends ``auto`` tries for ``op`` on tensors of ``device``, in order."""
    _check_op(op)
    return (AUTO_ORDER_CPU if device.type == "cpu" else AUTO_ORDER)[op]


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")


def _why_not(name: str, args, op: str) -> tuple[ModuleType | None, str | None]:
    module, reason = load(name)
    if module is None:
        return None, reason
    if not hasattr(module, op):
        return None, f"no {op} kernel"
    reason = getattr(module, f"why_not_{op}", module.why_not)(args)
    if reason is None and getattr(args, "verdict", None) is not None:
        if op not in getattr(module, "VERDICT_OPS", ()):
            reason = f"no {op} kernel that reads a verdict (kvattn.resolve_pages)"
    if reason is None and op == "write_kv":
        claimed = getattr(module, "WRITE_SWITCHES", frozenset())
        missing = [s for s in args.switches() if s not in claimed]
        if missing:
            reason = f"no {op} kernel for {', '.join(missing)}"
    return module, reason


def explain(args, op: str = "decode") -> dict[str, str | None]:
    """For each backend, None if it can run ``op`` on ``args``, else the reason it cannot."""
    _check_op(op)
    return {name: _why_not(name, args, op)[1] for name in _BACKENDS}


def auto_choice(args, op: str = "decode") -> tuple[str | None, dict[str, str]]:
    """``(name, refused)``: the backend ``auto`` takes for ``op`` on ``args`` (None when none
    accepts them) and why it refused the ones before it. ``KVATTN_BACKEND`` is not applied."""
    refused = {}
    for name in auto_order(op, args.k_cache.device):
        reason = _why_not(name, args, op)[1]
        if reason is None:
            return name, refused
        refused[name] = reason
    return None, refused


def select(args, requested: str = "auto", op: str = "decode") -> ModuleType:
    """The backend module that runs ``args``; see the module docstring for the rule."""
    if not isinstance(requested, str):
        raise TypeError(f"backend: expected a str, got {type(requested).__name__}")
    _check_op(op)
    source = "backend argument"
    forced = os.environ.get("KVATTN_BACKEND", "auto")
    if requested == "auto" and forced != "auto":
        if forced not in _BACKENDS:
            raise ValueError(
                f"KVATTN_BACKEND: expected 'auto' or one of {list(_BACKENDS)}, got {forced!r}"
            )
        module = load(forced)[0]
        if module is None or hasattr(module, op):
            requested, source = forced, "KVATTN_BACKEND"
    if requested != "auto":
        if requested not in _BACKENDS:
            raise ValueError(
                f"{source}: expected 'auto' or one of {list(_BACKENDS)}, got {requested!r}"
            )
        module, reason = _why_not(requested, args, op)
        if reason is not None:
            error = ValueError(f"{source}: backend {requested!r} cannot run these inputs: {reason}")
            error.backend, error.reason = requested, reason  # for callers that route on it
            raise error
        return module
    name, refused = auto_choice(args, op)
    if name is None:
        raise ValueError(
            f"no backend can run {op} on these inputs: "
            + "; ".join(f"{n}: {r}" for n, r in refused.items())
        )
    device = args.k_cache.device
    key = (op, name, device.type, tuple(sorted(refused.items())))
    if key not in _logged:
        _logged.add(key)
        why = "; ".join(f"{n}: {r}" for n, r in refused.items()) or "first choice"
        logger.info("kvattn: %s uses backend %r on %s (%s)", op, name, device, why)
    return load(name)[0]

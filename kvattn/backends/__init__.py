"""Backend registry: picks the backend that runs a call, and says why it refused the others.

A backend is a module with ``NAME``, ``why_not(args) -> str | None`` (None: it can run these inputs)
and one launcher per op, named after the op, taking the validated arguments
(``decode(args, *, check, out, lse)``). A backend without a launcher for an op refuses that op.
Preference for ``backend="auto"``: the order of ``AUTO_ORDER`` -- the first that accepts the inputs.
Backends outside it (test harnesses) run only when named. ``KVATTN_BACKEND`` forces a choice when
the call says ``"auto"``. A forced backend that cannot run the inputs raises ``ValueError`` with its
reason; it never falls back silently.
"""
from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType


logger = logging.getLogger("kvattn")

# name -> module path; imported lazily so a missing dependency only disables its backend.
_BACKENDS = {
    "cuda": "kvattn.backends.cuda",
    "triton": "kvattn.backends.triton",
    "reference": "kvattn.backends.reference",
    "cuda_sim": "kvattn.backends.cuda_sim",
}
AUTO_ORDER = ("cuda", "triton", "reference")
_logged: set = set()


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) or (None, why it cannot be imported)."""
    try:
        return importlib.import_module(_BACKENDS[name]), None
    except ImportError as e:
        return None, f"not importable ({e})"


def _why_not(name: str, args, op: str) -> tuple[ModuleType | None, str | None]:
    module, reason = load(name)
    if module is None:
        return None, reason
    if not hasattr(module, op):
        return None, f"no {op} kernel"
    return module, module.why_not(args)


def explain(args, op: str = "decode") -> dict[str, str | None]:
    """For each backend, None if it can run ``op`` on ``args``, else the reason it cannot."""
    return {name: _why_not(name, args, op)[1] for name in _BACKENDS}


def select(args, requested: str = "auto", op: str = "decode") -> ModuleType:
    """The backend module that runs ``args``; see the module docstring for the rule."""
    if not isinstance(requested, str):
        raise TypeError(f"backend: expected a str, got {type(requested).__name__}")
    source = "backend argument"
    if requested == "auto" and os.environ.get("KVATTN_BACKEND", "auto") != "auto":
        requested, source = os.environ["KVATTN_BACKEND"], "KVATTN_BACKEND"
    if requested != "auto":
        if requested not in _BACKENDS:
            raise ValueError(f"{source}: expected 'auto' or one of {list(_BACKENDS)}, got {requested!r}")
        module, reason = _why_not(requested, args, op)
        if reason is not None:
            raise ValueError(f"{source}: backend {requested!r} cannot run these inputs: {reason}")
        return module
    refused = {}
    for name in AUTO_ORDER:
        module, reason = _why_not(name, args, op)
        if reason is None:
            key = (op, name, args.q.device.type, tuple(sorted(refused.items())))
            if key not in _logged:
                _logged.add(key)
                why = "; ".join(f"{n}: {r}" for n, r in refused.items()) or "first choice"
                logger.info("kvattn: %s uses backend %r on %s (%s)", op, name, args.q.device, why)
            return module
        refused[name] = reason
    raise ValueError(f"no backend can run {op} on these inputs: "
                     + "; ".join(f"{n}: {r}" for n, r in refused.items()))

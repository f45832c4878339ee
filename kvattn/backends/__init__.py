"""Backend registry: picks the backend that runs a call, and says why it refused the others.

A backend is a module with ``NAME``, ``why_not(args) -> str | None`` (None: it can run these inputs)
and one launcher per op with the reference's signature (``decode(args, *, check, out, lse)``).
Preference for ``backend="auto"``: ``cuda``, ``triton``, ``reference`` -- the first that accepts the
inputs. ``KVATTN_BACKEND`` forces a choice when the call says ``"auto"``. A forced backend that
cannot run the inputs raises ``ValueError`` with its reason; it never falls back silently.
"""
from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from ..layout import DecodeArgs

logger = logging.getLogger("kvattn")

# name -> module path; imported lazily so a missing dependency only disables its backend.
_BACKENDS = {
    "cuda": "kvattn.backends.cuda_decode",
    "triton": "kvattn.backends.triton_decode",
    "reference": "kvattn.backends.reference",
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


def _why_not(name: str, args: DecodeArgs) -> tuple[ModuleType | None, str | None]:
    module, reason = load(name)
    return module, (reason if module is None else module.why_not(args))


def explain(args: DecodeArgs) -> dict[str, str | None]:
    """For each backend, None if it can run ``args``, else the reason it cannot."""
    return {name: _why_not(name, args)[1] for name in _BACKENDS}


def select(args: DecodeArgs, requested: str = "auto") -> ModuleType:
    """The backend module that runs ``args``; see the module docstring for the rule."""
    if not isinstance(requested, str):
        raise TypeError(f"backend: expected a str, got {type(requested).__name__}")
    source = "backend argument"
    if requested == "auto" and os.environ.get("KVATTN_BACKEND", "auto") != "auto":
        requested, source = os.environ["KVATTN_BACKEND"], "KVATTN_BACKEND"
    if requested != "auto":
        if requested not in _BACKENDS:
            raise ValueError(f"{source}: expected 'auto' or one of {list(_BACKENDS)}, got {requested!r}")
        module, reason = _why_not(requested, args)
        if reason is not None:
            raise ValueError(f"{source}: backend {requested!r} cannot run these inputs: {reason}")
        return module
    refused = {}
    for name in _BACKENDS:
        module, reason = _why_not(name, args)
        if reason is None:
            key = (name, args.q.device.type, tuple(sorted(refused.items())))
            if key not in _logged:
                _logged.add(key)
                why = "; ".join(f"{n}: {r}" for n, r in refused.items()) or "first choice"
                logger.info("kvattn: using backend %r on %s (%s)", name, args.q.device, why)
            return module
        refused[name] = reason
    raise ValueError("no backend can run these inputs: "
                     + "; ".join(f"{n}: {r}" for n, r in refused.items()))

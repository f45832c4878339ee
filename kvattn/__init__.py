"""kvattn: ownership-checked paged attention.

Every KV page carries a tag (:mod:`kvattn.tags`); the attention kernels refuse pages whose tag does
not prove they were written for the reader, and report it in the same call. The contract:
docs/ownership.md. Layout: :mod:`kvattn.layout`. Oracle: :mod:`kvattn.reference`. What runs on this
machine: :func:`info`, or ``python -m kvattn.env``.
"""

from .version import __version__ as __version__

MIN_TORCH = (2, 4)

# torch is not a declared dependency (pip would resolve a bare `torch` to the multi-GB CUDA build
# on a machine without one), so its absence must say what to do.
try:
    import torch as _torch
except ImportError as _e:
    raise ImportError(
        "kvattn needs PyTorch >= 2.4, which it does not install: install the torch "
        "build for your machine first (CPU or CUDA; see the README, section "
        "Install)"
    ) from _e
if tuple(int(p) for p in _torch.__version__.split(".")[:2]) < MIN_TORCH:
    raise ImportError(f"kvattn needs PyTorch >= 2.4, found {_torch.__version__}")

from . import reference
from .api import paged_decode, paged_extend, paged_mla_decode, paged_mla_extend
from .cache import Lease, PagedKVCache
from .layout import DecodeArgs, ExtendArgs, MLADecodeArgs, MLAExtendArgs
from .report import KVOwnershipError, OwnershipReport, WriteResult
from .tags import (
    FREE_TAG,
    Violation,
    WriteDrop,
    describe_tag,
    reserved_tag,
    tag_owner,
    tag_state,
    tag_valid_len,
    written_tag,
)
from .verdict import PageVerdict, resolve_pages
from .writers import commit_pages, reassign_pages, release_pages, reserve_pages, write_kv


def info() -> dict:
    """What kvattn finds on this machine: versions, GPUs, which backend accepts which op and why
    the others refuse, the extensions' build status, the CUDA module's resource figures. Printed by
    ``python -m kvattn.env``; see :mod:`kvattn.env`."""
    from .env import info as collect  # on call: `python -m kvattn.env` must not find it imported

    return collect()


__all__ = [
    "FREE_TAG",
    "DecodeArgs",
    "ExtendArgs",
    "KVOwnershipError",
    "Lease",
    "OwnershipReport",
    "PageVerdict",
    "PagedKVCache",
    "Violation",
    "WriteDrop",
    "WriteResult",
    "commit_pages",
    "describe_tag",
    "info",
    "paged_decode",
    "paged_extend",
    "reassign_pages",
    "reference",
    "release_pages",
    "reserve_pages",
    "reserved_tag",
    "resolve_pages",
    "tag_owner",
    "tag_state",
    "tag_valid_len",
    "write_kv",
    "written_tag",
    "MLADecodeArgs",
    "MLAExtendArgs",
    "paged_mla_decode",
    "paged_mla_extend",
]

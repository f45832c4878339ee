"""kvattn: ownership-checked paged attention.

Every KV page carries a tag (:mod:`kvattn.tags`); the attention kernels refuse pages whose tag does
not prove they were written for the reader, and report it in the same call. Layout:
:mod:`kvattn.layout`. Oracle: :mod:`kvattn.reference`.
"""
from . import reference
from .api import paged_decode, paged_extend
from .cache import Lease, PagedKVCache
from .layout import DecodeArgs, ExtendArgs
from .report import KVOwnershipError, OwnershipReport
from .tags import (FREE_TAG, Violation, WriteDrop, describe_tag, reserved_tag, tag_owner, tag_state,
                   tag_valid_len, written_tag)
from .writers import (WriteResult, commit_pages, reassign_pages, release_pages, reserve_pages,
                      write_kv)

__version__ = "0.1.0"

__all__ = [
    "FREE_TAG", "DecodeArgs", "ExtendArgs", "KVOwnershipError", "Lease", "OwnershipReport",
    "PagedKVCache", "Violation", "WriteDrop", "WriteResult", "commit_pages", "describe_tag",
    "paged_decode", "paged_extend", "reassign_pages", "reference", "release_pages",
    "reserve_pages", "reserved_tag", "tag_owner", "tag_state", "tag_valid_len", "write_kv",
    "written_tag",
]

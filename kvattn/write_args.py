"""The inputs of :func:`kvattn.write_kv`, validated once: :class:`WriteArgs`, the record the backend
registry and the writer backends receive, as :class:`kvattn.layout.DecodeArgs` is for the readers.

The pools and tags follow :mod:`kvattn.layout`; the new tokens' ``k``/``v`` are ``[T, num_kv_heads,
head_dim]`` in the cache dtype, ``slot_mapping`` ``[T]`` int32/int64 (``page * page_size + slot``,
negative = padding), the owners one int64 per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import check_kv_pools, check_last_dim_contiguous, check_page_tags, check_tensor
from .tags import OWNER_MAX

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class WriteArgs:
    """Validated ``write_kv`` inputs; ``owners`` is int64 ``[T]`` (a stride-0 view for one owner)."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    page_tags: torch.Tensor
    owners: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(k, v, k_cache, v_cache, slot_mapping, page_tags, owners)``, the launchers' order."""
        return (self.k, self.v, self.k_cache, self.v_cache, self.slot_mapping, self.page_tags,
                self.owners)


def owner_ids(owner, n: int, device) -> torch.Tensor:
    """Owner ids as an int64 tensor of ``n``; a Python int is checked here, a tensor is trusted
    (an owner that holds no page simply matches none)."""
    if isinstance(owner, torch.Tensor):
        check_tensor("owner", owner, dtypes=(torch.int64,))
        if owner.dim() == 0:
            return owner.to(device).expand(n)
        if tuple(owner.shape) != (n,):
            raise ValueError(f"owner: expected an int or an int64 tensor of shape ({n},), "
                             f"got shape {tuple(owner.shape)}")
        return owner.to(device)
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"owner: expected an int or an int64 tensor, got {type(owner).__name__}")
    if not 1 <= owner <= OWNER_MAX:
        raise ValueError(f"owner: expected an id in [1, {OWNER_MAX}], got {owner}")
    return torch.full((n,), owner, dtype=torch.int64, device=device)


def validate_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owner) -> WriteArgs:
    """The argument checks of :func:`kvattn.write_kv`; raise ValueError/TypeError naming the
    argument, what was expected and what was got."""
    check_kv_pools(k_cache, v_cache)
    device = k_cache.device
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    check_page_tags(page_tags, num_pages, device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=(k_cache.dtype,), device=device)
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected shape ({num_tokens}, {num_kv_heads}, {head_dim}) "
                             f"(tokens of slot_mapping, heads and head_dim of the cache), "
                             f"got {tuple(t.shape)}")
        check_last_dim_contiguous(name, t)
    return WriteArgs(k, v, k_cache, v_cache, slot_mapping, page_tags,
                     owner_ids(owner, num_tokens, device))

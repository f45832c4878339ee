"""The inputs of :func:`kvattn.write_kv`, validated once: :class:`WriteArgs`, the record the backend
registry and the writer backends receive, as :class:`kvattn.layout.DecodeArgs` is for the readers;
and the owner-id checks every writer shares.

The pools and tags follow :mod:`kvattn.layout`; the new tokens' ``k``/``v`` are ``[T, num_kv_heads,
head_dim]`` (``v``: ``head_dim_v``, its pool's) in the cache dtype (fp8 pools also take
float16/bfloat16/float32 tokens, which the writer
quantises by ``k_scale``/``v_scale``: :func:`kvattn.write_kv`), ``slot_mapping`` ``[T]``
int32/int64 (``page * page_size + slot``,
negative = padding, any stride), the owners one int64 per token.

Value checks of the writers (owner ids in ``[1, OWNER_MAX]``, page ids in the pool) run where the
values are on the host: a Python int or list, a CPU tensor; ``validate=True`` runs them on device
tensors too (one synchronisation), ``validate=False`` on no tensor. Unchecked, the device ops fail
closed (docs/ownership.md section 4): an owner outside ``[1, OWNER_MAX]`` holds no page and no tag
ever carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import (
    KV_DTYPES,
    check_apart,
    check_kv_pools,
    check_last_dim_contiguous,
    check_page_tags,
    check_tensor,
)
from .tags import OWNER_MAX
from .variants import FP8_DTYPES, _kv_scale, check_scale_values

INDEX_DTYPES = (torch.int32, torch.int64)
# How a quantising writer rounds ``x / scale`` to fp8 (:func:`kvattn.write_kv`).
FP8_ROUNDINGS = ("nearest", "toward_zero")


@dataclass
class WriteArgs:
    """Validated ``write_kv`` inputs; ``owners`` is int64 ``[T]`` (a stride-0 view for one owner).
    ``k_scale``/``v_scale``: ``[num_kv_heads]`` float32 tensors when the writer quantises ``k``/``v``
    into fp8 pools, else None. ``fp8_rounding``: one of :data:`FP8_ROUNDINGS` (``"nearest"``
    unless the writer quantises)."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    page_tags: torch.Tensor
    owners: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    fp8_rounding: str = "nearest"

    @property
    def quantises(self) -> bool:
        return self.k_scale is not None

    def switches(self) -> list[str]:
        """The :mod:`kvattn.variants` switches a writer must implement to run these inputs (the
        registry refuses a backend whose ``WRITE_SWITCHES`` lack one): ``"fp8 KV"`` for fp8 pools,
        ``"fp8 toward_zero"`` for quantising with that rounding."""
        switches = ["fp8 KV"] if self.k_cache.dtype in FP8_DTYPES else []
        if self.fp8_rounding != "nearest":
            switches.append(f"fp8 {self.fp8_rounding}")
        return switches

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def head_dim_v(self) -> int:
        return self.v_cache.shape[3]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(k, v, k_cache, v_cache, slot_mapping, page_tags, owners)``, the launchers' order."""
        return (
            self.k,
            self.v,
            self.k_cache,
            self.v_cache,
            self.slot_mapping,
            self.page_tags,
            self.owners,
        )


def on_host(values, validate: bool | None) -> bool:
    """Whether the value checks run on ``values``: ``validate``, or by default when they are on
    the host (not a tensor, or a CPU tensor)."""
    if validate is not None:
        if not isinstance(validate, bool):
            raise TypeError(f"validate: expected a bool or None, got {type(validate).__name__}")
        return validate
    return not isinstance(values, torch.Tensor) or values.device.type == "cpu"


def check_owner_values(name: str, owners: torch.Tensor) -> None:
    """Every id of ``owners`` in ``[1, OWNER_MAX]`` (host-side: synchronises on a device tensor)."""
    flat = owners.detach().reshape(-1).cpu()
    bad = torch.nonzero((flat < 1) | (flat > OWNER_MAX)).flatten()
    if bad.numel():
        i = int(bad[0])
        where = f"{name}[{i}]" if owners.dim() else name
        raise ValueError(
            f"{name}: expected owner ids in [1, {OWNER_MAX}], got {where} = {int(flat[i])}"
        )


def owner_ids(
    owner, n: int, device, *, name: str = "owner", validate: bool | None = None
) -> torch.Tensor:
    """Owner ids as an int64 tensor of ``n`` on ``device``. A Python int is always checked; a
    tensor (0-d or ``[n]``) when :func:`on_host` says so. An unchecked id outside ``[1,
    OWNER_MAX]`` holds no page, so the writers refuse it on the device."""
    if isinstance(owner, torch.Tensor):
        check_tensor(name, owner, dtypes=(torch.int64,))
        if owner.dim() != 0 and tuple(owner.shape) != (n,):
            raise ValueError(
                f"{name}: expected an int or an int64 tensor of shape ({n},), "
                f"got shape {tuple(owner.shape)}"
            )
        if on_host(owner, validate):
            check_owner_values(name, owner)
        owner = owner.to(device)
        return owner.expand(n) if owner.dim() == 0 else owner
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"{name}: expected an int or an int64 tensor, got {type(owner).__name__}")
    if not 1 <= owner <= OWNER_MAX:
        raise ValueError(f"{name}: expected an id in [1, {OWNER_MAX}], got {owner}")
    return torch.full((n,), owner, dtype=torch.int64, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def write_scales(
    k_dtype, k_cache, k_scale, v_scale, validate: bool | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` as ``[num_kv_heads]`` float32 tensors when the writer quantises (fp8
    pools, ``k`` not fp8), else ``(None, None)``. A scale is a float or a float32 tensor ``[]``,
    ``[1]`` or ``[num_kv_heads]`` (:mod:`kvattn.variants`), in ``[2**-126, 2**126]``: checked for
    floats, and for tensors where :func:`on_host` says so."""
    device, num_kv_heads = k_cache.device, k_cache.shape[2]
    fp8_pool = k_cache.dtype in FP8_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not fp8_pool:
            raise ValueError(
                f"{name}: expected None with {_dtype_name(k_cache.dtype)} pools (scales "
                f"quantise into fp8 pools), got a scale"
            )
        if k_dtype == k_cache.dtype:
            raise ValueError(
                f"{name}: expected None when k and v are already "
                f"{_dtype_name(k_cache.dtype)} (stored as they are), got a scale"
            )
    if not fp8_pool or k_dtype == k_cache.dtype:
        return None, None
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        t = _kv_scale(name, scale, num_kv_heads, device, device_of="k_cache")
        if isinstance(scale, torch.Tensor) and on_host(scale, validate):
            check_scale_values(name, t)
        scales.append(t)
    return scales[0], scales[1]


def check_fp8_rounding(fp8_rounding, quantises: bool) -> str:
    """``fp8_rounding`` is one of :data:`FP8_ROUNDINGS`, and ``"nearest"`` unless the writer
    quantises (a rounding that nothing rounds is a caller's mistake)."""
    if not isinstance(fp8_rounding, str):
        raise TypeError(f"fp8_rounding: expected a str, got {type(fp8_rounding).__name__}")
    if fp8_rounding not in FP8_ROUNDINGS:
        raise ValueError(
            f"fp8_rounding: expected one of {list(FP8_ROUNDINGS)}, got {fp8_rounding!r}"
        )
    if fp8_rounding != "nearest" and not quantises:
        raise ValueError(
            f"fp8_rounding: expected 'nearest' when the writer does not quantise "
            f"(fp8 pools and wider k/v), got {fp8_rounding!r}"
        )
    return fp8_rounding


def validate_write_kv(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    page_tags,
    owner,
    *,
    validate: bool | None = None,
    k_scale=None,
    v_scale=None,
    fp8_rounding: str = "nearest",
) -> WriteArgs:
    """The argument checks of :func:`kvattn.write_kv`; raise ValueError/TypeError naming the
    argument, what was expected and what was got."""
    check_kv_pools(k_cache, v_cache)
    device = k_cache.device
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    check_page_tags(page_tags, num_pages, device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_tokens = slot_mapping.shape[0]
    # fp8 pools take tokens already in the pool's format, or in a wider one to quantise.
    dtypes = (k_cache.dtype,) + (KV_DTYPES if k_cache.dtype in FP8_DTYPES else ())
    check_tensor("k", k, ndim=3, dtypes=dtypes, device=device)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=device)
    for name, t, dim in (("k", k, head_dim), ("v", v, v_cache.shape[3])):
        if tuple(t.shape) != (num_tokens, num_kv_heads, dim):
            raise ValueError(
                f"{name}: expected shape ({num_tokens}, {num_kv_heads}, {dim}) "
                f"(tokens of slot_mapping, heads and head dim of its pool), "
                f"got {tuple(t.shape)}"
            )
        check_last_dim_contiguous(name, t)
    owners = owner_ids(owner, num_tokens, device, validate=validate)
    # The kernels read slot_mapping, the owners and the tags again after storing K/V (the stamp):
    # none may sit in memory this call writes, nor may a K/V store land in a tag.
    written = dict(k_cache=k_cache, v_cache=v_cache, page_tags=page_tags)
    check_apart("page_tags", page_tags, dict(k_cache=k_cache, v_cache=v_cache))
    check_apart("slot_mapping", slot_mapping, written)
    check_apart("owner", owners, written)
    k_scale, v_scale = write_scales(k.dtype, k_cache, k_scale, v_scale, validate)
    check_apart("k_scale", k_scale, written)
    check_apart("v_scale", v_scale, written)
    fp8_rounding = check_fp8_rounding(fp8_rounding, k_scale is not None)
    return WriteArgs(
        k, v, k_cache, v_cache, slot_mapping, page_tags, owners, k_scale, v_scale, fp8_rounding
    )

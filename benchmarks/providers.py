"""The decode implementations the benchmarks time, each behind the same small interface.

A provider says whether it can run a point (``why_not``) and builds a ``run(i)`` that decodes
rotation set ``i`` and returns ``(out, report)`` (``report`` is None for providers without the
check). ``build`` also returns the output buffer ``run`` writes into, when there is one, so the
harness can poison it before the correctness check. Everything a provider needs that a serving
engine would prepare once per batch (plans, index casts) happens in ``build``, outside the timing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kvattn
from kvattn import backends

from .common import DTYPES, DecodeInputs


@dataclass(frozen=True)
class Provider:
    name: str
    family: str  # checked and unchecked variants of one kernel share a family
    checked: bool
    why_not: Callable[[DecodeInputs], str | None]
    build: Callable[[DecodeInputs], tuple]


def _kvattn(backend: str, check: bool) -> Provider:
    def why_not(inp: DecodeInputs) -> str | None:
        args = kvattn.layout.validate_decode(*inp.args(0), scale=inp.scale, validate=False)
        return backends.explain(args)[backend]

    def build(inp: DecodeInputs):
        out = torch.empty_like(inp.q)

        def run(i: int):
            return kvattn.paged_decode(*inp.args(i), scale=inp.scale, check=check, backend=backend,
                                       out=out)
        return run, out

    variant = "checked" if check else "unchecked"
    return Provider(f"kvattn-{backend}-{variant}", f"kvattn-{backend}", check, why_not, build)


def _sdpa_why_not(inp: DecodeInputs) -> str | None:
    if inp.q.device.type == "cuda":
        # The gather materialises K and V of one set; SDPA may make one more contiguous copy.
        need = 3 * inp.point.kv_set_bytes()
        free, _ = torch.cuda.mem_get_info(inp.q.device)
        if need > free:
            return f"gathering the KV needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    return None


def _sdpa_build(inp: DecodeInputs):
    """What a user without a paged kernel does: gather the pages into a contiguous KV tensor, then
    call SDPA. GQA is expressed by viewing the group of query heads as a query length (no KV
    repeat); all lengths are equal, so no mask is needed."""
    p = inp.point
    group = p.num_heads // p.num_kv_heads
    tables = [t.long() for t in inp.tables]

    def run(i: int):
        k = inp.k_cache[tables[i]].flatten(1, 2)[:, :p.context].transpose(1, 2)  # [B, Hkv, N, D]
        v = inp.v_cache[tables[i]].flatten(1, 2)[:, :p.context].transpose(1, 2)
        q = inp.q.view(p.batch, p.num_kv_heads, group, p.head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, k, v, scale=inp.scale)
        return out.reshape(p.batch, p.num_heads, p.head_dim), None
    return run, None


def _flashinfer_why_not(inp: DecodeInputs) -> str | None:
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return f"not importable ({e})"
    if inp.q.device.type != "cuda":
        return "needs a CUDA device"
    return None


def _flashinfer_build(inp: DecodeInputs):
    """FlashInfer's documented paged decode: one planned wrapper per rotation set (the plan is
    host work an engine does once per batch), NHD pools shared with kvattn."""
    import flashinfer
    p = inp.point
    dev = inp.q.device
    dtype = DTYPES[p.dtype]
    indptr = torch.arange(p.batch + 1, dtype=torch.int32, device=dev) * p.pages_per_seq
    last_len = torch.full((p.batch,), p.context - (p.pages_per_seq - 1) * p.page_size,
                          dtype=torch.int32, device=dev)
    wrappers = []
    for table in inp.tables:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(indptr, table.reshape(-1), last_len, p.num_heads, p.num_kv_heads, p.head_dim,
               p.page_size, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        wrappers.append(w)

    def run(i: int):
        return wrappers[i].run(inp.q, (inp.k_cache, inp.v_cache)), None
    return run, None


def _reference_why_not(inp: DecodeInputs) -> str | None:
    if inp.q.device.type != "cpu":
        return "timed only on CPU tiny points (it gathers every page in float32)"
    return None


def _reference_build(inp: DecodeInputs):
    out = torch.empty_like(inp.q)

    def run(i: int):
        return kvattn.paged_decode(*inp.args(i), scale=inp.scale, backend="reference", out=out)
    return run, out


def all_providers() -> list[Provider]:
    return [
        _kvattn("triton", True), _kvattn("triton", False),
        _kvattn("cuda", True), _kvattn("cuda", False),
        Provider("torch-sdpa-gather", "torch-sdpa-gather", False, _sdpa_why_not, _sdpa_build),
        Provider("flashinfer", "flashinfer", False, _flashinfer_why_not, _flashinfer_build),
        Provider("kvattn-reference", "kvattn-reference", True, _reference_why_not, _reference_build),
    ]


def select(names: list[str] | None) -> list[Provider]:
    """Providers by name (all when ``names`` is empty); unknown names raise ValueError."""
    providers = all_providers()
    if not names:
        return providers
    known = {p.name for p in providers}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--providers: expected names from {sorted(known)}, got {unknown}")
    return [p for p in providers if p.name in names]

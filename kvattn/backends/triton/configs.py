"""Launch configurations of the Triton kernels: one table per kernel, keyed by
``(arch, dtype, head_dim, page_size)`` (decode: and V's head dim, when it has its own), with
overrides for tuning sweeps.

A key matches an entry when every field of the entry is None (any) or equal; the most specific
entry wins (most non-None fields, then the later entry). The values are defaults until a recorded
GPU sweep (``benchmarks/gpu_suite.sh``) replaces them; see ``benchmarks/results/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` tokens per tile (a power of two >= 16); tiles of pages at least that long read one
    block-table entry and one tag per tile. ``programs_per_sm``: resident programs the split planner
    fits its grid to (from registers and shared memory of the compiled kernel, see
    ``tools/static_sm90.py``; never more than the compiled kernel allows, or the grid spills into a
    second wave); ``max_registers``: registers per thread the kernel is compiled for (ptxas's
    ``maxnreg``; None: as ptxas chooses)."""

    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 7
    max_registers: int | None = None


@dataclass(frozen=True)
class ExtendConfig:
    """Tiles of ``block_m`` rows (query tokens x the heads of a GQA group) and ``block_n`` keys;
    ``d_split`` programs share a tile and each accumulates ``1 / d_split`` of the output head dim
    (for heads too wide for one program's registers)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    d_split: int = 1


def small_pages(page_size: int) -> bool:
    """Pages a 16-token tile does not fit whole: resolved per token."""
    return page_size % 16 != 0


def large_pages(page_size: int) -> bool:
    """Pages whole 32-token tiles fit."""
    return page_size % 32 == 0


# (arch, dtype, head_dim rounded up to a power of two, page_size) -> config. A field matches when it
# is None, equal, or a predicate that accepts the value; decode keys carry a fifth, V's head dim
# rounded up, which only the entries that name it read. Defaults chosen from sm_90 compiles
# (tools/static_sm90.py: K/V buffers, registers, shared memory, loop instructions), not timings.
DECODE_TABLE: list[tuple[tuple, DecodeConfig]] = [
    # Pages of 16 (and 48, 80, ...): one scalar page per tile, three K/V buffers in flight; 29 KB of
    # shared memory and at most 72 registers let 7 programs share an SM. Unbounded, ptxas gives the
    # checked kernel 80 registers, and more with variant switches; capped at 72 every variant of
    # the static table fits, without spills.
    (
        (None, None, None, None),
        DecodeConfig(block_n=16, num_warps=4, num_stages=4, programs_per_sm=7, max_registers=72),
    ),
    # Longer pages: 32-token tiles halve the per-token loop overhead; 38 KB of shared memory, 6
    # programs.
    ((None, None, None, large_pages), DecodeConfig(block_n=32, num_stages=3, programs_per_sm=6)),
    # Short pages are resolved per token; the extra indirection needs two more stages for two
    # K/V buffers.
    ((None, None, None, small_pages), DecodeConfig(block_n=16, num_stages=5, programs_per_sm=4)),
    # Head dim 256: 41 KB of shared memory; at most 96 registers (ptxas gives the checked kernel
    # 106 unbounded) for 5 programs.
    (
        (None, None, 256, None),
        DecodeConfig(block_n=16, num_stages=3, programs_per_sm=5, max_registers=96),
    ),
    ((None, None, 512, None), DecodeConfig(block_n=16, num_stages=3, programs_per_sm=2)),
    ((None, torch.float32, None, None), DecodeConfig(block_n=16, num_stages=3, programs_per_sm=4)),
    # Keys of 256 (192 rounded up) with values of 128, V's own head dim (5th field; the entries
    # above match any): capped at 96 registers ptxas schedules the checked loop 10% longer than
    # the unchecked (332 / 301 instructions, DeepSeek's 192 / 128), at 80 as long as d256's gap
    # (322 / 301); 80 registers and 33 KB of shared memory fit 6 programs.
    (
        (None, None, 256, None, 128),
        DecodeConfig(block_n=16, num_stages=3, programs_per_sm=6, max_registers=80),
    ),
]

EXTEND_TABLE: list[tuple[tuple, ExtendConfig]] = [
    ((None, None, None, None), ExtendConfig()),
    ((None, None, 256, None), ExtendConfig(block_m=64, block_n=32)),
    ((None, None, 512, None), ExtendConfig(block_m=128, block_n=16, d_split=2)),
    # Exact fp32 products ("ieee") hold four times the registers of a 16-bit tensor-core tile.
    ((None, torch.float32, None, None), ExtendConfig(block_m=32, block_n=32, num_warps=4)),
    (
        (None, torch.float32, 512, None),
        ExtendConfig(block_m=32, block_n=16, num_warps=4, d_split=4),
    ),
]


def _matches(pattern, value) -> bool:
    return pattern is None or (pattern(value) if callable(pattern) else pattern == value)


def _lookup(table, key):
    best, best_score = None, -1
    for pattern, config in table:
        if all(_matches(p, k) for p, k in zip(pattern, key)):
            score = sum(p is not None for p in pattern)
            if score >= best_score:
                best, best_score = config, score
    return best


def _arch(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def decode_config(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    head_dim_v: int | None = None,
    **overrides,
) -> DecodeConfig:
    """The table's decode config for these inputs (``head_dim_v``: V's head dim, default
    ``head_dim``), with ``overrides`` (fields of DecodeConfig)."""
    dv = _pow2(head_dim if head_dim_v is None else head_dim_v)
    config = _lookup(DECODE_TABLE, (_arch(device), dtype, _pow2(head_dim), page_size, dv))
    return replace(config, **overrides) if overrides else config


def extend_config(
    device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int, **overrides
) -> ExtendConfig:
    """The table's extend config for these inputs, with ``overrides`` (fields of ExtendConfig)."""
    config = _lookup(EXTEND_TABLE, (_arch(device), dtype, _pow2(head_dim), page_size))
    return replace(config, **overrides) if overrides else config


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class MLADecodeConfig:
    """MLA decode: ``block_h`` query heads per program (the M dimension of both products, at
    least 16 for the tensor cores; more heads take more programs, which re-read the latent rows
    from L2), ``block_n`` latent rows per tile, ``programs_per_sm`` for the split planner (from
    registers and shared memory of the compiled kernel, see ``tools/static_sm90.py``)."""

    block_h: int = 16
    block_n: int = 16
    num_warps: int = 8
    num_stages: int = 4
    programs_per_sm: int = 2


# (arch, dtype, kv_lora_rank + rope_dim rounded up to a power of two, page_size) -> config, matched
# as DECODE_TABLE. Defaults chosen from sm_90 compiles of the 512 + 64 latent (tools/static_sm90.py:
# K/V buffers, registers, shared memory, loop instructions), not timings. With 4 warps the
# [16, 512] float32 accumulator and the 16-head query take 128 to 180 registers; 8 warps halve that.
MLA_DECODE_TABLE: list[tuple[tuple, MLADecodeConfig]] = [
    # Pages of 16 (and other multiples of 16 but not 32): one scalar page per tile, three latent
    # buffers (74 KB of shared memory), about 97 registers: two programs per SM.
    ((None, None, None, None), MLADecodeConfig()),
    # Pages of 64 (FlashMLA's) and other multiples of 32: 32-row tiles, two buffers (93 KB).
    ((None, None, None, large_pages), MLADecodeConfig(block_n=32, num_stages=3)),
    # Short pages are resolved per row; five stages keep two buffers; about 140 registers (checked):
    # one program per SM.
    ((None, None, None, small_pages), MLADecodeConfig(num_stages=5, programs_per_sm=1)),
    # float32 rows are twice as wide: 16-row tiles, two buffers (112 KB).
    ((None, torch.float32, None, None), MLADecodeConfig(num_stages=3)),
]


def mla_decode_config(
    device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int, **overrides
) -> MLADecodeConfig:
    """The table's MLA decode config for these inputs (``head_dim``: ``kv_lora_rank +
    rope_dim``), with ``overrides`` (fields of MLADecodeConfig)."""
    config = _lookup(MLA_DECODE_TABLE, (_arch(device), dtype, _pow2(head_dim), page_size))
    return replace(config, **overrides) if overrides else config


@dataclass(frozen=True)
class MLAExtendConfig:
    """MLA extend: tiles of ``block_m`` rows (query tokens x query heads, every head reading the one
    latent head) and ``block_n`` latent rows; the ``[block_m, kv_lora_rank]`` float32 accumulator
    and the query tile stay in registers across the loop."""

    block_m: int = 32
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 3


# (arch, dtype, kv_lora_rank + rope_dim rounded up to a power of two, page_size) -> config, matched
# as DECODE_TABLE. Defaults chosen from sm_90 compiles of the 512 + 64 latent (tools/static_sm90.py:
# K/V buffers, registers, shared memory, loop instructions), not timings.
MLA_EXTEND_TABLE: list[tuple[tuple, MLAExtendConfig]] = [
    # Pages a multiple of 32: two latent buffers (110 KB of shared memory), about 160 registers.
    # 64-row tiles (wgmma's M) spill at 8 warps.
    ((None, None, None, None), MLAExtendConfig()),
    # Other pages are resolved per key: five stages keep two buffers; about 230 registers.
    ((None, None, None, lambda page: page % 32 != 0), MLAExtendConfig(num_stages=5)),
    # Exact fp32 products ("ieee") take four times the registers of a 16-bit tensor-core tile.
    ((None, torch.float32, None, None), MLAExtendConfig(block_m=16, block_n=16)),
]


def mla_extend_config(
    device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int, **overrides
) -> MLAExtendConfig:
    """The table's MLA extend config for these inputs (``head_dim``: ``kv_lora_rank +
    rope_dim``), with ``overrides`` (fields of MLAExtendConfig)."""
    config = _lookup(MLA_EXTEND_TABLE, (_arch(device), dtype, _pow2(head_dim), page_size))
    return replace(config, **overrides) if overrides else config

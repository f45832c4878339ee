"""Grid planning shared by the kernels of every backend: split-KV for decode, the query-tile map
for extend.

Grids depend on shapes only (batch, heads, table width, page size, total query rows) and the
device's SM count, never on ``seq_lens`` or ``cu_seqlens_q`` values: no host sync, and a captured
CUDA graph stays valid when lengths change. Decode splits are aligned to ``align`` tokens (a multiple
of the page size), so every logical page belongs to exactly one split and is checked once.
"""
from __future__ import annotations

import functools

import torch

from ..layout import query_offsets

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 512


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(args, align: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)``. Default on a GPU: enough (batch x KV head x split) programs
    for two waves over the SMs, splits of at least MIN_TOKENS_PER_SPLIT table tokens, at most
    MAX_SPLITS; on the CPU (interpreter, harness) a few splits at most, so tests exercise merges."""
    capacity = args.max_pages * args.page_size
    if num_splits is None:
        if args.q.device.type == "cuda":
            programs = args.batch * args.num_kv_heads
            wanted = -(-2 * sm_count(args.q.device.index or 0) // programs)
            num_splits = max(1, min(wanted, capacity // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))
        else:
            num_splits = max(1, min(capacity // 1024, 4))
    tokens_per_split = -(-capacity // max(1, num_splits))
    tokens_per_split = -(-tokens_per_split // align) * align
    return -(-capacity // tokens_per_split), tokens_per_split


def extend_tile_map(args, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(q_start [B + 1] int32, tile_start [B] int32, grid slots)`` for extend: the query rows of
    each sequence and the first grid slot of its tiles of ``block_m`` rows, with device ops only.
    Every sequence gets at least one tile (its tile 0 writes the report); ``ceil(total_q / block_m)
    + B`` slots always cover ``sum_b max(1, ceil(q_len_b / block_m))`` because the offsets are
    clamped to ``[0, total_q]`` and non-decreasing; the spare slots write nothing."""
    q_start = query_offsets(args.cu_seqlens_q, args.total_q).to(torch.int32)
    q_lens = q_start[1:] - q_start[:-1]
    tiles = torch.clamp((q_lens + block_m - 1) // block_m, min=1)
    tile_start = (torch.cumsum(tiles, dim=0) - tiles).to(torch.int32)
    return q_start, tile_start, -(-args.total_q // block_m) + args.batch

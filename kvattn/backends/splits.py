"""Split-KV planning shared by the decode kernels of every backend.

The plan depends on shapes only (batch, heads, table width, page size) and the device's SM count,
never on ``seq_lens`` values: no host sync, and a captured CUDA graph stays valid when lengths
change. Splits are aligned to ``align`` tokens (a multiple of the page size), so every logical page
belongs to exactly one split and is checked once.
"""
from __future__ import annotations

import functools

import torch

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

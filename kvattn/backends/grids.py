"""Grid planning shared by the kernels of every backend: split-KV for decode, the query-tile map
for extend.

Grids depend on shapes only (batch, heads, table width, page size, total query rows) and the
device's SM count, never on ``seq_lens`` or ``cu_seqlens_q`` values: no host sync, and a captured
CUDA graph stays valid when lengths change.

Decode launches ``num_splits`` programs per (sequence, KV head). Each program derives its own token
range from the sequence's actual length (:func:`split_chunk`, which every decode kernel computes
the same way on the device): a short sequence in a wide block table still spreads over all
splits, and splits past its end do nothing. Chunks are multiples of ``align`` (a multiple of the
page size), so every logical page belongs to exactly one split and is checked once.

On a GPU the split count fits the grid to the device's resident slots (the kernel's programs per
SM times the SMs): every program of a grid of at most one wave runs from the start, while a grid
just past a wave leaves its last programs running nearly alone after the rest have finished
(:func:`grid_waves`).
"""

from __future__ import annotations

import functools
import math

import torch

from ..layout import query_offsets

MAX_SPLITS = 64
# A split shorter than this costs more in partial results and merge than its parallelism returns.
GPU_MIN_CHUNK = 256
# The most of a grid's slot time its last wave may leave idle when the grid needs more than one
# wave (the batch alone overflows the slots).
TAIL_MAX = 0.10


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None on the CPU (interpreter, harness)."""
    if device.type != "cuda":
        return None
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def split_chunk(seq_len: int, num_splits: int, align: int, min_chunk: int) -> int:
    """Tokens per split for a sequence of ``seq_len`` tokens (clamped to the table): an equal share
    rounded up to ``align``, at least ``min_chunk`` (a multiple of ``align``). The kernels compute
    this same value from ``seq_lens`` on the device."""
    return max(round_up(-(-max(seq_len, 0) // num_splits), align), min_chunk, align)


def split_bounds(
    seq_len: int, num_splits: int, align: int, min_chunk: int
) -> list[tuple[int, int]]:
    """``[(start, end)]`` per split; empty ranges (start >= end) do no work."""
    chunk = split_chunk(seq_len, num_splits, align, min_chunk)
    return [(s * chunk, min((s + 1) * chunk, max(seq_len, 0))) for s in range(num_splits)]


def grid_waves(programs: int, slots: int) -> tuple[float, float]:
    """``(waves, tail)`` of a grid of ``programs`` equal programs on ``slots`` resident slots:
    waves = programs / slots, and tail = the share of the slots' time over ``ceil(waves)`` waves
    that the last, partial wave leaves idle (``1 - waves / ceil(waves)``). A grid of at most one
    wave has no tail: all of its programs are resident from the start."""
    waves = programs / slots
    return waves, 0.0 if waves <= 1 else 1.0 - waves / math.ceil(waves)


def fit_splits(programs_per_split: int, slots: int, most: int) -> int:
    """Splits for a grid of ``programs_per_split`` programs per split on ``slots`` resident slots,
    at most ``most``: as many as one wave holds (at least 1). When one split already overflows a
    wave, the fewest splits whose tail (:func:`grid_waves`) is at most ``TAIL_MAX``, else the
    count with the smallest tail."""
    if programs_per_split <= slots:
        return max(1, min(slots // programs_per_split, most))
    tails = {s: grid_waves(programs_per_split * s, slots)[1] for s in range(1, max(1, most) + 1)}
    return next((s for s, tail in tails.items() if tail <= TAIL_MAX), min(tails, key=tails.get))


def plan_num_splits(
    args,
    align: int,
    programs_per_sm: int,
    num_splits: int | None = None,
    programs_per_split: int | None = None,
) -> tuple[int, int]:
    """``(num_splits, min_chunk)`` for a decode launch of ``programs_per_split`` programs per split
    (default ``batch * num_kv_heads``). On a GPU: :func:`fit_splits` over the device's resident
    slots, ``programs_per_sm`` (the kernel's occupancy) times the SMs, with no more splits than
    chunks of ``GPU_MIN_CHUNK`` tokens in the table and at most ``MAX_SPLITS``. On the CPU
    (interpreter, harness): a few splits at most, with the smallest chunk, so tests exercise the
    merge. ``num_splits`` overrides the count (tests, tuning sweeps)."""
    capacity = args.max_pages * args.page_size
    if args.variant.windowed:
        # The splits cover the window (from an aligned start), not the whole table.
        capacity = min(capacity, args.variant.window_left + 1 + align)
    sms = device_sms(args.q.device)
    min_chunk = align if sms is None else round_up(GPU_MIN_CHUNK, align)
    if num_splits is None:
        if sms is None:
            num_splits = max(1, min(capacity // 1024, 4))
        else:
            per_split = programs_per_split or args.batch * args.num_kv_heads
            num_splits = fit_splits(
                per_split, programs_per_sm * sms, min(-(-capacity // min_chunk), MAX_SPLITS)
            )
    if (
        not isinstance(num_splits, int)
        or isinstance(num_splits, bool)
        or not 1 <= num_splits <= 65535
    ):
        raise ValueError(f"num_splits: expected an int in [1, 65535], got {num_splits!r}")
    return num_splits, min_chunk


def extend_tile_map(args, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(q_start [B + 1] int32, tile_start [B] int32, grid slots)`` for extend (the CUDA
    launcher's; each Triton extend program computes the same map itself,
    ``paged_extend.locate_tile``): the query rows of each sequence and the first grid slot of its
    tiles of ``block_m`` rows, with device ops only.
    Every sequence gets at least one tile (its tile 0 writes the report); ``ceil(total_q / block_m)
    + B`` slots always cover ``sum_b max(1, ceil(q_len_b / block_m))`` because the offsets are
    clamped to ``[0, total_q]`` and non-decreasing; the spare slots write nothing."""
    q_start = query_offsets(args.cu_seqlens_q, args.total_q).to(torch.int32)
    q_lens = q_start[1:] - q_start[:-1]
    tiles = torch.clamp((q_lens + block_m - 1) // block_m, min=1)
    tile_start = (torch.cumsum(tiles, dim=0) - tiles).to(torch.int32)
    return q_start, tile_start, -(-args.total_q // block_m) + args.batch

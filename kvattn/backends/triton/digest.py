"""The keyed transfer digest on the device (:class:`kvattn.transfer.DigestKey`; docs/transfer.md):
NH, the universal hash of UMAC, in four Toeplitz instances, over the bytes of the pages a transfer
moves, where they lie.

A page's message is, per layer in order, the K then the V rows of its slots ``[0, valid_len)`` as
little-endian 32-bit words, in NHD order whatever the pool's layout (a slot's heads in turn);
chunk ``c`` (one pool of one layer) takes the key words from
``key_offset[c]`` on, a page-sized stretch of them, so word ``w`` of its slot ``s`` meets key word
``key_offset[c] + s * row_words[c] + w``. Instance ``j`` reads the key shifted by ``4 j`` words::

    NH_j = sum over word pairs (2i, 2i + 1) of
           ((m[2i] + k[2i + 4j]) mod 2^32) * ((m[2i + 1] + k[2i + 1 + 4j]) mod 2^32)  mod 2^64

``nh_kernel`` (grid ``(pages, chunks, ceil(page_size / ROWS))``) reads ``ROWS`` slot rows of one
chunk of one page and stores the four partial sums; the launcher adds them up per page (a sum mod
2^64 in any order is exact). The pools are reached through a table of their addresses and strides,
so one launch covers every layer whatever its allocation (one per row shape: K and V may differ).
Head rows, strides and addresses come in 16-byte units, so message and key words load 128 bits at
a time (a slot row of words not a power of two is padded with masked ones); ``ROWS`` and
``NUM_WARPS`` are the static figures' choice (benchmarks/results/static_sm90.md: 8 rows over 4
warps issue the fewest instructions per byte that keep 5 programs per SM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INSTANCES = 4
SHIFT = 4  # key words between instances (UMAC's Toeplitz step for 32-bit NH)
ROWS = 8
NUM_WARPS = 4


@triton.jit
def nh_kernel(
    pool_ptrs,
    page_strides,
    slot_strides,
    head_strides,
    key_offsets,
    pages_ptr,
    lens_ptr,
    key_ptr,
    part_ptr,
    ROWS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    HEAD_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    INSTANCES: tl.constexpr,
    SHIFT: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    block = tl.program_id(2)
    # Pools, strides and rows come in 16-byte units (kvattn.transfer checks it): whole 128-bit
    # loads of message and key words.
    base = tl.multiple_of(tl.load(pool_ptrs + c), 16).to(tl.pointer_type(tl.int32))
    page = tl.load(pages_ptr + i)
    valid_len = tl.load(lens_ptr + i)
    slot = block * ROWS + tl.arange(0, ROWS)  # [ROWS]
    word = tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
    if BLOCK_WORDS == ROW_WORDS:
        live = (slot < valid_len)[:, None]  # [ROWS, 1]: whole rows, so the loads stay 128-bit
    else:
        live = (slot < valid_len)[:, None] & (word < ROW_WORDS)[None, :]  # [ROWS, BLOCK_WORDS]
    if HEAD_WORDS == ROW_WORDS:
        cols = word  # slot rows contiguous
    else:
        head_stride = tl.multiple_of(tl.load(head_strides + c), 4)
        cols = (word // HEAD_WORDS).to(tl.int64) * head_stride + word % HEAD_WORDS
    rows = page * tl.load(page_strides + c) + slot.to(tl.int64) * tl.load(slot_strides + c)
    rows = tl.multiple_of(rows, 4)
    m = tl.load(base + rows[:, None] + cols[None, :], mask=live, other=0).to(tl.uint32)
    key_rows = tl.multiple_of(tl.load(key_offsets + c) + slot.to(tl.int64) * ROW_WORDS, 4)
    key_at = key_rows[:, None] + word[None, :]  # [ROWS, BLOCK_WORDS]
    part = part_ptr + ((i * tl.num_programs(1) + c) * tl.num_programs(2) + block) * INSTANCES
    for j in tl.static_range(INSTANCES):
        # Slots past valid_len load 0 with 0 for key: their pairs add (0 + 0)(0 + 0).
        k = tl.load(key_ptr + key_at + SHIFT * j, mask=live, other=0).to(tl.uint32)
        even, odd = tl.split(tl.reshape(m + k, [ROWS, BLOCK_WORDS // 2, 2]))
        product = even.to(tl.uint64) * odd.to(tl.uint64)  # [ROWS, BLOCK_WORDS / 2]
        total = tl.sum(tl.sum(product, axis=1), axis=0)
        tl.store(part + j, total.to(tl.int64, bitcast=True))


def nh(pools: list[torch.Tensor], pages: torch.Tensor, lens: torch.Tensor, key: torch.Tensor):
    """``[len(pages), INSTANCES]`` int64 NH values (the bits of uint64 sums) of pages ``pages``
    with ``lens`` slots over ``pools`` (per layer K then V, validated by the caller: contiguous head
    rows of 16-byte units, strides and addresses 16-byte aligned), with key words ``key`` (int32,
    :func:`key_words` of them). One launch per row shape (K and V may differ)."""
    device = pools[0].device
    words = [row_shape(p) for p in pools]
    offsets = [0]
    for p, w in zip(pools, words):
        offsets.append(offsets[-1] + p.shape[1] * w[0])
    page_size = pools[0].shape[1]
    blocks = triton.cdiv(page_size, ROWS)
    total = torch.zeros(pages.numel(), INSTANCES, dtype=torch.int64, device=device)
    if not pages.numel():
        return total
    for shape in sorted(set(words)):
        group = [c for c, w in enumerate(words) if w == shape]
        as_words = [pools[c].element_size() / 4 for c in group]
        table = dict(
            pool_ptrs=[pools[c].data_ptr() for c in group],
            page_strides=[int(pools[c].stride(0) * s) for c, s in zip(group, as_words)],
            slot_strides=[int(pools[c].stride(1) * s) for c, s in zip(group, as_words)],
            head_strides=[int(pools[c].stride(2) * s) for c, s in zip(group, as_words)],
            key_offsets=[offsets[c] for c in group],
        )
        tables = {k: torch.tensor(v, dtype=torch.int64, device=device) for k, v in table.items()}
        part = torch.empty(
            pages.numel(), len(group), blocks, INSTANCES, dtype=torch.int64, device=device
        )
        nh_kernel[(pages.numel(), len(group), blocks)](
            **tables,
            pages_ptr=pages,
            lens_ptr=lens,
            key_ptr=key,
            part_ptr=part,
            ROWS=ROWS,
            ROW_WORDS=shape[0],
            HEAD_WORDS=shape[1],
            BLOCK_WORDS=triton.next_power_of_2(shape[0]),
            INSTANCES=INSTANCES,
            SHIFT=SHIFT,
            num_warps=NUM_WARPS,
        )
        total += part.sum(dim=(1, 2))  # int64 addition wraps: the sums mod 2^64
    return total


def row_shape(pool: torch.Tensor) -> tuple[int, int]:
    """(words per slot row, words per run): a run is what lies back to back of a slot, its row
    where the heads do (the kernel's contiguous path), else a head's row."""
    head = pool.shape[3] * pool.element_size() // 4
    row = pool.shape[2] * head
    return (row, row) if pool.shape[2] == 1 or pool.stride(2) == pool.shape[3] else (row, head)


def key_words(pools: list[torch.Tensor]) -> int:
    """Key words a digest of ``pools``' pages reads."""
    return sum(p[0].numel() * p.element_size() // 4 for p in pools) + SHIFT * (INSTANCES - 1)

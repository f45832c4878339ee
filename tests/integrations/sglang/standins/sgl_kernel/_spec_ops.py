"""Test-only torch stand-ins for the CPU ops of ``sgl_kernel`` that SGLang 0.5.23's n-gram
speculative decoding calls on a CPU (ngram_worker.py, spec_utils.py, cache_locs.py, eagle.py,
spec_tree.py, memory_pool.py), each with the semantics of the Triton kernel SGLang runs on GPUs."""

import ctypes

import torch


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len=None
):
    """``out_cache_loc`` (packed in request order) gets ``req_to_token[row_i, start_i:end_i]``."""
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        out_cache_loc[offset : offset + end - start] = req_to_token[row, start:end].to(
            out_cache_loc.dtype
        )
        offset += end - start


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The entries of ``out_cache_loc`` at the accepted indices (``accept_index != -1``, row-major),
    packed at the front of ``accept_out_cache_loc``."""
    index = accept_index.reshape(-1).long()
    kept = index[index != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """Each request's last accepted token (its bonus token)."""
    batch = accept_lens.numel()
    index = torch.arange(batch) * accept_stride + accept_lens.long() - 1
    bonus_tokens[:batch] = accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype)


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Greedy verification of each request's draft tree (``verify_tree_greedy_kernel_triton``):
    from the root, follow the child whose token is the target's prediction, as deep as it goes."""
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1).tolist()
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for b in range(candidates.shape[0]):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            node = next_token[b][node]
            while node != -1 and cand[b][node] != target[last]:
                node = next_sibling[b][node]
            if node == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = index[b][node]
            last = index[b][node]
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Row ``tgt`` <- row ``src`` in every buffer named by its address and row stride (bytes)."""
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist()):
            if tgt != src:
                ctypes.memmove(address + tgt * stride, address + src * stride, stride)

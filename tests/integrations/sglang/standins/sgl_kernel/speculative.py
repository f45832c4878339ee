"""Test-only torch stand-in for ``sgl_kernel.speculative`` (n-gram speculative decoding)."""

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    batch_size,
    draft_token_num,
):
    """The draft tree of each request from its ``[n, n]`` ancestor mask (the contract in SGLang's
    kernels/ops/speculative/reconstruct_tree.py): positions (verified length + depth), each
    node's first child and next sibling (-1: none)."""
    n, batch = draft_token_num, batch_size
    if batch == 0:
        return
    mask = tree_mask[: batch * n * n].view(batch, n, n).bool()
    idx = torch.arange(n, device=mask.device)
    ancestors = mask & (idx[None, :] < idx[:, None])[None]  # [batch, node, earlier node]
    depth = ancestors.sum(-1)
    positions[: batch * n].copy_(
        (depth + verified_seq_len[:batch].view(-1, 1).to(torch.int64)).view(-1)
    )
    retrieve_index[:batch].copy_(torch.arange(batch * n, device=mask.device).view(batch, n))
    none = torch.full((batch, n, n), -1, dtype=torch.int64)
    parent = torch.where(ancestors, idx.view(1, 1, n).expand(batch, n, n), none).amax(-1)
    past = torch.full((batch, n, n), n, dtype=torch.int64)
    first_child = torch.where(ancestors, idx.view(1, n, 1).expand(batch, n, n), past).amin(1)
    retrieve_next_token[:batch].copy_(torch.where(first_child < n, first_child, -1))
    siblings = (parent[:, :, None] == parent[:, None, :]) & (idx[:, None] > idx[None, :])[None]
    sibling = torch.where(siblings, idx.view(1, n, 1).expand(batch, n, n), past).amin(1)
    retrieve_next_sibling[:batch].copy_(torch.where((parent >= 0) & (sibling < n), sibling, -1))

"""Test-only stand-in for ``sgl_kernel`` on a CPU without AMX, where SGLang 0.5.23 falls back to
torch everywhere but still imports ``sgl_kernel`` at module level and calls a few ops of it:
``assign_req_to_token_pool_cpu``, and for n-gram speculative decoding the ops of
``_spec_ops.py`` and ``sgl_kernel.speculative``. Those are implemented here in torch (each after
the Triton kernel or contract SGLang names for it); any other top-level name imports and raises
NotImplementedError when called; other submodules (``sgl_kernel.x``) do not exist, so SGLang's own
ImportError fallbacks apply.

The engine suite puts this folder on the servers' path only when no real ``sgl_kernel`` is
installed, and this module refuses to load if one lies further down ``sys.path``."""

import importlib.machinery
import os
import sys

_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_real = importlib.machinery.PathFinder.find_spec(
    "sgl_kernel", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _real is not None:
    raise ImportError(
        f"the test stand-in for sgl_kernel would shadow the real one at {_real.origin}"
    )


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} (the test-only stand-in has only the ops SGLang calls on a CPU)"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len=None
):
    """SGLang's Triton kernel ``assign_req_to_token_pool`` (mem_cache/allocation.py): row
    ``req_pool_indices[i]`` of ``req_to_token`` gets, at ``[start[i], end[i])``, the next
    ``end[i] - start[i]`` entries of ``out_cache_loc`` (packed in request order)."""
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start].to(
            req_to_token.dtype
        )
        offset += end - start


from ._spec_ops import (  # noqa: E402
    assign_extend_cache_locs_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

__all__ = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

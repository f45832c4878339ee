"""Test-only: loaded by every Python process whose path holds this folder (the engine suite
starts SGLang's servers with it on ``PYTHONPATH``, and SGLang's scheduler, tokenizer and
detokenizer processes inherit it).

- ``sglang.srt.configs`` imports ``torchvision.transforms`` for image models; the index's
  torchvision is a CUDA build that does not load beside the CPU torch, and no test reads images:
  a stand-in takes its place unless a real one is importable.
- SGLang's Mooncake sender takes page indices as pinned host tensors behind a CUDA event
  (prefill.py) unless ``MooncakeKVSender.supports_host_tensor_indices`` is False: set once the
  module is imported.
- HiCache's host pool (``--enable-hierarchical-cache --hicache-io-backend direct
  --hicache-mem-layout layer_first``) registers its memory with CUDA and copies with
  ``sgl_kernel``'s ``transfer_kv_direct``, imported on CUDA, HIP and XPU only: on a machine
  without an accelerator the pool is plain memory and the copy an index_select/index_copy_ per
  layer, the same rows the kernel moves.
- HiCache's host pool keeps 10 GB of host memory free for other processes
  (``HICACHE_HOST_MEMORY_RESERVE_BYTES``) and refuses to start below that; the test servers' host
  pools take a few MB on a machine that runs a dozen servers at once, so the reserve is 256 MB.
- SGLang's ``torch_native`` backend would take DeepSeek-style models' MHA paths (the dispatch
  falls back to Triton's), whose prefill reads the latent cache as MHA's K and V and fails; its
  ``forward_extend``/``forward_decode`` read the latent cache correctly on the absorbed MLA path,
  which it is given instead, so that the engine's own attention runs MLA models here.

- SGLang's ``torch_native`` backend has no path for the verify forwards of speculative decoding
  (``TARGET_VERIFY``: its extend path needs prefix lengths the verify batch does not carry); it is
  given one: each request's draft tokens attend over its committed prefix and, within the draft
  tree, their ancestors and themselves (the tree mask SGLang's n-gram worker builds: on a CPU a
  ``[draft, draft]`` block per request, elsewhere the full ``[draft, prefix + draft]`` one).

The fault injectors are not here: the conformance suite's server launcher
(``kvattn.conformance.sglang_server``) installs them.
"""

import enum
import importlib.abc
import importlib.util
import sys
import types


def _stand_in_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    tv, tr, fn = (
        types.ModuleType(n)
        for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    )
    tv.__path__, tr.__path__ = [], []

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tv.transforms, tr.functional = tr, fn
    sys.modules.update({m.__name__: m for m in (tv, tr, fn)})


def _host_indices(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _plain_host_memory(module) -> None:
    import torch

    def alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc


def _small_reserve(module) -> None:
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 256 << 20


def _direct_copy(module) -> None:
    import torch

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        src_rows, dst_rows = src_indices.to(torch.int64), dst_indices.to(torch.int64)
        for src, dst in zip(src_layers, dst_layers, strict=True):
            rows = src.index_select(0, src_rows.to(src.device))
            dst.index_copy_(0, dst_rows.to(dst.device), rows.to(dst.device))

    if not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = transfer_kv_direct


def _absorbed_mla(module) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    module.AttentionBackendRegistry.register(
        "torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA
    )


def _verify_path(module) -> None:
    import torch
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from torch.nn.functional import scaled_dot_product_attention

    cls = module.TorchNativeAttnBackend
    extend = cls.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        fb = forward_batch
        if not fb.forward_mode.is_target_verify():
            return extend(self, q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)
        spec, batch = fb.spec_info, fb.req_pool_indices.shape[0]
        n = spec.draft_token_num
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out_ = out.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        mask, offset = spec.custom_mask, 0
        full = mask.numel() != batch * n * n
        for b in range(batch):
            prefix = int(fb.seq_lens[b])
            slots = self.req_to_token_pool.req_to_token[fb.req_pool_indices[b], : prefix + n]
            if full:
                m = mask[offset : offset + n * (prefix + n)].view(n, prefix + n).bool()
                offset += n * (prefix + n)
            else:
                tree = mask[b * n * n : (b + 1) * n * n].view(n, n).bool()
                m = torch.cat(
                    [torch.ones(n, prefix, dtype=torch.bool, device=tree.device), tree], 1
                )
            rows = slots.long()
            out_[b * n : (b + 1) * n] = (
                scaled_dot_product_attention(
                    q_[b * n : (b + 1) * n].movedim(0, 1).unsqueeze(0),
                    keys[rows].movedim(0, 1).unsqueeze(0).to(q.dtype),
                    values[rows].movedim(0, 1).unsqueeze(0).to(q.dtype),
                    attn_mask=m,
                    scale=layer.scaling,
                    enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                )
                .squeeze(0)
                .movedim(0, 1)
            )
        return out

    cls.forward_extend = forward_extend


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls each of ``callbacks[name]`` with the module right after module ``name`` has run."""

    def __init__(self, callbacks):
        self.callbacks = callbacks

    def find_spec(self, fullname, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for call in callback:
                call(module)

        spec.loader.exec_module = exec_module
        return spec


if importlib.util.find_spec("sglang") is not None:
    import transformers.utils.import_utils  # noqa: F401  (before the stand-in: it sees none)

    _stand_in_torchvision()
    sys.meta_path.insert(
        0,
        _AfterImport(
            {
                "sglang.srt.disaggregation.mooncake.conn": [_host_indices],
                "sglang.srt.mem_cache.pool_host.common": [_plain_host_memory],
                "sglang.srt.mem_cache.pool_host.base": [_small_reserve],
                "sglang.srt.mem_cache.pool_host.mha": [_direct_copy],
                "sglang.srt.mem_cache.pool_host.mla": [_direct_copy],
                "sglang.srt.models.deepseek_common.attention_backend_handler": [_absorbed_mla],
                "sglang.srt.layers.attention.torch_native_backend": [_verify_path],
            }
        ),
    )

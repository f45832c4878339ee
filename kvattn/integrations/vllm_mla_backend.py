"""The vLLM attention backend of MLA models (DeepSeek-V2/V3-style multi-head latent attention)
that :func:`kvattn.integrations.vllm.register` puts in the slot of vLLM's CPU MLA backend.

vLLM's MLA layer keeps one latent row per token, ``kv_lora_rank`` dims then the RoPE key, in a
per-layer cache ``[num_blocks, block_size, kv_lora_rank + rope]``, and hands its backend the new
tokens' latent rows to store (``do_kv_cache_update``) and either absorbed queries (``forward_mqa``:
``q_nope @ W_UK_T`` and ``q_pe``, the output then multiplied by ``W_UV`` by the layer) or, for
prefill tokens, the decompressed queries, keys and values of the new tokens (``forward_mha``,
whose earlier context vLLM gathers from the cache itself, past the backend). Here every token
takes the absorbed path: the builder classes every request as a decode (variable query lengths,
no threshold), so the reads are :func:`kvattn.paged_mla_extend` / :func:`kvattn.paged_mla_decode`
over the latent pool, checked against the ledger's owners, and ``forward_mha`` is never called
(it raises if it is). The latent and its RoPE key are written by :func:`kvattn.write_kv` through
two column views of the cache, under each token's request owner.

Imported by vLLM (through the registry path) only in processes that run the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf

from ..layout import MAX_PAGE_SIZE
from . import vllm as integration
from .ledger import Step


@dataclass
class KVAttnMLAMetadata(MLACommonMetadata):
    batch: Step | None = None  # the ledger's record of this step

    def __post_init__(self):
        # vLLM's check names the head sizes of its own MLA kernels; kvattn's readers take any.
        pass


class KVAttnMLAMetadataBuilder(MLACommonMetadataBuilder[KVAttnMLAMetadata]):
    # Every request is a "decode" of however many new tokens it has: all of them reach
    # forward_mqa, none the MHA prefill that reads earlier context past the backend.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    reorder_batch_threshold: int = 1 << 30
    # The ledger fills each step's tables on the host into fresh tensors (as the MHA builder).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(
            kv_cache_spec, layer_names, vllm_config, device, metadata_cls=KVAttnMLAMetadata
        )
        self.layer_names = list(layer_names)
        self.state = integration.attach(
            vllm_config, self.layer_names, kv_cache_spec.block_size, check=True, layout="mla"
        )
        # vLLM's cache write names no layer; each impl learns its own here.
        context = vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            context[name].impl.layer_name = name

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.num_prefills:
            raise integration.IntegrationError(
                f"kvattn.integrations.vllm: {metadata.num_prefills} MLA request(s) were "
                "classed as prefills, whose earlier context vLLM reads past the backend"
            )
        metadata.batch = self.state.step_batch(common_attn_metadata, self.layer_names[0])
        return metadata


class KVAttnMLAImpl(MLACommonImpl[KVAttnMLAMetadata]):
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap,
        attn_type: str,
        kv_sharing_target_layer_name,
        **mla_args,
    ) -> None:
        unsupported = []
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type {attn_type!r}")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype!r} with MLA")
        if alibi_slopes is not None or sliding_window or logits_soft_cap:
            unsupported.append("ALiBi, a sliding window or a logit soft-cap with MLA")
        if mla_args.get("indexer") is not None:
            unsupported.append("sparse MLA (an indexer)")
        if unsupported:
            raise integration.IntegrationError(
                "kvattn.integrations.vllm does not support " + ", ".join(unsupported)
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        self.supports_quant_query_input = False
        self.layer_name: str | None = None  # set by the builder
        self.vllm_config = get_current_vllm_config()

    def _state(self) -> integration.WorkerOwnership:
        return integration.running_state(self.vllm_config)

    def _latent(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as kvattn's MLA pool ``[num_blocks, block_size, 1, dims]`` (a view)."""
        return kv_cache.unsqueeze(2) if kv_cache.dim() == 3 else kv_cache.transpose(1, 2)

    def _pools(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and its RoPE key as the two column views a K/V pool's code reads."""
        latent = self._latent(kv_cache)
        return latent[..., : self.kv_lora_rank], latent[..., self.kv_lora_rank :]

    def do_kv_cache_update(
        self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale
    ) -> None:
        state = self._state()
        step = state.batch_of(self.layer_name)
        if step is None or kv_cache.numel() == 0:  # a dummy run: no request owns anything
            return
        latent, rope = self._pools(kv_cache)
        step.write(
            self.layer_name,
            kv_c_normed.reshape(-1, 1, self.kv_lora_rank),
            k_pe.reshape(-1, 1, rope.shape[-1]),
            latent,
            rope,
            slot_mapping,
            state.layer_tags(self.layer_name),
        )

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        attn_metadata.batch.attend_mla(
            layer.layer_name,
            q,
            self._latent(kv_c_and_k_pe_cache),
            self._state().layer_tags(layer.layer_name),
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            out=out,
        )
        return out, None

    def forward_mha(self, *args, **kwargs):
        raise integration.IntegrationError(
            "kvattn.integrations.vllm: vLLM's MLA prefill path was called; kvattn's MLA "
            "backend reads every token through the absorbed path"
        )


class KVAttnMLABackend(MLACommonBackend):
    """MLA attention over vLLM's latent cache, ownership-checked by kvattn."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_PAGE_SIZE

    @staticmethod
    def get_impl_cls() -> type[KVAttnMLAImpl]:
        return KVAttnMLAImpl

    @staticmethod
    def get_builder_cls() -> type[KVAttnMLAMetadataBuilder]:
        return KVAttnMLAMetadataBuilder

"""The vLLM attention backends that :func:`kvattn.integrations.vllm.register` puts in place of
vLLM's attention: vLLM's cache read by views, KV written by :func:`kvattn.write_kv`, attention by
:func:`kvattn.paged_extend` / :func:`kvattn.paged_decode` on vLLM's own block table and lengths,
checked against the owners of :class:`kvattn.integrations.vllm.WorkerOwnership`.

Two classes, one per cache layout (vLLM 0.32's ``KVCacheLayout``, resolved once per engine from
what its backends declare; a layer's ``kv_cache`` is always the logical view ``[num_blocks,
kv_heads, block_size, 2 * head_dim]``, K then V in each row, with the layout's strides):

- :class:`KVAttnBackend`, vLLM's CPU layout ``LBHNC`` (head-major blocks), in the slot of vLLM's
  CPU attention;
- :class:`KVAttnGPUBackend`, vLLM's standard GPU layout ``LBNHC`` (token-major blocks, what
  FlashAttention and Triton attention get on CUDA), chosen for every decoder layer on vLLM's CUDA
  platform and, with ``KVATTN_VLLM_LAYOUT=gpu``, in the CPU slot on vLLM's CPU platform.

Either way K and V are NHD views of the layer's cache, no copy, and kvattn's ``auto`` backend
picks the kernels by the device of the tensors (on a GPU the CUDA or Triton ones). The ledger,
the hooks and the failure path are the same.

Imported by vLLM (through the registry path) only in processes that run the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..layout import MAX_PAGE_SIZE
from . import vllm as integration
from .ledger import Step


class KVAttnBackend(AttentionBackend):
    """Decoder attention over vLLM's paged cache, ownership-checked by kvattn."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *integration.FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        # The slot of vLLM's CPU backend: code that branches on the name sees the cache layout
        # it expects.
        return "CPU_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_PAGE_SIZE

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # [num_blocks, kv_heads, block_size, 2 * head_dim] per layer, as vLLM's CPU backend: the
        # K and V halves are HND pages, which kvattn reads as transposed NHD views.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[KVAttnImpl]:
        return KVAttnImpl

    @staticmethod
    def get_builder_cls() -> type[KVAttnMetadataBuilder]:
        return KVAttnMetadataBuilder


@dataclass
class KVAttnMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [num_slots] int64, -1 = padding
    decode_only: bool
    batch: Step  # the ledger's record of this step (its tables, owners and reports)


class KVAttnMetadataBuilder(AttentionMetadataBuilder[KVAttnMetadata]):
    # The ledger fills each step's tables and owners on the host into fresh tensors, which a
    # replayed CUDA graph would not read: vLLM must not capture the attention
    # (kvattn.integrations.vllm refuses CUDA graphs at setup besides).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    layout: ClassVar[str] = "cpu"  # kvattn.integrations.vllm.LAYOUTS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layer_names = list(layer_names)
        self.state = integration.attach(
            vllm_config, self.layer_names, kv_cache_spec.block_size, check=True, layout=self.layout
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVAttnMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        return KVAttnMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc[: num_reqs + 1],
            seq_lens=common.seq_lens[:num_reqs],
            slot_mapping=common.slot_mapping,
            decode_only=common.max_query_len == 1,
            batch=self.state.step_batch(common, self.layer_names[0]),
        )


class KVAttnImpl(AttentionImpl[KVAttnMetadata]):
    # How fp8 KV is rounded into the cache: vLLM's CPU writer's rule (None: no fp8 cache).
    fp8_rounding: ClassVar[str | None] = "toward_zero"
    layout_name: ClassVar[str] = "vLLM's CPU cache layout"

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
    ) -> None:
        # Sliding window, soft-cap, ALiBi and sinks are score switches of kvattn's kernels with
        # vLLM's own definitions (kvattn.variants): vLLM's window W is the query and the W - 1
        # keys before it.
        unsupported = ["kv_sharing_target_layer_name"] if kv_sharing_target_layer_name else []
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type {attn_type!r}")
        fp8 = self.fp8_rounding is not None and kv_cache_dtype in integration.FP8_CACHE_DTYPES
        if kv_cache_dtype != "auto" and not fp8:
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype!r} on {self.layout_name}")
        if unsupported:
            raise integration.IntegrationError(
                "kvattn.integrations.vllm does not support " + ", ".join(unsupported)
            )
        # vLLM's CPU cache of an fp8 model is uint8 bytes of this format, one per-tensor scale
        # per layer (``layer._k_scale_float``); None: the model's dtype.
        self.fp8 = integration.FP8_CACHE_DTYPES.get(kv_cache_dtype)
        self.window_left = sliding_window - 1 if sliding_window else -1
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.alibi_slopes = (
            None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        )
        # The layer's parameter, loaded after this constructor: read (as float32) at each call.
        self.sinks = sinks
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        # The layers are built under the engine's configuration, the object the runner and the
        # builders share: the key of the worker's ownership state.
        self.vllm_config = get_current_vllm_config()

    def _state(self) -> integration.WorkerOwnership:
        return integration.running_state(self.vllm_config)

    def _pools(self, kv_cache: torch.Tensor):
        """K and V pools as NHD views ``[num_blocks, block_size, kv_heads, head_dim]`` of vLLM's
        ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` layer cache (its uint8 bytes as the
        fp8 format for an fp8 cache). The view is logical: the strides of either layout, head-
        or token-major, carry over, so the same views serve both."""
        d = self.head_size
        if self.fp8 is not None:
            kv_cache = kv_cache.view(self.fp8)
        return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)

    def _scales(self, layer) -> dict:
        """The fp8 cache's dequantisation scales, vLLM's per layer (none for a plain cache)."""
        if self.fp8 is None:
            return {}
        return dict(k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float))

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        state = self._state()
        step = state.batch_of(layer.layer_name)
        if step is None:  # a dummy run (profiling, warm-up): no request owns anything
            return
        k_pages, v_pages = self._pools(kv_cache)
        # Into an fp8 cache with vLLM's CPU rounding (toward zero): the bytes vLLM's own writer
        # would store.
        rounding = {} if self.fp8 is None else dict(fp8_rounding=self.fp8_rounding)
        step.write(
            layer.layer_name,
            key,
            value,
            k_pages,
            v_pages,
            slot_mapping,
            state.layer_tags(layer.layer_name),
            **self._scales(layer),
            **rounding,
        )

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise integration.IntegrationError(
                "kvattn.integrations.vllm does not support fused output quantization"
            )
        if attn_metadata is None:  # profiling run
            return output
        state = self._state()
        n = attn_metadata.num_actual_tokens
        k_pages, v_pages = self._pools(kv_cache)
        sinks = None if self.sinks is None else self.sinks.to(torch.float32)
        alibi = None if self.alibi_slopes is None else self.alibi_slopes.to(query.device)
        attn_metadata.batch.attend(
            layer.layer_name,
            query[:n],
            k_pages,
            v_pages,
            state.layer_tags(layer.layer_name),
            scale=self.scale,
            out=output[:n].view(n, self.num_heads, self.head_size),
            window_left=self.window_left,
            logits_soft_cap=self.logits_soft_cap,
            sinks=sinks,
            alibi_slopes=alibi,
            **self._scales(layer),
        )
        return output


# -- vLLM's standard GPU cache layout ---------------------------------------------------------


class KVAttnGPUMetadataBuilder(KVAttnMetadataBuilder):
    layout: ClassVar[str] = "gpu"


class KVAttnGPUImpl(KVAttnImpl):
    # vLLM's CUDA cache writer rounds fp8 its own way, which no GPU has compared with kvattn's
    # writer: an fp8 cache is refused on this layout.
    fp8_rounding: ClassVar[str | None] = None
    layout_name: ClassVar[str] = "vLLM's GPU cache layout"


class KVAttnGPUBackend(KVAttnBackend):
    """:class:`KVAttnBackend` on vLLM's standard GPU cache layout: token-major blocks
    (``LBNHC``, vLLM 0.32's first preference when no backend declares one, which FlashAttention
    and Triton attention read as ``kv_cache.transpose(1, 2).split(head_size, -1)``), so K and V
    are ``[num_blocks, block_size, kv_heads, head_dim]`` views whose (token, head) rows sit side
    by side, ``2 * head_dim`` apart. No fp8 cache, no KV connector, no CUDA graphs (refused at setup)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # A layer looks its backend up by this name among vLLM's (kvattn.integrations.vllm
        # registers it).
        return integration.GPU_BACKEND_NAME

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # The architectures kvattn's CUDA module is built for (sm_80 code runs on every 8.x);
        # no other has been built or compiled for (docs/backends.md).
        return capability.major in (8, 9)

    @staticmethod
    def get_impl_cls() -> type[KVAttnGPUImpl]:
        return KVAttnGPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVAttnGPUMetadataBuilder]:
        return KVAttnGPUMetadataBuilder

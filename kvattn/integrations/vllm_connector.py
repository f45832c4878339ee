"""vLLM's debug KV connector (``ExampleConnector``: KV moves between a prefill and a decode instance
through files) with a receiver that accounts for what arrived.

Select it in the decode instance's ``kv_transfer_config``::

    {"kv_connector": "CheckedExampleConnector",
     "kv_connector_module_path": "kvattn.integrations.vllm_connector",
     "kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": DIR}}

The sender's side is vLLM's own. On the receiving side each layer's file holds the K/V rows the
sender actually wrote; the receiver stores those rows, in order, into the first slots the
scheduler reserved for the request (never more: vLLM's own loader would broadcast a short file over
every slot), and, when kvattn's attention is active (``KVATTN_VLLM=1``), marks them WRITTEN with
:func:`kvattn.commit_pages` by the number of rows it stored. The slots the sender claimed but never
sent stay RESERVED, so a decode over them fails the ownership check instead of reading another
request's KV (docs/ownership.md section 4, "commit").
"""
from __future__ import annotations

import logging

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector, ExampleConnectorMetadata)

from . import vllm as integration

logger = logging.getLogger("kvattn")


class CheckedExampleConnector(ExampleConnector):
    """``ExampleConnector`` whose loads store only the rows that arrived and commit them."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleConnectorMetadata):
            raise TypeError(f"connector metadata: expected ExampleConnectorMetadata, got "
                            f"{type(metadata).__name__}")
        if forward_context.attn_metadata is None:
            return
        state = integration.state_for(self._vllm_config)
        for request in metadata.requests:
            if request.is_store:
                continue
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                if kv_cache is None:
                    continue
                filename = self._generate_filename_debug(layer_name, request.token_ids,
                                                         request.mm_hashes)
                rows = safetensors.torch.load_file(filename)["kv_cache"]
                arrived = min(rows.shape[0], request.slot_mapping.shape[0])
                slots = request.slot_mapping[:arrived].to(torch.int64)
                if arrived < request.slot_mapping.shape[0]:
                    logger.warning("kvattn: %s: %d of the %d claimed KV rows arrived",
                                   layer_name, arrived, request.slot_mapping.shape[0])
                blocks = torch.div(slots, self._block_size, rounding_mode="floor")
                kv_cache[blocks, :, slots - blocks * self._block_size] = rows[:arrived].to(
                    kv_cache.device, kv_cache.dtype)
                if state is not None:
                    state.commit_received(layer_name, slots)

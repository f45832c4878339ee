"""vLLM's KV connectors with a receiver that accounts for what arrived: the debug connector
(``CheckedExampleConnector``: KV moves between a prefill and a decode instance through files) and
NIXL (``CheckedNixlConnector``: the decode instance reads the prefill instance's blocks over
UCX/RDMA, vLLM's production path).

Select the debug one in the decode instance's ``kv_transfer_config``::

    {"kv_connector": "CheckedExampleConnector",
     "kv_connector_module_path": "kvattn.integrations.vllm_connector",
     "kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": DIR}}

Its sender is vLLM's own. On the receiving side each layer's file holds the K/V rows the sender
actually wrote; the receiver stores those rows, in order, into the first slots the
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
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from ..transfer import DigestKey
from . import vllm as integration

logger = logging.getLogger("kvattn")


class CheckedExampleConnector(ExampleConnector):
    """``ExampleConnector`` whose loads store only the rows that arrived and commit them."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleConnectorMetadata):
            raise TypeError(
                f"connector metadata: expected ExampleConnectorMetadata, got "
                f"{type(metadata).__name__}"
            )
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
                filename = self._generate_filename_debug(
                    layer_name, request.token_ids, request.mm_hashes
                )
                rows = safetensors.torch.load_file(filename)["kv_cache"]
                arrived = min(rows.shape[0], request.slot_mapping.shape[0])
                slots = request.slot_mapping[:arrived].to(torch.int64)
                if arrived < request.slot_mapping.shape[0]:
                    logger.warning(
                        "kvattn: %s: %d of the %d claimed KV rows arrived",
                        layer_name,
                        arrived,
                        request.slot_mapping.shape[0],
                    )
                blocks = torch.div(slots, self._block_size, rounding_mode="floor")
                kv_cache[blocks, :, slots - blocks * self._block_size] = rows[:arrived].to(
                    kv_cache.device, kv_cache.dtype
                )
                if state is not None:
                    state.commit_received(layer_name, slots)


ATTESTATION_KEY = "kvattn_pages"
DIGEST_KEY = "kvattn_digest_key"


def _digest_key(value) -> DigestKey | None | bool:
    """The digest key a sender put in ``kv_transfer_params``: None for keyless digests, False
    for a value that is not one (its request's blocks then verify nothing)."""
    if value is None:
        return None
    try:
        return DigestKey.from_hex(value)
    except ValueError:
        return False


class CheckedNixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull: the decode instance reads the prefill instance's blocks)
    whose sender attests its pages and whose receiver commits only what it verified.

    Select it on both instances (``KVATTN_VLLM=1`` on both)::

        {"kv_connector": "CheckedNixlConnector",
         "kv_connector_module_path": "kvattn.integrations.vllm_connector",
         "kv_role": "kv_producer" | "kv_consumer", "kv_buffer_device": "cpu"}

    The prefill side's worker attests every block of a request it prefilled for remote decode
    (:func:`kvattn.transfer.attest_pages` under the request's lease, in the context of its
    prompt: what its own tags say the blocks hold, not its scheduler's token count); the
    attestation goes to the scheduler with the step's output, and this connector puts it in the
    request's ``kv_transfer_params`` (key ``ATTESTATION_KEY``, aligned with
    ``remote_block_ids``), with the key of its digests (``DIGEST_KEY``: hex, drawn by the sender
    once the prompt's bytes are written, per request; None where the digests are keyless,
    :meth:`kvattn.transfer.DigestKey.for_pools`). The decode side, when NIXL reports a request's
    reads complete (and not failed), verifies each local block's bytes against the attestation
    of the block it was read from, with that key, in the context of its own prompt, and commits
    it by the attested length when the request's lease is made (the digests run on kvattn's
    transfer thread, off the step, and the request is reported received only once they are
    done); a block whose read failed, whose bytes or tokens differ, that has no attestation, or
    whose remote list does not line up with the local blocks stays RESERVED, so a decode over it
    fails that request only. A remote block list shorter than the local one (a prefill that sent
    less than it owes) is read into the first blocks it covers instead of stopping the worker
    (vLLM asserts there), and the rest stays unread and RESERVED. A read that completes after
    its request ended is dropped.

    ``kv_connector_extra_config={"kvattn_check_bytes": False}`` (on both instances) turns the
    digests off: the sender attests lengths only and the receiver commits by them, which keeps the
    ownership half of the check and drops the bytes half (``docs/transfer.md``).
    """

    def _check_bytes(self) -> bool:
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return bool(extra.get("kvattn_check_bytes", True))

    # -- prefill side (scheduler role) ---------------------------------------------------------

    def request_finished(self, request, block_ids):
        return self._attested(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._attested(request, super().request_finished_all_groups(request, block_ids))

    def _attested(self, request, result):
        delay, params = result
        attested = integration.take_attestation(self._vllm_config, request.request_id)
        if params and params.get("do_remote_prefill"):
            blocks = params["remote_block_ids"][0] if params.get("remote_block_ids") else []
            by_block = attested["blocks"] if attested is not None else None
            pages = None if by_block is None else [by_block.get(b) for b in blocks]
            key = attested["key"] if attested is not None else None
            params = {**params, ATTESTATION_KEY: pages, DIGEST_KEY: key}
        return delay, params

    # -- decode side (scheduler role): the attestation goes to the worker with the request -----

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and params.get("do_remote_prefill"):
            self._for_worker[request.request_id] = (
                params.get(ATTESTATION_KEY),
                list(request.prompt_token_ids or ()),
                params.get(DIGEST_KEY),
            )
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        metadata = super().build_connector_meta(scheduler_output)
        for req_id, meta in metadata.reqs_to_recv.items():
            meta.kvattn_pages, meta.kvattn_tokens, meta.kvattn_key = self._for_worker.pop(
                req_id, (None, [], None)
            )
        for req_id in scheduler_output.finished_req_ids:
            self._for_worker.pop(req_id, None)
        return metadata

    @property
    def _for_worker(self) -> dict:
        """Request id -> (attestation, prompt tokens, digest key hex), from allocation to the
        worker's metadata."""
        if "_kvattn_for_worker" not in self.__dict__:
            self.__dict__["_kvattn_for_worker"] = {}
        return self.__dict__["_kvattn_for_worker"]

    # -- decode side (worker role) ---------------------------------------------------------------

    @property
    def _receiving(self) -> set:
        """Requests whose reads this worker started and whose request has not ended."""
        if "_kvattn_receiving" not in self.__dict__:
            self.__dict__["_kvattn_receiving"] = set()
        return self.__dict__["_kvattn_receiving"]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for req_id, meta in self._connector_metadata.reqs_to_recv.items():
            if meta.remote is None:
                continue
            first = meta.local_num_computed_blocks or (0,) * len(meta.local_block_ids)
            local = list(meta.local_block_ids)
            for g, (mine, theirs) in enumerate(zip(local, meta.remote.block_ids)):
                # vLLM reads remote[-len(local):] into the local blocks after a local prefix hit
                # of first[g] blocks; a list shorter than that would stop its receiver.
                if len(theirs) < first[g] + len(mine):
                    logger.warning(
                        "kvattn: request %s: the prefill instance offers %d block(s) "
                        "for %d; the rest stay unread",
                        req_id,
                        len(theirs),
                        first[g] + len(mine),
                    )
                    local[g] = list(mine)[: max(0, len(theirs) - first[g])]
            meta.local_block_ids = tuple(local)
            if meta.awaiting_kvs:
                self._receiving.add(req_id)
        super().start_load_kv(forward_context, **kwargs)

    @property
    def _verifying(self) -> dict:
        """Requests whose reads completed and whose digests run on kvattn's transfer thread:
        request id -> (future, first logical block, local blocks)."""
        if "_kvattn_verifying" not in self.__dict__:
            self.__dict__["_kvattn_verifying"] = {}
        return self.__dict__["_kvattn_verifying"]

    def get_transfer_results(self, finished_req_ids):
        receiving = dict(self.connector_worker._recving_metadata)
        results = super().get_transfer_results(finished_req_ids)
        self._receiving.difference_update(finished_req_ids)
        state = integration.state_for(self._vllm_config)
        if state is None:
            return results
        self._start_verifying(state, results, receiving)
        # A request is reported received only once its digests are done, so no forward reads a
        # block before its verification; one that ended meanwhile commits nothing.
        for req_id, (future, first, local) in list(self._verifying.items()):
            if req_id not in finished_req_ids and not future.done():
                results.finished_recving.discard(req_id)
                continue
            del self._verifying[req_id]
            results.finished_recving.add(req_id)
            if req_id in finished_req_ids:
                continue
            notes = state.received(req_id, first, local, *future.result())
            if notes:
                logger.warning(
                    "kvattn: request %s: %d received block(s) not committed: %s",
                    req_id,
                    len(notes),
                    "; ".join(notes[:8]),
                )
        return results

    def _start_verifying(self, state, results, receiving) -> None:
        for req_id in results.finished_recving - results.failed_recving:
            meta = receiving.get(req_id)
            if req_id not in self._receiving or meta is None or meta.remote is None:
                continue  # a late read of an ended request: dropped
            self._receiving.discard(req_id)
            local, remote = list(meta.local_block_ids[0]), list(meta.remote.block_ids[0])
            first = meta.local_num_computed_blocks[0] if meta.local_num_computed_blocks else 0
            attested = getattr(meta, "kvattn_pages", None)
            # Local block j holds logical block first + j only when the remote list covers the
            # prompt's blocks exactly (vLLM tail-aligns it otherwise).
            lined_up = isinstance(attested, list) and len(remote) == first + len(local) == len(
                attested
            )
            claims = attested[first:] if lined_up else None
            key = _digest_key(getattr(meta, "kvattn_key", None))
            if key is False:  # a malformed key: nothing it covers verifies
                claims, key = None, None
            try:
                future = state.receive_async(
                    req_id,
                    first,
                    local,
                    claims,
                    getattr(meta, "kvattn_tokens", []),
                    check_bytes=self._check_bytes(),
                    key=key,
                )
            except ValueError as e:
                if key is None:
                    raise
                # A key for blocks this instance cannot digest keyed (laid out unlike the
                # sender's): nothing of the request is committed.
                logger.warning("kvattn: request %s: %s", req_id, e)
                future = state.receive_async(
                    req_id, first, local, None, [], check_bytes=self._check_bytes()
                )
            self._verifying[req_id] = (future, first, local)

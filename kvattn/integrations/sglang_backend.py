"""The SGLang attention backend that ``--attention-backend kvattn`` selects, and the plugin entry
point that registers it (:func:`register`): SGLang's MHA pool read by views, KV written
through the pool's ``set_kv_buffer`` (which the ledger routes to :func:`kvattn.write_kv`),
attention by :func:`kvattn.paged_extend` / :func:`kvattn.paged_decode` on the block table the
ledger reads off ``req_to_token``, checked against the owners of
:class:`kvattn.integrations.sglang.SGLangOwnership`; under SGLang's decode CUDA graphs, on the
ledger's fixed buffers, refilled on the host before each replay.

Imported by SGLang's plugin loader (the ``sglang.srt.plugins`` entry point), so only where SGLang
is installed.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from . import sglang as integration
from . import sglang_hicache, sglang_transfer


class KVAttnSGLangBackend(AttentionBackend):
    """Decoder attention over SGLang's token pool, ownership-checked by kvattn."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.state = integration.attach(model_runner)
        forward = model_runner.forward

        def forward_hook(*args, **kwargs):
            batch = kwargs.get("forward_batch", args[0] if args else None)
            self.state.start_forward()
            try:
                return forward(*args, **kwargs)
            finally:
                self.state.end_forward(batch)

        # The scheduler reads the requests' state after the runner's forward: a request failed
        # here is aborted before its token is processed.
        model_runner.forward = forward_hook

    def init_forward_metadata(self, forward_batch):
        """An eager forward (SGLang's default calls the two graph halves below instead)."""
        self.state.begin_forward(forward_batch)

    # SGLang's decode CUDA graphs (DecodeCudaGraphRunner): fixed buffers allocated once, every
    # row padding while a graph is captured, the batch resolved on the host into the buffers
    # before each replay, the forward's sums zeroed inside the graph, the report read after the
    # forward as for an eager one (:meth:`SGLangOwnership.end_forward`).

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.state.allocate_graph_buffers(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if in_capture:
            self.state.capture_forward(forward_batch)
        else:
            self.state.replay_forward(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.state.graph_run()

    def get_cuda_graph_seq_len_fill_value(self):
        # SGLang's own padded rows (positions, its seq_lens) get 1, as for its Triton backend;
        # kvattn's buffers give a padded row length 0 whatever this is.
        return 1

    def _refuse(self, layer) -> None:
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            raise integration.IntegrationError(
                f"kvattn.integrations.sglang supports decoder self-attention only, got layer "
                f"{layer.layer_id} of type {layer.attn_type}"
            )

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, q_rope=None, k_rope=None):
        self._refuse(layer)
        loc = KVWriteLoc.for_batch(forward_batch)
        if k_rope is not None:  # an MLA latent row handed over as its two parts
            if save_kv_cache:
                self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)
        elif save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        if q_rope is not None:
            q = q.reshape(-1, layer.tp_q_head_num, layer.v_head_dim)
            q = torch.cat([q, q_rope.reshape(q.shape[0], q.shape[1], -1)], dim=-1)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        self.state.attend(q, layer, out)
        return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(
        self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None, **kw
    ):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def forward_decode(
        self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None, **kw
    ):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def support_triton(self):
        return False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point; SGLang calls it in every process it starts.

    Adds ``kvattn`` to SGLang's attention backends and to the ``--attention-backend`` choices, and
    hooks that act only on engines whose backend is kvattn's: the decode side's transfer commit,
    the transfer attestation on the prefill -> decode channel
    (:mod:`kvattn.integrations.sglang_transfer`), HiCache's backups attested and its load-backs
    verified (:mod:`kvattn.integrations.sglang_hicache`), models' fused rotary-and-KV writes (which would
    bypass the pool's ``set_kv_buffer``) turned off, beam requests refused. A version of SGLang
    other than a tested one is refused when
    ``kvattn`` is selected, with the reason, so that installing kvattn breaks no other backend.
    Idempotent.
    """
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    name = integration.BACKEND_NAME
    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])
    if name in ATTENTION_BACKENDS:
        return
    register_attention_backend(name)(create_backend)
    # The hooks' targets must be imported for HookRegistry to find them; each hook acts only on
    # an engine whose backend is kvattn's.
    import sglang.srt.beam_search.coordinator  # noqa: F401
    import sglang.srt.disaggregation.common.conn  # noqa: F401
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401
    import sglang.srt.managers.cache_controller  # noqa: F401
    import sglang.srt.managers.scheduler_components.batch_result_processor  # noqa: F401
    import sglang.srt.mem_cache.allocation  # noqa: F401
    import sglang.srt.models.utils  # noqa: F401
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in (
        (
            "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
            integration.commit_transfer_hook,
        ),
        ("sglang.srt.models.utils.enable_fused_set_kv_buffer", integration.fused_write_hook),
        ("sglang.srt.mem_cache.allocation.get_last_loc", integration.last_loc_hook),
        (
            "sglang.srt.beam_search.coordinator.BeamCoordinator.validate_and_init",
            integration.beam_hook,
        ),
        (
            "sglang.srt.managers.scheduler_components.batch_result_processor."
            "SchedulerBatchResultProcessor._normalize_decode_outputs",
            integration.decode_outputs_hook,
        ),
        *sglang_transfer.HOOKS,
        *sglang_hicache.HOOKS,
    ):
        HookRegistry.register(target, hook, HookType.AROUND)


def create_backend(runner):
    """SGLang's factory for ``--attention-backend kvattn``."""
    integration.check_version()
    return KVAttnSGLangBackend(runner)


__all__ = ["KVAttnSGLangBackend", "create_backend", "register"]

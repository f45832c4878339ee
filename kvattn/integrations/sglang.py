"""kvattn as an attention backend of SGLang, loaded through SGLang's plugin entry point.

Usage: install kvattn next to SGLang and start the server with ``--attention-backend kvattn``,
on CUDA with ``--disable-prefill-cuda-graph`` (decode CUDA graphs run; see below). SGLang loads
the ``sglang.srt.plugins`` entry point ``kvattn`` in every process it starts;
:func:`kvattn.integrations.sglang_backend.register` adds the ``kvattn`` choice to SGLang's
attention registry and hooks that act only on engines whose backend is kvattn's, so an engine
that does not ask for it is unchanged. A request whose KV fails the ownership check is
ended with ``FINISH_ABORT`` (an error status, never an answer), and a message naming the check,
the layers, pages and reasons is logged (logger ``kvattn``); the other requests of the batch go
on.

Tested with SGLang ``SUPPORTED_VERSIONS``: its engine and HTTP server (one server, and a
prefill/decode pair over Mooncake) and its own classes; the decode graphs' capture and replay
metadata on this CPU only, through SGLang's own graph buffers, padding fill and replay view
(no graph has been captured on a GPU); other versions are refused when the
backend is asked for, because the hooks below follow private parts of SGLang.

What kvattn follows, and where (all on the instances of the engine whose backend is kvattn's):

- **Pages and tags.** SGLang's MHA pool keeps per layer ``[size + page_size, kv_heads, head_dim]``
  token slots, K and V apart; slot ``t`` is slot ``t % page_size`` of page ``t // page_size``, so
  the buffers are kvattn's NHD pools by views. Page 0 is SGLang's padding page (dummy writes); it
  is never handed to a request and its tag stays FREE. One ``[num_layers, num_pages]`` tag array.
- **Leases follow the request pool.** ``ReqToTokenPool.alloc`` binds a row of ``req_to_token`` to a
  request: the row gets a lease (a new owner id) for as long as the request holds it (a retracted
  request that comes back gets a new one). At each forward the ledger reads the rows of the batch
  (``req_to_token``, one host read per forward) and compares them with what each lease holds:
  a page at a position of the request's new tokens is its own (reserved for its owner before the
  forward writes it); a page at a position SGLang reports as already computed
  (``extend_prefix_lens``) that the lease does not hold is a radix-cache hit, expected to carry
  the owner that wrote it only if the writer's token prefix through that page is the reader's own,
  in the reader's own domain (its ``extra_key``, LoRA id and cache salt:
  :func:`~kvattn.integrations.ledger.cache_domain`), else owner 0, which no page carries (fails
  closed).
  The token ids behind the digests are the forwards' own input ids (under overlap scheduling a
  request's ``output_ids`` lag its forward by a token).
  A row whose slots of one logical page do not lie in one page at their offsets is read as no page
  (``OUT_OF_RANGE``).
- **Writes**: the pool's ``set_kv_buffer`` (every write of the engine, the backend's and a model's
  own) goes through :func:`kvattn.write_kv` at SGLang's slot indices under each token's request
  owner: a write into a page the request does not hold is dropped. Models whose rotary kernel
  would store K/V itself (``enable_fused_set_kv_buffer``) write through the pool instead.
- **Release**: when SGLang's allocator frees pages (a finished request's tail, the radix cache's
  evictions), the ledger releases them owner-scoped; a page the radix cache keeps stays WRITTEN.
- **Prefill/decode disaggregation** (:mod:`kvattn.integrations.sglang_transfer`): a kvattn
  prefill instance attests each page it sends from its own tags (written length, digest of the
  bytes in the context of the request's tokens) and sends the attestation on SGLang's own status
  channel just before the transfer's Success. When the decode side's transfer queue commits a
  finished transfer (``DecodeTransferQueue._commit_transfer_to_req``), the request's pages are
  reserved for its lease and committed page by page at the lengths verified against its own
  copy; a page without a verified attestation (a stock prefill's, a placeholder's missing pages,
  bytes that differ) stays RESERVED, and the request fails at attention, saying why. SGLang's
  fake backend moves no bytes: nothing is committed and its "success" is refused.
- **Hierarchical cache** (:mod:`kvattn.integrations.sglang_hicache`): a page HiCache backs up to
  host memory is attested for its writer when the copy completes; a page it loads back becomes
  readable only once verified against that attestation (else it stays FREE and its reader fails).
- **Decode CUDA graphs** (SGLang's ``full`` decode graphs, its default on CUDA): the backend
  implements SGLang's contract (``init_cuda_graph_state``, ``init_forward_metadata_out_graph``
  at capture and before every replay, ``init_forward_metadata_in_graph`` inside the graph,
  ``get_cuda_graph_seq_len_fill_value``). The block table, expected owners, lengths, per-token
  owners, padding mask and per-request sums live in fixed buffers allocated once for the largest
  captured batch (:class:`~kvattn.integrations.ledger.GraphBuffers`); a graph is captured with
  every row padding, and before each replay the ledger resolves the live batch on the host, as
  for an eager forward, into those buffers. The captured kernels read them (``validate=False``,
  the step's verdict resolved inside the graph, the sums zeroed inside it); the report is read
  once after the forward, as for an eager one. SGLang pads a batch to a captured size with
  request-pool row 0 and its fill length: kvattn gives those rows length 0 and no write, so
  they read nothing, write nothing and are never a request's failure. After each forward the
  owners the fill wrote are set back to 0, which no page carries, so a replay whose refill did
  not happen reads nothing and writes nothing; the runner's forward it ran in then fails each
  of its requests, saying so.
- **Failure**: refused pages and dropped writes are summed per request over the layers of a forward
  in device memory and read once, after the forward; a failed request gets SGLang's own
  ``discard_output_reason`` (a ``FINISH_ABORT``, status 500): the forward's output is dropped
  (after a decode forward, by :func:`decode_outputs_hook`), the request finishes with the error,
  and its KV is not put in the radix cache.

fp8 KV caches (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): the pool's uint8 bytes are read as
kvattn's fp8 pools, written by :func:`kvattn.write_kv` with the layer's scales (a checkpoint's,
else 1), the codes SGLang's own write stores.

MLA models (DeepSeek-style, SGLang's ``MLATokenToKVPool``): the latent row of each token is kept as
two column views (the ``kv_lora_rank`` latent, then the RoPE key), which the pool's
``set_kv_buffer`` and ``set_mla_kv_buffer`` write through :func:`kvattn.write_kv`; every forward
of the model takes SGLang's absorbed MLA path (kvattn's entry in its DeepSeek dispatch), whose
reads are :func:`kvattn.paged_mla_extend` / :func:`kvattn.paged_mla_decode` over the latent pool,
checked as above; in prefill/decode disaggregation the latent rows are attested and verified
as K and V are; under decode CUDA graphs the MLA decode reads the graph's buffers as the MHA
decode does; HiCache's host copies of latent rows are attested and verified as K/V pages are.
fp8 latent caches, DSA and decode-context-parallel pools are refused.

Speculative decoding with SGLang's n-gram proposer: a verify forward (``TARGET_VERIFY``) is an
extend of each request's draft tokens, read under their tree mask (:func:`verify_mask`); the rows
SGLang moves into place after acceptance (the pool's ``move_kv_cache``) move only within pages the
same owner holds (:meth:`SGLangOwnership._moves`); the next forward takes the slots' token ids
from the request's accepted ones.

Not supported (refused at setup, saying why): a prefill or decode phase on another attention
backend (its reads would be unchecked), hybrid (SWA, linear), sparse and quantized KV pools
(scale buffers: FP4, MXFP8), HND layouts, speculative decoding but n-gram's, prefill CUDA graphs (breakable
or full), breakable decode graphs, decode graphs with torch.compile, LoRA, two-batch overlap,
PD multiplexing or SGLang's metadata glue graph, CPU graphs (torch.compile on ``--device cpu``),
DP attention, encoder-decoder and cross attention; in prefill/decode disaggregation, transfer
backends other than ``mooncake`` and ``fake``, tensor and pipeline parallelism, staging buffers;
HiCache storage backends (L3), buffer-only host memory and HiSparse; beam-search requests are
refused one by one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from .. import backends
from ..tags import STATE_WRITTEN, held_by, tag_owner, tag_state, tag_valid_len
from ..transfer import DigestKey, attest_pages, verify_arrived
from . import sglang_transfer
from .ledger import IntegrationError, Lease, Ledger, cache_domain, refuse
from .ledger import check_version as _check_version

logger = logging.getLogger("kvattn")

SUPPORTED_VERSIONS = ("0.5.23",)
BACKEND_NAME = "kvattn"
BACKEND_ENV = "KVATTN_SGLANG_BACKEND"  # the kvattn backend the readers and writers use
# fp8 KV caches (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``), stored by SGLang as uint8 bytes of
# the format and read by kvattn as its fp8 pools.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Transfer backends whose transfers a kvattn decode instance commits: "fake" moves no bytes (and
# commits none); Mooncake's carry the prefill's attestation (kvattn.integrations.sglang_transfer).
TRANSFER_BACKENDS = ("fake", "mooncake")
GLUE_ON = ("true", "1", "yes", "y")
# Speculative decoding: SGLang's n-gram proposer, whose drafts are the request's own tokens'
# continuations (no draft model), verified under their tree mask.
SPECULATIVE_ALGORITHMS = ("NGRAM",)


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless the installed SGLang (or ``version``) is a tested one."""
    if version is None:
        import sglang

        version = sglang.__version__
    _check_version(
        "sglang",
        "SGLang",
        version,
        SUPPORTED_VERSIONS,
        "Install one of those, or choose another --attention-backend.",
    )


def commit_transfer_hook(original, queue, decode_req, *args, **kwargs):
    """Around ``DecodeTransferQueue._commit_transfer_to_req``: the request's transfer finished;
    its pages are committed by what the receiver accounts for. The receiver is taken before the
    original runs, which drops it (``decode_req.kv_receiver = None``)."""
    receiver = decode_req.kv_receiver
    state = _STATES.get(id(queue.scheduler.req_to_token_pool))
    # Taken before the original, which clears the receiver's room (and with it the frames).
    frames = sglang_transfer.take(receiver) if state is not None else None
    result = original(queue, decode_req, *args, **kwargs)
    req = decode_req.req
    if state is not None and not _aborted(req):
        state.commit_transfer(req, receiver, frames)
    return result


def _kvattn_pool(pool) -> bool:
    return any(state.kv_pool is pool for state in _STATES.values())


def fused_write_hook(original, *args, **kwargs):
    """Around ``sglang.srt.models.utils.enable_fused_set_kv_buffer``: models whose rotary kernel
    can store K/V itself (Qwen3-MoE, gpt-oss, ...) do so past ``set_kv_buffer``, and their pages
    would never be stamped; under kvattn they write through the pool instead."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool, has_forward_context

    if has_forward_context() and _kvattn_pool(get_token_to_kv_pool()):
        return False
    return original(*args, **kwargs)


def last_loc_hook(original, req_to_token, *args, **kwargs):
    """Around ``sglang.srt.mem_cache.allocation.get_last_loc``: SGLang takes its Triton kernel for
    every attention backend but ``torch_native`` and ``ascend`` (by name); on a CPU, where Triton
    has no driver, a kvattn engine's speculative allocation takes SGLang's torch twin instead, as
    a ``torch_native`` engine's does."""
    from sglang.srt.runtime_context import attention_backends

    if req_to_token.device.type == "cpu" and BACKEND_NAME in attention_backends():
        from sglang.srt.mem_cache.allocation import get_last_loc_torch

        return get_last_loc_torch(req_to_token, *args, **kwargs)
    return original(req_to_token, *args, **kwargs)


def beam_hook(original, coordinator, req, *args, **kwargs):
    """Around ``BeamCoordinator.validate_and_init``: a beam request's member rows are taken
    without a request (``alloc_rows``), so no lease could hold their pages; refused, saying why."""
    pool = getattr(getattr(coordinator, "tree_cache", None), "req_to_token_pool", None)
    if pool is not None and state_for(pool) is not None:
        return (
            "Beam search is not supported with --attention-backend kvattn (its member rows "
            "are taken without a request, so no ownership lease covers their pages)."
        )
    return original(coordinator, req, *args, **kwargs)


def decode_outputs_hook(original, processor, *args, **kwargs):
    """Around ``SchedulerBatchResultProcessor._normalize_decode_outputs``: SGLang finishes a
    request whose forward must not count (``discard_output_reason``, which the ledger sets) only
    after an extend. After a decode forward the request's sampled token is withheld here and the
    request finishes with the reason, as SGLang does for a token it must not commit."""
    next_token_ids, logprobs = original(processor, *args, **kwargs)
    if state_for(processor.req_to_token_pool) is not None:
        for i, req in enumerate(kwargs["batch"].reqs):
            if req.discard_output_reason is not None and not req.finished():
                next_token_ids[i] = []
                req.to_finish = req.discard_output_reason
    return next_token_ids, logprobs


def _aborted(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT) or isinstance(req.to_finish, FINISH_ABORT)


def received_tokens(receiver) -> tuple[int, str]:
    """How many tokens of a transfer ``receiver`` accounts for as arrived, and how it knows.

    A receiver that counts what arrived says so through ``kvattn_received_tokens()``; SGLang's fake
    receiver moves no bytes (0). Any other receiver reports completion only, which is not an
    account of bytes: 0 (its pages stay unreadable)."""
    count = getattr(receiver, "kvattn_received_tokens", None)
    name = type(receiver).__name__
    if callable(count):
        return int(count()), f"{name} counted {int(count())} token(s) arrived"
    if name == "FakeKVReceiver":
        return 0, "FakeKVReceiver moves no bytes: 0 tokens arrived"
    return 0, f"{name} reports completion, not what arrived: 0 tokens accounted for"


# One ledger per engine in this process, keyed by the id of its request pool, which the scheduler,
# the model runner and the disaggregation queues share.
_STATES: dict[int, SGLangOwnership] = {}
sglang_transfer.use_ledgers(_STATES)


def state_for(req_to_token_pool) -> SGLangOwnership | None:
    return _STATES.get(id(req_to_token_pool))


def state_for_pool(kv_pool) -> SGLangOwnership | None:
    """The ledger whose engine keeps its KV in ``kv_pool`` (a HiCache controller's device pool)."""
    return next((s for s in _STATES.values() if s.kv_pool is kv_pool), None)


def attach(runner) -> SGLangOwnership:
    """The ledger of the engine whose model runner is ``runner`` (created and hooked once)."""
    _refuse_unsupported(runner)
    state = _STATES.get(id(runner.req_to_token_pool))
    if state is None or state.req_pool is not runner.req_to_token_pool:
        state = SGLangOwnership(runner)
        _STATES[id(runner.req_to_token_pool)] = state
        logging.getLogger("sglang.kvattn").info(
            "kvattn: ownership-checked attention (page size %d, kvattn backend %r)",
            state.page_size,
            state.backend,
        )
    return state


def _refuse_unsupported(runner) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    pool = runner.token_to_kv_pool
    args = runner.server_args
    reasons = []
    if type(pool) is MLATokenToKVPool:
        reasons += _mla_refusals(pool, args)
    elif type(pool) is not MHATokenToKVPool:
        reasons.append(
            f"KV pool {type(pool).__name__} (MHATokenToKVPool and MLATokenToKVPool only: "
            f"hybrid, sparse (DSA), quantized and page-major pools are not followed)"
        )
    elif pool.is_quantized_kv_cache:
        reasons.append(
            f"quantized KV cache {type(pool.quant_method).__name__} (its scale buffers are not "
            "followed; plain fp8 e4m3/e5m2 caches are)"
        )
    elif pool.dtype not in (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES):
        reasons.append(
            f"KV cache dtype {pool.dtype} (the model's float dtype, float8_e4m3fn or float8_e5m2)"
        )
    elif pool.kv_cache_layout != "nhd":
        reasons.append(f"KV cache layout {pool.kv_cache_layout!r} ('nhd' only)")
    elif pool.head_dim != pool.v_head_dim:
        reasons.append(f"V head dim {pool.v_head_dim} != K head dim {pool.head_dim}")
    reasons += _phase_refusals(args)
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm:
        name = str(getattr(algorithm, "name", algorithm)).upper()
        if name not in SPECULATIVE_ALGORITHMS:
            reasons.append(
                f"speculative decoding with {name} (supported: "
                f"{', '.join(SPECULATIVE_ALGORITHMS)}, which runs no draft model: a draft "
                "model's own attention and KV are not followed)"
            )
        elif type(pool) is not MHATokenToKVPool:
            reasons.append(
                f"speculative decoding with {type(pool).__name__} (the MLA extend takes no tree "
                "mask)"
            )
        if name in SPECULATIVE_ALGORITHMS and _overlap_scheduling(args):
            reasons.append(
                "speculative decoding with overlap scheduling (the accepted ids would reach "
                "the request a step after the forward that reads them; not run: "
                "--disable-overlap-schedule, as SGLang sets on a CPU)"
            )
        mode = str(getattr(args, "disaggregation_mode", "null")).split(".")[-1].lower()
        if mode in ("prefill", "decode"):
            reasons.append(f"speculative decoding in a {mode} instance (not run)")
    reasons += _graph_refusals(*_graph_backends(args, str(runner.device)), str(runner.device), args)
    if getattr(args, "enable_dp_attention", False):
        reasons.append(
            "DP attention (each data-parallel rank runs idle and padded batches and gathers "
            "the others' tokens; neither is followed, and it has not run here)"
        )
    if getattr(runner.model_config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models (the ledger follows decoder KV only)")
    if getattr(args, "enable_hierarchical_cache", False):
        reasons += _hicache_refusals(args)
    mode = str(getattr(args, "disaggregation_mode", "null")).split(".")[-1].lower()
    transfer = getattr(args, "disaggregation_transfer_backend", "fake")
    if mode in ("prefill", "decode"):
        reasons += _disaggregation_refusals(mode, transfer, args)
    refuse("sglang", reasons)


def verify_mask(mask: torch.Tensor, committed: list[int], drafts: int) -> torch.Tensor:
    """kvattn's ``custom_mask`` (FlashInfer's layout: per request a row-major ``[drafts,
    committed + drafts]`` block) of a verify forward, from SGLang's n-gram tree mask: on a CPU a
    ``[drafts, drafts]`` block per request (True where the column is the row's ancestor or the
    row itself), which reads the whole committed prefix; elsewhere already in that layout."""
    full = sum(drafts * (n + drafts) for n in committed)
    if mask.numel() == full:
        return mask.to(torch.bool)
    if mask.numel() != len(committed) * drafts * drafts:
        raise IntegrationError(
            f"kvattn.integrations.sglang: a tree mask of {mask.numel()} entries for "
            f"{len(committed)} request(s) of {drafts} draft tokens"
        )
    tree = mask.to(torch.bool).view(len(committed), drafts, drafts)
    blocks = [
        torch.cat(
            [torch.ones(drafts, n, dtype=torch.bool, device=mask.device), tree[b]], dim=1
        ).reshape(-1)
        for b, n in enumerate(committed)
    ]
    return torch.cat(blocks)


def _overlap_scheduling(args) -> bool:
    """Whether the engine overlaps scheduling with the forwards: SGLang's resolved setting where
    it was published (a server's processes), else what ``args`` ask for."""
    try:
        from sglang.srt.runtime_context import get_schedule

        return not get_schedule().disable_overlap_schedule
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return not getattr(args, "disable_overlap_schedule", False)


def _phase_refusals(args) -> list[str]:
    """A phase (prefill or decode) given another attention backend than kvattn's: SGLang would
    run that phase's reads of the cache through it, unchecked."""
    reasons = []
    for phase in ("prefill", "decode"):
        chosen = getattr(args, f"{phase}_attention_backend", None)
        if chosen and chosen != BACKEND_NAME:
            reasons.append(
                f"--{phase}-attention-backend {chosen} (that phase would read the KV cache "
                f"unchecked: leave it unset or name {BACKEND_NAME!r})"
            )
    return reasons


def _mla_refusals(pool, args) -> list[str]:
    """What of SGLang's MLA pool kvattn's MLA readers do not follow yet."""
    reasons = []
    if pool.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(
            f"MLA KV cache dtype {pool.dtype} (the model's float dtype: an fp8 latent cache's "
            "scales are not followed)"
        )
    if pool.kv_cache_dim != pool.kv_lora_rank + pool.qk_rope_head_dim:
        reasons.append(
            f"an MLA row of {pool.kv_cache_dim} dims (kv_lora_rank + rope = "
            f"{pool.kv_lora_rank + pool.qk_rope_head_dim} only)"
        )
    if pool.use_dsa or pool.dcp_replicated or getattr(args, "dcp_size", 1) > 1:
        reasons.append("sparse (DSA) or decode-context-parallel MLA (rows split across ranks)")
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend not in ("auto", *backends.AUTO_ORDER["mla_extend"]):
        reasons.append(
            f"{BACKEND_ENV}={backend!r} with an MLA model (kvattn's MLA extend runs on "
            f"{', '.join(backends.AUTO_ORDER['mla_extend'])})"
        )
    return reasons


def _mla_forward_method(attn, forward_batch):
    """DeepSeek-style models' attention path under kvattn: always the absorbed MLA path, which
    reads the latent cache through the backend. SGLang's MHA paths read the cache past the
    backend (a prefix's latent rows gathered and decompressed by the model) or attend over the
    new tokens only; neither would pass through kvattn's check."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def _graph_backends(args, device: str) -> tuple[str, str]:
    """The decode and prefill graph backends (``full``, ``breakable``, ``disabled``) of this
    engine: SGLang's resolved config where it was published (a server's processes), else what
    ``args`` ask for, with SGLang's defaults (decode ``full``; prefill ``breakable`` on CUDA)."""
    try:
        from sglang.srt.runtime_context import get_exec

        config = get_exec().graph.cuda_graph_config
    except (ImportError, ValueError):
        config = None
    config = config if config is not None else getattr(args, "cuda_graph_config", None)
    if config is not None and hasattr(config, "decode"):
        return str(config.decode.backend), str(config.prefill.backend)
    off = bool(getattr(args, "disable_cuda_graph", False))
    decode = getattr(args, "cuda_graph_backend_decode", None) or "full"
    prefill = getattr(args, "cuda_graph_backend_prefill", None)
    prefill = prefill or ("breakable" if device.startswith("cuda") else "disabled")
    return (
        "disabled" if off or getattr(args, "disable_decode_cuda_graph", False) else decode,
        "disabled" if off or getattr(args, "disable_prefill_cuda_graph", False) else prefill,
    )


def _graph_refusals(decode: str, prefill: str, device: str, args) -> list[str]:
    """What of SGLang's graphs kvattn's backend does not cover: it implements the decode graphs'
    capture and replay (init_cuda_graph_state, init_forward_metadata_out_graph/_in_graph) for
    whole-forward ("full") capture only."""
    reasons = []
    compile_ = bool(getattr(args, "enable_torch_compile", False))
    if device == "cpu":
        # On a CPU SGLang captures only with torch.compile, through its CPU graph runner.
        if compile_:
            reasons.append(
                "CPU graphs (--enable-torch-compile on --device cpu: SGLang's CPU graph runner "
                "calls init_cpu_graph_state, which kvattn does not implement)"
            )
        return reasons
    if decode == "breakable":
        reasons.append(
            "breakable decode CUDA graphs (--cuda-graph-backend-decode breakable, "
            "--debug-cuda-graph: kvattn's attention would run eagerly between captured "
            "segments at every replay, which is not covered; 'full' is)"
        )
    elif decode != "disabled":
        if compile_:
            reasons.append(
                "torch.compile of the decode CUDA graphs (--enable-torch-compile: dynamo would "
                "trace kvattn's attention and the ledger's Python, which is not covered)"
            )
        if getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None):
            reasons.append(
                "LoRA with decode CUDA graphs (SGLang captures a graph per LoRA variant of one "
                "batch size; kvattn keeps one set of per-layer reports per batch size)"
            )
        if getattr(args, "enable_two_batch_overlap", False):
            reasons.append("two-batch overlap with decode CUDA graphs (not covered)")
        if getattr(args, "enable_pdmux", False):
            reasons.append(
                "PD multiplexing with decode CUDA graphs (one attention backend per stream; "
                "not covered)"
            )
        # SGLang's own reading of the variable (EnvBool).
        if os.environ.get("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "").lower() in GLUE_ON:
            reasons.append(
                "the metadata glue graph (SGLANG_ENABLE_METADATA_GLUE_GRAPH: it would capture "
                "kvattn's host-side refill of the graph's buffers and replay it frozen)"
            )
    if prefill != "disabled":
        reasons.append(
            f"prefill CUDA graphs ({prefill!r}, SGLang's default on CUDA; start with "
            "--disable-prefill-cuda-graph: a prefill replay runs attention on the batch padded "
            "to a captured token count, which kvattn's extend step, built for the batch's own "
            "tokens, does not follow)"
        )
    return reasons


def _hicache_refusals(args) -> list[str]:
    """What the checked restore (:mod:`kvattn.integrations.sglang_hicache`) does not cover: KV
    that reaches the device other than from a host copy it attested."""
    reasons = []
    if getattr(args, "hicache_storage_backend", None) is not None:
        reasons.append(
            "a HiCache storage backend (pages prefetched from storage carry no attestation; "
            "host-memory HiCache is checked)"
        )
    if getattr(args, "hicache_host_memory_mode", "cache") != "cache":
        reasons.append(f"HiCache host memory mode {args.hicache_host_memory_mode!r} ('cache' only)")
    if getattr(args, "enable_hisparse", False):
        reasons.append("HiSparse (its device buffers are filled past the checked restore)")
    return reasons


def _disaggregation_refusals(mode: str, transfer: str, args) -> list[str]:
    """What the attestation (:mod:`kvattn.integrations.sglang_transfer`) does not cover yet."""
    reasons = []
    if transfer not in TRANSFER_BACKENDS:
        reasons.append(
            f"a {mode} instance on transfer backend {transfer!r} (attested transfers "
            f"run on {', '.join(map(repr, TRANSFER_BACKENDS))})"
        )
    if getattr(args, "tp_size", 1) > 1:
        reasons.append(
            f"tensor parallelism in a {mode} instance (each rank would attest and "
            "commit its own heads' pages; not covered yet)"
        )
    if getattr(args, "pp_size", 1) > 1:
        reasons.append(
            f"pipeline parallelism in a {mode} instance (layers split across ranks; "
            "not covered yet)"
        )
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").strip().lower() in ("1", "true"):
        reasons.append(
            "staging buffers (SGLANG_DISAGG_STAGING_BUFFER: pages reach the decode's "
            "pool by a scatter the attestation does not follow)"
        )
    return reasons


def _domain(req) -> bytes:
    """A request's cache domain: SGLang keys its radix cache on ``extra_key`` (to which it
    appends the LoRA id: kept apart here, so that no split of one string into key and id
    collides) and ``cache_salt``."""
    return cache_domain(
        extra_key=getattr(req, "extra_key", None),
        lora=getattr(req, "lora_id", None),
        cache_salt=getattr(req, "cache_salt", None),
    )


@dataclass
class _Lease(Lease):
    """A request's hold on pages, as the ledger learned it from its row of ``req_to_token``."""

    req: object = None  # SGLang's Req, for its token ids and its abort
    tokens: list[int] = field(default_factory=list)  # the token ids its forwards put in the cache
    # Where the draft tokens of its last verify forward began (speculative decoding), or None:
    # which of them were accepted, and in which slots, the next forward learns from the request.
    drafts_from: int | None = None


class SGLangOwnership(Ledger):
    """kvattn's ledger in one SGLang engine: the request pool's rows, the allocator's frees, the
    forwards' ``req_to_token`` rows and the disaggregation queue's commits translated into leases,
    reservations, releases, prefix hits and transfer commits."""

    adapter = "sglang"
    lease_type = _Lease

    def __init__(self, runner):
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.allocator = runner.token_to_kv_pool_allocator
        super().__init__(
            int(self.kv_pool.page_size),
            backend=os.environ.get(BACKEND_ENV, "auto"),
            prefix_caching=not getattr(runner.server_args, "disable_radix_cache", False),
        )
        # An MLA pool (one latent row per token: kv_lora_rank dims, then the RoPE key) is kept as
        # two column views, so that its writes, digests and copies are those of a K/V pool.
        self.kv_lora_rank = getattr(self.kv_pool, "kv_lora_rank", None)
        first = (self.kv_pool.k_buffer if self.kv_lora_rank is None else self.kv_pool.kv_buffer)[0]
        self.num_pages = first.shape[0] // self.page_size
        self.allocate_tags(self.kv_pool.layer_num, self.num_pages, first.device)
        if self.kv_lora_rank is not None:
            from sglang.srt.models.deepseek_common.attention_backend_handler import (
                AttentionBackendRegistry,
            )

            AttentionBackendRegistry.register(BACKEND_NAME, _mla_forward_method)
        self.page_owner: dict[int, int] = {}  # page -> the owner it was last reserved for
        # Host page -> (writer owner, its prefix digest, attestation) of the device page last
        # backed up there, or None: not attested (commit_restore).
        self.host_copies: dict[int, tuple | None] = {}
        # Whether this runner forward's inputs were prepared (begin_forward, or a graph replay's
        # fill); a forward is "prepared" until start_forward says one began.
        self._prepared = True
        self._hook()

    # -- hooks on the engine's own instances --------------------------------------------------

    def _hook(self) -> None:
        pool, allocator, kv = self.req_pool, self.allocator, self.kv_pool
        alloc, free_rows = pool.alloc, getattr(pool, "free_rows", None)
        free = pool.free

        def alloc_hook(reqs):
            fresh = [r for r in reqs if not r.kv.holds_kv]
            rows = alloc(reqs)
            if rows is not None:
                for r in fresh:  # a row's last transfer note was its last holder's
                    self.open_lease(r.kv.req_pool_idx, req=r, domain=_domain(r))
                    self.receive_notes.pop(r.kv.req_pool_idx, None)
                for r in reqs:  # a row a streaming session lends its next turn: same KV, new Req
                    lease = self.leases.get(r.kv.req_pool_idx)
                    if lease is not None:
                        lease.req = r
            return rows

        def free_hook(req):
            self.close_lease(req.kv.req_pool_idx)
            return free(req)

        pool.alloc, pool.free = alloc_hook, free_hook
        if free_rows is not None:

            def free_rows_hook(indices):
                for row in indices:
                    self.close_lease(int(row))
                return free_rows(indices)

            pool.free_rows = free_rows_hook
        # Every path that frees pages ends here: the paged allocator's page ids, or the token
        # allocator's slots (one slot per page) outside a free group.
        if hasattr(allocator, "_release_page_ids"):
            release = allocator._release_page_ids

            def release_hook(*page_ids):
                self._freed(torch.cat([p.reshape(-1) for p in page_ids]) if page_ids else None)
                return release(*page_ids)

            allocator._release_page_ids = release_hook
        else:
            token_free = allocator.free

            def token_free_hook(free_index):
                if allocator.free_group is None:
                    self._freed(free_index)
                return token_free(free_index)

            allocator.free = token_free_hook
        kv.set_kv_buffer = self.set_kv_buffer
        if self.kv_lora_rank is not None:
            kv.set_mla_kv_buffer = self.set_mla_kv_buffer
        if hasattr(kv, "move_kv_cache"):
            move = kv.move_kv_cache

            def move_hook(tgt_loc, src_loc):
                return move(*self._moves(tgt_loc, src_loc))

            kv.move_kv_cache = move_hook

    def _moves(self, tgt: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Around the pool's ``move_kv_cache`` (speculative decoding moves the accepted drafts'
        rows into place, past ``set_kv_buffer``): a row moves only from a written slot into a page
        held by the same owner, in every layer. Any other pair stays unmoved and its target page
        is released for its owner, so the request that reads it next fails, naming it."""
        if tgt.numel() == 0:
            return tgt, src
        P = self.page_size
        t, s = tgt.to(torch.int64), src.to(torch.int64)
        source = self.tags[:, s // P]  # [layers, pairs]
        target = self.tags[:, t // P]
        owner = tag_owner(source)
        ok = (
            (tag_state(source) == STATE_WRITTEN)
            & (s % P < tag_valid_len(source))
            & held_by(target, owner)
        ).all(0) | (t == s)
        ok_host, moved = torch.stack([ok, t != s]).cpu()  # the one host read of the moves
        self.counts["moved_rows"] += int((moved & ok_host).sum())
        if bool(ok_host.all()):
            return tgt, src
        bad = sorted(set((t.cpu()[~ok_host] // P).tolist()))
        self.counts["refused_moves"] += int((~ok_host).sum())
        # Released for whoever holds each page now (a FREE page stays as it is).
        held = [(p, int(tag_owner(self.tags[0, p]))) for p in bad]
        held = [(p, owner) for p, owner in held if owner > 0]
        if held:
            self.release([p for p, _ in held], [owner for _, owner in held])
        logger.warning(
            "kvattn: %d KV row move(s) from a slot not written for the target page's owner were "
            "refused; page(s) %s released",
            int((~ok_host).sum()),
            bad,
        )
        return tgt[ok], src[ok]

    def _freed(self, pages) -> None:
        if pages is None or pages.numel() == 0:
            return
        pages = sorted(set(pages.to(torch.int64).cpu().tolist()))
        known = [p for p in pages if p in self.page_owner]
        for p in pages:
            self.content.pop(p, None)
        self.release(known, [self.page_owner.pop(p) for p in known])
        self.counts["released_pages"] += len(known)

    def _reserve(self, reserve: dict[int, list[int]], written: dict[int, tuple[int, bytes]]):
        """Reserve the pages leases write in this forward (per owner), then record the full
        pages among them as what a later hit must hold (``written``, after: a reservation ends
        a page's old content)."""
        for owner, pages in reserve.items():
            self.reserve(pages, owner)
            self.page_owner.update(dict.fromkeys(pages, owner))
        if self.prefix_caching:
            self.content.update(written)

    # -- one forward -------------------------------------------------------------------------

    def _tokens(self, lease: _Lease, computed: int, new: list[int]) -> list[int]:
        """The token ids in the cache after this forward: the lease's own record, completed from
        the request for a prefix it did not compute (a radix hit, a resumed request, the drafts a
        verify forward accepted), then this forward's ``new`` ids at positions ``computed ..``.
        Under overlap scheduling the request's ``output_ids`` lag the forward by a token; the
        forward's own input ids do not."""
        tokens = lease.tokens  # kept in place: a decode step appends one id
        if lease.drafts_from is not None:
            # A verify forward wrote its draft tree in tree order; the accepted path was moved
            # into place after it (move_kv_cache): the request's ids say what the slots now hold.
            del tokens[lease.drafts_from :]
        del tokens[computed:]
        if len(tokens) < computed:
            req = lease.req
            tokens += (list(req.origin_input_ids) + list(req.output_ids))[len(tokens) : computed]
        tokens += new
        return tokens

    def _table(self, rows: list[int], seq_lens: list[int]) -> torch.Tensor:
        """kvattn's block table of ``rows`` read off ``req_to_token``: the page of each logical
        page's first slot, or -1 where the slots of a logical page (within the sequence) are not
        that page's slots in order."""
        P = self.page_size
        width = max(1, -(-max(seq_lens, default=1) // P))
        req_to_token = self.req_pool.req_to_token
        index = torch.tensor(rows, dtype=torch.int64, device=req_to_token.device)
        cols = min(width * P, req_to_token.shape[1])
        slots = torch.full(
            (len(rows), width * P), -1, dtype=torch.int64, device=req_to_token.device
        )
        slots[:, :cols] = req_to_token[index, :cols].to(torch.int64)
        slots = slots.view(len(rows), width, P)  # [B, W, P]
        pages = torch.div(slots[:, :, 0], P, rounding_mode="floor")  # [B, W]
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=slots.device)
        pos = torch.arange(width * P, device=slots.device).view(1, width, P)
        inside = pos < lens.view(-1, 1, 1)
        aligned = slots == pages.unsqueeze(-1) * P + torch.arange(P, device=slots.device)
        good = (aligned | ~inside).all(-1) & (pages >= 0) & (pages < self.num_pages)
        return torch.where(good, pages, -1).to(torch.int32)

    def begin_forward(self, fb) -> None:
        """The ownership inputs of this forward (``fb``: SGLang's ForwardBatch), resolved on the
        host: each lease's pages against its row, hits against the pages' writers."""
        rows = [int(r) for r in fb.req_pool_indices.tolist()]
        seq_lens = [
            int(n)
            for n in (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
        ]
        decode = fb.forward_mode.is_decode()
        verify = fb.forward_mode.is_target_verify()
        if verify:
            # Speculative decoding's verify: each request's draft tree, written after the
            # committed tokens (SGLang's seq_lens), read under the tree mask.
            drafts = int(fb.spec_info.draft_token_num)
            q_lens = [drafts] * len(rows)
            committed, seq_lens = seq_lens, [n + drafts for n in seq_lens]
        else:
            q_lens = [1] * len(rows) if decode else [int(n) for n in fb.extend_seq_lens_cpu]
        keys, owners, names, table, expected = self._resolve(
            rows, seq_lens, q_lens, fb.input_ids.tolist(), verify
        )
        step = self.start_step(
            keys,
            owners,
            q_lens,
            table.to(fb.seq_lens.device),
            expected,
            seq_lens,
            names=names,
            decode_only=decode,
        )
        if verify:
            step.custom_mask = verify_mask(fb.spec_info.custom_mask, committed, drafts)

    # -- decode forwards replayed from CUDA graphs ------------------------------------------

    def allocate_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """SGLang's ``init_cuda_graph_state``: kvattn's fixed buffers for decode graphs of up to
        ``max_bs`` rows, each as wide as a row of ``req_to_token``."""
        if max_num_tokens != max_bs:
            raise IntegrationError(
                f"kvattn.integrations.sglang: CUDA graphs of {max_num_tokens} tokens for "
                f"{max_bs} requests (several tokens per request: speculative decoding); kvattn's "
                "graphs take one decode token per request"
            )
        width = -(-self.req_pool.req_to_token.shape[1] // self.page_size)
        self.allocate_graph(max_bs, width, self.tags.device)

    def capture_forward(self, fb) -> None:
        """Before SGLang captures the decode graph of ``fb.batch_size`` rows: every row padding
        while the capture's runs record the forward."""
        if not fb.forward_mode.is_decode():
            raise IntegrationError(
                f"kvattn.integrations.sglang: a CUDA graph of {fb.forward_mode.name} forwards "
                "(decode graphs only)"
            )
        self.capture_graph_step(int(fb.batch_size))

    def replay_forward(self, fb) -> None:
        """Before SGLang replays a decode graph (``fb``: its replay view, padded to the
        captured batch size, ``num_padding`` rows at the end): the rows of the batch resolved
        on the host, as for an eager forward, into the graph's fixed buffers."""
        mode = getattr(fb, "actual_forward_mode", fb.forward_mode)
        if not (fb.forward_mode.is_decode() and mode.is_decode()):
            raise IntegrationError(
                f"kvattn.integrations.sglang: a CUDA-graph replay of a {mode.name} forward on a "
                f"{fb.forward_mode.name} graph (decode graphs only)"
            )
        batch = int(fb.batch_size)
        n = batch - int(getattr(fb, "num_padding", 0) or 0)
        # The padded rows' request-pool index is SGLang's padding (0), not a request: only the
        # first n rows are read.
        rows = [int(r) for r in fb.req_pool_indices[:n].tolist()]
        lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens
        seq_lens = [int(x) for x in lens[:n].tolist()]
        keys, owners, names, table, expected = self._resolve(
            rows, seq_lens, [1] * n, fb.input_ids[:n].tolist()
        )
        self.fill_graph_step(batch, keys, owners, table, expected, seq_lens, names=names)

    def _resolve(
        self,
        rows: list[int],
        seq_lens: list[int],
        q_lens: list[int],
        ids: list[int],
        verify: bool = False,
    ) -> tuple[list, list[int], list[str], torch.Tensor, torch.Tensor]:
        """One forward's rows brought up to date on the host (leases synced with their rows of
        ``req_to_token``, the pages they now write reserved): per row its lease key, owner and
        request id (None, 0 and "" for a row no lease holds), the block table read off the rows
        (on their device) and the expected owners ``[B, W]`` (on the host)."""
        self._prepared = True
        table = self._table(rows, seq_lens)
        pages = table.cpu().tolist()
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        width = table.shape[1]
        expected = torch.zeros(len(rows), width, dtype=torch.int64)
        owners, keys, names = [0] * len(rows), [None] * len(rows), [""] * len(rows)
        reserve: dict[int, list[int]] = {}
        written: dict[int, tuple[int, bytes]] = {}
        for b, row in enumerate(rows):
            lease = self.leases.get(row)
            if lease is None:  # padding rows, or a row no lease holds: nothing is readable
                continue
            owners[b], keys[b], names[b] = lease.owner, row, lease.req.rid
            computed = seq_lens[b] - q_lens[b]
            # The pages the last verify forward wrote are recorded again from the ids the
            # request accepted (what their content is now).
            rewritten = min(
                computed, lease.drafts_from if lease.drafts_from is not None else computed
            )
            tokens = self._tokens(lease, computed, ids[starts[b] : starts[b + 1]])
            lease.drafts_from = computed if verify else None
            self._sync(
                lease,
                tokens,
                pages[b][: -(-seq_lens[b] // self.page_size)],
                computed,
                seq_lens[b],
                reserve,
                written,
                rewritten,
            )
            expected[b, : len(lease.expected[0])] = torch.tensor(lease.expected[0][:width])
        self._reserve(reserve, written)
        return keys, owners, names, table, expected

    def _sync(
        self,
        lease: _Lease,
        tokens: list[int],
        pages: list[int],
        computed: int,
        seq_len: int,
        reserve: dict[int, list[int]],
        written: dict[int, tuple[int, bytes]],
        rewritten: int | None = None,
    ) -> None:
        """Bring ``lease`` up to its row's ``pages`` (a forward over ``seq_len`` tokens whose first
        ``computed`` are already in the cache): a page at a position of its new tokens is its own
        (to ``reserve`` unless it holds it); a page of computed tokens it does not hold is a hit
        (:meth:`Ledger.hit_owner`). The full pages it writes, and those from token ``rewritten``
        on (default ``computed``), go to ``written``."""
        P = self.page_size
        held_pages, expected = lease.pages[0], lease.expected[0]
        del lease.keys[(len(tokens) if rewritten is None else min(len(tokens), rewritten)) // P :]
        if self.prefix_caching and len(lease.keys) < len(tokens) // P:
            lease.keys = self.digests(tokens, lease.keys, lease.domain)
        del held_pages[len(pages) :], expected[len(pages) :]
        # A row usually changes only past what the lease held (one compare, in C); SGLang rewrites
        # earlier entries when the radix cache dedups a chunk, and then every entry is compared.
        held = len(held_pages)
        start = held if pages[:held] == held_pages else 0
        for i in range(start, len(pages)):
            page = pages[i]
            if i < held and held_pages[i] == page:
                continue
            if (i + 1) * P <= computed:
                owner = self.hit_owner(page, lease.keys[i] if i < len(lease.keys) else None)
            elif i * P < computed:  # part of a page it does not hold was computed: no proof
                owner = 0
            else:
                owner = lease.owner
                if page >= 0:
                    reserve.setdefault(owner, []).append(page)
            if i < len(held_pages):
                held_pages[i], expected[i] = page, owner
            else:
                held_pages.append(page)
                expected.append(owner)
        if self.prefix_caching:  # full pages it writes now: what a later hit on them must hold
            first = computed if rewritten is None else rewritten
            for i in range(first // P, min(seq_len // P, len(pages), len(lease.keys))):
                if expected[i] == lease.owner and pages[i] >= 0:
                    written[pages[i]] = (lease.owner, lease.keys[i])

    # -- the pool's writes and the backend's reads --------------------------------------------

    def pools(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V buffers as kvattn's NHD pools ``[pages, P, H, D]`` (an fp8
        cache's uint8 bytes as its fp8 format)."""
        if self.kv_lora_rank is not None:
            latent = self.latent(layer_id)
            return latent[..., : self.kv_lora_rank], latent[..., self.kv_lora_rank :]
        local = layer_id - self.kv_pool.start_layer
        n = self.num_pages * self.page_size
        k, v = self.kv_pool.k_buffer[local], self.kv_pool.v_buffer[local]
        if k.dtype != self.kv_pool.dtype:
            k, v = k.view(self.kv_pool.dtype), v.view(self.kv_pool.dtype)
        return (
            k[:n].view(self.num_pages, self.page_size, *k.shape[1:]),
            v[:n].view(self.num_pages, self.page_size, *v.shape[1:]),
        )

    def latent(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s MLA latent buffer as kvattn's MLA pool ``[pages, P, 1, dims]``."""
        n = self.num_pages * self.page_size
        latent = self.kv_pool.kv_buffer[layer_id - self.kv_pool.start_layer][:n]
        return latent.view(self.num_pages, self.page_size, *latent.shape[1:])

    def layer_tags(self, layer_id: int) -> torch.Tensor:
        return self.tags[layer_id - self.kv_pool.start_layer]

    def set_kv_buffer(
        self,
        layer,
        loc_info,
        cache_k,
        cache_v,
        k_scale=None,
        v_scale=None,
        layer_id_override=None,
        dcp_kv_mask=None,
    ) -> None:
        """In place of the pool's ``set_kv_buffer``: kvattn's append and stamp, under the owner of
        each token's request in this forward. An MLA pool's ``cache_k`` is the whole latent row
        and its ``cache_v`` is ignored, as SGLang's MLA pool does."""
        if dcp_kv_mask is not None:
            raise IntegrationError("kvattn.integrations.sglang: masked KV writes are not supported")
        if self.kv_lora_rank is not None:
            latent = cache_k.reshape(cache_k.shape[0], 1, -1)
            cache_k, cache_v = latent[..., : self.kv_lora_rank], latent[..., self.kv_lora_rank :]
        self._write(layer, loc_info, cache_k, cache_v, k_scale, v_scale, layer_id_override)

    def set_mla_kv_buffer(
        self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None
    ) -> None:
        """In place of the MLA pool's ``set_mla_kv_buffer`` (the latent and its RoPE key apart)."""
        self._write(layer, loc_info, cache_k_nope, cache_k_rope, None, None, layer_id_override)

    def _write(self, layer, loc_info, cache_k, cache_v, k_scale, v_scale, layer_id_override):
        from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

        step = self.step()
        loc, _, _ = unwrap_write_loc(loc_info)
        if loc.shape[0] != step.token_row.shape[0]:
            raise IntegrationError(
                f"kvattn.integrations.sglang: {loc.shape[0]} KV slots written "
                f"for a forward of {step.token_row.shape[0]} tokens"
            )
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        k_pages, v_pages = self.pools(layer_id)
        heads, dim = k_pages.shape[2], k_pages.shape[3]
        cache_k = cache_k.reshape(-1, heads, dim)
        cache_v = cache_v.reshape(-1, heads, v_pages.shape[3])
        scales = {}
        if k_pages.dtype in FP8_DTYPES:
            # SGLang's own write divides by the scale and casts (nearest-even, e4m3 saturating):
            # the codes kvattn's writer stores.
            scales = self.fp8_scales(layer, k_scale, v_scale)
        else:
            cache_k, cache_v = cache_k.to(k_pages.dtype), cache_v.to(v_pages.dtype)
        step.write(
            f"layer {layer_id}",
            cache_k,
            cache_v,
            k_pages,
            v_pages,
            loc,
            self.layer_tags(layer_id),
            **scales,
        )

    @staticmethod
    def fp8_scales(layer, k_scale=None, v_scale=None) -> dict:
        """An fp8 cache's K and V scales of ``layer``: those a write is given, else the layer's
        own (a checkpoint's, ``k_scale_float``), else 1."""

        def scale(given, own):
            value = given if given is not None else own
            return float(value) if value is not None else 1.0

        return dict(
            k_scale=scale(k_scale, getattr(layer, "k_scale_float", None)),
            v_scale=scale(v_scale, getattr(layer, "v_scale_float", None)),
        )

    def attend(self, q, layer, out) -> None:
        """Layer ``layer``'s attention of this forward into ``out`` ([T, Hq, Dv]); over an MLA
        pool, ``q`` is the absorbed query and its RoPE part ([T, Hq, kv_lora_rank + rope])."""
        if self.kv_lora_rank is not None:
            if layer.logit_cap or (layer.sliding_window_size or -1) > -1:
                raise IntegrationError(
                    f"kvattn.integrations.sglang: MLA layer {layer.layer_id} with a logit cap or "
                    "a sliding window (kvattn's MLA readers take neither)"
                )
            self.step().attend_mla(
                f"layer {layer.layer_id}",
                q,
                self.latent(layer.layer_id),
                self.layer_tags(layer.layer_id),
                kv_lora_rank=self.kv_lora_rank,
                scale=float(layer.scaling),
                out=out,
            )
            return
        k_pages, v_pages = self.pools(layer.layer_id)
        window = layer.sliding_window_size
        scales = self.fp8_scales(layer) if k_pages.dtype in FP8_DTYPES else {}
        self.step().attend(
            f"layer {layer.layer_id}",
            q,
            k_pages,
            v_pages,
            self.layer_tags(layer.layer_id),
            scale=float(layer.scaling),
            out=out,
            logits_soft_cap=float(layer.logit_cap or 0.0),
            window_left=window if window is not None and window > -1 else -1,
            **scales,
        )

    def start_forward(self) -> None:
        """Before the runner's forward: nothing is prepared for it yet (:meth:`end_forward`), and
        no graph buffer holds an owner (a fill whose replay never ran is not this forward's)."""
        self._prepared = False
        if self.graph is not None:
            self.graph.poison()

    def end_forward(self, fb=None) -> dict[str, str]:
        """After the forward: abort the requests with refused pages or dropped writes (one read);
        returns their messages by request id. A forward of ``fb`` (SGLang's ForwardBatch) that
        ran with nothing prepared for it (a CUDA graph replayed without kvattn's refill) read
        owner-0 buffers, which fail closed: each of its requests is aborted, saying so."""
        if not self._prepared and fb is not None:
            self._prepared = True
            self.steps = {}  # a step of an earlier forward: nothing in it is this one's
            if self.graph is not None:
                self.graph.poison()
            return self._unprepared(fb)
        failed = self.finish()
        return self._abort({row: message for row, (_, _, message) in failed.items()})

    def _unprepared(self, fb) -> dict[str, str]:
        if fb.forward_mode.is_idle() or not fb.batch_size:
            return {}
        message = (
            "kvattn ownership check failed: this forward's ownership inputs were never "
            f"prepared (a {fb.forward_mode.name} forward whose CUDA-graph replay ran without "
            "kvattn's refill); its reads found owner 0 and failed closed, so the request was "
            "stopped."
        )
        rows = [int(r) for r in fb.req_pool_indices[: fb.batch_size].tolist()]
        self.counts["unprepared_forwards"] += 1
        logger.error("%s (requests in rows %s)", message, rows)
        self.failures += [
            (self.leases[r].req.rid, message) for r in rows if self.leases.get(r) is not None
        ]
        return self._abort(dict.fromkeys(rows, message))

    def _abort(self, messages: dict[int, str]) -> dict[str, str]:
        if not messages:
            return {}
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        out = {}
        for row, message in messages.items():
            lease = self.leases.get(row)
            if lease is None:
                continue
            out[lease.req.rid] = message
            # SGLang's own path for a forward that ran on KV that never landed: the forward's
            # output is dropped, the request finishes with the reason (an error status), and its
            # KV is not put in the radix cache.
            lease.req.discard_output_reason = FINISH_ABORT(
                message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVOwnershipError"
            )
            lease.req.skip_radix_cache_insert = True
        return out

    # -- KV that arrived by a transfer --------------------------------------------------------

    def transfer_key(self) -> DigestKey | None:
        """A fresh key for one transfer's digests where the keyed digest reads this engine's
        pools at speed, else None (:meth:`kvattn.transfer.DigestKey.for_pools`)."""
        return DigestKey.for_pools(*self._all_pools())

    def attest_sent(
        self,
        req,
        indices: list[int],
        pages: list[int],
        *,
        digests: bool = True,
        key: DigestKey | None = None,
    ) -> dict[int, list]:
        """The prefill side: ``pages`` (logical pages ``indices`` of ``req``) are about to be sent.
        Per logical page, ``[valid_len, digest]`` from this ledger's tags under the owner the
        request expects there (a radix hit: its writer's); a page the request's lease does not
        map there attests nothing (0). ``key``: the transfer's (:meth:`transfer_key`)."""
        lease = self.leases.get(req.kv.req_pool_idx)
        held = lease.pages[0] if lease is not None else []
        owners = [
            lease.expected[0][i] if lease is not None and i < len(held) and held[i] == p else 0
            for i, p in zip(indices, pages)
        ]
        attested = self.attest(
            owners,
            pages,
            indices,
            list(req.origin_input_ids),
            *self._all_pools(),
            digests=digests,
            key=key,
        )
        self.counts["attested_pages"] += len(pages)
        return {i: a.to_json() for i, a in zip(indices, attested)}

    def _all_pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V pools, in tag-row order."""
        start = self.kv_pool.start_layer
        pools = [self.pools(start + i) for i in range(self.tags.shape[0])]
        return [k for k, _ in pools], [v for _, v in pools]

    def commit_transfer(self, req, receiver, frames: list[bytes] | None = None) -> None:
        """The decode side: ``req``'s transfer finished. Its pages (its row, through its prompt)
        are reserved for its lease and committed from the first position no local prefix hit
        covers: by the prefill's attestation (``frames``, from a transfer engine's receiver),
        page by page at the lengths verified here; or, for a receiver that is not a transfer
        engine's (``frames`` None), by the tokens it accounts for (:func:`received_tokens`)."""
        row = req.kv.req_pool_idx
        lease = self.leases.get(row)
        if lease is None:
            return
        total = len(req.origin_input_ids)
        table = self._table([row], [total])
        pages = table[0, : -(-total // self.page_size)].cpu().tolist()
        reserve: dict[int, list[int]] = {}
        prefix = getattr(req, "prefix_indices", None)  # the decode side's own radix-cache hit
        computed = min(0 if prefix is None else len(prefix), total)
        tokens = self._tokens(lease, computed, list(req.origin_input_ids)[computed:total])
        self._sync(lease, tokens, pages, computed, computed, reserve, {})
        self._reserve(reserve, {})
        P = self.page_size
        own = [
            i
            for i, page in enumerate(pages)
            if page >= 0 and lease.expected[0][i] == lease.owner and i * P >= computed
        ]
        if frames is None:
            count, how = received_tokens(receiver)
            end = min(total, computed + max(0, count))
            lens = {i: min(P, end - i * P) for i in own if end - i * P > 0}
            self.counts["received_tokens"] += end - computed
            note = f"transfer of {total - computed} token(s): {how}"
        else:
            lens, note = self._verified(frames, own, pages, list(req.origin_input_ids))
        commit = [pages[i] for i in sorted(lens)]
        self.commit(commit, lease.owner, [lens[i] for i in sorted(lens)])
        if self.prefix_caching:  # a full page that arrived is a prefix hit's content later
            for i in sorted(lens):
                if lens[i] == P and i < len(lease.keys):
                    self.remember(pages[i], lease.owner, lease.keys[i])
        self.receive_notes[row] = [f"received: {note}; {len(commit)} page(s) committed"]

    # -- KV backed up to host memory and loaded back (kvattn.integrations.sglang_hicache) ---

    def attest_backup(self, hosts: list[int], pages: list[int]) -> None:
        """Device ``pages`` were copied to host pages ``hosts`` (pairwise): each is attested for
        the owner that wrote it, in the context of its writer's prefix digest, and kept by host
        page (a page without a known writer, or not full, as not attested)."""
        written = [self.content.get(p) for p in pages]  # (owner, key) or None
        # One key per backup, drawn after its pages were written and kept in this process.
        key = self.transfer_key()
        attested = attest_pages(
            self.tags,
            [w[0] if w is not None else 0 for w in written],
            pages,
            *self._all_pools(),
            contexts=[w[1] if w is not None else b"" for w in written],
            key=key,
        )
        for host, w, a in zip(hosts, written, attested, strict=True):
            full = w is not None and a.valid_len == self.page_size
            self.host_copies[host] = (w[0], w[1], a, key) if full else None
            self.counts["backed_up_pages" if full else "backed_up_pages_not_attested"] += 1

    def commit_restore(self, hosts: list[int], pages: list[int]) -> None:
        """Host pages ``hosts`` were copied into freshly allocated device ``pages`` (pairwise):
        each that verifies against its host page's attestation is committed for its writer and
        is that prefix's content again; the others stay FREE."""
        copies = [self.host_copies.get(h) for h in hosts]
        lens: list[int] = [0] * len(pages)
        reasons: list[str | None] = ["not attested"] * len(pages)
        # Pages backed up by different backups carry different keys: one check per key.
        by_key: dict[DigestKey | None, list[int]] = {}
        for j, c in enumerate(copies):
            if c is not None:
                by_key.setdefault(c[3], []).append(j)
        for key, group in by_key.items():
            found = verify_arrived(
                [copies[j][2] for j in group],
                [pages[j] for j in group],
                *self._all_pools(),
                contexts=[copies[j][1] for j in group],
                key=key,
            )
            for j, n, why in zip(group, *found, strict=True):
                lens[j], reasons[j] = n, why
        refused = []
        for host, page, copy, n, why in zip(hosts, pages, copies, lens, reasons, strict=True):
            if n != self.page_size:
                refused.append(f"page {page} from host page {host}: {why or 'partial page'}")
                continue
            owner, key, _, _ = copy
            self.reserve([page], owner)
            self.page_owner[page] = owner
            self.commit([page], owner, [n])
            self.remember(page, owner, key)
        self.counts["restored_pages"] += len(pages) - len(refused)
        self.counts["restored_pages_refused"] += len(refused)
        if refused:
            more = f"; ... ({len(refused) - 8} more)" if len(refused) > 8 else ""
            logger.warning(
                "kvattn: pages loaded back from host memory not committed (a read of them is "
                "refused): %s%s",
                "; ".join(refused[:8]),
                more,
            )

    def _verified(
        self, frames: list[bytes], own: list[int], pages: list[int], prompt: list[int]
    ) -> tuple[dict[int, int], str]:
        """Per logical page of ``own``, the length the prefill's attestation proves here (pages
        it does not prove are left out), and a line saying what arrived."""
        claims, key, why = sglang_transfer.parse(frames)
        self.counts["received_transfers"] += 1
        if key is not None:
            self.counts["received_keyed_transfers"] += 1
        if claims is not None:
            try:
                lens, reasons = self.verify(
                    [claims.get(i) for i in own],
                    own,
                    [pages[i] for i in own],
                    prompt,
                    *self._all_pools(),
                    check_bytes=sglang_transfer.check_bytes(),
                    key=key,
                )
            except ValueError as e:
                if key is None:
                    raise
                # A key for pools this instance cannot digest keyed (laid out unlike the sender's).
                claims, why = None, f"the attestation's keyed digest cannot be checked here: {e}"
        if claims is None:
            self.counts["received_pages_refused"] += len(own)
            return {}, why
        refused = [
            f"logical page {i} (page {pages[i]}): {why}"
            for i, why in zip(own, reasons)
            if why is not None
        ]
        self.counts["received_pages_committed"] += sum(1 for n in lens if n)
        self.counts["received_pages_refused"] += len(refused)
        note = f"attestation of {len(claims)} page(s) from the prefill"
        if refused:
            more = f"; ... ({len(refused) - 8} more)" if len(refused) > 8 else ""
            note += f"; not committed: {'; '.join(refused[:8])}{more}"
        return {i: n for i, n in zip(own, lens) if n}, note


__all__ = [
    "BACKEND_NAME",
    "SUPPORTED_VERSIONS",
    "IntegrationError",
    "SGLangOwnership",
    "attach",
    "beam_hook",
    "check_version",
    "commit_transfer_hook",
    "decode_outputs_hook",
    "fused_write_hook",
    "received_tokens",
    "state_for",
    "state_for_pool",
]

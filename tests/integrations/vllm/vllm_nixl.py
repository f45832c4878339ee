"""Disaggregated prefill over NIXL (UCX on the loopback), for test_vllm_nixl.py: a prefill
instance and a decode instance of vLLM, each in its own process, run with the vLLM environment's
Python:

    python tests/integrations/vllm/vllm_nixl.py ROLE MODEL_DIR OUT_JSON DIR PREFILL_PORT DECODE_PORT

``ROLE`` is ``prefill`` or ``decode``. The two meet through files in ``DIR``: the prefill instance
writes what the router hands the decode instance for each case (``cases.json``: the
``kv_transfer_params``, some altered as below) and serves its blocks until ``done`` appears (both
waits bounded). With ``KVATTN_VLLM=1`` both run kvattn's attention and ``CheckedNixlConnector``,
without it vLLM's own attention and ``NixlConnector``.

The cases, after earlier requests have filled the prefill instance's pool with other users' KV
(and warm-up transfers made the handshake): ``short`` (a prompt the prefill instance holds,
transferred whole), ``shared`` (one whose first block is a prefix-cache hit on both instances,
written by the short request), ``local_hit`` (decoded locally, its first block a hit on the block
that arrived for the short request), ``corrupt`` (its second block's bytes changed on the prefill
side after the attestation), ``padded`` (the incident: the long prompt does not fit the prefill
instance, a 1-token placeholder is prefilled in its place, and the block list handed to the
decode instance is padded with the prefill instance's other blocks, still holding earlier
requests' KV, under a token count of the whole prompt) and ``short_list`` (a second long prompt
with its placeholder's own one-block list, beside a clean request in the same batch).
"""

from __future__ import annotations

import json
import os
import sys
import time

ROLE, MODEL, OUT, DIR, PREFILL_PORT, DECODE_PORT = sys.argv[1:7]
# UCX_MODULES: the loopback needs no InfiniBand module, and where rdma-core is installed UCX's
# efa module would map the system libnl beside the wheel's own copy, whose destructor then
# crashes the process at exit (SIGSEGV in rtnl_tc_unregister).
os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    UCX_TLS="tcp,self,sm",
    UCX_NET_DEVICES="lo",
    UCX_MODULES="^ib,rdmacm",
    VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
    VLLM_NIXL_SIDE_CHANNEL_PORT=PREFILL_PORT if ROLE == "prefill" else DECODE_PORT,
)

from vllm_prompts import (
    BESIDE,
    BLOCK,
    CORRUPT,
    EARLIER,
    LOCAL_HIT,
    LONG,
    LONG2,
    SHARED,
    SHORT,
    WARMUPS,
)

WAIT_S = 240  # bound on each wait for the other instance
PREFILL_CAPACITY = 128


def kvattn_on() -> bool:
    return os.environ.get("KVATTN_VLLM") == "1"


def make_llm(role: str, **overrides):
    from vllm import LLM

    transfer = {
        "kv_connector": "NixlConnector",
        "kv_buffer_device": "cpu",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }
    if kvattn_on():
        transfer.update(
            kv_connector="CheckedNixlConnector",
            kv_connector_module_path="kvattn.integrations.vllm_connector",
        )
    args = dict(
        model=MODEL,
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=PREFILL_CAPACITY if role == "prefill" else 512,
        kv_cache_memory_bytes=32 << 20,
        max_num_seqs=8,
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        seed=0,
        kv_transfer_config=transfer,
    )
    args.update(overrides)
    return LLM(**args)


def wait_for(path: str) -> None:
    start = time.time()
    while not os.path.exists(path):
        if time.time() - start > WAIT_S:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.2)


def prefill() -> dict:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    # vLLM's default prefix caching here: the ``shared`` request's first block is a hit on the
    # ``short`` request's, written under that request's owner.
    llm = make_llm("prefill", num_gpu_blocks_override=40, enable_prefix_caching=True)
    remote = SamplingParams(
        max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )

    def send(tokens):
        out = llm.generate([{"prompt_token_ids": tokens}], remote, use_tqdm=False)[0]
        return out.kv_transfer_params

    params = {f"earlier{i}": send(p) for i, p in enumerate(EARLIER)}
    params.update({f"warmup{i}": send(p) for i, p in enumerate(WARMUPS)})
    params["short"] = send(SHORT)
    params["shared"] = send(SHARED)
    params["corrupt"] = send(CORRUPT)
    # Its second block's bytes change after the attestation (a torn or misdirected write on the
    # sender's side): every K of the block in the first layer, negated.
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    layer = runner.compilation_config.static_forward_context["model.layers.0.self_attn.attn"]
    block, head_dim = params["corrupt"]["remote_block_ids"][0][1], layer.impl.head_size
    layer.kv_cache[block, ..., :head_dim].neg_()
    try:
        send(LONG)
        refused = ""
    except VLLMValidationError as e:
        refused = str(e).splitlines()[0]
    params["placeholder"] = send(LONG[:1])
    params["placeholder2"] = send(LONG2[:1])
    with open(os.path.join(DIR, "cases.json.tmp"), "w") as f:
        json.dump(routed(params), f)
    os.replace(os.path.join(DIR, "cases.json.tmp"), os.path.join(DIR, "cases.json"))
    # Serve the blocks (NIXL reads them from this process) until the decode instance is done.
    wait_for(os.path.join(DIR, "done"))
    return dict(refused=refused, params=params)


def routed(params: dict) -> dict:
    """What the router hands the decode instance for each case."""
    placeholder = params["placeholder"]
    others = [b for i in range(len(EARLIER)) for b in params[f"earlier{i}"]["remote_block_ids"][0]]
    need = -(-len(LONG) // BLOCK)
    padded = dict(
        placeholder,
        remote_num_tokens=len(LONG),
        remote_block_ids=[placeholder["remote_block_ids"][0] + others[: need - 1]],
    )
    return dict(
        short=params["short"],
        shared=params["shared"],
        corrupt=params["corrupt"],
        padded=padded,
        short_list=params["placeholder2"],
        warmups=[params[f"warmup{i}"] for i in range(len(WARMUPS))],
    )


def decode() -> dict:
    try:
        return _decode()
    finally:  # the prefill instance stops serving, whatever happened here
        open(os.path.join(DIR, "done"), "w").close()


def _decode() -> dict:
    from vllm import SamplingParams

    wait_for(os.path.join(DIR, "cases.json"))
    with open(os.path.join(DIR, "cases.json")) as f:
        cases = json.load(f)
    # vLLM's default prefix caching: the shared request's first block and the local one's are
    # hits on the block that arrived for the short request.
    llm = make_llm("decode", enable_prefix_caching=True)
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)

    def generate(batch):
        outs = llm.generate(
            [{"prompt_token_ids": tokens} for tokens, _ in batch],
            [SamplingParams(**greedy, extra_args={"kv_transfer_params": p}) for _, p in batch],
            use_tqdm=False,
        )
        return [
            dict(
                tokens=list(o.outputs[0].token_ids),
                finish_reason=o.outputs[0].finish_reason,
                request_id=o.request_id,
            )
            for o in outs
        ]

    results: dict = {}
    # The first transfer makes the side-channel handshake, which vLLM gives 5 s: on a loaded
    # machine it may time out and fail that one request, so it is retried on another.
    for i, (tokens, params) in enumerate(zip(WARMUPS, cases["warmups"])):
        results["warmups"] = i + 1
        if generate([(tokens, params)])[0]["finish_reason"] == "length":
            break
    try:
        for name, tokens, params in (
            ("short", SHORT, cases["short"]),
            ("shared", SHARED, cases["shared"]),
            ("local_hit", LOCAL_HIT, None),
            ("corrupt", CORRUPT, cases["corrupt"]),
            ("padded", LONG, cases["padded"]),
        ):
            results[name] = generate([(tokens, params)])[0]
        # The victim beside a clean request of the same batch (a local prompt, no transfer).
        victim, clean = generate([(LONG2, cases["short_list"]), (BESIDE, None)])
        results.update(short_list=victim, beside=clean)
    except Exception as e:  # vLLM's own engine may stop on a case; what ran is kept
        results["engine_died"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    failures, counts = [], {}
    if kvattn_on():
        from kvattn.integrations import vllm as integration

        runner = (
            llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        )
        state = integration.state_for(runner.vllm_config)
        failures, counts = list(state.failures), dict(state.counts)
    return dict(results=results, failures=failures, counts=counts)


def local() -> dict:
    """The same prompts on one instance without a transfer: the answers a correct one gives."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=MODEL,
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        seed=0,
    )
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cases = {
        "short": SHORT,
        "shared": SHARED,
        "local_hit": LOCAL_HIT,
        "corrupt": CORRUPT,
        "long": LONG,
        "beside": BESIDE,
    }
    outs = llm.generate([{"prompt_token_ids": p} for p in cases.values()], greedy, use_tqdm=False)
    return {name: list(o.outputs[0].token_ids) for name, o in zip(cases, outs)}


if __name__ == "__main__":
    result = {"prefill": prefill, "decode": decode, "local": local}[ROLE]()
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)

"""kvattn's backend of vLLM's standard GPU cache layout (``KVAttnGPUBackend``, the class vLLM's
CUDA platform gets with ``KVATTN_VLLM=1``), run on vLLM 0.32's CPU build with
``KVATTN_VLLM_LAYOUT=gpu``, so that only the device differs from a GPU run: vLLM lays the cache
out token-major (``LBNHC``), kvattn reads it through views.

The scenario is test_vllm.py's ``main`` (vllm_driver.py): greedy tokens with chunked prefill and
prefix caching against vLLM's own CPU attention (that file's run, shared), then vLLM's four
bookkeeping faults, each next to a clean run. Then the configurations the GPU layout refuses are
set up once each on a real engine, and kvattn's answers to vLLM's CUDA backend selection are
asked through the hook it installs on the CUDA platform (a stand-in class: vLLM's CUDA platform
module does not import on the CPU build).
"""

from __future__ import annotations

import pytest
from vllm_scenarios import DRIVER, FAULTS, VICTIM, Runs

from kvattn_testing.engines import why_no_vllm

GPU_BACKEND = "kvattn.integrations.vllm_backend.KVAttnGPUBackend"
REASONS = {
    "foreign_entry": "OWNER_MISMATCH",
    "early_free": "OWNER_MISMATCH",
    "lost_prefill": "RESERVED",
    "stale_prefix": "FREE",
}

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def runs():
    return Runs()


@pytest.fixture(scope="module")
def stock(runs):
    """vLLM's own attention (and kvattn's CPU layout), test_vllm.py's run of the scenario."""
    return runs.main()


@pytest.fixture(scope="module")
def gpu(runs):
    return runs.shared(
        "main-gpu-layout",
        lambda: runs.drive([("main-kvattn-gpu", DRIVER, True, ("main", "gpu"))]),
    )["main-kvattn-gpu"]


def test_gpu_layout_runs_kvattns_gpu_class_on_a_token_major_cache(gpu, stock):
    """The engine ran the GPU class on vLLM's GPU layout: the layer's cache is the logical
    ``[blocks, kv_heads, block_size, 2 * head_dim]`` view with token-major strides (a token's
    rows of every head side by side), where the CPU layout's run is head-major."""
    layout = gpu["layout"]
    assert (layout["backend"], layout["backend_class"], layout["impl"]) == (
        "KVATTN",
        "KVAttnGPUBackend",
        "KVAttnGPUImpl",
    )
    assert layout["kv_cache_layout"] == "LBNHC" and layout["cudagraph_mode"] == "NONE"
    blocks, heads, size, row = layout["shape"]
    assert layout["stride"] == [size * heads * row, row, heads * row, 1]
    cpu = stock["main-kvattn"]["layout"]
    assert (cpu["backend_class"], cpu["kv_cache_layout"]) == ("KVAttnBackend", "LBHNC")
    assert cpu["stride"] == [heads * size * row, size * row, row, 1]
    assert stock["main-stock"]["layout"]["backend_class"] == "CPUAttentionBackend"


def test_gpu_layout_matches_vllm_attention_with_no_refusal(gpu, stock):
    """Clean: the tokens and prefix-cache hits of vLLM's own attention, every page checked and
    none refused, no write dropped; the clean runs of every fault as on vLLM's attention."""
    own = stock["main-stock"]
    assert {n: r["tokens"] for n, r in gpu["equality"].items()} == {
        n: r["tokens"] for n, r in own["equality"].items()
    }
    assert [gpu["equality"][n]["cached"] for n in ("s2", "s3", "r3")] == [64, 64, 128]
    ledger = gpu["equality_ledger"]
    assert ledger["failures"] == 0 and ledger["pages_checked"] > 0
    assert ledger["counts"]["refused_pages"] == 0 and ledger["counts"]["dropped_writes"] == 0
    assert ledger["counts"]["prefix_hit_blocks"] > 0
    for fault in FAULTS:
        assert gpu[fault]["clean"] == own[fault]["clean"], fault
    assert gpu["failures_total"] == len(FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_gpu_layout_fails_only_the_victim_of_a_fault(gpu, stock, fault):
    """The twin: each of vLLM's bookkeeping faults (which change the victim's tokens on vLLM's
    attention: test_vllm.py) fails the victim alone, with the reason the CPU layout gives."""
    run, victim = gpu[fault], VICTIM[fault]
    assert run["injected"], "the fault was never injected"
    assert run["faulted"][victim]["finish_reason"] == "error"
    tokens, clean = run["faulted"][victim]["tokens"], run["clean"][victim]["tokens"]
    assert len(tokens) < len(clean) and tokens == clean[: len(tokens)]
    ((name, message),) = run["failures"]
    assert name == victim
    assert message.startswith("kvattn ownership check failed for request")
    assert REASONS[fault] in message and "logical page(s) 0 (block " in message
    for other, result in run["faulted"].items():
        if other != victim:
            assert result == run["clean"][other], other
    assert stock["main-stock"][fault]["faulted"][victim]["tokens"] != clean


def test_gpu_layout_refuses_fp8_caches_and_kv_connectors_at_setup(gpu):
    """An engine on the GPU layout with an fp8 cache or a KV connector stops as it is set up,
    naming it (the CPU layout runs both: test_vllm_variants.py, test_vllm.py)."""
    refused = gpu["refused"]
    assert refused["fp8"] == (
        "IntegrationError: kvattn.integrations.vllm does not support kv_cache_dtype 'fp8' on "
        "vLLM's GPU cache layout"
    )
    assert refused["connector"].startswith(
        "IntegrationError: kvattn.integrations.vllm does not support KV connectors on vLLM's "
        "GPU cache layout"
    )


def test_cuda_platform_gets_kvattn_for_decoder_layers(gpu):
    """vLLM's CUDA selection, through kvattn's hook: kvattn's GPU class for a decoder layer on
    sm_80 and sm_90, with sliding windows and sinks, and when ``--attention-backend KVATTN``
    names it."""
    selection = gpu["cuda_selection"]
    for case in ("default", "sm80", "named_kvattn", "window_sinks"):
        assert selection[case] == GPU_BACKEND, case


@pytest.mark.parametrize(
    "case, reason",
    [
        ("named_flash_attn", "attention backend FLASH_ATTN was selected"),
        ("sm100", "compute capability not supported"),
        ("mla", "MLA not supported"),
        ("fp8", "kv_cache_dtype not supported"),
        ("cross_attention", "attention type encoder_decoder not supported"),
        ("kv_connector", "KV connector not supported"),
    ],
)
def test_cuda_platform_refuses_layers_kvattn_does_not_check(gpu, case, reason):
    """The twin: a layer that would run unchecked (another backend named, an architecture
    kvattn's CUDA module is not built for, MLA, an fp8 cache, cross-attention, a KV connector)
    stops the engine with the reason, never falls back to vLLM's own backend."""
    answer = gpu["cuda_selection"][case]
    assert answer.startswith("IntegrationError: kvattn.integrations.vllm: ") and reason in answer

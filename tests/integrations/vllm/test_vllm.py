"""kvattn inside vLLM 0.32 (the CPU build), end to end, on a small random-weight Llama (GQA,
untied embeddings) that the tests build and save locally: no downloads.

vLLM lives in its own environment (``make vllm-env``: build/venv-vllm); the scenarios run there,
in vllm_driver.py, one engine per process, a run on vLLM's own CPU attention next to a run on
kvattn's (``KVATTN_VLLM=1``, the plugin's one setting). The tests here read their results.

Greedy tokens are compared exactly: both attentions compute a float32 softmax over the same K/V,
and the argmax over a 258-token vocabulary is stable under their rounding differences for these
weights. Every fault runs on both attentions: on vLLM's the victim's tokens change (the fault is
real), on kvattn's the victim fails with the ownership error and the other requests keep their
clean tokens.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest
import vllm_prompts as prompts
from vllm_scenarios import DRIVER, FAULTS, VICTIM, Runs

from kvattn_testing import engines
from kvattn_testing.engines import VENV_PY, why_no_vllm
from kvattn_testing.engines import env as _env

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def runs():
    return Runs()


@pytest.fixture(scope="module")
def main(runs):
    return runs.main()


def test_kvattn_matches_vllm_attention_with_chunked_prefill_and_prefix_caching(main):
    stock, kvattn = main["main-stock"]["equality"], main["main-kvattn"]["equality"]
    assert {n: r["tokens"] for n, r in kvattn.items()} == {n: r["tokens"] for n, r in stock.items()}
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == 8 for r in kvattn.values())
    # The prompt lengths (17 to 130 tokens, 64 a step) chunk the prefill; the later requests hit
    # the prefix cache on both attentions, and tokens stay informative.
    assert [kvattn[n]["cached"] for n in ("s2", "s3", "r3")] == [64, 64, 128]
    assert [stock[n]["cached"] for n in ("s2", "s3", "r3")] == [64, 64, 128]
    assert len({t for r in stock.values() for t in r["tokens"]}) > 20


def test_kvattn_ran_and_checked_pages(main):
    """The twin of the equality test: kvattn's run has no failure, and the clean runs of every
    fault match vLLM's own tokens."""
    kvattn = main["main-kvattn"]
    for fault in FAULTS:
        assert kvattn[fault]["clean"] == main["main-stock"][fault]["clean"]
    assert kvattn["failures_total"] == len(FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_changes_the_victims_answer_on_vllm_attention(main, fault):
    run = main["main-stock"][fault]
    victim = VICTIM[fault]
    assert run["injected"], "the fault was never injected"
    assert run["faulted"][victim]["finish_reason"] == "length"
    assert run["faulted"][victim]["tokens"] != run["clean"][victim]["tokens"]
    assert run["failures"] == []


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("foreign_entry", "OWNER_MISMATCH"),
        ("early_free", "OWNER_MISMATCH"),
        ("lost_prefill", "RESERVED"),
        # The stale block was freed after the overwriter's partial write; the reader's hit
        # expects owner 0 and leaves the tag as it is.
        ("stale_prefix", "FREE"),
    ],
)
def test_fault_fails_only_the_victim_on_kvattn(main, fault, reason):
    run = main["main-kvattn"][fault]
    victim = VICTIM[fault]
    assert run["injected"], "the fault was never injected"
    assert run["faulted"][victim]["finish_reason"] == "error"
    # Tokens sampled before the fault (from clean KV) stand; none after it.
    tokens, clean = run["faulted"][victim]["tokens"], run["clean"][victim]["tokens"]
    assert len(tokens) < len(clean) and tokens == clean[: len(tokens)]
    ((name, message),) = run["failures"]
    assert name == victim
    assert message.startswith("kvattn ownership check failed for request")
    assert reason in message and "model.layers.0.self_attn.attn" in message
    assert "logical page(s) 0 (block " in message
    for other, result in run["faulted"].items():
        if other != victim:
            assert result == run["clean"][other], other


@pytest.fixture(scope="module")
def disaggregated(runs):
    return runs.disaggregated()


def test_prefill_instance_refuses_the_long_prompt_and_sends_one_row(disaggregated):
    for backend in ("stock", "kvattn"):
        produced = disaggregated[f"produce-{backend}"]
        assert "maximum context length is 128" in produced["refused"]
        assert produced["files"] == [f"model.layers.{i}.self_attn.attn.safetensors" for i in (0, 1)]


def test_disaggregated_incident_leaks_on_vllm_attention(disaggregated):
    """vLLM's own attention answers the long prompt from one transferred row and pages that hold
    the earlier requests' KV: fluent-looking tokens, unlike the local answer."""
    stock, local = disaggregated["decode-stock"]["results"], disaggregated["local"]
    assert stock["long"]["finish_reason"] == "length" and len(stock["long"]["tokens"]) == 8
    assert stock["long"]["cached"] == 288  # the sender's claim
    assert stock["long"]["tokens"] != local["long"]["tokens"]
    assert stock["short"]["tokens"] == local["short"]["tokens"]


def test_disaggregated_incident_fails_the_request_on_kvattn(disaggregated):
    kvattn, local = disaggregated["decode-kvattn"], disaggregated["local"]
    results = kvattn["results"]
    assert results["long"]["finish_reason"] == "error" and results["long"]["tokens"] == []
    ((name, message),) = kvattn["failures"]
    assert name == "long"
    # One row arrived: page 0 is committed with one slot, the other eight stay RESERVED.
    assert "reads: UNWRITTEN on logical page(s) 0 (block" in message
    assert "reads: RESERVED on logical page(s) 1 (block" in message and "8 (block" in message
    # A whole transfer is committed and read, and the earlier requests are untouched.
    assert results["short"]["tokens"] == local["short"]["tokens"]
    assert results["short"]["cached"] == 32
    stock = disaggregated["decode-stock"]["results"]
    for i in range(3):
        assert results[f"filler{i}"] == stock[f"filler{i}"]


# -- the OpenAI-compatible server, multi-process as usual ---------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_the_incident_request_with_an_error(runs, disaggregated):
    """``vllm serve`` with KVATTN_VLLM=1 (engine core and worker in their own processes) as the
    decode instance: the short prompt gets its text (200), the long one an error, never a 200."""
    store = runs.dir / "serve-kvattn"
    shutil.rmtree(store, ignore_errors=True)
    shutil.copytree(runs.dir / "store-kvattn", store)
    transfer = {
        "kv_connector": "CheckedExampleConnector",
        "kv_connector_module_path": "kvattn.integrations.vllm_connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    env = _env(kvattn=True)
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]
    log_path = runs.dir / "serve.log"
    # A port found free can be taken by another suite's server before this one binds it: then
    # once more on another port (the SGLang suites do the same).
    for attempt in range(2):
        port = _free_port()
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [
                    str(VENV_PY),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(runs.model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--dtype",
                    "float32",
                    "--block-size",
                    "32",
                    "--enforce-eager",
                    "--max-model-len",
                    "512",
                    "--kv-cache-memory-bytes",
                    str(32 << 20),
                    "--max-num-batched-tokens",
                    "64",
                    "--no-enable-prefix-caching",
                    "--kv-transfer-config",
                    json.dumps(transfer),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            engines.wait_healthy(base, server, log_path, 240)
            break
        except RuntimeError as e:
            engines.stop_servers(server)
            if attempt or "Address already in use" not in str(e):
                raise
    try:
        body = dict(model=str(runs.model), max_tokens=8, temperature=0)
        status, short = engines.post(base + "/v1/completions", dict(body, prompt=prompts.SHORT))
        assert status == 200, short
        local = disaggregated["local"]["short"]["tokens"]
        assert short["choices"][0]["finish_reason"] == "length" and local
        status, long = engines.post(base + "/v1/completions", dict(body, prompt=prompts.LONG))
        assert status >= 400 and "choices" not in long, long
        assert "error" in long
    finally:
        engines.stop_servers(server)
    text = log_path.read_text()
    assert "kvattn: ownership-checked attention in place of vLLM's CPU attention" in text
    assert "kvattn ownership check failed for request" in text
    assert "reads: RESERVED on logical page(s) 1 (block" in text


# -- prefix-cache hits on blocks written in the same step ------------------------------------


@pytest.fixture(scope="module")
def same_step(runs):
    return runs.shared(
        "same_step",
        lambda: runs.drive(
            [
                ("same-step-stock", DRIVER, False, ("same_step",)),
                ("same-step-kvattn", DRIVER, True, ("same_step",)),
            ]
        ),
    )


@pytest.mark.parametrize(
    "batch, hits", [("duplicate", [0, 64]), ("parallel", [64]), ("system_prompt", [0, 64, 64])]
)
def test_same_step_prefix_hits_pass_with_vllm_defaults(same_step, batch, hits):
    """A request admitted in the step that writes the blocks it hits (a duplicate prompt, the
    second sample of ``n=2``, a shared system prompt) gets vLLM's own tokens and hit count; the
    twin, a hit whose block holds another prompt's tokens, is the differential suite's
    ``same_step_collision`` fault."""
    stock, kvattn = same_step["same-step-stock"], same_step["same-step-kvattn"]
    assert kvattn[batch] == stock[batch]
    assert [r["cached"] for r in stock[batch]] == hits
    assert all(f == "length" for r in kvattn[batch] for f in r["finish"])
    assert kvattn["failures"] == []

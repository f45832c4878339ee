"""The engine ledger's failure of one request, from the per-layer reports and writer results of
one forward: summarised per request across layers, the writer's dropped writes (usually the cause)
before the refused reads, read back once by ``Ledger.finish``. Needs no engine install: the ledger
is plain kvattn code. And the vLLM plugin's refusals when an engine is set up (no vLLM install
either), and the SGLang backend's version refusal and receive accounting (no SGLang install)."""
import torch

import kvattn
from kvattn import Violation, WriteDrop
from kvattn.integrations.ledger import Ledger

NOT_HELD = int(WriteDrop.NOT_HELD)


def _failed_step(layers: int, drop: bool, refuse: bool) -> dict:
    """A forward of ``layers`` layers where request 1's new tokens were dropped NOT_HELD in every
    layer (an early free) and its two pages then refused as UNWRITTEN and RESERVED in every layer;
    request 0 is clean. Returns what ``finish`` says of it."""
    ledger = Ledger(16)
    step = ledger.start_step(["req_0", "req_1"], [1, 2], [1, 1],
                             torch.tensor([[3, 0, 0], [5, 6, 0]], dtype=torch.int32),
                             torch.zeros(2, 3, dtype=torch.int64), [1, 6])
    for layer in range(layers):
        reasons = torch.tensor([[0, 0, 0], [int(Violation.UNWRITTEN), int(Violation.RESERVED), 0]]
                               if refuse else [[0, 0, 0], [0, 0, 0]], dtype=torch.int8)
        count = (reasons != 0).sum(1).to(torch.int32)
        bits = torch.tensor([0, int(Violation.UNWRITTEN | Violation.RESERVED) if refuse else 0],
                            dtype=torch.int32)
        step.reports.append((f"layer {layer}", kvattn.OwnershipReport(
            count, bits, torch.tensor([1, 2]), reasons, torch.zeros(2, dtype=torch.int32))))
        step.refused += count
        drops = torch.tensor([0, NOT_HELD if drop else 0], dtype=torch.int8)
        step.drops.append((f"layer {layer}", drops))
        step.dropped += (drops != 0).to(torch.int32)
    failed = ledger.finish()
    assert list(failed) == ["req_1"] and ledger.failures[0][0] == "req_1"
    assert ledger.counts["refused_pages"] == (2 * layers if refuse else 0)
    assert ledger.counts["dropped_writes"] == (layers if drop else 0)
    return failed["req_1"][2]


def test_failure_names_the_dropped_writes_of_every_layer():
    message = _failed_step(30, drop=True, refuse=True)
    assert "30 NOT_HELD dropped write(s)" in message and "in 30 of 30 layer(s)" in message
    assert "reads: RESERVED on logical page(s) 1 (page 6), in 30 of 30 layer(s)" in message
    assert "reads: UNWRITTEN on logical page(s) 0 (page 5), in 30 of 30 layer(s)" in message
    assert "layer 0, layer 1, layer 2, layer 3, ... (26 more)" in message
    assert message.index("writes:") < message.index("reads:")
    assert len(message.splitlines()) == 4  # heading, writes, two read lines: not one per layer


def test_failure_without_drops_shows_reads_only():
    """The twin: a request whose writes all landed shows no writes line; one with drops only shows
    no reads line."""
    reads_only = _failed_step(3, drop=False, refuse=True)
    assert "writes:" not in reads_only and "in 3 of 3 layer(s)" in reads_only
    writes_only = _failed_step(3, drop=True, refuse=False)
    assert "reads:" not in writes_only and "3 NOT_HELD dropped write(s)" in writes_only


def test_a_clean_step_fails_nobody_and_counts_its_checks():
    ledger = Ledger(16)
    step = ledger.start_step(["a"], [7], [1], torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, 1, dtype=torch.int64), [1])
    step.pages_checked += 4
    assert ledger.finish() == {} and ledger.failures == []
    assert ledger.pages_checked == 4 and ledger.forwards == 1
    assert ledger.finish() == {} and ledger.forwards == 1  # no step: nothing read


def _vllm_config(cache_dtype="auto", speculative=None, multimodal=False, encoder_decoder=False):
    from types import SimpleNamespace
    return SimpleNamespace(speculative_config=speculative,
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           scheduler_config=SimpleNamespace(async_scheduling=False),
                           model_config=SimpleNamespace(is_multimodal_model=multimodal,
                                                        is_encoder_decoder=encoder_decoder))


def test_vllm_plugin_takes_the_fp8_caches_it_writes():
    """vLLM's fp8 cache dtypes and the n-gram proposer are accepted when the engine is set up
    (plain kvattn code: no vLLM install needed)."""
    from kvattn.integrations import vllm as integration
    for dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        integration._refuse_unsupported(_vllm_config(dtype))
    # The n-gram proposer's drafts are verified by a causal extend (tests/test_vllm_spec.py).
    from types import SimpleNamespace
    integration._refuse_unsupported(_vllm_config(speculative=SimpleNamespace(method="ngram")))


def test_vllm_plugin_refuses_other_cache_dtypes_and_speculation_naming_them():
    """The twin: a cache dtype it does not write, speculative decoding by another proposer,
    multimodal and encoder-decoder models are refused with the reason."""
    import pytest

    from kvattn.integrations import vllm as integration
    with pytest.raises(integration.IntegrationError,
                       match=r"KV cache dtype 'fp8_inc' \(use 'auto' or one of 'fp8', 'fp8_e4m3', "
                             r"'fp8_e5m2'\)"):
        integration._refuse_unsupported(_vllm_config("fp8_inc"))
    from types import SimpleNamespace
    for method in ("eagle", "eagle3", "draft_model", "mtp", "suffix"):
        config = _vllm_config(speculative=SimpleNamespace(method=method))
        with pytest.raises(integration.IntegrationError,
                           match=rf"speculative decoding with method '{method}' "
                                 r"\(supported: 'ngram'"):
            integration._refuse_unsupported(config)
    with pytest.raises(integration.IntegrationError, match="multimodal models"):
        integration._refuse_unsupported(_vllm_config(multimodal=True))
    with pytest.raises(integration.IntegrationError, match="encoder-decoder models"):
        integration._refuse_unsupported(_vllm_config(encoder_decoder=True))


def test_sglang_backend_refuses_other_versions_naming_the_tested_one():
    import pytest

    from kvattn.integrations import sglang
    sglang.check_version("0.5.23")
    with pytest.raises(RuntimeError, match=r"SGLang 0\.5\.22 is not supported.*\['0\.5\.23'\]"):
        sglang.check_version("0.5.22")


def test_sglang_receivers_account_for_what_arrived_not_for_success():
    from types import SimpleNamespace

    from kvattn.integrations import sglang

    class FakeKVReceiver:
        pass

    class MooncakeKVReceiver:
        pass
    assert sglang.received_tokens(FakeKVReceiver())[0] == 0
    count, how = sglang.received_tokens(MooncakeKVReceiver())
    assert count == 0 and "reports completion, not what arrived" in how
    counted = SimpleNamespace(kvattn_received_tokens=lambda: 7)
    assert sglang.received_tokens(counted) == (7, "SimpleNamespace counted 7 token(s) arrived")

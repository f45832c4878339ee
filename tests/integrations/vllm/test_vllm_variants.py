"""Models whose attention has a switch of kvattn.variants, under vLLM 0.32 (the CPU build) with
kvattn in place of vLLM's CPU attention: a Mistral (a sliding window in every layer), a Gemma 2
(logit soft-cap, every layer full attention), a Bloom (ALiBi), a gpt-oss (sinks, no sliding
window), a Gemma 2 and a gpt-oss whose window and full layers alternate (two KV cache groups),
random weights at tiny shapes (kvattn.conformance.model); and the Llama on fp8 KV caches (e4m3 and
e5m2, ``--kv-cache-dtype fp8`` / ``fp8_e5m2``).

Each model runs in vllm_driver.py's ``variants`` scenario, once on vLLM's attention and once
on kvattn's, with chunked prefill and a prefix-cache hit: greedy tokens equal and the sampled
tokens' log-probabilities within ``LOGPROB_TOL``; a foreign block-table entry fails only its
victim on kvattn and changes the victim's answer on vLLM's. A score switch turned off in every
layer changes the answer on both attentions (so the equality is the switch's, and the switch
reaches the kernel). The window's twin: vLLM frees the blocks the window leaves inside a live
request and hands them out again (a small pool), the ledger follows, vLLM's other bookkeeping
faults (an early free, a lost prefill, a stale prefix hit) on a block inside the window fail only
their victim, and a foreign entry where the window has left the victim's first block is neither
read nor reported. The fp8 caches' twins:
every KV write kvattn makes is the code vLLM's own writer stores, and the model's own cache dtype
answers otherwise.
"""

from __future__ import annotations

import pytest
import torch

from kvattn_testing import engines
from kvattn_testing.engines import ROOT, why_no_vllm

DRIVER = ROOT / "tests" / "integrations" / "vllm" / "vllm_driver.py"
FAMILIES = {
    "mistral": "sliding_window",
    "gemma2": "logits_soft_cap",
    "bloom": "alibi_slopes",
    "gpt-oss": "sinks",
    "gemma2-hybrid": "sliding_window",
    "gpt-oss-hybrid": "sliding_window",
    "llama-fp8": "fp8",
    "llama-fp8-e5m2": "fp8_e5m2",
}
WINDOWS = [name for name, switch in FAMILIES.items() if switch == "sliding_window"]
FP8 = [name for name, switch in FAMILIES.items() if switch.startswith("fp8")]  # vLLM cache dtypes
SCORES = [name for name in FAMILIES if name not in WINDOWS + FP8]
# vLLM's bookkeeping faults of test_vllm.py, on a block inside the victim's window: the
# victim, and the reason its read is refused.
WINDOW_FAULTS = {
    "early_free": ("victim", "OWNER_MISMATCH"),
    "lost_prefill": ("victim", "RESERVED"),
    "stale_prefix": ("reader", "FREE"),  # test_vllm.py: the hit leaves the freed block as is
}
HYBRIDS = [name for name in FAMILIES if name.endswith("-hybrid")]  # two KV cache groups
# Both attentions compute a float32 softmax over the same float32 K/V in a different order: a
# log-probability differs by a few float32 roundings per layer (~1e-6 relative), far below the
# change that turning a switch off makes (SWITCH_EFFECT_MIN).
LOGPROB_TOL = 1e-3
SWITCH_EFFECT_MIN = 1e-2

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def runs():
    return engines.Runs()


def _model(name: str) -> str:
    """The model family of kvattn.conformance.model (an fp8 cache runs the Llama)."""
    return "llama" if name in FP8 else name


def _results(runs, name):
    switch = FAMILIES[name]
    if switch.startswith("fp8") and not (
        torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    ):
        # vLLM's CPU platform refuses an fp8 cache at setup elsewhere (cpu_attn._get_attn_isa):
        # no engine of its own to compare with, and no writer of its own to compare codes with.
        pytest.skip(
            "vLLM's CPU attention keeps an fp8 KV cache only on x86 with AVX-512 or AMX; "
            "this CPU has neither"
        )
    results = runs.shared(
        f"variants-{name}",
        lambda: runs.drive(
            [
                (f"{name}-stock", DRIVER, False, ("variants", switch)),
                (f"{name}-kvattn", DRIVER, True, ("variants", switch)),
            ],
            family=_model(name),
        ),
    )
    return name, results[f"{name}-stock"], results[f"{name}-kvattn"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, runs):
    return _results(runs, request.param)


@pytest.fixture(scope="module", params=SCORES)
def score_family(request, runs):
    return _results(runs, request.param)


@pytest.fixture(scope="module", params=WINDOWS)
def window(request, runs):
    return _results(runs, request.param)


def _max_gap(a: dict, b: dict) -> float:
    """The largest difference of the sampled tokens' log-probabilities of the same requests."""
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name]["logprobs"], b[name]["logprobs"]))


def _same(a: dict, b: dict) -> bool:
    """The same answers: tokens equal, log-probabilities within LOGPROB_TOL."""
    return {n: r["tokens"] for n, r in a.items()} == {
        n: r["tokens"] for n, r in b.items()
    } and _max_gap(a, b) < LOGPROB_TOL


def test_kvattn_matches_vllm_attention(family):
    name, stock, kvattn = family
    assert kvattn["equality"].keys() == stock["equality"].keys()
    for request, result in stock["equality"].items():
        assert result["finish_reason"] == "length", request
        assert kvattn["equality"][request]["tokens"] == result["tokens"], request
        assert kvattn["equality"][request]["cached"] == result["cached"], request
    assert stock["equality"]["s3"]["cached"] == (128 if name in WINDOWS else 64)  # the hit happened
    assert _max_gap(kvattn["equality"], stock["equality"]) < LOGPROB_TOL
    # The faults' victims only: the foreign entries (one per KV cache group), and under a window
    # the other bookkeeping faults.
    faults = (2 if name.endswith("-hybrid") else 1) + (len(WINDOW_FAULTS) if name in WINDOWS else 0)
    assert kvattn["failures_total"] == faults


def test_the_switch_changes_the_answer_on_both_attentions(score_family):
    """The twin of the equality: without the switch, both attentions answer otherwise, and alike."""
    name, stock, kvattn = score_family
    for run in (stock, kvattn):
        assert run["layers_switched"] >= 2, name
        assert _max_gap(run["switch_off"], run["equality"]) > SWITCH_EFFECT_MIN
    assert _max_gap(kvattn["switch_off"], stock["switch_off"]) < LOGPROB_TOL


def _fails_only_the_victim(
    real: dict, run: dict, victim: str = "victim", reason: str = "OWNER_MISMATCH"
) -> None:
    """``real``: the fault on vLLM's attention, ``run``: on kvattn's."""
    assert real["injected"] and real["failures"] == []
    # The fault is real on vLLM's attention: the victim's answer moves (its tokens may not, on a
    # model this small, so its log-probabilities are compared).
    hurt, clean = {"v": real["faulted"][victim]}, {"v": real["clean"][victim]}
    assert not _same(hurt, clean) and _max_gap(hurt, clean) > SWITCH_EFFECT_MIN
    assert run["injected"]
    assert _same(run["clean"], real["clean"])
    assert run["faulted"][victim]["finish_reason"] == "error"
    ((name, message),) = run["failures"]
    assert name == victim and reason in message
    # The others answer as in the clean run (their batches differ once the victim is gone, so
    # their log-probabilities may move by float32 roundings: LOGPROB_TOL).
    others = {n: r for n, r in run["faulted"].items() if n != victim}
    assert others and _same(others, {n: run["clean"][n] for n in others})


def test_a_foreign_entry_fails_only_the_victim_on_kvattn(family):
    """In the table of the first KV cache group (a hybrid's window layers)."""
    _, stock, kvattn = family
    _fails_only_the_victim(stock["foreign_entry"], kvattn["foreign_entry"])


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, runs):
    return _results(runs, request.param)


def test_a_foreign_entry_in_the_full_layers_group_fails_only_the_victim(hybrid):
    _, stock, kvattn = hybrid
    _fails_only_the_victim(stock["foreign_entry_full"], kvattn["foreign_entry_full"])
    assert "layers.1." in kvattn["foreign_entry_full"]["failures"][0][1]  # the full layer refused


def test_the_ledger_follows_the_blocks_the_window_leaves(window):
    """vLLM freed blocks out of live requests' windows and handed blocks out again from a pool of
    20; the tokens above are equal all the same."""
    _, stock, kvattn = window
    assert kvattn["counts"]["window_freed_blocks"] > 0
    assert kvattn["counts"]["cached_blocks_reused"] > 0
    assert stock["counts"] == {}


@pytest.mark.parametrize("fault", list(WINDOW_FAULTS))
def test_a_bookkeeping_fault_inside_the_window_fails_only_its_victim(window, fault):
    _, stock, kvattn = window
    victim, reason = WINDOW_FAULTS[fault]
    _fails_only_the_victim(stock[fault], kvattn[fault], victim, reason)


def test_a_foreign_entry_the_window_has_left_is_neither_read_nor_reported(window):
    """The twin of the foreign entry inside the window (which fails its victim, above)."""
    _, stock, kvattn = window
    for run in (stock["before_window"], kvattn["before_window"]):
        assert run["injected"] and run["failures"] == []
        assert _same(run["faulted"], run["clean"])
    assert _same(kvattn["before_window"]["clean"], stock["before_window"]["clean"])


@pytest.fixture(scope="module", params=FP8)
def fp8(request, runs):
    return _results(runs, request.param)


def test_kvattn_stores_vllm_s_own_fp8_codes(fp8):
    """Every KV write of the kvattn engine, done again by vLLM's CPU cache writer on the same
    keys, values and scales: the same code in every written element (K laid out token-major by
    kvattn, dimension-major by vLLM)."""
    _, stock, kvattn = fp8
    tally = kvattn["fp8_writes"]
    assert tally["calls"] > 0 and tally["elements"] > 0
    assert tally["mismatches"] == 0
    assert stock["fp8_writes"] == {}


def test_the_rounding_agrees_with_vllm_s_writer_on_hard_values(fp8):
    """Over the float32 range with both signs, zeros, infinities, NaN and values past the
    format's largest, three source dtypes and three scales: vLLM's writer and kvattn's differ
    only where kvattn's rule says (a negative float32-subnormal quotient, -0 there, +0 here)."""
    _, _, kvattn = fp8
    probe = kvattn["fp8_probe"]
    assert probe["elements"] > 100_000
    assert probe["subnormal_sign"] > 0  # the probe reaches the documented case
    assert probe["mismatches"] == probe["subnormal_sign"]


def test_the_fp8_cache_changes_the_answer_on_both_attentions(fp8, runs):
    """The twin of the equality: the same requests on the model's own dtype answer otherwise (the
    cache is quantised, and kvattn reads it as such)."""
    _, stock, kvattn = fp8
    plain = runs.shared(
        "variants-llama-auto",
        lambda: runs.drive(
            [("llama-auto-stock", DRIVER, False, ("variants", "auto"))], family="llama"
        ),
    )
    wide = plain["llama-auto-stock"]["equality"]
    for run in (stock, kvattn):
        assert _max_gap(run["equality"], wide) > SWITCH_EFFECT_MIN

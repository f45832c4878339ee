"""kvattn's SGLang backend against SGLang 0.5.23's own classes (``make sglang-env``:
build/venv-sglang; sglang_driver.py runs the scenarios there, once per test run, and these
tests read its JSON). The driver plays the scheduler's part with SGLang's pools, allocators,
request pool, ``Req``, ``ForwardBatch``, layers, torch-native backend and fake disaggregation
receiver, step by step, so each scenario hits its exact case (test_sglang_engine.py runs SGLang's
engine itself).

Outputs are compared with SGLang's torch-native attention at float32: both compute a float32
softmax over the same K/V (kvattn's online softmax in another order), so they agree to a few
float32 ulps of the O(1) outputs; 1e-5 leaves a margin of 20x over the largest gap seen (4.8e-7),
and a refused or foreign page moves an output by more than 0.1.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvattn_testing.engines import ROOT, Runs, why_not_ready

VENV = ROOT / "build" / "venv-sglang"
DRIVER = ROOT / "tests" / "integrations" / "sglang" / "sglang_driver.py"
TOL = 1e-5
pytestmark = pytest.mark.slow  # a minute of SGLang's classes in its environment

if why_not_ready("SGLang", "venv-sglang", "sglang-env"):
    pytest.skip(why_not_ready("SGLang", "venv-sglang", "sglang-env"), allow_module_level=True)


def _drive() -> dict:
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(DRIVER)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError("sglang_driver.py failed:\n" + done.stderr[-4000:])
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs() -> dict:
    return Runs().shared("sglang-scenarios", _drive)


@pytest.mark.parametrize(
    "scenario",
    [
        "equality-1",
        "equality-16",
        "overlap-1",
        "overlap-16",
        "mla-equality-16",
        "mla-overlap-1",
        "mla-split-16",
    ],
)
def test_kvattn_equals_torch_native_on_sglang_pools(runs, scenario):
    """Chunked prefill, a radix-cache hit, a mixed batch (two extends and a decode), decodes
    across a page boundary, then a second turn whose prompt is the first request's tokens (a hit
    on pages its decodes filled), GQA (4 query heads on 2 KV heads), two layers. Under overlap
    scheduling the forward runs before the previous token reaches the request's output_ids.
    ``mla-``: SGLang's MLA pool, 4 query heads reading one latent row per token (32 + 16 dims),
    written through the pool's ``set_kv_buffer`` and read by kvattn's MLA extend and decode;
    ``mla-split-``: one layer's rows handed to kvattn's backend as latent and RoPE parts
    (``q_rope``/``k_rope``, written through ``set_mla_kv_buffer``)."""
    r = runs[scenario]
    page_size = int(scenario.rsplit("-", 1)[1])
    assert len(r["gaps"]) == page_size + 7
    assert max(r["gaps"]) < TOL
    assert r["aborted"] == {"a": None, "b": None, "c": None, "t": None}
    assert r["counts"]["refused_pages"] == 0 and r["counts"]["dropped_writes"] == 0
    # SGLang's radix tree matched these; kvattn proved each page of them (a token per page at
    # page size 1), the decode-filled ones of the second turn included.
    assert (r["hit"], r["turn_hit"]) == ((16, 26) if page_size == 1 else (32, 48))
    assert r["counts"]["prefix_hit_pages"] == (r["hit"] + r["turn_hit"]) // page_size


@pytest.mark.parametrize("scenario", ["fp8-e4m3-16", "fp8-e4m3-1", "fp8-e5m2-16"])
def test_fp8_pools_hold_sglang_s_codes_and_read_as_torch_native(runs, scenario):
    """The equality scenario over an fp8 pool (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``: uint8
    bytes of the format): every K and V byte kvattn's writer stored equals the byte SGLang's own
    ``set_kv_buffer`` stored (its divide-and-cast: nearest-even, e4m3 saturating), outputs as
    torch-native's, which reads the same codes, and nothing refused."""
    r = runs[scenario]
    assert r["codes_compared"] > 10_000 and r["codes_different"] == 0
    assert max(r["gaps"]) < TOL
    assert r["aborted"] == {"a": None, "b": None, "c": None, "t": None}
    assert r["counts"]["refused_pages"] == 0 and r["counts"]["dropped_writes"] == 0
    page_size = int(scenario.rsplit("-", 1)[1])
    assert r["counts"]["prefix_hit_pages"] == (r["hit"] + r["turn_hit"]) // page_size


def test_plain_and_fp8_pools_run_and_other_dtypes_are_refused(runs):
    """SGLang's MHA pool of the model's float dtype or of an fp8 format is taken; another KV dtype
    is refused at setup, naming it and what is taken."""
    r = runs["pool-refusals"]
    assert r["float32"] is None and r["float8_e4m3fn"] is None and r["float8_e5m2"] is None
    assert "KV cache dtype torch.int8 (the model's float dtype, float8_e4m3fn or" in r["int8"]


def test_mla_pools_run_in_float_dtypes_and_fp8_or_speculation_are_refused(runs):
    r = runs["mla-refusals"]
    assert r["float32"] is None and r["bfloat16"] is None
    assert "MLA KV cache dtype torch.float8_e4m3fn" in r["float8_e4m3fn"]
    # A P/D decode instance and HiCache: transfers and host copies are attested as K/V's.
    assert r["decode"] is None and r["hicache"] is None
    assert "speculative decoding with MLATokenToKVPool (the MLA extend takes no tree" in r["ngram"]


def test_speculative_row_moves_stay_inside_the_request_s_pages(runs):
    """Speculative decoding moves accepted drafts' rows into place through the pool's
    ``move_kv_cache``, past ``set_kv_buffer``: a move within A's own pages happens and A reads on;
    the twin also moves a row of B's into A's page, which is refused: the row stays out, the page
    is released, and A alone fails at its next forward, naming it."""
    clean, fault = runs["moves-clean"], runs["moves-fault"]
    for r in (clean, fault):
        assert r["own_row_moved"] and r["foreign_row_kept_out"]
        assert r["counts"]["moved_rows"] == 1 and r["aborted"]["B"] is None
    assert clean["aborted"]["A"] is None and "refused_moves" not in clean["counts"]
    assert fault["counts"]["refused_moves"] == 1
    assert "reads: FREE on logical page(s) 1 (page " in fault["aborted"]["A"]


def test_configurations_kvattn_does_not_run_are_refused_naming_them(runs):
    r = runs["config-refusals"]
    assert "KV pool SWAKVPool (MHATokenToKVPool and MLATokenToKVPool only" in r["swa-pool"]
    assert r["ngram"] is None  # its verify forwards run (test_sglang_spec.py)
    assert "speculative decoding with overlap scheduling" in r["ngram-overlap"]
    assert "speculative decoding in a decode instance (not run)" in r["ngram-decode"]
    assert "speculative decoding with EAGLE (supported: NGRAM, which runs no draft" in r["eagle"]
    assert "DP attention" in r["dp-attention"]


def test_fp8_radix_hit_on_changed_pages_fails_closed(runs):
    """The twin over an fp8 pool: a match whose pages were evicted and rewritten by another
    request is refused (OWNER_MISMATCH), and the evicted bytes, NaN codes where the other request
    did not write, never reach R's output."""
    r = runs["prefix-stale-fp8-16"]
    assert r["kvattn"]["hit"] == 32 and r["kvattn"]["hit_is_w"]
    assert r["torch_native"]["aborted"]["R"] is None and r["r_gap"] > 0.1
    assert "reads: OWNER_MISMATCH on logical page(s) 0 (page " in r["kvattn"]["aborted"]["R"]
    assert r["r_kvattn_finite"]
    assert r["kvattn"]["aborted"]["D"] is None and r["d_gap"] < TOL


def test_fused_rotary_kv_writes_are_off_and_beams_refused_under_kvattn(runs):
    """Models that store K/V from their rotary kernel (past set_kv_buffer) ask
    enable_fused_set_kv_buffer: under a kvattn engine the hook answers no. A beam request's
    member rows would hold no lease: refused with the reason (None lets it through)."""
    g = runs["guards"]
    assert g["torch_native"] == {"fused": True, "beam": None}
    assert g["kvattn"]["fused"] is False
    assert "not supported with --attention-backend kvattn" in g["kvattn"]["beam"]


@pytest.mark.parametrize("scenario", ["incident-16", "incident-1", "mla-incident-16"])
def test_incident_fake_receiver_success_is_refused(runs, scenario):
    r = runs[scenario]
    page_size = int(scenario.rsplit("-", 1)[1])
    stock, mine = r["torch_native"], r["kvattn"]
    assert stock["receiver_success"] and mine["receiver_success"]
    assert stock["aborted"]["B"] is None  # SGLang's attention answers
    assert r["b_gap"] > 0.1
    message = mine["aborted"]["B"]
    assert mine["finish"]["type"] == "abort" and mine["finish"]["status_code"] == 500
    assert stock["finish"] is None
    assert "FakeKVReceiver moves no bytes: 0 tokens arrived; 0 page(s) committed" in message
    assert "reads: RESERVED on logical page(s) 0 (page " in message
    pages = 4 if page_size == 16 else 5  # B's prompt: 3 * 16 + 2 tokens, or 5 at page size 1
    assert mine["counts"]["refused_pages"] == pages * 2  # every page, in both layers
    assert mine["aborted"]["C"] is None and r["c_gap"] < TOL
    assert r["b_kvattn_finite"]  # A's freed bytes are NaN under kvattn: none reached an output
    if page_size == 16:
        # A's freed pages were preallocated for B: SGLang's attention reads A's KV.
        assert stock["reused_pages"] == mine["reused_pages"] == [2, 3, 4]
        assert r["b_kvattn_norm"] == 0.0  # nothing of B's is readable: output 0


@pytest.mark.parametrize("scenario", ["transfer-16", "mla-transfer-16"])
def test_transfer_that_arrived_and_was_counted_reads_clean(runs, scenario):
    """The incident's clean twin: the transport wrote B's KV into the preallocated pages and
    counted every token; B decodes as on SGLang's attention."""
    r = runs[scenario]
    assert r["kvattn"]["aborted"] == {"B": None, "C": None}
    assert r["kvattn"]["counts"]["received_tokens"] == 50
    assert r["kvattn"]["counts"]["refused_pages"] == 0
    assert r["b_gap"] < TOL and r["c_gap"] < TOL


def test_placeholder_one_token_commits_one_slot(runs):
    r = runs["placeholder-16"]
    message = r["kvattn"]["aborted"]["B"]
    assert "counted 1 token(s) arrived; 1 page(s) committed" in message
    assert "UNWRITTEN on logical page(s) 0 (page 2)" in message
    assert "RESERVED on logical page(s) 1 (page 3), 2 (page 4), 3 (page 5)" in message
    assert r["torch_native"]["aborted"]["B"] is None and r["b_gap"] > 0.1
    assert r["kvattn"]["aborted"]["C"] is None and r["c_gap"] < TOL
    assert r["b_kvattn_finite"]  # the NaN of A's bytes past the one committed slot is not read


@pytest.mark.parametrize("scenario", ["prefix-clean-16", "mla-prefix-clean-16"])
def test_radix_hit_on_unchanged_pages_reads_them(runs, scenario):
    r = runs[scenario]
    assert r["kvattn"]["hit"] == 32 and r["kvattn"]["hit_is_w"]
    assert r["kvattn"]["aborted"] == {"R": None, "D": None}
    assert r["kvattn"]["counts"]["prefix_hit_pages"] == 2
    assert r["kvattn"]["counts"]["refused_pages"] == 0
    assert r["r_gap"] < TOL and r["d_gap"] < TOL


@pytest.mark.parametrize(
    "scenario,reason",
    [
        ("prefix-stale-16", "OWNER_MISMATCH"),
        ("prefix-stale-1", "FREE"),
        ("mla-prefix-stale-16", "OWNER_MISMATCH"),
    ],
)
def test_radix_hit_on_changed_pages_fails_closed(runs, scenario, reason):
    """R's match was not locked and the tree evicted its pages before R ran: at page size 16 they
    were reused and rewritten by another request (SGLang's attention reads its KV), at page size 1
    they are free."""
    r = runs[scenario]
    page_size = int(scenario.rsplit("-", 1)[1])
    assert r["kvattn"]["hit"] == 2 * page_size and r["kvattn"]["hit_is_w"]
    assert r["torch_native"]["aborted"]["R"] is None and r["r_gap"] > 0.1
    assert r["torch_native"]["x_reused"] == (page_size == 16)
    message = r["kvattn"]["aborted"]["R"]
    assert f"reads: {reason} on logical page(s) 0 (page " in message
    assert r["r_kvattn_finite"]  # the evicted pages are NaN under kvattn where X did not write
    assert r["kvattn"]["counts"]["unproven_hit_pages"] == 2
    assert r["kvattn"]["aborted"]["D"] is None and r["d_gap"] < TOL


def test_radix_hits_keep_to_their_cache_salt(runs):
    """SGLang's tree keys on the cache salt: R (another salt) computes its own pages, R2 (W's
    salt) hits W's and reads them; nothing refused, kvattn equals SGLang's attention."""
    r = runs["domains-clean-16"]
    for kind in ("torch_native", "kvattn"):
        assert r[kind]["hits"] == {"R": 0, "R2": 32}
        assert r[kind]["aborted"] == {"R": None, "R2": None, "D": None}
    assert r["kvattn"]["counts"]["prefix_hit_pages"] == 2
    assert r["kvattn"]["counts"]["refused_pages"] == 0
    assert max(r["R_gap"], r["R2_gap"], r["D_gap"]) < TOL


def test_a_radix_hit_across_cache_salts_fails_closed(runs):
    """The twin: the tree's keys leave the salt out, so R hits W's pages under another tenant's
    salt. SGLang's attention reads them (the same bytes: the tenant boundary is what is crossed);
    kvattn's ledger digests the salt with the tokens, cannot prove the pages are R's, and fails
    R alone: R2 (a hit in W's own salt) and D read as SGLang's attention does."""
    r = runs["domains-fault-16"]
    assert r["torch_native"]["hits"]["R"] == 32 and r["torch_native"]["aborted"]["R"] is None
    message = r["kvattn"]["aborted"]["R"]
    assert "reads: OWNER_MISMATCH on logical page(s) 0 (page " in message
    assert r["kvattn"]["counts"]["unproven_hit_pages"] == 2
    assert r["kvattn"]["aborted"]["R2"] is None and r["kvattn"]["aborted"]["D"] is None
    assert r["R2_gap"] < TOL and r["D_gap"] < TOL


def test_plugin_registers_through_sglang_entry_points(runs):
    r = runs["plugin"]
    assert "kvattn=kvattn.integrations.sglang_backend:register" in r["entry_points"]
    assert not r["before"] and r["after"] and r["factory"] == "create_backend"
    assert r["parsed"] == "kvattn"
    # HookRegistry wrapped the transfer commit, the beam check and the fused-write switch; a model
    # module imported afterwards binds the wrapped switch.
    assert r["hooked"] == [True, True, True] and r["late_import_hooked"]


def test_streaming_session_turn_keeps_the_row_lease(runs):
    """A session's next turn is a new Req on the same row: its own pages read clean (one lease
    for both turns), within tolerance of SGLang's attention."""
    r = runs["session-clean-16"]
    assert r["kvattn"]["aborted"] == {"s1": None, "s2": None}
    assert r["kvattn"]["counts"]["leases"] == 1 and r["kvattn"]["counts"]["refused_pages"] == 0
    assert r["gap"] < TOL


def test_streaming_session_fault_aborts_the_live_turn(runs):
    """The row's first page freed under the session and rewritten by X: SGLang's attention reads
    X's KV; kvattn aborts the turn that reads it (the new Req), not the finished first turn."""
    r = runs["session-fault-16"]
    assert r["torch_native"]["aborted"]["s2"] is None and r["gap"] > 0.1
    assert r["kvattn"]["aborted"]["s1"] is None
    assert "reads: OWNER_MISMATCH on logical page(s) 0 (page 1)" in r["kvattn"]["aborted"]["s2"]

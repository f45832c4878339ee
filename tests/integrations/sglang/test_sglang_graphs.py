"""kvattn's SGLang backend under SGLang 0.5.23's decode CUDA graphs, tested on a CPU: nothing is
captured here (no GPU), so the capture/replay metadata path runs on CPU tensors.

- Through SGLang's own replay pieces (``sglang_graph_driver.py`` in build/venv-sglang: its static
  buffers, its padding fill and replay view, the backend's capture and replay methods, the
  captured region run again per replay on the same buffers), against kvattn's eager path and
  SGLang's torch-native attention on the same steps: clean, a foreign page in one request's
  table, a replay whose refill was skipped, padded rows.
- The graph step of the engine-neutral ledger (kvattn only): what the captured region reads on
  the host (nothing), and what a replay nobody refilled reads (nothing).

Tolerances as test_sglang.py: float32 softmax in another order agrees to a few ulps; a refused or
foreign page moves an output by more than 0.1.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvattn_testing.engines import ROOT, Runs, why_not_ready

VENV = ROOT / "build" / "venv-sglang"
DRIVER = ROOT / "tests" / "integrations" / "sglang" / "sglang_graph_driver.py"
TOL = 1e-5
NOT_PREPARED = "this forward's ownership inputs were never prepared"


def _drive() -> dict:
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(DRIVER)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError("sglang_graph_driver.py failed:\n" + done.stderr[-4000:])
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs() -> dict:
    why = why_not_ready("SGLang", "venv-sglang", "sglang-env")
    if why:
        pytest.skip(why)
    return Runs().shared("sglang-graph-scenarios", _drive)


# -- through SGLang's replay pieces (build/venv-sglang) -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario,replays", [("clean-16", 21), ("clean-1", 6), ("mla-clean-16", 21)]
)
def test_graph_replays_read_as_eager_and_torch_native(runs, scenario, replays):
    """Decodes of 3 (padded to a graph of 4), 2, 4 and 1 rows, requests joining and leaving,
    each a replay of the graph of its size refilled on the host: every output equals kvattn's
    eager forward of the same step (bit for bit here) and torch-native's within tolerance, no
    page refused, no write dropped; every replay read the step and buffers its capture read.
    ``mla-``: on SGLang's MLA pool, read by kvattn's MLA decode inside the replay."""
    r = runs[scenario]
    assert len(r["replays"]) == replays and r["forwards"] == replays + 2  # two eager extends
    assert max(r["gaps_torch_native"]) < TOL
    assert max(r["gaps_eager"]) == 0.0 and r["identical_to_eager"] == r["forwards"]
    for kind in ("eager", "graph"):
        assert r["counts"][kind]["refused_pages"] == 0 and r["counts"][kind]["dropped_writes"] == 0
        assert set(r["aborted"][kind].values()) == {None}
    assert all(p["refilled_captured_step"] and p["same_addresses"] for p in r["replays"])
    assert {(p["bs"], p["raw"]) for p in r["replays"]} >= {(4, 3), (2, 2), (4, 4), (1, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fault-16", "mla-fault-16"])
def test_a_foreign_page_in_a_replayed_batch_fails_only_its_request(runs, scenario):
    """The twin: in the last replay (3 rows padded to 4) b's first page names a's. SGLang's
    attention reads a's KV for b; under the graph, as eagerly, b alone fails (OWNER_MISMATCH on
    logical page 0), a and c read as torch-native, the padded row reads nothing."""
    r = runs[scenario]
    assert r["aborted"]["torch_native"]["b"] is None
    assert r["last_gaps"]["graph"]["b"] > 0.1
    for kind in ("eager", "graph"):
        message = r["aborted"][kind]["b"]
        assert "reads: OWNER_MISMATCH on logical page(s) 0 (page " in message
        assert message.endswith("in 2 of 2 layer(s): layer 0, layer 1")
        assert {k: v for k, v in r["aborted"][kind].items() if k != "b"} == dict.fromkeys("acd")
        assert r["last_gaps"][kind]["a"] < TOL and r["last_gaps"][kind]["c"] < TOL
    last = r["replays"][-1]
    assert (last["bs"], last["raw"]) == (4, 3) and last["refused"] == [0, 2, 0]
    assert last["padded_refused"] == [0] and last["padded_out_max"] == 0.0
    assert max(r["gaps_eager"]) == 0.0


@pytest.mark.slow
def test_padded_rows_read_nothing_and_are_never_reported(runs):
    """SGLang pads a graph's rows with request-pool row 0 and its fill length (1): kvattn's
    buffers give those rows length 0, so they check no page, refuse none, write nothing and
    output 0, in clean replays and in the faulted one alike."""
    padded = [
        p
        for name in ("clean-16", "clean-1", "fault-16", "mla-clean-16", "mla-fault-16")
        for p in runs[name]["replays"]
        if p["bs"] > p["raw"]
    ]
    assert len(padded) >= 4
    for p in padded:
        assert p["sglang_padded_rows"] == [0] * (p["bs"] - p["raw"])
        assert p["sglang_padded_lens"] == [1] * (p["bs"] - p["raw"])
        zeros = [0] * (p["bs"] - p["raw"])
        assert p["padded_seq_lens"] == p["padded_checked"] == p["padded_refused"] == zeros
        assert p["padded_dropped"] == zeros and p["padded_out_max"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["refilled-16", "mla-refilled-16"])
def test_a_refilled_replay_reads_its_batch(runs, scenario):
    """x and b replay a graph of 2 rows, then a and b replay it, refilled: a and b read as
    torch-native, a's new token lands in every layer."""
    r = runs[scenario]
    assert max(r["gap"].values()) < TOL
    assert r["graph"]["aborted"] == {"x": None, "a": None, "b": None}
    g = r["graph"]
    assert g["a_valid_lens"] == [g["a_valid_before"] + 1] * 2
    assert g["replay"]["refused"] == [0, 0] and g["replay"]["dropped"] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stale-16", "mla-stale-16"])
def test_a_replay_whose_refill_was_skipped_fails_closed(runs, scenario):
    """The twin, refill skipped on purpose: the graph's buffers still hold x's and b's pages, under
    owner 0 since the last forward. Nothing is read (outputs exactly 0, never x's KV), every page
    is refused in the kernel, the writes do not land, and both requests of the batch fail,
    saying their replay was never prepared; x, not in it, does not."""
    r = runs[scenario]
    g = r["graph"]
    assert r["norm"] == {"a": 0.0, "b": 0.0}
    assert min(r["gap"].values()) > 0.1  # torch-native had something to read
    assert not g["replay"]["refilled_captured_step"] and g["replay"]["same_addresses"]
    assert all(n > 0 for n in g["replay"]["refused"])
    assert all(n > 0 for n in g["replay"]["dropped"])
    assert g["a_valid_lens"] == [g["a_valid_before"]] * 2
    assert g["aborted"]["x"] is None
    assert NOT_PREPARED in g["aborted"]["a"] and NOT_PREPARED in g["aborted"]["b"]
    assert g["counts"]["unprepared_forwards"] == 1


@pytest.mark.slow
def test_graph_configurations_kvattn_does_not_cover_are_refused(runs):
    """On a CUDA engine: whole-forward decode graphs (SGLang's default) and no graphs run; the
    prefill graphs, breakable decode graphs and speculative widths are refused, saying why."""
    r = runs["refusals"]
    assert r["decode-full"] is None and r["disabled"] is None
    assert "prefill CUDA graphs ('breakable'" in r["prefill-breakable"]
    assert "--disable-prefill-cuda-graph" in r["prefill-breakable"]
    assert "breakable decode CUDA graphs" in r["decode-breakable"]
    assert "CUDA graphs of 8 tokens for 4 requests" in r["spec-width"]


# -- kvattn only ---------------------------------------------------------------------------------


def test_graph_backends_and_refusals_from_the_arguments(monkeypatch):
    """Without SGLang's published config, the graph backends come from the arguments with
    SGLang's defaults; each configuration kvattn's graphs do not cover is named, the covered
    ones give no refusal."""
    from kvattn.integrations import sglang

    args = SimpleNamespace
    assert sglang._graph_backends(args(), "cuda:0") == ("full", "breakable")
    assert sglang._graph_backends(args(), "cpu") == ("full", "disabled")
    assert sglang._graph_backends(args(disable_cuda_graph=True), "cuda") == ("disabled",) * 2
    assert sglang._graph_backends(args(disable_prefill_cuda_graph=True), "cuda") == (
        "full",
        "disabled",
    )
    assert sglang._graph_refusals("full", "disabled", "cuda", args()) == []
    assert sglang._graph_refusals("full", "disabled", "cpu", args()) == []
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
    everything = args(
        enable_torch_compile=True,
        enable_lora=True,
        enable_two_batch_overlap=True,
        enable_pdmux=True,
    )
    refused = sglang._graph_refusals("full", "breakable", "cuda", everything)
    assert [r.split(" (")[0] for r in refused] == [
        "torch.compile of the decode CUDA graphs",
        "LoRA with decode CUDA graphs",
        "two-batch overlap with decode CUDA graphs",
        "PD multiplexing with decode CUDA graphs",
        "the metadata glue graph",
        "prefill CUDA graphs",
    ]
    assert sglang._graph_refusals("full", "disabled", "cpu", everything)[0].startswith(
        "CPU graphs (--enable-torch-compile"
    )


class HostReadSpy(TorchDispatchMode):
    """Every aten op that reads a tensor's value on the host (tests/readers/test_cuda_graphs.py's
    list)."""

    READS = (
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.is_nonzero",
        "aten.equal",
        "aten.item",
        "aten.repeat_interleave.Tensor",
    )

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


P, HEADS, KV_HEADS, DIM, LAYERS = 4, 4, 2, 16, 2


def _ledger(backend: str):
    """A ledger with two requests' KV written (a: 5 tokens in pages 1-2, b: 3 in page 3) and a
    graph of 4 rows captured; returns it, its pools and the owners."""
    import kvattn
    from kvattn.integrations.ledger import Ledger
    from kvattn.tags import new_owner_id

    g = torch.Generator().manual_seed(7)
    ledger = Ledger(P, backend=backend)
    ledger.allocate_tags(LAYERS, 8, "cpu")
    pools = [
        (
            torch.randn(8, P, KV_HEADS, DIM, generator=g),
            torch.randn(8, P, KV_HEADS, DIM, generator=g),
        )
        for _ in range(LAYERS)
    ]
    a, b = new_owner_id(), new_owner_id()
    ledger.reserve([1, 2], a)
    ledger.reserve([3], b)
    slots = torch.tensor([4, 5, 6, 7, 8, 12, 13, 14])
    owners = torch.tensor([a] * 5 + [b] * 3)
    for layer, (k, v) in enumerate(pools):
        new = torch.randn(8, KV_HEADS, DIM, generator=g)
        kvattn.write_kv(new, new, k, v, slots, ledger.tags[layer], owners)
    ledger.allocate_graph(4, 3, "cpu")
    ledger.capture_graph_step(4)
    return ledger, pools, (a, b)


def _replay(ledger, pools, refill: bool, owners, spy=None, first_page: int = 1):
    """One replay of the graph of 4 rows for a and b (two rows of padding), refilled or not (a's
    first page ``first_page``: 3 is b's); the captured region (sums zeroed, each layer's write
    and attention) under ``spy``."""
    a, b = owners
    if refill:
        ledger.fill_graph_step(
            4,
            ["a", "b"],
            [a, b],
            torch.tensor([[first_page, 2, -1], [3, -1, -1]], dtype=torch.int32),
            torch.tensor([[a, a, 0], [b, 0, 0]]),
            [6, 4],
        )
    step = ledger.graph.steps[4]  # what the replayed kernels read
    ledger.steps[0] = step
    g = torch.Generator().manual_seed(11)
    q = torch.randn(4, HEADS, DIM, generator=g)
    kv = torch.randn(4, KV_HEADS, DIM, generator=g)
    slots = torch.tensor([9, 15, 0, 0])  # SGLang's padded rows write to slot 0
    outs = []
    with spy if spy is not None else contextlib.nullcontext():
        ledger.graph_run()
        for layer, (k, v) in enumerate(pools):
            step.write(f"layer {layer}", kv, kv, k, v, slots, ledger.tags[layer])
            out = torch.empty(4, HEADS, DIM)
            step.attend(f"layer {layer}", q, k, v, ledger.tags[layer], scale=0.25, out=out)
            outs.append(out)
    return step, outs


BACKENDS = ["triton", "auto"]  # the spy's verdict is about triton's launchers (the GPU's decode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_captured_region_reads_nothing_on_the_host(backend):
    """What a graph step runs inside the graph (its sums zeroed, each layer's stamped write, the
    step's verdict resolved once, each layer's checked decode) records no host read, and reads
    the batch: a's and b's rows attend, the padded rows output 0 and check nothing. After the
    forward, nothing to report, and the owners the fill wrote are 0 again. Triton's launchers
    run here under the interpreter; on a GPU the resolve's Triton launcher and the CUDA writer's
    are not spied."""
    ledger, pools, owners = _ledger(backend)
    spy = HostReadSpy()
    step, outs = _replay(ledger, pools, True, owners, spy)
    if backend == "triton":
        assert spy.reads == []
    assert step.refused.tolist() == [0, 0, 0, 0] and step.dropped.tolist() == [0, 0, 0, 0]
    assert step.pages_checked[2:].tolist() == [0, 0] and min(step.pages_checked[:2]) > 0
    assert all(o[2:].abs().max() == 0 and o[:2].abs().min() > 0 for o in outs)
    assert ledger.graph.expected.any() and ledger.graph.token_owner.any()
    assert ledger.finish() == {}
    assert not ledger.graph.expected.any() and not ledger.graph.token_owner.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_foreign_page_is_refused_in_the_region_and_reported_after_it(backend):
    """The twin: a's first page is b's. Inside the region still no host read, and the page is
    refused for a only; the one read after the forward (``finish``, which the spy sees) names it,
    and the owners are 0 again."""
    ledger, pools, owners = _ledger(backend)
    spy = HostReadSpy()
    step, _ = _replay(ledger, pools, True, owners, spy, first_page=3)
    if backend == "triton":
        assert spy.reads == []
    assert step.refused[0] > 0 and step.refused[1:].tolist() == [0, 0, 0]
    after = HostReadSpy()
    with after:
        failed = ledger.finish()
    assert after.reads
    assert list(failed) == ["a"]
    assert "reads: OWNER_MISMATCH on logical page(s) 0 (page 3)" in failed["a"][2]
    assert not ledger.graph.expected.any() and not ledger.graph.token_owner.any()


def test_a_replay_nobody_refilled_reads_and_writes_nothing():
    """A second replay of the graph with no refill: the buffers hold the last batch's pages under
    owner 0. Every page is refused, no output, no write lands; the refilled twin reads again."""
    ledger, pools, owners = _ledger("auto")
    _replay(ledger, pools, True, owners)
    ledger.finish()
    tags = ledger.tags.clone()
    step, outs = _replay(ledger, pools, False, owners)
    assert all(n > 0 for n in step.refused[:2].tolist())
    assert all(n > 0 for n in step.dropped[:2].tolist())
    assert all(o.abs().max() == 0 for o in outs)
    assert torch.equal(ledger.tags, tags)
    ledger.finish()
    step, outs = _replay(ledger, pools, True, owners)
    assert step.refused.tolist() == [0, 0, 0, 0]
    assert all(o[:2].abs().min() > 0 for o in outs)


def test_graph_steps_refuse_what_was_never_captured():
    from kvattn.integrations.ledger import IntegrationError

    ledger, _, (a, b) = _ledger("auto")
    table = torch.full((1, 3), -1, dtype=torch.int32)
    with pytest.raises(IntegrationError, match=r"graph of 2 rows, which was never captured"):
        ledger.fill_graph_step(2, ["a"], [a], table, torch.zeros(1, 3, dtype=torch.int64), [1])
    with pytest.raises(IntegrationError, match=r"a CUDA graph of 5 rows, but the buffers hold"):
        ledger.capture_graph_step(5)
    wide = torch.full((1, 4), -1, dtype=torch.int32)
    with pytest.raises(IntegrationError, match=r"1 rows of 4 pages do not fit"):
        ledger.fill_graph_step(4, ["a"], [a], wide, torch.zeros(1, 4, dtype=torch.int64), [1])

"""The SGLang engine suites' set-up: SGLang's own environment (``make sglang-env``:
build/venv-sglang), the test model, and the conformance suite's SGLang run
(:mod:`kvattn.conformance.sglang`) through its command, once per test run, shared by
test_sglang_engine.py and test_sglang_pd.py.

SGLang 0.5.23 runs on this CPU with ``--device cpu`` (no AMX here, so it falls back to torch
everywhere) once two modules it imports have test-only stand-ins (``standins/``: ``sgl_kernel``'s
one op it calls, and ``torchvision.transforms``; and the Mooncake sender told to take host
indices); they go on the servers' path only when the environment has no real ``sgl_kernel``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from kvattn.conformance import sglang as differential
from kvattn_testing.engines import ROOT, Runs, why_not_ready, write_model

VENV_PY = ROOT / "build" / "venv-sglang" / "bin" / "python"
STANDINS = pathlib.Path(__file__).resolve().parent / "standins"
SEEDS = (0, 1)


def why_no_sglang() -> str | None:
    return why_not_ready("SGLang", "venv-sglang", "sglang-env")


def why_no_mooncake() -> str | None:
    """None when the Mooncake transfer engine is installed beside SGLang (``make sglang-env``)."""
    if (ROOT / "build" / "venv-sglang" / ".mooncake").exists():
        return why_no_sglang()
    return "the Mooncake transfer engine is not installed in build/venv-sglang (make sglang-env)"


def model(folder: pathlib.Path) -> pathlib.Path:
    """The suites' random-weight Llama (kvattn.conformance.model's), written once into ``folder``."""
    return write_model(folder, sys.executable)


def _standins_allowed() -> None:
    probe = subprocess.run(
        [
            str(VENV_PY),
            "-c",
            "import importlib.util as u; print(u.find_spec('sgl_kernel') is None)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if probe.stdout.strip() != "True":
        raise RuntimeError(
            "SGLang's environment has a real sgl_kernel; the suite would not "
            "shadow it with its stand-in: " + probe.stderr[-500:]
        )


def conformance() -> dict:
    """``python -m kvattn.conformance --engine sglang`` in SGLang's environment, with the
    stand-ins on its path: ``raw`` (the servers' results, kvattn.conformance.sglang.run's),
    ``returncode``, ``stdout``, ``stderr`` and the ``report`` it wrote."""
    runs = Runs()
    return runs.shared("sglang-conformance", lambda: _conformance(runs))


def _conformance(runs: Runs) -> dict:
    _standins_allowed()
    work = runs.dir / "sglang-conformance"
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVATTN_", "TRITON_"))}
    env["PYTHONPATH"] = str(STANDINS)
    command = [str(VENV_PY), "-m", "kvattn.conformance", "--engine", "sglang"]
    command += ["--seeds", ",".join(map(str, SEEDS)), "--model", str(model(runs.dir))]
    command += ["--work", str(work), "--out", str(work / "out")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"the SGLang conformance run failed ({done.returncode}):\n{done.stderr}")
    return dict(
        raw=json.loads((work / "sglang.json").read_text()),
        returncode=done.returncode,
        stdout=done.stdout,
        stderr=done.stderr,
        report=json.loads((work / "out" / "conformance-sglang.json").read_text()),
    )


def mla() -> dict:
    """On a random-weight DeepSeek-V2-style model (kvattn.conformance.model's ``deepseek-v2``:
    multi-head latent attention, SGLang's MLA pool), once per test run, servers on SGLang's
    ``torch_native`` attention and on kvattn's: ``servers``, the differential workloads of
    :func:`kvattn.conformance.sglang.serve_workloads` (seed 0, page size 16), and ``offload``,
    HiCache's lane (:func:`kvattn.conformance.sglang.serve_offload`)."""
    runs = Runs()
    return runs.shared("sglang-mla", lambda: _mla(runs))


def _mla(runs: Runs) -> dict:
    _standins_allowed()
    model = write_model(runs.dir, sys.executable, family="deepseek-v2")
    folders = {name: runs.dir / f"sglang-mla-{name}" for name in ("servers", "offload")}
    for folder in folders.values():
        folder.mkdir(exist_ok=True)
    env = dict(PYTHONPATH=str(STANDINS))
    servers, offload = differential.concurrently(
        [
            lambda: differential.serve_workloads(
                model, folders["servers"], (0,), (16,), python=VENV_PY, env=env
            ),
            lambda: differential.serve_offload(model, folders["offload"], VENV_PY, env),
        ]
    )
    return dict(servers=servers, offload=offload)


def mla_incident() -> dict:
    """The incident's prefill/decode replay (:func:`kvattn.conformance.sglang.replay_incident`)
    on the DeepSeek-V2-style model of :func:`mla`, once per test run."""
    runs = Runs()
    return runs.shared("sglang-mla-pd", lambda: _mla_incident(runs))


def _mla_incident(runs: Runs) -> dict:
    _standins_allowed()
    work = runs.dir / "sglang-mla-pd"
    work.mkdir(exist_ok=True)
    return differential.replay_incident(
        write_model(runs.dir, sys.executable, family="deepseek-v2"),
        work,
        python=VENV_PY,
        env=dict(PYTHONPATH=str(STANDINS)),
    )


# SGLang's n-gram speculative decoding: four draft tokens a verify forward from a trie of depth
# 8; at page size 16 SGLang takes draft chains only (breadth 1), at page size 1 trees of up to 10
# branches.
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
NGRAM += ("--speculative-ngram-max-trie-depth", "8", "--speculative-ngram-min-bfs-breadth", "1")
NGRAM_BREADTH = {16: 1, 1: 10}
SPEC_SEEDS = (1,)


def spec() -> dict:
    """The differential workloads (``SPEC_SEEDS``) under n-gram speculative decoding at page sizes 16
    and 1, on the narrow-weight Llama (whose greedy answers loop, so drafts are accepted), once
    per test run: ``{page size: serve_workloads' servers}``."""
    runs = Runs()
    return runs.shared("sglang-spec", lambda: _spec(runs))


def _spec(runs: Runs) -> dict:
    _standins_allowed()
    model = write_model(runs.dir, sys.executable, family="llama-narrow")
    folder = runs.dir / "sglang-spec"
    folder.mkdir(exist_ok=True)
    env = dict(PYTHONPATH=str(STANDINS))

    def serve(page: int):
        extra = NGRAM + ("--speculative-ngram-max-bfs-breadth", str(NGRAM_BREADTH[page]))
        return differential.serve_workloads(
            model, folder, SPEC_SEEDS, (page,), python=VENV_PY, env=env, extra=extra
        )

    results = differential.concurrently([lambda p=p: serve(p) for p in NGRAM_BREADTH])
    return {str(p): r["servers"] for p, r in zip(NGRAM_BREADTH, results)}


def assert_clean(stock: dict, mine: dict, seeds) -> None:
    """Every request of the clean workloads answers with the same greedy tokens on both servers;
    faults' victims aside, kvattn refused no page and failed no request."""
    for seed in seeds:
        a, b = stock["runs"][f"clean-{seed}"], mine["runs"][f"clean-{seed}"]
        assert set(a) == set(b) and len(a) == 10
        for rid in a:
            assert a[rid]["status"] == b[rid]["status"] == 200, (rid, b[rid]["message"])
            assert b[rid]["ids"] == a[rid]["ids"], rid
    victims = {
        rid
        for name, results in mine["runs"].items()
        if not name.startswith("clean")
        for rid in results
        if ":" in rid
    }
    victims.add("salt-ignored:t2")  # the class-5 lane's, keyed by name (t2) in its results
    assert set(mine["counts"]["failures"]) <= victims
    assert mine["counts"]["pages_checked"] > 0 and mine["counts"].get("prefix_hit_pages", 0) > 0


def assert_only_the_victim_fails(stock: dict, mine: dict, fault: str, seeds) -> None:
    """The fault was applied on both servers; on SGLang's own attention the victim answers over
    KV that is not its own, under kvattn it fails with the check's message and every other
    request's tokens equal its clean run's."""
    for seed in seeds:
        victim = differential.victim(fault, seed)
        for server in (stock, mine):
            assert victim in {f["rid"] for f in server["faults"]}, "the fault was not applied"
        clean_stock = stock["runs"][f"clean-{seed}"]
        faulted_stock = stock["runs"][f"{fault}-{seed}"]
        assert faulted_stock[victim]["status"] == 200
        assert faulted_stock[victim]["ids"] != clean_stock[victim.split(":", 1)[1]]["ids"]
        faulted = mine["runs"][f"{fault}-{seed}"]
        assert faulted[victim]["status"] >= 400 and faulted[victim]["ids"] is None
        assert differential.OWNERSHIP_ERROR in faulted[victim]["message"]
        assert "reads: " in faulted[victim]["message"] or "writes: " in faulted[victim]["message"]
        clean = mine["runs"][f"clean-{seed}"]
        for rid, result in faulted.items():
            if rid != victim:
                assert result["status"] == 200 and result["ids"] == clean[rid]["ids"], rid


def assert_offload(offload: dict) -> None:
    """HiCache on both attentions. Clean: ``b``'s match, the four pages of ``a``'s prompt, comes
    back from host memory after the fillers evicted it from the device, and both attentions give
    the same tokens; kvattn committed the pages it loaded back by their attestations. With the
    host copy of the first page changed before the load-back, SGLang's attention answers ``b``
    with other tokens; kvattn commits the three pages that verify, leaves the changed one FREE
    and fails ``b``, naming it, and only ``b``."""
    stock, mine = offload["torch_native-hicache"], offload["kvattn-hicache"]
    for server in (stock, mine):
        clean = server["runs"]["clean"]
        assert all(r["status"] == 200 for r in clean.values())
        assert clean["b"]["cached"] == len(differential.OFFLOADED)
    assert {n: r["ids"] for n, r in mine["runs"]["clean"].items()} == {
        n: r["ids"] for n, r in stock["runs"]["clean"].items()
    }
    pages = len(differential.OFFLOADED) // 16
    assert mine["counts"]["restored_pages"] == pages + pages - 1
    assert mine["counts"]["restored_pages_refused"] == 1
    assert stock["runs"]["host-corrupt"]["b"]["status"] == 200
    assert stock["runs"]["host-corrupt"]["b"]["ids"] != stock["runs"]["clean"]["b"]["ids"]
    faulted = mine["runs"]["host-corrupt"]
    assert faulted["b"]["status"] >= 400
    assert "FREE on logical page(s) 0 " in faulted["b"]["message"], faulted["b"]["message"]
    for name, result in faulted.items():
        if name != "b":
            assert result["status"] == 200 and result["ids"] == mine["runs"]["clean"][name]["ids"]

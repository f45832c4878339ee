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

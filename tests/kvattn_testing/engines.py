"""Engine processes for the engine suites: whether an engine's own environment is ready (``make
vllm-env``: build/venv-vllm; ``make sglang-env``: build/venv-sglang), the vLLM test model, engine
processes run in that environment whose JSON results are computed once per test run and shared by
the xdist workers (:class:`Runs`), and OpenAI servers started and stopped. The vLLM test files use
all of it; test_sglang the environment check and the once-per-run results."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import subprocess
import time
import urllib.error
import urllib.request

from kvattn.conformance.sglang import stop_servers  # noqa: F401  (the engine tests' too)

ROOT = (
    pathlib.Path(__file__).resolve().parents[2]
)  # the repository: tests/kvattn_testing/engines.py
VENV = ROOT / "build" / "venv-vllm"
VENV_PY = VENV / "bin" / "python"
VLLM_STANDINS = ROOT / "tests" / "integrations" / "vllm" / "standins"
VLLM_CONFORMANCE_SEEDS = (0, 1, 2, 3, 4, 5)


def why_not_ready(engine: str, venv: str, target: str) -> str | None:
    """None when an engine's environment (build/``venv``, made by ``make target``) is ready, else
    why not (the tail of its install log)."""
    if (ROOT / "build" / venv / ".ready").exists():
        return None
    log = ROOT / "build" / f"{venv}.log"
    tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
    return f"{engine} is not installed in build/{venv} (make {target})" + (
        ": " + " | ".join(tail) if tail else ""
    )


def why_no_vllm() -> str | None:
    return why_not_ready("vLLM", "venv-vllm", "vllm-env")


def env(kvattn: bool) -> dict:
    """The environment of an engine process: in-process engine core, one thread, kvattn's
    plugin switched on (``KVATTN_VLLM=1``) or not, and the test stand-ins of
    tests/integrations/vllm/standins on the path."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("KVATTN_", "TRITON_"))}
    out.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(VLLM_STANDINS), os.environ.get("PYTHONPATH")) if p
    )
    if kvattn:
        out["KVATTN_VLLM"] = "1"
    return out


def post(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` as JSON to an OpenAI server: ``(status, JSON reply)``, error statuses too."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_healthy(base: str, server: subprocess.Popen, log_path, timeout_s: float) -> None:
    """Until the server at ``base`` answers ``/health``; raises with its log's tail if it exits
    or does not come up within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError("the server exited:\n" + log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the server did not come up in {timeout_s:.0f} s:\n" + log_path.read_text()[-3000:]
            )
        time.sleep(1)


@contextlib.contextmanager
def locked(path: pathlib.Path):
    """An exclusive lock on the file ``path`` (between the xdist workers) while inside."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_model(folder: pathlib.Path, python, family: str = "llama") -> pathlib.Path:
    """The random-weight model of ``family`` (kvattn.conformance.model run by ``python``) in ``folder``,
    written once whoever asks first."""
    model = folder / ("model" if family == "llama" else f"model-{family}")
    with locked(folder / f"{model.name}.lock"):
        if not (model / "config.json").exists():
            subprocess.run(
                [str(python), "-m", "kvattn.conformance.model", str(model), "--family", family],
                check=True,
                capture_output=True,
                timeout=300,
            )
    return model


class Runs:
    """Engine processes' results, computed once per test run and shared by the xdist workers
    through files under one lock (each run starts engines for several seconds)."""

    def __init__(self):
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
        self.dir = ROOT / "build" / "vllm-tests" / run_id
        self.dir.mkdir(parents=True, exist_ok=True)

    def shared(self, name, compute):
        """``compute()``'s result, computed by the first worker that asks for ``name`` (a worker
        asking for another name meanwhile does not wait for it)."""
        path = self.dir / f"{name}.json"
        with locked(self.dir / f"{name}.lock"):
            if not path.exists():
                path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())

    @property
    def model(self) -> pathlib.Path:
        return self.model_of("llama")

    def model_of(self, family: str) -> pathlib.Path:
        """The random-weight model of ``family`` (kvattn.conformance.model), written once."""
        return write_model(self.dir, VENV_PY, family)

    def drive(
        self, jobs: list[tuple[str, pathlib.Path | str, bool, tuple]], family: str = "llama"
    ) -> dict:
        """Run ``(key, script, kvattn, args)`` jobs as ``script ARG0 MODEL OUT ARGS...`` (the
        first argument names the scenario; a ``script`` given as a string is a module, run with
        ``-m``) on the model of ``family``, two at a time (the machine has two cores); returns
        ``{key: result}``."""
        model = self.model_of(family)
        results, running = {}, []
        for key, script, kvattn, args in jobs:
            out = self.dir / f"{key}.out.json"
            log = open(self.dir / f"{key}.log", "w")
            first, *extra = args
            program = ["-m", script] if isinstance(script, str) else [str(script)]
            proc = subprocess.Popen(
                [str(VENV_PY), *program, str(first), str(model), str(out), *map(str, extra)],
                env=env(kvattn),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            running.append((key, proc, out, log))
            if len(running) == 2:
                self._wait(running.pop(0), results)
        while running:
            self._wait(running.pop(0), results)
        return results

    def vllm_conformance(self) -> dict:
        """``python -m kvattn.conformance --engine vllm`` over ``VLLM_CONFORMANCE_SEEDS`` in vLLM's
        environment, once per test run: ``stock`` and ``kvattn`` (each attention's raw results,
        :mod:`kvattn.conformance.vllm`'s), ``returncode``, ``stdout``, ``stderr`` and the
        ``report`` it wrote."""
        return self.shared("vllm-conformance", self._vllm_conformance)

    def _vllm_conformance(self) -> dict:
        work = self.dir / "vllm-conformance"
        command = [str(VENV_PY), "-m", "kvattn.conformance", "--engine", "vllm"]
        command += ["--seeds", ",".join(map(str, VLLM_CONFORMANCE_SEEDS))]
        command += ["--model", str(self.model), "--work", str(work), "--out", str(work / "out")]
        done = subprocess.run(
            command, capture_output=True, text=True, env=env(False), cwd=ROOT, timeout=1200
        )
        if done.returncode not in (0, 1):
            raise RuntimeError(
                f"the vLLM conformance run failed ({done.returncode}):\n{done.stderr}"
            )
        return dict(
            stock=json.loads((work / "vllm-stock.json").read_text()),
            kvattn=json.loads((work / "vllm-kvattn.json").read_text()),
            returncode=done.returncode,
            stdout=done.stdout,
            stderr=done.stderr,
            report=json.loads((work / "out" / "conformance-vllm.json").read_text()),
        )

    def _wait(self, job, results) -> None:
        key, proc, out, log = job
        rc = proc.wait(timeout=600)
        log.close()
        if rc != 0:
            tail = (self.dir / f"{key}.log").read_text().splitlines()[-30:]
            raise RuntimeError(f"driver {key} failed ({rc}):\n" + "\n".join(tail))
        results[key] = json.loads(out.read_text())

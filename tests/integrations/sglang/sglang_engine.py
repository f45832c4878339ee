"""SGLang servers for the engine suites: started on 127.0.0.1 in SGLang's own environment
(``make sglang-env``: build/venv-sglang), waited for on their ``/health`` within a bound, asked
with ``/generate``, and stopped by process group whatever happens.

SGLang 0.5.23 runs on this CPU with ``--device cpu`` (no AMX here, so it falls back to torch
everywhere) once two modules it imports have test-only stand-ins (``standins/``: ``sgl_kernel``'s
one op it calls, and ``torchvision.transforms``); they go on the servers' path only when the
environment has no real ``sgl_kernel``. ``standins/kvattn_faults.py`` holds the fault injectors,
``standins/kvattn_counts.py`` writes each server's ledger counts where the tests read them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvattn_testing.engines import ROOT, stop_servers, why_not_ready, write_model

VENV_PY = ROOT / "build" / "venv-sglang" / "bin" / "python"
STANDINS = pathlib.Path(__file__).resolve().parent / "standins"
STARTUP_S = 420  # a bound on a server's start, two starting at once on two loaded cores
# A bound on one request (a lost transfer would otherwise wait for its 300 s timeout).
REQUEST_S = 180
# A bound on the wait of a cache flush for the scheduler to be idle (shorter than REQUEST_S, so
# that the server's answer arrives before the client gives up).
FLUSH_S = 120


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Server:
    """One SGLang server: ``attention`` (``kvattn`` or ``torch_native``), optionally one side of
    a prefill/decode pair over Mooncake (``mode``), with its log, fault log and counts in
    ``folder``."""

    def __init__(
        self,
        name: str,
        attention: str,
        folder: pathlib.Path,
        *,
        page_size: int = 16,
        mode: str | None = None,
        check_bytes: bool = True,
        extra: tuple = (),
    ):
        self.name, self.attention, self.mode = name, attention, mode
        self.folder, self.page_size, self.check_bytes = folder, page_size, check_bytes
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        self.extra = list(extra)
        self.log = folder / f"{name}.log"
        self.fault_log = folder / f"{name}.faults.jsonl"
        self.counts_path = folder / f"{name}.counts.json"
        self.process: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, model_path: pathlib.Path) -> None:
        args = [
            str(VENV_PY),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--attention-backend",
            self.attention,
            "--disable-cuda-graph",
            "--skip-server-warmup",
            # An idle scheduler otherwise polls its sockets in a busy loop: a core per server
            # taken from the one serving and from the rest of the suite.
            "--sleep-on-idle",
            "--grammar-backend",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--page-size",
            str(self.page_size),
            "--chunked-prefill-size",
            "32",
            "--max-running-requests",
            "8",
            "--max-total-tokens",
            "2048",
            *self.extra,
        ]
        if self.mode is not None:
            args += [
                "--disaggregation-mode",
                self.mode,
                "--disaggregation-transfer-backend",
                "mooncake",
            ]
            if self.mode == "prefill":
                args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
            else:  # its default backup pool pins host memory through CUDA
                args += ["--disaggregation-decode-retraction-backup", "none"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVATTN_", "TRITON_"))}
        env.update(
            PYTHONPATH=str(STANDINS),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_HOST_IP="127.0.0.1",
            MOONCAKE_PROTOCOL="tcp",
            MC_FORCE_TCP="1",
            OMP_NUM_THREADS="1",
            # prefill.py: the early send of a cached prefix under overlap scheduling
            # records a torch.cuda.Event; the send is an optimisation only.
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
            KVATTN_TEST_FAULTS="1",
            KVATTN_TEST_FAULT_LOG=str(self.fault_log),
            KVATTN_TEST_COUNTS=str(self.counts_path),
            KVATTN_SGLANG_CHECK_BYTES="1" if self.check_bytes else "0",
        )
        self.log.write_text(" ".join(args) + "\n")
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.folder,
                start_new_session=True,
            )

    def wait_healthy(self, deadline: float) -> None:
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server {self.name} exited ({self.process.returncode}):\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SGLang server {self.name} did not come up within "
                    f"{STARTUP_S} s:\n{self.tail()}"
                )
            time.sleep(1)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def faults(self) -> list[dict]:
        """What the fault injectors did (and, on a decode instance, each transfer's pages)."""
        if not self.fault_log.exists():
            return []
        return [json.loads(line) for line in self.fault_log.read_text().splitlines()]

    def counts(self) -> dict:
        return json.loads(self.counts_path.read_text()) if self.counts_path.exists() else {}

    def generate(self, rid: str, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
        """One greedy ``/generate``: ``{status, ids, finish, message}``."""
        body = dict(
            rid=rid,
            input_ids=input_ids,
            stream=False,
            **extra,
            sampling_params=dict(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True),
        )
        request = urllib.request.Request(
            self.base + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
                status, reply = response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read().decode(errors="replace")
            try:
                reply = json.loads(raw or "{}")
            except ValueError:
                reply = {}
            if not isinstance(reply, dict):
                reply = {}
            reply.setdefault("raw", raw)
        finish = (reply.get("meta_info") or {}).get("finish_reason") or {}
        message = finish.get("message") or reply.get("raw")
        return dict(
            status=status, ids=reply.get("output_ids"), finish=finish.get("type"), message=message
        )

    def flush_cache(self) -> None:
        """Empty the radix cache (``/flush_cache``). The scheduler may still hold the last
        requests (an abort lands, overlap scheduling ends a batch) after their replies came:
        it flushes once it is idle, within the bound."""
        request = urllib.request.Request(
            f"{self.base}/flush_cache?timeout={FLUSH_S}", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            if response.status != 200:
                raise RuntimeError(f"{self.name}: /flush_cache answered {response.status}")

    def abort_midway(
        self, rid: str, input_ids: list[int], max_new_tokens: int, after: int = 2
    ) -> dict:
        """A streamed ``/generate`` aborted (``/abort_request``) once ``after`` chunks of its
        output arrived: ``{chunks, finish}`` (the request may also end before the abort lands)."""
        body = dict(
            rid=rid,
            input_ids=input_ids,
            stream=True,
            sampling_params=dict(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True),
        )
        request = urllib.request.Request(
            self.base + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        chunks, finish = 0, None
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            for line in response:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunks += 1
                finish = (
                    (json.loads(line[5:]).get("meta_info") or {}).get("finish_reason") or {}
                ).get("type", finish)
                if chunks == after:
                    abort = urllib.request.Request(
                        self.base + "/abort_request",
                        data=json.dumps({"rid": rid}).encode(),
                        headers={"Content-Type": "application/json"},
                    )
                    urllib.request.urlopen(abort, timeout=REQUEST_S).read()
        return dict(chunks=chunks, finish=finish)


@contextlib.contextmanager
def running(model_path: pathlib.Path, *servers: Server):
    """The servers started together and healthy, stopped on the way out whatever happened."""
    _standins_allowed()
    try:
        for server in servers:
            server.start(model_path)
        deadline = time.monotonic() + STARTUP_S
        for server in servers:
            server.wait_healthy(deadline)
        yield servers
    finally:
        stop_servers(*(s.process for s in servers if s.process is not None))


def concurrently(calls: list) -> list:
    """Run the zero-argument ``calls`` at once (requests in flight together: one batch)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        return list(pool.map(lambda call: call(), calls))

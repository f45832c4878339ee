"""The conformance suite under SGLang: SGLang's own HTTP servers, on SGLang's ``torch_native``
attention and on kvattn's (``--attention-backend kvattn``), with the fault injectors of
:mod:`kvattn.conformance.sglang_faults` in their processes (:mod:`kvattn.conformance.sglang_server`
starts them). ``python -m kvattn.conformance --engine sglang`` runs it in the environment SGLang
is installed in. Two runs, side by side:

- **One server per attention and page size** (16 and 1): seeded workloads in three waves, each
  wave's requests in flight together: two system prompts shared by most requests (radix-cache
  hits, and evictions in a pool of 512 tokens), prompts longer than the 32-token prefill chunk
  (chunked prefill), overlap scheduling (SGLang's default), one request aborted while it runs.
  Then each workload again with one fault aimed at one request of the second wave, the victim:
  ``lost-write``, ``stale-hit``, ``foreign-entry``, ``boundary-hit`` (:data:`FAULTS`); and one
  prompt under two tenants' cache salts, clean and with the salt left out of the radix key.
- **The incident's stack**, where the Mooncake transfer engine is installed: a prefill and a
  decode server per attention over Mooncake (TCP on the loopback). An earlier tenant's long
  request leaves its KV in the decode's pages; then a request whose prompt the prefill turns into
  a one-token placeholder is told "transfer done", beside a clean request; then transfers that
  move one page per chunk, bytes changed after arrival, and two attacks on kvattn's attestation
  itself (a malformed and a replayed frame; kvattn's own tests judge those, the table does not:
  the stock engine has no attestation to break).

The servers run SGLang's CPU path (``--device cpu``, float32, ``SGLANG_USE_CPU_ENGINE=1``) on the
random-weight Llama of :mod:`kvattn.conformance.model`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvattn.conformance import Report, Row

STARTUP_S = 420  # a bound on a server's start, several starting at once on two loaded cores
# A bound on one request (a lost transfer would otherwise wait for its 300 s timeout).
REQUEST_S = 180
# A bound on the wait of a cache flush for the scheduler to be idle (shorter than REQUEST_S, so
# that the server's answer arrives before the client gives up).
FLUSH_S = 120
OWNERSHIP_ERROR = "kvattn ownership check failed"

PAGE_SIZES = (16, 1)
# fault -> (conformance class, the public reports it stands for)
FAULTS = {
    "foreign-entry": (3, "SGLang #22716 (a misrouted req_to_token entry)"),
    "stale-hit": (2, "vLLM #52234 (a radix hit on pages handed on and rewritten)"),
    "lost-write": (1, "TensorRT-LLM #19545 (a write that never reached its pages)"),
    "boundary-hit": (4, "SGLang #22819 (corruption at prefix_len == page_size)"),
}
# Each fault's victim: ``w`` (alone in the third wave) has a radix hit of exactly one page,
# ``v`` (in the second) one of a system prompt.
VICTIMS = {"boundary-hit": "w"}
POOL = ("--max-total-tokens", "512")
# Class 5: one prompt under cache salts of two tenants, then the first's again.
DOMAIN_FAULTS = {
    "salt-ignored": (5, "SGLang #37160, LMCache #4247 (the cache salt left out of the key)"),
}
DOMAIN_PROMPT = [(11 * i) % 250 + 3 for i in range(40)]  # two full pages at page size 16
DOMAIN_LANE = (("t1", "tenant-1"), ("t2", "tenant-2"), ("t1b", "tenant-1"))

# Class 6 on one server: a prompt of four pages whose KV HiCache backs up to host memory, requests
# that evict it from a 16-page device pool, then a request sharing the prompt, whose radix match
# is loaded back from host memory.
OFFLOAD_FAULTS = {
    "host-corrupt": (
        6,
        "vLLM #45704 (an offload restore missing a cross-stream sync), SGLang #38031 (a "
        "host-tier load-back corrupting generation)",
    ),
}
HICACHE = (
    "--max-total-tokens",
    "256",
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
    "--hicache-ratio",
    "4",
)
OFFLOADED = [(13 * i) % 240 + 5 for i in range(64)]
FILLERS = [[(29 * j + 31 * i) % 240 + 4 for j in range(150)] for i in range(3)]

# The incident's stack. A decode pool of 40 pages: the tenant's request takes 36, so the next
# request's pages are the tenant's (SGLang's allocator hands freed pages out again once its free
# list runs short).
DECODE_POOL = ("--max-total-tokens", "640", "--num-reserved-decode-tokens", "32")
NEW = 12
TENANT = [(7 * i) % 250 + 3 for i in range(560)]  # 572 tokens with its output: 36 pages
PROMPT = list(range(100, 150))  # the victims' prompt: 4 pages
BESIDE = list(range(200, 230))
ATTESTATION_FAULTS = (
    "short-transfer",
    "corrupt-arrival",
    "bad-attestation",
    "replayed-attestation",
)
# P/D fault -> (conformance class, reports); the attestation attacks are kvattn's own, not rows.
PD_FAULTS = {
    "placeholder": (1, "SGLang #30233 (the incident: a 1-token placeholder transferred)"),
    "short-transfer": (1, "TensorRT-LLM #19545 (a transfer that moved less than it reported)"),
    "corrupt-arrival": (6, "vLLM #44238 (completion reported before the bytes were right)"),
}
NOT_REPLAYED: dict[int, str] = {}


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and one this process has not handed out before: servers
    bind theirs only once their model is loaded, a minute later, and two servers started together
    must not get the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def stop_servers(*servers: subprocess.Popen, grace_s: float = 30) -> None:
    """Stop servers started in their own sessions, with every process of each: all told at once
    (a server may take seconds to shut down), then killed if still there after ``grace_s``."""
    live = [s for s in servers if s.poll() is None]
    for server in live:
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in live:
        try:
            server.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


class Server:
    """One SGLang server: ``attention`` (``kvattn`` or ``torch_native``), optionally one side of
    a prefill/decode pair over Mooncake (``mode``), with its log, fault log and counts in
    ``folder``; run by ``python`` with ``env`` added to this process's environment."""

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
        python: str | os.PathLike = sys.executable,
        env: dict | None = None,
    ):
        self.name, self.attention, self.mode = name, attention, mode
        self.folder, self.page_size, self.check_bytes = folder, page_size, check_bytes
        self.python, self.env = python, dict(env or {})
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
            str(self.python),
            "-m",
            "kvattn.conformance.sglang_server",
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
            # taken from the one serving.
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
            KVATTN_CONFORMANCE_FAULT_LOG=str(self.fault_log),
            KVATTN_CONFORMANCE_COUNTS=str(self.counts_path),
            KVATTN_SGLANG_CHECK_BYTES="1" if self.check_bytes else "0",
        )
        env.update(self.env)
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

    def wait_healthy(self, deadline: float, model_path: pathlib.Path, restarts: int = 1) -> None:
        """Until the server answers ``/health``. A server that exits while starting, or that
        could not bind its port (another process bound it first: a free port is only free until
        someone binds it, and what answers there then is not this server), is started once more
        on fresh ports; a second failure raises, with its log's tail."""
        while True:
            bound_elsewhere = "error while attempting to bind" in self.log.read_text()
            if self.process.poll() is None and bound_elsewhere:
                # Its port was taken: whatever answers there is not this server.
                stop_servers(self.process)
            if self.process.poll() is not None:
                if restarts > 0:
                    restarts -= 1
                    self.log.replace(self.folder / f"{self.name}.exited.log")
                    self.port = free_port()
                    if self.mode == "prefill":
                        self.bootstrap_port = free_port()
                    self.start(model_path)
                    continue
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
        meta = reply.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        message = finish.get("message") or reply.get("raw")
        return dict(
            status=status,
            ids=reply.get("output_ids"),
            finish=finish.get("type"),
            message=message,
            cached=meta.get("cached_tokens"),
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
    try:
        for server in servers:
            server.start(model_path)
        deadline = time.monotonic() + STARTUP_S
        for server in servers:
            server.wait_healthy(deadline, model_path)
        yield servers
    finally:
        stop_servers(*(s.process for s in servers if s.process is not None))


def concurrently(calls: list) -> list:
    """Run the zero-argument ``calls`` at once (requests in flight together: one batch)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        return list(pool.map(lambda call: call(), calls))


# -- one server per attention ----------------------------------------------------------------------


def victim(fault: str, seed: int) -> str:
    """The request id the fault aims at in the workload of ``seed``."""
    return f"{fault}:{seed}-{VICTIMS.get(fault, 'v')}"


def workload(seed: int, fault: str | None = None) -> list[list[dict]]:
    """Waves of requests sent together, each wave after the last one ended: ``{rid, ids, new}``.
    The victim of ``fault`` (:func:`victim`) shares a system prompt cached by the first wave
    (``v``, in the second), or exactly one page of ``h``'s prompt (``w``, alone in the third)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 40))] for _ in range(2)]

    def request(name: str, system: int | None, user: int, new: int) -> dict:
        prefix = systems[system] if system is not None else []
        return dict(
            rid=f"{seed}-{name}", new=new, ids=prefix + [rng.randrange(3, 250) for _ in range(user)]
        )

    first = [
        request("a", 0, rng.randrange(4, 30), 12),
        request("b", 1, rng.randrange(4, 30), 16),
        request("c", None, rng.randrange(36, 70), 10),
    ]
    second = [
        request("d", 0, rng.randrange(4, 30), 20),
        request("e", 1, rng.randrange(4, 30), 14),
        request("v", 0, rng.randrange(8, 20), 16),
        request("f", None, rng.randrange(40, 60), 8),
    ]
    # A prompt of 16 tokens and tails, drawn apart (the requests above keep their draws): ``w``
    # shares exactly its 16 tokens with ``h``, so its radix hit ends at a page boundary.
    other = random.Random(seed + 7919)
    head = [other.randrange(3, 250) for _ in range(16)]
    h_tail = [other.randrange(3, 250) for _ in range(other.randrange(4, 20))]
    # Its prompt's rest is prefilled in one forward (alone in its wave, under the 32-token chunk).
    w_tail = [other.randrange(3, 250) for _ in range(other.randrange(8, 16))]
    w_tail[0] = 3 + (h_tail[0] - 2) % 247  # the token after h's in [3, 250), never h's own
    first.append(dict(rid=f"{seed}-h", new=10, ids=head + h_tail))
    alone = [dict(rid=f"{seed}-w", new=12, ids=head + w_tail)]
    if fault is not None:
        aimed = next(r for r in second + alone if r["rid"] == victim(fault, seed).split(":", 1)[1])
        aimed["rid"] = f"{fault}:{aimed['rid']}"
    third = [request("g", 1, rng.randrange(4, 12), 24), dict(request("x", 0, 6, 64), abort=True)]
    return [first, second, alone, third]


def run_workload(server: Server, waves: list[list[dict]]) -> dict:
    """``{rid: result}`` of every request but the aborted ones (which end whenever the abort
    lands, on either engine), from an empty radix cache."""
    server.flush_cache()
    out = {}
    for wave in waves:
        served = [r for r in wave if not r.get("abort")]
        calls = [(lambda r=r: server.generate(r["rid"], r["ids"], r["new"])) for r in served]
        calls += [
            (lambda r=r: server.abort_midway(r["rid"], r["ids"], r["new"]))
            for r in wave
            if r.get("abort")
        ]
        results = concurrently(calls)
        out.update({r["rid"]: res for r, res in zip(served, results)})
    return out


def domain_lane(server: Server, fault: bool) -> dict:
    """:data:`DOMAIN_PROMPT` under tenant 1's salt, tenant 2's, then tenant 1's again, each after
    the one before ended, from an empty radix cache: tenant 2's must not hit tenant 1's pages,
    tenant 1's second request does. With ``fault`` the salts are ones the ``salt-ignored`` fault
    leaves out of the radix key, so tenant 2 (the victim, ``salt-ignored:t2``) hits them."""
    server.flush_cache()
    prefix = "salt-ignored:" if fault else "salt-clean-"
    return {
        name: server.generate(
            f"{prefix}{name}", DOMAIN_PROMPT, 8, cache_salt=("salt-ignored:" * fault) + salt
        )
        for name, salt in DOMAIN_LANE
    }


def offload_lane(server: Server, fault: bool) -> dict:
    """From an empty cache: :data:`OFFLOADED` (``a``), the :data:`FILLERS` (``fill0`` ..), which
    evict its pages from the device pool while HiCache keeps their copy in host memory, then
    :data:`OFFLOADED` with another ending (``b``), whose match is loaded back. With ``fault``,
    ``b`` is ``host-corrupt``'s victim."""
    server.flush_cache()
    name = "host-corrupt:offload-" if fault else "offload-clean-"
    requests = [("a", OFFLOADED + [7, 9])]
    requests += [(f"fill{i}", ids) for i, ids in enumerate(FILLERS)]
    requests += [("b", OFFLOADED + [11, 12, 13])]
    return {r: server.generate(name + r, ids, 8) for r, ids in requests}


def serve_offload(
    model: pathlib.Path, folder: pathlib.Path, python=sys.executable, env: dict | None = None
) -> dict:
    """Per server (``torch_native-hicache``, ``kvattn-hicache``): the offload lane clean and
    with its fault (``runs``), what the injector did and kvattn's counts."""
    servers = [
        Server(f"{kind}-hicache", kind, folder, extra=HICACHE, python=python, env=env)
        for kind in ("torch_native", "kvattn")
    ]
    out = {}
    with running(model, *servers):
        for server in servers:
            runs_of = {"clean": offload_lane(server, fault=False)}
            for fault in OFFLOAD_FAULTS:
                runs_of[fault] = offload_lane(server, fault=True)
            out[server.name] = dict(runs=runs_of, faults=server.faults(), counts=server.counts())
    return out


def serve_workloads(
    model: pathlib.Path,
    folder: pathlib.Path,
    seeds=(0, 1),
    page_sizes=PAGE_SIZES,
    python=sys.executable,
    env: dict | None = None,
    extra: tuple = (),
) -> dict:
    """Per server (``torch_native-p16``, ``kvattn-p16``, ...): ``runs`` (``clean-SEED`` and
    ``FAULT-SEED``: each request's result; ``domains-clean`` and ``domains-salt-ignored``: the
    class-5 lanes), what the injectors did and kvattn's counts. ``extra``: more server
    arguments (speculative decoding's, say)."""
    servers = [
        Server(
            f"{kind}-p{p}",
            kind,
            folder,
            page_size=p,
            extra=POOL + tuple(extra),
            python=python,
            env=env,
        )
        for p in page_sizes
        for kind in ("torch_native", "kvattn")
    ]
    out = {}
    with running(model, *servers):
        for server in servers:
            runs_of = {}
            for seed in seeds:
                runs_of[f"clean-{seed}"] = run_workload(server, workload(seed))
                for fault in FAULTS:
                    runs_of[f"{fault}-{seed}"] = run_workload(server, workload(seed, fault))
            runs_of["domains-clean"] = domain_lane(server, fault=False)
            runs_of["domains-salt-ignored"] = domain_lane(server, fault=True)
            out[server.name] = dict(runs=runs_of, faults=server.faults(), counts=server.counts())
    return dict(seeds=list(seeds), page_sizes=list(page_sizes), servers=out)


# -- the incident's stack ---------------------------------------------------------------------------


def transfer(prefill: Server, decode: Server, rid: str, ids: list[int]) -> dict:
    """One request through a pair, as SGLang's router sends it (the same body, with the
    prefill's bootstrap address and a room, to both): the decode's result."""
    boot = dict(
        bootstrap_host="127.0.0.1",
        bootstrap_port=prefill.bootstrap_port,
        bootstrap_room=random.randrange(1, 2**62),
    )
    _, result = concurrently(
        [
            lambda: prefill.generate(rid, ids, NEW, **boot),
            lambda: decode.generate(rid, ids, NEW, **boot),
        ]
    )
    return result


def replay_incident(
    model: pathlib.Path, folder: pathlib.Path, python=sys.executable, env: dict | None = None
) -> dict:
    """Per attention (``stock``, ``kvattn``): each request's ``results``, what the prefill's and
    the decode's injectors did (the decode also logs each transfer's pages) and the decode's
    counts; and the two mixed pairs."""
    pairs = {
        kind: (
            Server(f"{kind}-prefill", attention, folder, mode="prefill", python=python, env=env),
            Server(
                f"{kind}-decode",
                attention,
                folder,
                mode="decode",
                extra=DECODE_POOL,
                python=python,
                env=env,
            ),
        )
        for kind, attention in (("stock", "torch_native"), ("kvattn", "kvattn"))
    }
    out = {}
    with running(model, *pairs["stock"], *pairs["kvattn"]):
        for kind, (prefill, decode) in pairs.items():
            result = {"tenant": transfer(prefill, decode, f"{kind}-tenant", TENANT)}
            result["victim"], result["beside"] = concurrently(
                [
                    lambda p=prefill, d=decode, k=kind: transfer(
                        p, d, f"placeholder:{k}-victim", PROMPT
                    ),
                    lambda p=prefill, d=decode, k=kind: transfer(p, d, f"{k}-beside", BESIDE),
                ]
            )
            # Before the replay: the frame it repeats is of another prompt.
            result["beside-clean"] = transfer(prefill, decode, f"{kind}-beside-clean", BESIDE)
            for fault in ATTESTATION_FAULTS[::-1]:
                result[fault] = transfer(prefill, decode, f"{fault}:{kind}", PROMPT)
            result["clean"] = transfer(prefill, decode, f"{kind}-clean", PROMPT)
            out[kind] = dict(
                results=result,
                prefill_faults=prefill.faults(),
                decode_log=decode.faults(),
                counts=decode.counts(),
            )
        (stock_prefill, stock_decode), (prefill, decode) = pairs["stock"], pairs["kvattn"]
        out["kvattn-prefill-stock-decode"] = transfer(prefill, stock_decode, "mixed-1", PROMPT)
        out["stock-prefill-kvattn-decode"] = transfer(stock_prefill, decode, "mixed-2", PROMPT)
    return out


# -- the verdict ------------------------------------------------------------------------------------


def _caught(result: dict) -> bool:
    return result["status"] >= 400 and OWNERSHIP_ERROR in (result["message"] or "")


def _applied(server: dict, rid: str, log: str = "faults") -> bool:
    return any(record.get("rid") == rid and "fault" in record for record in server[log])


def _merged(rows: list[Row]) -> list[Row]:
    """One row of the tallies of ``rows`` (the same fault at each page size)."""
    if not rows:
        return []
    total = Row(rows[0].cls, rows[0].fault, rows[0].reports)
    for row in rows:
        for field in ("runs", "injected", "caught", "victim_only", "stock_changed"):
            setattr(total, field, getattr(total, field) + getattr(row, field))
    return [total]


def _tally(report: Report, ours: dict, theirs: dict, names=None) -> None:
    """Requests ``names`` (default: all of ``ours``) as clean requests of ``report``: kvattn's
    results ``ours`` against the stock attention's ``theirs``, by request."""
    for name in ours if names is None else names:
        report.clean_requests += 1
        report.false_refusals += ours[name]["status"] != 200
        report.clean_equal_to_stock += ours[name]["ids"] == theirs[name]["ids"]


def _judge_offload(report: Report, offload: dict) -> None:
    """The offload lane's clean requests and its fault's row, into ``report``."""
    stock, mine = offload["torch_native-hicache"], offload["kvattn-hicache"]
    clean, clean_stock = mine["runs"]["clean"], stock["runs"]["clean"]
    _tally(report, clean, clean_stock)
    for fault, (cls, reports) in OFFLOAD_FAULTS.items():
        faulted, faulted_stock = mine["runs"][fault], stock["runs"][fault]
        aimed = f"{fault}:offload-b"
        report.rows.append(
            Row(
                cls,
                fault,
                reports,
                runs=1,
                injected=int(_applied(mine, aimed) and _applied(stock, aimed)),
                caught=int(_caught(faulted["b"])),
                victim_only=int(
                    all(
                        r["status"] == 200 and r["ids"] == clean[n]["ids"]
                        for n, r in faulted.items()
                        if n != "b"
                    )
                ),
                stock_changed=int(
                    faulted_stock["b"]["status"] == 200
                    and faulted_stock["b"]["ids"] != clean_stock["b"]["ids"]
                ),
            )
        )


def judge(
    servers: dict, incident: dict | None, version: str, offload: dict | None = None
) -> Report:
    """The conformance report of :func:`serve_workloads`', :func:`replay_incident`'s and
    :func:`serve_offload`'s results (``incident`` None: the pair did not run; ``offload`` None:
    the offload lane did not)."""
    report = Report("SGLang", version, servers["seeds"], [])
    rows = {fault: Row(cls, fault, reports) for fault, (cls, reports) in FAULTS.items()}
    domain_rows = []
    for p in servers["page_sizes"]:
        stock, mine = servers["servers"][f"torch_native-p{p}"], servers["servers"][f"kvattn-p{p}"]
        for seed in servers["seeds"]:
            clean, clean_stock = mine["runs"][f"clean-{seed}"], stock["runs"][f"clean-{seed}"]
            _tally(report, clean, clean_stock)
            for fault, row in rows.items():
                aimed = victim(fault, seed)
                faulted, faulted_stock = (
                    mine["runs"][f"{fault}-{seed}"],
                    stock["runs"][f"{fault}-{seed}"],
                )
                row.runs += 1
                row.injected += _applied(mine, aimed) and _applied(stock, aimed)
                row.caught += _caught(faulted[aimed])
                row.victim_only += all(
                    r["status"] == 200 and r["ids"] == clean[rid]["ids"]
                    for rid, r in faulted.items()
                    if rid != aimed
                )
                row.stock_changed += (
                    faulted_stock[aimed]["status"] == 200
                    and faulted_stock[aimed]["ids"] != clean_stock[aimed.split(":", 1)[1]]["ids"]
                )
        row = Row(5, "salt-ignored", DOMAIN_FAULTS["salt-ignored"][1], runs=1)
        clean, clean_stock = mine["runs"]["domains-clean"], stock["runs"]["domains-clean"]
        faulted, faulted_stock = (
            mine["runs"]["domains-salt-ignored"],
            stock["runs"]["domains-salt-ignored"],
        )
        _tally(report, clean, clean_stock)
        # Injected: the salt was dropped on both servers, and tenant 2 was served from tenant 1's
        # pages on SGLang's attention.
        row.injected = int(
            _applied(mine, "salt-ignored:tenant-2")
            and _applied(stock, "salt-ignored:tenant-2")
            and (faulted_stock["t2"]["cached"] or 0) > 0
        )
        row.caught = int(_caught(faulted["t2"]))
        row.victim_only = int(
            all(
                faulted[n]["status"] == 200 and faulted[n]["ids"] == clean[n]["ids"]
                for n in ("t1", "t1b")
            )
        )
        row.stock_changed = int(faulted_stock["t2"]["ids"] != clean_stock["t2"]["ids"])
        domain_rows.append(row)
    report.rows = list(rows.values()) + _merged(domain_rows)
    report.not_replayed = dict(NOT_REPLAYED)
    if offload is not None:
        _judge_offload(report, offload)
    if incident is None:
        report.not_replayed[6] = (
            "the Mooncake transfer engine is not installed: the prefill/decode pair did not run"
        )
        return report
    stock, mine = incident["stock"], incident["kvattn"]
    bystanders = ("tenant", "beside", "beside-clean", "clean")
    _tally(report, mine["results"], stock["results"], bystanders)
    # Every other request of the pair kept its answer: the tenant's and the clean ones.
    others_kept = all(
        mine["results"][n]["status"] == 200
        and mine["results"][n]["ids"] == stock["results"][n]["ids"]
        for n in bystanders
    )
    for fault, (cls, reports) in PD_FAULTS.items():
        key = "victim" if fault == "placeholder" else fault
        rid = "placeholder:{}-victim" if fault == "placeholder" else f"{fault}:{{}}"
        applied = [
            _applied(run, rid.format(kind), "prefill_faults")
            or _applied(run, rid.format(kind), "decode_log")
            for kind, run in (("stock", stock), ("kvattn", mine))
        ]
        theirs = stock["results"][key]
        report.rows.append(
            Row(
                cls,
                fault,
                reports,
                runs=1,
                injected=int(all(applied)),
                caught=int(_caught(mine["results"][key])),
                victim_only=int(others_kept),
                stock_changed=int(
                    theirs["status"] == 200 and theirs["ids"] != stock["results"]["clean"]["ids"]
                ),
            )
        )
    return report


def run(
    seeds,
    work: pathlib.Path,
    model: str | None = None,
    page_sizes=PAGE_SIZES,
    python=sys.executable,
    env: dict | None = None,
) -> dict:
    """The workloads, the offload lane and (only where Mooncake is installed) the incident's pair,
    at once; the raw results, also written to ``work``/sglang.json."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError(f"SGLang is not installed in this Python environment ({sys.executable})")
    # Absolute: each server runs in a folder of its own, where a relative path means nothing.
    work = pathlib.Path(work).resolve()
    model = str(pathlib.Path(model).resolve()) if model is not None else None
    if model is None:
        from kvattn.conformance.model import build

        model = work / "model"
        if not (model / "config.json").exists():
            build(str(model))
    folders = {name: work / name for name in ("servers", "incident", "offload")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    jobs = [
        lambda: serve_workloads(model, folders["servers"], seeds, page_sizes, python, env),
        lambda: serve_offload(model, folders["offload"], python, env),
    ]
    if importlib.util.find_spec("mooncake") is not None:
        jobs.append(lambda: replay_incident(model, folders["incident"], python, env))
    results = concurrently(jobs)
    raw = dict(
        version=importlib.metadata.version("sglang"),
        servers=results[0],
        offload=results[1],
        incident=results[2] if len(results) > 2 else None,
    )
    (work / "sglang.json").write_text(json.dumps(raw))
    return raw

"""kvattn under vLLM's disaggregated serving over NIXL: a prefill and a decode instance of vLLM
0.32 (the CPU build), each in its own process, moving KV over UCX on the loopback
(vllm_nixl.py), once on vLLM's own attention and ``NixlConnector``, once on kvattn's and
``CheckedNixlConnector`` (kvattn.integrations.vllm_connector).

A clean transfer answers as a single instance does, on both (one of them with a prefix-cache hit
on the prefill side). The incident, replayed through NIXL
after earlier requests filled the prefill instance's pool: the long prompt does not fit the
prefill instance, a 1-token placeholder is prefilled in its place, and the decode instance gets
(a) a block list padded with the prefill instance's other blocks under the whole prompt's token
count: vLLM answers over other users' KV, kvattn fails that request, the padded blocks
unattested; (b) the placeholder's own one-block list: vLLM's decode engine stops (an assertion in
its receiver) and the clean request beside it is lost with it, kvattn reads the one block, fails
the victim only and answers the other. The twin of the checked bytes: a block whose
bytes change on the prefill side after they were attested fails that request on kvattn; vLLM
answers with other tokens. The
two instances behind OpenAI servers on kvattn: the padded placeholder gets an error status.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from vllm_prompts import EARLIER, LONG, SHORT, WARMUPS

from kvattn_testing import engines
from kvattn_testing.engines import ROOT, VENV_PY, why_no_vllm

DRIVER = ROOT / "tests" / "integrations" / "vllm" / "vllm_nixl.py"
START_S = 600  # bound on a pair of instances, start to finish
PREFILL_CAPACITY = 128  # the prefill instance's max_model_len, as in vllm_nixl.py

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


def why_no_nixl() -> str | None:
    probe = subprocess.run([str(VENV_PY), "-c", "import nixl._api"], capture_output=True, text=True)
    if probe.returncode != 0:
        return (
            "NIXL is not installed in build/venv-vllm (make vllm-env installs nixl-cu12): "
            + (probe.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return None


if why_no_nixl():
    pytest.skip(why_no_nixl(), allow_module_level=True)


def free_ports(n: int) -> list[str]:
    """``n`` ports free on 127.0.0.1 below the kernel's ephemeral range (which vLLM draws its
    own sockets from, so a port handed back by the kernel could be taken before it is used)."""
    ports = []
    for port in range(20000 + os.getpid() % 5000 * 2, 30000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(str(port))
        if len(ports) == n:
            return ports
    raise RuntimeError("no free ports on 127.0.0.1 in [20000, 30000)")


class Runs(engines.Runs):
    def nixl(self) -> dict:
        return self.shared("nixl", self._compute)

    def _compute(self) -> dict:
        out = {}
        for kvattn in (False, True):
            name = "kvattn" if kvattn else "stock"
            work = self.dir / f"nixl-{name}"
            work.mkdir(exist_ok=True)
            ports = free_ports(2)
            procs = {}
            for role in ("prefill", "decode"):
                log = open(work / f"{role}.log", "w")
                procs[role] = subprocess.Popen(
                    [
                        str(VENV_PY),
                        str(DRIVER),
                        role,
                        str(self.model),
                        str(work / f"{role}.json"),
                        str(work),
                        *ports,
                    ],
                    env=engines.env(kvattn),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
                log.close()
            self._supervise(name, work, procs)
            for role in procs:
                out[f"{role}-{name}"] = json.loads((work / f"{role}.json").read_text())
        local = self.dir / "nixl-local.json"
        subprocess.run(
            [
                str(VENV_PY),
                str(DRIVER),
                "local",
                str(self.model),
                str(local),
                str(self.dir),
                "0",
                "0",
            ],
            env=engines.env(False),
            check=True,
            capture_output=True,
            timeout=START_S,
            cwd=ROOT,
        )
        out["local"] = json.loads(local.read_text())
        return out

    @staticmethod
    def _supervise(name: str, work, procs: dict) -> None:
        """Wait for both instances; one that fails or outlives ``START_S`` stops both (by pid)."""
        deadline = time.monotonic() + START_S
        while any(p.poll() is None for p in procs.values()):
            failed = [r for r, p in procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs.values():
                    p.kill()
                    p.wait()
                role = failed[0] if failed else "prefill"
                tail = (work / f"{role}.log").read_text().splitlines()[-30:]
                why = f"failed ({procs[role].returncode})" if failed else f"ran past {START_S} s"
                raise RuntimeError(f"{name} {role} {why}:\n" + "\n".join(tail))
            time.sleep(0.5)
        for role, p in procs.items():
            if p.returncode != 0:
                tail = (work / f"{role}.log").read_text().splitlines()[-30:]
                raise RuntimeError(f"{name} {role} failed ({p.returncode}):\n" + "\n".join(tail))


@pytest.fixture(scope="module")
def nixl():
    return Runs().nixl()


def _failure(decode: dict, case: str) -> str:
    # The engine's own id is the output's id with a suffix ("2" -> "2-85e87132").
    rid = decode["results"][case]["request_id"]
    messages = [m for r, m in decode["failures"] if r == rid or r.startswith(rid + "-")]
    assert len(messages) == 1, (case, decode["failures"])
    return messages[0]


def test_the_prefill_instance_refuses_the_long_prompt(nixl):
    for name in ("stock", "kvattn"):
        assert "maximum context length is 128" in nixl[f"prefill-{name}"]["refused"]


@pytest.mark.parametrize("case", ["short", "shared", "local_hit"])
def test_a_clean_transfer_answers_as_a_single_instance(nixl, case):
    """``shared``: its first block a prefix-cache hit on both instances; ``local_hit``: decoded
    locally, its first block a hit on a block that arrived by the transfer."""
    for name in ("stock", "kvattn"):
        result = nixl[f"decode-{name}"]["results"][case]
        assert result["finish_reason"] == "length" and result["tokens"] == nixl["local"][case]
    kvattn = nixl["decode-kvattn"]
    # The short prompt's two blocks, the shared one's second (its first was a local hit).
    assert kvattn["counts"]["received_blocks_committed"] >= 3
    rid = kvattn["results"][case]["request_id"]
    assert not any(r.startswith(rid + "-") for r, _ in kvattn["failures"])


def test_the_sender_attests_what_its_tags_hold(nixl):
    """The prefill instance's attestation: one per offered block, the short prompt's 60 tokens
    as 32 + 28 written slots; the placeholder's single token; vLLM's own sends none. Each
    request's digests are keyed by a key of its own (vLLM's CPU cache, K and V interleaved per
    head, read in place)."""
    params = nixl["prefill-kvattn"]["params"]
    assert [n for n, _ in params["short"]["kvattn_pages"]] == [32, 28]
    assert [n for n, _ in params["shared"]["kvattn_pages"]] == [32, 30]
    # The hit is the short request's own block, attested under its writer's owner (its whole
    # length), under the sharing request's own key.
    assert params["shared"]["remote_block_ids"][0][0] == params["short"]["remote_block_ids"][0][0]
    keys = [params[name]["kvattn_digest_key"] for name in ("short", "shared", "placeholder")]
    assert all(isinstance(k, str) and len(k) == 64 for k in keys) and len(set(keys)) == 3
    assert params["shared"]["kvattn_pages"][0][1] != params["short"]["kvattn_pages"][0][1]
    assert [n for n, _ in params["placeholder"]["kvattn_pages"]] == [1]
    assert "kvattn_pages" not in nixl["prefill-stock"]["params"]["short"]


def test_the_incident_leaks_or_stops_the_engine_on_vllm(nixl):
    stock, local = nixl["decode-stock"]["results"], nixl["local"]
    # (a) answered over the prefill instance's earlier requests' KV, as a success.
    assert stock["padded"]["finish_reason"] == "length"
    assert stock["padded"]["tokens"] != local["long"]
    # (b) the engine stopped: the victim and the clean request beside it have no answer.
    assert stock["engine_died"].startswith("AssertionError")
    assert "short_list" not in stock and "beside" not in stock


def test_the_incident_fails_only_the_victim_on_kvattn(nixl):
    kvattn, local = nixl["decode-kvattn"], nixl["local"]
    results = kvattn["results"]
    assert "engine_died" not in results
    for case in ("padded", "short_list"):
        assert results[case]["finish_reason"] == "error" and results[case]["tokens"] == []
    assert results["beside"]["finish_reason"] == "length"
    assert results["beside"]["tokens"] == local["beside"]
    padded = _failure(kvattn, "padded")
    # The list does not line up with the attestation (one block): none of it is committed.
    assert "10 transferred block(s) not committed" in padded and "not attested" in padded
    assert "RESERVED" in padded
    assert "RESERVED" in _failure(kvattn, "short_list")


def test_bytes_that_differ_from_the_attestation_are_not_committed(nixl):
    """The twin of the clean transfer: a request whose second block's K bytes (first layer)
    changed on the prefill side after they were attested. vLLM reads them without a word (its
    answer moves); kvattn refuses the block."""
    kvattn, stock, local = nixl["decode-kvattn"], nixl["decode-stock"], nixl["local"]
    assert kvattn["results"]["corrupt"]["finish_reason"] == "error"
    message = _failure(kvattn, "corrupt")
    assert "digest mismatch" in message and "logical 1" in message
    assert stock["results"]["corrupt"]["finish_reason"] == "length"
    assert stock["results"]["corrupt"]["tokens"] != local["corrupt"]


def _serve(model, port: str, side_channel: str, kvattn: bool, role: str, log_path, *extra):
    """An OpenAI server of vLLM as one instance of the pair (multi-process engine: its own engine
    core and worker processes), in its own session so that it is stopped whole."""
    env = engines.env(kvattn=kvattn)
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]
    # Two servers share the cores: vLLM's CPU worker would pin its OpenMP threads to the same
    # ones and spin there.
    # UCX_MODULES: as in vllm_nixl.py (no InfiniBand module on the loopback; with
    # rdma-core installed it would crash the process at exit).
    env.update(
        UCX_TLS="tcp,self,sm",
        UCX_NET_DEVICES="lo",
        UCX_MODULES="^ib,rdmacm",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=side_channel,
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_WAIT_POLICY="PASSIVE",
    )
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    if kvattn:
        transfer.update(
            kv_connector="CheckedNixlConnector",
            kv_connector_module_path="kvattn.integrations.vllm_connector",
        )
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [
                str(VENV_PY),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                port,
                "--dtype",
                "float32",
                "--block-size",
                "32",
                "--enforce-eager",
                "--kv-cache-memory-bytes",
                str(32 << 20),
                "--kv-transfer-config",
                json.dumps(transfer),
                *extra,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _over_http(model, work, kvattn: bool) -> dict:
    """Both instances behind OpenAI servers; the test is the router: prefill requests with
    ``do_remote_decode``, their ``kv_transfer_params`` (one altered: the padded placeholder) on
    to the decode server."""
    ports = free_ports(4)  # HTTP and side channel, per instance
    logs = {role: work / f"{role}-{'kvattn' if kvattn else 'stock'}.log" for role in ("p", "d")}
    prefill = _serve(
        model,
        ports[0],
        ports[1],
        kvattn,
        "kv_producer",
        logs["p"],
        "--max-model-len",
        str(PREFILL_CAPACITY),
        "--num-gpu-blocks-override",
        "40",
    )
    decode = _serve(
        model, ports[2], ports[3], kvattn, "kv_consumer", logs["d"], "--max-model-len", "512"
    )
    out: dict = {}
    try:
        p_base, d_base = (f"http://127.0.0.1:{port}" for port in (ports[0], ports[2]))
        engines.wait_healthy(p_base, prefill, logs["p"], START_S / 2)
        engines.wait_healthy(d_base, decode, logs["d"], START_S / 2)
        body = dict(model=str(model), temperature=0, return_token_ids=True)

        def prefilled(tokens):
            status, reply = engines.post(
                p_base + "/v1/completions",
                dict(
                    body, prompt=tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
                ),
            )
            assert status == 200, reply
            return reply["kv_transfer_params"]

        def decoded(tokens, params):
            status, reply = engines.post(
                d_base + "/v1/completions",
                dict(body, prompt=tokens, max_tokens=8, ignore_eos=True, kv_transfer_params=params),
            )
            return status, reply["choices"][0]["token_ids"] if status == 200 else reply

        earlier = [prefilled(t) for t in EARLIER]
        for tokens in WARMUPS:  # the handshake (5 s in vLLM) may time out once under load
            if decoded(tokens, prefilled(tokens))[0] == 200:
                break
        out["short"] = decoded(SHORT, prefilled(SHORT))
        placeholder = prefilled(LONG[:1])
        others = [b for e in earlier for b in e["remote_block_ids"][0]]
        padded = dict(
            placeholder,
            remote_num_tokens=len(LONG),
            remote_block_ids=[placeholder["remote_block_ids"][0] + others[:9]],
        )
        out["padded"] = decoded(LONG, padded)
    finally:
        engines.stop_servers(decode, prefill)
    out["decode_log"] = logs["d"].read_text()
    return out


def test_openai_servers_over_nixl_answer_the_incident_with_an_error(nixl, tmp_path):
    """Prefill and decode instances behind OpenAI servers on kvattn (each with its own engine
    core and worker processes: the attestation travels from the prefill worker to its scheduler
    with the step's output): the clean transfer gets a single instance's tokens (200); the padded
    placeholder an error status, with the reasons in the decode server's log. vLLM's own
    attention answers the same placeholder with other tokens as a normal completion
    (test_the_incident_leaks_or_stops_the_engine_on_vllm, in process: the servers add nothing
    to that engine's answer)."""
    kvattn = _over_http(Runs().model, tmp_path, kvattn=True)
    assert kvattn["short"] == (200, nixl["local"]["short"])
    status, reply = kvattn["padded"]
    assert status >= 400 and "choices" not in reply and "error" in reply, reply
    log = kvattn["decode_log"]
    assert "kvattn ownership check failed for request" in log
    assert "not attested" in log and "RESERVED" in log

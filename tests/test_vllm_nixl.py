"""kvattn under vLLM's disaggregated serving over NIXL: a prefill and a decode instance of vLLM
0.32 (the CPU build), each in its own process, moving KV over UCX on the loopback
(tests/vllm_nixl.py), once on vLLM's own attention and ``NixlConnector``, once on kvattn's and
``CheckedNixlConnector`` (kvattn.integrations.vllm_connector).

A clean transfer answers as a single instance does, on both (one of them with a prefix-cache hit
on the prefill side). The incident, replayed through NIXL
after earlier requests filled the prefill instance's pool: the long prompt does not fit the
prefill instance, a 1-token placeholder is prefilled in its place, and the decode instance gets
(a) a block list padded with the prefill instance's other blocks under the whole prompt's token
count: vLLM answers over other users' KV, kvattn fails that request, the padded blocks
unattested; (b) the placeholder's own one-block list: vLLM's decode engine stops (an assertion in
its receiver) and the clean request beside it is lost with it, kvattn reads the one block, fails
the victim only and answers the other. The twin of the checked bytes: one digest of the
attestation changed on the way fails that request on kvattn and changes nothing on vLLM.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

import vllm_runs
from vllm_runs import ROOT, VENV_PY, why_no_vllm

DRIVER = ROOT / "tests" / "vllm_nixl.py"
START_S = 600  # bound on a pair of instances, start to finish

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


def why_no_nixl() -> str | None:
    probe = subprocess.run([str(VENV_PY), "-c", "import nixl._api"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("NIXL is not installed in build/venv-vllm (make vllm-env installs nixl-cu12): "
                + (probe.stderr.strip().splitlines() or ["no output"])[-1])
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


class Runs(vllm_runs.Runs):
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
                    [str(VENV_PY), str(DRIVER), role, str(self.model), str(work / f"{role}.json"),
                     str(work), *ports], env=vllm_runs.env(kvattn), stdout=log,
                    stderr=subprocess.STDOUT, cwd=ROOT)
                log.close()
            self._supervise(name, work, procs)
            for role in procs:
                out[f"{role}-{name}"] = json.loads((work / f"{role}.json").read_text())
        local = self.dir / "nixl-local.json"
        subprocess.run([str(VENV_PY), str(DRIVER), "local", str(self.model), str(local),
                        str(self.dir), "0", "0"], env=vllm_runs.env(False), check=True,
                       capture_output=True, timeout=START_S, cwd=ROOT)
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


@pytest.mark.parametrize("case", ["short", "shared"])
def test_a_clean_transfer_answers_as_a_single_instance(nixl, case):
    """``shared``: its first block a prefix-cache hit on the prefill instance."""
    for name in ("stock", "kvattn"):
        result = nixl[f"decode-{name}"]["results"][case]
        assert result["finish_reason"] == "length" and result["tokens"] == nixl["local"][case]
    kvattn = nixl["decode-kvattn"]
    assert kvattn["counts"]["received_blocks_committed"] >= 4  # two blocks each
    rid = kvattn["results"][case]["request_id"]
    assert not any(r.startswith(rid + "-") for r, _ in kvattn["failures"])


def test_the_sender_attests_what_its_tags_hold(nixl):
    """The prefill instance's attestation: one per offered block, the short prompt's 60 tokens
    as 32 + 28 written slots; the placeholder's single token; vLLM's own sends none."""
    params = nixl["prefill-kvattn"]["params"]
    assert [n for n, _ in params["short"]["kvattn_pages"]] == [32, 28]
    assert [n for n, _ in params["shared"]["kvattn_pages"]] == [32, 30]
    # The hit is the short request's own block, attested under its writer's owner.
    assert params["shared"]["remote_block_ids"][0][0] == params["short"]["remote_block_ids"][0][0]
    assert params["shared"]["kvattn_pages"][0] == params["short"]["kvattn_pages"][0]
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
    assert "9 transferred block(s) not committed" in padded and "not attested" in padded
    assert "RESERVED" in padded
    assert "RESERVED" in _failure(kvattn, "short_list")


def test_bytes_that_differ_from_the_attestation_are_not_committed(nixl):
    """The twin of the clean transfer: the same request with one digest changed on the way."""
    kvattn, stock, local = nixl["decode-kvattn"], nixl["decode-stock"], nixl["local"]
    assert kvattn["results"]["corrupt"]["finish_reason"] == "error"
    message = _failure(kvattn, "corrupt")
    assert "digest mismatch" in message and "logical 1" in message
    assert stock["results"]["corrupt"]["tokens"] == local["short"]  # vLLM does not look

"""Static resources of the Triton decode and extend kernels compiled for sm_90 (no GPU needed): the checked
and unchecked variants must not spill. The figures are printed, never compared as speed."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(ROOT, "tools", "triton_resources.py")


@pytest.fixture(scope="module")
def resources():
    # A fresh process without the interpreter: under TRITON_INTERPRET=1 there is nothing to compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The tool imports kvattn from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, TOOL, "--json"], capture_output=True, text=True, env=env)
    if run.returncode == 1 and "not found" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_decode_kernel_does_not_spill(resources):
    assert len(resources) >= 10  # every config, checked and unchecked
    for row in resources:
        print(row)
        assert row["local"] == 0 and row["stack"] == 0, f"spills: {row}"


def test_check_adds_no_shared_memory(resources):
    by_config = {}
    for row in resources:
        key = (row["kernel"], row["dtype"], row["head_dim"], row["page_size"])
        by_config.setdefault(key, {})[row["check"]] = row
    for key, pair in by_config.items():
        assert pair[True]["shared"] == pair[False]["shared"], (key, pair)

"""The sanitizer run (``make sanitize``): the harness module built with AddressSanitizer and UBSan
stands in for ``kvattn.backends.cuda_sim._sim`` (tests/conftest.py), and the harness, hardening and
fuzz tests of cuda_sim run against it. These tests prove the run is what it says: the instrumented
module is the one loaded, and it reports an out-of-bounds read (so a clean run means something).
Skipped outside ``make sanitize``."""

import os
import subprocess
import sys

import pytest

SANITIZED = os.environ.get("KVATTN_SIM_MODULE")
pytestmark = pytest.mark.skipif(not SANITIZED, reason="only under make sanitize")


def test_the_sanitized_module_stands_in_for_the_harness():
    from kvattn.backends import cuda_sim

    assert os.path.samefile(cuda_sim._sim.__file__, SANITIZED)
    assert cuda_sim.why_not_write_kv.__module__ == "kvattn.backends.cuda_sim"
    values, error = cuda_sim._sim.harness_selftest(0, 64)
    assert error == "" and values == [(i + 1) % 64 for i in range(64)]


def test_the_sanitizer_reports_a_read_past_a_buffer():
    """The twin of a clean run: a kernel thread reading one element past its output buffer, from a
    fiber's stack frame, stops the process with AddressSanitizer's report."""
    code = (
        "import importlib.util, os\n"
        "spec = importlib.util.spec_from_file_location('kvattn.backends.cuda_sim._sim', "
        "os.environ['KVATTN_SIM_MODULE'])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.harness_selftest(4, 64))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in done.stderr, done.stderr[-2000:]
    assert "neighbour_kernel" in done.stderr  # the report points into the kernel

"""``pip install .`` into a fresh virtual environment builds the extensions a user's machine allows.

One build for the module: the fixture copies the repository's files as a clone would hold them (no
build/, no in-place modules), creates a virtual environment that sees the machine's packages (torch
and triton are not downloaded again), and runs ``pip install -v .`` with ``KVATTN_CUDA_ARCHS=90``.
The CUDA module is built only where nvcc is found and a GPU is visible (setup.py's default), so on
a machine without a GPU the install builds the CPU harness alone and says why it skipped the rest.
What was built is checked, never how long it took. The build
requirements come from the package index into pip's isolated build environment, as on a user's
machine; where no index answers (the GPU machine), the build runs without isolation against
the installed setuptools and pybind11. The test then looks at the installed package from outside
the repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time

import pytest

from kvattn import extensions
from kvattn_testing.build import instantiations

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA = "kvattn.backends.cuda._C"
SIM = "kvattn.backends.cuda_sim._sim"
BUILD_REQUIREMENTS = ("setuptools>=64", "pybind11>=2.12", "ninja")

pytestmark = [pytest.mark.slow, pytest.mark.host_only]


def _nvcc_present() -> bool:
    """setup.py's rule: nvcc on PATH, else in $CUDA_HOME/bin (default /usr/local/cuda)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def _gpu_visible() -> bool:
    """setup.py's rule for a machine where the CUDA module can run."""
    if os.path.exists("/dev/nvidiactl"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    return listed.returncode == 0 and "GPU" in listed.stdout


def _cuda_skipped_because() -> str | None:
    """Why this machine's install skips the CUDA module (a phrase of the build's reason), or None
    when it builds it."""
    if not _nvcc_present():
        return "nvcc not found"
    if not _gpu_visible():
        return "no GPU visible (KVATTN_CUDA_BUILD=1 builds it anyway)"
    return None


def _source_files() -> list[str]:
    """What a clone holds: tracked files, plus new files git does not ignore."""
    try:
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=False,
        )
    except OSError:  # no git on this machine
        listed = None
    if listed is not None and listed.returncode == 0:
        return [f for f in listed.stdout.decode().split("\0") if f and (ROOT / f).is_file()]
    # A tree that travelled without .git: everything but what builds and runs leave behind.
    skip = {"build", "dist", ".git", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks"}
    return [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file()
        and not skip & set(p.relative_to(ROOT).parts)
        and p.suffix not in (".so", ".o", ".pyc")
        and p.name != "_build.json"
    ]


def _clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONPATH",
            "KVATTN_SKIP_EXTENSIONS",
            "KVATTN_SKIP_CUDA_BUILD",
            "KVATTN_CUDA_BUILD",
            "KVATTN_CUDA_ARCHS",
            "KVATTN_CUDA_DTYPES",
            "KVATTN_CUDA_HEAD_DIMS",
            "KVATTN_CUDA_VARIANTS",
            "KVATTN_BACKEND",
        )
    }
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _index_answers(python: str, scratch: pathlib.Path) -> bool:
    """Whether pip can fetch the build requirements (bounded: no retries, short timeout)."""
    probe = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--retries",
            "0",
            "--timeout",
            "15",
            "-q",
            "-d",
            str(scratch),
            *BUILD_REQUIREMENTS,
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(venv python, pip log, seconds)`` after ``pip install -v .`` of a copy of this tree."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    # The venv sees this interpreter's packages through a .pth file (--system-site-packages would
    # show the base interpreter's, which inside a virtual environment lack torch). --without-pip:
    # the visible pip installs into the environment it runs in; ensurepip would only add seconds.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True)
    python = str(base / "venv" / "bin" / "python")
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    paths = dict.fromkeys(
        [
            sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"],
            *site.getsitepackages(),
        ]
    )
    pathlib.Path(site_dir, "kvattn-parent.pth").write_text("\n".join(paths) + "\n")
    command = [python, "-m", "pip", "install", "-v", "."]
    if not _index_answers(python, base / "requirements"):
        # setup.py builds without ninja (plain nvcc calls), not without these two.
        missing = [
            m
            for m in ("setuptools", "pybind11")
            if subprocess.run([python, "-c", f"import {m}"], capture_output=True).returncode
        ]
        if missing:
            pytest.skip(f"no package index answers and {missing} are not installed: cannot build")
        command.append("--no-build-isolation")
    start = time.perf_counter()
    # The timeout only stops a hung build; the time is printed, never compared.
    result = subprocess.run(
        command,
        cwd=src,
        capture_output=True,
        text=True,
        env=_clean_env(KVATTN_CUDA_ARCHS="90"),
        timeout=3600,
    )
    seconds = time.perf_counter() - start
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"pip install failed after {seconds:.0f} s:\n{log[-6000:]}"
    print(f"pip install . took {seconds:.1f} s")
    return python, log, seconds


def _run_installed(python: str, code: str, cwd: pathlib.Path) -> str:
    """Run ``code`` with the environment's Python outside the repository (so the checkout's kvattn
    cannot shadow the installed one)."""
    result = subprocess.run(
        [python, "-c", code], cwd=cwd, capture_output=True, text=True, env=_clean_env(), timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


PROBE = r"""
import json, torch, kvattn
from kvattn import extensions
k = torch.randn(4, 16, 1, 64).half(); v = torch.randn(4, 16, 1, 64).half()
tags = torch.zeros(4, dtype=torch.int64)
kvattn.reserve_pages(tags, [2], owner=3)
written = kvattn.write_kv(k[0, :5], v[0, :5], k, v, torch.arange(32, 37), tags, 3, backend="cuda_sim")
out, report = kvattn.paged_decode(torch.randn(1, 2, 64).half(), k, v, torch.tensor([[2]], dtype=torch.int32),
                                  torch.tensor([5], dtype=torch.int32), tags, torch.tensor([3]),
                                  backend="cuda_sim")
print(json.dumps({
    "file": kvattn.__file__,
    "statuses": {n: [s.state, s.reason, s.path] for n, s in extensions.statuses().items()},
    "record": extensions.read_record(),
    "py_typed": (extensions.record_path().parent / "py.typed").is_file(),
    "test_only": [p.name for p in extensions.record_path().parent.glob("backends/cuda_sim/_sim_break*")],
    "sim_dropped": written.dropped_count(), "sim_checked": int(report.pages_checked.sum()),
    "sim_refused": int(report.violations.sum()),
}))
"""


def test_pip_install_in_a_fresh_venv(installed, tmp_path):
    """One test, so that xdist never gives the build to two workers: the installed modules, the
    build's one line, and ``python -m kvattn.env`` from the installed package."""
    python, log, seconds = installed
    _check_installed_modules(python, tmp_path)
    _check_the_one_line(log)
    _check_environment_report(python, tmp_path)
    print(f"fresh-venv pip install: {seconds:.1f} s")


def _check_installed_modules(python: str, cwd: pathlib.Path) -> None:
    got = json.loads(_run_installed(python, PROBE, cwd).splitlines()[-1])
    venv = pathlib.Path(python).parent.parent
    assert pathlib.Path(got["file"]).is_relative_to(venv), got["file"]
    assert got["py_typed"]

    state, reason, path = got["statuses"][SIM]
    assert state == "built" and pathlib.Path(path).is_relative_to(venv), (state, reason, path)
    # The installed harness runs the kernels: 5 tokens written, one page checked, none refused.
    assert (got["sim_dropped"], got["sim_checked"], got["sim_refused"]) == (0, 1, 0)

    entries = got["record"]["extensions"]
    state, reason, path = got["statuses"][CUDA]
    skipped = _cuda_skipped_because()
    if skipped is None:
        assert state == "built" and pathlib.Path(path).is_relative_to(venv), (state, reason)
        assert entries[CUDA]["archs"] == ["90"]
        kernels = {(r["kernel"], r["arch"]) for r in entries[CUDA]["resources"]}
        assert {arch for _, arch in kernels} == {"sm_90"}
        assert any("paged_decode_kernel" in k for k, _ in kernels)
        assert any("paged_extend_kernel" in k for k, _ in kernels)
        # Every row of csrc/instantiations.py, from its generated units, once.
        assert entries[CUDA]["selection"]["full"]
        assert len(entries[CUDA]["resources"]) == len(kernels) == len(instantiations().TABLE)
    else:
        assert state == "not built" and skipped in reason, (state, reason)
        assert entries[CUDA]["status"] == "skipped"
    assert {e["status"] for n, e in entries.items() if n != CUDA} == {"built"}
    # The harness builds with a deliberate defect are the tests' own: not in a wheel, nor listed.
    assert got["test_only"] == [] and not set(entries) & set(extensions.TEST_ONLY), got
    assert set(got["statuses"]) == set(extensions.EXTENSIONS) - set(extensions.TEST_ONLY)


def _check_the_one_line(log: str) -> None:
    lines = [
        line.strip()
        for line in log.splitlines()
        if re.match(r"\s*kvattn: built .*(skipped|failed)", line)
    ]
    assert len(lines) == 1, lines
    skipped = _cuda_skipped_because()
    if skipped is None:
        assert lines[0].endswith("skipped nothing") and "cuda._C (sm_90)" in lines[0], lines[0]
    else:
        assert f"skipped cuda._C: {skipped}" in lines[0], lines[0]


def _check_environment_report(python: str, cwd: pathlib.Path) -> None:
    result = subprocess.run(
        [python, "-m", "kvattn.env"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert result.returncode == 0 and "RuntimeWarning" not in result.stderr, result.stderr
    assert "Extensions:" in result.stdout and SIM in result.stdout
    if _cuda_skipped_because() is None:
        assert "CUDA module, static resources (ptxas" in result.stdout

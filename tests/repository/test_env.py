"""``kvattn.info()`` / ``python -m kvattn.env``, and the build status of the extensions
(:mod:`kvattn.extensions`): built, not built and build failed say different things."""

from __future__ import annotations

import importlib.machinery
import json
import os
import pathlib
import subprocess
import sys

import pytest

import kvattn
from kvattn import backends, demo, env, extensions
from kvattn.backends.triton.paged_decode import interpreted

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_info_says_which_backend_accepts_which_op_and_why_the_others_refuse():
    data = kvattn.info()
    json.dumps(data)  # plain data
    assert data["versions"]["torch"] and data["versions"]["python"] and data["versions"]["kvattn"]
    cpu = data["backends"]["cpu"]
    assert set(cpu) == {"decode", "extend", "write_kv", "mla_decode", "mla_extend"}
    for op, entry in cpu.items():
        assert set(entry["reasons"]) == set(backends.names()), op
        assert entry["reasons"]["cuda"], "CPU tensors never run on the cuda backend"
    assert cpu["decode"]["reasons"]["reference"] is None
    assert cpu["extend"]["reasons"]["reference"] is None
    assert cpu["write_kv"]["reasons"]["reference"] == "no write_kv kernel"
    assert cpu["decode"]["reasons"]["torch"] is None
    assert cpu["extend"]["reasons"]["torch"] is None
    assert cpu["write_kv"]["reasons"]["torch"] is None
    assert cpu["write_kv"]["auto"] == (
        "cpu" if cpu["write_kv"]["reasons"]["cpu"] is None else "torch"
    )
    for op in ("decode", "extend"):  # the compiled CPU readers, where they are built
        compiled = cpu[op]["reasons"]["cpu"] is None
        assert cpu[op]["auto"] == ("cpu" if compiled else "triton" if interpreted() else "torch")
    assert cpu["decode"]["order"].index("torch") < cpu["decode"]["order"].index("reference")
    assert cpu["mla_decode"]["auto"] == ("triton" if interpreted() else "reference")
    assert cpu["mla_decode"]["reasons"]["torch"] == "no mla_decode kernel"
    assert cpu["mla_extend"]["auto"] == ("triton" if interpreted() else "reference")
    assert (
        cpu["mla_extend"]["reasons"]["cuda"] and cpu["mla_extend"]["reasons"]["reference"] is None
    )
    if not interpreted():
        assert "TRITON_INTERPRET=1" in cpu["decode"]["reasons"]["triton"]


def test_info_gives_the_state_of_every_extension_and_agrees_with_the_registry():
    data = kvattn.info()
    assert set(data["extensions"]) == set(extensions.EXTENSIONS)
    for name, ext in data["extensions"].items():
        assert ext["state"] in (extensions.BUILT, extensions.NOT_BUILT, extensions.FAILED), name
    sim = data["extensions"]["kvattn.backends.cuda_sim._sim"]
    reason = data["backends"]["cpu"]["decode"]["reasons"]["cuda_sim"]
    if sim["state"] == extensions.BUILT:
        assert reason is None
    elif sim["state"] == extensions.NOT_BUILT:
        assert reason == f"not built: {sim['reason']}"
    if data["cuda_resources"]:
        assert "paged_decode_kernel<" in env.report(data, kernels=True)
        assert "paged_decode_kernel<" not in env.report(data)


def test_report_lays_out_versions_backends_extensions_and_resources():
    data = kvattn.info()
    data["cuda_resources"] = [
        dict(
            kernel="void kvattn::paged_decode_kernel<__half, true>(kvattn::DecodeParams)",
            arch="sm_90",
            registers=56,
            smem_static=1024,
            stack_frame=0,
            spill_stores=0,
            spill_loads=0,
        )
    ]
    data["cuda_resources"].append(dict(data["cuda_resources"][0], registers=128, spill_stores=8))
    text = env.report(data)
    for heading in (
        "kvattn environment",
        "Backends for a probe input",
        "Extensions:",
        "CUDA module, static resources (ptxas",
    ):
        assert heading in text
    assert f"write_kv on cpu: auto takes {data['backends']['cpu']['write_kv']['auto']}" in text
    assert (
        "  sm_90: 2 kernels, at most 128 registers, 1024 bytes of static shared memory, 0 bytes "
        "of stack; 1 kernel(s) spill"
    ) in text
    data["cuda_selection"] = dict(full=False, text="dtypes fp16; head dims 128; variants off")
    data["cuda_units"] = dict(instantiations=21, units=5)
    assert (
        "  a subset (dtypes fp16; head dims 128; variants off) of csrc/instantiations.py: 21 in 5 "
        "translation units"
    ) in env.report(data)
    text = env.report(data, kernels=True)
    assert "CUDA module, static resources per kernel" in text
    row = next(line for line in text.splitlines() if "paged_decode_kernel<__half, true>" in line)
    assert row.split()[-5:] == ["sm_90", "56", "1024", "0", "0"] and "kvattn::" not in row


def test_env_command_prints_the_report_and_json():
    run = dict(
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    text = subprocess.run([sys.executable, "-m", "kvattn.env"], **run)
    assert text.returncode == 0, text.stderr
    assert "RuntimeWarning" not in text.stderr, text.stderr  # runpy: kvattn.env imported twice
    assert "Extensions:" in text.stdout and "decode on cpu: auto takes" in text.stdout
    as_json = subprocess.run([sys.executable, "-m", "kvattn.env", "--json"], **run)
    assert as_json.returncode == 0, as_json.stderr
    assert set(json.loads(as_json.stdout)["extensions"]) == set(extensions.EXTENSIONS)


def test_demo_prints_the_environment_first(monkeypatch, capsys):
    for scene in ("replay_incident", "shared_prefix_prefill", "timing_table"):
        monkeypatch.setattr(demo, scene, lambda: print("scene"))
    demo.main()
    out = capsys.readouterr().out
    assert out.startswith("kvattn environment") and out.count("scene") == 3


def _record(monkeypatch, entries: dict) -> None:
    monkeypatch.setattr(extensions, "read_record", lambda: {"extensions": entries})


def test_a_module_never_built_says_run_make_build(monkeypatch):
    _record(monkeypatch, {})
    module, status = extensions.load("kvattn.backends.cuda._never_built")
    assert module is None and status.state == extensions.NOT_BUILT
    assert status.line() == "not built: run `make build`"
    module, status = extensions.load("kvattn.backends.cuda._C_absent")
    assert status.line() == "not built: run `make build`"


def test_a_module_the_build_skipped_says_why(monkeypatch):
    _record(
        monkeypatch,
        {"kvattn.backends.cuda._absent": {"status": "skipped", "reason": "nvcc not found on PATH"}},
    )
    _, status = extensions.load("kvattn.backends.cuda._absent")
    assert status.state == extensions.NOT_BUILT
    assert (
        status.line() == "not built: run `make build` (setup.py skipped it: nvcc not found on PATH)"
    )


def test_a_failed_build_is_not_reported_as_not_built(monkeypatch, tmp_path):
    _record(
        monkeypatch,
        {
            "kvattn.backends.cuda._absent": {
                "status": "failed",
                "reason": "CalledProcessError: nvcc",
            },
            "json": {"status": "failed", "reason": "CalledProcessError: nvcc"},
        },
    )
    _, status = extensions.load("kvattn.backends.cuda._absent")
    assert (
        status.state == extensions.FAILED
        and "the last build failed (CalledProcessError" in status.line()
    )
    # An older build still loads: it is used, and the report says the last build failed.
    module, status = extensions.load("json")
    assert (
        module is not None and status.state == extensions.FAILED and "older build" in status.reason
    )

    # A module file that does not load (a broken or foreign build).
    package = tmp_path / "fakekv"
    package.mkdir()
    (package / "__init__.py").write_text("")
    broken = package / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    broken.write_bytes(b"not a shared object")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, status = extensions.load("fakekv._C")
    assert module is None and status.state == extensions.FAILED
    assert str(broken) in status.reason and "does not load" in status.reason


def test_the_cuda_backend_says_not_built_without_the_circular_import_noise():
    """With ``_C`` absent, the registry's reason is the clean one (Python's own ImportError for
    ``from . import _C`` speaks of a circular import)."""
    code = (
        "import sys; sys.modules['kvattn.backends.cuda._C'] = None\n"
        "import kvattn.backends.cuda as cuda\n"
        "print(cuda._NOT_BUILT)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    reason = result.stdout.strip()
    assert reason.startswith("not built: run `make build` where nvcc is installed"), reason
    assert "circular" not in reason


@pytest.mark.parametrize("backend", ["cuda", "cuda_sim"])
def test_a_built_extension_leaves_no_reason(backend):
    module, _ = backends.load(backend)
    if module.STATUS.path is None:
        pytest.skip(f"{backend}: {module.STATUS.line()}")
    assert module._NOT_BUILT is None and module.STATUS.state in (
        extensions.BUILT,
        extensions.FAILED,
    )


@pytest.mark.parametrize("backend", ["cuda", "cuda_sim"])
def test_built_modules_carry_the_digest_of_this_checkout(backend):
    module, _ = backends.load(backend)
    if module.STATUS.path is None:
        pytest.skip(f"{backend}: {module.STATUS.line()}")
    compiled = module._C if backend == "cuda" else module._sim
    assert compiled.SOURCE_DIGEST == extensions.source_digest(ROOT)


def test_a_module_built_from_other_sources_is_stale_and_not_used(monkeypatch):
    """A launcher newer than its kernel would pass arguments the kernel does not read (a switch
    silently off): such a module is refused, whatever the build record says."""
    module, status = extensions.load("kvattn.backends.cuda_sim._sim")
    if module is None:
        pytest.skip(status.line())
    monkeypatch.setattr(extensions, "_tree_digest", lambda: "0" * 16)
    module, status = extensions.load("kvattn.backends.cuda_sim._sim")
    assert module is None and status.state == extensions.STALE
    assert "built from other sources" in status.reason and "run `make build`" in status.reason
    assert "0" * 16 in status.reason


def test_the_source_digest_follows_every_compiled_file(tmp_path):
    (tmp_path / "csrc" / "kvattn").mkdir(parents=True)
    (tmp_path / "kvattn").mkdir()
    header, tags = tmp_path / "csrc" / "kvattn" / "decode.cuh", tmp_path / "kvattn" / "tags.py"
    table = tmp_path / "csrc" / "instantiations.py"  # the generated units and the dispatch's list
    header.write_text("// kernel\n")
    tags.write_text("OWNER_SHIFT = 16\n")
    table.write_text("TABLE = ()\n")
    (tmp_path / "csrc" / "notes.md").write_text("not compiled\n")
    first = extensions.source_digest(tmp_path)
    (tmp_path / "csrc" / "notes.md").write_text("edited\n")
    assert extensions.source_digest(tmp_path) == first
    for path, text in (
        (header, "// kernel, edited\n"),
        (tags, "OWNER_SHIFT = 17\n"),
        (table, "TABLE = (1,)\n"),
    ):
        path.write_text(text)
        assert extensions.source_digest(tmp_path) != first
        first = extensions.source_digest(tmp_path)

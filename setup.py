"""Build of kvattn: the Python package, the CPU-harness modules and (when nvcc is found) the CUDA module.

- ``kvattn.backends.cuda_sim._sim``: the CUDA kernel sources compiled by the host compiler against
  the SIMT harness in csrc/sim/ (needs only g++ and pybind11), plus two test-only variants with a
  deliberate defect (``_sim_break_barrier``, ``_sim_break_pages``, ``_sim_break_fragment``) that the
  tests require to fail.
- ``kvattn.backends.cuda._C``: the kernels compiled by nvcc for sm_80 and sm_90 (ninja when present),
  with the ``-Xptxas -v`` output kept in build/cuda/ptxas.log and checked for local memory
  (csrc/ptxas_report.py, summary in build/cuda/resources.json). Skipped when nvcc is missing or
  ``KVATTN_SKIP_CUDA_BUILD=1``; a failing CUDA compile fails the build.
- Without pybind11, or with ``KVATTN_SKIP_EXTENSIONS=1`` (tools/ensure_deps.sh uses it for the
  editable install, then ``make build`` runs ``python setup.py build_ext --inplace``), no extension
  is built and the install is pure Python.

The tag layout header is generated from kvattn/tags.py (csrc/gen_tags_header.py) before any build.
"""
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
GENERATED = ROOT / "build" / "generated"
CUDA_BUILD = ROOT / "build" / "cuda"
CUDA_ARCHS = ("80", "90")
CUDA_EXT = "kvattn.backends.cuda._C"


def _import_path(relative: str):
    """Load a stdlib-only helper from csrc/ without importing kvattn (which needs torch)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(pathlib.Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pybind11_include():
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_include()


def _nvcc():
    if os.environ.get("KVATTN_SKIP_CUDA_BUILD", "0") == "1":
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


HEADERS = sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cpp"))
SIM_FLAGS = ["-std=c++17", "-O2", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-fvisibility=hidden"]


def _sim_extension(name: str, source: str, pybind_include: str) -> Extension:
    return Extension(f"kvattn.backends.cuda_sim.{name}", sources=[f"csrc/sim/{source}"],
                     include_dirs=[str(CSRC), str(GENERATED), pybind_include],
                     depends=HEADERS + ["kvattn/tags.py"], extra_compile_args=SIM_FLAGS, language="c++")


class BuildExt(build_ext):
    """Generates the tag header, builds the harness modules with the host compiler and the CUDA
    module with nvcc."""

    def run(self):
        _import_path("csrc/gen_tags_header.py").write_header(GENERATED / "kvattn_tags.h")
        super().run()

    def build_extension(self, ext):
        start = time.perf_counter()
        if ext.name == CUDA_EXT:
            self._build_cuda(ext)
        else:
            super().build_extension(ext)
        print(f"kvattn: built {ext.name} in {time.perf_counter() - start:.1f} s", flush=True)

    def _build_cuda(self, ext):
        nvcc = _nvcc()
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        CUDA_BUILD.mkdir(parents=True, exist_ok=True)
        includes = [f"-I{CSRC}", f"-I{GENERATED}"]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
        nvcc_flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-lineinfo", *gencode, *includes]
        cxx = os.environ.get("CXX", "g++")
        cxx_flags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wno-unknown-pragmas", *includes,
                     f"-I{sysconfig.get_paths()['include']}", f"-I{_pybind11_include()}"]
        log = CUDA_BUILD / "ptxas.log"
        kernels_o, module_o = CUDA_BUILD / "kernels.o", CUDA_BUILD / "module.o"
        q = shlex.join
        ninja = shutil.which("ninja")
        if ninja:
            (CUDA_BUILD / "build.ninja").write_text(
                f"rule nvcc\n"
                f"  command = {q([nvcc, *nvcc_flags])} -MD -MF $out.d -c $in -o $out > {log} 2>&1"
                f" || {{ cat {log}; exit 1; }}\n"
                f"  depfile = $out.d\n  deps = gcc\n"
                f"rule cxx\n  command = {q([cxx, *cxx_flags])} -MD -MF $out.d -c $in -o $out\n"
                f"  depfile = $out.d\n  deps = gcc\n"
                f"rule link\n  command = {q([nvcc, '-shared'])} $in -o $out\n"
                f"build {kernels_o}: nvcc {CSRC / 'cuda' / 'kernels.cu'}\n"
                f"build {module_o}: cxx {CSRC / 'cuda' / 'module_cuda.cpp'}\n"
                f"build {target}: link {kernels_o} {module_o}\n")
            subprocess.run([ninja, "-C", str(CUDA_BUILD)], check=True)
        else:
            with open(log, "w") as out:
                subprocess.run([nvcc, *nvcc_flags, "-c", str(CSRC / "cuda" / "kernels.cu"), "-o", str(kernels_o)],
                               check=True, stdout=out, stderr=subprocess.STDOUT)
            subprocess.run([cxx, *cxx_flags, "-c", str(CSRC / "cuda" / "module_cuda.cpp"), "-o", str(module_o)],
                           check=True)
            subprocess.run([nvcc, "-shared", str(kernels_o), str(module_o), "-o", str(target)], check=True)
        report = _import_path("csrc/ptxas_report.py")
        records = report.check(log, CUDA_BUILD / "resources.json")
        print(report.table(records), flush=True)


def _extensions():
    if os.environ.get("KVATTN_SKIP_EXTENSIONS", "0") == "1":
        return []
    pybind_include = _pybind11_include()
    if pybind_include is None:
        print("kvattn: pybind11 not found; building the pure-Python package only", file=sys.stderr)
        return []
    exts = [_sim_extension("_sim", "module_sim.cpp", pybind_include),
            _sim_extension("_sim_break_barrier", "module_sim_break_barrier.cpp", pybind_include),
            _sim_extension("_sim_break_pages", "module_sim_break_pages.cpp", pybind_include),
            _sim_extension("_sim_break_fragment", "module_sim_break_fragment.cpp", pybind_include)]
    if _nvcc() is not None:
        exts.append(Extension(CUDA_EXT, sources=[], depends=HEADERS))
    else:
        print("kvattn: nvcc not found or KVATTN_SKIP_CUDA_BUILD=1; skipping the CUDA module", file=sys.stderr)
    return exts


setup(
    name="kvattn",
    version="0.1.0",
    description="Ownership-checked paged attention kernels (Triton, CUDA) for LLM serving",
    packages=find_packages(include=["kvattn", "kvattn.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "triton>=3.4"],
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
)

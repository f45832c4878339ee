"""The compiled extensions of kvattn (the package metadata is in pyproject.toml).

- ``kvattn.backends.cuda_sim._sim``: the CUDA kernel sources compiled by the host compiler
  against the SIMT harness in csrc/sim/ (pybind11, a build requirement), every instantiation of
  the table, plus three test-only variants with a deliberate defect (``_sim_break_barrier``,
  ``_sim_break_pages``, ``_sim_break_fragment``) that the tests require to fail, compiled with
  fp16 at head dims up to 64 only (``HARNESS_SUBSET``), into a source checkout only (``make
  build``; a wheel leaves them out). Skipped when no C++ compiler works.
- ``kvattn.backends.cuda._C``: the kernels compiled by nvcc for sm_80 and sm_90, or for the
  architectures in ``KVATTN_CUDA_ARCHS`` (``90``, ``80,90``, ``9.0``, ``sm_90a``). The kernel
  instantiations are the table of csrc/instantiations.py: each (op, element type, pool type,
  head-dim tile) becomes one generated translation unit (build/generated/cuda/<unit>.cu), and ninja,
  when present, compiles them in parallel (``KVATTN_BUILD_JOBS=N`` jobs; default ninja's own, a few more
  than the CPUs) beside the dispatch (csrc/cuda/dispatch.cu, no kernel) and the binding. A subset of
  the table builds faster and refuses the rest at run time, saying which axis is missing (the
  registry then takes another backend):

  - ``KVATTN_CUDA_DTYPES``: element and pool types from ``fp16,bf16,fp32,e4m3,e5m2`` (fp32: the
    writer only; e4m3/e5m2: the decode's fp8 pools, for each 16-bit type built); default all;
  - ``KVATTN_CUDA_HEAD_DIMS``: head-dim tiles from the table's ``TILES`` (a head_dim runs on the
    smallest tile that holds it) and ``LATENT`` (the MLA latent decode); default all;
  - ``KVATTN_CUDA_VARIANTS=0``: no score switch (window, soft-cap, ALiBi, sinks); default ``1``.

  The ``-Xptxas -v`` output of every unit is gathered in build/cuda/ptxas.log and checked: every
  instantiation of the selection once per architecture, none other, and no local memory
  (csrc/ptxas_report.py; the figures in build/cuda/resources.json, a table of every kernel in
  build/cuda/ptxas-table.txt, one line of them in the build's output). Built where it can run (an
  NVIDIA GPU visible: ``/dev/nvidiactl``, or ``nvidia-smi -L`` lists one) or where asked for
  (``KVATTN_CUDA_BUILD=1``: a wheel for GPU machines, the static gates of ``make test``); skipped
  when nvcc is not found (PATH, then ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``), on a machine
  without a GPU unless asked for, or with ``KVATTN_SKIP_CUDA_BUILD=1`` (which wins).
  ``KVATTN_NVCC_THREADS=N`` lets each nvcc itself use N threads (``0``: one per CPU; unset or
  ``1``: one): ``--split-compile N`` splits one architecture's optimisation and assembly over N
  threads, and ``--threads N`` compiles several architectures at once (nvcc ignores it for one);
  with many units, ninja's jobs are the parallelism that counts.
- ``kvattn.backends.cpu._cpu``: the CPU paged decode and extend (csrc/cpu/, the reader's rule of
  csrc/kvattn/tag_rule.cuh), the readers of CPU tensors where no GPU kernel runs (vLLM's and
  SGLang's CPU engines), built by the host compiler with optimisation; into wheels too. Skipped
  when no C++ compiler works.
- ``KVATTN_SKIP_EXTENSIONS=1`` (tools/ensure_deps.sh uses it for the editable install, then
  ``make build`` runs ``python setup.py build_ext --inplace``), or no pybind11 (a build without
  isolation), builds no extension: the install is pure Python. ``KVATTN_SKIP_HARNESS_BUILD=1``
  builds the CUDA module alone (the GPU suite).

A compile that fails fails the build. The build prints one line saying what it built and what it
skipped and why (pip shows it with ``-v``), and records the same, with the selection and the ptxas
figures of the CUDA module, in ``kvattn/_build.json`` beside the modules, so an installed wheel
carries it (format: kvattn/extensions.py; ``python -m kvattn.env`` shows it). The build needs no
torch: the bindings take raw pointers and never include a torch header.

Sources: the harness modules compile ``csrc/sim/<module>.cpp``; the CUDA module compiles the
generated units and ``csrc/cuda/dispatch.cu`` with nvcc and ``csrc/cuda/module_cuda.cpp`` with the
host compiler and links them. Everything else reaches them through ``#include``: a new kernel
header in csrc/kvattn/ needs an include, a new instantiation a row in csrc/instantiations.py, not
an edit here. Every file of csrc/ counts as a dependency of every harness module (so setuptools
rebuilds the harness when any changes); the CUDA build tracks headers with nvcc's depfiles under
ninja (a decode edit recompiles the decode units only) and recompiles everything without it. The
generated headers (the tag layout from kvattn/tags.py, csrc/gen_tags_header.py; the source digest;
each module's instantiation list) are written before any build, and only when they change.
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError, ExecError

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
GENERATED = ROOT / "build" / "generated"
# A dependency of every host-compiled module: sources edited while a build ran leave a module with
# the digest of the build's start, which the next build must then redo.
DIGEST_HEADER = GENERATED / "kvattn_sources.h"
CUDA_BUILD = ROOT / "build" / "cuda"
DEFAULT_CUDA_ARCHS = ("80", "90")
CUDA_EXT = "kvattn.backends.cuda._C"
CPU_EXT = "kvattn.backends.cpu._cpu"
SIM_MODULES = {
    "_sim": "module_sim.cpp",
    "_sim_break_barrier": "module_sim_break_barrier.cpp",
    "_sim_break_pages": "module_sim_break_pages.cpp",
    "_sim_break_fragment": "module_sim_break_fragment.cpp",
}


def _import_path(relative: str):
    """Load a stdlib-only helper of this tree without importing kvattn (which needs torch)."""
    import importlib.util

    name = f"_kvattn_build_{pathlib.Path(relative).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


STATUS = _import_path("kvattn/extensions.py")  # the record and its format, shared with kvattn
VERSION = _import_path("kvattn/version.py").__version__
TABLE = _import_path("csrc/instantiations.py")  # the kernel instantiations
# What the test-only harness builds compile: the tests run them at fp16, head_dim 64, no switch.
HARNESS_SUBSET = TABLE.Selection(dtypes=("fp16",), head_dims=(64,), variants=False)
# The folder of build/generated/ with each module's instantiation list.
SELECTION_DIRS = {"_sim": "sim", **{name: "sim-subset" for name in SIM_MODULES if name != "_sim"}}


def _pybind11_include():
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_include()


def _nvcc() -> tuple:
    """``(path, None)``, or ``(None, why the CUDA module is skipped)``."""
    if os.environ.get("KVATTN_SKIP_CUDA_BUILD", "0") == "1":
        return None, "KVATTN_SKIP_CUDA_BUILD=1"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate, None
    return None, f"nvcc not found on PATH nor in {home}/bin"


def _gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU, so that the CUDA module can run here."""
    if os.path.exists("/dev/nvidiactl"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def _cuda_wanted() -> tuple:
    """``(nvcc path, None)`` when the CUDA module is to be built, else ``(None, why not)``."""
    nvcc, why = _nvcc()
    if nvcc is None:
        return nvcc, why
    if os.environ.get("KVATTN_CUDA_BUILD", "0") != "1" and not _gpu_visible():
        return None, "no GPU visible (KVATTN_CUDA_BUILD=1 builds it anyway)"
    return nvcc, None


def _cuda_archs() -> tuple:
    """``KVATTN_CUDA_ARCHS`` as compute capabilities without the dot (``"90"``, ``"90a"``)."""
    raw = os.environ.get("KVATTN_CUDA_ARCHS", "").strip()
    if not raw:
        return DEFAULT_CUDA_ARCHS
    archs = []
    for item in re.split(r"[,;\s]+", raw):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)?([af]?)", item)
        if not m:
            raise ValueError(
                f"KVATTN_CUDA_ARCHS: expected compute capabilities such as '90' or "
                f"'80,90' (also '9.0', 'sm_90a'), got {raw!r}"
            )
        archs.append(m.group(1) + (m.group(2) or "") + m.group(3))
    return tuple(dict.fromkeys(archs))


def _nvcc_parallel(archs: tuple) -> list:
    """nvcc's own parallelism from ``KVATTN_NVCC_THREADS`` (see the module docstring)."""
    raw = os.environ.get("KVATTN_NVCC_THREADS", "").strip()
    if raw in ("", "1"):
        return []
    if not raw.isdigit():
        raise ValueError(
            f"KVATTN_NVCC_THREADS: expected a whole number of threads (0: one per CPU), got {raw!r}"
        )
    return [f"--split-compile={int(raw)}"] + ([f"--threads={int(raw)}"] if len(archs) > 1 else [])


def _build_jobs() -> list:
    """ninja's ``-j`` from ``KVATTN_BUILD_JOBS`` (unset: ninja's default)."""
    raw = os.environ.get("KVATTN_BUILD_JOBS", "").strip()
    if not raw:
        return []
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"KVATTN_BUILD_JOBS: expected a whole number of jobs (1 or more), got {raw!r}"
        )
    return [f"-j{int(raw)}"]


def _nvcc_release(nvcc: str):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _short(name: str) -> str:
    return name.replace("kvattn.backends.", "")


class _Outcome:
    """What this build did to each extension; printed as one line and written as the record."""

    def __init__(self):
        self.entries = {}
        self.finished = False
        self.expected = list(STATUS.EXTENSIONS)  # a wheel leaves the test-only modules out

    def skip(self, name, reason):
        self.entries[name] = {"status": "skipped", "reason": reason}

    def built(self, name, seconds, **details):
        self.entries[name] = {"status": "built", "seconds": round(seconds, 1), **details}

    def fail(self, name, error):
        if isinstance(error, subprocess.CalledProcessError):
            tool = pathlib.Path(str(error.cmd[0])).name
            reason = (
                f"{tool} exited with status {error.returncode}: see the compiler output in "
                f"the build log and build/cuda/obj/*.log"
            )
        else:
            reason = f"{type(error).__name__}: {error}"[:600]
        self.entries[name] = {"status": "failed", "reason": reason}

    def summary(self) -> str:
        built = []
        for name, e in self.entries.items():
            if e["status"] == "built":
                archs = f" (sm_{', sm_'.join(e['archs'])})" if "archs" in e else ""
                if "selection" in e and not e["selection"]["full"]:
                    archs = archs[:-1] + f"; a subset: {e['selection']['text']})"
                built.append(_short(name) + archs)
        parts = [f"built {', '.join(built) or 'no extension'}"]
        for status in ("failed", "skipped"):
            by_reason = {}
            for name, e in self.entries.items():
                if e["status"] == status:
                    by_reason.setdefault(e["reason"], []).append(_short(name))
            parts += [
                f"{status} {', '.join(names)}: {reason}" for reason, names in by_reason.items()
            ]
        if not any(e["status"] == "skipped" for e in self.entries.values()):
            parts.append("skipped nothing")
        return "kvattn: " + "; ".join(parts)

    def finish(self, record: pathlib.Path) -> None:
        """Print the line and write the record, once per build."""
        if self.finished:
            return
        self.finished = True
        stopped = next((n for n, e in self.entries.items() if e["status"] == "failed"), None)
        for name in self.expected:
            if name not in self.entries:
                self.skip(
                    name,
                    f"not attempted: the build stopped at {_short(stopped)}"
                    if stopped
                    else "not part of this build",
                )
        # In the order of STATUS.EXTENSIONS, whichever thread finished first; none a wheel
        # leaves out.
        self.entries = {n: self.entries[n] for n in self.expected}
        line = self.summary()
        print(line, file=sys.stderr, flush=True)
        STATUS.write_record(record, VERSION, line, self.entries)


OUTCOME = _Outcome()
HEADERS = sorted(
    str(p.relative_to(ROOT)) for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu")
) + ["csrc/instantiations.py"]
# The CPU reader is meant to be fast: -O3 vectorises its dot products and sums; no fast-math, whose
# assumptions (no NaN, no infinity) the masking relies on not being made.
CPU_FLAGS = [
    "-std=c++17",
    "-O3",
    # The 64-byte vectors of csrc/cpu/ are only passed between always-inlined functions: no ABI
    # crosses an instruction set's or a clone's boundary, so GCC's note on their calling
    # convention does not apply.
    "-Wno-psabi",
    # The readers' threads: an OpenMP region, on torch's own libgomp once torch is loaded
    # (csrc/cpu/attention_cpu.h says why).
    "-fopenmp",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
    "-fvisibility=hidden",
]
SIM_FLAGS = [
    "-std=c++17",
    "-O2",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
    "-fvisibility=hidden",
]


def _extensions():
    """The extensions to attempt; the ones left out are recorded with the reason."""
    if os.environ.get("KVATTN_SKIP_EXTENSIONS", "0") == "1":
        reason = "KVATTN_SKIP_EXTENSIONS=1"
    elif _pybind11_include() is None:
        reason = "pybind11 not installed (a build without isolation needs it)"
    else:
        reason = None
    if reason:
        for name in STATUS.EXTENSIONS:
            OUTCOME.skip(name, reason)
        return []
    if os.environ.get("KVATTN_SKIP_HARNESS_BUILD", "0") == "1":
        # The GPU suite builds the CUDA module alone: the harness tests run on CPU machines.
        for name in SIM_MODULES:
            OUTCOME.skip(f"kvattn.backends.cuda_sim.{name}", "KVATTN_SKIP_HARNESS_BUILD=1")
        exts = []
    else:
        exts = [
            Extension(
                f"kvattn.backends.cuda_sim.{name}",
                sources=[f"csrc/sim/{source}"],
                include_dirs=[
                    str(CSRC),
                    str(GENERATED / SELECTION_DIRS[name]),
                    str(GENERATED),
                    _pybind11_include(),
                ],
                depends=HEADERS + ["kvattn/tags.py", str(DIGEST_HEADER)],
                extra_compile_args=SIM_FLAGS,
                language="c++",
            )
            for name, source in SIM_MODULES.items()
        ]
    if os.environ.get("KVATTN_SKIP_HARNESS_BUILD", "0") != "1":
        exts.append(
            Extension(
                CPU_EXT,
                sources=["csrc/cpu/module_cpu.cpp"],
                include_dirs=[str(CSRC), str(GENERATED), _pybind11_include()],
                depends=HEADERS + ["kvattn/tags.py", str(DIGEST_HEADER)],
                extra_compile_args=CPU_FLAGS,
                extra_link_args=["-fopenmp"],
                language="c++",
            )
        )
    else:
        OUTCOME.skip(CPU_EXT, "KVATTN_SKIP_HARNESS_BUILD=1")
    nvcc, why = _cuda_wanted()
    cxx = os.environ.get("CXX", "g++")
    if nvcc is not None and shutil.which(shlex.split(cxx)[0]) is None:
        nvcc, why = None, f"no host C++ compiler {cxx} for the binding"
    if nvcc is None:
        OUTCOME.skip(CUDA_EXT, why)
    else:
        _nvcc_parallel(_cuda_archs())  # a malformed KVATTN_CUDA_ARCHS or _NVCC_THREADS fails here
        TABLE.selection_from_env(os.environ)  # and KVATTN_CUDA_DTYPES, _HEAD_DIMS, _VARIANTS
        _build_jobs()
        exts.append(Extension(CUDA_EXT, sources=[], depends=HEADERS))
    return exts


def _write_digest_header(path: pathlib.Path) -> None:
    """The digest of the sources every module is compiled from (``SOURCE_DIGEST`` of each module;
    kvattn refuses a module whose digest differs from its checkout's). Written only when it
    changes, so an unchanged tree rebuilds nothing."""
    text = (
        "// Generated by setup.py: kvattn.extensions.source_digest of this build's sources.\n"
        f'#define KVATTN_SOURCE_DIGEST "{STATUS.source_digest(ROOT)}"\n'
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


class BuildExt(build_ext):
    """Generates the tag header, builds the harness modules with the host compiler and the CUDA
    module with nvcc, and records the outcome beside the modules."""

    def run(self):
        into_tree = self.inplace or getattr(self, "editable_mode", False)
        base = ROOT if into_tree else pathlib.Path(self.build_lib)
        if not into_tree:
            OUTCOME.expected = [n for n in STATUS.EXTENSIONS if n not in STATUS.TEST_ONLY]
            self.extensions = [e for e in self.extensions if e.name in OUTCOME.expected]
        _import_path("csrc/gen_tags_header.py").write_header(GENERATED / "kvattn_tags.h")
        _write_digest_header(DIGEST_HEADER)
        TABLE.write_generated(GENERATED / "sim", TABLE.Selection(), with_units=False)
        TABLE.write_generated(GENERATED / "sim-subset", HARNESS_SUBSET, with_units=False)
        try:
            super().run()
        finally:
            OUTCOME.finish(base / "kvattn" / STATUS.RECORD)

    def build_extensions(self):
        problem = self._cxx_problem()
        if problem is not None:
            for ext in self.extensions:
                OUTCOME.skip(ext.name, problem)
            self.extensions = []
            return
        # The CUDA module first: its compilers (ninja's jobs) start at once, and the harness
        # modules, one compiler each, build beside them on the threads left.
        self.extensions.sort(key=lambda ext: ext.name != CUDA_EXT)
        self.parallel = self.parallel or min(os.cpu_count() or 1, len(self.extensions)) or 1
        super().build_extensions()

    def _cxx_problem(self):
        """None when the host compiler builds a C++17 file, else why not."""
        with tempfile.TemporaryDirectory() as tmp:
            probe = pathlib.Path(tmp) / "probe.cpp"
            probe.write_text("#include <vector>\nint main() { return std::vector<int>(1)[0]; }\n")
            try:
                self.compiler.compile([str(probe)], output_dir=tmp, extra_postargs=["-std=c++17"])
            except (CompileError, ExecError) as e:
                return f"no working C++ compiler (a C++17 test file failed: {str(e)[:160]})"
        return None

    def build_extension(self, ext):
        start = time.perf_counter()
        try:
            if ext.name == CUDA_EXT:
                details = self._build_cuda(ext)
            else:
                super().build_extension(ext)
                details = {}
        except Exception as e:
            OUTCOME.fail(ext.name, e)
            raise
        OUTCOME.built(ext.name, time.perf_counter() - start, **details)
        print(f"kvattn: built {ext.name} in {time.perf_counter() - start:.1f} s", flush=True)

    def _build_cuda(self, ext) -> dict:
        nvcc, _ = _nvcc()
        archs = _cuda_archs()
        selection = TABLE.selection_from_env(os.environ)
        rows = TABLE.select(selection)
        units = TABLE.write_generated(GENERATED / "cuda", selection)  # in table order
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        objects = CUDA_BUILD / "obj"
        objects.mkdir(parents=True, exist_ok=True)
        includes = [f"-I{CSRC}", f"-I{GENERATED / 'cuda'}", f"-I{GENERATED}"]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        nvcc_flags = [
            "-std=c++17",
            "-O3",
            "-Xcompiler",
            "-fPIC",
            "-Xptxas",
            "-v",
            "-lineinfo",
            *gencode,
            *_nvcc_parallel(archs),
            *includes,
        ]
        cxx = os.environ.get("CXX", "g++")
        cxx_flags = [
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wno-unknown-pragmas",
            *includes,
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{_pybind11_include()}",
        ]
        # (source, object): the kernel units, the dispatch (nvcc); the binding (host compiler)
        cuda_sources = [
            (src, objects / f"{src.stem}.o") for src in [*units, CSRC / "cuda" / "dispatch.cu"]
        ]
        # ninja starts the heaviest units (widest head dims) first, so the last job to finish is short.
        tile = {
            name: max(row.head_dim or 0 for row in members)
            for name, members in TABLE.units(rows).items()
        }
        by_weight = sorted(cuda_sources, key=lambda source: -tile.get(source[0].stem, 0))
        module_o = objects / "module.o"
        log = CUDA_BUILD / "ptxas.log"
        q = shlex.join
        ninja = shutil.which("ninja")
        if ninja:
            lines = [
                f"rule nvcc\n"
                f"  command = {q([nvcc, *nvcc_flags])} -MD -MF $out.d -c $in -o $out > $out.log 2>&1"
                f" || {{ cat $out.log; exit 1; }}\n"
                f"  depfile = $out.d\n  deps = gcc\n  description = nvcc $in\n",
                f"rule cxx\n  command = {q([cxx, *cxx_flags])} -MD -MF $out.d -c $in -o $out\n"
                f"  depfile = $out.d\n  deps = gcc\n  description = c++ $in\n",
                f"rule link\n  command = {q([nvcc, '-shared'])} $in -o $out\n  description = link $out\n",
            ]
            lines += [f"build {obj}: nvcc {src}\n" for src, obj in by_weight]
            lines.append(f"build {module_o}: cxx {CSRC / 'cuda' / 'module_cuda.cpp'}\n")
            lines.append(
                f"build {target}: link {' '.join(str(o) for _, o in cuda_sources)} {module_o}\n"
            )
            (CUDA_BUILD / "build.ninja").write_text("".join(lines))
            subprocess.run([ninja, "-C", str(CUDA_BUILD), *_build_jobs()], check=True)
        else:
            for src, obj in by_weight:
                with open(f"{obj}.log", "w") as out:
                    subprocess.run(
                        [nvcc, *nvcc_flags, "-c", str(src), "-o", str(obj)],
                        check=True,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
            subprocess.run(
                [
                    cxx,
                    *cxx_flags,
                    "-c",
                    str(CSRC / "cuda" / "module_cuda.cpp"),
                    "-o",
                    str(module_o),
                ],
                check=True,
            )
            subprocess.run(
                [
                    nvcc,
                    "-shared",
                    *(str(o) for _, o in cuda_sources),
                    str(module_o),
                    "-o",
                    str(target),
                ],
                check=True,
            )
        # One log for the module, in table order (the units' own logs stay beside their objects).
        log.write_text("".join(pathlib.Path(f"{obj}.log").read_text() for _, obj in cuda_sources))
        report = _import_path("csrc/ptxas_report.py")
        records = report.check(
            log,
            CUDA_BUILD / "resources.json",
            expected={(row.signature, f"sm_{a}") for row in rows for a in archs},
        )
        # One line here; the table of every kernel in a file (`python -m kvattn.env --kernels` too).
        table = CUDA_BUILD / "ptxas-table.txt"
        table.write_text(report.table(records) + "\n")
        print(
            f"kvattn: CUDA module: {len(units)} kernel units, the dispatch and the binding; "
            f"{len(rows)} instantiations of csrc/instantiations.py for sm_{', sm_'.join(archs)}; ptxas: "
            f"{report.summary(records)} (every kernel: {table.relative_to(ROOT)})",
            flush=True,
        )
        return {
            "archs": list(archs),
            "nvcc": _nvcc_release(nvcc),
            "nvcc_parallel": _nvcc_parallel(archs),
            "jobs": _build_jobs(),
            "selection": selection.as_dict(),
            "instantiations": len(rows),
            "units": len(units),
            "resources": records,
        }


class BuildPy(build_py):
    """A build without extensions still says so, in the line and the record."""

    def run(self):
        super().run()
        if not self.distribution.ext_modules:
            OUTCOME.finish(pathlib.Path(self.build_lib) / "kvattn" / STATUS.RECORD)


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})

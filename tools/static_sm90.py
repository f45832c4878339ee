"""Static sm_90 figures of every kernel, compiled on a machine without a GPU: what an H200 would run.

- **Triton**: the real launchers run on CPU tensors with real shapes and strides under a stand-in
  driver that reports an sm_90 device and compiles without launching. Triton's own binder then
  specialises every argument (pointer alignment, integers equal to 1 or divisible by 16) exactly as
  at a launch on the GPU, and the planners see an H200 (132 SMs, arch 90). Run it with the Triton
  the GPU image has (3.6; ``make static`` builds a venv with it) -- figures record the version.
- **CUDA**: the cubins of the CUDA module (``kvattn/backends/cuda/_C*.so``, every generated unit),
  read with ``cuobjdump``; each kernel is named by its row of csrc/instantiations.py.

Per kernel and variant: registers, local memory (must be 0: spills), the real dynamic shared memory
(Triton: from the compiled kernel's metadata; CUDA: from the launcher's plan), the K/V shared-memory
buffer count and pipelining depth (Triton: from TTGIR), SASS instructions in all and in the main
loop (the first backward-branch range holding the most global loads), and in that loop the async copies
(LDGSTS, ``.128`` = 16 bytes), 128-bit global loads, tensor-core instructions (HMMA/HGMMA),
barriers (BAR) and fences (MEMBAR); in the JSON, the resident programs per SM those registers
and that shared memory allow. Then the decode grids the split planners choose at the goal shapes
on an H200, their waves over those resident slots and a model of their bandwidth
(``decode_grids``). **These are static figures, not speed.**

    python tools/static_sm90.py [--json FILE] [--markdown FILE] [--cuda-object kvattn/backends/cuda/_C...so]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # the interpreter replaces kernels by Python functions

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

H200_SMS = 132
ARCH = 90


# ---- SASS ------------------------------------------------------------------------------------

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BRA_TARGET = re.compile(r"(0x[0-9a-f]+)")


def _tool(name: str) -> str:
    """Triton's wheel ships cuobjdump and ptxas; the CUDA toolkit's are the fallback."""
    bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.exists():
        return str(bundled)
    return str(pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / name)


def parse_sass(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """``{function: [(address, opcode, operands), ...]}`` from ``cuobjdump --dump-sass``."""
    functions: dict[str, list] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return functions


_COUNTED = {
    "ldgsts": lambda op, args: op.startswith("LDGSTS"),
    "ldgsts_128": lambda op, args: op.startswith("LDGSTS") and ".128" in op,
    "ldg_128": lambda op, args: op.startswith("LDG.") and ".128" in op,
    "ldg": lambda op, args: op.startswith("LDG.") or op == "LDG",
    "mma": lambda op, args: op.startswith(("HMMA", "HGMMA")),
    "hgmma": lambda op, args: op.startswith("HGMMA"),
    "bar": lambda op, args: op.startswith("BAR"),
    "membar": lambda op, args: op.startswith("MEMBAR"),
    "atom": lambda op, args: op.startswith(("ATOM", "RED")),
}


_HMMA = re.compile(r"HMMA\.(16)(8)(8|16)\b")
_HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\b")


def mma_flops(op: str, args: str = "") -> int:
    """FLOPs (multiply and add) one warp's tensor-core instruction stands for: an ``HMMA.16816``
    its warp's 16x8x16 product, an ``HGMMA.64xNx16`` (wgmma) a quarter of its warpgroup's, whose
    four warps each issue it; 0 for any other instruction. (``parse_sass`` splits ``HGMMA.64`` from
    the rest of its shape, which starts its operands.)"""
    m = _HMMA.match(op)
    if m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    m = _HGMMA.match(op + args.lstrip())
    if m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4
    return 0


def _counts(insns) -> dict[str, int]:
    return {
        name: sum(1 for _, op, args in insns if test(op, args)) for name, test in _COUNTED.items()
    }


def loops(insns) -> list[tuple[int, int]]:
    """Address ranges ``[target, branch]`` of backward branches (loop bodies, innermost included).

    Branches back out of the out-of-line paths that ``BRA.DIV`` jumps to (the compiler's fallback
    for warp-collective instructions reached by a possibly divergent warp) are not loops: each such
    path runs from a ``BRA.DIV`` target to its first unconditional branch."""

    def target(args):
        m = _BRA_TARGET.search(args)
        return int(m.group(1), 16) if m else None

    addresses = [a for a, _, _ in insns]
    fallback = set()
    for _, op, args in insns:
        if op.startswith("BRA.DIV") and target(args) is not None:
            i = addresses.index(target(args)) if target(args) in addresses else len(insns)
            while i < len(insns):
                fallback.add(insns[i][0])
                if insns[i][1] == "BRA" and not insns[i][2].strip().startswith("@"):
                    break
                i += 1
    found = []
    for addr, op, args in insns:
        if op.startswith("BRA") and not op.startswith("BRA.DIV") and addr not in fallback:
            t = target(args)
            if t is not None and t < addr:
                found.append((t, addr))
    return found


def sass_figures(insns) -> dict:
    """Instruction counts of a function and of its main loop: among the loops with tensor-core
    instructions if any has them, then among those with async copies, the one with the most
    async copies (of plain global loads where there are none), the first in the code on a tie
    (extend's loop over key tiles before the diagonal comes before the causal one; the decode's
    loop before the tiles of the new token's page it peels off under a verdict, which load a tag
    besides). A small loop of plain loads (the extend's
    report of a sequence) is never the main one, also in fp32 kernels, which have no tensor-core
    instructions."""
    figures = {"sass": len(insns), **{f"all_{k}": v for k, v in _counts(insns).items()}}
    best = None
    for lo, hi in sorted(loops(insns)):
        body = [i for i in insns if lo <= i[0] <= hi]
        c = _counts(body)
        key = (c["mma"] > 0, c["ldgsts"] > 0, c["ldgsts"] or c["ldg"])
        if best is None or key > best[0]:
            best = (key, body, c)
    if best is None:
        figures.update(loop_sass=0, loop_mma_flops=0, **{f"loop_{k}": 0 for k in _COUNTED})
    else:
        figures.update(
            loop_sass=len(best[1]),
            loop_mma_flops=sum(mma_flops(op, args) for _, op, args in best[1]),
            **{f"loop_{k}": v for k, v in best[2].items()},
        )
    return figures


def _cuobjdump(path: str, *flags: str) -> str:
    return subprocess.run(
        [_tool("cuobjdump"), *flags, path], capture_output=True, text=True, check=True
    ).stdout


def resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``{function: {REG, STACK, SHARED, LOCAL}}`` from ``cuobjdump --dump-resource-usage``."""
    usage, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            current = m.group(1)
            continue
        if current and "REG:" in line:
            usage[current] = {
                k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)
            }
    return usage


# ---- Triton, compiled as the GPU would JIT it -------------------------------------------------


class _StandInDriver:
    """Triton's CUDA driver without a GPU: an sm_90 target, device 0, stream 0, CPU tensors."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaDriver

        self._real = CudaDriver.__new__(CudaDriver)

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=0):
        return divmod(ARCH, 10)


@contextlib.contextmanager
def compile_only():
    """Launches compile and record their kernels instead of running: yields the list of
    ``(kernel name, compiled kernel)`` in launch order. The stand-in driver stays active after (no
    real one can be created on a machine without a GPU)."""
    from triton.runtime import jit

    from kvattn.backends import grids
    from kvattn.backends.triton import configs

    compiled = []
    real_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    saved = (grids.device_sms, configs._arch)
    triton.runtime.driver.set_active(_StandInDriver())
    jit.JITFunction.run = run
    grids.device_sms = lambda device: H200_SMS
    configs._arch = lambda device: ARCH
    try:
        yield compiled
    finally:
        jit.JITFunction.run = real_run
        grids.device_sms, configs._arch = saved


def ttgir_pipelining(ttgir: str) -> dict:
    """K/V shared-memory buffers (leading dimension of the 3-D mutable allocations) and the loop's
    deepest ``async_wait`` count (copies still in flight while computing)."""
    buffers = [
        int(m) for m in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    ]
    waits = [int(m) for m in re.findall(r"async_wait[^\n]*\{num = (\d+)", ttgir)]
    return {"kv_buffers": max(buffers, default=0), "async_wait_max": max(waits, default=0)}


def triton_kernel_figures(kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = next(iter(resource_usage(_cuobjdump(f.name, "--dump-resource-usage")).values()))
        functions = parse_sass(_cuobjdump(f.name, "--dump-sass"))
    insns = next(iter(functions.values()))
    return dict(
        registers=usage["REG"],
        local=usage["LOCAL"] + usage["STACK"],
        shared=int(kernel.metadata.shared),
        num_warps=kernel.metadata.num_warps,
        num_stages=kernel.metadata.num_stages,
        **ttgir_pipelining(kernel.asm["ttgir"]),
        **sass_figures(insns),
    )


# Shapes of the configurations: (name, op, dtype, head_dim, page_size, num_heads, num_kv_heads),
# and optionally the variant switches (kvattn.variants) by name, below.
TRITON_CONFIGS = [
    ("decode bf16 d128 p16 gqa4", "decode", torch.bfloat16, 128, 16, 32, 8),
    ("decode fp16 d128 p16 gqa4", "decode", torch.float16, 128, 16, 32, 8),
    ("decode bf16 d128 p1 gqa4", "decode", torch.bfloat16, 128, 1, 32, 8),
    ("decode bf16 d128 p64 mha", "decode", torch.bfloat16, 128, 64, 32, 32),
    ("decode bf16 d256 p16 gqa8", "decode", torch.bfloat16, 256, 16, 64, 8),
    ("decode bf16 d64 p16 gqa4", "decode", torch.bfloat16, 64, 16, 32, 8),
    ("decode bf16 d512 p16 gqa8", "decode", torch.bfloat16, 512, 16, 64, 8),
    ("decode bf16 d128 p48 gqa4", "decode", torch.bfloat16, 128, 48, 32, 8),
    ("decode fp16 d128 p5 gqa4", "decode", torch.float16, 128, 5, 32, 8),
    ("extend bf16 d128 p16 gqa4", "extend", torch.bfloat16, 128, 16, 32, 8),
    ("extend fp16 d128 p1 mha", "extend", torch.float16, 128, 1, 32, 32),
    ("extend bf16 d256 p16 gqa8", "extend", torch.bfloat16, 256, 16, 64, 8),
    ("extend bf16 d512 p16 gqa8", "extend", torch.bfloat16, 512, 16, 64, 8),
    ("extend fp16 d128 p80 gqa4", "extend", torch.float16, 128, 80, 32, 8),
    (
        "decode bf16 d128 p16 gqa4 window+softcap+sinks+alibi",
        "decode",
        torch.bfloat16,
        128,
        16,
        32,
        8,
        "scores",
    ),
    ("decode bf16 d128 p16 gqa4 fp8-e4m3 KV", "decode", torch.bfloat16, 128, 16, 32, 8, "fp8"),
    (
        "extend bf16 d128 p16 gqa4 window+softcap+sinks+alibi",
        "extend",
        torch.bfloat16,
        128,
        16,
        32,
        8,
        "scores",
    ),
    ("extend bf16 d128 p16 gqa4 fp8-e4m3 KV", "extend", torch.bfloat16, 128, 16, 32, 8, "fp8"),
    ("extend bf16 d128 p16 gqa4 custom_mask", "extend", torch.bfloat16, 128, 16, 32, 8, "mask"),
    (
        "extend bf16 d128 p16 gqa4 two-sided window",
        "extend",
        torch.bfloat16,
        128,
        16,
        32,
        8,
        "two-sided",
    ),
    (
        "decode bf16 d128 p16 gqa4 fp8-e4m3 KV per-seq scales+alibi",
        "decode",
        torch.bfloat16,
        128,
        16,
        32,
        8,
        "per-seq",
    ),
    (
        "extend bf16 d128 p16 gqa4 fp8-e4m3 KV per-seq scales+alibi",
        "extend",
        torch.bfloat16,
        128,
        16,
        32,
        8,
        "per-seq",
    ),
    # DeepSeek's non-absorbed attention: 192-dim queries and keys, 128-dim values.
    ("decode bf16 dk192 dv128 p16 gqa4", "decode", torch.bfloat16, 192, 16, 32, 8, "dv128"),
    # Through a verdict (kvattn.resolve_pages, docs/ownership.md section 9), the resolve's own
    # kernels compiled with it over the tags of RESOLVE_LAYERS layers; unchecked, the plain kernel.
    ("decode bf16 d128 p16 gqa4 verdict", "decode", torch.bfloat16, 128, 16, 32, 8, "verdict"),
    ("extend bf16 dk192 dv128 p16 gqa4", "extend", torch.bfloat16, 192, 16, 32, 8, "dv128"),
]

# MLA decode and extend (head_dim: the latent row, kv_lora_rank 512 + rope_dim 64; one latent
# head).
MLA_LORA = 512
TRITON_CONFIGS += [
    ("mla_decode bf16 512+64 p64 h16", "mla_decode", torch.bfloat16, 576, 64, 16, 1),
    ("mla_decode fp16 512+64 p64 h16", "mla_decode", torch.float16, 576, 64, 16, 1),
    ("mla_decode bf16 512+64 p64 h128", "mla_decode", torch.bfloat16, 576, 64, 128, 1),
    ("mla_decode bf16 512+64 p16 h16", "mla_decode", torch.bfloat16, 576, 16, 16, 1),
    ("mla_decode bf16 512+64 p1 h16", "mla_decode", torch.bfloat16, 576, 1, 16, 1),
    ("mla_decode fp32 512+64 p64 h16", "mla_decode", torch.float32, 576, 64, 16, 1),
    ("mla_extend bf16 512+64 p64 h16", "mla_extend", torch.bfloat16, 576, 64, 16, 1),
    ("mla_extend bf16 512+64 p64 h128", "mla_extend", torch.bfloat16, 576, 64, 128, 1),
    ("mla_extend bf16 512+64 p1 h16", "mla_extend", torch.bfloat16, 576, 1, 16, 1),
    ("mla_extend fp32 512+64 p64 h16", "mla_extend", torch.float32, 576, 64, 16, 1),
]


# The layers of the tags a verdict is resolved over: those of the goal shape's model (32 query
# heads over 8 KV heads of dim 128 is Llama 3 8B, 32 layers).
RESOLVE_LAYERS = 32


def _variant(name: str | None, num_heads: int, num_kv_heads: int, batch: int) -> dict:
    """The switches of a configuration: every score switch at once, fp8 pools with scales (per
    tensor, or per sequence with per-sequence ALiBi slopes), a window on both sides, or a custom
    mask (added by :func:`_inputs`, which knows the lengths); "dv128" is a value pool of its own
    head dim, 128 (also :func:`_inputs`)."""
    if name == "scores":
        return dict(
            window_left=4095,
            logits_soft_cap=30.0,
            sinks=torch.zeros(num_heads),
            alibi_slopes=torch.ones(num_heads),
        )
    if name == "fp8":
        return dict(k_scale=0.5, v_scale=0.5)
    if name == "per-seq":
        return dict(
            k_scale=torch.ones(batch, num_kv_heads),
            v_scale=torch.ones(batch, num_kv_heads),
            alibi_slopes=torch.ones(batch, num_heads),
        )
    if name == "two-sided":
        return dict(window_left=4095, window_right=4095)
    return {}


def _inputs(op, dtype, head_dim, page_size, num_heads, num_kv_heads, variant=None):
    """Validated arguments of a small launch with engine-like strides (a pool of 1001 pages and a
    table of 257 entries per sequence: neither divisible by 16, as in general)."""
    import kvattn

    batch, num_pages, max_pages = 4, 1001, 257
    switches = _variant(variant, num_heads, num_kv_heads, batch)
    pool_dtype = torch.float8_e4m3fn if variant in ("fp8", "per-seq") else dtype
    k = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=pool_dtype)
    v = torch.zeros_like(k) if variant != "dv128" else k[..., :128].clone()
    tags = torch.zeros(num_pages, dtype=torch.int64)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    expected = torch.ones(batch, dtype=torch.int64)
    if op == "mla_decode":
        q = torch.zeros(batch, num_heads, head_dim, dtype=dtype)
        return kvattn.layout.validate_mla_decode(
            q, k, table, lens, tags, expected, kv_lora_rank=MLA_LORA, validate=False
        )
    if op == "mla_extend":
        q = torch.zeros(batch * 77, num_heads, head_dim, dtype=dtype)
        cu = torch.arange(0, batch + 1, dtype=torch.int32) * 77
        return kvattn.layout.validate_mla_extend(
            q, k, cu, table, lens, tags, expected, kv_lora_rank=MLA_LORA, validate=False
        )
    if op == "decode":
        q = torch.zeros(batch, num_heads, head_dim, dtype=dtype)
        if variant == "verdict":
            tags = torch.zeros(RESOLVE_LAYERS, num_pages, dtype=torch.int64)
        args = kvattn.layout.validate_decode(
            q,
            k,
            v,
            table,
            lens,
            tags[0] if variant == "verdict" else tags,
            expected,
            validate=False,
            **switches,
        )
        if variant == "verdict":
            args.verdict = kvattn.resolve_pages(
                table, lens, tags, args.expected, page_size=page_size, backend="reference"
            )
        return args
    q = torch.zeros(batch * 77, num_heads, head_dim, dtype=dtype)
    cu = torch.arange(0, batch + 1, dtype=torch.int32) * 77
    if variant == "mask":
        switches = dict(custom_mask=torch.ones(batch * 77 * 100, dtype=torch.bool))
    return kvattn.layout.validate_extend(
        q, k, v, cu, table, lens, tags, expected, validate=False, **switches
    )


def _planned_per_sm(op: str, args) -> int | None:
    """The resident programs per SM the split planner fits a decode grid to (None for extend)."""
    from kvattn.backends.triton import paged_decode, paged_mla_decode

    if op == "decode":
        return paged_decode.launch_config(args).programs_per_sm
    if op == "mla_decode":
        return paged_mla_decode.launch_config(args).programs_per_sm
    return None


def triton_records(configs=TRITON_CONFIGS) -> list[dict]:
    from kvattn.backends import triton as triton_backend

    records = []
    for name, op, *shape in configs:
        args = _inputs(op, *shape)
        for check in (False, True):
            width = args.kv_lora_rank if op.startswith("mla") else args.head_dim_v
            out = args.q.new_empty(*args.q.shape[:2], width)
            lse = torch.empty(args.q.shape[:2], dtype=torch.float32)
            with compile_only() as compiled:
                # A verdict serves only the checked kernel: unchecked, the row is the plain one.
                if getattr(args, "verdict", None) is not None and check:
                    from kvattn.backends.triton.resolve import resolve

                    v = args.verdict
                    resolve(v.block_table, v.seq_lens, v.page_tags, v.expected, v.page_size, -1)
                getattr(triton_backend, op)(args, check=check, out=out, lse=lse)
                planned = _planned_per_sm(op, args)
            for kernel_name, kernel in compiled:
                extra = (
                    dict(planned_per_sm=planned)
                    if kernel_name.startswith("paged_") and planned
                    else {}
                )
                figures = triton_kernel_figures(kernel)
                records.append(
                    dict(
                        backend="triton",
                        config=name,
                        op=op,
                        kernel=kernel_name,
                        check=check,
                        **figures,
                        **extra,
                        resident_per_sm=resident_per_sm(
                            figures["registers"], figures["shared"], figures["num_warps"]
                        ),
                    )
                )
    return records


# ---- CUDA, from the nvcc build ----------------------------------------------------------------


def _demangle(names: list[str]) -> dict[str, str]:
    result = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=False
    )
    lines = result.stdout.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


def _instantiations():
    """csrc/instantiations.py, the table the CUDA module is generated from (loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "kvattn_instantiations", ROOT / "csrc" / "instantiations.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


INSTANTIATIONS = _instantiations()
CUDA_MODULE = (
    ROOT / "kvattn" / "backends" / "cuda" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
)
_CUDA_FP8 = {"e4m3": "fp8 e4m3", "e5m2": "fp8 e5m2"}


def cuda_config(row) -> str:
    """How the table names a row of csrc/instantiations.py: op, dtype, head-dim tile, copy width
    (16B, or elementwise for pools whose rows are not 16-byte aligned: odd head dims, offset views;
    fp8 pools copy by 16 bytes only and name their format instead), the score switches of
    kvattn.variants when compiled in (the merge kernel has only the window, the sinks and ALiBi's
    shift past the table, the decode neither the custom mask nor the window's right edge), and
    ``verdict`` for the checked decode that reads a step's verdict."""
    fp8 = _CUDA_FP8.get(row.pool, "")
    copies = "" if fp8 or row.vec is None else ("16B" if row.vec else "elementwise")
    switches = ""
    if row.variant:
        switches = {
            "extend": "two-sided window+softcap+sinks+alibi+mask",
            "decode": "window+softcap+sinks+alibi",
        }
        switches = switches[row.op] if row.head_dim else "window+sinks+alibi"
    return " ".join(
        x
        for x in (
            row.op,
            row.dtype or "",
            f"d{row.head_dim}" if row.head_dim else "",
            copies,
            fp8,
            switches,
            "verdict" if row.verdict else "",
        )
        if x
    )


def _cuda_layouts() -> dict:
    """Pipeline stages and dynamic shared memory per kernel and padded head dim, from the binding
    (the same constants the launchers use); empty when the harness module is not built."""
    try:
        from kvattn.backends.cuda_sim import _sim
    except ImportError:
        return {}
    return _sim.tile_layouts()


def cuda_records(obj: pathlib.Path) -> list[dict]:
    """Figures of every sm_90 kernel in ``obj`` (the CUDA module, or an nvcc object), each a row
    of csrc/instantiations.py found once."""
    layouts = _cuda_layouts()
    table, seen = INSTANTIATIONS.by_name(), set()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [_tool("cuobjdump"), "--extract-elf", "all", str(obj.resolve())],
            cwd=tmp,
            capture_output=True,
            check=True,
        )
        cubins = [p for p in pathlib.Path(tmp).iterdir() if "sm_90" in p.name]
        records = []
        for cubin in cubins:
            usage = resource_usage(_cuobjdump(str(cubin), "--dump-resource-usage"))
            functions = parse_sass(_cuobjdump(str(cubin), "--dump-sass"))
            names = _demangle(list(functions))
            for mangled, insns in functions.items():
                u = usage.get(mangled, {})
                name = re.sub(r"^void\s+|\(.*\)$", "", names[mangled])
                row = table.get(name)
                if row is None:
                    raise RuntimeError(
                        f"{obj}: kernel {names[mangled]} is not a row of csrc/instantiations.py"
                    )
                if row in seen:
                    raise RuntimeError(f"{obj}: kernel {row.name} is compiled twice")
                seen.add(row)
                table_key = row.op + "_fp8" if row.pool else row.op
                layout = (
                    layouts.get(table_key, {}).get(row.head_dim, {})
                    if row.kernel.startswith("paged_")
                    else {}
                )
                shared = layout.get("shared_bytes", u.get("SHARED", 0))
                extra = {}
                if row.kernel.startswith("paged_") and u.get("REG"):
                    extra["resident_per_sm"] = resident_per_sm(u["REG"], shared, CUDA_DECODE_WARPS)
                if row.kernel == "paged_decode_kernel":
                    from kvattn.backends.cuda import launch as cuda_launch

                    extra["planned_per_sm"] = cuda_launch.decode_blocks_per_sm(
                        row.head_dim, fp8=bool(row.pool), scores=bool(row.variant)
                    )
                records.append(
                    dict(
                        backend="cuda",
                        config=cuda_config(row),
                        op=row.op,
                        kernel=row.kernel,
                        check=bool(row.check),
                        registers=u.get("REG"),
                        local=u.get("LOCAL", 0) + u.get("STACK", 0),
                        shared=shared,
                        kv_buffers=layout.get("stages"),
                        **sass_figures(insns),
                        **extra,
                    )
                )
    # A verdict serves only the checked kernel: unchecked, its row is the plain one (as Triton's).
    plain = {(r["kernel"], r["config"]): r for r in records if not r["check"]}
    records += [
        dict(plain[(r["kernel"], r["config"].removesuffix(" verdict"))], config=r["config"])
        for r in list(records)
        if r["config"].endswith(" verdict")
    ]
    records.sort(key=lambda r: (r["op"], r["kernel"], r["config"], r["check"]))
    return records


# ---- Decode grids at the goal shapes ----------------------------------------------------------

# The shapes the goals are stated at: bf16, head dim 128, 32 query heads over 8 KV heads, pages of
# 16 tokens, a table as wide as the context.
GOAL_BATCHES = (1, 16, 64)
GOAL_CONTEXTS = (4096, 8192, 16384, 32768)
GOAL_CONFIGS = {"triton": "decode bf16 d128 p16 gqa4", "cuda": "decode bf16 d128 16B"}
# An sm_90 SM: 64K registers allocated per warp in units of 256, 228 KB of shared memory of which
# each block reserves 1 KB (allocated in units of 128 bytes), at most 32 blocks and 64 warps.
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED, MAX_BLOCKS, MAX_WARPS = 65536, 233472, 1024, 32, 64
CUDA_DECODE_WARPS = 4  # csrc/kvattn/tiles.h kThreads: every attention kernel
# The model's assumptions (a model, NOT a measurement): a device-to-device copy moved about 4.3
# TB/s on an H200; a load from memory takes about a microsecond under load, one that hits L2 about
# 0.3; a kernel of a graph starts about a microsecond after the one before it ends.
COPY_BYTES_PER_US = 4.3e6
MEMORY_US, L2_US, LAUNCH_US = 1.0, 0.3, 1.0
# Dependent loads a decode program waits on in every iteration before it can issue the next K/V
# copy (from the TTGIR of the main loop: the Triton kernel loads the tile's table entry, then its
# tag, in the iteration that issues its copy; the CUDA kernel resolves them a sub-tile ahead), and
# before its first K/V copy (the length, the table entry, the tag).
# Through a verdict ("verdict") the Triton kernel loads one packed entry per tile, as unchecked
# loads its table entry; so does the CUDA kernel per token, which loads the new token's page's
# entry (kept per sequence) and then its tag beside the length and the first entry, so its start
# waits as long as unchecked.
LOOP_CHAIN = {
    ("triton", False): 1,
    ("triton", True): 2,
    ("triton", "verdict"): 1,
    ("cuda", False): 0,
    ("cuda", True): 0,
    ("cuda", "verdict"): 0,
}
START_CHAIN = {False: 3, True: 4, "verdict": 3}


def resident_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Blocks of a kernel one sm_90 SM holds at once, from its registers per thread and dynamic
    shared memory per block."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // per_warp // num_warps
    by_shared = SM_SHARED // (-(-(shared + BLOCK_RESERVED) // 128) * 128)
    return min(by_registers, by_shared, MAX_BLOCKS, MAX_WARPS // num_warps)


def record_residency(record: dict) -> int:
    return resident_per_sm(
        record["registers"], record["shared"], record.get("num_warps") or CUDA_DECODE_WARPS
    )


def _goal_args(batch: int, context: int):
    """Validated decode arguments of a goal shape: a table ``context / 16`` pages wide over a small
    pool (the planners read shapes only)."""
    import kvattn

    page, num_pages = 16, 64
    q = torch.zeros(batch, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(num_pages, page, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(batch, context // page, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return kvattn.layout.validate_decode(
        q,
        k,
        torch.zeros_like(k),
        table,
        lens,
        torch.zeros(num_pages, dtype=torch.int64),
        torch.ones(batch, dtype=torch.int64),
        validate=False,
    )


def model_time(programs: list[tuple[float, int, float]], slots: int, cap: float) -> float:
    """Microseconds for a grid of ``(start us, bytes, end us)`` programs in launch order, ``slots``
    at once: each waits its start latency, streams its bytes at most at ``cap`` bytes per us,
    sharing the copy bandwidth equally with the others streaming, then waits its end latency (a
    model of the waves, NOT speed)."""
    queue = list(programs)[::-1]
    running, clock = [], 0.0
    while queue or running:
        while queue and len(running) < slots:
            running.append(list(queue.pop()))
        streaming = sum(1 for p in running if p[0] <= 0 and p[1] > 0)
        rate = min(cap, COPY_BYTES_PER_US / streaming) if streaming else 0.0
        step = min(p[0] if p[0] > 0 else p[1] / rate if p[1] > 0 else p[2] for p in running)
        for p in running:
            if p[0] > 0:
                p[0] -= step
            elif p[1] > 0:
                p[1] -= step * rate
            else:
                p[2] -= step
        clock += step
        running = [p for p in running if p[0] > 1e-9 or p[1] > 1e-3 or p[2] > 1e-9]
    return clock


# Checked per call, both decode backends write the report from programs of their own beside the
# attention programs, one per sequence and split, first in launch order (a column of the grid).
# Through a verdict only the new token's page is reported: by split 0's report program ("column",
# the Triton kernel), or by one thread of the attention block that reads the new token, before
# its loop, from loads issued beside its first copies' ("fresh", the CUDA kernel).
VERDICT_REPORT = {"triton": "column", "cuda": "fresh"}


def decode_model(
    backend: str,
    check: bool,
    batch: int,
    splits: int,
    attention_per_split: int,
    bounds,
    slots: int,
    in_flight: int,
    tile_bytes: int,
    head_dim: int,
) -> float:
    """Modelled microseconds of one decode call (the kernel, then the merge when split): programs
    in launch order (the split is the slowest grid dimension), checked per call with the report's
    programs (one pass over a split's table entries and tags per 128 pages, two dependent loads
    from memory each), through a verdict as ``VERDICT_REPORT`` says; no program has report work
    after its loop."""
    chain = LOOP_CHAIN[(backend, check)] * L2_US
    cap = min(in_flight / MEMORY_US, tile_bytes / chain if chain else float("inf"))
    verdict = check == "verdict"
    programs = []
    for split, (s, e) in enumerate(bounds):
        pages = -(-max(e - s, 0) // 16)
        passes = -(-pages // 128)
        if verdict and VERDICT_REPORT[backend] == "column":
            # Split 0's report program judges the new token's page: entry, tag, its reason.
            programs += [(MEMORY_US, 0, 3 * MEMORY_US if split == 0 else 0.0)] * batch
        elif check and not verdict:
            programs += [(MEMORY_US, 0, 2 * MEMORY_US * passes)] * batch
        for _ in range(attention_per_split):
            start = START_CHAIN[check] * MEMORY_US if e > s else 0.0
            programs.append((start, max(e - s, 0) * head_dim * 2 * 2, 0.0))
    total = LAUNCH_US + model_time(programs, slots, cap)
    if splits > 1:  # the merge: read the partials (and, checked, sum the report counts)
        total += LAUNCH_US + 2 * MEMORY_US
    return total


def resolve_model(layers: int) -> float:
    """Modelled microseconds of one resolve (kvattn.resolve_pages on the GPU; its grid fits one
    wave at the goal shapes): two launches; the length, then the table entries and expected
    owners, then one tag tile per BLOCK_L layers, each a dependent load from memory; then the
    report kernel's partial counts (a model, NOT speed)."""
    from kvattn.backends.triton.resolve import BLOCK_L

    return 2 * LAUNCH_US + (2 + -(-layers // BLOCK_L) + 1) * MEMORY_US


def decode_grids(records: list[dict]) -> list[dict]:
    """The decode grids the planners choose at the goal shapes on an H200, with the resident
    programs per SM of the compiled kernels (both variants) in ``records``."""
    from kvattn.backends import grids
    from kvattn.backends.cuda import launch as cuda_launch
    from kvattn.backends.triton import paged_decode

    rows = []
    for backend, config in GOAL_CONFIGS.items():
        found = {
            r["check"]: r
            for r in records
            if r["backend"] == backend
            and r["kernel"] == "paged_decode_kernel"
            and r["config"] == config
        }
        if len(found) < 2:
            continue
        modes = [False, True]
        through = [
            r
            for r in records
            if r["backend"] == backend
            and r["kernel"] == "paged_decode_kernel"
            and r["config"] == f"{config} verdict"
            and r["check"]
        ]
        if through:
            found["verdict"] = through[0]
            modes.append("verdict")
        resident = min(record_residency(r) for r in found.values())
        slots = resident * H200_SMS
        for batch in GOAL_BATCHES:
            for context in GOAL_CONTEXTS:
                args = _goal_args(batch, context)
                with compile_only():
                    if backend == "triton":
                        splits, min_chunk, align = paged_decode.plan_splits(args)
                        # The report column: one program per sequence and split (checked).
                        per_split = batch * (args.num_kv_heads + 1)
                        attention = batch * args.num_kv_heads
                        cfg = paged_decode.launch_config(args)
                        tile_bytes = cfg.block_n * args.head_dim * 2 * 2
                        in_flight = (found[True]["kv_buffers"] - 1) * tile_bytes
                        planned = cfg.programs_per_sm
                    else:
                        splits, min_chunk, align = cuda_launch.plan_splits(args)
                        # As the planner counts them: the report's short blocks left out
                        # (decode_model has them).
                        per_split = attention = cuda_launch.decode_blocks_per_split(args)
                        tile_bytes = cuda_launch.SUB_TILE * args.head_dim * 2 * 2
                        in_flight = CUDA_DECODE_WARPS * (found[True]["kv_buffers"] - 1) * tile_bytes
                        planned = cuda_launch.decode_blocks_per_sm(args.head_dim)
                programs = per_split * splits
                waves, tail = grids.grid_waves(programs, slots)
                bounds = grids.split_bounds(context, splits, align, min_chunk)
                times = {
                    check: decode_model(
                        backend,
                        check,
                        batch,
                        splits,
                        attention,
                        bounds,
                        slots,
                        in_flight,
                        tile_bytes,
                        args.head_dim,
                    )
                    for check in modes
                }
                copy_us = (
                    batch * context * args.num_kv_heads * args.head_dim * 2 * 2 / COPY_BYTES_PER_US
                )
                rows.append(
                    dict(
                        backend=backend,
                        batch=batch,
                        context=context,
                        splits=splits,
                        programs=programs,
                        resident_per_sm=resident,
                        planned_per_sm=planned,
                        slots=slots,
                        waves=round(waves, 3),
                        tail=round(tail, 3),
                        most_splits=min(-(-context // min_chunk), grids.MAX_SPLITS),
                        modelled_bandwidth=round(copy_us / times[False], 3),
                        modelled_check_cost=round(times[True] / times[False] - 1, 3),
                    )
                )
                if "verdict" in times:
                    # Per layer, and with the step's one resolve shared by its RESOLVE_LAYERS.
                    per_layer = resolve_model(RESOLVE_LAYERS) / RESOLVE_LAYERS
                    rows[-1].update(
                        modelled_verdict_cost=round(times["verdict"] / times[False] - 1, 3),
                        modelled_verdict_cost_with_resolve=round(
                            (times["verdict"] + per_layer) / times[False] - 1, 3
                        ),
                    )
    return rows


def grids_markdown(rows: list[dict]) -> str:
    lines = [
        "## decode grids at the goal shapes",
        "",
        "bf16, head dim 128, 32 query / 8 KV heads, pages of 16, a table as wide as the context, "
        f"on {H200_SMS} SMs. Resident programs per SM from the registers and shared memory of "
        "both variants above; tail: the share of the slots' time the last, partial wave "
        "leaves idle (0 for one wave or less). The model (tools/static_sm90.py `decode_model`, "
        "NOT speed): programs take the slots in launch order, wait their dependent start "
        "loads, stream their K/V at most at their buffers in flight per loaded latency (and "
        "one tile per exposed per-iteration load chain), sharing "
        f"{COPY_BYTES_PER_US / 1e6:g} TB/s of copy bandwidth; then the merge. Unchecked: the "
        "modelled share of the copy bandwidth; checked: the modelled time over unchecked. "
        "Through a verdict (docs/ownership.md section 9): the same, the per-layer call "
        "alone, then with the step's one resolve (`resolve_model`) shared by its "
        f"{RESOLVE_LAYERS} layers.",
        "",
        "| backend | batch | context | splits | programs | resident/SM | slots | waves | tail "
        "| model: unchecked % of copy | model: checked cost | model: verdict cost "
        "| model: verdict + resolve |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        verdict = ["", ""]
        if "modelled_verdict_cost" in r:
            verdict = [
                f"{100 * r['modelled_verdict_cost']:+.1f}%",
                f"{100 * r['modelled_verdict_cost_with_resolve']:+.1f}%",
            ]
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['context']} | {r['splits']} | "
            f"{r['programs']} | {r['resident_per_sm']} | {r['slots']} | {r['waves']:.2f} | "
            f"{100 * r['tail']:.0f}% | {100 * r['modelled_bandwidth']:.0f}% | "
            f"{100 * r['modelled_check_cost']:+.1f}% | {verdict[0]} | {verdict[1]} |"
        )
    return "\n".join(lines) + "\n"


# ---- Launches per call --------------------------------------------------------------------------

# Aten ops that launch nothing on a GPU: allocations and views.
_NO_LAUNCH = {
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "view",
    "_unsafe_view",
    "as_strided",
    "select",
    "slice",
    "alias",
    "detach",
    "t",
    "transpose",
    "expand",
    "unsqueeze",
    "squeeze",
    "reshape",
    "lift_fresh",
}


def launches_per_call(configs=TRITON_CONFIGS) -> list[dict]:
    """Device launches of one Triton extend call (host-side torch ops that would launch a kernel,
    and Triton kernels), counted while the launcher runs under :func:`compile_only`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvattn.backends import triton as triton_backend

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in _NO_LAUNCH:
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    rows = []
    for name, op, *shape in configs:
        if op != "extend":
            continue
        args = _inputs(op, *shape)
        for check in (False, True):
            out = args.q.new_empty(args.q.shape)
            with compile_only() as compiled, Ops() as ops:
                triton_backend.extend(args, check=check, out=out, lse=None)
            rows.append(
                dict(
                    config=name,
                    check=check,
                    torch_ops=len(ops.names),
                    kernels=[k for k, _ in compiled],
                )
            )
    return rows


def launches_markdown(rows: list[dict]) -> str:
    lines = [
        "## extend launches per call (Triton)",
        "",
        "Device launches of one `kvattn.paged_extend` call on the triton backend: host-side torch "
        "ops that launch a kernel on a GPU (allocations and views launch none), then the Triton "
        "kernels, counted while the launcher runs.",
        "",
        "| config | variant | torch ops | Triton kernels | launches |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {'checked' if r['check'] else 'unchecked'} | {r['torch_ops']} | "
            f"{', '.join(r['kernels'])} | {r['torch_ops'] + len(r['kernels'])} |"
        )
    return "\n".join(lines) + "\n"


# ---- The keyed transfer digest ------------------------------------------------------------------

# The pages it digests: a Llama-8B-like page (32 layers, 8 KV heads of 128, bfloat16, 16 tokens),
# 2 MiB over the layers, as docs/transfer.md and benchmarks/transfer_digest.py measure on the CPU.
DIGEST_GEOMETRY = (32, 16, 8, 128)
HBM_BYTES_PER_US = 4.8e6  # an H200's HBM3e, nominal
# An sm_90 SM issues one warp instruction per clock from each of its 4 schedulers, at 1.98 GHz.
ISSUE_PER_US = 4 * 1980


def digest_records() -> list[dict]:
    """The keyed digest's kernel (kvattn.backends.triton.digest), compiled as a launch over
    DIGEST_GEOMETRY's pools would compile it."""
    from kvattn.backends.triton import digest

    layers, page, heads, dim = DIGEST_GEOMETRY
    pools = [torch.zeros(64, page, heads, dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
    key = torch.zeros(digest.key_words(pools), dtype=torch.int32)
    with compile_only() as compiled:
        digest.nh(pools, torch.arange(8), torch.full((8,), page), key)
    records = []
    for kernel_name, kernel in compiled:
        figures = triton_kernel_figures(kernel)
        records.append(
            dict(
                backend="triton",
                config=f"digest bf16 {layers}x2 pools p{page} h{heads} d{dim}",
                op="digest",
                kernel=kernel_name,
                check=True,
                **figures,
                resident_per_sm=resident_per_sm(
                    figures["registers"], figures["shared"], figures["num_warps"]
                ),
            )
        )
    return records


def digest_model(record: dict) -> dict:
    """The keyed digest's modelled bandwidth on an H200 (a model, NOT speed): each program reads
    ROWS slot rows of one pool of one page (its message words from memory; its key words, the
    same for every page, from L2) and runs its SASS once; the grid streams its bytes at the least
    of the copy bandwidth, the issue rate of its instructions, and its resident programs' bytes
    in flight per memory latency."""
    from kvattn.backends.triton import digest

    _, page, heads, dim = DIGEST_GEOMETRY
    program_bytes = digest.ROWS * heads * dim * 2
    issue = H200_SMS * ISSUE_PER_US * program_bytes / (record["sass"] * record["num_warps"])
    in_flight = H200_SMS * record["resident_per_sm"] * program_bytes / MEMORY_US
    bandwidth = min(COPY_BYTES_PER_US, issue, in_flight)
    return dict(
        program_bytes=program_bytes,
        issue_bound=round(issue / 1e6, 2),
        latency_bound=round(in_flight / 1e6, 2),
        modelled=round(bandwidth / 1e6, 2),
        share_of_hbm=round(bandwidth / HBM_BYTES_PER_US, 3),
    )


def digest_markdown(record: dict, model: dict) -> str:
    return "\n".join(
        [
            "## keyed transfer digest (Triton, NH x4)",
            "",
            f"`{record['kernel']}` over `{record['config']}`: {record['registers']} registers, "
            f"{record['sass']} SASS instructions per program ({record['num_warps']} warps, "
            f"{model['program_bytes']} bytes of K/V), {record['resident_per_sm']} programs per SM. "
            "The model (tools/static_sm90.py `digest_model`, NOT speed): the least of "
            f"{COPY_BYTES_PER_US / 1e6:g} TB/s of copy bandwidth, the issue rate of those "
            f"instructions ({model['issue_bound']} TB/s) and the resident programs' bytes in "
            f"flight per {MEMORY_US:g} us of memory latency ({model['latency_bound']} TB/s): "
            f"**{model['modelled']} TB/s, {100 * model['share_of_hbm']:.0f}% of the "
            f"{HBM_BYTES_PER_US / 1e6:g} TB/s HBM**.",
            "",
        ]
    )


# ---- Output -----------------------------------------------------------------------------------

# ---- Extend: the tensor cores' share of the main loop ------------------------------------------

# An H200 SM's dense bf16 tensor-core rate, 4096 FLOPs a cycle (989 TFLOPS at 1.83 GHz on 132 SMs),
# over its four warp schedulers, each issuing at most one instruction a cycle.
TC_FLOPS_PER_SCHEDULER_CYCLE = 4096 // 4


def extend_estimates(records: list[dict]) -> list[dict]:
    """Per extend record, the share of the bf16 tensor-core rate its main loop can reach when
    issuing its instructions is all that limits it (a ceiling, NOT speed): the cycles the tensor
    cores need for the loop's products over the cycles the SM's schedulers need to issue it, both
    per warp and iteration (``loop_mma_flops / (1024 * loop_sass)``; the warps per SM cancel).
    Latencies, barriers, memory and the causal diagonal are left out."""
    rows = []
    for r in records:
        if r["kernel"] != "paged_extend_kernel" or not r.get("loop_sass"):
            continue
        share = r["loop_mma_flops"] / (TC_FLOPS_PER_SCHEDULER_CYCLE * r["loop_sass"])
        rows.append(
            dict(
                backend=r["backend"],
                config=r["config"],
                check=r["check"],
                loop_sass=r["loop_sass"],
                loop_mma_flops=r["loop_mma_flops"],
                tensor_core_share=round(share, 3),
            )
        )
    return rows


def estimates_markdown(rows: list[dict]) -> str:
    lines = [
        "## extend: the tensor cores' share of the main loop (issue-bound estimate)",
        "",
        "Per warp and main-loop iteration (a key tile before the diagonal): the FLOPs of its "
        "tensor-core instructions (an `HMMA.16816` its warp's 16x8x16 product, an `HGMMA` a "
        "quarter of its warpgroup's), and the share of an H200's dense bf16 rate (4096 FLOPs a "
        "cycle per SM, over four schedulers issuing one instruction a cycle each) the loop reaches "
        "when issuing its instructions is all that limits it: FLOPs / (1024 x instructions). A "
        "ceiling from the SASS (tools/static_sm90.py `extend_estimates`), NOT speed: latencies, "
        "barriers, memory and the causal diagonal are left out.",
        "",
        "| backend | config | variant | loop SASS | tensor-core FLOPs | estimate: share of the bf16 rate |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['config']} | {'checked' if r['check'] else 'unchecked'} | "
            f"{r['loop_sass']} | {r['loop_mma_flops']} | {100 * r['tensor_core_share']:.0f}% |"
        )
    return "\n".join(lines) + "\n"


COLUMNS = [
    ("registers", "regs"),
    ("local", "local B"),
    ("shared", "smem B"),
    ("kv_buffers", "K/V bufs"),
    ("async_wait_max", "in flight"),
    ("sass", "SASS"),
    ("loop_sass", "loop SASS"),
    ("loop_ldgsts_128", "loop LDGSTS.128"),
    ("loop_ldg_128", "loop LDG.128"),
    ("loop_mma", "loop MMA"),
    ("loop_bar", "loop BAR"),
    ("loop_membar", "loop MEMBAR"),
]


def markdown(records: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| backend | kernel | config | variant | "
        + " | ".join(label for _, label in COLUMNS)
        + " |",
        "|" + "---|" * (4 + len(COLUMNS)),
    ]
    for r in records:
        cells = [str(r.get(key, "")) if r.get(key) is not None else "" for key, _ in COLUMNS]
        lines.append(
            f"| {r['backend']} | {r['kernel']} | {r.get('config', '')} | "
            f"{'checked' if r['check'] else 'unchecked'} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--cuda-object", default=str(CUDA_MODULE))
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--only", help="Triton configurations whose name contains this")
    args = ap.parse_args(argv)
    configs = [c for c in TRITON_CONFIGS if args.only is None or args.only in c[0]]
    records = [] if args.no_triton else triton_records(configs)
    obj = pathlib.Path(args.cuda_object)
    cuda = cuda_records(obj) if obj.exists() else []
    records += cuda
    # The CUDA module by its name (not its file's, which carries the interpreter's tag); a build of
    # a subset of the table (KVATTN_CUDA_DTYPES, _HEAD_DIMS, _VARIANTS) says so.
    full = len(INSTANTIATIONS.TABLE)
    cuda_name = ("absent" if not obj.exists() else "_C" if obj == CUDA_MODULE else obj.name) + (
        f" (a subset: {len(cuda)} of {full} instantiations)"
        if obj.exists() and len(cuda) < full
        else ""
    )
    header = (
        f"Static sm_90 figures (NOT speed): Triton {triton.__version__}, "
        f"torch {torch.__version__}, CUDA module {cuda_name}"
    )
    decode_grid_rows = decode_grids(records)
    launch_rows = [] if args.no_triton else launches_per_call(configs)
    estimate_rows = extend_estimates(records)
    digest = [] if args.no_triton or args.only else digest_records()
    records += digest
    digest_row = digest_model(digest[0]) if digest else None
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                dict(
                    header=header,
                    records=records,
                    decode_grids=decode_grid_rows,
                    extend_launches=launch_rows,
                    extend_estimates=estimate_rows,
                    digest_model=digest_row,
                ),
                indent=1,
            )
        )
    table = markdown(records, header)
    if decode_grid_rows:
        table += "\n" + grids_markdown(decode_grid_rows)
    if launch_rows:
        table += "\n" + launches_markdown(launch_rows)
    if estimate_rows:
        table += "\n" + estimates_markdown(estimate_rows)
    if digest_row:
        table += "\n" + digest_markdown(digest[0], digest_row)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

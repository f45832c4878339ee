"""Static resource figures of the Triton decode and extend kernels for sm_90, compiled on any
machine (no GPU).

``python tools/triton_resources.py [--json]`` prints registers, stack (spills), shared memory and SASS
instruction counts of the checked and unchecked variants for a few configurations. These are not
speed: they are a cheap, repeatable view of what the ownership check adds to the kernel, and
``tests/test_triton_resources.py`` fails if either variant spills. Run it without
``TRITON_INTERPRET=1``: the interpreter replaces the kernels with Python functions.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class Resources:
    registers: int
    stack: int
    local: int
    shared: int
    sass_instructions: int


def _bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def available() -> bool:
    return os.path.exists(_bin("cuobjdump")) and os.path.exists(_bin("ptxas"))


def compile_resources(kernel, pointers: dict, constexprs: dict, num_warps: int,
                      arch: int = 90) -> Resources:
    """Compile ``kernel`` for ``arch`` as a launch would specialise it (pointers and strides
    16-byte aligned/divisible, as they are for torch allocations) and read its resource usage."""
    names = kernel.arg_names
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = "*" + pointers[p.name]
        else:
            signature[p.name] = "fp32" if p.name.startswith("scale") else "i32"
    divisible = [n for n in names if n in pointers or n.startswith("stride_")]
    src = triton.compiler.ASTSource(
        kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    fields = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line))
    return Resources(fields["REG"], fields["STACK"], fields["LOCAL"], fields["SHARED"], instructions)


_REPORT_POINTERS = dict(violations_ptr="i32", reasons_ptr="i32", checked_ptr="i32", beyond_ptr="i32",
                        page_reasons_ptr="i8", block_table_ptr="i32", seq_lens_ptr="i32",
                        tags_ptr="i64", expected_ptr="i64", lse_ptr="fp32")


def decode_resources(*, check: bool, dtype: str = "float16", head_dim: int = 128, page_size: int = 16,
                     group: int = 4, num_splits: int = 2, arch: int = 90) -> Resources:
    """The decode kernel with the launcher's own tile choice."""
    module = importlib.import_module("kvattn.backends.triton.paged_decode")
    block_d, block_n = module.tile_sizes(head_dim, page_size)
    elem = _TYPES[dtype]
    pointers = dict(_REPORT_POINTERS, q_ptr=elem, k_ptr=elem, v_ptr=elem, out_ptr=elem,
                    part_acc_ptr="fp32", part_ml_ptr="fp32")
    constexprs = dict(NUM_HEADS=8 * group, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                      HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=block_n,
                      BLOCK_P=64, NUM_SPLITS=num_splits, CHECK=check, DOT_FP32=dtype == "float32",
                      RETURN_LSE=False)
    return compile_resources(module.paged_decode_kernel, pointers, constexprs, num_warps=4, arch=arch)


def extend_resources(*, check: bool, dtype: str = "float16", head_dim: int = 128, page_size: int = 16,
                     group: int = 4, arch: int = 90) -> Resources:
    """The extend kernel with the launcher's own tile choice (causal)."""
    import torch

    module = importlib.import_module("kvattn.backends.triton.paged_extend")
    block_d, block_m, block_n, num_warps = module.tile_sizes(head_dim, getattr(torch, dtype))
    elem = _TYPES[dtype]
    pointers = dict(_REPORT_POINTERS, q_ptr=elem, k_ptr=elem, v_ptr=elem, out_ptr=elem,
                    q_start_ptr="i32", tile_start_ptr="i32")
    constexprs = dict(NUM_HEADS=8 * group, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                      PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=64, BLOCK_P=64,
                      CAUSAL=True, CHECK=check, DOT_FP32=dtype == "float32", RETURN_LSE=True)
    return compile_resources(module.paged_extend_kernel, pointers, constexprs, num_warps, arch=arch)


CONFIGS = [
    ("decode", dict(dtype="float16", head_dim=128, page_size=16, group=4)),
    ("decode", dict(dtype="bfloat16", head_dim=256, page_size=1, group=8)),
    ("decode", dict(dtype="float16", head_dim=64, page_size=256, group=1)),
    ("extend", dict(dtype="bfloat16", head_dim=128, page_size=16, group=4)),
    ("extend", dict(dtype="float16", head_dim=64, page_size=1, group=1)),
]
_MEASURE = {"decode": decode_resources, "extend": extend_resources}


def main() -> int:
    if not available():
        print("triton's cuobjdump/ptxas not found: nothing to report")
        return 1
    if "--json" in sys.argv:
        rows = [dict(config, kernel=kernel, check=check,
                     **_MEASURE[kernel](check=check, **config).__dict__)
                for kernel, config in CONFIGS for check in (False, True)]
        print(json.dumps(rows))
        return 0
    print(f"triton {triton.__version__}, sm_90, num_warps 4")
    print(f"{'kernel, config':<52} {'variant':<10} {'regs':>5} {'stack':>6} {'local':>6} "
          f"{'smem':>6} {'sass':>6}")
    for kernel, config in CONFIGS:
        label = kernel + ": " + ", ".join(f"{k}={v}" for k, v in config.items())
        for check in (False, True):
            r = _MEASURE[kernel](check=check, **config)
            print(f"{label:<52} {'checked' if check else 'unchecked':<10} {r.registers:>5} {r.stack:>6} "
                  f"{r.local:>6} {r.shared:>6} {r.sass_instructions:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

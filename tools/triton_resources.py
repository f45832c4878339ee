"""Static resource figures of the Triton decode kernel for sm_90, compiled on any machine (no GPU).

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


def decode_resources(*, check: bool, dtype: str = "float16", head_dim: int = 128, page_size: int = 16,
                     group: int = 4, num_splits: int = 2, arch: int = 90) -> Resources:
    """Compile the decode kernel with the launcher's own tile choice and read its resource usage."""
    decode = importlib.import_module("kvattn.backends.triton.decode")
    kernel = decode.paged_decode_kernel
    block_d, block_n = decode.tile_sizes(head_dim, page_size)
    elem = _TYPES[dtype]
    pointers = dict(q_ptr=elem, k_ptr=elem, v_ptr=elem, out_ptr=elem, block_table_ptr="i32",
                    seq_lens_ptr="i32", tags_ptr="i64", expected_ptr="i64", lse_ptr="fp32",
                    part_acc_ptr="fp32", part_ml_ptr="fp32", violations_ptr="i32", reasons_ptr="i32",
                    checked_ptr="i32", beyond_ptr="i32", page_reasons_ptr="i8")
    constexprs = dict(NUM_HEADS=8 * group, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                      HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=block_n,
                      BLOCK_P=64, NUM_SPLITS=num_splits, CHECK=check, DOT_FP32=dtype == "float32",
                      RETURN_LSE=False)
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = "*" + pointers[p.name]
        else:
            signature[p.name] = "fp32" if p.name == "scale_log2" else "i32"
    src = triton.compiler.ASTSource(
        kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
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


CONFIGS = [
    dict(dtype="float16", head_dim=128, page_size=16, group=4),
    dict(dtype="bfloat16", head_dim=256, page_size=1, group=8),
    dict(dtype="float16", head_dim=64, page_size=256, group=1),
]


def main() -> int:
    if not available():
        print("triton's cuobjdump/ptxas not found: nothing to report")
        return 1
    if "--json" in sys.argv:
        rows = [dict(config, check=check, **decode_resources(check=check, **config).__dict__)
                for config in CONFIGS for check in (False, True)]
        print(json.dumps(rows))
        return 0
    print(f"triton {triton.__version__}, sm_90, num_warps 4")
    print(f"{'config':<44} {'variant':<10} {'regs':>5} {'stack':>6} {'local':>6} {'smem':>6} {'sass':>6}")
    for config in CONFIGS:
        label = ", ".join(f"{k}={v}" for k, v in config.items())
        for check in (False, True):
            r = decode_resources(check=check, **config)
            print(f"{label:<44} {'checked' if check else 'unchecked':<10} {r.registers:>5} {r.stack:>6} "
                  f"{r.local:>6} {r.shared:>6} {r.sass_instructions:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

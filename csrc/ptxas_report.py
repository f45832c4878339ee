"""Registers, shared memory and local memory of every kernel instantiation, from ``nvcc -Xptxas -v``.

setup.py gathers the compiler's output of every translation unit in ``build/cuda/ptxas.log`` and
calls :func:`check` after each CUDA build: it records ``build/cuda/resources.json`` and fails when a
kernel spills or keeps a stack frame (local memory, i.e. a register array the compiler could not
keep in registers), or when the log does not hold exactly the instantiations the build's selection
of csrc/instantiations.py lists, once per architecture. tests/backends/test_cuda.py runs the same
check on the kept log. Standard library only.

Usage: ``python csrc/ptxas_report.py build/cuda/ptxas.log``.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    result = subprocess.run(
        [tool], input="\n".join(names), capture_output=True, text=True, check=False
    )
    lines = result.stdout.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


def parse(text: str) -> list[dict]:
    """One record per (kernel, arch): registers, static smem, stack frame and spill bytes."""
    records: list[dict] = []
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = dict(
                kernel=m.group(1),
                arch=m.group(2),
                registers=None,
                smem_static=0,
                stack_frame=0,
                spill_stores=0,
                spill_loads=0,
            )
            records.append(current)
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.update(
                stack_frame=int(m.group(1)),
                spill_stores=int(m.group(2)),
                spill_loads=int(m.group(3)),
            )
            continue
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            current["smem_static"] = int(m.group(2) or 0)
    names = _demangle([r["kernel"] for r in records])
    for r in records:
        r["kernel"] = names[r["kernel"]]
    return records


CHECKED_KERNELS = ("paged_decode_kernel", "paged_extend_kernel")


def local_memory_problems(records: list[dict]) -> list[str]:
    """Kernels of the module (every instantiation) that use local memory (spills or a stack
    frame)."""
    return [
        f"{r['kernel']} [{r['arch']}]: {r['stack_frame']} B stack, {r['spill_stores']} B spill "
        f"stores, {r['spill_loads']} B spill loads"
        for r in records
        if r["stack_frame"] or r["spill_stores"] or r["spill_loads"]
    ]


def check(
    log: pathlib.Path, out_json: pathlib.Path | None = None, expected: set | None = None
) -> list[dict]:
    """Parse ``log``, write the records to ``out_json``; raise RuntimeError on local memory in any
    kernel, and when the log lacks a decode or extend kernel (a build that printed nothing proves
    nothing) or, given ``expected`` (``{(demangled signature, "sm_90"), ...}``), when it does not
    hold each of those exactly once and nothing else."""
    records = parse(log.read_text())
    for name in CHECKED_KERNELS:
        if expected is None and not any(name in r["kernel"] for r in records):
            raise RuntimeError(f"{log}: no {name} entry in the -Xptxas -v output")
    if expected is not None:
        found = [(r["kernel"], r["arch"]) for r in records]
        missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
        twice = sorted({k for k in found if found.count(k) > 1})
        if missing or extra or twice:
            raise RuntimeError(
                f"{log}: the instantiations differ from the build's selection: "
                f"{len(missing)} missing {missing[:3]}, {len(extra)} not in it {extra[:3]}, "
                f"{len(twice)} compiled twice {twice[:3]}"
            )
    if out_json is not None:
        out_json.write_text(json.dumps(records, indent=1) + "\n")
    problems = local_memory_problems(records)
    if problems:
        raise RuntimeError("kernel uses local memory:\n" + "\n".join(problems))
    return records


def summary(records: list[dict]) -> str:
    """One line: the kernels per architecture, their range of registers, and how many use local
    memory (spills or a stack frame; :func:`check` fails on any)."""
    archs = sorted({r["arch"] for r in records})
    per_arch = ", ".join(f"{sum(r['arch'] == a for r in records)} for {a}" for a in archs)
    registers = [r["registers"] for r in records if r["registers"] is not None]
    local = len(local_memory_problems(records))
    return (
        f"{len(records)} kernels ({per_arch or 'none'}), "
        + (f"{min(registers)}-{max(registers)} registers, " if registers else "")
        + (f"{local} with local memory" if local else "no spills, no stack frames")
    )


def table(records: list[dict]) -> str:
    rows = [f"{'kernel':<60} {'arch':<6} {'regs':>4} {'smem':>5} {'stack':>5} {'spill':>5}"]
    for r in records:
        rows.append(
            f"{r['kernel'][:60]:<60} {r['arch']:<6} {r['registers']:>4} {r['smem_static']:>5} "
            f"{r['stack_frame']:>5} {r['spill_stores'] + r['spill_loads']:>5}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    records = check(pathlib.Path(sys.argv[1]))
    print(table(records))
    print(summary(records))

"""``python -m kvattn.env`` and :func:`kvattn.info`: what kvattn finds on this machine.

- Versions: Python, kvattn, torch (and the CUDA it was built for), triton, nvcc (on this machine and
  the one the CUDA module was built with), the NVIDIA driver, the GPUs.
- Backends: for each op (``decode``, ``extend``, ``write_kv``, ``mla_decode``, ``mla_extend``)
  and each device (the CPU, and the first GPU when there is one), the backend ``backend="auto"``
  takes for a small probe input, and for every backend whether it accepts that input or why it
  refuses. Only the registry is asked: nothing is launched. ``KVATTN_BACKEND`` and
  ``TRITON_INTERPRET`` are shown because they change the answers.
- Extensions: each compiled module built / not built / build failed, and why
  (:mod:`kvattn.extensions`); for the CUDA module, the instantiations it holds (all of
  csrc/instantiations.py, or the subset it was built with) and the static resource figures ptxas
  reported for every kernel (registers, static shared memory, stack frame, spills).

Usage: ``python -m kvattn.env [--json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess

import torch

from . import backends, extensions
from .layout import validate_decode, validate_extend, validate_mla_decode, validate_mla_extend
from .version import __version__
from .write_args import validate_write_kv

CUDA_MODULE = "kvattn.backends.cuda._C"
PROBE = dict(dtype=torch.float16, num_heads=2, num_kv_heads=1, head_dim=64, page_size=16)


def info() -> dict:
    """Everything the report shows, as plain data (JSON-serialisable)."""
    statuses = extensions.statuses()
    cuda_record = statuses[CUDA_MODULE].record
    return {
        "versions": _versions(cuda_record),
        "gpus": _gpus(),
        "environment": {
            name: os.environ.get(name) for name in ("KVATTN_BACKEND", "TRITON_INTERPRET")
        },
        "probe": {k: str(v).replace("torch.", "") for k, v in PROBE.items()},
        "backends": {device: _backends_on(device) for device in _devices()},
        "extensions": {
            name: {"state": s.state, "reason": s.reason, "path": s.path}
            for name, s in statuses.items()
        },
        "build_summary": extensions.read_record().get("summary"),
        "cuda_resources": cuda_record.get("resources", []) if statuses[CUDA_MODULE].path else [],
        "cuda_selection": cuda_record.get("selection") if statuses[CUDA_MODULE].path else None,
        "cuda_units": {k: cuda_record[k] for k in ("instantiations", "units") if k in cuda_record},
    }


def _devices() -> list[str]:
    return ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def _probe_args(device: str) -> dict:
    """Validated records of a one-token call per op: the registry's questions, never launched."""
    p = PROBE
    dev = torch.device(device)
    pool = (4, p["page_size"], p["num_kv_heads"], p["head_dim"])
    k_cache = torch.zeros(pool, dtype=p["dtype"], device=dev)
    v_cache = torch.zeros_like(k_cache)
    page_tags = torch.zeros(pool[0], dtype=torch.int64, device=dev)
    block_table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
    expected = torch.ones(1, dtype=torch.int64, device=dev)
    q = torch.zeros(1, p["num_heads"], p["head_dim"], dtype=p["dtype"], device=dev)
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    kv = torch.zeros(1, p["num_kv_heads"], p["head_dim"], dtype=p["dtype"], device=dev)
    slot_mapping = torch.zeros(1, dtype=torch.int64, device=dev)
    return {
        "decode": validate_decode(
            q, k_cache, v_cache, block_table, seq_lens, page_tags, expected, validate=False
        ),
        "extend": validate_extend(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            block_table,
            seq_lens,
            page_tags,
            expected,
            validate=False,
        ),
        "write_kv": validate_write_kv(kv, kv, k_cache, v_cache, slot_mapping, page_tags, 1),
        # MLA: the probe's head_dim is the latent row (three quarters latent, a quarter RoPE).
        "mla_decode": validate_mla_decode(
            q,
            k_cache[:, :, :1],
            block_table,
            seq_lens,
            page_tags,
            expected,
            kv_lora_rank=3 * p["head_dim"] // 4,
            validate=False,
        ),
        "mla_extend": validate_mla_extend(
            q,
            k_cache[:, :, :1],
            cu_seqlens_q,
            block_table,
            seq_lens,
            page_tags,
            expected,
            kv_lora_rank=3 * p["head_dim"] // 4,
            validate=False,
        ),
    }


def _backends_on(device: str) -> dict:
    out = {}
    for op, args in _probe_args(device).items():
        auto, _ = backends.auto_choice(args, op)
        out[op] = {
            "auto": auto,
            "order": list(backends.auto_order(op, args.k_cache.device)),
            "reasons": backends.explain(args, op),
        }
    return out


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvcc_version() -> str | None:
    """``release X.Y`` of the nvcc setup.py would use (PATH, then $CUDA_HOME/bin, /usr/local/cuda)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path=os.path.join(home, "bin"))
    if nvcc is None:
        return None
    try:
        text = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), else the CUDA version its libcuda supports."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10}"


def _versions(cuda_record: dict) -> dict:
    return {
        "python": platform.python_version(),
        "kvattn": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _distribution_version("triton", "pytorch-triton"),
        "nvcc": _nvcc_version(),
        "nvcc_of_cuda_module": cuda_record.get("nvcc"),
        "driver": _driver(),
    }


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append(
            {"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"}
        )
    return gpus


def _kernel_name(demangled: str) -> str:
    """``void kvattn::paged_decode_kernel<__half, true>(kvattn::DecodeParams)`` ->
    ``paged_decode_kernel<__half, true>``."""
    name = re.sub(r"^void\s+", "", demangled)
    name = re.sub(r"\(.*\)$", "", name)
    return name.replace("kvattn::", "")


def _selection_lines(data: dict) -> list[str]:
    """What the CUDA module holds of csrc/instantiations.py (a build older than the table: nothing)."""
    selection, units = data.get("cuda_selection"), data.get("cuda_units") or {}
    if not selection:
        return []
    what = "every instantiation" if selection["full"] else f"a subset ({selection['text']})"
    count = (
        f": {units['instantiations']} in {units['units']} translation units"
        if {"instantiations", "units"} <= set(units)
        else ""
    )
    return [f"  {what} of csrc/instantiations.py{count}"]


def report(data: dict | None = None, kernels: bool = False) -> str:
    """The text ``python -m kvattn.env`` prints: the CUDA module's resources as one line per
    architecture, or per kernel with ``kernels``."""
    data = info() if data is None else data
    v = data["versions"]
    lines = [
        "kvattn environment",
        f"  python {v['python']}, kvattn {v['kvattn']}, torch {v['torch']} "
        f"(CUDA {v['torch_cuda'] or 'none: a CPU build'}), triton {v['triton'] or 'not installed'}",
        f"  nvcc: {v['nvcc'] or 'not found'} (the CUDA module was built with "
        f"{v['nvcc_of_cuda_module'] or 'no recorded nvcc'}); driver: {v['driver'] or 'none'}",
    ]
    gpus = ", ".join(f"{g['index']}: {g['name']} (sm {g['capability']})" for g in data["gpus"])
    lines.append(f"  GPUs: {gpus or 'none visible to torch'}")
    env = ", ".join(f"{k}={val}" for k, val in data["environment"].items() if val is not None)
    lines.append(f"  environment: {env or 'KVATTN_BACKEND and TRITON_INTERPRET unset'}")

    p = data["probe"]
    lines.append(
        f"\nBackends for a probe input ({p['dtype']}, {p['num_heads']} heads / "
        f"{p['num_kv_heads']} KV head, head_dim {p['head_dim']}, page {p['page_size']}):"
    )
    for device, ops in data["backends"].items():
        for op, entry in ops.items():
            lines.append(f"  {op} on {device}: auto takes {entry['auto'] or 'none'}")
            for name, reason in entry["reasons"].items():
                state = "accepts" if reason is None else f"refuses: {reason}"
                outside = (
                    "" if name in entry["order"] or reason is not None else " (only when named)"
                )
                lines.append(f"    {name:<10} {state}{outside}")

    lines.append("\nExtensions:")
    for name, ext in data["extensions"].items():
        detail = ext["reason"] or ext["path"]
        lines.append(f"  {name:<44} {ext['state']}" + (f": {detail}" if detail else ""))
    if data["build_summary"]:
        lines.append(f"  last build: {data['build_summary']}")

    if data["cuda_resources"] and not kernels:
        lines.append(
            "\nCUDA module, static resources (ptxas; `python -m kvattn.env --kernels` "
            "lists every kernel):"
        )
        lines += _selection_lines(data)
        for arch in sorted({r["arch"] for r in data["cuda_resources"]}):
            rows = [r for r in data["cuda_resources"] if r["arch"] == arch]
            spilling = sum(r["spill_stores"] + r["spill_loads"] > 0 for r in rows)
            lines.append(
                f"  {arch}: {len(rows)} kernels, at most "
                f"{max(r['registers'] for r in rows)} registers, "
                f"{max(r['smem_static'] for r in rows)} bytes of static shared memory, "
                f"{max(r['stack_frame'] for r in rows)} bytes of stack; "
                f"{spilling} kernel(s) spill"
            )
    elif data["cuda_resources"]:
        lines.append(
            "\nCUDA module, static resources per kernel (ptxas; registers, static shared "
            "memory bytes, stack frame bytes, spill bytes):"
        )
        lines += _selection_lines(data)
        lines.append(
            f"  {'kernel':<48} {'arch':<6} {'regs':>4} {'smem':>6} {'stack':>5} {'spill':>5}"
        )
        for r in data["cuda_resources"]:
            spill = r["spill_stores"] + r["spill_loads"]
            lines.append(
                f"  {_kernel_name(r['kernel'])[:48]:<48} {r['arch']:<6} {r['registers']:>4} "
                f"{r['smem_static']:>6} {r['stack_frame']:>5} {spill:>5}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvattn.env", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print the data as JSON")
    parser.add_argument(
        "--kernels", action="store_true", help="list the CUDA module's resources per kernel"
    )
    options = parser.parse_args(argv)
    print(json.dumps(info(), indent=1) if options.json else report(kernels=options.kernels))


if __name__ == "__main__":
    main()

"""Shared pieces of the benchmarks: the device, input generation, byte counts and timing.

Inputs are built so that no cache flatters a kernel: the KV pool of a point holds several
*rotation sets* (each a full batch with its own block table), together at least ``POOL_L2_MULTIPLE``
times the L2 size, physical pages are a random permutation of an oversized pool, and every call
uses the next set. Slots no sequence may read (tails of last pages, unused pages) hold NaN, so a
provider that reads them fails the correctness check that precedes every timing.
"""
from __future__ import annotations

import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvattn  # noqa: E402

POOL_L2_MULTIPLE = 4
SLACK_PAGES = 0.25  # unused pages in the pool, on top of the rotation sets, as a fraction
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Largest |out - ref| accepted against the float32 reference: a few units of the dtype's epsilon
# times max|v| (randn values, |v| <= ~5), as in tests/util.py.
MAX_ABS_ERR = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 6e-2}
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Point:
    """One decode problem: ``batch`` sequences of ``context`` tokens each (uniform lengths)."""

    batch: int
    context: int
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def elt(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8

    def kv_set_bytes(self) -> int:
        """Bytes of K and V one rotation set occupies in the pool (whole pages)."""
        return 2 * self.batch * self.pages_per_seq * self.page_size * self.num_kv_heads * \
            self.head_dim * self.elt

    def label(self) -> str:
        return (f"B{self.batch}_ctx{self.context}_p{self.page_size}_h{self.num_heads}x"
                f"{self.num_kv_heads}_d{self.head_dim}_{self.dtype}")


def bytes_moved(p: Point, checked: bool) -> dict[str, int]:
    """The fewest bytes a decode call must move through device memory, by part.

    K/V: only the slots the sequences read (``context`` tokens each, not whole pages). Q is read and
    O written once. The block table: the entries read. Checked calls also read one tag per page
    read and the ``[B]`` expected owners, and write the report (counters and per-page reasons).
    Split-KV partial results are an implementation choice and are not counted.
    """
    tokens = p.batch * p.context
    pages = p.batch * p.pages_per_seq
    parts = {
        "kv": 2 * tokens * p.num_kv_heads * p.head_dim * p.elt,
        "qo": 2 * p.batch * p.num_heads * p.head_dim * p.elt,
        "table": pages * 4 + p.batch * 4,  # block table + seq_lens
        "tags": (pages * 8 + p.batch * 8 + pages * 1 + 4 * p.batch * 4) if checked else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


@dataclass
class Device:
    name: str
    slug: str
    is_gpu: bool
    l2_bytes: int
    memory_bytes: int
    sm_count: int

    @classmethod
    def current(cls) -> "Device":
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            name = prop.name
            return cls(name, _slug(name), True, int(getattr(prop, "L2_cache_size", 50 << 20)),
                       int(prop.total_memory), int(prop.multi_processor_count))
        name = _cpu_name()
        return cls(name, "cpu", False, 8 << 20, 0, os.cpu_count() or 1)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.is_gpu else "cpu")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


def git_commit() -> str:
    """Short commit of the working tree (``-dirty`` when it differs), ``KVATTN_COMMIT`` when git
    cannot tell (a copy of the tree without ``.git``), else ``unknown``."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KVATTN_COMMIT", "unknown")


def versions() -> dict[str, str]:
    import triton
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "triton": triton.__version__, "kvattn": kvattn.__version__,
         "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
    return v


@dataclass
class DecodeInputs:
    """A pool holding ``len(tables)`` rotation sets of one point, and everything a call needs."""

    point: Point
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_tags: torch.Tensor
    tables: list[torch.Tensor]  # per set: [B, pages_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32, shared by every set
    expected: list[torch.Tensor]  # per set: [B] int64
    scale: float

    @property
    def sets(self) -> int:
        return len(self.tables)

    def pool_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def args(self, i: int) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.tables[i], self.seq_lens, self.page_tags,
                self.expected[i])


def rotation_sets(p: Point, l2_bytes: int, max_sets: int = 32) -> int:
    """How many independent batches the pool holds so that together they span
    ``POOL_L2_MULTIPLE`` times the L2 (one when a batch alone is that large)."""
    return max(1, min(max_sets, math.ceil(POOL_L2_MULTIPLE * l2_bytes / p.kv_set_bytes())))


def make_decode_inputs(p: Point, device: torch.device, sets: int, seed: int = 0) -> DecodeInputs:
    """Rotation sets over a randomly permuted pool; set ``r``'s sequence ``b`` has owner
    ``r * B + b + 1`` and its pages are WRITTEN for it up to ``context`` tokens."""
    dtype = DTYPES[p.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    per_set = p.batch * p.pages_per_seq
    num_pages = sets * per_set + max(1, int(SLACK_PAGES * sets * per_set))
    shape = (num_pages, p.page_size, p.num_kv_heads, p.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    page_tags = torch.zeros(num_pages, dtype=torch.int64, device=device)
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    # Unused pages and the unread tail of every last page hold NaN: reading them shows in the output.
    k_cache[perm[sets * per_set:].long()] = float("nan")
    v_cache[perm[sets * per_set:].long()] = float("nan")
    tail = p.context - (p.pages_per_seq - 1) * p.page_size
    tables, expected = [], []
    for r in range(sets):
        table = perm[r * per_set:(r + 1) * per_set].view(p.batch, p.pages_per_seq)
        owners = torch.arange(r * p.batch + 1, (r + 1) * p.batch + 1, device=device)
        lens = torch.full((p.batch, p.pages_per_seq), p.page_size, device=device)
        lens[:, -1] = tail
        pages = table.reshape(-1).long()
        page_owners = owners[:, None].expand(-1, p.pages_per_seq).reshape(-1).contiguous()
        kvattn.reserve_pages(page_tags, pages, page_owners)
        kvattn.commit_pages(page_tags, pages, page_owners, lens.reshape(-1), p.page_size)
        if tail < p.page_size:
            last = table[:, -1].long()
            k_cache[last, tail:] = float("nan")
            v_cache[last, tail:] = float("nan")
        tables.append(table.contiguous())
        expected.append(owners)
    q = torch.randn(p.batch, p.num_heads, p.head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((p.batch,), p.context, dtype=torch.int32, device=device)
    return DecodeInputs(p, q, k_cache, v_cache, page_tags, tables, seq_lens, expected,
                        p.head_dim ** -0.5)


def reference_output(inp: DecodeInputs, i: int, rows: int) -> torch.Tensor:
    """float32 reference for the first ``rows`` sequences of set ``i`` (sequences are independent,
    so a slice keeps the check cheap at long context)."""
    q, k, v, table, lens, tags, expected = inp.args(i)
    out, report = kvattn.reference.paged_decode(q[:rows], k, v, table[:rows], lens[:rows], tags,
                                                expected[:rows], scale=inp.scale)
    if int(report.violations.sum()) != 0:
        raise RuntimeError(f"benchmark inputs are inconsistent: the reference refused pages "
                           f"({report.summary()})")
    return out


@dataclass
class TimingConfig:
    """``warmup_ms``/``rep_ms``: do_bench's budgets per measurement (GPU). ``cpu_runs``: timed runs
    per measurement on the CPU. ``repeats``: interleaved measurements per provider, for the spread."""

    warmup_ms: float = 10.0
    rep_ms: float = 30.0
    cpu_runs: int = 3
    repeats: int = 3
    graphs: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn, device: torch.device, cfg: TimingConfig) -> float:
    """Median milliseconds of ``fn()``: device events through ``triton.testing.do_bench`` on a GPU
    (it also clears the L2 before every run), the host clock on the CPU."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms,
                                             return_mode="median"))
    fn()
    runs = []
    for _ in range(cfg.cpu_runs):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


class GraphTimer:
    """Captures one CUDA graph that runs a call on every rotation set back to back; a replay's
    median time over the number of sets is the per-call time without launch gaps."""

    def __init__(self, fn_of_set, sets: int, device: torch.device):
        self.sets = sets
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for i in range(sets):
                fn_of_set(i)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(sets):
                fn_of_set(i)
        torch.cuda.synchronize(device)

    def time(self, cfg: TimingConfig) -> float:
        import triton.testing
        ms = triton.testing.do_bench(self.graph.replay, warmup=cfg.warmup_ms, rep=cfg.rep_ms,
                                     return_mode="median")
        return float(ms) / self.sets


def copy_bandwidth(device: Device, cfg: TimingConfig) -> dict:
    """Device-to-device copy of a buffer several times the L2: bytes read plus bytes written over
    the median time. The ceiling the decode kernels are compared with."""
    nbytes = max(8 * device.l2_bytes, (1 << 30) if device.is_gpu else 64 << 20)
    numel = nbytes // 2
    src = torch.randn(numel, device=device.torch_device, dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = time_eager(lambda: dst.copy_(src), device.torch_device, cfg)
    return {"bytes": 2 * numel * 2, "median_ms": ms, "tbps": 2 * numel * 2 / (ms * 1e-3) / 1e12}


def spread_pct(values: list[float]) -> float:
    """(max - min) / median of repeated measurements, in percent."""
    if len(values) < 2:
        return 0.0
    return 100.0 * (max(values) - min(values)) / statistics.median(values)

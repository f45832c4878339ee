"""Shared pieces of the benchmarks: the device, input generation, byte counts and timing.

Inputs are built so that no cache flatters a kernel: the KV pool of a point holds several
*rotation sets* (each a full batch with its own block table), together at least ``POOL_L2_MULTIPLE``
times the L2 size, physical pages are a random permutation of an oversized pool, and every call
uses the next set. Slots no sequence may read (tails of last pages, unused pages) hold NaN, so a
provider that reads them fails the correctness check that precedes every timing.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
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
# times max|v| (randn values, |v| <= ~5), as in tests/kvattn_testing/util.py.
MAX_ABS_ERR = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 6e-2}
REPO = Path(__file__).resolve().parent.parent
FP8_SCALE = 1 / 16  # randn values / 1/16 stay well inside e4m3's +-448


def _bloom_slopes(h: int) -> torch.Tensor:
    """BLOOM's slopes: 2 ** (-8 (i + 1) / H)."""
    return 2.0 ** (-8.0 * torch.arange(1, h + 1) / h)


def _per_sequence(values: torch.Tensor, b: int) -> torch.Tensor:
    """``[b, *values.shape]``: sequence i's row ``values * (1 + i / b)``, each its own."""
    return values * (1 + torch.arange(b).view(-1, *[1] * values.dim()) / b)


# The attention variants the sweeps time (kvattn/variants.py), checked and unchecked alike: name ->
# (window_left, the switch's keyword arguments for H query heads, Hkv KV heads and B sequences).
# Peers run "plain" only.
VARIANTS = {
    "plain": (-1, lambda h, hk, b: {}),
    "window128": (128, lambda h, hk, b: dict(window_left=128)),
    "window256": (256, lambda h, hk, b: dict(window_left=256)),
    "softcap30": (-1, lambda h, hk, b: dict(logits_soft_cap=30.0)),
    "sinks": (-1, lambda h, hk, b: dict(sinks=torch.linspace(-1.0, 1.0, h))),
    "alibi": (-1, lambda h, hk, b: dict(alibi_slopes=_bloom_slopes(h))),
    "alibi-per-seq": (-1, lambda h, hk, b: dict(alibi_slopes=_per_sequence(_bloom_slopes(h), b))),
    "fp8-e4m3": (-1, lambda h, hk, b: dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)),
    # FlashAttention 3's k_descale/v_descale [B, Hkv] over the same pool.
    "fp8-e4m3-per-seq": (
        -1,
        lambda h, hk, b: dict(
            k_scale=_per_sequence(torch.full((hk,), FP8_SCALE), b),
            v_scale=_per_sequence(torch.full((hk,), FP8_SCALE), b),
        ),
    ),
}


# The extend's own variants: their switch depends on the point's shape. "tree": the verify step of
# tree speculative decoding, a custom mask (kvattn.variants) over a binary tree of the chunk's
# draft tokens (node j's parent (j - 1) // 2), each reading the prefix, itself and its ancestors.
EXTEND_VARIANTS = ("tree",)


def tree_mask_rows(prefix: int, chunk: int) -> torch.Tensor:
    """``[chunk, prefix + chunk]`` bool: one sequence's block of the "tree" variant's mask."""
    rows = torch.zeros(chunk, prefix + chunk, dtype=torch.bool)
    rows[:, :prefix] = True
    for j in range(chunk):
        node = j
        while node >= 0:
            rows[j, prefix + node] = True
            node = (node - 1) // 2 if node else -1
    return rows


def variant_kwargs(
    name: str, num_heads: int, device: torch.device, num_kv_heads: int = 1, batch: int = 1
) -> dict:
    """The switches of variant ``name`` as kvattn takes them for ``batch`` sequences, tensors on
    ``device``."""
    if name not in VARIANTS:
        raise ValueError(f"variant: expected one of {list(VARIANTS)}, got {name!r}")
    kwargs = VARIANTS[name][1](num_heads, num_kv_heads, batch)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


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
    variant: str = "plain"
    head_dim_v: int | None = None  # V's own head dim (kvattn.layout), None: head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def elt(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8

    @property
    def kv_elt(self) -> int:
        """Bytes per K/V element in the pool (1 for fp8 pools)."""
        return 1 if self.variant.startswith("fp8") else self.elt

    @property
    def window_left(self) -> int:
        return VARIANTS[self.variant][0]

    def first_page_read(self, first_key: int) -> int:
        """The first logical page a query whose window starts at key ``first_key`` reads."""
        return max(0, first_key) // self.page_size if self.window_left >= 0 else 0

    @property
    def pages_checked(self) -> int:
        """Pages a checked decode of one sequence counts: those its window reaches."""
        return self.pages_per_seq - self.first_page_read(self.context - 1 - self.window_left)

    def kv_set_bytes(self) -> int:
        """Bytes of K and V one rotation set occupies in the pool (whole pages)."""
        return (
            self.batch
            * self.pages_per_seq
            * self.page_size
            * self.num_kv_heads
            * (self.head_dim + self.dv)
            * self.kv_elt
        )

    def label(self) -> str:
        suffix = "" if self.variant == "plain" else f"_{self.variant}"
        return (
            f"B{self.batch}_ctx{self.context}_p{self.page_size}_h{self.num_heads}x"
            f"{self.num_kv_heads}_{dims_label(self)}_{self.dtype}{suffix}"
        )


def dims_label(p) -> str:
    """``d128``, or ``d192x128`` for a V head dim of its own."""
    return f"d{p.head_dim}" + ("" if p.head_dim_v is None else f"x{p.head_dim_v}")


def bytes_moved(p: Point, checked: bool, q_tokens: int | None = None) -> dict[str, int]:
    """The fewest bytes a decode call must move through device memory, by part.

    K/V: only the slots the sequences read (``context`` tokens each, not whole pages), once each.
    Q is read and O written once (a decode window reads its last ``window_left + 1`` keys and their
    pages only; extend counts every key of the sequence). The block table: the entries read.
    Checked calls also read one
    tag per page read and the ``[B]`` expected owners, and write the report (counters and per-page
    reasons). Split-KV partial results are an implementation choice and are not counted.
    ``q_tokens``: an extend call's query rows (default one per sequence, decode); it also reads
    the ``[B + 1]`` row offsets.
    """
    read = (
        p.context
        if p.window_left < 0 or q_tokens is not None
        else min(p.context, p.window_left + 1)
    )
    tokens = p.batch * read
    pages = p.batch * (p.pages_per_seq if q_tokens is not None else p.pages_checked)
    rows = p.batch if q_tokens is None else q_tokens
    offsets = 0 if q_tokens is None else (p.batch + 1) * 4
    parts = {
        "kv": tokens * p.num_kv_heads * (p.head_dim + p.dv) * p.kv_elt,
        "qo": rows * p.num_heads * (p.head_dim + p.dv) * p.elt,  # q as wide as K, out as V
        "table": pages * 4 + p.batch * 4 + offsets,  # block table + seq_lens (+ cu_seqlens_q)
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
    def current(cls) -> Device:
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            name = prop.name
            return cls(
                name,
                _slug(name),
                True,
                int(getattr(prop, "L2_cache_size", 50 << 20)),
                int(prop.total_memory),
                int(prop.multi_processor_count),
            )
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
        sha = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KVATTN_COMMIT", "unknown")


def versions() -> dict[str, str]:
    import triton

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kvattn": kvattn.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
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
    variant: dict = field(default_factory=dict)  # the point's switches, as kvattn takes them

    @property
    def sets(self) -> int:
        return len(self.tables)

    def pool_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def args(self, i: int) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.tables[i],
            self.seq_lens,
            self.page_tags,
            self.expected[i],
        )

    def new_out(self) -> torch.Tensor:
        """An output buffer: ``q``'s rows and heads, V's head dim."""
        return self.q.new_empty(*self.q.shape[:2], self.v_cache.shape[3])


@dataclass(frozen=True)
class ExtendPoint:
    """One extend (chunked prefill) problem: ``batch`` sequences, each with ``prefix`` tokens
    already cached and ``chunk`` new query tokens whose K/V are already appended to the pages, so
    each sequence reads ``prefix + chunk`` tokens (uniform lengths)."""

    batch: int
    chunk: int
    prefix: int
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    variant: str = "plain"
    head_dim_v: int | None = None  # V's own head dim, None: head_dim

    @property
    def context(self) -> int:
        return self.prefix + self.chunk

    @property
    def pages_per_seq(self) -> int:
        return self.pool_point().pages_per_seq

    @property
    def q_tokens(self) -> int:
        return self.batch * self.chunk

    def pool_point(self) -> Point:
        """The decode point whose pool an extend call reads: same sequences, same pages (a plain
        pool under the extend's own variants)."""
        pool_variant = "plain" if self.variant in EXTEND_VARIANTS else self.variant
        return Point(
            self.batch,
            self.context,
            self.page_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            pool_variant,
            self.head_dim_v,
        )

    @property
    def pages_checked(self) -> int:
        """Pages a checked extend of one sequence counts: from its first row's window on."""
        pool = self.pool_point()
        return pool.pages_per_seq - pool.first_page_read(self.prefix - pool.window_left)

    def flops(self) -> int:
        """Causal-aware: query row ``j`` of a chunk (position ``prefix + j``) meets
        ``prefix + j + 1`` keys, 2 FLOPs per element for QK^T (K's head dim) and 2 for PV (V's);
        masked-out work a kernel may still do is not counted."""
        per_pair = 2 * self.batch * self.num_heads * (self.head_dim + self.pool_point().dv)
        pairs = self.chunk * self.prefix + self.chunk * (self.chunk + 1) // 2
        if self.variant == "tree":  # a draft token meets the prefix, itself and its ancestors
            pairs = self.chunk * self.prefix + sum((j + 1).bit_length() for j in range(self.chunk))
            return per_pair * pairs
        window = VARIANTS[self.variant][0]
        if window >= 0:  # row j meets at most window_left + 1 keys
            pairs = sum(min(self.prefix + j + 1, window + 1) for j in range(self.chunk))
        return per_pair * pairs

    def label(self) -> str:
        suffix = "" if self.variant == "plain" else f"_{self.variant}"
        return (
            f"B{self.batch}_q{self.chunk}_pre{self.prefix}_p{self.page_size}_h{self.num_heads}x"
            f"{self.num_kv_heads}_{dims_label(self)}_{self.dtype}{suffix}"
        )


@dataclass
class ExtendInputs:
    """The pool of the decode inputs of ``point.pool_point()`` (same rotation sets, owners, NaN
    poison) and ``chunk`` query rows per sequence: the last ``chunk`` tokens of each sequence."""

    point: ExtendPoint
    pool: DecodeInputs
    q: torch.Tensor  # [B * chunk, H, D]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32

    @property
    def sets(self) -> int:
        return self.pool.sets

    @property
    def scale(self) -> float:
        return self.pool.scale

    def new_out(self) -> torch.Tensor:
        """An output buffer: ``q``'s rows and heads, V's head dim."""
        return self.q.new_empty(*self.q.shape[:2], self.pool.v_cache.shape[3])

    def pool_bytes(self) -> int:
        return self.pool.pool_bytes()

    custom_mask: torch.Tensor | None = None  # the "tree" variant's, for every sequence

    @property
    def variant(self) -> dict:
        if self.custom_mask is None:
            return self.pool.variant
        return dict(self.pool.variant, custom_mask=self.custom_mask)

    def args(self, i: int) -> tuple:
        d = self.pool
        return (
            self.q,
            d.k_cache,
            d.v_cache,
            self.cu_seqlens_q,
            d.tables[i],
            d.seq_lens,
            d.page_tags,
            d.expected[i],
        )


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
    v_cache = torch.randn(*shape[:3], p.dv, generator=gen, device=device, dtype=dtype)
    page_tags = torch.zeros(num_pages, dtype=torch.int64, device=device)
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    # Unused pages and the unread tail of every last page hold NaN: reading them shows in the output.
    k_cache[perm[sets * per_set :].long()] = float("nan")
    v_cache[perm[sets * per_set :].long()] = float("nan")
    tail = p.context - (p.pages_per_seq - 1) * p.page_size
    tables, expected = [], []
    for r in range(sets):
        table = perm[r * per_set : (r + 1) * per_set].view(p.batch, p.pages_per_seq)
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
    variant = variant_kwargs(p.variant, p.num_heads, device, p.num_kv_heads, p.batch)
    if "k_scale" in variant:
        # fp8 pools hold the values divided by FP8_SCALE (NaN stays NaN); per-sequence scales
        # read them back at up to twice that, still within range.
        k_cache = (k_cache.float() / FP8_SCALE).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / FP8_SCALE).to(torch.float8_e4m3fn)
    return DecodeInputs(
        p, q, k_cache, v_cache, page_tags, tables, seq_lens, expected, p.head_dim**-0.5, variant
    )


def make_extend_inputs(
    p: ExtendPoint, device: torch.device, sets: int, seed: int = 0
) -> ExtendInputs:
    pool = make_decode_inputs(p.pool_point(), device, sets, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(
        p.q_tokens, p.num_heads, p.head_dim, generator=gen, device=device, dtype=DTYPES[p.dtype]
    )
    cu = torch.arange(p.batch + 1, dtype=torch.int32, device=device) * p.chunk
    mask = None
    if p.variant == "tree":
        mask = tree_mask_rows(p.prefix, p.chunk).flatten().repeat(p.batch).to(device)
    return ExtendInputs(p, pool, q, cu, mask)


def of_sequences(variant: dict, seqs) -> dict:
    """``variant``'s switches for the sequences ``seqs`` (an index or a slice) alone: the rows of
    its per-sequence values (``[B, ...]``: 2-D), the rest as they are."""
    return {
        k: v[seqs] if isinstance(v, torch.Tensor) and v.dim() == 2 else v
        for k, v in variant.items()
    }


def reference_output(inp: DecodeInputs, i: int, rows: int) -> torch.Tensor:
    """float32 reference for the first ``rows`` sequences of set ``i`` (sequences are independent,
    so a slice keeps the check cheap at long context)."""
    q, k, v, table, lens, tags, expected = inp.args(i)
    out, report = kvattn.reference.paged_decode(
        q[:rows],
        k,
        v,
        table[:rows],
        lens[:rows],
        tags,
        expected[:rows],
        scale=inp.scale,
        **of_sequences(inp.variant, slice(0, rows)),
    )
    if int(report.violations.sum()) != 0:
        raise RuntimeError(
            f"benchmark inputs are inconsistent: the reference refused pages ({report.summary()})"
        )
    return out


def extend_check_rows(p: ExtendPoint, seqs: int) -> list[tuple[int, int]]:
    """(sequence, query row) pairs compared with the reference: every row of tiny chunks, else
    the first, second, middle, second-last and last row and those around a 64-row tile edge, of
    the first ``seqs`` sequences and the last one."""
    if p.chunk <= 32:
        rows = range(p.chunk)
    else:
        rows = sorted({0, 1, 63, 64, p.chunk // 2, p.chunk - 2, p.chunk - 1} & set(range(p.chunk)))
    return [(b, j) for b in sorted(set(range(min(p.batch, seqs))) | {p.batch - 1}) for j in rows]


def extend_reference(inp: ExtendInputs, i: int, picks: list[tuple[int, int]]) -> torch.Tensor:
    """float32 ``kvattn.reference.paged_extend`` for the query rows ``picks`` of set ``i``: each
    row alone is an extend of one query token at its position, so a long chunk is checked on a
    sample without the reference materialising ``chunk x context`` keys."""
    p = inp.point
    q, k, v, _, table, _, tags, expected = inp.args(i)
    dev = q.device
    seqs = torch.tensor([b for b, _ in picks], device=dev)
    rows = torch.tensor([b * p.chunk + j for b, j in picks], device=dev)
    lens = torch.tensor([p.prefix + j + 1 for _, j in picks], dtype=torch.int32, device=dev)
    cu = torch.arange(len(picks) + 1, dtype=torch.int32, device=dev)
    variant = of_sequences(inp.variant, seqs)
    if inp.custom_mask is not None:
        # Row j alone reads its block's row up to its own position.
        block = tree_mask_rows(p.prefix, p.chunk)
        variant = dict(
            variant, custom_mask=torch.cat([block[j, : p.prefix + j + 1] for _, j in picks]).to(dev)
        )
    out, report = kvattn.reference.paged_extend(
        q[rows],
        k,
        v,
        cu,
        table[seqs].contiguous(),
        lens,
        tags,
        expected[seqs],
        scale=inp.scale,
        **variant,
    )
    if int(report.violations.sum()) != 0:
        raise RuntimeError(
            f"benchmark inputs are inconsistent: the reference refused pages ({report.summary()})"
        )
    return out


def check_provider(
    run, out_buf, refs: dict, dtype: str, pages_per_seq: int, rows: torch.Tensor | None = None
) -> float:
    """Run every set in ``refs`` once on a poisoned buffer; raise if the output is off, not
    written, or the report does not prove the check ran (``pages_per_seq``: the pages each
    sequence's check must count, those its window reaches). ``rows`` indexes the output rows
    ``refs`` hold (default: the first ones). Returns the largest error seen."""
    worst = 0.0
    for i, ref in refs.items():
        if out_buf is not None:
            out_buf.fill_(float("nan"))
        out, report = run(i)
        if not torch.isfinite(out).all():
            raise AssertionError(
                f"set {i}: output holds NaN/inf (unwritten rows or foreign slots read)"
            )
        got = out[: ref.shape[0]] if rows is None else out[rows]
        err = float((got.float() - ref).abs().max())
        worst = max(worst, err)
        if err > MAX_ABS_ERR[dtype]:
            raise AssertionError(f"set {i}: max |out - ref| = {err:.3g} > {MAX_ABS_ERR[dtype]:g}")
        if report is not None:
            if int(report.violations.sum()) != 0:
                raise AssertionError(
                    f"set {i}: clean inputs reported violations: {report.summary()}"
                )
            if not bool((report.pages_checked == pages_per_seq).all()):
                raise AssertionError(
                    f"set {i}: pages_checked != {pages_per_seq}: the check did not run"
                )
    return worst


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

        return float(
            triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
        )
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

        ms = triton.testing.do_bench(
            self.graph.replay, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"
        )
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


def matmul_rate(device: Device, cfg: TimingConfig, n: int = 8192) -> dict:
    """bf16 ``n x n x n`` matrix product on random data (GPU only): the ceiling the extend kernels
    are compared with."""
    a = torch.randn(n, n, device=device.torch_device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device.torch_device, dtype=torch.bfloat16)
    ms = time_eager(lambda: a @ b, device.torch_device, cfg)
    return {"n": n, "median_ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def prepare_providers(providers, inp, check, base: dict, log) -> tuple[list[dict], list[tuple]]:
    """Ask each provider whether it runs ``inp``, build it and pass it through ``check(run,
    out_buf)``. Returns the rows of providers not run (skipped or failed, never timed) and the
    ``(provider, run, row)`` of the others."""
    rows, live = [], []
    for prov in providers:
        row = dict(base, provider=prov.name, family=prov.family, checked=prov.checked)
        try:
            reason = prov.why_not(inp)
            if reason is not None:
                rows.append(dict(row, status=f"skipped: {reason}"))
                continue
            run, out_buf = prov.build(inp)
            err = check(run, out_buf)
        except Exception as e:  # a provider that fails is reported, never timed
            rows.append(dict(row, status=f"failed: {type(e).__name__}: {e}"[:300]))
            log(f"  {prov.name}: {rows[-1]['status']}")
            continue
        live.append((prov, run, dict(row, status="ok", max_abs_err=err)))
    return rows, live


def check_and_measure(
    providers,
    inp,
    check,
    base: dict,
    device: Device,
    cfg: TimingConfig,
    columns,
    log,
    deadline: float | None = None,
) -> list[dict]:
    """:func:`prepare_providers`, then :func:`measure` of those that passed, over ``inp``'s
    rotation sets: the rows of one point."""
    rows, live = prepare_providers(providers, inp, check, base, log)
    synchronize(device.torch_device)
    return rows + measure(live, inp.sets, device, cfg, columns, deadline, log)


def measurement_seconds(call_s: float, sets: int, device: Device, cfg: TimingConfig) -> float:
    """What timing one provider costs: per repeat and mode do_bench's budgets (at least a few calls
    each), a graph capture over every set, doubled for host overhead."""
    modes = 2 if device.is_gpu and cfg.graphs else 1
    per = max(cfg.warmup_ms / 1e3, call_s) + max(cfg.rep_ms / 1e3, 5 * call_s)
    return 2 * (cfg.repeats * modes * per + (2 * sets * call_s if modes == 2 else 0))


def size_by_first_call(
    live, sets: int, device: Device, cfg: TimingConfig, deadline: float | None, log
) -> tuple[list, list[dict]]:
    """Times one call of each provider; a provider whose measurement would end past ``deadline``
    (monotonic seconds) is not timed and says why. Returns ``(kept, skipped rows)``."""
    if deadline is None:
        return live, []
    dev = device.torch_device
    kept, skipped = [], []
    for prov, run, row in live:
        t0 = time.monotonic()
        run(0)
        synchronize(dev)
        call_s = time.monotonic() - t0
        need = measurement_seconds(call_s, sets, device, cfg)
        if time.monotonic() + need > deadline:
            skipped.append(
                dict(
                    row,
                    status=f"skipped: time budget (one call {call_s * 1e3:.2f} ms, "
                    f"about {need:.0f} s to time)",
                )
            )
            log(f"  {prov.name}: {skipped[-1]['status']}")
        else:
            kept.append((prov, run, row))
    return kept, skipped


def rotating(run, sets: int):
    counter = itertools.count()
    return lambda: run(next(counter) % sets)


def measure(
    live,
    sets: int,
    device: Device,
    cfg: TimingConfig,
    columns,
    deadline: float | None = None,
    log=print,
) -> list[dict]:
    """Interleaved repeats of every live provider, in eager mode and, on a GPU, from a CUDA graph
    over all rotation sets. ``columns(provider, median_ms)`` adds the figures derived from the time.
    Providers whose first call says they cannot be timed before ``deadline`` are skipped
    (:func:`size_by_first_call`). Returns skips and graph-capture failures, then one row per
    (mode, provider) with the checked/unchecked ratios filled in."""
    dev = device.torch_device
    live, failed = size_by_first_call(live, sets, device, cfg, deadline, log)
    modes = {"eager": {prov.name: rotating(run, sets) for prov, run, _ in live}}
    if device.is_gpu and cfg.graphs:
        modes["graph"] = {}
        for prov, run, row in live:
            try:
                modes["graph"][prov.name] = GraphTimer(lambda i, run=run: run(i), sets, dev).time
            except Exception as e:  # capture is not supported by every provider
                failed.append(dict(row, mode="graph", status=f"failed: graph capture: {e}"[:300]))
    out_rows = []
    for mode, fns in modes.items():
        label = mode if device.is_gpu else "cpu"
        times = {name: [] for name in fns}
        for r in range(cfg.repeats):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                times[name].append(
                    fns[name](cfg) if mode == "graph" else time_eager(fns[name], dev, cfg)
                )
        mode_rows = []
        for prov, _, row in live:
            if prov.name not in times:
                continue
            ts = times[prov.name]
            med = statistics.median(ts)
            mode_rows.append(
                dict(
                    row,
                    mode=label,
                    median_ms=med,
                    spread_pct=spread_pct(ts),
                    repeats=len(ts),
                    **columns(prov, med),
                    times_ms=ts,
                )
            )
        add_ratios(mode_rows)
        out_rows += mode_rows
    return failed + out_rows


def bandwidth_columns(nbytes: dict[str, int], median_ms: float, copy_tbps: float) -> dict:
    tbps = nbytes["total"] / (median_ms * 1e-3) / 1e12
    return dict(
        kv_bytes=nbytes["kv"],
        other_bytes=nbytes["total"] - nbytes["kv"],
        total_bytes=nbytes["total"],
        tbps=tbps,
        pct_copy_bw=100 * tbps / copy_tbps,
    )


def add_ratios(rows: list[dict]) -> None:
    """checked / unchecked per interleaved repeat, on each checked row of a family (the per-call
    check and the read through a verdict of kvattn's Triton kernel share one unchecked twin)."""
    unchecked = {r["family"]: r for r in rows if not r["checked"]}
    for row in rows:
        twin = unchecked.get(row["family"])
        if row["checked"] and twin is not None:
            ratios = [c / u for c, u in zip(row["times_ms"], twin["times_ms"])]
            row.update(
                ratio_vs_unchecked=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
            )


def spread_pct(values: list[float]) -> float:
    """(max - min) / median of repeated measurements, in percent."""
    if len(values) < 2:
        return 0.0
    return 100.0 * (max(values) - min(values)) / statistics.median(values)


@dataclass(frozen=True)
class MLAPoint:
    """One MLA problem: ``batch`` sequences of ``context`` tokens, ``num_heads`` query heads
    reading one latent row of ``kv_lora_rank + rope_dim`` dims per token; ``q_len`` new query rows
    per sequence, its last tokens (1: decode, :func:`kvattn.paged_mla_decode`; more: the causal
    MLA extend, :func:`kvattn.paged_mla_extend`, as in speculative verify or chunked prefill)."""

    batch: int
    context: int
    page_size: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    q_len: int = 1

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def elt(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8

    def kv_set_bytes(self) -> int:
        """Bytes of latent rows one rotation set occupies in the pool (whole pages)."""
        return self.batch * self.pages_per_seq * self.page_size * self.head_dim * self.elt

    def label(self) -> str:
        rows = f"_q{self.q_len}" if self.q_len > 1 else ""
        return (
            f"B{self.batch}_ctx{self.context}{rows}_p{self.page_size}_h{self.num_heads}_"
            f"mla{self.kv_lora_rank}+{self.rope_dim}_{self.dtype}"
        )


def mla_bytes_moved(p: MLAPoint, checked: bool) -> dict[str, int]:
    """The fewest bytes an MLA call must move, by part: each latent row read once (the kernel's
    re-reads of a row for further head blocks and query tiles come from L2 and are not counted),
    each query row's Q (``kv_lora_rank + rope_dim`` dims) read and O (``kv_lora_rank``) written
    once, and the index and report bytes of :func:`bytes_moved`."""
    pages = p.batch * p.pages_per_seq
    parts = {
        "kv": p.batch * p.context * p.head_dim * p.elt,
        "qo": p.batch * p.q_len * p.num_heads * (p.head_dim + p.kv_lora_rank) * p.elt,
        "table": pages * 4 + p.batch * 4,
        "tags": (pages * 8 + p.batch * 8 + pages * 1 + 4 * p.batch * 4) if checked else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


@dataclass
class MLAInputs:
    """A latent pool holding ``len(tables)`` rotation sets of one MLA point."""

    point: MLAPoint
    q: torch.Tensor
    kv_cache: torch.Tensor
    page_tags: torch.Tensor
    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    expected: list[torch.Tensor]
    scale: float
    cu_seqlens_q: torch.Tensor

    @property
    def sets(self) -> int:
        return len(self.tables)

    def pool_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def validated(self, i: int = 0):
        """Set ``i``'s call as the registry judges it (unvalidated values, as on a GPU)."""
        p = self.point
        if p.q_len == 1:
            return kvattn.layout.validate_mla_decode(
                *self._args(i), kv_lora_rank=p.kv_lora_rank, scale=self.scale, validate=False
            )
        return kvattn.layout.validate_mla_extend(
            *self._args(i), kv_lora_rank=p.kv_lora_rank, scale=self.scale, validate=False
        )

    def call(self, i: int, rows: int | None = None, **kwargs):
        """Set ``i``'s call (``kwargs``: backend, check, out, ...): the MLA decode, or the MLA
        extend when the point has several query rows; ``rows``: the first sequences only."""
        p = self.point
        fn = kvattn.paged_mla_decode if p.q_len == 1 else kvattn.paged_mla_extend
        return fn(*self._args(i, rows), kv_lora_rank=p.kv_lora_rank, scale=self.scale, **kwargs)

    def _args(self, i: int, rows: int | None = None) -> tuple:
        rows = self.point.batch if rows is None else rows
        q, cu = self.q[: rows * self.point.q_len], self.cu_seqlens_q[: rows + 1]
        index = (
            self.tables[i][:rows],
            self.seq_lens[:rows],
            self.page_tags,
            self.expected[i][:rows],
        )
        if self.point.q_len == 1:
            return (q, self.kv_cache, *index)
        return (q, self.kv_cache, cu, *index)


def make_mla_inputs(p: MLAPoint, device: torch.device, sets: int, seed: int = 0) -> MLAInputs:
    """The decode pool of :func:`make_decode_inputs` (rotation sets, permuted pages, NaN in every
    slot no sequence reads, committed tags) with one latent pool ``[num_pages, page_size, 1,
    kv_lora_rank + rope_dim]``, and ``q_len`` query rows per sequence; the scale is FlashMLA's
    default, ``head_dim ** -0.5``."""
    decode_point = Point(p.batch, p.context, p.page_size, p.num_heads, 1, p.head_dim, p.dtype)
    d = make_decode_inputs(decode_point, device, sets, seed)
    q = d.q
    if p.q_len > 1:
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        q = torch.randn(
            p.batch * p.q_len,
            p.num_heads,
            p.head_dim,
            generator=gen,
            device=device,
            dtype=DTYPES[p.dtype],
        )
    cu = torch.arange(p.batch + 1, dtype=torch.int32, device=device) * p.q_len
    return MLAInputs(p, q, d.k_cache, d.page_tags, d.tables, d.seq_lens, d.expected, d.scale, cu)


def mla_reference_output(inp: MLAInputs, i: int, rows: int) -> torch.Tensor:
    """float32 reference for the first ``rows`` sequences of set ``i`` (their query rows)."""
    out, report = inp.call(i, rows, backend="reference")
    if int(report.violations.sum()) != 0:
        raise RuntimeError(
            f"benchmark inputs are inconsistent: the reference refused pages ({report.summary()})"
        )
    return out

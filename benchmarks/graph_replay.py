"""kvattn's ops captured in one CUDA graph and replayed with the ledger's buffer refill between
replays, against eager runs of the same steps; a violation caught on replay; a skipped refill that
fails closed.

    python -m benchmarks.graph_replay [--device cuda|cpu] [--preset tiny|gpu] [--steps N]
        [--time-budget-s S] [--backend B] [--out-dir DIR] [--stream FILE]

A forward of a few layers is what an engine's decode graph holds: per layer, the stamping write of
the batch's new tokens (``Step.write``: ``kvattn.write_kv`` with the per-token owners) and the
checked decode (``Step.attend``: ``kvattn.paged_decode`` with ``validate=False``, reading the
step's verdict, ``kvattn.resolve_pages``, resolved at the first layer; docs/ownership.md section
9). Its inputs are the fixed buffers of :class:`kvattn.integrations.ledger.GraphBuffers` (block
table, expected owners, lengths, per-token owners, report sums) and fixed query/K/V/slot/output
tensors. On CUDA the forward is warmed up, captured once in a ``torch.cuda.CUDAGraph`` of
``batch`` rows (the last row padding) and replayed; on a CPU there is no capture and a "replay"
runs the same Python on the same buffers (what the kernels would read), so the checks run here.

Two copies of the same pools, tags and requests advance in lockstep: the graph world (refill with
``Ledger.fill_graph_step``, copy the step's inputs into the fixed tensors, replay, read the report
with ``Ledger.finish``, which poisons the owners to 0) and the eager world (``Ledger.start_step``
and the same layers on fresh tensors). The checks, each a row of ``rows.jsonl``:

- ``clean``: decode steps (requests crossing page boundaries, pages reserved between replays):
  outputs, reports, tags and pools of the graph world bit for bit those of the eager world (same
  kernels, same launch shapes), every live row within ``MAX_ABS_ERR`` of a float32 attention over
  its tokens, the padded row 0, nothing refused; replay and eager timed per step (GPU only: host
  clock from the refill, or from ``start_step``, to the device's end).
- ``foreign_page``: between replays a page of request A (its first) is released, reserved for
  request B and written by B with K = 1e4 and V = NaN, A's table unchanged: A alone is reported
  (one refused page per layer, ``finish`` names A and logical page 0), A's output finite and
  within tolerance of the attention over its tokens without that page, the others clean, the
  graph world bit for bit the eager one.
- ``stale_buffer``: the next replay with the refill skipped on purpose (owners still 0 from the
  last ``finish``): outputs exactly 0, every live row refused and its write dropped, tags and
  pools unchanged bit for bit, ``finish`` names every live request.
- ``refilled``: the twin, refilled (A gone): clean again, bit for bit the eager world.

Exits 1 when a check fails (or the capture raised). Writes a run folder
``<stamp>_<device>_<commit>_graph-replay/`` (``rows.jsonl``, ``summary.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvattn  # noqa: E402
from kvattn.integrations.ledger import Ledger  # noqa: E402
from kvattn.tags import new_owner_id  # noqa: E402

from .common import DTYPES, MAX_ABS_ERR, Device, git_commit, versions  # noqa: E402
from .sweep import CPU_LABEL, RESULTS, append_rows  # noqa: E402

OP = "graph_replay"
POISON_K = 1e4  # fits float16: a read of the foreign page would dominate the softmax


@dataclass(frozen=True)
class Shape:
    layers: int
    batch: int  # rows of the captured graph; the rows past the requests are padding
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    contexts: tuple[int, ...]  # prompt tokens per request; request 0 is the one faulted
    dtype: str
    max_steps: int  # clean decode steps (the time budget may stop them earlier)


PRESETS = {
    # Request 0 starts on a page boundary (a page reserved between the first replays) and holds 3
    # pages at the fault, so its first page is not the one its new token goes to.
    "tiny": Shape(2, 3, 2, 1, 16, 4, (8, 6), "fp32", 3),
    "gpu": Shape(4, 8, 32, 8, 128, 16, (4000, 3100, 2500, 1900, 1200, 700, 300), "bf16", 48),
}
SPARE_PAGES = 8
FAULT_STEPS = 3  # foreign page, stale buffer, refilled: what the clean loop leaves time for


def _int_view(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included, where ``torch.equal`` says no)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_int_view(a), _int_view(b))


@dataclass
class Request:
    key: str
    owner: int
    pages: list[int]
    length: int  # tokens written


@dataclass
class Inputs:
    """One decode step as the host plans it: ``n`` live rows of the ``batch`` rows."""

    keys: list[str]
    owners: list[int]
    table: torch.Tensor  # [n, W] int32, on the host
    expected: torch.Tensor  # [n, W] int64, on the host
    seq_lens: list[int]  # the new token included
    slots: torch.Tensor  # [batch] int64, -1 on padded rows
    q: torch.Tensor  # [L, batch, H, D]
    k: torch.Tensor  # [L, batch, KVH, D]
    v: torch.Tensor  # [L, batch, KVH, D]


class World:
    """One ledger, its tags and pools; the forward a graph captures."""

    def __init__(self, shape: Shape, device, backend: str, num_pages: int):
        self.shape = shape
        self.ledger = Ledger(shape.page_size, backend=backend)
        self.ledger.allocate_tags(shape.layers, num_pages, device)
        dtype = DTYPES[shape.dtype]
        size = (num_pages, shape.page_size, shape.kv_heads, shape.head_dim)
        # NaN wherever nothing was written: a read of a slot no tag certifies shows in the output.
        self.k = [
            torch.full(size, float("nan"), dtype=dtype, device=device) for _ in range(shape.layers)
        ]
        self.v = [
            torch.full(size, float("nan"), dtype=dtype, device=device) for _ in range(shape.layers)
        ]
        self.scale = shape.head_dim**-0.5

    def forward(self, step, q, k, v, slots, out) -> None:
        tags = self.ledger.tags
        for layer in range(self.shape.layers):
            name = f"layer {layer}"
            step.write(name, k[layer], v[layer], self.k[layer], self.v[layer], slots, tags[layer])
            step.attend(
                name,
                q[layer],
                self.k[layer],
                self.v[layer],
                tags[layer],
                scale=self.scale,
                out=out[layer],
            )

    def write(self, slots: torch.Tensor, owners: torch.Tensor, k, v) -> None:
        """Tokens written outside a forward (a prompt, a page's poison), every layer; ``k``/``v``
        ``[L, T, KVH, D]``."""
        for layer in range(self.shape.layers):
            kvattn.write_kv(
                k[layer],
                v[layer],
                self.k[layer],
                self.v[layer],
                slots,
                self.ledger.tags[layer],
                owners,
            )

    def state(self) -> list[torch.Tensor]:
        return [self.ledger.tags, *self.k, *self.v]


class GraphWorld(World):
    """The world whose decode forwards replay one captured graph over fixed buffers."""

    def __init__(self, shape: Shape, device, backend: str, num_pages: int, width: int):
        super().__init__(shape, device, backend, num_pages)
        s, b = shape, shape.batch
        self.q = torch.zeros(s.layers, b, s.heads, s.head_dim, dtype=DTYPES[s.dtype], device=device)
        self.k_new = torch.zeros(
            s.layers, b, s.kv_heads, s.head_dim, dtype=self.q.dtype, device=device
        )
        self.v_new = torch.zeros_like(self.k_new)
        self.slots = torch.zeros(b, dtype=torch.int64, device=device)
        self.out = torch.zeros_like(self.q)
        self.ledger.allocate_graph(b, width, device)
        self.step = self.ledger.capture_graph_step(b)
        self.graph = None

    def body(self) -> None:
        """What the graph holds: the step's sums zeroed, then every layer."""
        self.ledger.graph_run()
        self.forward(self.step, self.q, self.k_new, self.v_new, self.slots, self.out)

    def capture(self) -> None:
        if self.q.device.type != "cuda":
            return
        stream = torch.cuda.Stream(self.q.device)
        stream.wait_stream(torch.cuda.current_stream(self.q.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles outside the capture
                self.body()
        torch.cuda.current_stream(self.q.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.body()
        torch.cuda.synchronize(self.q.device)

    def fill(self, inp: Inputs) -> None:
        self.ledger.fill_graph_step(
            self.shape.batch, inp.keys, inp.owners, inp.table, inp.expected, inp.seq_lens
        )
        self.load(inp)

    def load(self, inp: Inputs) -> None:
        self.q.copy_(inp.q)
        self.k_new.copy_(inp.k)
        self.v_new.copy_(inp.v)
        self.slots.copy_(inp.slots)

    def replay(self) -> None:
        # Whatever the host did since, the replayed kernels read the step their capture recorded.
        self.ledger.steps[0] = self.step
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention(world: World, layer: int, q, pages, seq_len: int, skip=()) -> torch.Tensor:
    """Float32 softmax attention of ``q`` ``[H, D]`` over the first ``seq_len`` tokens of
    ``pages``, leaving out the pages in ``skip``; ``[H, D]``."""
    s = world.shape
    keys, values = [], []
    for i, page in enumerate(pages):
        n = min(s.page_size, seq_len - i * s.page_size)
        if n <= 0:
            break
        if page not in skip:
            keys.append(world.k[layer][page, :n])
            values.append(world.v[layer][page, :n])
    if not keys:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = s.heads // s.kv_heads
    k = torch.cat(keys).float().repeat_interleave(group, dim=1)  # [T, H, D]
    v = torch.cat(values).float().repeat_interleave(group, dim=1)
    weights = (torch.einsum("hd,thd->ht", q.float(), k) * world.scale).softmax(-1)
    return torch.einsum("ht,thd->hd", weights, v)


class Scenario:
    def __init__(self, shape: Shape, device: torch.device, backend: str, seed: int = 0):
        self.shape, self.device = shape, device
        s = shape
        if not 0 < len(s.contexts) < s.batch:
            raise ValueError(
                f"contexts: expected 1 to {s.batch - 1} requests (one row of the {s.batch} is "
                f"padding), got {len(s.contexts)}"
            )
        if len(s.contexts) < 2 or s.contexts[0] < 2 * s.page_size:
            raise ValueError(
                "contexts: expected two requests or more, the first over two pages (the fault "
                f"re-tags its first page), got {s.contexts} with pages of {s.page_size}"
            )
        grown = [c + s.max_steps + FAULT_STEPS for c in s.contexts]
        self.width = -(-max(grown) // s.page_size)
        num_pages = sum(-(-c // s.page_size) for c in grown) + SPARE_PAGES
        self.gen = torch.Generator(device=device).manual_seed(seed)
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.free = order  # pages scattered over the pool
        self.graph = GraphWorld(s, device, backend, num_pages, self.width)
        self.eager = World(s, device, backend, num_pages)
        self.worlds = (self.graph, self.eager)
        self.requests = [Request(f"r{i}", new_owner_id(), [], 0) for i in range(len(s.contexts))]
        self.tol = MAX_ABS_ERR[s.dtype]
        self._prefill()

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device).to(
            DTYPES[self.shape.dtype]
        )

    def _reserve(self, request: Request, count: int) -> None:
        pages = [self.free.pop() for _ in range(count)]
        request.pages += pages
        for world in self.worlds:
            world.ledger.reserve(pages, request.owner)

    def _prefill(self) -> None:
        s = self.shape
        slots, owners = [], []
        for request, context in zip(self.requests, s.contexts):
            self._reserve(request, -(-context // s.page_size))
            for t in range(context):
                slots.append(request.pages[t // s.page_size] * s.page_size + t % s.page_size)
            owners += [request.owner] * context
            request.length = context
        slots_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
        owners_t = torch.tensor(owners, dtype=torch.int64, device=self.device)
        k = self._randn(s.layers, len(slots), s.kv_heads, s.head_dim)
        v = self._randn(s.layers, len(slots), s.kv_heads, s.head_dim)
        for world in self.worlds:
            world.write(slots_t, owners_t, k, v)

    def plan(self, requests: list[Request]) -> Inputs:
        """The next decode step of ``requests`` (pages reserved where a token starts one)."""
        s, n = self.shape, len(requests)
        table = torch.full((n, self.width), -1, dtype=torch.int32)
        expected = torch.zeros(n, self.width, dtype=torch.int64)
        slots = torch.full((s.batch,), -1, dtype=torch.int64)
        for row, r in enumerate(requests):
            if r.length % s.page_size == 0:
                self._reserve(r, 1)
            table[row, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
            expected[row, : len(r.pages)] = r.owner
            slots[row] = r.pages[r.length // s.page_size] * s.page_size + r.length % s.page_size
        return Inputs(
            keys=[r.key for r in requests],
            owners=[r.owner for r in requests],
            table=table,
            expected=expected,
            seq_lens=[r.length + 1 for r in requests],
            slots=slots.to(self.device),
            q=self._randn(s.layers, s.batch, s.heads, s.head_dim),
            k=self._randn(s.layers, s.batch, s.kv_heads, s.head_dim),
            v=self._randn(s.layers, s.batch, s.kv_heads, s.head_dim),
        )

    def run_graph(self, inp: Inputs, refill: bool = True) -> tuple[dict, dict]:
        """Refill (or not), replay, read the report: ``(failed requests, timings)``."""
        g = self.graph
        t0 = time.perf_counter()
        if refill:
            g.fill(inp)
        else:
            g.load(inp)
        t1 = time.perf_counter()
        g.replay()
        _sync(self.device)
        t2 = time.perf_counter()
        failed = g.ledger.finish()
        return failed, dict(fill_ms=(t1 - t0) * 1e3, replay_ms=(t2 - t0) * 1e3)

    def run_eager(self, inp: Inputs) -> tuple[torch.Tensor, dict, float]:
        s, n = self.shape, len(inp.keys)
        pad = s.batch - n
        table = torch.full((s.batch, self.width), -1, dtype=torch.int32)
        table[:n] = inp.table
        expected = torch.zeros(s.batch, self.width, dtype=torch.int64)
        expected[:n] = inp.expected
        t0 = time.perf_counter()
        step = self.eager.ledger.start_step(
            inp.keys + [None] * pad,
            inp.owners + [0] * pad,
            [1] * s.batch,
            table.to(self.device),
            expected,
            inp.seq_lens + [0] * pad,
        )
        out = torch.empty_like(inp.q)
        self.eager.forward(step, inp.q, inp.k, inp.v, inp.slots, out)
        _sync(self.device)
        eager_ms = (time.perf_counter() - t0) * 1e3
        return out, self.eager.ledger.finish(), eager_ms

    def advance(self, requests: list[Request]) -> None:
        for r in requests:
            r.length += 1

    def reference_error(self, inp: Inputs, out: torch.Tensor, skip: dict) -> float:
        """Largest gap of each live row (every layer) to :func:`attention` over its tokens, less
        the pages ``skip[row]``; inf where an output is not finite."""
        worst = 0.0
        for row in range(len(inp.keys)):
            pages = inp.table[row][inp.table[row] >= 0].tolist()
            for layer in range(self.shape.layers):
                got = out[layer, row]
                if not torch.isfinite(got).all():
                    return float("inf")
                ref = attention(
                    self.graph,
                    layer,
                    inp.q[layer, row],
                    pages,
                    inp.seq_lens[row],
                    skip.get(row, ()),
                )
                gap = float((got.float() - ref).abs().max())
                # max() would keep the old value over a NaN gap (a poisoned reference).
                worst = max(worst, gap if gap == gap else float("inf"))
        return worst

    def compare(self, inp: Inputs, eager_out, problems: list[str]) -> dict:
        """The graph world against the eager one after the same step."""
        n, g = len(inp.keys), self.graph
        out_same = same_bits(g.out[:, :n], eager_out[:, :n])
        if not out_same:
            problems.append(
                "replay output differs from eager by "
                f"{float((g.out[:, :n].float() - eager_out[:, :n].float()).abs().max()):.3g}"
            )
        if torch.count_nonzero(g.out[:, n:]):
            problems.append("a padded row's output is not 0")
        state_same = all(same_bits(a, b) for a, b in zip(g.state(), self.eager.state()))
        if not state_same:
            problems.append("tags or pools differ from eager after the step")
        return dict(output_bitwise=out_same, state_bitwise=state_same)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def check_clean(sc: Scenario, deadline: float) -> dict:
    problems: list[str] = []
    times: dict[str, list[float]] = dict(fill_ms=[], replay_ms=[], eager_ms=[])
    worst_ref, steps, bitwise = 0.0, 0, True
    step_s: list[float] = []
    live = sc.requests
    while steps < sc.shape.max_steps:
        reserve = (FAULT_STEPS + 1) * (max(step_s) if step_s else 0.0)
        if steps >= 2 and time.monotonic() + reserve > deadline:
            break
        t0 = time.monotonic()
        inp = sc.plan(live)
        failed, timing = sc.run_graph(inp)
        eager_out, eager_failed, eager_ms = sc.run_eager(inp)
        sc.advance(live)
        for key, value in (*timing.items(), ("eager_ms", eager_ms)):
            times[key].append(value)
        if failed or eager_failed:
            problems.append(
                f"step {steps}: requests failed: {sorted(failed)} {sorted(eager_failed)}"
            )
        refused = sc.graph.step.refused
        if torch.count_nonzero(refused) or torch.count_nonzero(sc.graph.step.dropped):
            problems.append(f"step {steps}: pages refused or writes dropped: {refused.tolist()}")
        same = sc.compare(inp, eager_out, problems)
        bitwise = bitwise and same["output_bitwise"] and same["state_bitwise"]
        worst_ref = max(worst_ref, sc.reference_error(inp, sc.graph.out, {}))
        steps += 1
        step_s.append(time.monotonic() - t0)
    if worst_ref > sc.tol:
        problems.append(f"output {worst_ref:.3g} from the float32 attention (tolerance {sc.tol})")
    row = dict(check="clean", steps=steps, bitwise_equal_eager=bitwise, max_abs_err_ref=worst_ref)
    if sc.graph.graph is not None:
        # The first replay and eager step pay one-off costs (allocator, caches): the median.
        medians = {key: _median(values) for key, values in times.items()}
        row.update(medians)
        row["eager_over_replay"] = medians["eager_ms"] / medians["replay_ms"]
    return dict(row, problems=problems)


def check_foreign_page(sc: Scenario) -> dict:
    """Request 0's first page handed to request 1 and poisoned by its write, then a refilled
    replay of every request, request 0's table unchanged."""
    s, problems = sc.shape, []
    victim, thief = sc.requests[0], sc.requests[1]
    page = victim.pages[0]
    slots = torch.arange(page * s.page_size, (page + 1) * s.page_size, device=sc.device)
    shape = (s.layers, s.page_size, s.kv_heads, s.head_dim)
    k = torch.full(shape, POISON_K, dtype=DTYPES[s.dtype], device=sc.device)
    v = torch.full(shape, float("nan"), dtype=DTYPES[s.dtype], device=sc.device)
    owners = torch.full((s.page_size,), thief.owner, dtype=torch.int64, device=sc.device)
    for world in sc.worlds:
        world.ledger.release([page])
        world.ledger.reserve([page], thief.owner)
        world.write(slots, owners, k, v)
    inp = sc.plan(sc.requests)
    failed, _ = sc.run_graph(inp)
    eager_out, eager_failed, _ = sc.run_eager(inp)
    sc.advance(sc.requests)
    refused = sc.graph.step.refused[: len(inp.keys)].tolist()
    if refused != [s.layers] + [0] * (len(inp.keys) - 1):
        problems.append(f"refused pages per row {refused}, expected {s.layers} for row 0 alone")
    if list(failed) != [victim.key] or list(eager_failed) != [victim.key]:
        problems.append(f"failed requests {list(failed)} (eager {list(eager_failed)})")
    elif "OWNER_MISMATCH on logical page(s) 0 (page " not in failed[victim.key][2]:
        problems.append(f"the failure names another page: {failed[victim.key][2]!r}")
    same = sc.compare(inp, eager_out, problems)
    err = sc.reference_error(inp, sc.graph.out, {0: {page}})
    if err > sc.tol:
        problems.append(f"output {err:.3g} from the attention without the foreign page")
    # The poison has teeth: the same attention reading the page is not finite.
    read = attention(
        sc.graph, 0, inp.q[0, 0], inp.table[0][inp.table[0] >= 0].tolist(), inp.seq_lens[0]
    )
    if torch.isfinite(read).all():
        problems.append("the poisoned page would not show in an output that read it")
    return dict(
        check="foreign_page",
        refused=refused,
        failed=list(failed),
        message=failed[victim.key][2] if victim.key in failed else None,
        max_abs_err_ref=err,
        bitwise_equal_eager=same["output_bitwise"] and same["state_bitwise"],
        problems=problems,
    )


def check_stale_buffer(sc: Scenario) -> dict:
    """A replay nobody refilled: the buffers hold the last step's rows under owner 0."""
    problems = []
    inp = sc.plan(sc.requests)  # new inputs; the fixed tensors get them, the ledger buffers do not
    before = [t.clone() for t in sc.graph.state()]
    failed, _ = sc.run_graph(inp, refill=False)
    n, step = len(inp.keys), sc.graph.step
    refused, dropped = step.refused[:n].tolist(), step.dropped[:n].tolist()
    if not all(refused):
        problems.append(f"refused pages per row {refused}: a live row read without its owners")
    if not all(dropped):
        problems.append(f"dropped writes per row {dropped}: a write landed without its owner")
    nonzero = int(torch.count_nonzero(sc.graph.out))
    if nonzero:
        problems.append(f"{nonzero} output values are not 0")
    unchanged = all(same_bits(a, b) for a, b in zip(before, sc.graph.state()))
    if not unchanged:
        problems.append("tags or pools changed")
    if sorted(failed) != sorted(inp.keys):
        problems.append(f"failed requests {sorted(failed)}, expected every live one {inp.keys}")
    # Nothing landed: the requests' next tokens are still to be written.
    return dict(
        check="stale_buffer",
        refused=refused,
        dropped=dropped,
        nonzero_outputs=nonzero,
        state_unchanged=unchanged,
        failed=sorted(failed),
        problems=problems,
    )


def check_refilled(sc: Scenario) -> dict:
    """The stale replay's twin, refilled: request 0 (failed) gone, the others read again."""
    problems = []
    live = sc.requests[1:]
    inp = sc.plan(live)
    failed, _ = sc.run_graph(inp)
    eager_out, eager_failed, _ = sc.run_eager(inp)
    sc.advance(live)
    if failed or eager_failed:
        problems.append(f"requests failed: {sorted(failed)} {sorted(eager_failed)}")
    if torch.count_nonzero(sc.graph.step.refused) or torch.count_nonzero(sc.graph.step.dropped):
        problems.append(f"pages refused or writes dropped: {sc.graph.step.refused.tolist()}")
    same = sc.compare(inp, eager_out, problems)
    err = sc.reference_error(inp, sc.graph.out, {})
    if err > sc.tol:
        problems.append(f"output {err:.3g} from the float32 attention")
    return dict(
        check="refilled",
        rows=len(live),
        max_abs_err_ref=err,
        bitwise_equal_eager=same["output_bitwise"] and same["state_bitwise"],
        problems=problems,
    )


CHECKS = (
    ("clean", "clean replays, refilled between them, against eager"),
    ("foreign_page", "a page of request 0 re-tagged to request 1 and poisoned between replays"),
    ("stale_buffer", "a replay whose refill was skipped"),
    ("refilled", "the stale replay's twin, refilled"),
)


def run(shape: Shape, device: torch.device, backend: str, budget_s: float, emit) -> list[dict]:
    """Every check in order; ``emit(row)`` as each ends. A raise (the capture, a kernel) ends the
    run with a failed row naming it."""
    started = time.monotonic()
    deadline = started + budget_s
    rows: list[dict] = []
    base = dict(op=OP, backend=backend, device=str(device), **asdict(shape))
    stage = "setup"
    # The ledger logs each failed request; here the failures are the faults' and go in the rows.
    quiet = logging.Filter()
    quiet.filter = lambda record: record.module != "ledger"
    logging.getLogger("kvattn").addFilter(quiet)
    try:
        sc = Scenario(shape, device, backend)
        stage = "capture"
        sc.graph.capture()
        base["captured"] = sc.graph.graph is not None
        for name, fn in (
            ("clean", lambda: check_clean(sc, deadline)),
            ("foreign_page", lambda: check_foreign_page(sc)),
            ("stale_buffer", lambda: check_stale_buffer(sc)),
            ("refilled", lambda: check_refilled(sc)),
        ):
            stage = name
            row = dict(base, **fn())
            row["passed"] = not row["problems"]
            row["wall_s"] = round(time.monotonic() - started, 3)
            rows.append(row)
            emit(row)
    except Exception as e:  # the row says what raised; the exit status fails the suite's step
        row = dict(base, check=stage, passed=False, problems=[f"raised {type(e).__name__}: {e}"])
        row["wall_s"] = round(time.monotonic() - started, 3)
        rows.append(row)
        emit(row)
    finally:
        logging.getLogger("kvattn").removeFilter(quiet)
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def summary(rows: list[dict], label: str, head: str) -> str:
    lines = [
        f"# kvattn's ops in one CUDA graph: replay against eager, violations on replay ({label})",
        "",
        head,
        "",
        "| check | what | passed | detail |",
        "|---|---|---|---|",
    ]
    what = dict(CHECKS)
    for r in rows:
        detail = "; ".join(r["problems"]) or ", ".join(
            f"{key} {_fmt(r[key])}"
            for key in ("steps", "refused", "dropped", "max_abs_err_ref", "bitwise_equal_eager")
            if key in r
        )
        lines.append(f"| {r['check']} | {what.get(r['check'], '')} | {r['passed']} | {detail} |")
    timed = [r for r in rows if r.get("replay_ms") is not None]
    if timed:
        r = timed[0]
        lines += [
            "",
            f"Per decode step of {r['layers']} layers, batch {r['batch']} (median of {r['steps']}, "
            "host clock to the device's end):",
            "",
            "| refill (host) ms | refill + replay ms | eager ms | eager / replay |",
            "|---|---|---|---|",
            f"| {r['fill_ms']:.3f} | {r['replay_ms']:.3f} | {r['eager_ms']:.3f} | "
            f"{r['eager_over_replay']:.2f} |",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu on CUDA, tiny on a CPU")
    ap.add_argument("--steps", type=int, help="clean decode steps at most (default: the preset's)")
    ap.add_argument("--time-budget-s", type=float, default=20.0)
    ap.add_argument("--backend", default="auto", help="the readers' backend (the ledger's)")
    ap.add_argument("--out-dir", default=str(RESULTS), help="parent of the run folder")
    ap.add_argument("--stream", help="also append each row, as a JSON line naming the run, here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda, but torch sees no GPU")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps: expected at least 1, got {args.steps}")
    if args.time_budget_s <= 0:
        raise ValueError(f"--time-budget-s: expected a positive number, got {args.time_budget_s}")
    shape = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "tiny")]
    if args.steps is not None:
        shape = replace(shape, max_steps=args.steps)
    on_gpu = device.type == "cuda"
    slug = Device.current().slug if on_gpu else "cpu"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    commit = git_commit()
    run_dir = (
        Path(args.out_dir)
        / f"{stamp}_{slug}_{os.environ.get('KVATTN_COMMIT', commit)}_graph-replay"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    stream = Path(args.stream) if args.stream else None

    def emit(row: dict) -> None:
        append_rows(run_dir / "rows.jsonl", [row])
        if stream is not None:
            append_rows(stream, [dict(run=run_dir.name, **row)])
        print(
            f"{row['check']}: {'passed' if row['passed'] else 'FAILED'} {row['problems']}",
            flush=True,
        )

    rows = run(shape, device, args.backend, args.time_budget_s, emit)
    v = versions()
    label = "GPU measurement" if on_gpu else CPU_LABEL
    where = Device.current().name if on_gpu else "CPU"
    captured = bool(rows and rows[0].get("captured"))
    head = (
        f"`python -m benchmarks.graph_replay`, commit {commit}, {where}, backend {args.backend}, "
        f"torch {v['torch']}, triton {v['triton']}; {shape.layers} layers, batch {shape.batch} "
        f"({len(shape.contexts)} requests, the rest padding), {shape.heads}/{shape.kv_heads} heads "
        f"of {shape.head_dim}, pages of {shape.page_size}, {shape.dtype}; "
        + ("captured in one CUDA graph." if captured else "no capture (a replay is a plain call).")
    )
    text = summary(rows, label, head)
    (run_dir / "summary.md").write_text(text)
    print(text)
    failed = [r["check"] for r in rows if not r["passed"]]
    if failed:
        print(f"graph replay checks FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

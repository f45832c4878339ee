"""Decode forwards of kvattn's SGLang backend under SGLang 0.5.23's CUDA-graph contract, driven on
this CPU (run by test_sglang_graphs.py in build/venv-sglang; prints JSON).

There is no GPU here, so nothing is captured. ``GraphRunner`` does on CPU tensors what SGLang's
``DecodeCudaGraphRunner`` does around a capture and a replay, with SGLang's own pieces: its static
input buffers (``DecodeInputBuffers``), its per-replay fill and padding rules
(``build_decode_registry(...).fill_from``: padded rows get request-pool row 0, the backend's
fill length and slot 0) and its replay view (``build_replay_fb_view``):

- capture of ``bs`` rows: ``init_forward_metadata_out_graph(fb, in_capture=True)`` on the static
  ForwardBatch, then three runs (two warm-ups and the capture) of ``run_once``'s body:
  ``init_forward_metadata_in_graph`` and every layer's attention;
- replay: ``fill_from`` with the live batch padded to the smallest captured size, the backend's
  ``init_forward_metadata_out_graph(view)`` on the host, then the same body on the same static
  ForwardBatch and buffers.

A real replay runs the captured kernels without the Python around them; what that relies on is
recorded here: every forward of one size reads the step and buffers its capture read, at the
same addresses. The engines (``sglang_driver.Engine``) play the scheduler with SGLang's pools,
allocators and requests; torch-native and kvattn's eager path run the same steps.
"""

from __future__ import annotations

import json
import sys

from sglang_driver import DTYPE, LATENT, Engine, _diff  # first: it stands in torchvision for SGLang

# isort: split
import torch
from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, Phase, with_phase
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers
from sglang.srt.runtime_context import get_parallel

from kvattn.integrations import sglang as integration
from kvattn.tags import tag_valid_len

SIZES = (1, 2, 4)  # captured batch sizes
# What a server publishes before its graph runner builds buffers (no expert parallelism here).
get_parallel().override_permanently(moe_ep_size=1)

STEP_TENSORS = (
    "block_table",
    "expected",
    "seq_lens",
    "cu_seqlens_q",
    "token_owner",
    "token_row",
    "refused",
    "dropped",
    "pages_checked",
    "padding",
    "slots",
)


class GraphRunner:
    """SGLang's decode graph runner's capture and replay, on CPU tensors, around ``engine``."""

    def __init__(self, engine: GraphEngine):
        self.e = engine
        max_bs = max(SIZES)
        backend = engine.backend
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        self.buffers = DecodeInputBuffers.create(
            device=torch.device("cpu"),
            max_bs=max_bs,
            max_num_token=max_bs,
            hidden_size=8,
            next_token_logits_buffer=torch.zeros(max_bs, 8),
            dtype=DTYPE,
            num_dp_ranks=1,
            pp_size=1,
            is_encoder_decoder=False,
            require_mlp_tp_gather=False,
            seq_len_fill_value=self.fill,
            encoder_len_fill_value=0,
            num_tokens_per_req=1,
            cache_loc_dtype=torch.int64,
            enable_mamba_track=False,
        )
        self.registry = build_decode_registry(
            device=torch.device("cpu"),
            max_bs=max_bs,
            max_num_token=max_bs,
            seq_len_fill_value=self.fill,
            cache_loc_dtype=torch.int64,
            share_pool=False,
            source=self.buffers,
        )
        backend.init_cuda_graph_state(max_bs, max_bs)
        self.static: dict[int, ForwardBatch] = {}
        self.captured: dict[int, dict] = {}  # bs -> the step's identity and tensor addresses
        for bs in reversed(SIZES):  # SGLang captures the largest first
            self.capture(bs)

    def _addresses(self, bs: int) -> dict:
        step = self.e.state.steps[0]
        return dict(
            step=id(step),
            graph_step=id(self.e.state.graph.steps[bs]),
            **{name: getattr(step, name).data_ptr() for name in STEP_TENSORS},
            tags=step.layer_tags.data_ptr(),
            out_cache_loc=self.static[bs].out_cache_loc.data_ptr(),
        )

    def capture(self, bs: int) -> None:
        b = self.buffers
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=b.input_ids[:bs],
            req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs],
            seq_lens_cpu=b.seq_lens_cpu[:bs],
            out_cache_loc=b.out_cache_loc[:bs],
            seq_lens_sum=int(b.seq_lens[:bs].sum()),
            positions=b.positions[:bs],
        )
        self.e.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self.static[bs] = fb
        for _ in range(3):  # two warm-up runs, then the one a capture records
            self.run(fb)
        self.captured[bs] = self._addresses(bs)

    def run(self, fb) -> torch.Tensor:
        """``run_once``'s body: what the graph holds."""
        self.e.backend.init_forward_metadata_in_graph(fb)
        o = None
        for layer in self.e.layers:
            q, k, v = self.e._qkv(fb, layer.layer_id)
            o = self.e.backend.forward(q, k, v, layer, fb)
        return o

    def replay(self, fb) -> dict:
        raw = fb.batch_size
        bs = min(s for s in SIZES if s >= raw)
        self.registry.fill_from(
            fb, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
        )
        view = build_replay_fb_view(
            forward_batch=fb,
            buffers=self.buffers,
            bs=bs,
            raw_bs=raw,
            num_tokens=bs,
            global_num_tokens_cpu=None,
            seq_len_fill_value=self.fill,
            capture_forward_mode=ForwardMode.DECODE,
            is_encoder_decoder=False,
        )
        state = self.e.state
        if not self.e.skip_refill:
            self.e.backend.init_forward_metadata_out_graph(view)
        filled = state.steps.get(0)
        # The replayed kernels read the buffers of the step their capture recorded, whatever the
        # host did before: the Python of the body below stands in for them.
        state.steps[0] = state.graph.steps[bs]
        o = self.run(self.static[bs])
        graph = state.graph
        self.e.replays.append(
            dict(
                bs=bs,
                raw=raw,
                refilled_captured_step=filled is graph.steps[bs],
                same_addresses=self._addresses(bs) == self.captured[bs],
                padded_out_max=o[raw:].abs().max().item() if bs > raw else 0.0,
                padded_seq_lens=graph.seq_lens[raw:bs].tolist(),
                padded_checked=graph.pages_checked[raw:bs].tolist(),
                padded_refused=graph.refused[raw:bs].tolist(),
                padded_dropped=graph.dropped[raw:bs].tolist(),
                refused=graph.refused[:raw].tolist(),
                dropped=graph.dropped[:raw].tolist(),
                sglang_padded_rows=self.buffers.req_pool_indices[raw:bs].tolist(),
                sglang_padded_lens=self.buffers.seq_lens[raw:bs].tolist(),
            )
        )
        return {r: o[i : i + 1].tolist() for i, r in enumerate(fb.kvattn_rids)}


class GraphEngine(Engine):
    """A kvattn engine whose decode forwards of up to ``max(SIZES)`` rows replay a graph."""

    def __init__(self, page_size: int, latent=None):
        super().__init__("kvattn", page_size, latent=latent)
        self.replays: list[dict] = []
        self.skip_refill = False
        self.graphs = GraphRunner(self)

    def _model(self, fb):
        if fb.forward_mode.is_decode() and fb.batch_size <= max(SIZES):
            return self.graphs.replay(fb)
        return super()._model(fb)


def _engines(page_size: int, latent=None) -> dict:
    return {
        "torch_native": Engine("torch_native", page_size, latent=latent),
        "eager": Engine("kvattn", page_size, latent=latent),
        "graph": GraphEngine(page_size, latent=latent),
    }


def _script(e: Engine, page_size: int, fault: bool) -> list[dict]:
    """Three requests' prompts, decodes of 3 (padded to 4), 2, 4 and 1 rows across a page
    boundary, a fourth request joining, one leaving. With ``fault``, the last decode of
    a, b and c has b's first page pointing at a's (a ``req_to_token`` entry naming another
    request's page)."""
    P = page_size
    e.admit("a", list(range(1, 2 * P + 6)))
    e.admit("b", list(range(200, 200 + P + 3)))
    e.admit("c", [9, 8, 7, 6, 5])
    e.step({"a": 2 * P + 5, "b": P + 3, "c": 5})
    for _ in range(2):
        e.step({"a": 1, "b": 1, "c": 1})
    e.step({"a": 1, "b": 1})
    e.admit("d", [4, 4, 4, 4, 4, 4, 4])
    e.step({"d": 7})
    for _ in range(P):
        e.step({"a": 1, "b": 1, "c": 1, "d": 1})
    e.step({"b": 1})
    if fault:
        a, b = e.reqs["a"].kv.req_pool_idx, e.reqs["b"].kv.req_pool_idx
        e.req_pool.req_to_token[b, :P] = e.req_pool.req_to_token[a, :P]
    e.step({"a": 1, "b": 1, "c": 1})
    return e.outputs


def equality(page_size: int, fault: bool = False, latent=None) -> dict:
    """The script on torch-native, kvattn eager and kvattn under graphs: per forward, the largest
    output gap of the graph engine to each; what each kvattn engine refused and aborted; the
    replays' records. ``latent``: on SGLang's MLA pool (``sglang_driver.Engine``)."""
    engines = _engines(page_size, latent)
    outs = {k: _script(e, page_size, fault) for k, e in engines.items()}
    g = engines["graph"]
    last = {k: o[-1] for k, o in outs.items()}
    return dict(
        gaps_torch_native=[_diff(s, m) for s, m in zip(outs["torch_native"], outs["graph"])],
        gaps_eager=[_diff(s, m) for s, m in zip(outs["eager"], outs["graph"])],
        identical_to_eager=sum(s == m for s, m in zip(outs["eager"], outs["graph"])),
        forwards=len(outs["graph"]),
        replays=g.replays,
        counts={k: dict(e.state.counts) for k, e in engines.items() if e.state},
        aborted={k: {r: e.aborted(r) for r in e.reqs} for k, e in engines.items()},
        last_gaps={
            k: {r: _diff({r: last["torch_native"][r]}, {r: last[k][r]}) for r in last[k]}
            for k in ("eager", "graph")
        },
    )


def stale(page_size: int, skip: bool, latent=None) -> dict:
    """x and b decode (a graph of 2 rows), then a and b decode on the same graph: with ``skip``,
    the second replay's refill is skipped (its buffers still hold x's and b's pages, under owner
    0). The twin refills. Against torch-native on the same steps."""
    P = page_size
    out = {}
    for kind in ("torch_native", "graph"):
        e = (
            Engine("torch_native", P, latent=latent)
            if kind == "torch_native"
            else GraphEngine(P, latent)
        )
        e.admit("x", list(range(500, 500 + P + 4)))
        e.admit("a", list(range(1, P + 6)))
        e.admit("b", list(range(200, 200 + P + 3)))
        e.step({"x": P + 4, "a": P + 5, "b": P + 3})
        e.step({"x": 1, "b": 1})
        position = e.lens["a"]  # where a's next token goes
        if kind == "graph":
            e.skip_refill = skip
        result = e.step({"a": 1, "b": 1})
        record = dict(result=result, aborted={r: e.aborted(r) for r in ("x", "a", "b")})
        if kind == "graph":
            page = int(e.req_pool.req_to_token[e.reqs["a"].kv.req_pool_idx, position]) // P
            record.update(
                replay=e.replays[-1],
                counts=dict(e.state.counts),
                failures=[m for _, m in e.state.failures],
                # Slots of a's last page written for a after the forward, in every layer, and
                # how many it held before the forward's write.
                a_valid_lens=[tag_valid_len(int(t)) for t in e.state.tags[:, page]],
                a_valid_before=position % P,
            )
        out[kind] = record
    mine, stock = out["graph"]["result"], out["torch_native"]["result"]
    out["norm"] = {r: torch.tensor(mine[r]).abs().max().item() for r in mine}
    out["gap"] = {r: _diff({r: stock[r]}, {r: mine[r]}) for r in mine}
    return out


def refusals() -> dict:
    """kvattn's setup on each graph configuration of a CUDA engine (SGLang's CudaGraphConfig):
    None where it runs, else the refusal; and its graph state for speculative widths."""
    default = CudaGraphConfig()  # decode full; prefill disabled off CUDA
    configs = {
        "decode-full": default,
        "prefill-breakable": with_phase(default, Phase.PREFILL, backend=Backend.BREAKABLE),
        "decode-breakable": with_phase(default, Phase.DECODE, backend=Backend.BREAKABLE),
        "disabled": with_phase(
            with_phase(default, Phase.DECODE, backend=Backend.DISABLED),
            Phase.PREFILL,
            backend=Backend.DISABLED,
        ),
    }
    out = {}
    e = Engine("torch_native", 16)
    e.runner.device = "cuda"  # what setup reads of the device: the refusals of a CUDA engine
    for name, config in configs.items():
        e.runner.server_args.cuda_graph_config = config
        try:
            integration._refuse_unsupported(e.runner)
            out[name] = None
        except integration.IntegrationError as err:
            out[name] = str(err)
    g = Engine("kvattn", 16)
    try:
        g.backend.init_cuda_graph_state(4, 8)
        out["spec-width"] = None
    except integration.IntegrationError as err:
        out["spec-width"] = str(err)
    return out


SCENARIOS = {
    "clean-16": lambda: equality(16),
    "clean-1": lambda: equality(1),
    "fault-16": lambda: equality(16, fault=True),
    "stale-16": lambda: stale(16, True),
    "refilled-16": lambda: stale(16, False),
    "refusals": refusals,
    "mla-clean-16": lambda: equality(16, latent=LATENT),
    "mla-fault-16": lambda: equality(16, fault=True, latent=LATENT),
    "mla-stale-16": lambda: stale(16, True, latent=LATENT),
    "mla-refilled-16": lambda: stale(16, False, latent=LATENT),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SCENARIOS)
    print(json.dumps({n: SCENARIOS[n]() for n in names}))

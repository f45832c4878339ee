"""docs/backends.md's table of attention variants per backend says what the registry does: every cell is
compared with :func:`kvattn.backends.explain` on a small probe input with that variant.

"yes": the backend accepts the probe; "no": it refuses it with a reason naming the switch; "—": it
has no launcher for the op (the MLA rows are ops, not switches: "—" or "yes"). A reader row's cell
holds one answer for decode and extend alike, or "decode / extend" answers apart (a backend with a
decode and no extend: ``yes / —``). A backend refused
for this machine (no GPU, an extension not built)
cannot answer for its kernels here: the CUDA backend's machine check is set aside (its kernel
claims, :func:`kvattn.backends.cuda.launch.unsupported` and the writer switches, are the same code
on any machine), and a backend that still refuses the plain probe is skipped, not trusted.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn.layout import validate_decode, validate_extend, validate_mla_decode, validate_mla_extend
from kvattn.write_args import validate_write_kv

TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "backends.md")
HEADS, KV_HEADS, DIM, PAGE = 2, 1, 64, 16


def matrix() -> tuple[list[str], dict[str, dict[str, str]]]:
    """``(backends, {row label: {backend: cell}})`` from docs/backends.md's marked table."""
    text = open(TABLE).read()
    block = re.search(r"<!-- support-matrix -->\n(.*?)<!-- /support-matrix -->", text, re.S)
    assert block, "docs/backends.md: the support matrix markers are missing"
    lines = [line.strip() for line in block.group(1).strip().splitlines()]
    split = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = split[0], split[2:]
    names = [h.strip("`") for h in header[1:]]
    return names, {row[0]: dict(zip(names, row[1:])) for row in rows}


def reader_args(pool_dtype=torch.float16, head_dim_v=DIM, q_dtype=torch.float16, **variant):
    k_cache = torch.zeros(2, PAGE, KV_HEADS, DIM, dtype=pool_dtype)
    v_cache = torch.zeros(2, PAGE, KV_HEADS, head_dim_v, dtype=pool_dtype)
    tags = torch.zeros(2, dtype=torch.int64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    owners = torch.ones(1, dtype=torch.int64)
    q = torch.zeros(1, HEADS, DIM, dtype=q_dtype)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    return {
        "decode": validate_decode(
            q, k_cache, v_cache, table, lens, tags, owners, validate=False, **variant
        ),
        "extend": validate_extend(
            q, k_cache, v_cache, cu, table, lens, tags, owners, validate=False, **variant
        ),
    }


def extend_args(**variant):
    """The extend probe alone, for a switch decode does not take."""
    args = reader_args()["extend"]
    return {
        "extend": kvattn.layout.validate_extend(
            args.q,
            args.k_cache,
            args.v_cache,
            args.cu_seqlens_q,
            args.block_table,
            args.seq_lens,
            args.page_tags,
            args.expected,
            validate=False,
            **variant,
        )
    }


def writer_args(pool_dtype, head_dim_v=DIM, **rounding):
    k_cache = torch.zeros(2, PAGE, KV_HEADS, DIM, dtype=pool_dtype)
    v_cache = torch.zeros(2, PAGE, KV_HEADS, head_dim_v, dtype=pool_dtype)
    k = torch.zeros(1, KV_HEADS, DIM, dtype=torch.float16)
    v = torch.zeros(1, KV_HEADS, head_dim_v, dtype=torch.float16)
    scales = dict(k_scale=0.5, v_scale=0.5, **rounding) if pool_dtype != torch.float16 else {}
    return {
        "write_kv": validate_write_kv(
            k,
            v,
            k_cache,
            v_cache,
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            1,
            **scales,
        )
    }


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def only(op: str, pool_dtype, per_sequence: bool = False) -> dict:
    """The probe of one reader op on fp8 pools (the CUDA kernels differ between decode and
    extend), scaled per tensor or per sequence (the probes hold one)."""
    scale = torch.full((1, KV_HEADS), 0.5) if per_sequence else 0.5
    return {op: reader_args(pool_dtype, k_scale=scale)[op]}


# Row label -> (the switch a refusal must name, probes: one {op: args} per input the row covers).
ROWS = {
    "sliding window (`window_left`)": ("window_left", lambda: [reader_args(window_left=3)]),
    "two-sided window, extend (`window_right`)": (
        "window_right",
        lambda: [extend_args(window_right=3)],
    ),
    "logit soft-cap (`logits_soft_cap`)": (
        "logits_soft_cap",
        lambda: [reader_args(logits_soft_cap=30.0)],
    ),
    "attention sinks (`sinks`)": ("sinks", lambda: [reader_args(sinks=torch.zeros(HEADS))]),
    "ALiBi (`alibi_slopes`)": (
        "alibi_slopes",
        lambda: [reader_args(alibi_slopes=torch.ones(HEADS))],
    ),
    "per-sequence ALiBi (`alibi_slopes` `[batch, num_heads]`)": (
        "alibi_slopes",
        lambda: [reader_args(alibi_slopes=torch.ones(1, HEADS))],
    ),
    "custom mask / tree attention, extend (`custom_mask`)": (
        "custom_mask",
        lambda: [extend_args(custom_mask=torch.ones(1, dtype=torch.bool))],
    ),
    "fp8 e4m3 pools, decode (`k_scale`, `v_scale`)": ("fp8 KV", lambda: [only("decode", E4M3)]),
    "fp8 e5m2 pools, decode (`k_scale`, `v_scale`)": ("fp8 KV", lambda: [only("decode", E5M2)]),
    "fp8 pools, per-sequence scales, decode (`k_scale` `[batch, num_kv_heads]`)": (
        "fp8 KV",
        lambda: [only("decode", E4M3, per_sequence=True)],
    ),
    "fp8 e4m3 pools, extend": ("fp8 KV", lambda: [only("extend", E4M3)]),
    "fp8 e5m2 pools, extend": ("fp8 KV", lambda: [only("extend", E5M2)]),
    "fp8 pools, per-sequence scales, extend": (
        "fp8 KV",
        lambda: [only("extend", E4M3, per_sequence=True)],
    ),
    "fp8 queries (`q` e4m3/e5m2 over fp8 pools, `q_scale`; per sequence too)": (
        "fp8 queries",
        lambda: [
            reader_args(E4M3, q_dtype=E4M3, q_scale=0.5),
            reader_args(E5M2, q_dtype=E5M2, q_scale=torch.full((1, KV_HEADS), 0.5)),
        ],
    ),
    "fp8 write (`write_kv` into e4m3/e5m2 pools)": (
        "fp8 KV",
        lambda: [writer_args(E4M3), writer_args(E5M2)],
    ),
    'fp8 write rounded toward zero (`fp8_rounding="toward_zero"`, vLLM CPU\'s rule)': (
        "fp8 toward_zero",
        lambda: [
            writer_args(E4M3, fp8_rounding="toward_zero"),
            writer_args(E5M2, fp8_rounding="toward_zero"),
        ],
    ),
    "V head dim narrower than K's (`v_cache` `[..., head_dim_v]`, DeepSeek's 192/128)": (
        "V head dim",
        lambda: [reader_args(head_dim_v=DIM // 2)],
    ),
    "V head dim wider than K's": ("V head dim", lambda: [reader_args(head_dim_v=2 * DIM)]),
    "write V rows of their own head dim": (
        "V head dim",
        lambda: [writer_args(torch.float16, DIM // 2)],
    ),
}


def latent_args(lora=48, rope=16):
    """The probes of the MLA ops: a latent pool (48 + 16, or FlashMLA's 512 + 64), one page."""
    kv = torch.zeros(2, PAGE, 1, lora + rope, dtype=torch.float16)
    q = torch.zeros(1, HEADS, lora + rope, dtype=torch.float16)
    index = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int64),
        torch.ones(1, dtype=torch.int64),
    )
    cu = torch.tensor([0, 1], dtype=torch.int32)
    return {
        "mla_decode": validate_mla_decode(q, kv, *index, kv_lora_rank=lora, validate=False),
        "mla_extend": validate_mla_extend(q, kv, cu, *index, kv_lora_rank=lora, validate=False),
    }


ROWS.update(
    {
        "MLA decode, FlashMLA's 512 + 64 (`paged_mla_decode`, latent cache)": (
            "mla_decode",
            lambda: [{"mla_decode": latent_args(512, 64)["mla_decode"]}],
        ),
        "MLA decode, other latent widths": (
            "512 + 64",
            lambda: [{"mla_decode": latent_args()["mla_decode"]}],
        ),
        "MLA extend (`paged_mla_extend`, several query rows per sequence)": (
            "mla_extend",
            lambda: [{"mla_extend": latent_args()["mla_extend"]}],
        ),
    }
)
PLAIN = {
    "decode": lambda: reader_args()["decode"],
    "extend": lambda: reader_args()["extend"],
    "write_kv": lambda: writer_args(torch.float16)["write_kv"],
    "mla_decode": lambda: latent_args(512, 64)["mla_decode"],
    "mla_extend": lambda: latent_args()["mla_extend"],
}


@pytest.fixture
def claims_here(monkeypatch):
    """The CUDA backend with its machine check set aside (see the module docstring)."""
    cuda = backends.load("cuda")[0]
    if cuda is not None and not torch.cuda.is_available():
        monkeypatch.setattr(cuda, "_why_not_here", lambda device: None)


def verdict(reason: str | None, op: str, switch: str) -> str:
    if reason is None:
        return "yes"
    if reason == f"no {op} kernel":
        return "—"
    assert switch in reason, f"a refusal that does not name {switch!r}: {reason!r}"
    return "no"


def cell(text: str, op: str) -> str:
    """The answer a cell gives for ``op``: the cell, or its decode or extend half."""
    if " / " in text:
        decode, extend = text.split(" / ")
        return decode if op == "decode" else extend
    return text


def test_the_matrix_has_every_backend_and_row():
    names, rows = matrix()
    assert sorted(names) == sorted(backends.names())
    assert list(rows) == list(ROWS)
    answers = {"yes", "no", "—"}
    for cells in rows.values():
        for text in cells.values():
            assert {cell(text, "decode"), cell(text, "extend")} <= answers, text


@pytest.mark.parametrize("row", list(ROWS))
def test_each_cell_is_what_the_registry_says(row, claims_here):
    names, rows = matrix()
    switch, probes = ROWS[row]
    checked = 0
    for backend in names:
        for probe in probes():
            for op, args in probe.items():
                plain = backends.explain(PLAIN[op](), op)[backend]
                if plain is not None and plain != f"no {op} kernel":
                    continue  # refused here for reasons of this machine: no answer about kernels
                got = verdict(backends.explain(args, op)[backend], op, switch)
                assert got == cell(rows[row][backend], op), (
                    f"docs/backends.md says {rows[row][backend]!r} for {row} on {backend} ({op}); the "
                    f"registry says {backends.explain(args, op)[backend]!r}"
                )
                checked += 1
    # reference, triton (interpreted on the CPU), torch and cuda answer on every machine.
    assert checked >= 4 * len(probes()[0])


def test_a_wrong_cell_is_caught(claims_here):
    """The twin: the comparison fails on a cell the registry contradicts (CUDA's V wider than K
    said yes)."""
    args = reader_args(head_dim_v=2 * DIM)["extend"]
    assert verdict(backends.explain(args, "extend")["cuda"], "extend", "V head dim") != "yes"
    assert verdict(backends.explain(args, "extend")["triton"], "extend", "V head dim") == "yes"
    with pytest.raises(AssertionError, match="does not name"):
        verdict("no GPU (torch.cuda.is_available() is False)", "decode", "fp8 KV")
    write = writer_args(E4M3)["write_kv"]
    assert (
        verdict(kvattn.backends.explain(write, "write_kv")["reference"], "write_kv", "fp8 KV")
        == "—"
    )

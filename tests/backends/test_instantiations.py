"""The instantiation table (csrc/instantiations.py) that the CUDA build, the dispatch and the static
gates come from: its rows are the dispatch's axes written out, the generated units hold each row
once, a subset build is read from the environment, and a module built from a subset refuses the
rest with the axis that is missing, in the binding and in the registry (the test-only harness
builds are such a subset: fp16 at head dims up to 64, no score switch)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn.backends.cuda import launch
from kvattn_testing.build import SUBSET_MODULE, built_module, instantiations
from kvattn_testing.util import Batch

F16, BF16 = torch.float16, torch.bfloat16
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_table_is_the_dispatchs_axes_written_out():
    """Every instantiation dispatch.cuh can pick, once: decode over pools of the query's type with
    both copy widths and over fp8 pools (e4m3, e5m2) with 16-byte copies only, and its MLA latent
    tile; the checked decode through a verdict with 16-byte copies; the split merge;
    extend; its page pre-pass; the writer of tokens into pools of their own type (fp8 ones too) and
    of float tokens into fp8 pools."""
    table = instantiations()
    names = [row.name for row in table.TABLE]
    assert len(names) == len(set(names))
    hd, bools = table.TILES, ("true", "false")
    want = {
        f"kvattn::paged_decode_kernel<{t}, {kv}, {d}, {c}, {v}, {s}, {r}>"
        for t in ("__half", "__nv_bfloat16")
        for kv in (t, "kvattn::Fp8E4M3", "kvattn::Fp8E5M2")
        for d in hd
        for c in bools
        for v in (bools if kv == t else ("true",))
        for s in bools
        # through a verdict: checked, 16-byte copies
        for r in (bools if (c, v) == ("true", "true") else ("false",))
    }
    # the MLA latent tile: 16-bit pools, 16-byte copies, no score switch, no verdict
    want |= {
        f"kvattn::paged_decode_kernel<{t}, {t}, {table.LATENT}, {c}, true, false, false>"
        for t in ("__half", "__nv_bfloat16")
        for c in bools
    }
    want |= {
        f"kvattn::merge_splits_kernel<{t}, {s}>" for t in ("__half", "__nv_bfloat16") for s in bools
    }
    want |= {
        f"kvattn::paged_extend_kernel<{t}, {d}, {c}, {v}, {s}>"
        for t in ("__half", "__nv_bfloat16")
        for d in hd
        for c in bools
        for v in bools
        for s in bools
    }
    want |= {"kvattn::resolve_pages_kernel", "kvattn::write_kv_verdict_kernel"}
    floats, fp8 = ("float", "__half", "__nv_bfloat16"), ("kvattn::Fp8E4M3", "kvattn::Fp8E5M2")
    want |= {
        f"kvattn::write_kv_copy_kernel<{t}, {kv}>"
        for t in floats + fp8
        for kv in (t, *fp8)
        if kv == t or t in floats
    }
    assert set(names) == want


def test_each_row_is_in_one_unit_and_a_plain_kernel_header_in_one_unit_only():
    """A kernel that is not a template is defined by its header: a second unit including it would
    not link. A decode unit does not include the extend's headers, nor an extend unit decode.cuh."""
    table = instantiations()
    units = table.units(table.select())
    sources = {name: table.unit_source(name, rows) for name, rows in units.items()}
    for row in table.TABLE:
        text = sources[row.unit]
        if row.template_args() and row.launcher:
            assert text.count(f"template struct {row.launcher};") == 1, row
    for header in ("kvattn/resolve_pages.cuh", "kvattn/write_kv.cuh"):
        assert sum(f'#include "{header}"' in text for text in sources.values()) == 1, header
    for name, text in sources.items():
        includes = set(re.findall(r'#include "([^"]+)"', text))
        assert includes == {table.KERNELS[row.kernel][2] for row in units[name]}, name
    # decode by type and tile (the latent tile too); merge; extend; pre-pass; writer
    assert len(units) == 2 * len(table.HEAD_DIMS) + 1 + 2 * len(table.TILES) + 1 + 1


def test_selection_from_the_environment():
    table = instantiations()
    full = table.selection_from_env({})
    assert full.full and len(table.select(full)) == len(table.TABLE)
    sub = table.selection_from_env(
        {
            "KVATTN_CUDA_DTYPES": "bf16, fp16",
            "KVATTN_CUDA_HEAD_DIMS": "128",
            "KVATTN_CUDA_VARIANTS": "0",
        }
    )
    assert (
        sub.dtypes == ("fp16", "bf16")
        and sub.head_dims == (128,)
        and not sub.variants
        and not sub.full
    )
    rows = table.select(sub)
    assert {row.kernel for row in rows} == {
        "paged_decode_kernel",
        "merge_splits_kernel",
        "paged_extend_kernel",
        "resolve_pages_kernel",
        "write_kv_copy_kernel",
        "write_kv_verdict_kernel",
    }
    assert all(row.head_dim in (None, 128) and not row.variant and row.pool is None for row in rows)
    # dtype, check, copy; and through a verdict, checked by 16-byte copies
    assert len([r for r in rows if r.kernel == "paged_decode_kernel"]) == 2 * 2 * 2 + 2
    # No 16-bit attention type: no attention kernel and no pre-pass; the fp32 writer stays.
    assert {
        r.name for r in table.select(table.selection_from_env({"KVATTN_CUDA_DTYPES": "fp32"}))
    } == {"kvattn::write_kv_copy_kernel<float, float>", "kvattn::write_kv_verdict_kernel"}
    # With an fp8 format: its pass-through copy and the quantising copies from the selected types.
    assert {
        r.name
        for r in table.select(table.selection_from_env({"KVATTN_CUDA_DTYPES": "bf16,e5m2"}))
        if r.op == "write_kv"
    } == {
        "kvattn::write_kv_copy_kernel<__nv_bfloat16, __nv_bfloat16>",
        "kvattn::write_kv_copy_kernel<kvattn::Fp8E5M2, kvattn::Fp8E5M2>",
        "kvattn::write_kv_copy_kernel<__nv_bfloat16, kvattn::Fp8E5M2>",
        "kvattn::write_kv_verdict_kernel",
    }
    for env in (
        {"KVATTN_CUDA_DTYPES": "fp8"},
        {"KVATTN_CUDA_HEAD_DIMS": "96"},
        {"KVATTN_CUDA_VARIANTS": "no"},
        {"KVATTN_CUDA_DTYPES": ","},
    ):
        with pytest.raises(ValueError, match=next(iter(env))):
            table.selection_from_env(env)


def test_generated_headers_name_the_selection(tmp_path):
    table = instantiations()
    sub = table.Selection(dtypes=("fp16", "e4m3"), head_dims=(64,), variants=False)
    units = table.write_generated(tmp_path, sub)
    built = (tmp_path / "kvattn_built.h").read_text()
    assert (
        "struct Built<DecodeKernel<__half, kvattn::Fp8E4M3, 64, true, true, false, false>>" in built
    )
    assert "ResolvePagesKernel" in built and "__nv_bfloat16" not in built and "128" not in built
    macros = (tmp_path / "kvattn_selection.h").read_text()
    assert (
        "#define KVATTN_BUILT_DTYPE_E4M3 1" in macros
        and "#define KVATTN_BUILT_DTYPE_BF16 0" in macros
    )
    assert (
        "#define KVATTN_BUILT_HEAD_DIM_128 0" in macros
        and "#define KVATTN_BUILT_VARIANTS 0" in macros
    )
    assert (
        tmp_path / "kvattn_head_dims.h"
    ).read_text() == table.head_dims_header()  # the table's, whole
    assert [p.name for p in units] == [
        "decode_fp16_d64.cu",
        "decode_merge.cu",
        "extend_fp16_d64.cu",
        "extend_resolve.cu",
        "write_kv.cu",
    ]
    assert (
        "DecodeKernel<__half, kvattn::Fp8E4M3, 64, true, true, false, false>;"
        in units[0].read_text()
    )
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    table.write_generated(tmp_path, sub)  # unchanged: nothing rewritten, so nothing recompiles
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    table.write_generated(
        tmp_path, table.Selection(dtypes=("fp16",), head_dims=(128,), variants=False)
    )
    assert not (tmp_path / "decode_fp16_d64.cu").exists()  # a unit of an earlier selection goes


def test_the_head_dim_tiles_are_the_tables():
    """The tiles are spelled once, in the table (TILES, LATENT): the C++ expands the generated
    kvattn_head_dims.h (padded_head_dim, the dispatch, the plan, the binding's tile_layouts), and
    the launcher's tiles are the keys of its decode occupancy, which each tile needs."""
    table = instantiations()
    header = table.head_dims_header()
    firsts = [1, *(t + 1 for t in table.TILES[:-1])]
    assert (
        "#define KVATTN_HEAD_DIM_TILES(X) "
        + " ".join(f"X({t}, {f})" for t, f in zip(table.TILES, firsts))
        + "\n"
        in header
    )
    assert f"#define KVATTN_MAX_HEAD_DIM_TILE {max(table.TILES)}\n" in header
    assert f"#define KVATTN_LATENT_DIM {table.LATENT}\n" in header
    for name in (
        "DECODE_BLOCKS_PER_SM",
        "DECODE_BLOCKS_PER_SM_SWITCHED",
        "DECODE_BLOCKS_PER_SM_FP8",
    ):
        assert tuple(sorted(getattr(launch, name))) == table.HEAD_DIMS, (
            f"kvattn/backends/cuda/launch.py {name}: one figure per head-dim tile of csrc/instantiations.py "
            f"{table.HEAD_DIMS}"
        )
    assert launch.HEAD_DIM_TILES == table.HEAD_DIMS and launch.LATENT_DIM == table.LATENT
    assert launch.MAX_HEAD_DIM == max(table.TILES)
    assert [
        launch.padded_head_dim(d) for d in (1, *table.TILES, *(t + 1 for t in table.TILES[:-1]))
    ] == [table.TILES[0], *table.TILES, *table.TILES[1:]]
    sim = built_module("kvattn.backends.cuda_sim._sim")
    layouts = sim.tile_layouts()
    assert tuple(layouts["decode"]) == table.HEAD_DIMS
    assert tuple(layouts["decode_fp8"]) == tuple(layouts["extend"]) == table.TILES


def test_modules_report_their_selection():
    sim, subset = built_module("kvattn.backends.cuda_sim._sim"), built_module(SUBSET_MODULE)
    table = instantiations()
    assert sim.SELECTION["full"] and sim.SELECTION["instantiations"] == len(table.TABLE)
    assert subset.SELECTION["text"] == "dtypes fp16; head dims 64; variants off"
    assert subset.SELECTION["instantiations"] == len(
        table.select(table.Selection(("fp16",), (64,), False))
    )


def _decode_args(dtype=F16, head_dim=64, **variant):
    batch = Batch.random(
        batch=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        page_size=4,
        seq_lens=[5, 9],
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return kvattn.layout.validate_decode(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.page_tags,
        batch.expected,
        **variant,
    )


@pytest.mark.parametrize(
    "case, axis",
    [
        (dict(dtype=BF16), "dtype bf16"),
        (dict(head_dim=65), "head_dim 65 (tile 128)"),
        (dict(sinks=torch.zeros(4)), "the score switches (sinks)"),
    ],
)
def test_a_subset_module_refuses_what_it_lacks(case, axis, monkeypatch):
    """The launcher refuses before any launch (launch.NotBuilt, the registry's reason too), and the
    binding itself refuses in the same words if asked anyway."""
    subset = built_module(SUBSET_MODULE)
    args = _decode_args(**case)
    reason = launch.not_built(subset, args)
    assert reason.startswith(f"{axis} not built into this module"), reason
    assert "it has: dtypes fp16; head dims 64; variants off" in reason
    out = torch.empty_like(args.q)
    with pytest.raises(launch.NotBuilt, match=re.escape(reason)):
        launch.decode(subset, args, check=True, out=out, lse=None, num_splits=2)
    monkeypatch.setattr(launch, "not_built", lambda ext, args: None)
    binding = {
        "dtype bf16": "dtype",
        "head_dim 65 (tile 128)": "head_dim 65..128 (tile 128)",
        "the score switches (sinks)": "score switches (window, soft-cap, ALiBi, sinks, custom mask)",
    }[axis]
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            f"{binding} not built into this module (it has: dtypes "
            f"fp16; head dims 64; variants off)"
        ),
    ):
        launch.decode(subset, args, check=True, out=out, lse=None, num_splits=2)


def test_a_subset_module_runs_what_it_has():
    subset = built_module(SUBSET_MODULE)
    args = _decode_args()
    assert launch.not_built(subset, args) is None
    out = torch.full_like(args.q, float("nan"))
    launch.decode(subset, args, check=False, out=out, lse=None, num_splits=2)
    assert torch.isfinite(out).all()


def test_the_registry_gives_the_subset_reason(monkeypatch):
    """With a subset module behind the harness backend, the registry refuses it for what it lacks
    and accepts it for what it has."""
    subset = built_module(SUBSET_MODULE)
    sim_backend = backends.load("cuda_sim")[0]
    monkeypatch.setattr(sim_backend, "_sim", subset)
    assert backends.explain(_decode_args())["cuda_sim"] is None
    assert (
        "dtype bf16 not built into this module"
        in backends.explain(_decode_args(dtype=BF16))["cuda_sim"]
    )


def _ninja_deps() -> dict[str, set[str]]:
    """``{object name: the headers nvcc reported}`` of the last CUDA build, from ninja's log."""
    ninja, build = shutil.which("ninja"), ROOT / "build" / "cuda"
    if ninja is None or not (build / "build.ninja").exists():
        pytest.skip("no ninja build of the CUDA module here (make build)")
    out = subprocess.run(
        [ninja, "-C", str(build), "-t", "deps"], capture_output=True, text=True, check=True
    ).stdout
    deps, current = {}, None
    for line in out.splitlines():
        if line and not line[0].isspace():
            current = pathlib.Path(line.split(":")[0]).name
            deps[current] = set()
        elif line.strip() and current is not None:
            deps[current].add(pathlib.Path(line.strip()).name)
    return deps


def test_a_decode_edit_recompiles_no_extend_unit():
    """nvcc's own dependency lists: each attention unit reads its op's header and not the other's,
    and the dispatch compiles neither (it holds no kernel)."""
    deps = _ninja_deps()
    units = {
        name: members
        for name, members in instantiations().units(instantiations().select()).items()
        if f"{name}.o" in deps
    }
    if not units:
        pytest.skip("the last CUDA build has no unit of the table")
    for name, members in units.items():
        own = {pathlib.Path(instantiations().KERNELS[row.kernel][2]).name for row in members}
        headers = deps[f"{name}.o"]
        assert own <= headers, name
        assert not ({"decode.cuh", "extend.cuh"} - own) & headers, (name, sorted(headers))
    assert not {"decode.cuh", "extend.cuh", "write_kv.cuh"} & deps["dispatch.o"]

"""The CUDA kernel instantiations: the one table the build, the dispatch and the static gates come from.

``TABLE`` lists every kernel instantiation the kernels of csrc/kvattn/ have (one row each: op,
kernel, element type, pool type, head-dim tile, checked, copy width, score switches, as
``dispatch.cuh`` picks them at run time). A build compiles a *selection* of it (:func:`select`;
setup.py reads it from ``KVATTN_CUDA_DTYPES``, ``KVATTN_CUDA_HEAD_DIMS`` and
``KVATTN_CUDA_VARIANTS``, :func:`selection_from_env`), and :func:`write_generated` writes, into one
folder of build/generated/:

- ``<unit>.cu``, one translation unit per (op, element type, head-dim tile) and one for each
  kernel without a tile (the split merge, the extend's page pre-pass, the writer), each explicitly
  instantiating its rows (``template struct kvattn::DecodeKernel<...>;``), so that ninja compiles
  them in parallel and a decode edit recompiles the decode units only;
- ``kvattn_built.h``: the dispatch's list, ``Built<Kernel<...>>`` true for every selected row
  (csrc/kvattn/launchers.h declares the kernels' launchers; dispatch.cuh refuses a row that is
  not built, with the axis that is missing);
- ``kvattn_selection.h``: the selection as plain macros for the binding (``SELECTION`` of the
  module, which the Python launchers and the registry read);
- ``kvattn_head_dims.h``: the table's head-dim tiles (``TILES``, ``LATENT``) as macros, the same in
  every folder: tiles.h's ``padded_head_dim``, the dispatch's switches and refusals, plan.h's
  limits and the binding's ``tile_layouts`` expand them, so a tile is added here alone (and its
  decode occupancy in kvattn/backends/cuda/launch.py, which tests/backends/test_instantiations.py
  asks for).

tools/static_sm90.py and the tests name the CUDA kernels by :func:`by_name`. Standard library only:
setup.py, the tools and the tests load this file by path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

# Element types of the queries, outputs and 16-bit pools (fp32: the writer only; the attention
# kernels run fp16/bf16 on tensor cores), then the fp8 pool formats of the decode and the writer
# (whose tokens may be fp8 too, stored as they are).
DTYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
FP8 = {"e4m3": "kvattn::Fp8E4M3", "e5m2": "kvattn::Fp8E5M2"}
TYPES = {**DTYPES, **FP8}
TILES = (64, 128, 256, 512)  # the padded head-dim tiles, increasing (tiles.h padded_head_dim)
LATENT = 576  # the MLA latent tile (tiles.h kLatentDim): decode, 16-bit pools, 16-byte copies
HEAD_DIMS = (*TILES, LATENT)  # a selection's head-dim axis
ATTENTION_DTYPES = ("fp16", "bf16")
BOOL = (False, True)

# kernel: (op, launcher struct of csrc/kvattn/launchers.h, header defining it, parameter struct)
KERNELS = {
    "paged_decode_kernel": ("decode", "DecodeKernel", "kvattn/decode.cuh", "DecodeParams"),
    "merge_splits_kernel": ("decode", "MergeKernel", "kvattn/decode.cuh", "DecodeParams"),
    "paged_extend_kernel": ("extend", "ExtendKernel", "kvattn/extend.cuh", "ExtendParams"),
    "resolve_pages_kernel": (
        "extend",
        "ResolvePagesKernel",
        "kvattn/resolve_pages.cuh",
        "ExtendParams",
    ),
    "write_kv_copy_kernel": ("write_kv", "WriteKVKernel", "kvattn/write_kv.cuh", "WriteKVParams"),
    "write_kv_verdict_kernel": ("write_kv", None, "kvattn/write_kv.cuh", "WriteKVParams"),
}


@dataclass(frozen=True)
class Row:
    """One kernel instantiation. ``None``: the kernel has no such template argument. ``pool``: the
    K/V element type when it differs from ``dtype`` (fp8); ``vec``: 16-byte cp.async copies (False:
    element by element, for rows that are not 16-byte aligned); ``variant``: the score switches
    of kvattn.variants compiled in (window, soft-cap, ALiBi, sinks; the extend's custom mask);
    ``verdict``: the checked decode reading a step's verdict instead of the table and the tags
    (kvattn.resolve_pages)."""

    kernel: str
    dtype: str | None = None
    pool: str | None = None
    head_dim: int | None = None
    check: bool | None = None
    vec: bool | None = None
    variant: bool | None = None
    verdict: bool | None = None

    @property
    def op(self) -> str:
        return KERNELS[self.kernel][0]

    def template_args(self) -> list[str]:
        """The C++ template arguments, in the kernel's order."""
        cxx = lambda b: "true" if b else "false"  # noqa: E731
        args = [] if self.dtype is None else [TYPES[self.dtype]]
        if self.kernel in ("paged_decode_kernel", "write_kv_copy_kernel"):
            args.append(FP8[self.pool] if self.pool else TYPES[self.dtype])
        if self.head_dim is not None:
            args.append(str(self.head_dim))
        args += [
            cxx(b) for b in (self.check, self.vec, self.variant, self.verdict) if b is not None
        ]
        return args

    @property
    def name(self) -> str:
        """As c++filt prints the kernel, without ``void`` and the parameters:
        ``kvattn::paged_decode_kernel<__half, __half, 64, true, true, false, false>``."""
        args = self.template_args()
        return f"kvattn::{self.kernel}" + (f"<{', '.join(args)}>" if args else "")

    @property
    def signature(self) -> str:
        """The whole demangled name, as ptxas reports it (csrc/ptxas_report.py; c++filt names the
        return type of a template only)."""
        return f"{'void ' if self.template_args() else ''}{self.name}(kvattn::{KERNELS[self.kernel][3]})"

    @property
    def launcher(self) -> str | None:
        """The launcher struct the dispatch calls (None: launched by another row's launcher)."""
        struct = KERNELS[self.kernel][1]
        if struct is None:
            return None
        args = self.template_args()
        return f"kvattn::{struct}" + (f"<{', '.join(args)}>" if args else "")

    @property
    def unit(self) -> str:
        """The generated translation unit holding this row: one per (op, element type, head-dim
        tile), fp8 pools with their query type's. Each nvcc call costs ~2 s before its first
        kernel (preprocessing, the front ends, the host compile): a unit per (op, type, pool,
        tile) made the 2-core serial build a third slower than one unit when measured; a unit per
        (op, type, tile) keeps a few heavy units of each attention op for the parallel build."""
        if self.head_dim is None:
            return {"decode": "decode_merge", "extend": "extend_resolve", "write_kv": "write_kv"}[
                self.op
            ]
        return f"{self.op}_{self.dtype}_d{self.head_dim}"


TABLE: tuple[Row, ...] = (
    # decode: pools of the query's type by both copy widths, fp8 pools by 16-byte copies only;
    # checked by 16-byte copies also through a verdict
    *(
        Row("paged_decode_kernel", t, pool, d, check, vec, variant, verdict)
        for t in ATTENTION_DTYPES
        for pool in (None, *FP8)
        for d in TILES
        for check in BOOL
        for vec in (BOOL if pool is None else (True,))
        for variant in BOOL
        for verdict in (BOOL if check and vec else (False,))
    ),
    # the MLA latent tile (kvattn.paged_mla_decode): no score switch, no fp8, 16-byte copies, no
    # verdict (the MLA readers take none)
    *(
        Row("paged_decode_kernel", t, None, LATENT, check, True, False, False)
        for t in ATTENTION_DTYPES
        for check in BOOL
    ),
    *(Row("merge_splits_kernel", t, variant=variant) for t in ATTENTION_DTYPES for variant in BOOL),
    *(
        Row("paged_extend_kernel", t, None, d, check, vec, variant)
        for t in ATTENTION_DTYPES
        for d in TILES
        for check in BOOL
        for vec in BOOL
        for variant in BOOL
    ),
    Row("resolve_pages_kernel"),
    # the writer: tokens into pools of their type (fp8 ones too), and float tokens quantised into fp8
    *(Row("write_kv_copy_kernel", t) for t in TYPES),
    *(Row("write_kv_copy_kernel", t, pool) for pool in FP8 for t in DTYPES),
    Row("write_kv_verdict_kernel"),
)


def by_name() -> dict[str, Row]:
    """``{row.name: row}`` of the whole table."""
    return {row.name: row for row in TABLE}


@dataclass(frozen=True)
class Selection:
    """What a build compiles: the element and pool types (``DTYPES`` and ``FP8`` names), the
    head-dim tiles, and whether the score switches are compiled in."""

    dtypes: tuple[str, ...] = (*DTYPES, *FP8)
    head_dims: tuple[int, ...] = HEAD_DIMS
    variants: bool = True

    def keeps(self, row: Row) -> bool:
        return (
            (row.dtype is None or row.dtype in self.dtypes)
            and (row.pool is None or row.pool in self.dtypes)
            and (row.head_dim is None or row.head_dim in self.head_dims)
            and (not row.variant or self.variants)
        )

    @property
    def full(self) -> bool:
        return self == Selection()

    def text(self) -> str:
        """``dtypes fp16,bf16; head dims 128; variants off``."""
        return (
            f"dtypes {','.join(self.dtypes) or 'none'}; "
            f"head dims {','.join(map(str, self.head_dims)) or 'none'}; "
            f"variants {'on' if self.variants else 'off'}"
        )

    def as_dict(self) -> dict:
        return {
            "dtypes": list(self.dtypes),
            "head_dims": list(self.head_dims),
            "variants": self.variants,
            "text": self.text(),
            "full": self.full,
        }


def select(selection: Selection = Selection()) -> list[Row]:
    """The rows a build of ``selection`` compiles, in table order. A kernel without template
    arguments (the extend's page pre-pass, the writer's verdict) comes with the first row of its
    op that is kept."""
    kept = [row for row in TABLE if row.dtype is not None and selection.keeps(row)]
    ops = {row.op for row in kept}
    return [row for row in TABLE if row in kept or (row.dtype is None and row.op in ops)]


def _names(raw: str, allowed, what: str, variable: str) -> tuple:
    items = [x.strip() for x in raw.replace(";", ",").split(",") if x.strip()]
    wrong = [x for x in items if x not in allowed]
    if wrong or not items:
        raise ValueError(
            f"{variable}: expected {what} from {', '.join(map(str, allowed))}, got {raw!r}"
        )
    return tuple(x for x in allowed if x in items)  # table order, no repeats


def selection_from_env(env) -> Selection:
    """The selection of ``KVATTN_CUDA_DTYPES`` (``fp16,bf16,fp32,e4m3,e5m2``),
    ``KVATTN_CUDA_HEAD_DIMS`` (``HEAD_DIMS``: ``TILES``, then ``LATENT``, the MLA latent tile) and
    ``KVATTN_CUDA_VARIANTS`` (``1``; ``0``
    builds no score switch); unset: everything. ValueError for a value it cannot read."""
    default = Selection()
    dtypes, dims = (
        env.get("KVATTN_CUDA_DTYPES", "").strip(),
        env.get("KVATTN_CUDA_HEAD_DIMS", "").strip(),
    )
    variants = env.get("KVATTN_CUDA_VARIANTS", "1").strip()
    if variants not in ("0", "1"):
        raise ValueError(f"KVATTN_CUDA_VARIANTS: expected 0 or 1, got {variants!r}")
    return Selection(
        dtypes=_names(dtypes, (*DTYPES, *FP8), "element or pool types", "KVATTN_CUDA_DTYPES")
        if dtypes
        else default.dtypes,
        head_dims=tuple(
            int(d)
            for d in _names(
                dims, tuple(map(str, HEAD_DIMS)), "head-dim tiles", "KVATTN_CUDA_HEAD_DIMS"
            )
        )
        if dims
        else default.head_dims,
        variants=variants == "1",
    )


def units(rows: list[Row]) -> dict[str, list[Row]]:
    """``{unit: rows}``, the units in table order."""
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(row.unit, []).append(row)
    return out


_NOTICE = "// Generated by setup.py from csrc/instantiations.py (edit the table, not this file).\n"


def unit_source(name: str, rows: list[Row]) -> str:
    headers = sorted({KERNELS[row.kernel][2] for row in rows})
    lines = [_NOTICE, f"// Unit {name}: {len(rows)} kernel(s).\n"]
    lines += [f'#include "{h}"\n' for h in headers]
    lines.append("\n")
    for row in rows:
        if row.launcher is None:
            lines.append(
                f"// {row.name}: defined by {KERNELS[row.kernel][2]}, launched by the op's launcher\n"
            )
        elif row.template_args():
            lines.append(f"template struct {row.launcher};\n")
        else:
            lines.append(f"// {row.name}: not a template, defined by {KERNELS[row.kernel][2]}\n")
    return "".join(lines)


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def built_header(rows: list[Row], selection: Selection) -> str:
    lines = [
        _NOTICE,
        "// The kernel instantiations of this module, for the dispatch (dispatch.cuh).\n",
        '#pragma once\n\n#include "kvattn_selection.h"\n\nnamespace kvattn {\n\n',
    ]
    lines += [
        f"template <>\nstruct Built<{row.launcher[len('kvattn::') :]}> : std::true_type {{}};\n"
        for row in rows
        if row.launcher is not None
    ]
    lines.append("\n}  // namespace kvattn\n")
    return "".join(lines)


def selection_header(rows: list[Row], selection: Selection) -> str:
    """Macros only (the binding includes it without CUDA): the selection as text and as JSON, and
    one ``KVATTN_BUILT_<AXIS>_<VALUE>`` flag per axis value for the dispatch's reasons."""
    data = dict(selection.as_dict(), instantiations=len(rows), units=len(units(rows)))
    lines = [
        _NOTICE,
        "#pragma once\n\n",
        f"#define KVATTN_SELECTION {_c_string(selection.text())}\n",
        f"#define KVATTN_SELECTION_JSON {_c_string(json.dumps(data, sort_keys=True))}\n",
    ]
    for name in (*DTYPES, *FP8):
        lines.append(f"#define KVATTN_BUILT_DTYPE_{name.upper()} {int(name in selection.dtypes)}\n")
    for d in HEAD_DIMS:
        lines.append(f"#define KVATTN_BUILT_HEAD_DIM_{d} {int(d in selection.head_dims)}\n")
    lines.append(f"#define KVATTN_BUILT_VARIANTS {int(selection.variants)}\n")
    return "".join(lines)


def head_dims_header() -> str:
    """The head-dim tiles as macros (the whole table's, whatever the selection):
    ``KVATTN_HEAD_DIM_TILES(X)`` expands ``X(tile, first)`` for each of ``TILES`` in increasing
    order, ``first`` the smallest head dim it runs (the one above the previous tile);
    ``KVATTN_MAX_HEAD_DIM_TILE`` is the widest, ``KVATTN_LATENT_DIM`` the MLA latent tile."""
    assert list(TILES) == sorted(set(TILES)) and LATENT > TILES[-1], (
        "TILES increasing, LATENT above them"
    )
    firsts = [1, *(t + 1 for t in TILES[:-1])]
    return "".join(
        [
            _NOTICE,
            "// The head-dim tiles of the table (TILES, LATENT): X(tile, first head dim it runs).\n",
            "#pragma once\n\n",
            "#define KVATTN_HEAD_DIM_TILES(X) "
            + " ".join(f"X({t}, {f})" for t, f in zip(TILES, firsts))
            + "\n",
            f"#define KVATTN_MAX_HEAD_DIM_TILE {TILES[-1]}\n",
            f"#define KVATTN_LATENT_DIM {LATENT}\n",
        ]
    )


def _write(path: pathlib.Path, text: str) -> None:
    """Written only when it changes, so an unchanged build recompiles nothing."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_generated(
    folder: pathlib.Path, selection: Selection, with_units: bool = True
) -> list[pathlib.Path]:
    """Writes the headers (and, ``with_units``, the translation units) of ``selection`` into
    ``folder``; removes units of an earlier selection. Returns the units' paths in table order."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = select(selection)
    _write(folder / "kvattn_selection.h", selection_header(rows, selection))
    _write(folder / "kvattn_built.h", built_header(rows, selection))
    _write(folder / "kvattn_head_dims.h", head_dims_header())
    if not with_units:
        return []
    paths = []
    for name, members in units(rows).items():
        paths.append(folder / f"{name}.cu")
        _write(paths[-1], unit_source(name, members))
    for stale in set(folder.glob("*.cu")) - set(paths):
        stale.unlink()
    return paths

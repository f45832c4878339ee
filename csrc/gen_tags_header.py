"""Write the C++ header of the tag layout from kvattn/tags.py, so the layout stays written once.

Reads the module with ``ast`` (no import: setup.py runs without torch in an isolated build) and
evaluates its integer constants and the values of the ``Violation`` and ``WriteDrop`` flags.

Usage: ``python csrc/gen_tags_header.py OUT.h``.
"""

from __future__ import annotations

import ast
import pathlib
import sys

TAGS_PY = pathlib.Path(__file__).resolve().parent.parent / "kvattn" / "tags.py"
CONSTANTS = (
    "STATE_MASK",
    "STATE_FREE",
    "STATE_RESERVED",
    "STATE_WRITTEN",
    "VALID_LEN_SHIFT",
    "VALID_LEN_BITS",
    "VALID_LEN_MAX",
    "OWNER_SHIFT",
    "OWNER_BITS",
    "OWNER_MAX",
)
ENUMS = ("Violation", "WriteDrop")


def _eval(node: ast.expr, env: dict[str, int]) -> int:
    """Integer constant expressions of names, literals, + - << | and parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env), _eval(node.right, env)
        ops = {ast.Add: a + b, ast.Sub: a - b, ast.LShift: a << b, ast.BitOr: a | b}
        if type(node.op) in ops:
            return ops[type(node.op)]
    raise ValueError(f"{TAGS_PY}: unsupported constant expression {ast.unparse(node)}")


def read_layout(path: pathlib.Path = TAGS_PY) -> dict[str, int]:
    """``{name: value}`` of the module constants and ``Enum_MEMBER`` flag values."""
    env: dict[str, int] = {}
    values: dict[str, int] = {}
    for stmt in ast.parse(path.read_text()).body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            try:
                env[stmt.targets[0].id] = _eval(stmt.value, env)
            except (ValueError, KeyError):
                continue
        elif isinstance(stmt, ast.ClassDef) and stmt.name in ENUMS:
            for item in stmt.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    values[f"{stmt.name}_{item.targets[0].id}"] = _eval(item.value, {})
    for name in CONSTANTS:
        values[name] = env[name]
    return values


def render(values: dict[str, int]) -> str:
    lines = [
        "// Generated from kvattn/tags.py by csrc/gen_tags_header.py at build time; do not edit.",
        "#pragma once",
        "#include <cstdint>",
        "",
        "namespace kvattn {",
        "namespace tags {",
    ]
    for name, value in values.items():
        lines.append(f"constexpr int64_t {name} = {value}LL;")
    lines += ["}  // namespace tags", "}  // namespace kvattn", ""]
    return "\n".join(lines)


def write_header(out: pathlib.Path) -> None:
    """Write the header, touching the file only when its text changes (keeps rebuilds incremental)."""
    text = render(read_layout())
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_text() != text:
        out.write_text(text)


if __name__ == "__main__":
    write_header(pathlib.Path(sys.argv[1]))

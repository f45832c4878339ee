"""The conformance suite: the classes of KV-mixing bug that serving engines have shipped, replayed
through an engine's own bookkeeping with a fault injector, each fault next to a clean run of the
same requests, on the engine's stock attention and on kvattn's. Run it in the environment the
engine is installed in::

    python -m kvattn.conformance --engine vllm|sglang|transformers [--seeds 0,1,2] [--out DIR]

It prints one row per fault: the class and the public report it stands for, how often it was
injected, how often kvattn caught it (the victim failed with the ownership error), how often the
victim was the only request affected (every other request kept its clean answer), and how often
the stock engine answered the victim with other tokens than its clean run (the fault is real);
then the clean requests served and the false refusals among them. ``--out`` also writes the rows
as JSON and the table as Markdown. The exit status is 0 only when every fault was injected and
caught with the victim alone affected and no clean request was refused.

The engines' own modules (:mod:`kvattn.conformance.vllm`, :mod:`kvattn.conformance.sglang`,
:mod:`kvattn.conformance.transformers`) say what their workloads hold and how each fault is made.
"""

from __future__ import annotations

import dataclasses

# class -> what goes wrong; the public reports behind each row are the engine module's.
CLASSES = {
    1: "never-written pages read as if filled",
    2: "pages freed and handed on while a request still reads them",
    3: "pages misrouted by index or metadata",
    4: "page-boundary and partial-page errors, mismatched hash hits",
    5: "pages shared across cache domains (LoRA adapter, cache salt)",
    6: "bytes wrong inside a correctly owned page",
}


@dataclasses.dataclass
class Row:
    """One fault's tally over the runs (seeds or lanes) it was injected in."""

    cls: int
    fault: str
    reports: str
    runs: int = 0
    injected: int = 0
    caught: int = 0
    victim_only: int = 0
    stock_changed: int = 0

    @property
    def ok(self) -> bool:
        return self.runs > 0 and self.injected == self.caught == self.victim_only == self.runs


@dataclasses.dataclass
class Report:
    """An engine's conformance: a row per fault, the clean requests behind the false refusals'
    count, the classes this engine's run does not replay (class -> why), and the faults of a
    replayed class whose lane could not run in this environment (fault -> why)."""

    engine: str
    version: str
    seeds: list[int]
    rows: list[Row]
    clean_requests: int = 0
    clean_equal_to_stock: int = 0
    false_refusals: int = 0
    not_replayed: dict[int, str] = dataclasses.field(default_factory=dict)
    lanes_not_run: dict[str, str] = dataclasses.field(default_factory=dict)  # fault -> why

    @property
    def ok(self) -> bool:
        return (
            bool(self.rows)
            and all(row.ok for row in self.rows)
            and self.false_refusals == 0
            and self.clean_equal_to_stock == self.clean_requests > 0
        )

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out

    def markdown(self) -> str:
        lines = [
            f"Engine: {self.engine} {self.version}; seeds {', '.join(map(str, self.seeds))}.",
            "",
            "| class | fault | stands for | injected | caught | victim only | stock answer changed |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in sorted(self.rows, key=lambda r: r.cls):
            lines.append(
                f"| {row.cls} | {row.fault} | {row.reports} | {row.injected}/{row.runs} | "
                f"{row.caught}/{row.runs} | {row.victim_only}/{row.runs} | "
                f"{row.stock_changed}/{row.runs} |"
            )
        lines += [
            "",
            f"Clean requests: {self.clean_requests}, of which {self.clean_equal_to_stock} "
            f"answered as on the stock attention; false refusals: {self.false_refusals}.",
        ]
        if self.not_replayed:
            lines += ["", "Classes not replayed here:"]
            lines += [
                f"- {cls} ({CLASSES[cls]}): {why}" for cls, why in sorted(self.not_replayed.items())
            ]
        if self.lanes_not_run:
            lines += ["", "Not run in this environment:"]
            lines += [f"- {fault}: {why}" for fault, why in sorted(self.lanes_not_run.items())]
        lines += ["", "Conformant." if self.ok else "NOT conformant."]
        return "\n".join(lines) + "\n"

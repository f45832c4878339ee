"""``python -m kvattn.conformance --engine vllm|sglang|transformers``: the package docstring says what it
runs and prints."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

from kvattn.conformance import Report
from kvattn.version import __version__

DEFAULT_SEEDS = {"vllm": "0,1,2,3,4,5", "transformers": "0,1,2,3,4", "sglang": "0,1"}


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return seeds


def run_vllm(seeds: list[int], work: pathlib.Path, model: str | None = None) -> Report:
    """vLLM's attention and kvattn's in two engine processes side by side (the plugin is chosen
    when vLLM starts), then the comparison."""
    import importlib.util

    from kvattn.conformance import vllm as conformance

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"vLLM is not installed in this Python environment ({sys.executable})")
    if model is None:
        from kvattn.conformance.model import build

        model = str(work / "model")
        if not (work / "model" / "config.json").exists():
            build(model)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
    jobs = []
    for name in ("stock", "kvattn"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVATTN_")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=threads)
        if name == "kvattn":
            env["KVATTN_VLLM"] = "1"
        out, log = work / f"vllm-{name}.json", work / f"vllm-{name}.log"
        command = [sys.executable, "-m", "kvattn.conformance.vllm", ",".join(map(str, seeds))]
        command += [model, str(out), str(work / f"adapters-{name}")]
        with open(log, "w") as f:
            jobs.append((subprocess.Popen(command, env=env, stdout=f, stderr=f), out, log))
    results = []
    for proc, out, log in jobs:
        if proc.wait() != 0:
            tail = "\n".join(log.read_text().splitlines()[-30:])
            raise RuntimeError(f"the engine process failed ({proc.returncode}), {log}:\n{tail}")
        results.append(json.loads(out.read_text()))
    return conformance.judge(*results)


def run_transformers(seeds: list[int], work: pathlib.Path, model: str | None = None) -> Report:
    """Both attentions in this process: kvattn's is switched on per run."""
    from kvattn.conformance import transformers as conformance

    why = conformance.why_unsupported()
    if why is not None:
        raise RuntimeError(why)
    llama = conformance.tiny_llama()
    return conformance.judge({seed: conformance.compute_seed(llama, seed) for seed in seeds})


def run_sglang(seeds: list[int], work: pathlib.Path, model: str | None = None) -> Report:
    """SGLang's servers on both attentions (with HiCache for the offload lane, and the
    prefill/decode pairs where Mooncake is installed), then the comparison."""
    from kvattn.conformance import sglang as conformance

    raw = conformance.run(seeds, work, model)
    return conformance.judge(raw["servers"], raw["incident"], raw["version"], raw["offload"])


RUNNERS = {"vllm": run_vllm, "transformers": run_transformers, "sglang": run_sglang}


def _commit() -> str | None:
    """The commit of the kvattn checkout this runs from (with ``-dirty`` when its tree differs),
    or None for an installed kvattn."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def provenance(argv: list[str]) -> str:
    """The run's first line: the command, when, which kvattn, on what machine."""
    import torch

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = _commit()
    return (
        f"`python -m kvattn.conformance {' '.join(argv)}`, {when}, kvattn {__version__}"
        + (f" (commit {commit})" if commit else "")
        + f", torch {torch.__version__}, {platform.machine()} ({os.cpu_count()} cores)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvattn.conformance",
        description="Replay the classes of KV-mixing bug through an engine, on its attention "
        "and on kvattn's, and print which were caught.",
    )
    parser.add_argument("--engine", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--seeds", type=_seeds, help="comma-separated workload seeds")
    parser.add_argument(
        "--model",
        help="vLLM, SGLang: a Llama-family model directory with at least 256 tokens in its "
        "vocabulary "
        "(default: a tiny random-weight Llama written to the work directory)",
    )
    parser.add_argument("--out", help="a directory for conformance-ENGINE.json and .md")
    parser.add_argument("--work", help="a directory for the engine processes' files")
    args = parser.parse_args(argv)
    if args.model is not None and args.engine == "transformers":
        parser.error(f"--model: {args.engine} runs its own tiny Llama; expected no --model")
    if args.model is not None and not (pathlib.Path(args.model) / "config.json").is_file():
        parser.error(f"--model: expected a model directory with a config.json, got {args.model!r}")
    seeds = args.seeds or _seeds(DEFAULT_SEEDS[args.engine])
    with tempfile.TemporaryDirectory(prefix="kvattn-conformance-") as tmp:
        work = pathlib.Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            report = RUNNERS[args.engine](seeds, work, args.model)
        except (ImportError, RuntimeError) as e:
            print(f"conformance run of {args.engine} failed: {e}", file=sys.stderr)
            return 2
    text = provenance(sys.argv[1:] if argv is None else argv) + "\n\n" + report.markdown()
    print(text, end="")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"conformance-{args.engine}.json").write_text(
            json.dumps(dict(provenance=text.splitlines()[0], **report.to_json()), indent=1) + "\n"
        )
        (out / f"conformance-{args.engine}.md").write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

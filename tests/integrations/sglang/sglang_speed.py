"""End-to-end speed of kvattn's attention inside SGLang against SGLang's own CPU attention
(``torch_native``: SGLang's attention on a CPU without AMX), on a random-weight model with
SmolLM-135M's shapes (kvattn.conformance.model; no download). Run with SGLang's environment's
Python (``make sglang-speed``); each attention runs in its own process (one offline
``sglang.Engine``, its scheduler in a process of its own), the same requests, greedy, float32:

    python tests/integrations/sglang/sglang_speed.py [--requests 4] [--prompt 256] [--new 32]
                                                     [--page-size 16] [--json OUT]

Prints the wall time of ``Engine.generate`` for each (after a warm-up request), the ratio and
whether the greedy tokens are identical. CPU figures of this machine only; they say nothing about
a GPU. The model steps run in SGLang's scheduler process, so unlike ``make vllm-speed`` this
script does not break the time down.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
MODEL = ROOT / "build" / "sglang-speed" / "model"
STANDINS = HERE / "standins"  # what SGLang needs on this CPU (see standins/sitecustomize.py)
ATTENTIONS = ("torch_native", "kvattn")


def child(args) -> dict:
    import sglang

    from kvattn.conformance.model import prompt

    engine = sglang.Engine(
        model_path=str(MODEL),
        device="cpu",
        dtype="float32",
        attention_backend=args.attention,
        disable_cuda_graph=True,
        grammar_backend="none",
        page_size=args.page_size,
        max_total_tokens=8192,
        skip_server_warmup=True,
        sleep_on_idle=True,
        log_level="error",
        random_seed=0,
    )
    try:
        params = dict(max_new_tokens=args.new, temperature=0, ignore_eos=True)
        engine.generate(input_ids=[prompt(0, 64)], sampling_params=params)
        prompts = [prompt(1 + i, args.prompt) for i in range(args.requests)]
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    return dict(seconds=seconds, tokens=[list(o["output_ids"]) for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json")
    parser.add_argument("--attention", choices=ATTENTIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attention:
        print(json.dumps(child(args)))
        return
    if not (MODEL / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvattn.conformance.model",
                str(MODEL),
                "--geometry",
                "smollm-135m",
            ],
            check=True,
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVATTN_", "TRITON_"))}
    env.update(
        PYTHONPATH=str(STANDINS),
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
    )
    results = {}
    for name in ATTENTIONS:
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                "--attention",
                name,
                "--requests",
                str(args.requests),
                "--prompt",
                str(args.prompt),
                "--new",
                str(args.new),
                "--page-size",
                str(args.page_size),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise SystemExit(f"the {name} engine failed ({run.returncode}):\n{run.stderr[-3000:]}")
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = results["kvattn"]["seconds"] / results["torch_native"]["seconds"]
    same = results["kvattn"]["tokens"] == results["torch_native"]["tokens"]
    print(
        f"{args.requests} requests x {args.prompt} prompt tokens, {args.new} new tokens each, "
        f"SmolLM-135M shapes, float32, pages of {args.page_size}, this CPU "
        f"({os.cpu_count()} cores)"
    )
    for name in ATTENTIONS:
        print(f"  {name:12s} {results[name]['seconds']:7.2f} s")
    print(f"  kvattn / SGLang's torch_native: {ratio:.2f}x; greedy tokens identical: {same}")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(dict(args=vars(args), ratio=ratio, same_tokens=same, **results), indent=1)
        )


if __name__ == "__main__":
    main()

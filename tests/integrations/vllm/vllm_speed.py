"""End-to-end speed of kvattn's attention inside vLLM against vLLM's own CPU attention, on a
random-weight model with SmolLM-135M's shapes (kvattn.conformance.model; no download). Run with the vLLM
environment's Python (``make vllm-speed``); each attention runs in its own process, one engine,
the same requests, greedy, float32:

    python tests/integrations/vllm/vllm_speed.py [--requests 4] [--prompt 256] [--new 32]
                                                 [--no-prefix-caching] [--json OUT]

Prints the wall time of ``LLM.generate`` for each (after a warm-up request), the ratio, and where
the time goes, timed by wrapping the calls in each process: the model steps (``execute_model``),
the attention calls and KV writes of each attention, and kvattn's per-step host work. CPU figures
of this machine only; they say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent  # beside vllm_prompts.py
ROOT = HERE.parents[2]
MODEL = ROOT / "build" / "vllm-speed" / "model"


def _timed(timings, owner, name, key):
    """Add the wall time of every call of ``owner.name`` to ``timings[key]``."""
    original = getattr(owner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            timings[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def child(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from collections import defaultdict

    timings: dict[str, float] = defaultdict(float)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _timed(timings, GPUModelRunner, "execute_model", "model step (execute_model)")
    if os.environ.get("KVATTN_VLLM"):
        import kvattn.api
        import kvattn.integrations.ledger as ledger
        import kvattn.integrations.vllm as integration

        _timed(timings, kvattn.api, "paged_extend", "attention (paged_extend)")
        _timed(timings, kvattn.api, "paged_decode", "attention (paged_decode)")
        _timed(timings, ledger, "write_kv", "KV writes (write_kv)")
        for name in ("begin_step", "step_batch", "end_step"):
            _timed(timings, integration.WorkerOwnership, name, f"adapter host work ({name})")
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        _timed(timings, CPUAttentionBackendImpl, "forward", "attention (forward)")
        _timed(timings, CPUAttentionBackendImpl, "do_kv_cache_update", "KV writes")

    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(HERE))
    from vllm_prompts import prompt

    llm = LLM(
        model=str(MODEL),
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=args.prefix_caching,
        seed=0,
    )
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt(0, 64)}], params, use_tqdm=False)
    timings.clear()
    prompts = [{"prompt_token_ids": prompt(1 + i, args.prompt)} for i in range(args.requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return dict(
        seconds=seconds,
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        breakdown=dict(timings),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's prefix cache (on by default, as in vLLM)",
    )
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
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
    results = {}
    for name in ("vllm", "kvattn"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVATTN_")}
        if name == "kvattn":
            env["KVATTN_VLLM"] = "1"
        caching = "--prefix-caching" if args.prefix_caching else "--no-prefix-caching"
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--requests",
                str(args.requests),
                "--prompt",
                str(args.prompt),
                "--new",
                str(args.new),
                caching,
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = results["kvattn"]["seconds"] / results["vllm"]["seconds"]
    same = results["kvattn"]["tokens"] == results["vllm"]["tokens"]
    print(
        f"{args.requests} requests x {args.prompt} prompt tokens, {args.new} new tokens each, "
        f"SmolLM-135M shapes, float32, block 32, prefix caching "
        f"{'on' if args.prefix_caching else 'off'}, this CPU ({os.cpu_count()} cores)"
    )
    for name in ("vllm", "kvattn"):
        print(f"  {name:7s} {results[name]['seconds']:7.2f} s")
        for key, seconds in sorted(results[name]["breakdown"].items()):
            print(f"    {key:38s} {seconds:7.2f} s")
    print(f"  kvattn / vLLM CPU attention: {ratio:.2f}x; greedy tokens identical: {same}")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(dict(args=vars(args), ratio=ratio, same_tokens=same, **results), indent=1)
        )


if __name__ == "__main__":
    main()

"""`make demo`: replay the disaggregated-serving leak (docs/ownership.md section 6.1) and its prevention.

Tenant A fills pages with KV engineered to dominate attention and frees them. Request B reserves
pages for a long prompt, but the prefill side delivers one token of KV and reports success. B decodes
over all its pages. Unchecked, B's answer is built from A's data; checked, the kernel refuses every
page that was not written for B and says so in the same call.
"""

from __future__ import annotations

import os
import time

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import kvattn  # noqa: E402
from kvattn import backends, env  # noqa: E402

PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 16, 2, 8, 64
PROMPT_TOKENS = 256  # what the decode side reserved for


def _backend_for(q, cache, leases) -> str:
    """The backend ``auto`` picks for this decode, after printing why the registry refused others."""
    table, lens, expected = cache.batch(leases)
    args = kvattn.layout.validate_decode(
        q, cache.k_cache, cache.v_cache, table, lens, cache.page_tags, expected
    )
    order = backends.auto_order("decode", q.device)
    for name, reason in backends.explain(args).items():
        state = "available" if reason is None else "refused: " + reason
        named_only = "" if name in order or reason is not None else " (runs only when named)"
        print(f"  backend {name:<10} {state}{named_only}")
    return backends.select(args).NAME


def replay_incident() -> None:
    torch.manual_seed(0)
    dtype = torch.float16
    cache = kvattn.PagedKVCache(
        num_pages=64,
        page_size=PAGE_SIZE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device=DEVICE,
    )
    q_b = torch.randn(1, HEADS, HEAD_DIM, device=DEVICE).to(dtype)

    # Tenant A: KV aligned with B's query (huge logits) and V = 100 everywhere: a loud sentinel.
    lease_a = cache.allocate(PROMPT_TOKENS)
    k_a = (4 * q_b.view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).mean(1)).expand(
        PROMPT_TOKENS, -1, -1
    )
    v_a = torch.full((PROMPT_TOKENS, KV_HEADS, HEAD_DIM), 100.0, device=DEVICE, dtype=dtype)
    cache.append(lease_a, k_a.contiguous(), v_a)
    cache.free(lease_a)  # pages go back to the pool; their bytes stay (nobody zeroes KV)

    # Request B: reserve pages for the whole prompt; the prefill side delivers ONE token of KV.
    lease_b = cache.allocate(PROMPT_TOKENS)
    k_b = torch.randn(1, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    v_b = torch.randn(1, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    cache.append(lease_b, k_b, v_b)
    lease_b.num_tokens = (
        PROMPT_TOKENS  # "transfer done": the decode side believes the full prompt arrived
    )
    reused = len(set(lease_b.pages))
    print(
        f"Pool: {cache.num_free_pages + reused} pages of {PAGE_SIZE} tokens on {DEVICE}; "
        f"request B holds {reused} pages that tenant A freed, 1 token of its own KV."
    )

    order = ", ".join(backends.auto_order("decode", DEVICE))
    print(f"\nBackends for this call (auto takes the first available of {order}):")
    backend = _backend_for(q_b, cache, [lease_b])
    # What B's answer must be: attention over its one token is that token's V, per KV head group.
    truth = v_b.float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    out_u, _ = cache.decode(q_b, [lease_b], check=False)
    out_c, report = cache.decode(q_b, [lease_b])

    def show(label, out):
        err = (out.float() - truth).abs().max().item()
        print(
            f"  {label:<26} mean output {out.float().mean().item():9.3f}   "
            f"max |out - B's own V| = {err:8.3f}"
        )

    print(f"\nDecode of request B ({backend} backend):")
    show("unchecked (trusts table):", out_u)
    show("checked:", out_c)
    print(f"  (tenant A's sentinel V is 100; B's own V has mean {v_b.float().mean().item():.3f})")
    print("\nOwnership report of the checked call:")
    print("  " + report.summary(max_pages=4).replace("\n", "\n  "))
    print(
        f"  pages checked: {int(report.pages_checked.sum())}, refused: "
        f"{int(report.violations.sum())}, reasons: {kvattn.Violation(int(report.reasons[0]))!r}"
    )
    try:
        cache.decode(q_b, [lease_b], on_violation="raise")
    except kvattn.KVOwnershipError as e:
        lines = str(e).splitlines()
        print(
            f"\nWith on_violation='raise' the call raises KVOwnershipError:\n  {lines[0]}\n  "
            f"{lines[1][:96]}..."
        )

    leaked = (out_u.float() - truth).abs().max().item() > 1.0
    clean = torch.allclose(out_c.float(), truth, atol=1e-2) and int(report.violations[0]) == reused
    print(
        f"\nVerdict: unchecked output {'CONTAINS' if leaked else 'does not contain'} tenant A's data; "
        f"checked output {'is' if clean else 'is NOT'} attention over B's own token, "
        f"with {int(report.violations[0])} of {reused} pages reported."
    )
    if not (leaked and clean):
        raise SystemExit("demo: the replay did not behave as the contract says")


def shared_prefix_prefill() -> None:
    """Chunked prefill over a system prompt shared between two leases; then a bookkeeping bug maps a
    foreign page into B's prefix and the extend kernel refuses it."""
    torch.manual_seed(1)
    dtype = torch.float16
    cache = kvattn.PagedKVCache(
        num_pages=32,
        page_size=PAGE_SIZE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device=DEVICE,
    )

    def tokens(n):
        return (
            torch.randn(n, HEADS, HEAD_DIM, device=DEVICE).to(dtype),
            torch.randn(n, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype),
            torch.randn(n, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype),
        )

    system = cache.allocate(0)
    for chunk in (20, 12):  # a 32-token system prompt prefilled in two chunks
        _, report = cache.prefill(*tokens(chunk), [system], [chunk])
    user_b = cache.share_prefix(system, 32)  # B reads the system prompt's pages under its owner
    other = cache.allocate(0)
    cache.prefill(*tokens(16), [other], [16])  # someone else's request
    _, report = cache.prefill(*tokens(8), [user_b], [8])
    print(
        f"\nChunked prefill with a shared prefix ({PAGE_SIZE}-token pages): B's 8 new tokens over "
        f"{len(user_b.pages)} pages, 2 of them the system prompt's -> "
        f"{report.summary()}"
    )
    user_b.pages[1] = other.pages[0]  # bookkeeping bug: a foreign page in B's prefix
    user_b.page_owners[1] = user_b.owner  # ... recorded as if B had written it
    _, report = cache.prefill(*tokens(1), [user_b], [1])
    print(
        "Same request after a foreign page slipped into its prefix -> "
        + report.summary().replace("\n", "; ")
    )


def timing_table() -> None:
    batch, seq_len = (32, 4096) if DEVICE.type == "cuda" else (4, 256)
    cache = kvattn.PagedKVCache(
        num_pages=batch * seq_len // PAGE_SIZE + 1,
        page_size=PAGE_SIZE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float16,
        device=DEVICE,
    )
    leases = []
    for _ in range(batch):
        lease = cache.allocate(seq_len)
        kv = torch.randn(seq_len, KV_HEADS, HEAD_DIM, device=DEVICE).to(torch.float16)
        cache.append(lease, kv, kv)
        leases.append(lease)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE).to(torch.float16)
    table, lens, expected = cache.batch(leases)
    backend = backends.select(
        kvattn.layout.validate_decode(
            q, cache.k_cache, cache.v_cache, table, lens, cache.page_tags, expected
        )
    ).NAME
    reps = 20 if DEVICE.type == "cuda" else 3

    def median_ms(check: bool) -> float:
        cache.decode(q, leases, check=check)  # compile / warm up
        times = []
        for _ in range(reps):
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.decode(q, leases, check=check)
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    unchecked, checked = median_ms(False), median_ms(True)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU"
    print(
        f"\nTiming: decode, batch {batch}, {seq_len} tokens each, {HEADS}/{KV_HEADS} heads, "
        f"head_dim {HEAD_DIM}, fp16, page {PAGE_SIZE}; device {name}, backend {backend}, "
        f"median of {reps} (host clock, includes launch)"
    )
    print(f"  {'variant':<10} {'ms':>10}")
    print(f"  {'unchecked':<10} {unchecked:10.3f}")
    print(f"  {'checked':<10} {checked:10.3f}   ratio {checked / unchecked:.3f}")
    if DEVICE.type == "cpu":
        print(
            "  These are CPU timings of the Triton interpreter: they say NOTHING about GPU speed.\n"
            "  GPU figures exist only in recorded runs under benchmarks/results/."
        )


def main() -> None:
    print(env.report() + "\n")
    replay_incident()
    shared_prefix_prefill()
    timing_table()


if __name__ == "__main__":
    main()

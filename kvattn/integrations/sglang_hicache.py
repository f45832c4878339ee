"""Where kvattn's checked receive rides on SGLang's hierarchical cache (HiCache).

With ``--enable-hierarchical-cache`` SGLang backs a radix node's device pages up to host memory
(on insert under a write-through policy, at eviction under write-back) and, when a later request
matches a node whose device pages were evicted since, loads the host copy back into freshly
allocated device pages. Nothing on that path checks the bytes that come back: a restore that
misses a cross-stream sync (vLLM #45704), a load-back still writing pages a later request matched
(SGLang #44070) or a host copy changed while offloaded hands the reader wrong KV under its own
prefix, and it answers.

Under kvattn a restored page becomes readable only through the checked receive
(docs/transfer.md), with the host pool as the transport:

- **Backup** (around ``HiCacheController.start_writing``): once the copy of the queued write
  operations has completed, each device page copied is attested from the ledger's tags for the
  owner that wrote it, with a digest of its bytes over every layer in the context of the writer's
  prefix digest (a radix node holds full pages whose writer the ledger remembers); the attestation
  is kept by host page, replacing that host page's earlier one. A page the ledger cannot name a
  writer for is kept as not attested.
- **Restore** (around ``HiCacheController.start_loading``, which SGLang calls before the forward
  that reads the pages): once the copy has completed, each destination page is verified against
  the attestation of the host page it came from. A page that verifies is committed WRITTEN for its
  writer and becomes that prefix's content again, so the readers' prefix-hit rule accepts it for
  the writer's prefix only. A page without an attestation, or whose bytes differ, stays FREE: the
  request that reads it fails at attention, saying why, and only that request.

On a GPU each hook waits for its copy to finish before reading the pages: the restore gives up
SGLang's overlap of the load-back with the forward's first layers (kvattn's attention must not
read a layer before its copy landed, which SGLang's per-layer wait does not cover).

Host pages reach the device only through ``start_loading``; pages a storage backend (L3)
prefetches are refused at setup (:func:`kvattn.integrations.sglang.attach`), as they carry no
attestation.
"""

from __future__ import annotations

from . import sglang as integration


def _ops(queue) -> list[tuple[list[int], list[int]]]:
    """(host pages, device pages) of each queued operation, pairwise (SGLang keeps page-aligned
    token slots, host and device aligned element by element)."""
    return [
        (op.host_indices.reshape(-1).tolist(), op.device_indices.reshape(-1).tolist())
        for op in queue
    ]


def _pages(ops, page_size: int) -> tuple[list[int], list[int]]:
    hosts, devices = [], []
    for host, device in ops:
        hosts += [h // page_size for h in host[::page_size]]
        devices += [d // page_size for d in device[::page_size]]
    return hosts, devices


def _wait(acks) -> None:
    """The copy the last queued acknowledgement stands for has finished (a no-op on CPU)."""
    if acks:
        acks[-1].finish_event.synchronize()


def backup_hook(original, controller, *args, **kwargs):
    """Around ``HiCacheController.start_writing``: attest the pages the queued writes copy."""
    state = integration.state_for_pool(controller.mem_pool_device)
    ops = _ops(controller.write_queue) if state is not None else []
    result = original(controller, *args, **kwargs)
    if ops:
        _wait(controller.ack_write_queue)
        state.attest_backup(*_pages(ops, state.page_size))
    return result


def restore_hook(original, controller, *args, **kwargs):
    """Around ``HiCacheController.start_loading``: verify and commit the pages the queued loads
    copy, before the forward that reads them."""
    state = integration.state_for_pool(controller.mem_pool_device)
    ops = _ops(controller.load_queue) if state is not None else []
    result = original(controller, *args, **kwargs)
    if ops:
        _wait(controller.ack_load_queue)
        state.commit_restore(*_pages(ops, state.page_size))
    return result


# (target, hook) pairs the plugin registers.
HOOKS = (
    ("sglang.srt.managers.cache_controller.HiCacheController.start_writing", backup_hook),
    ("sglang.srt.managers.cache_controller.HiCacheController.start_loading", restore_hook),
)

__all__ = ["HOOKS", "backup_hook", "restore_hook"]

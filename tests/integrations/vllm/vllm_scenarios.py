"""The vLLM suites' shared scenarios, importable by every test file of this folder: the fixed
runs of vllm_driver.py (:class:`Runs`, each computed once per test run and shared across the
xdist workers), its bookkeeping faults and their victims."""

from __future__ import annotations

import shutil

from kvattn_testing import engines
from kvattn_testing.engines import ROOT

DRIVER = ROOT / "tests" / "integrations" / "vllm" / "vllm_driver.py"

FAULTS = ("foreign_entry", "early_free", "lost_prefill", "stale_prefix")
VICTIM = {
    "foreign_entry": "victim",
    "early_free": "victim",
    "lost_prefill": "victim",
    "stale_prefix": "reader",
}


class Runs(engines.Runs):
    """The fixed scenarios of vllm_driver.py."""

    def main(self) -> dict:
        return self.shared(
            "main",
            lambda: self.drive(
                [("main-stock", DRIVER, False, ("main",)), ("main-kvattn", DRIVER, True, ("main",))]
            ),
        )

    def mla(self) -> dict:
        """vllm_driver.py's ``mla`` scenario on a DeepSeek-V2-style model with DeepSeek's
        512 + 64 latent row (vLLM's CPU MLA kernel takes no other), on both attentions."""
        return self.shared(
            "mla",
            lambda: self.drive(
                [("mla-stock", DRIVER, False, ("mla",)), ("mla-kvattn", DRIVER, True, ("mla",))],
                family="deepseek-v2-576",
            ),
        )

    def disaggregated(self) -> dict:
        def compute():
            stores = {b: self.dir / f"store-{b}" for b in ("stock", "kvattn")}
            for store in stores.values():
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir()
            produced = self.drive(
                [(f"produce-{b}", DRIVER, b == "kvattn", ("produce", stores[b])) for b in stores]
            )
            # Each decode instance loads a copy: vLLM's debug connector also stores what a
            # consumer computes, which must not reach the other run.
            copies = {}
            for b, store in stores.items():
                copies[b] = self.dir / f"load-{b}"
                shutil.rmtree(copies[b], ignore_errors=True)
                shutil.copytree(store, copies[b])
            decoded = self.drive(
                [(f"decode-{b}", DRIVER, b == "kvattn", ("decode", copies[b])) for b in stores]
                + [("local", DRIVER, False, ("local",))]
            )
            return {**produced, **decoded}

        return self.shared("disaggregated", compute)

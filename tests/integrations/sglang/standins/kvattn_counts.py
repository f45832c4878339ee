"""Test-only: after each forward of a kvattn engine, its ledger's counts and failures go to the
JSON file ``KVATTN_TEST_COUNTS`` (the engine suite reads them; a server process keeps them in
memory only). Installed by ``sitecustomize`` when that variable is set."""

from __future__ import annotations

import json
import os


def install(module) -> None:
    end_forward = module.SGLangOwnership.end_forward
    path = os.environ["KVATTN_TEST_COUNTS"]

    def end_forward_hook(self, *args, **kwargs):
        try:
            return end_forward(self, *args, **kwargs)
        finally:
            record = dict(
                self.counts,
                forwards=self.forwards,
                pages_checked=self.pages_checked,
                failures=[name for name, _ in self.failures],
            )
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)

    module.SGLangOwnership.end_forward = end_forward_hook

"""A DeepSeek-V2-style model (multi-head latent attention) through SGLang's engine and HTTP
server under kvattn, against the same server on SGLang's ``torch_native`` attention: the
differential workloads of test_sglang_engine.py (seed 0, page size 16; sglang_engine.py runs
them) on SGLang's MLA pool, one latent row per token (a 32-dim latent, the value, and a 16-dim
RoPE key) read by every query head.

Under kvattn every prefill and decode of the model takes SGLang's absorbed MLA path, whose
attention is kvattn's MLA extend and decode over the latent pool, and the latent rows are
written through the pool's ``set_kv_buffer`` under each request's owner. SGLang's own attention
runs the same path (the stand-ins' ``sitecustomize`` gives it to ``torch_native``, whose MHA path
fails on a latent cache here). Clean, every request's greedy tokens are the same on both
servers (the same as transformers' ``generate`` for this model, checked when it was written);
with each bookkeeping fault, the victim alone fails under kvattn. Then HiCache's offload lane:
latent rows backed up to host memory and loaded back are verified before they are read.
"""

from __future__ import annotations

import pytest
import sglang_engine as engine

from kvattn.conformance import sglang as conformance

pytestmark = pytest.mark.slow

if engine.why_no_sglang():
    pytest.skip(engine.why_no_sglang(), allow_module_level=True)

SEEDS = (0,)


@pytest.fixture(scope="module")
def servers():
    suite = engine.mla()["servers"]["servers"]
    return suite["torch_native-p16"], suite["kvattn-p16"]


def test_clean_workloads_give_sglang_s_tokens_and_refuse_nothing(servers):
    engine.assert_clean(*servers, SEEDS)


@pytest.mark.parametrize("fault", tuple(conformance.FAULTS))
def test_a_fault_fails_the_victim_and_only_the_victim(servers, fault):
    engine.assert_only_the_victim_fails(*servers, fault, SEEDS)


def test_a_latent_prefix_loaded_back_from_host_memory_is_read_once_verified():
    """HiCache's lane (test_sglang_engine.py's) on the MLA pool: the latent rows backed up to
    host memory and loaded back are verified against their attestation before they are read."""
    engine.assert_offload(engine.mla()["offload"])

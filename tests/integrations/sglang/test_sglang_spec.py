"""SGLang's n-gram speculative decoding under kvattn, through SGLang's engine and HTTP server,
against the same server on SGLang's ``torch_native`` attention: the differential workloads of
test_sglang_engine.py (one seed) with ``--speculative-algorithm NGRAM`` (four draft tokens a verify
forward; at page size 16 draft chains, SGLang's limit there; at page size 1 draft trees of up to
10 branches), on the narrow-weight Llama, whose greedy answers loop so that drafts are accepted.

Under kvattn each verify forward writes its draft tokens under the request's owner and reads them
through kvattn's extend with the draft tree as its custom mask; the rows SGLang moves into place
after acceptance (``move_kv_cache``, past ``set_kv_buffer``) move only within pages the request
holds. SGLang's own attention has no verify path on a CPU; the test stand-ins give torch-native
one (sitecustomize.py), and the few sgl_kernel ops n-gram decoding calls here are torch stand-ins.
Clean, every request's greedy tokens are the same on both servers and nothing is refused; with
each bookkeeping fault (the decode-time one now hits verify forwards), the victim alone fails.
"""

from __future__ import annotations

import pytest
import sglang_engine as engine

from kvattn.conformance import sglang as conformance

pytestmark = pytest.mark.slow

if engine.why_no_sglang():
    pytest.skip(engine.why_no_sglang(), allow_module_level=True)

SEEDS = engine.SPEC_SEEDS
PAGE_SIZES = tuple(engine.NGRAM_BREADTH)


@pytest.fixture(scope="module")
def suite():
    return engine.spec()


def _servers(suite, page_size):
    servers = suite[str(page_size)]
    return servers[f"torch_native-p{page_size}"], servers[f"kvattn-p{page_size}"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_clean_workloads_give_sglang_s_tokens_and_refuse_nothing(suite, page_size):
    stock, mine = _servers(suite, page_size)
    engine.assert_clean(stock, mine, SEEDS)
    counts = mine["counts"]
    assert counts.get("refused_moves", 0) == 0
    if page_size == 1:  # draft trees: accepted rows past their first sibling move into place
        assert counts.get("moved_rows", 0) > 0
    print(f"\nn-gram at page size {page_size}: kvattn's counts", counts)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("fault", tuple(conformance.FAULTS))
def test_a_fault_fails_the_victim_and_only_the_victim(suite, page_size, fault):
    engine.assert_only_the_victim_fails(*_servers(suite, page_size), fault, SEEDS)

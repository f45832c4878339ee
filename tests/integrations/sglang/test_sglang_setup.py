"""The SGLang backend's version refusal and its receivers' accounting of what arrived. Plain kvattn
code (kvattn.integrations.sglang): no SGLang install needed, unlike test_sglang.py."""


def test_sglang_backend_refuses_other_versions_naming_the_tested_one():
    import pytest

    from kvattn.integrations import sglang
    sglang.check_version("0.5.23")
    with pytest.raises(RuntimeError, match=r"SGLang 0\.5\.22 is not supported.*\['0\.5\.23'\]"):
        sglang.check_version("0.5.22")


def test_sglang_receivers_account_for_what_arrived_not_for_success():
    from types import SimpleNamespace

    from kvattn.integrations import sglang

    class FakeKVReceiver:
        pass

    class MooncakeKVReceiver:
        pass
    assert sglang.received_tokens(FakeKVReceiver())[0] == 0
    count, how = sglang.received_tokens(MooncakeKVReceiver())
    assert count == 0 and "reports completion, not what arrived" in how
    counted = SimpleNamespace(kvattn_received_tokens=lambda: 7)
    assert sglang.received_tokens(counted) == (7, "SimpleNamespace counted 7 token(s) arrived")


"""The SGLang backend's version refusal, its receivers' accounting of what arrived, the transfer
attestation's frame and the disaggregation modes refused at setup. Plain kvattn code
(kvattn.integrations.sglang, sglang_transfer): no SGLang install needed, unlike test_sglang.py."""


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


def test_an_attestation_parses_into_pages_and_lengths():
    import json

    from kvattn.integrations import sglang_transfer
    from kvattn.transfer import DigestKey

    frame = json.dumps({"v": 1, "pages": [[0, 16, "ab"], [3, 5, "cd"]]}).encode()
    assert sglang_transfer.parse([frame]) == ({0: [16, "ab"], 3: [5, "cd"]}, None, None)
    assert sglang_transfer.parse([frame, frame])[0] == {0: [16, "ab"], 3: [5, "cd"]}
    # A keyed frame (version 2) gives its digests' key.
    key = DigestKey.new()
    keyed = json.dumps({"v": 2, "key": key.hex(), "pages": [[1, 4, "ef"]]}).encode()
    assert sglang_transfer.parse([keyed]) == ({1: [4, "ef"]}, key, None)


def test_a_missing_conflicting_or_malformed_attestation_proves_nothing():
    """The twin: none, two that disagree, or one that is not an attestation give no page, and
    say why (the request then fails at attention, its pages RESERVED)."""
    import json

    from kvattn.integrations import sglang_transfer

    good = json.dumps({"v": 1, "pages": [[0, 16, "ab"]]}).encode()
    assert sglang_transfer.parse([]) == (
        None,
        None,
        "no attestation arrived from the prefill instance "
        "(one without kvattn, or a transfer it did not "
        "attest)",
    )
    other = json.dumps({"v": 1, "pages": [[0, 8, "ab"]]}).encode()
    assert sglang_transfer.parse([good, other]) == (
        None,
        None,
        "2 different attestations arrived for one transfer",
    )
    for bad in (
        b"",
        b"[]",
        b"{",
        json.dumps({"v": 3, "pages": []}).encode(),
        json.dumps({"v": True, "pages": []}).encode(),
        json.dumps({"v": 2, "pages": []}).encode(),  # keyed without its key
        json.dumps({"v": 2, "key": "ab" * 31, "pages": []}).encode(),
        json.dumps({"v": 2, "key": 7, "pages": []}).encode(),
        json.dumps({"v": 1}).encode(),
        json.dumps({"v": 1, "pages": [[-1, 1, "a"]]}).encode(),
        json.dumps({"v": 1, "pages": [[True, 1, "a"]]}).encode(),
        json.dumps({"v": 1, "pages": [[0, 1, "a"], [0, 2, "b"]]}).encode(),
        json.dumps({"v": 1, "pages": [["0", 1, "a"]]}).encode(),
        json.dumps({"v": 1, "pages": [[]]}).encode(),
    ):
        assert sglang_transfer.parse([bad]) == (None, None, "a malformed attestation arrived"), bad


def test_disaggregation_modes_the_attestation_does_not_cover_are_refused(monkeypatch):
    from types import SimpleNamespace

    from kvattn.integrations import sglang

    args = SimpleNamespace(tp_size=1, pp_size=1)
    assert sglang._disaggregation_refusals("decode", "mooncake", args) == []
    assert sglang._disaggregation_refusals("prefill", "fake", args) == []
    refused = sglang._disaggregation_refusals(
        "decode", "nixl", SimpleNamespace(tp_size=2, pp_size=2)
    )
    assert any("transfer backend 'nixl'" in r for r in refused)
    assert any("tensor parallelism" in r for r in refused)
    assert any("pipeline parallelism" in r for r in refused)
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    assert any(
        "staging buffers" in r for r in sglang._disaggregation_refusals("prefill", "mooncake", args)
    )


def test_a_phase_on_another_attention_backend_is_refused():
    """SGLang's split backends: a prefill or decode phase named to another backend would read the
    cache unchecked; unset or kvattn's, both phases are kvattn's."""
    from types import SimpleNamespace

    from kvattn.integrations import sglang

    for unset in (dict(), dict(prefill_attention_backend=None, decode_attention_backend="kvattn")):
        assert sglang._phase_refusals(SimpleNamespace(**unset)) == []
    refused = sglang._phase_refusals(
        SimpleNamespace(prefill_attention_backend="fa3", decode_attention_backend="torch_native")
    )
    assert [r.split(" (")[0] for r in refused] == [
        "--prefill-attention-backend fa3",
        "--decode-attention-backend torch_native",
    ]


def test_hicache_is_taken_where_the_checked_restore_covers_it():
    """Host-memory HiCache runs under kvattn (its restores are verified); a storage backend,
    buffer-only host memory and HiSparse fill device pages past that check and are refused."""
    from types import SimpleNamespace

    from kvattn.integrations import sglang

    host = dict(hicache_storage_backend=None, hicache_host_memory_mode="cache")
    assert sglang._hicache_refusals(SimpleNamespace(**host, enable_hisparse=False)) == []
    refused = sglang._hicache_refusals(
        SimpleNamespace(
            hicache_storage_backend="file",
            hicache_host_memory_mode="buffer_only",
            enable_hisparse=True,
        )
    )
    assert [r.split(" (")[0] for r in refused] == [
        "a HiCache storage backend",
        "HiCache host memory mode 'buffer_only'",
        "HiSparse",
    ]


def test_a_frame_is_kept_for_a_live_room_and_dropped_with_it(monkeypatch):
    """The decode side keeps an attestation frame only while its room is live in the transfer
    manager, and drops it when the room's receiver is cleared (a late frame of an aborted or
    finished transfer never reaches a later request of the same room)."""
    import json
    from types import SimpleNamespace

    from kvattn.integrations import sglang_transfer

    monkeypatch.setattr(sglang_transfer, "_ledgers", {1: object()})
    monkeypatch.setattr(sglang_transfer, "_arrived", {})
    payload = json.dumps({"v": 1, "pages": [[0, 16, "ab"]]}).encode()
    manager = SimpleNamespace(request_status={7: 1})

    def not_a_status(manager, msg):
        raise AssertionError("an attestation frame reached SGLang's status parser")

    for room in (7, 8):  # 8: a room the manager no longer knows
        frame = [sglang_transfer.ATTEST_TAG, str(room).encode(), b"0", payload]
        assert sglang_transfer.parse_status_hook(not_a_status, manager, frame) is None
    assert sglang_transfer._arrived == {7: [payload]}
    sglang_transfer.receiver_clear_hook(lambda receiver: None, SimpleNamespace(bootstrap_room=7))
    assert sglang_transfer._arrived == {}
    # A status frame goes to SGLang's own parser.
    assert (
        sglang_transfer.parse_status_hook(lambda m, msg: "status", manager, [b"7", b"4", b"0"])
        == "status"
    )


def test_a_frame_on_a_decode_without_kvattn_is_dropped(monkeypatch):
    """The twin: with no kvattn ledger in the process (a stock decode that loaded the plugin), the
    frame is dropped like any status SGLang cannot parse, and nothing is kept."""
    import json
    from types import SimpleNamespace

    from kvattn.integrations import sglang_transfer

    monkeypatch.setattr(sglang_transfer, "_ledgers", {})
    monkeypatch.setattr(sglang_transfer, "_arrived", {})
    frame = [sglang_transfer.ATTEST_TAG, b"7", b"0", json.dumps({"v": 1, "pages": []}).encode()]
    manager = SimpleNamespace(request_status={7: 1})
    assert sglang_transfer.parse_status_hook(lambda m, msg: "status", manager, frame) is None
    assert sglang_transfer._arrived == {}

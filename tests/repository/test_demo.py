"""`make demo`'s replay and prefix scenes run and reach their verdicts (the demo exits non-zero when
the unchecked call does not leak or the checked call is not clean)."""

from kvattn import demo


def test_incident_replay_shows_the_leak_and_its_refusal(capsys):
    demo.replay_incident()
    out = capsys.readouterr().out
    assert "unchecked output CONTAINS tenant A's data" in out
    assert "checked output is attention over B's own token" in out


def test_shared_prefix_scene_refuses_the_foreign_page(capsys):
    demo.shared_prefix_prefill()
    out = capsys.readouterr().out
    assert "no violation" in out and "OWNER_MISMATCH" in out

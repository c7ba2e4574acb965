"""Which tree produced a record (`benchmarks/provenance.py`): the caller's JFP8_COMMIT / JFP8_DIRTY
win over git (a GPU machine's copy carried a stale .git), and git answers where they are unset."""

import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import provenance  # noqa: E402


def test_the_callers_word_wins_over_git(monkeypatch):
    monkeypatch.setattr(provenance, "git", lambda *argv: "7ab8f75\n" if argv[0] == "rev-parse" else " M x.py\n")
    monkeypatch.setenv("JFP8_COMMIT", "3009e9e")
    monkeypatch.setenv("JFP8_DIRTY", "0")
    assert provenance.commit_info() == {"commit": "3009e9e", "dirty": False}
    monkeypatch.setenv("JFP8_DIRTY", "1")
    assert provenance.commit_info() == {"commit": "3009e9e", "dirty": True}
    monkeypatch.delenv("JFP8_COMMIT")
    monkeypatch.delenv("JFP8_DIRTY")
    assert provenance.commit_info() == {"commit": "7ab8f75", "dirty": True}  # git's


def test_neither_says(monkeypatch):
    monkeypatch.setattr(provenance, "git", lambda *argv: None)
    monkeypatch.delenv("JFP8_COMMIT", raising=False)
    monkeypatch.delenv("JFP8_DIRTY", raising=False)
    assert provenance.commit_info() == {"commit": None, "dirty": None}

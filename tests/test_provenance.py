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


def test_changed_records_do_not_make_the_tree_dirty(monkeypatch, tmp_path):
    """Records a run rewrites (benchmarks/results, experiments/results) are not the code that
    produced the next one; any other change is."""
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for rel in ("benchmarks/results/r.json", "experiments/results/s.json", "code.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("0")
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "0"],
                   check=True)
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.delenv("JFP8_COMMIT", raising=False)
    monkeypatch.delenv("JFP8_DIRTY", raising=False)
    (tmp_path / "benchmarks/results/r.json").write_text("1")
    (tmp_path / "experiments/results/s.json").write_text("1")
    assert provenance.commit_info()["dirty"] is False
    (tmp_path / "code.py").write_text("1")
    assert provenance.commit_info()["dirty"] is True

"""Which tree produced a record: git's commit and dirty flag, else what the caller's environment
says (a GPU machine's copy of the tree has no .git; docs/gpu.md's commands pass JFP8_COMMIT and
JFP8_DIRTY). No jax: the GPU session imports it before any device is touched."""

from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent
# Committed records do not make the tree that writes the next one dirty: a run that rewrites
# several records (step_model.py over its presets) would otherwise mark all but its first.
RESULTS_EXCLUDED = (":(exclude)benchmarks/results", ":(exclude)experiments/results")


def git(*argv: str) -> str | None:
    """`git argv...`'s stdout in the repository, or None when git fails or is missing."""
    try:
        r = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def commit_info() -> dict:
    """{"commit", "dirty"}: what the caller's environment says (`JFP8_COMMIT`, `JFP8_DIRTY`) where
    it says it, else git's; None where neither says. The environment wins: the GPU machine's copy
    of the tree carried a .git from the session's start (an H100, 2026-11-28: the record said
    7ab8f75 and dirty for a tree that was 3009e9e, clean, as JFP8_COMMIT said). Changed files under
    `RESULTS_EXCLUDED` (records) do not count as dirty."""
    commit, flag = os.environ.get("JFP8_COMMIT") or None, os.environ.get("JFP8_DIRTY")
    if commit is None:
        head = git("rev-parse", "HEAD")
        commit = head.strip() if head else None
    if flag is not None and flag != "":
        dirty = flag not in ("0", "false")
    else:
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *RESULTS_EXCLUDED)
        dirty = bool(status.strip()) if status is not None else None
    return {"commit": commit, "dirty": dirty}

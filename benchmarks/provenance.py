"""Which tree produced a record: git's commit and dirty flag, else what the caller's environment
says (a GPU machine's copy of the tree has no .git; docs/gpu.md's commands pass JFP8_COMMIT and
JFP8_DIRTY). No jax: the GPU session imports it before any device is touched."""

from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent


def git(*argv: str) -> str | None:
    """`git argv...`'s stdout in the repository, or None when git fails or is missing."""
    try:
        r = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def commit_info() -> dict:
    """{"commit", "dirty"}: None where neither git nor the environment says."""
    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    flag = os.environ.get("JFP8_DIRTY")
    return {"commit": head.strip() if head else os.environ.get("JFP8_COMMIT") or None,
            "dirty": bool(status.strip()) if status is not None else (
                None if flag is None else flag not in ("0", "", "false"))}

"""Every Python block of README.md and docs/*.md runs as shown.

Each ```python block runs alone, in a fresh namespace and an empty working directory, as a reader
would paste it. Two markers, an HTML comment on the line right before a block, change that:

    <!-- docs-test: skip (why: e.g. needs a Hopper GPU) -->  the block is reported as skipped
    <!-- docs-test: continues -->                            the block runs after the previous
                                                             one of the file, in its namespace
                                                             (the text must say they are one)

A block with a `continues` successor runs as part of that sequence, not alone.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: its file, first code line (1-based), code and marker."""

    file: str
    line: int
    code: str
    skip: str | None = None  # the reason
    continues: bool = False


def python_blocks(text: str, file: str) -> list[Block]:
    """The ```python blocks of a markdown text, with their docs-test markers."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{file}:{i + 1}: a code block is never closed")
        if fence.group(1) in ("python", "py"):
            marker = _MARKER.match(lines[i - 1]) if i else None
            skip, continues = None, False
            if marker:
                what = marker.group(1)
                if m := re.fullmatch(r"skip\s*\((.+)\)", what):
                    skip = m.group(1)
                elif what == "continues":
                    continues = True
                else:
                    raise ValueError(
                        f"{file}:{i}: unknown marker {what!r}; use 'docs-test: skip (reason)' or "
                        "'docs-test: continues'"
                    )
            if continues and not blocks:
                raise ValueError(f"{file}:{i}: 'continues' on the file's first Python block")
            blocks.append(Block(file, i + 2, "\n".join(lines[i + 1 : end]) + "\n", skip, continues))
        i = end + 1
    return blocks


def sequences(blocks: list[Block]) -> list[list[Block]]:
    """Blocks grouped into what runs together: a block and the `continues` blocks after it."""
    out: list[list[Block]] = []
    for b in blocks:
        if b.continues:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def _all_sequences() -> list[list[Block]]:
    return [s for doc in DOCS for s in sequences(python_blocks(doc.read_text(), doc.relative_to(ROOT).as_posix()))]


@pytest.mark.parametrize("blocks", _all_sequences(), ids=lambda s: f"{s[0].file}:{s[0].line}")
def test_docs_block_runs_as_shown(blocks, tmp_path, monkeypatch):
    reasons = [b.skip for b in blocks if b.skip]
    if reasons:
        pytest.skip(f"marked in the docs: {'; '.join(reasons)}")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict = {"__name__": "__docs__"}
    for b in blocks:
        # Compiled with the markdown's name and line numbers, so a failure points into the docs.
        code = compile("\n" * (b.line - 1) + b.code, f"{ROOT / b.file}", "exec")
        exec(code, namespace)  # noqa: S102 - running the docs is the point


def test_every_doc_has_its_blocks_found():
    """The README's and docs/autocast.md's blocks are collected (a broken fence would hide them)."""
    found = {s[0].file for s in _all_sequences()}
    assert {"README.md", "docs/autocast.md"} <= found


def test_markers_are_read():
    text = "\n".join([
        "```python", "a = 1", "```",
        "<!-- docs-test: continues -->", "```python", "b = a + 1", "```",
        "```bash", "echo not python", "```",
        "<!-- docs-test: skip (needs a Hopper GPU) -->", "```python", "import nothing", "```",
    ])
    blocks = python_blocks(text, "x.md")
    assert [(b.line, b.skip, b.continues) for b in blocks] == [
        (2, None, False), (6, None, True), (13, "needs a Hopper GPU", False)]
    assert [[b.line for b in s] for s in sequences(blocks)] == [[2, 6], [13]]
    with pytest.raises(ValueError, match="unknown marker"):
        python_blocks("<!-- docs-test: skipp -->\n```python\nx = 1\n```\n", "x.md")
    with pytest.raises(ValueError, match="first Python block"):
        python_blocks("<!-- docs-test: continues -->\n```python\nx = 1\n```\n", "x.md")
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n", "x.md")

"""Lowered Mosaic GPU kernels kept on disk (`pallas_kernels.kernel_cache`): a second process parses
back what the first lowered, and gets the payloads a fresh lowering gives; anything that could
change a lowering is another entry; damaged, foreign or unwritable entries fall back to lowering.
Checked on the CUDA lowering, which runs on this CPU."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from helpers import REPO
from pallas_kernels import _mgpu, kernel_cache

# Lowers a quantizer pair and a GEMM (three kernels) for CUDA; prints the kernels' payload hashes
# and the counters. The same text runs in this process and in a child.
PROGRAM = """
import json, re, jax, jax.numpy as jnp, jfp8
from pallas_kernels import _mgpu, kernel_cache

def fn(x, w):
    x, w = x * 1, w * 1
    qx = jfp8.quantize(x, impl="mosaic")
    qw = jfp8.quantize(w, (128, 128), impl="mosaic")
    return jfp8.scaled_matmul(qx, qw, impl="mosaic")

def run():
    text = _mgpu.lower_for_cuda(fn, jax.ShapeDtypeStruct((256, 384), jnp.bfloat16),
                                jax.ShapeDtypeStruct((128, 384), jnp.float32))
    return re.findall(r'kernel_hash = "((?:[^"\\\\]|\\\\.)*)"', text)
"""


def _fresh_tables(monkeypatch, directory) -> None:
    monkeypatch.setenv(kernel_cache.ENV, str(directory))
    monkeypatch.setattr(_mgpu, "_LOWERED", collections.OrderedDict())
    monkeypatch.setattr(kernel_cache, "STATS", collections.Counter())
    monkeypatch.setattr(_mgpu, "LOWERING_STATS", collections.Counter())


def test_a_second_process_parses_the_first_ones_kernels_back(tmp_path, monkeypatch):
    _fresh_tables(monkeypatch, tmp_path)
    scope: dict = {}
    exec(PROGRAM, scope)
    fresh = scope["run"]()
    assert len(fresh) == 3 and kernel_cache.STATS["stored"] == 3 and _mgpu.LOWERING_STATS["lowered"] == 3
    assert len(list(tmp_path.glob("*.json"))) == 3

    child = PROGRAM + "\nprint(json.dumps([run(), dict(_mgpu.LOWERING_STATS), dict(kernel_cache.STATS)]))\n"
    env = {**os.environ, kernel_cache.ENV: str(tmp_path), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    hashes, lowerings, stats = json.loads(out.strip().splitlines()[-1])
    assert lowerings == {"reused": 3} and stats == {"loaded": 3}, (lowerings, stats)
    assert hashes == fresh  # the payloads a fresh lowering gave


def _lower_once(monkeypatch, directory) -> list[str]:
    _fresh_tables(monkeypatch, directory)
    scope: dict = {}
    exec(PROGRAM, scope)
    return scope["run"]()


def test_what_could_change_a_lowering_is_another_entry(tmp_path, monkeypatch):
    first = _lower_once(monkeypatch, tmp_path)
    assert _lower_once(monkeypatch, tmp_path) == first and kernel_cache.STATS["loaded"] == 3

    # another source tree (or jax version: both in the fingerprint)
    monkeypatch.setattr(kernel_cache, "_source_fingerprint", lambda: "another source tree")
    assert _lower_once(monkeypatch, tmp_path) == first
    assert kernel_cache.STATS["loaded"] == 0 and _mgpu.LOWERING_STATS["lowered"] == 3
    monkeypatch.undo()

    # a Mosaic GPU setting in the environment
    monkeypatch.setenv("MOSAIC_GPU_SOME_SETTING", "1")
    assert _lower_once(monkeypatch, tmp_path) == first
    assert kernel_cache.STATS["loaded"] == 0 and kernel_cache.STATS["stored"] == 3
    assert len(list(tmp_path.glob("*.json"))) == 9  # three lowerings of three kernels


def test_a_damaged_or_foreign_entry_is_lowered_again(tmp_path, monkeypatch):
    first = _lower_once(monkeypatch, tmp_path)
    files = sorted(tmp_path.glob("*.json"))
    files[0].write_text("{not json")
    record = json.loads(files[1].read_text())
    files[1].write_text(json.dumps({**record, "key": record["key"] + " (another kernel's)"}))
    assert _lower_once(monkeypatch, tmp_path) == first
    assert kernel_cache.STATS["unreadable"] == 2 and kernel_cache.STATS["loaded"] == 1
    assert _mgpu.LOWERING_STATS["lowered"] == 2 and kernel_cache.STATS["stored"] == 2  # rewritten
    assert _lower_once(monkeypatch, tmp_path) == first and kernel_cache.STATS["loaded"] == 3


def test_an_unwritable_folder_lowers_as_usual(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    first = _lower_once(monkeypatch, blocker / "kernels")  # cannot be created under a file
    assert len(first) == 3 and kernel_cache.STATS["write_failed"] == 3 and kernel_cache.STATS["stored"] == 0
    said = capsys.readouterr().out
    assert said.count("not kept") == 1 and kernel_cache.ENV in said


def test_a_key_without_a_stable_text_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    entry = (("op", object()), 0, "NVIDIA H100 80GB HBM3", 132)
    rest = ((1, 1, 1), (128, 1, 1), (jax.ShapeDtypeStruct((4,), jnp.float32),), None, ())
    assert not kernel_cache.store(entry, entry[2], b"module", rest)
    assert kernel_cache.load(entry, entry[2]) is None and not list(tmp_path.iterdir())
    keyed = (("op", 1), 0, "NVIDIA H100 80GB HBM3", 132)
    assert kernel_cache.store(keyed, keyed[2], b"module", rest)
    bytecode, (grid, block, outs, profiler, scratch) = kernel_cache.load(keyed, keyed[2])
    assert (bytecode, grid, block, profiler, scratch) == (b"module", (1, 1, 1), (128, 1, 1), None, ())
    assert outs == (jax.ShapeDtypeStruct((4,), jnp.float32),)


def test_where_it_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    monkeypatch.setattr(kernel_cache, "_directory", None)
    assert kernel_cache.directory() is None  # off unless asked for
    assert kernel_cache.set_directory(tmp_path) == tmp_path
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "mine"))
    assert kernel_cache.directory() == tmp_path / "mine"  # the environment wins
    monkeypatch.setenv(kernel_cache.ENV, "")
    assert kernel_cache.directory() is None
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    monkeypatch.setenv("JFP8_KERNEL_LOCATIONS", "1")  # each lowering keeps its own locations
    assert kernel_cache.directory() is None


def test_the_training_scripts_keep_kernels_beside_the_compile_cache(tmp_path):
    code = ("import json\nfrom jfp8.train import compile_cache\nfrom pallas_kernels import kernel_cache\n"
            "compile_cache.enable()\nprint(json.dumps(str(kernel_cache.directory())))\n")
    base = {k: v for k, v in os.environ.items()
            if k not in ("JFP8_COMPILE_CACHE", kernel_cache.ENV, "JAX_COMPILATION_CACHE_DIR")}
    run = lambda env: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], cwd=REPO, env={**base, **env}, capture_output=True, text=True, check=True,
        timeout=300).stdout.strip().splitlines()[-1])
    assert run({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "jfp8" / "mosaic-kernels")
    assert run({"XDG_CACHE_HOME": str(tmp_path), kernel_cache.ENV: str(tmp_path / "k")}) == str(tmp_path / "k")
    assert run({"XDG_CACHE_HOME": str(tmp_path), "JFP8_COMPILE_CACHE": "0"}) == "None"


def test_the_folder_is_trimmed_least_recently_used_first(tmp_path, monkeypatch):
    for i in range(10):
        path = tmp_path / f"{i:02d}.json"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    os.utime(tmp_path / "00.json")  # read back just now: the most recently used
    assert kernel_cache.trim(tmp_path, limit=10_000) == 0  # at the limit: nothing to do
    assert kernel_cache.trim(tmp_path, limit=9_999) == 3  # down to 80 %: the three oldest go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00.json", *(f"{i:02d}.json" for i in range(4, 10))]
    monkeypatch.setenv(kernel_cache.SIZE_ENV, "0.004")  # MB
    assert kernel_cache.max_bytes() == 4194
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(kernel_cache.SIZE_ENV, bad)
        with pytest.raises(ValueError, match=kernel_cache.SIZE_ENV):
            kernel_cache.max_bytes()


def test_reading_an_entry_marks_it_used(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    entry = (("op", 2), 0, "NVIDIA H100 80GB HBM3", 132)
    rest = ((1, 1, 1), (128, 1, 1), (), None, ())
    assert kernel_cache.store(entry, entry[2], b"m", rest)
    [path] = tmp_path.glob("*.json")
    os.utime(path, (1000, 1000))
    assert kernel_cache.load(entry, entry[2]) is not None and path.stat().st_mtime > 1000

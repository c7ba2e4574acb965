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


_ENTRY = (("op", 1), 0, "NVIDIA H100 80GB HBM3", 132, "body digest")
_REST = ((1, 1, 1), (128, 1, 1), (jax.ShapeDtypeStruct((4,), jnp.float32),), None, ())


def test_a_key_without_a_stable_text_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    entry = (("op", object()), *_ENTRY[1:])  # "<object object at 0x...>": another text each process
    assert not kernel_cache.store(entry, 80, b"module", _REST)
    assert kernel_cache.load(entry, 80) is None and not list(tmp_path.iterdir())
    assert kernel_cache.store(_ENTRY, 80, b"module", _REST)
    bytecode, (grid, block, outs, profiler, scratch) = kernel_cache.load(_ENTRY, 80)
    assert (bytecode, grid, block, profiler, scratch) == (b"module", (1, 1, 1), (128, 1, 1), None, ())
    assert outs == (jax.ShapeDtypeStruct((4,), jnp.float32),)


def test_the_ptxas_is_in_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "kept"))
    assert kernel_cache.store(_ENTRY, 80, b"module", _REST)
    assert kernel_cache.load(_ENTRY, lambda: 80) is not None  # the version asked lazily
    assert kernel_cache.load(_ENTRY, 81) is None  # another ptxas


def test_a_kernel_traced_differently_is_another_entry(tmp_path, monkeypatch):
    """The key holds a digest of the kernel's traced body: what the kernel function chose while it
    was traced and the op's key does not say, such as the GEMM's config from a measured table."""
    first = _lower_once(monkeypatch, tmp_path / "kept")
    table = tmp_path / "gemm-table.json"
    config = dict(tile_m=64, tile_n=64, max_concurrent_steps=2, warp_specialized=False, persistent=False,
                  grid_tile_group=1)
    table.write_text(json.dumps({"device": _mgpu.H100_DEVICE_KIND, "entries": [
        dict(m=256, n=128, kp=384, out_dtype="bfloat16", config=config)]}))
    monkeypatch.setenv("JFP8_GEMM_TABLE", str(table))
    tuned = _lower_once(monkeypatch, tmp_path / "kept")
    assert tuned[:2] == first[:2] and tuned[2] != first[2]  # the quantizers read back, the GEMM not
    assert kernel_cache.STATS["loaded"] == 2 and _mgpu.LOWERING_STATS == {"reused": 2, "lowered": 1}


def test_damaged_bytes_under_a_good_key_are_lowered_again(tmp_path, monkeypatch):
    first = _lower_once(monkeypatch, tmp_path)
    for path in tmp_path.glob("*.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "module": "bm90IGJ5dGVjb2Rl"}))  # "not bytecode"
    assert _lower_once(monkeypatch, tmp_path) == first
    assert kernel_cache.STATS["unreadable"] == 3 and _mgpu.LOWERING_STATS == {"lowered": 3}
    assert kernel_cache.STATS["stored"] == 3  # rewritten


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
    for bad in ("0", "-1", "lots", "nan", "inf"):  # said once, and the default kept: never a failed lowering
        monkeypatch.setenv(kernel_cache.SIZE_ENV, bad)
        assert kernel_cache.max_bytes() == kernel_cache.DEFAULT_MAX_MB * 2**20
    (tmp_path / "left-by-a-dead-process.tmp").write_text("x")
    os.utime(tmp_path / "left-by-a-dead-process.tmp", (1000, 1000))
    (tmp_path / "being-written.tmp").write_text("x")
    kernel_cache.trim(tmp_path, limit=10**9)
    assert not (tmp_path / "left-by-a-dead-process.tmp").exists() and (tmp_path / "being-written.tmp").exists()


def test_reading_an_entry_marks_it_used(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    assert kernel_cache.store(_ENTRY, 80, b"m", _REST)
    [path] = tmp_path.glob("*.json")
    assert path.stat().st_mode & 0o777 == 0o644  # readable by the other users of a shared folder
    os.utime(path, (1000, 1000))
    assert kernel_cache.load(_ENTRY, 80) is not None and path.stat().st_mtime > 1000

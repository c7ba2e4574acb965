"""Lowered Mosaic GPU kernels kept on disk, so that a second process skips their Pallas lowering.

A jitted FP8 training step for Hopper spends most of its lowering in jax's Pallas -> Mosaic GPU
lowering of jfp8's kernels: ~0.2 s of Python per kernel, 11.5 s of the `tiny` FP8 train step's
trace + lowering (45 kernel lowerings; 37 since call sites share them) against 0.7 s for BF16's
(deviceless H100, `benchmarks/hopper_train_build.py`; issue 44). jax's persistent compilation
cache does not help there: its key is a hash of the lowered program, so every start lowers every
kernel again before it can look anything up. Within a process `_mgpu.reuse_lowered_kernels` already lowers each
kernel once; with a directory set here, its table is also written to and read from disk.

An entry's key is the in-process one written out (the kernel function with its static
arguments, not the operands' tree: call sites of one function whose operands differ only outside
the kernel share an entry; the kernel's ordinal within the op; the GPU model and SM count; the
compiler parameters; the launch shape, every field of jax's Mosaic GPU mesh, and the module's
name; the kernel's operand and result types; jax's mesh under shard_map; a digest of the
kernel's traced body, its jaxpr's text: every config the kernel function chose while it was
traced), and what else the lowering reads: the source of `jfp8` and `pallas_kernels` (every
`.py` file's bytes), the versions of jax, jaxlib and the CUDA plugin, the PTX ISA version of the
ptxas found, the `MOSAIC_GPU_*` environment and x64. A change to any of them is another key. A
key that cannot be written out faithfully (an object's address in its text) is not kept. (The
body enters as its digest only; jax's text of a body masks addresses and names a callable
parameter by its name, one reason the kernel function is in the key.) The entry
holds its key's text, compared on reading; an unreadable, damaged or foreign entry is lowered
again and rewritten, and no failure of the cache reaches the lowering. Entries are written
atomically (a temporary file renamed), so processes sharing a folder read whole entries or none.

Off unless a directory is given: `JFP8_KERNEL_CACHE_DIR`, or `set_directory` (the training
scripts call `jfp8.train.compile_cache.enable()`, which puts it in
`~/.cache/jfp8/mosaic-kernels`). `JFP8_KERNEL_CACHE_DIR=""` or `JFP8_KERNEL_LOCATIONS=1` (each
lowering keeps its own source locations) turns it off. The folder is kept under 2 GiB, least
recently used entries removed first (`JFP8_KERNEL_CACHE_MAX_MB`); delete it to clear it.
"""

from __future__ import annotations

import base64
import collections
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import tempfile
import threading

import jax
import numpy as np

ENV = "JFP8_KERNEL_CACHE_DIR"
SIZE_ENV = "JFP8_KERNEL_CACHE_MAX_MB"
# The folder is trimmed to this size (least recently used entries first): every change to the
# sources is a new set of entries (a train step's kernels are 20-50 MB), and nothing else
# removes the old ones.
DEFAULT_MAX_MB = 2048
FORMAT = 1
STATS = collections.Counter()  # loaded, stored, unkeyable, unreadable, write_failed, trimmed, trim_failed
_LOCK = threading.Lock()
_directory: pathlib.Path | None = None
# An object's default text form, "<... at 0x7f...>", differs from process to process: such a key
# is not written out.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def set_directory(path: str | os.PathLike | None) -> pathlib.Path | None:
    """Keep lowered kernels in `path` from now on in this process (None: not on disk, unless
    `JFP8_KERNEL_CACHE_DIR` says so). Returns the directory in use."""
    global _directory
    _directory = None if path is None else pathlib.Path(path)
    return directory()


def directory() -> pathlib.Path | None:
    """Where lowered kernels are kept in this process, or None."""
    if os.environ.get("JFP8_KERNEL_LOCATIONS", "0") not in ("", "0"):
        return None
    if ENV in os.environ:
        return pathlib.Path(os.environ[ENV]) if os.environ[ENV] else None
    return _directory


@functools.cache
def _source_fingerprint() -> str:
    """A hash of every .py file of jfp8 and pallas_kernels and the library versions. (jfp8 is
    found, not imported: the kernels sit below it.)"""
    h = hashlib.sha256()
    for package in ("jfp8", "pallas_kernels"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin:
            h.update(f"{package}=-;".encode())
            continue
        root = pathlib.Path(spec.origin).parent
        for path in sorted(root.rglob("*.py")):
            if path.name.startswith("."):  # an editor's lock or backup file
                continue
            try:
                data = path.read_bytes()
            except OSError:  # unreadable: its name still counts
                data = b"<unreadable>"
            h.update(str(path.relative_to(root)).encode() + b"\0" + data + b"\0")
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=-;".encode())
    return h.hexdigest()


def _context(ptxas_isa) -> str:
    """What decides a lowering beyond the in-process key and the kernel's body: sources, versions,
    the ptxas it lowers FP8 conversions for, environment. (A config from a measured-config table
    is in the body: its tile shapes and loops are what the kernel function traced.)"""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU_"))
    return repr((FORMAT, _source_fingerprint(), ptxas_isa, env, jax.config.jax_enable_x64))


def _key(entry: tuple, ptxas_isa) -> str | None:
    """The entry's key as text (`_mgpu`'s in-process key, which ends with a digest of the kernel's
    traced body) with `_context`; None when it holds an object's address (no stable text)."""
    text = repr(entry)
    if _ADDRESS.search(text):
        return None
    return f"{_context(ptxas_isa() if callable(ptxas_isa) else ptxas_isa)}|{text}"


def count(what: str, n: int = 1) -> None:
    with _LOCK:
        STATS[what] += n


def _aval_to_json(aval) -> list:
    # jax reads only the shapes and dtypes of a lowering's result and scratch types (it rebuilds
    # them as ShapedArray(shape, dtype)), so they are kept as ShapeDtypeStructs of those.
    return [[int(d) for d in aval.shape], np.dtype(aval.dtype).name]


def _aval_from_json(value: list) -> jax.ShapeDtypeStruct:
    import ml_dtypes

    shape, name = value
    dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def _rest_to_json(rest: tuple) -> dict | None:
    grid, block, out_shapes, profiler_spec, scratch = rest
    if profiler_spec is not None:
        return None
    return {"grid": [int(g) for g in grid], "block": [int(b) for b in block],
            "out_shapes": [_aval_to_json(a) for a in out_shapes], "scratch": [_aval_to_json(a) for a in scratch]}


def _rest_from_json(value: dict) -> tuple:
    return (tuple(int(g) for g in value["grid"]), tuple(int(b) for b in value["block"]),
            tuple(_aval_from_json(a) for a in value["out_shapes"]), None,
            tuple(_aval_from_json(a) for a in value["scratch"]))


def _path(where: pathlib.Path, key: str) -> pathlib.Path:
    return where / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def load(entry: tuple, ptxas_isa=None) -> tuple[bytes, tuple] | None:
    """(module bytecode, the rest of the lowering result) kept for the kernel lowered under `entry`
    (`_mgpu`'s in-process key), or None. `ptxas_isa`: the PTX ISA version, or a function that
    gives it. Never raises: a failure is a miss (counted)."""
    where = directory()
    if where is None:
        return None
    try:
        key = _key(entry, ptxas_isa)
        if key is None:
            count("unkeyable")
            return None
        path = _path(where, key)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            count("unreadable")
            return None
        found = base64.b64decode(record["module"]), _rest_from_json(record["rest"])
    except Exception:  # noqa: BLE001 - unreadable, damaged or foreign: lower it again
        count("unreadable")
        return None
    count("loaded")
    try:
        os.utime(path)  # recently used: kept longest when the folder is trimmed
    except OSError:
        pass
    return found


def store(entry: tuple, ptxas_isa, bytecode: bytes, rest: tuple) -> bool:
    """Keep a lowering on disk (atomically); whether it was written. Never raises."""
    where = directory()
    if where is None:
        return False
    try:
        key, rest_json = _key(entry, ptxas_isa), _rest_to_json(rest)
        if key is None or rest_json is None:
            count("unkeyable")
            return False
        record = json.dumps({"key": key, "rest": rest_json, "module": base64.b64encode(bytecode).decode()})
    except Exception:  # noqa: BLE001 - something in it has no text form: not kept
        count("unkeyable")
        return False
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(record)
        os.chmod(tmp, 0o644)  # (a temporary file is private) a folder shared by users stays readable
        os.replace(tmp, _path(where, key))
    except OSError as e:  # a read-only or full disk: lower as usual
        count("write_failed")
        if STATS["write_failed"] == 1:
            print(f"jfp8: lowered kernels not kept in {where} ({e}); set {ENV} to a writable folder, or '' for none")
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
    count("stored")
    if STATS["stored"] % 16 == 1:  # the first write of a process, then every 16th
        try:
            trim(where)
        except Exception:  # noqa: BLE001 - trimming is housekeeping: never fail a lowering for it
            count("trim_failed")
    return True


_WARNED: set = set()


def max_bytes() -> int:
    """The folder's size limit: `JFP8_KERNEL_CACHE_MAX_MB` (a positive number), else 2 GiB."""
    value = os.environ.get(SIZE_ENV, "")
    if not value:
        return DEFAULT_MAX_MB * 2**20
    try:
        megabytes = float(value)
        if not 0 < megabytes < float("inf"):
            raise ValueError
    except ValueError:
        if value not in _WARNED:
            _WARNED.add(value)
            print(f"jfp8: {SIZE_ENV}={value!r} is not a positive number of megabytes; keeping the "
                  f"lowered-kernel folder under the default {DEFAULT_MAX_MB} MB")
        return DEFAULT_MAX_MB * 2**20
    return int(megabytes * 2**20)


# A temporary file older than this was left by a process that died while writing it.
_STALE_TMP_SECONDS = 3600


def trim(where: pathlib.Path, limit: int | None = None) -> int:
    """Remove the least recently used entries until the folder holds at most 80 % of `limit`
    bytes (`max_bytes()`), once it holds more than `limit`, and temporary files an hour old;
    returns how many entries were removed."""
    import time

    limit = max_bytes() if limit is None else limit
    for path in where.glob("*.tmp"):
        try:
            if time.time() - path.stat().st_mtime > _STALE_TMP_SECONDS:
                path.unlink()
        except OSError:
            pass
    entries = []
    for path in where.glob("*.json"):
        try:
            st = path.stat()
        except OSError:  # removed by another process meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return 0
    removed = 0
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= 0.8 * limit:
            break
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:  # another process trimmed it: gone all the same
            pass
        except OSError:
            continue
        total -= size
    count("trimmed", removed)
    return removed

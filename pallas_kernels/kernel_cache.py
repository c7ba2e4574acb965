"""Lowered Mosaic GPU kernels kept on disk, so that a second process skips their Pallas lowering.

A jitted FP8 training step for Hopper spends most of its lowering in jax's Pallas -> Mosaic GPU
lowering of jfp8's kernels: ~0.2 s of Python per kernel, 10-12 s of the `tiny` FP8 train step's
first jit (46 kernels) against 0.7 s for BF16's whole lowering (deviceless H100,
`benchmarks/hopper_train_build.py`; issue 44). jax's persistent compilation cache does not help
there: its key is a hash of the lowered program, so every start lowers every kernel again before
it can look anything up. Within a process `_mgpu.reuse_lowered_kernels` already lowers each
kernel once; with a directory set here, its table is also written to and read from disk.

An entry's key is the in-process one written out (jfp8's op key: the kernel and reference
functions with their static arguments, the operands' tree and types; the kernel's ordinal
within the op; the GPU model and SM count; the compiler parameters; the kernel's operand and
result types) plus what else decides the lowered module: the source of `jfp8` and
`pallas_kernels` (every `.py` file's bytes), the versions of jax, jaxlib and the Mosaic GPU
plugin, the measured-config tables the GEMMs' configs come from, and the `MOSAIC_GPU_*`
environment. A change to any of them is another key, so nothing stale is read back; a key that
cannot be written out faithfully (an object without a stable text form) is not kept. The entry
holds its key's text, which is compared on reading, and an unreadable or mismatched entry is
lowered again and rewritten. Entries are written atomically (a temporary file renamed), so
concurrent processes sharing a directory read whole entries or none.

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
STATS = collections.Counter()  # "loaded", "stored", "unkeyable", "unreadable"
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
    """A hash of every .py file of jfp8 and pallas_kernels and the library versions."""
    import jfp8
    import pallas_kernels

    h = hashlib.sha256()
    for package in (jfp8, pallas_kernels):
        root = pathlib.Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=-;".encode())
    return h.hexdigest()


def _file_stamp(path: pathlib.Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "-"


def _context(device_kind: str) -> str:
    """What decides a lowering beyond the in-process key: sources, versions, tables, environment."""
    from pallas_kernels import tuning

    tables = [f"{kind}:{_file_stamp(tuning.table_path(device_kind, kind))}" for kind in sorted(tuning.TABLE_KINDS)]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU_"))
    return repr((FORMAT, _source_fingerprint(), tables, env, jax.config.jax_enable_x64))


def _key_text(entry: tuple) -> str | None:
    """The entry's key as text, or None when it has no faithful text form."""
    text = repr(entry)
    return None if _ADDRESS.search(text) else text


def _aval_to_json(aval) -> list:
    # jax reads only the shapes and dtypes of a lowering's result and scratch types (it rebuilds
    # them as ShapedArray(shape, dtype)), so they are kept as ShapeDtypeStructs of those.
    return [list(aval.shape), np.dtype(aval.dtype).name]


def _aval_from_json(value: list) -> jax.ShapeDtypeStruct:
    import ml_dtypes

    shape, name = value
    dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _rest_to_json(rest: tuple) -> dict | None:
    grid, block, out_shapes, profiler_spec, scratch = rest
    if profiler_spec is not None:
        return None
    return {"grid": list(grid), "block": list(block), "out_shapes": [_aval_to_json(a) for a in out_shapes],
            "scratch": [_aval_to_json(a) for a in scratch]}


def _rest_from_json(value: dict) -> tuple:
    return (tuple(value["grid"]), tuple(value["block"]),
            tuple(_aval_from_json(a) for a in value["out_shapes"]), None,
            tuple(_aval_from_json(a) for a in value["scratch"]))


def _path(where: pathlib.Path, key: str) -> pathlib.Path:
    return where / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _full_key(entry: tuple, device_kind: str) -> str | None:
    text = _key_text(entry)
    return None if text is None else f"{_context(device_kind)}|{text}"


def load(entry: tuple, device_kind: str) -> tuple[bytes, tuple] | None:
    """(module bytecode, the rest of the lowering result) kept for `entry`, or None."""
    where = directory()
    if where is None:
        return None
    key = _full_key(entry, device_kind)
    if key is None:
        STATS["unkeyable"] += 1
        return None
    try:
        record = json.loads(_path(where, key).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        STATS["unreadable"] += 1
        return None
    try:
        if record.get("key") != key:
            STATS["unreadable"] += 1
            return None
        found = base64.b64decode(record["module"]), _rest_from_json(record["rest"])
    except (KeyError, TypeError, ValueError, AttributeError):
        STATS["unreadable"] += 1
        return None
    STATS["loaded"] += 1
    try:
        os.utime(_path(where, key))  # recently used: kept longest when the folder is trimmed
    except OSError:
        pass
    return found


def store(entry: tuple, device_kind: str, bytecode: bytes, rest: tuple) -> bool:
    """Keep a lowering on disk (atomically); whether it was written."""
    where = directory()
    if where is None:
        return False
    key, rest_json = _full_key(entry, device_kind), _rest_to_json(rest)
    if key is None or rest_json is None:
        STATS["unkeyable"] += 1
        return False
    record = json.dumps({"key": key, "rest": rest_json, "module": base64.b64encode(bytecode).decode()})
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False) as f:
            f.write(record)
        os.replace(f.name, _path(where, key))
    except OSError as e:  # a read-only or full disk: lower as usual
        with _LOCK:
            if not STATS["write_failed"]:
                print(f"jfp8: lowered kernels not kept in {where} ({e}); set {ENV} to a writable folder, or '' for none")
            STATS["write_failed"] += 1
        try:
            os.unlink(f.name)
        except (OSError, NameError):
            pass
        return False
    STATS["stored"] += 1
    if STATS["stored"] % 16 == 1:  # the first write of a process, then every 16th
        trim(where)
    return True


def max_bytes() -> int:
    value = os.environ.get(SIZE_ENV, str(DEFAULT_MAX_MB))
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1
    if megabytes <= 0:
        raise ValueError(f"{SIZE_ENV} must be a positive number of megabytes, got {value!r}")
    return int(megabytes * 2**20)


def trim(where: pathlib.Path, limit: int | None = None) -> int:
    """Remove the least recently used entries until the folder holds at most 80 % of `limit`
    bytes (`max_bytes()`), once it holds more than `limit`; returns how many were removed."""
    limit = max_bytes() if limit is None else limit
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
        except OSError:
            continue
        total -= size
        removed += 1
    STATS["trimmed"] += removed
    return removed

"""FP8 checkpoints in DeepSeek-V3's released safetensors layout.

Every linear weight of the released DeepSeek-V3 checkpoint is stored as two tensors:

    <name>            F8_E4M3  [out, in]                          (unpadded)
    <name>_scale_inv  F32      [ceil(out / 128), ceil(in / 128)]  (one scale per 128x128 block)

and the weight is `<name>[i, j] * <name>_scale_inv[i // 128, j // 128]` (DeepSeek-V3
`inference/kernel.py::weight_dequant`). That multiplier is exactly `Fp8Tensor.scale`, so a
`quantize(w, (128, 128))` result maps onto the pair without any arithmetic: the data is cut back to
its logical shape on save and zero-padded to whole blocks again on load.

Layouts: DeepSeek's `[out, in]` (torch `Linear.weight`) is the `(N, K)` operand `b` of
`scaled_matmul(a, b)` (NT), so a loaded weight feeds `scaled_matmul` as it is. `fp8_linear` takes the
master weight `(K, N)`: use `w.T` of a dequantized weight, or `t.mT` of an `Fp8Tensor` (exact, the
128x128 blocks are square). Tensors with more than two axes (stacked experts `[G, out, in]`) are
written with their scales `[G, ceil(out/128), ceil(in/128)]`; this is a jfp8 extension, DeepSeek's
files hold one 2-D tensor per expert.

Sharded checkpoints follow the Hugging Face convention DeepSeek uses: `model-00001-of-00002.safetensors`
... and `model.safetensors.index.json` holding `{"metadata": {"total_size": bytes},
"weight_map": {tensor name: file name}}`.

Writes are atomic: each file goes to a temporary name in the same directory, is fsynced and then
renamed into place, and the index is written last. A crash leaves either the previous checkpoint or,
in the middle of renaming a sharded one, a directory without an index, which `load_safetensors`
refuses; never a half-written file under its final name.

Reading uses `safetensors.deserialize` on the file's bytes: safetensors 0.8's numpy framework cannot
return F8_E4M3 tensors (it looks for `numpy.float8_e4m3fn`), so the dtypes come from `ml_dtypes`
here. A file is read whole (about twice its size in memory at the peak).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy as st_numpy

from jfp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor

#: Suffix of the dequantization multiplier stored next to each FP8 weight.
SCALE_SUFFIX = "_scale_inv"
#: The only scaling block the format has: DeepSeek-V3's 128x128 weight blocks.
WEIGHT_BLOCK = (TILE, TILE)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# The replaced index, kept during a sharded save (hidden: loaders never read it).
PREVIOUS_INDEX_NAME = ".model.safetensors.index.json.previous"
FILE_SUFFIX = ".safetensors"
#: The `quantization_config` of DeepSeek-V3's `config.json` (README_WEIGHTS.md), which this layout is.
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(WEIGHT_BLOCK),
}
#: Header metadata of every file written: the tensors are in torch's layout, as DeepSeek's are, and
#: Hugging Face loaders look for this key.
FORMAT_METADATA = {"format": "pt"}

# safetensors dtype names -> numpy dtypes (bf16 and fp8 from ml_dtypes).
_DTYPES = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

Tensors = Mapping[str, "Fp8Tensor | jax.Array | np.ndarray"]


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `_scale_inv` shape of an FP8 weight of `shape` `(..., out, in)`."""
    *batch, m, k = shape
    return (*batch, -(-m // TILE), -(-k // TILE))


def to_deepseek_layout(name: str, t: Fp8Tensor) -> tuple[np.ndarray, np.ndarray]:
    """An `Fp8Tensor` with 128x128 blocks -> (E4M3 data `[..., out, in]` unpadded, F32 scale_inv)."""
    if t.block != WEIGHT_BLOCK:
        raise ValueError(
            f"{name!r} is an Fp8Tensor with block {t.block}; the DeepSeek-V3 format stores only "
            f"{WEIGHT_BLOCK} block scales. Re-quantize it with "
            f"jfp8.quantize(t.dequantize(), {WEIGHT_BLOCK}), or save t.dequantize() as a plain array"
        )
    data = np.asarray(t.data)
    if data.dtype != np.dtype(FP8_DTYPE):
        raise ValueError(f"{name!r}: Fp8Tensor data must be {np.dtype(FP8_DTYPE)}, got {data.dtype}")
    m, k = t.logical
    data = np.asarray(data[..., :m, :k], order="C")
    scale = np.asarray(t.scale, dtype=np.float32, order="C")
    if scale.shape != scale_shape(data.shape):
        raise ValueError(
            f"{name!r}: Fp8Tensor scale has shape {scale.shape}, expected {scale_shape(data.shape)} "
            f"for data of logical shape {data.shape}"
        )
    return data, scale


def check_fp8_pair(name: str, data: np.ndarray, scale_inv: np.ndarray) -> None:
    """Raises ValueError unless `<name>` is E4M3 `[..., out, in]` and `<name>_scale_inv` F32
    `[..., ceil(out/128), ceil(in/128)]`."""
    if data.dtype != np.dtype(FP8_DTYPE):
        raise ValueError(
            f"{name + SCALE_SUFFIX!r} is a scale, but {name!r} is {data.dtype}, not float8_e4m3fn; "
            f"only E4M3 weights have a {SCALE_SUFFIX} tensor (rename one of them)"
        )
    if data.ndim < 2:
        raise ValueError(f"{name!r}: an FP8 weight must have at least 2 axes, got shape {data.shape}")
    if scale_inv.dtype != np.float32:
        raise ValueError(
            f"{name + SCALE_SUFFIX!r} is {scale_inv.dtype}; DeepSeek-V3's scales are float32 "
            "(cast it with .astype(np.float32) when writing)"
        )
    if scale_inv.shape != scale_shape(data.shape):
        raise ValueError(
            f"{name + SCALE_SUFFIX!r} has shape {scale_inv.shape}, but {name!r} of shape "
            f"{data.shape} needs {scale_shape(data.shape)} (one scale per {WEIGHT_BLOCK} block)"
        )


def from_deepseek_layout(name: str, data: np.ndarray, scale_inv: np.ndarray) -> Fp8Tensor:
    """(E4M3 `[..., out, in]`, F32 `[..., ceil(out/128), ceil(in/128)]`) -> `Fp8Tensor` with
    128x128 blocks, its data zero-padded to whole blocks as `quantize` pads it."""
    check_fp8_pair(name, data, scale_inv)
    *batch, m, k = data.shape
    mp, kp = (s * TILE for s in scale_inv.shape[-2:])
    padded = np.zeros((*batch, mp, kp), data.dtype)
    padded[..., :m, :k] = data
    return Fp8Tensor(jnp.asarray(padded), jnp.asarray(scale_inv), WEIGHT_BLOCK, (m, k))


def to_stored_arrays(tensors: Tensors) -> dict[str, np.ndarray]:
    """Names -> `Fp8Tensor` or array, flattened into the stored names and numpy arrays."""
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(
                f"{name!r} ends with {SCALE_SUFFIX!r}, which this format reserves for the scales of "
                f"FP8 weights; pass the weight as an Fp8Tensor named {name[: -len(SCALE_SUFFIX)]!r} "
                "or rename the array"
            )
        if isinstance(value, Fp8Tensor):
            out[name], out[name + SCALE_SUFFIX] = to_deepseek_layout(name, value)
        elif isinstance(value, (jax.Array, np.ndarray)):
            out[name] = np.asarray(value, order="C")  # (ascontiguousarray makes 0-d 1-d)
        else:
            raise TypeError(
                f"{name!r} is a {type(value).__name__}; save takes Fp8Tensor, jax.Array or "
                "np.ndarray values (wrap scalars with np.asarray)"
            )
    return out


def stored_pairs(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """Stored names -> `(array, its _scale_inv or None)`, each pair checked (`check_fp8_pair`)."""
    out: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    for name, arr in arrays.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in arrays:
                raise ValueError(
                    f"{name!r} is a scale without its data tensor {name.removesuffix(SCALE_SUFFIX)!r}; "
                    "the checkpoint is incomplete (check the files and the index's weight_map)"
                )
            continue
        scale = arrays.get(name + SCALE_SUFFIX)
        if scale is not None:
            check_fp8_pair(name, arr, scale)
        out[name] = (arr, scale)
    return out


def pair_fp8(arrays: Mapping[str, np.ndarray]) -> dict[str, Fp8Tensor | np.ndarray]:
    """Stored names -> arrays, with each `<name>` + `<name>_scale_inv` pair joined into an
    `Fp8Tensor`. An E4M3 tensor without a scale stays a plain array."""
    return {
        name: arr if scale is None else from_deepseek_layout(name, arr, scale)
        for name, (arr, scale) in stored_pairs(arrays).items()
    }


# --------------------------------------------------------------------------------------------
# Files


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    """The mode `open()` gives a new file under the process umask (safetensors 0.8 writes 0600)."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # no /proc: read it by setting it, then put it back
        os.umask(mask)
    return 0o666 & ~mask


def _temp_name(directory: Path, final_name: str) -> Path:
    return directory / f".{final_name}.tmp-{uuid.uuid4().hex}"


def _write_temp_safetensors(
    directory: Path, final_name: str, arrays: Mapping[str, np.ndarray], metadata: dict[str, str]
) -> Path:
    """Writes `arrays` to a fsynced temporary file beside `final_name`; returns its path."""
    tmp = _temp_name(directory, final_name)
    try:
        st_numpy.save_file(dict(arrays), tmp, metadata=metadata)
        os.chmod(tmp, _new_file_mode())  # like the index json beside it
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _write_json_atomic(path: Path, obj) -> None:
    tmp = _temp_name(path.parent, path.name)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _header_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    meta = dict(FORMAT_METADATA)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"safetensors metadata maps str to str; got {key!r}: {value!r} (json.dumps it)"
            )
        meta[key] = value
    return meta


def write_safetensors_file(path, arrays: Mapping[str, np.ndarray], metadata=None) -> None:
    """Atomically writes stored arrays (names as on disk) to one `.safetensors` file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp_safetensors(path.parent, path.name, arrays, _header_metadata(metadata))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_safetensors_shards(
    directory, shards: Iterable[tuple[str, Mapping[str, np.ndarray]]], metadata=None
) -> dict:
    """Atomically writes a sharded checkpoint: `(file name, stored arrays)` per shard, then the index.

    `shards` may be a generator, so that a conversion holds one shard in memory at a time. Every
    shard is written and fsynced under a temporary name first; then the previous index (if any) is
    moved aside, the shards are renamed into place and the new index is written. Shards that only the
    previous index named are deleted at the end. Returns the index written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header = _header_metadata(metadata)
    index_path = directory / INDEX_NAME
    staged: list[tuple[Path, str]] = []
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for file_name, arrays in shards:
            if "/" in file_name or not file_name.endswith(FILE_SUFFIX) or file_name == INDEX_NAME:
                raise ValueError(f"shard names are plain '*{FILE_SUFFIX}' file names, got {file_name!r}")
            if any(file_name == f for _, f in staged):
                raise ValueError(f"two shards are both named {file_name!r}; give each its own file name")
            for name, arr in arrays.items():
                if name in weight_map:
                    raise ValueError(f"{name!r} appears in two shards ({weight_map[name]}, {file_name})")
                weight_map[name] = file_name
                total += arr.nbytes
            staged.append((_write_temp_safetensors(directory, file_name, arrays, header), file_name))
        # From here a crash leaves no index (load refuses the directory), never an index that names
        # a mix of old and new shards. The old index is kept aside so that the next save (after a
        # crash, too) still knows which old shards to delete.
        previous = directory / PREVIOUS_INDEX_NAME
        old_files = _indexed_files(index_path) | _indexed_files(previous)
        if index_path.exists():
            os.replace(index_path, previous)
        for tmp, file_name in staged:
            os.replace(tmp, directory / file_name)
        _fsync_dir(directory)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json_atomic(index_path, index)
    for stale in old_files - set(weight_map.values()):
        if Path(stale).name == stale and stale.endswith(FILE_SUFFIX):  # only plain shard names
            (directory / stale).unlink(missing_ok=True)
    previous.unlink(missing_ok=True)
    return index


def _indexed_files(index_path: Path) -> set[str]:
    """The shard names of an existing index (none if it is missing or unreadable)."""
    try:
        return set(_read_index(index_path)[1].values())
    except (FileNotFoundError, ValueError):
        return set()


def shard_name(i: int, n: int) -> str:
    """The Hugging Face shard file name, `model-00001-of-00003.safetensors` for i=0, n=3."""
    return f"model-{i + 1:05d}-of-{n:05d}{FILE_SUFFIX}"


def plan_shards(
    arrays: Mapping[str, np.ndarray], max_shard_bytes: int | None
) -> list[dict[str, np.ndarray]]:
    """Greedy shards of at most `max_shard_bytes` (in the given order; a larger tensor gets its own
    shard). A weight and its `_scale_inv` always share a shard."""
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes}")
    groups: dict[str, list[str]] = {}
    for name in arrays:
        stem = name.removesuffix(SCALE_SUFFIX)
        groups.setdefault(stem if stem in arrays else name, []).append(name)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for names in groups.values():
        nbytes = sum(arrays[n].nbytes for n in names)
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update({n: arrays[n] for n in names})
        size += nbytes
    return shards


def save_safetensors(path, tensors: Tensors, *, max_shard_bytes: int | None = None, metadata=None) -> None:
    """Saves names -> `Fp8Tensor` (128x128 blocks) or arrays in DeepSeek-V3's FP8 layout.

    Args:
      path: a `*.safetensors` file, or a directory that receives `model-0000i-of-0000n.safetensors`
        shards and `model.safetensors.index.json`.
      tensors: an `Fp8Tensor` named `w` is written as `w` (E4M3, `[..., out, in]`, unpadded) and
        `w_scale_inv` (F32, `[..., ceil(out/128), ceil(in/128)]`); arrays (jax or numpy, any dtype
        safetensors has, bf16 included) are written as they are.
      max_shard_bytes: directory only: the largest shard, in bytes of tensor data (one shard if None).
      metadata: str -> str entries for every file header (beside `"format": "pt"`).
    """
    arrays = to_stored_arrays(tensors)
    path = Path(path)
    if path.suffix == FILE_SUFFIX:
        if max_shard_bytes is not None:
            raise ValueError(
                f"max_shard_bytes shards into a directory; {path} is one file. Pass a directory path "
                "(without .safetensors) to shard"
            )
        write_safetensors_file(path, arrays, metadata)
        return
    if path.suffix == ".json":
        raise ValueError(f"save into the checkpoint directory {path.parent}, not the index file {path}")
    shards = plan_shards(arrays, max_shard_bytes)
    write_safetensors_shards(path, ((shard_name(i, len(shards)), s) for i, s in enumerate(shards)), metadata)


def _read_index(index_path: Path) -> tuple[dict, dict[str, str]]:
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index_path} is not valid JSON ({e}); rewrite the index") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f"{index_path} needs a 'weight_map' object mapping tensor names to file names, as in "
            '{"metadata": {...}, "weight_map": {"layer.weight": "model-00001-of-00002.safetensors"}}'
        )
    return index, weight_map


def checkpoint_files(path) -> list[tuple[Path, list[str] | None]]:
    """The files of a checkpoint, each with the tensor names the index assigns to it (None for a
    checkpoint without an index: every tensor in the file).

    `path` is a `.safetensors` file, an index json, or a directory holding
    `model.safetensors.index.json` (or, without an index, a single `model.safetensors`).
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).exists():
            path = path / INDEX_NAME
        elif (path / SINGLE_FILE_NAME).exists():
            return [(path / SINGLE_FILE_NAME, None)]
        else:
            raise FileNotFoundError(
                f"{path} holds neither {INDEX_NAME} nor {SINGLE_FILE_NAME}; pass a .safetensors file "
                "or a checkpoint directory (a sharded one is only complete once its index is written)"
            )
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.suffix == FILE_SUFFIX:
        return [(path, None)]
    if path.suffix != ".json":
        raise ValueError(f"{path}: expected a {FILE_SUFFIX} file, an index .json or a directory")
    _, weight_map = _read_index(path)
    files: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        files.setdefault(file_name, []).append(name)
    out = []
    for file_name, names in files.items():
        file = path.parent / file_name
        if Path(file_name).is_absolute() or ".." in Path(file_name).parts:
            raise ValueError(f"{path} names {file_name!r}; shard names must be relative to the index")
        if not file.exists():
            raise FileNotFoundError(f"{path} maps {names[0]!r} to {file_name}, which does not exist")
        out.append((file, names))
    return out


# A safetensors file: an 8-byte little-endian header length, the JSON header, then the tensor data.
_HEADER_LENGTH_BYTES = 8


def check_safetensors_bytes(file: Path, raw: bytes) -> None:
    """Raises ValueError naming `file` and what its bytes lack when they are not a whole
    safetensors file (truncated by an interrupted copy, or not safetensors at all)."""
    size = len(raw)
    advice = "copy or download the file again (it may have been cut short) or rewrite the checkpoint"
    if size < _HEADER_LENGTH_BYTES:
        raise ValueError(
            f"{file} holds {size} bytes; a safetensors file starts with an "
            f"{_HEADER_LENGTH_BYTES}-byte header length: {advice}"
        )
    header_len = int.from_bytes(raw[:_HEADER_LENGTH_BYTES], "little")
    if _HEADER_LENGTH_BYTES + header_len > size:
        raise ValueError(
            f"{file} holds {size} bytes, but its header length says the JSON header alone takes "
            f"{header_len} bytes after the first {_HEADER_LENGTH_BYTES}: {advice}"
        )
    try:
        header = json.loads(raw[_HEADER_LENGTH_BYTES : _HEADER_LENGTH_BYTES + header_len])
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"{file}: the header is not safetensors' JSON ({e}): {advice}") from e
    expected = _HEADER_LENGTH_BYTES + header_len + data_end
    if size < expected:
        raise ValueError(
            f"{file} holds {size} bytes, but its header describes {len(header) - ('__metadata__' in header)} "
            f"tensors ending at byte {expected} ({expected - size} bytes missing): {advice}"
        )


def read_safetensors_file(file, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """The stored arrays of one file (names as on disk, no pairing), as numpy (bf16/fp8 via
    ml_dtypes). With `names` (from the index), the file must hold exactly those tensors. A file
    that is cut short or not safetensors raises ValueError naming it and what was expected."""
    file = Path(file)
    raw = file.read_bytes()
    check_safetensors_bytes(file, raw)
    try:
        views = safetensors.deserialize(raw)
    except safetensors.SafetensorError as e:
        raise ValueError(
            f"{file} is not a valid safetensors file (the safetensors library says: {e}); rewrite "
            "the checkpoint or copy the file again"
        ) from e
    arrays = {}
    for name, view in views:
        dtype = _DTYPES.get(view["dtype"])
        if dtype is None:
            raise NotImplementedError(
                f"{file}: {name!r} has dtype {view['dtype']}, which jfp8 does not read "
                f"(it reads {sorted(_DTYPES)}); convert the checkpoint with its own tools first"
            )
        arrays[name] = np.frombuffer(view["data"], dtype).reshape(view["shape"])
    if names is not None and set(names) != set(arrays):
        missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
        raise ValueError(
            f"{file} and the index disagree: the index lists {missing[:5]} there but the file lacks "
            f"them; the file holds {extra[:5]} that the index does not list. Rewrite the checkpoint"
        )
    return arrays if names is None else {n: arrays[n] for n in names}


def read_stored_arrays(path) -> dict[str, np.ndarray]:
    """All stored arrays of a checkpoint (file, index or directory), names as on disk."""
    arrays: dict[str, np.ndarray] = {}
    for file, names in checkpoint_files(path):
        arrays.update(read_safetensors_file(file, names))
    return arrays


def load_safetensors(path) -> dict[str, Fp8Tensor | np.ndarray]:
    """Loads a checkpoint in DeepSeek-V3's FP8 layout (or any safetensors checkpoint).

    Args:
      path: a `.safetensors` file, `model.safetensors.index.json`, or a directory holding it.

    Returns:
      names -> `Fp8Tensor` for every `<name>` (E4M3) with a `<name>_scale_inv` (F32), with block
      (128, 128), `logical` the stored `(out, in)` and data zero-padded to whole blocks (jax arrays);
      every other tensor as the numpy array stored (bf16 and fp8 through ml_dtypes; an E4M3 tensor
      without a scale stays plain). Numpy, because `jnp.asarray` would silently narrow F64/I64
      without `jax_enable_x64`; call it on the tensors you put on a device.
    """
    return pair_fp8(read_stored_arrays(path))


def dequantize_numpy(data: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 `data * scale_inv` per 128x128 block, for stored (unpadded) arrays."""
    x = data.astype(np.float32)
    s = np.repeat(np.repeat(scale_inv, TILE, axis=-2), TILE, axis=-1)
    return x * s[..., : x.shape[-2], : x.shape[-1]]


__all__ = [
    "FORMAT_METADATA",
    "INDEX_NAME",
    "QUANTIZATION_CONFIG",
    "SCALE_SUFFIX",
    "WEIGHT_BLOCK",
    "check_fp8_pair",
    "check_safetensors_bytes",
    "checkpoint_files",
    "dequantize_numpy",
    "from_deepseek_layout",
    "load_safetensors",
    "pair_fp8",
    "plan_shards",
    "read_safetensors_file",
    "read_stored_arrays",
    "save_safetensors",
    "scale_shape",
    "shard_name",
    "stored_pairs",
    "to_deepseek_layout",
    "to_stored_arrays",
    "write_safetensors_file",
    "write_safetensors_shards",
]

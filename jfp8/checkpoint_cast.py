"""Casting safetensors checkpoints between high precision (BF16/FP32) and DeepSeek-V3's FP8 layout.

`cast_to_fp8` quantizes the selected weights with `quantize(w, (128, 128))` and writes them as
`<name>` + `<name>_scale_inv` (see `jfp8.safetensors_io`); `cast_to_high_precision` is the reverse,
like DeepSeek-V3's `inference/fp8_cast_bf16.py`: `data * scale_inv` in FP32, rounded to BF16.

Which weights become FP8 (`CastPolicy`) mirrors the released DeepSeek-V3 checkpoint: every linear
weight (`*.weight`, 2-D) is FP8; the token embedding (`embed_tokens`), the output head (`lm_head`,
the MTP `shared_head.head`), the MoE router (`mlp.gate`, not `gate_proj`) and all norms stay in
high precision, as do biases and other 1-D tensors. Weights with a side under 128 stay too: their one
block would be mostly padding. The policy reads names only, so a 2-D weight in any other layout
(e.g. Flax's `(in, out)` kernels) quantizes to the same blocks, transposed: 128x128 blocks are
square, so `quantize(w.T, (128, 128))` equals `quantize(w, (128, 128)).mT` bit for bit.

A sharded checkpoint is converted one file at a time and keeps its file names, unless
`max_shard_bytes` re-shards it (then it is held in memory whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfp8.fp8 import TILE, Fp8Tensor, quantize
from jfp8.safetensors_io import (
    FILE_SUFFIX,
    INDEX_NAME,
    QUANTIZATION_CONFIG,
    SCALE_SUFFIX,
    WEIGHT_BLOCK,
    checkpoint_files,
    dequantize_numpy,
    plan_shards,
    read_safetensors_file,
    shard_name,
    stored_pairs,
    to_stored_arrays,
    write_safetensors_file,
    write_safetensors_shards,
)

#: Names (regular expressions, `re.search`) of weights that stay in high precision, after
#: DeepSeek-V3's release: embeddings, the output heads, the MoE router, norms.
DEEPSEEK_KEEP = (r"embed", r"norm", r"(^|\.)(lm_head|head|gate)\.weight$")
CONFIG_NAME = "config.json"
_QUANTIZABLE = tuple(
    np.dtype(d) for d in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64)
)


@dataclasses.dataclass(frozen=True)
class CastPolicy:
    """Which tensors of a high-precision checkpoint `cast_to_fp8` quantizes.

    Attributes:
      suffix: only names ending with it (linear weights).
      min_dim: both sides of the 2-D weight at least this.
      keep: regular expressions; a name any of them matches (`re.search`) stays high precision.
    """

    suffix: str = ".weight"
    min_dim: int = TILE
    keep: tuple[str, ...] = DEEPSEEK_KEEP

    def __post_init__(self):
        for pattern in self.keep:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"keep pattern {pattern!r} is not a regular expression: {e}") from e
        if self.min_dim < 1:
            raise ValueError(f"min_dim must be >= 1, got {self.min_dim}")

    def quantizes(self, name: str, arr: np.ndarray) -> bool:
        return (
            name.endswith(self.suffix)
            and arr.ndim == 2
            and min(arr.shape) >= self.min_dim
            and arr.dtype in _QUANTIZABLE
            and not any(re.search(p, name) for p in self.keep)
        )


_quantize_weight = jax.jit(lambda w: quantize(w, WEIGHT_BLOCK))


def quantize_arrays(arrays: dict[str, np.ndarray], policy: CastPolicy) -> dict[str, np.ndarray]:
    """High-precision stored arrays -> stored arrays with the selected weights in FP8 (+ scales)."""
    out: dict[str, Fp8Tensor | np.ndarray] = {}
    for name, arr in arrays.items():
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(
                f"the input already holds the FP8 scale {name!r}; cast it back to high precision "
                "first (cast_to_high_precision / `fp8_cast.py to-bf16`)"
            )
        out[name] = _quantize_weight(jnp.asarray(arr)) if policy.quantizes(name, arr) else arr
    return to_stored_arrays(out)


def dequantize_arrays(arrays: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """Stored FP8 arrays -> arrays with every `<name>` + `<name>_scale_inv` pair as one `dtype`
    tensor: `data * scale_inv` in FP32, then rounded (DeepSeek's `weight_dequant`)."""
    return {
        name: arr if scale is None else dequantize_numpy(arr, scale).astype(dtype)
        for name, (arr, scale) in stored_pairs(arrays).items()
    }


def _file_arrays(src, *, with_partner_scales: bool) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """(file name, stored arrays) per checkpoint file. With `with_partner_scales`, a scale stored in
    another file than its weight travels with the weight (DeepSeek's files allow that)."""
    files = checkpoint_files(src)
    owner = {n: f for f, names in files for n in (names or [])}
    cache: dict[Path, dict[str, np.ndarray]] = {}

    def read(file: Path) -> dict[str, np.ndarray]:
        if file not in cache:
            if len(cache) >= 2:  # the current file and one partner
                cache.pop(next(iter(cache)))
            cache[file] = read_safetensors_file(file, next(n for f, n in files if f == file))
        return cache[file]

    for file, _ in files:
        arrays = dict(read(file))
        if with_partner_scales and owner:
            for name in list(arrays):
                scale = name + SCALE_SUFFIX
                if name.endswith(SCALE_SUFFIX):
                    if owner.get(name.removesuffix(SCALE_SUFFIX), file) != file:
                        del arrays[name]  # converted with its weight
                elif scale not in arrays and scale in owner:
                    arrays[scale] = read(owner[scale])[scale]
        yield file.name, arrays


@contextlib.contextmanager
def _removed_on_failure(dst: Path):
    """Removes `dst` if the block fails and `dst` did not exist before it: a failed cast leaves no
    empty or partial output behind (an existing output is left to the atomic writes)."""
    existed = dst.exists()
    try:
        yield
    except BaseException:
        if not existed:
            if dst.is_dir():
                shutil.rmtree(dst, ignore_errors=True)
            else:
                dst.unlink(missing_ok=True)
        raise


def _write(src, dst, convert: Callable, *, partner_scales: bool, max_shard_bytes, metadata) -> list[str]:
    """Converts `src` file by file into `dst` (a file or a directory); returns the files written."""
    dst = Path(dst)
    src_dir = Path(src) if Path(src).is_dir() else Path(src).parent
    same_dir = dst.suffix != FILE_SUFFIX and dst.resolve() == src_dir.resolve()
    if dst.resolve() == Path(src).resolve() or same_dir:
        raise ValueError(f"write the converted checkpoint to a new path, not over its source {src}")
    checkpoint_files(src)  # a missing or broken source raises here, before anything is written
    files = _file_arrays(src, with_partner_scales=partner_scales)
    converted = ((name, convert(arrays)) for name, arrays in files)
    if dst.suffix == FILE_SUFFIX or max_shard_bytes is not None:
        merged: dict[str, np.ndarray] = {}
        for _, arrays in converted:
            merged.update(arrays)
        if dst.suffix == FILE_SUFFIX:
            if max_shard_bytes is not None:
                raise ValueError(f"max_shard_bytes writes a directory of shards; {dst} is one file")
            write_safetensors_file(dst, merged, metadata)
            return [dst.name]
        shards = plan_shards(merged, max_shard_bytes)
        converted = ((shard_name(i, len(shards)), s) for i, s in enumerate(shards))
    index = write_safetensors_shards(dst, converted, metadata)
    return sorted(set(index["weight_map"].values()))


def _copy_side_files(src, dst, edit_config: Callable[[dict], dict]) -> None:
    """Copies the non-tensor files of a checkpoint directory (tokenizer, generation config) and
    `config.json`, edited by `edit_config`."""
    src, dst = Path(src), Path(dst)
    src_dir = src.parent if src.is_file() else src
    if dst.suffix == FILE_SUFFIX or src.suffix == FILE_SUFFIX:
        return
    for f in sorted(src_dir.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.suffix == FILE_SUFFIX or f.name == INDEX_NAME:
            continue
        if f.name == CONFIG_NAME:
            config = edit_config(json.loads(f.read_text()))
            (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile(f, dst / f.name)


def cast_to_fp8(
    src, dst, *, policy: CastPolicy = CastPolicy(), max_shard_bytes: int | None = None
) -> list[str]:
    """A BF16/FP32 safetensors checkpoint -> DeepSeek-V3's FP8 layout.

    Args:
      src: a `.safetensors` file, an index json, or a checkpoint directory.
      dst: a `.safetensors` file, or a directory (same file names as `src`, or re-sharded).
      policy: which weights become FP8.
      max_shard_bytes: re-shard the output directory into files of at most this many bytes.

    Returns the names of the quantized weights. A directory `src`'s `config.json` is copied with
    DeepSeek's `quantization_config` added; every file header records it too. On failure, a `dst`
    that did not exist before is removed.
    """
    quantized: list[str] = []

    def convert(arrays):
        quantized.extend(n for n, a in arrays.items() if policy.quantizes(n, a))
        return quantize_arrays(arrays, policy)

    meta = {"quantization_config": json.dumps(QUANTIZATION_CONFIG)}
    with _removed_on_failure(Path(dst)):
        _write(src, dst, convert, partner_scales=False, max_shard_bytes=max_shard_bytes, metadata=meta)
        _copy_side_files(src, dst, lambda c: {**c, "quantization_config": dict(QUANTIZATION_CONFIG)})
    return quantized


def cast_to_high_precision(
    src, dst, *, dtype=ml_dtypes.bfloat16, max_shard_bytes: int | None = None
) -> list[str]:
    """An FP8 checkpoint in DeepSeek-V3's layout -> plain `dtype` weights (DeepSeek's
    `fp8_cast_bf16.py`); the `_scale_inv` tensors are dropped, everything else is copied.

    Returns the names of the dequantized weights; `config.json` loses its `quantization_config`.
    """
    dequantized: list[str] = []

    def convert(arrays):
        dequantized.extend(n.removesuffix(SCALE_SUFFIX) for n in arrays if n.endswith(SCALE_SUFFIX))
        return dequantize_arrays(arrays, np.dtype(dtype))

    with _removed_on_failure(Path(dst)):
        _write(src, dst, convert, partner_scales=True, max_shard_bytes=max_shard_bytes, metadata=None)
        _copy_side_files(src, dst, lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    return dequantized

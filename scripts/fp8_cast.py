"""Casts a safetensors checkpoint to DeepSeek-V3's FP8 layout (E4M3 weights + 128x128 F32
`_scale_inv` blocks) and back.

    python scripts/fp8_cast.py to-fp8 CKPT_BF16 CKPT_FP8 [--max-shard-size 5GB] [--keep REGEX ...]
    python scripts/fp8_cast.py to-bf16 CKPT_FP8 CKPT_BF16 [--dtype float32]

CKPT is a `.safetensors` file, a `model.safetensors.index.json`, or a directory holding one of
them (or `model.safetensors`). A directory output keeps the input's file names, or is re-sharded
with --max-shard-size; it gets an index json and a copy of the input's other files, with
`config.json`'s `quantization_config` added (to-fp8) or removed (to-bf16). Which weights become FP8
is `jfp8.checkpoint_cast.CastPolicy`: 2-D `*.weight` tensors with both sides >= 128, except names
matching a --keep pattern (default: embeddings, norms, lm_head/head, the MoE router `gate`).
"""

from __future__ import annotations

import argparse
import re
import sys

import ml_dtypes
import numpy as np

from jfp8.checkpoint_cast import CastPolicy, cast_to_fp8, cast_to_high_precision

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes ('MB', 'GiB', plain integers too)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    default = CastPolicy()
    fp8 = sub.add_parser("to-fp8", help="BF16/FP32 -> FP8 (E4M3 + 128x128 scale_inv)")
    fp8.add_argument("src")
    fp8.add_argument("dst")
    fp8.add_argument("--keep", action="append", metavar="REGEX",
                     help=f"names that stay high precision (repeatable; replaces the default {default.keep})")
    fp8.add_argument("--min-dim", type=int, default=default.min_dim,
                     help="quantize only 2-D weights with both sides >= this (default %(default)s)")
    fp8.add_argument("--suffix", default=default.suffix, help="quantize only names ending with this")
    bf16 = sub.add_parser("to-bf16", help="FP8 -> BF16 (or --dtype float32), like DeepSeek's fp8_cast_bf16.py")
    bf16.add_argument("src")
    bf16.add_argument("dst")
    bf16.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    for s in (fp8, bf16):
        s.add_argument("--max-shard-size", type=parse_size, default=None,
                       help="re-shard the output directory (e.g. 5GB); default: keep the input's files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return cast(args)
    except (OSError, ValueError, NotImplementedError) as e:
        # What was wrong, in one line; the output path is not left behind (jfp8.checkpoint_cast).
        print(f"fp8_cast.py {args.command}: {e}", file=sys.stderr)
        return 1


def cast(args: argparse.Namespace) -> int:
    if args.command == "to-fp8":
        policy = CastPolicy(suffix=args.suffix, min_dim=args.min_dim,
                            keep=tuple(args.keep) if args.keep is not None else CastPolicy().keep)
        names = cast_to_fp8(args.src, args.dst, policy=policy, max_shard_bytes=args.max_shard_size)
        print(f"{args.dst}: {len(names)} weights in FP8 (E4M3, 128x128 scale_inv)")
    else:
        dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
        names = cast_to_high_precision(args.src, args.dst, dtype=dtype, max_shard_bytes=args.max_shard_size)
        print(f"{args.dst}: {len(names)} FP8 weights cast to {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CPU reference path's bits, written down, so that a change meant to be bit-neutral (a faster
or cheaper-to-compile reference, issue #44) can be checked to the byte against the tree before it.

    python benchmarks/bits_snapshot.py --out /tmp/before.npz                 # on the old tree
    python benchmarks/bits_snapshot.py --compare /tmp/before.npz             # on the new tree
    python benchmarks/bits_snapshot.py --quick --out ... / --compare ...     # ops only, no small preset

Arrays (fixed seeds; the same inputs on every tree): `scaled_matmul` at 1 to 10 K chunks (the
unrolled promotions and the scan) with K tails; `fp8_linear` forward and backward (y, dx, dW)
at shapes with tails in M, K and N under the default recipe, 128x128 gradient blocks and
power-of-two scales; `grouped_fp8_linear` forward and backward with an empty group and rows past
the groups; two train steps (every parameter, moment and metric after them) and the eval step of
`tiny` in FP8 and BF16 and, unless `--quick`, of `small` in FP8. `--compare` exits 1 and names
every array whose bytes differ (with how many elements), 0 when all are equal.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys

import numpy as np


def _leaves(prefix: str, tree) -> dict[str, np.ndarray]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{prefix}{jax.tree_util.keystr(path)}": np.asarray(leaf) for path, leaf in flat}


def _op_arrays() -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    import jfp8

    out = {}
    key = jax.random.key(20261129)

    def normal(shape, dtype, scale=1.0):
        nonlocal key
        key, k = jax.random.split(key)
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)

    for k in (64, 128, 200, 384, 700, 1024, 1152, 1280):  # 1 to 10 chunks: unrolled and scanned
        a = jfp8.quantize(normal((72, k), jnp.float32, 3.0), (1, 128), impl="xla")
        b = jfp8.quantize(normal((136, k), jnp.float32), (128, 128), impl="xla")
        for dtype in (jnp.bfloat16, jnp.float32):
            out[f"scaled_matmul/k{k}/{jnp.dtype(dtype).name}"] = jfp8.scaled_matmul(a, b, out_dtype=dtype, impl="xla")

    recipes = {
        "deepseek": jfp8.Fp8Recipe(impl="xla"),
        "grad128x128": jfp8.Fp8Recipe(impl="xla", grad_block=(128, 128)),
        "pow2": jfp8.Fp8Recipe(impl="xla", pow2_scale=True),
    }
    for m, kk, n in ((64, 64, 96), (200, 320, 130), (256, 128, 384), (130, 700, 260)):
        x, w = normal((m, kk), jnp.bfloat16), normal((kk, n), jnp.float32, 0.05)
        dy = normal((m, n), jnp.bfloat16)
        for name, recipe in recipes.items():
            y, vjp = jax.vjp(lambda x, w: jfp8.fp8_linear(x, w, recipe), x, w)
            dx, dw = vjp(dy)
            for part, v in (("y", y), ("dx", dx), ("dw", dw)):
                out[f"fp8_linear/{m}x{kk}x{n}/{name}/{part}"] = v

    sizes = jnp.array([70, 0, 130, 33], jnp.int32)  # 233 of 260 rows in groups, one group empty
    x, w = normal((260, 200), jnp.bfloat16), normal((4, 200, 144), jnp.float32, 0.05)
    dy = normal((260, 144), jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, w: jfp8.grouped_fp8_linear(x, w, sizes, recipes["deepseek"]), x, w)
    dx, dw = vjp(dy)
    for part, v in (("y", y), ("dx", dx), ("dw", dw)):
        out[f"grouped_fp8_linear/{part}"] = v
    return {k: np.asarray(v) for k, v in out.items()}


def _step_arrays(preset: str, precision: str) -> dict[str, np.ndarray]:
    from jfp8.train import data
    from jfp8.train.config import PRESET_TRAINING, TrainConfig
    from jfp8.train.step import build

    shape = PRESET_TRAINING[preset]
    config = TrainConfig(preset=preset, precision=precision, batch_size=shape["batch_size"],
                         seq_len=shape["seq_len"], steps=shape["steps"], progress=False)
    setup = build(config)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    state = (setup.params, setup.rest, setup.tx.init(setup.params))
    out = {}
    for step in range(2):
        tokens = data.train_batch(split.train, config.batch_size, config.seq_len, config.seed, step)
        *state, metrics = setup.train_step(*state, tokens)
        out.update(_leaves(f"{preset}/{precision}/step{step}/metrics", metrics))
    out.update(_leaves(f"{preset}/{precision}/params", state[0]))
    out.update(_leaves(f"{preset}/{precision}/rest", state[1]))
    out.update(_leaves(f"{preset}/{precision}/opt_state", state[2]))
    val = data.eval_batches(split.val, config.batch_size, config.seq_len, 1)[0]
    out[f"{preset}/{precision}/eval"] = np.asarray(setup.eval_step(state[0], state[1], val))
    return out


def _as_bits(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array as unsigned integers of its width, its dtype in its name ("name|bfloat16"):
    np.savez cannot store bfloat16 or float8 as such, and bytes are what is compared."""
    out = {}
    for k, a in arrays.items():
        a = np.asarray(a)
        out[f"{k}|{a.dtype.name}"] = a.view(f"u{a.dtype.itemsize}") if a.dtype.kind != "b" else a.view("u1")
    return out


def snapshot(quick: bool = False) -> dict[str, np.ndarray]:
    arrays = _op_arrays()
    for preset, precision in (("tiny", "fp8"), ("tiny", "bf16"), *(() if quick else (("small", "fp8"),))):
        arrays.update(_step_arrays(preset, precision))
    return _as_bits(arrays)


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    """What differs between two snapshots, one line per array (missing, other shape or dtype,
    or how many elements' bytes differ)."""
    lines = [f"{k}: only in the saved snapshot" for k in sorted(set(want) - set(got))]
    lines += [f"{k}: not in the saved snapshot" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            lines.append(f"{k}: {a.shape} {a.dtype} against the saved {b.shape} {b.dtype}")
        elif _bytes(a) != _bytes(b):
            lines.append(f"{k}: {int((a != b).sum())} of {a.size} elements differ")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=pathlib.Path, help="write the snapshot here (.npz)")
    what.add_argument("--compare", type=pathlib.Path, help="compare with the snapshot saved here")
    ap.add_argument("--quick", action="store_true", help="ops and tiny only (no small preset)")
    args = ap.parse_args(argv)
    arrays = snapshot(args.quick)
    digest = hashlib.sha256(b"".join(k.encode() + _bytes(arrays[k]) for k in sorted(arrays))).hexdigest()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "wb") as f:
            np.savez(f, **arrays)
        print(f"wrote {len(arrays)} arrays to {args.out} (sha256 {digest[:16]})")
        return 0
    with np.load(args.compare) as saved:
        want = {k: saved[k] for k in saved.files}
    diff = compare(arrays, want)
    for line in diff:
        print(line)
    print(f"{len(arrays)} arrays, {len(diff)} differ (sha256 {digest[:16]})")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

"""Capture real FP8 GEMM operands from a trained model: each projection's input x and output grad dy.

    python experiments/capture_tensors.py --run experiments/results/ablation-small/deepseek \
        --out runs/captured-small.npz
    python experiments/scaling_granularity.py --activations runs/captured-small.npz

Loads the newest checkpoint (or `--step`) of a training run (`train_moe.py`, `compare_precision.py`
or `recipe_ablation.py` output), evaluates the training loss and its gradient on `--batches`
held-out batches with the run's recipe and loss scale (`--loss-scale`: dy is then what the
quantizers saw in that run), and saves, for each `Fp8Linear` whose path matches one of
`--layers` (shell patterns), `"<path>:x"` [tokens, in_features] (what Fprop quantizes in 1x128
tiles) and `"<path>:dy"` [tokens, out_features] (what Dgrad quantizes in 1x128 tiles, or 128x128
blocks in the Appendix B.2 ablation). `jfp8.nn.capture` does the recording.
"""

from __future__ import annotations

import argparse
import fnmatch
import pathlib

import jax.numpy as jnp
import numpy as np

from jfp8.nn.capture import capture_linear_operands
from jfp8.train.probes import load_model, val_batches

# One dense FFN, the attention and shared expert of a middle MoE block, and the MTP projection.
DEFAULT_LAYERS = ("blocks.0.ffn.*", "blocks.3.attn.*", "blocks.3.ffn.shared.*", "mtp.proj")


def capture(run: pathlib.Path, step: int | None, layers: list[str], n_batches: int) -> dict[str, np.ndarray]:
    config, model = load_model(run, step)
    batches = val_batches(config, n_batches)
    out: dict[str, list[np.ndarray]] = {}
    for tokens in batches:
        for path, t in capture_linear_operands(model, jnp.asarray(tokens), config.loss_scale).items():
            if any(fnmatch.fnmatchcase(path, pat) for pat in layers):
                for key, value in t.items():
                    out.setdefault(f"{path}:{key}", []).append(value)
    if not out:
        raise SystemExit(f"no layer matches {layers}; layer paths look like 'blocks.1.attn.wq_a'")
    return {k: np.concatenate(v) for k, v in out.items()}


def main(argv=None) -> dict[str, np.ndarray]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=pathlib.Path, required=True, help="a training run's --out directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--layers", nargs="+", default=list(DEFAULT_LAYERS), help="shell patterns of layer paths")
    p.add_argument("--batches", type=int, default=1, help="held-out batches to capture")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the .npz to write")
    args = p.parse_args(argv)
    tensors = capture(args.run, args.step, args.layers, args.batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **tensors)
    for name, a in tensors.items():
        print(f"{name:>34} {str(a.shape):>14}  max|.| {np.abs(a).max():.3e}")
    print(f"wrote {args.out}")
    return tensors


if __name__ == "__main__":
    main()

"""Scaling granularity of activations: per tensor vs 1x128 tiles vs 128x128 blocks (DeepSeek-V3 §3.3).

    python experiments/scaling_granularity.py                        # synthetic channel outliers
    python experiments/scaling_granularity.py --activations acts.npz # saved arrays {name: array}

Synthetic mode (the default): `jfp8.error_study`'s outlier problem (x ~ N(0, 1) with a few channels
multiplied by a factor, w divided by it, so x @ w.T keeps its distribution) gives two tables:

- `gemm_errors`: `jfp8.error_study.granularity_errors` (activation x weight granularity pairs,
  reference GEMM vs the exact product, the activations' regular-channel error, the accumulation's
  share);
- `activation_errors`: the activations alone, per activation granularity: relative quantization
  error, the error on regular channels, the fraction of non-zero values flushed to zero, the GEMM
  error against N(0, 1/K) weights (128x128 blocks; per tensor with a per-tensor x), and the spread
  of log2(scale).

`--activations PATH.npz` runs the `activation_errors` table (and the scale histograms) on saved
arrays instead, e.g. activations captured from the trained MoE: each array is flattened to
(-1, last axis), the last axis being the contraction (channel) axis. Regular channels there are
those whose max |x| is at most `--outlier-ratio` times the median channel's. Arrays named
`*:dy` (activation gradients, as `capture_tensors.py` names them) are quantized with the recipe's
gradient floor (`GRAD_AMAX_FLOOR`; `--dy-floor 1e-4` gives DeepGEMM's, the default before the
floors were split by role), the others with the activations' (`AMAX_FLOOR`, 1e-4).

Writes `config.json`, `*.csv`/`*.json` tables, `summary.md` and `scale_histograms.png` under `--out` (default
`experiments/results/granularity/`, or `.../granularity/<npz stem>/` with `--activations`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jfp8.error_study import format_table, granularity_errors, outlier_problem  # noqa: E402
from jfp8.fp8 import AMAX_FLOOR, BLOCKS, GRAD_AMAX_FLOOR, TILE, quantize  # noqa: E402
from jfp8.reference import scaled_matmul_reference  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "granularity"
#: activation granularity name -> block (the weights of the GEMM column: blocks, or per tensor)
ACTIVATION_BLOCKS = {
    "tensor": BLOCKS["tensor"], "tile 1x128": BLOCKS["tile"], "block 128x128": BLOCKS["block"],
}
_quantize = jax.jit(quantize, static_argnums=1, static_argnames="amax_floor")
_reference = jax.jit(scaled_matmul_reference, static_argnums=2)


@dataclasses.dataclass(frozen=True)
class Config:
    ks: tuple[int, ...] = (1024, 4096)
    outlier_factors: tuple[float, ...] = (1.0, 1e2, 1e3, 1e4, 1e5)
    m: int = 256  # tokens
    n: int = 256  # output features of the GEMM
    n_outliers: int = 4  # outlier channels
    outlier_ratio: float = 10.0  # channel amax / median channel amax above this: an outlier channel
    histogram_k: int = 4096  # the synthetic K whose scales are histogrammed
    seed: int = 0
    activations: str | None = None  # an .npz of {name: array}, instead of the synthetic problem
    dy_floor: float = GRAD_AMAX_FLOOR  # the amax floor of arrays named "*:dy" (gradients)


@dataclasses.dataclass(frozen=True)
class ActivationRow:
    name: str
    shape: tuple[int, int]
    granularity: str
    amax_floor: float  # the quantizer's amax floor for this tensor's role
    quant_error: float  # ||Q(x) - x||_F / ||x||_F
    regular_error: float  # the same, on regular (non-outlier) channels only
    flushed_to_zero: float  # fraction of the non-zero x that quantize to 0
    gemm_error: float  # ||Q(x) Q(w)^T - x w^T||_F / ||x w^T||_F, w ~ N(0, 1/K)
    n_scales: int
    log2_scale_min: float
    log2_scale_median: float
    log2_scale_max: float


def regular_channels(x: np.ndarray, ratio: float) -> np.ndarray:
    """Indices of the channels (last axis) whose max |x| is at most `ratio` x the median's."""
    amax = np.max(np.abs(x), axis=0)
    return np.flatnonzero(amax <= ratio * np.median(amax))


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    norm = np.linalg.norm(ref)
    return float(np.linalg.norm(err) / norm) if norm > 0 else 0.0


def activation_rows(name: str, x: np.ndarray, config: Config, rng: np.random.Generator):
    """One `ActivationRow` per activation granularity, and {granularity: log2 scales}."""
    x = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    m, k = x.shape
    x64 = x.astype(np.float64)
    regular = regular_channels(x, config.outlier_ratio)
    w = (rng.standard_normal((config.n, k)) / np.sqrt(k)).astype(np.float32)
    exact = x64 @ w.astype(np.float64).T
    floor = config.dy_floor if name.endswith(":dy") else AMAX_FLOOR
    rows, scales = [], {}
    for gran, block in ACTIVATION_BLOCKS.items():
        qx = _quantize(jnp.asarray(x), block, amax_floor=floor)
        qw = _quantize(jnp.asarray(w), None if block is None else BLOCKS["block"])
        deq = np.asarray(qx.dequantize(jnp.float32), np.float64)
        out = np.asarray(_reference(qx, qw, jnp.float32), np.float64)
        log2s = np.log2(np.asarray(qx.scale, np.float64).ravel())
        scales[gran] = log2s
        nonzero = x != 0
        rows.append(ActivationRow(
            name=name, shape=(m, k), granularity=gran, amax_floor=floor,
            quant_error=_rel(deq - x64, x64),
            regular_error=_rel(deq[:, regular] - x64[:, regular], x64[:, regular]),
            flushed_to_zero=float(np.mean(deq[nonzero] == 0)) if nonzero.any() else 0.0,
            gemm_error=_rel(out - exact, exact),
            n_scales=int(log2s.size),
            log2_scale_min=float(log2s.min()), log2_scale_median=float(np.median(log2s)),
            log2_scale_max=float(log2s.max()),
        ))
    return rows, scales


def load_activations(path: pathlib.Path) -> dict[str, np.ndarray]:
    """{name: float32 array (>= 2-D, last axis = channels)} from an .npz of {name: array}."""
    out = {}
    with np.load(path) as data:
        for name in data.files:
            a = np.asarray(data[name])
            if a.ndim < 2 or not np.issubdtype(a.dtype, np.floating):
                raise ValueError(
                    f"{path}: array {name!r} has shape {a.shape} and dtype {a.dtype}; save floating "
                    "activations with at least 2 axes (..., channels)"
                )
            out[name] = a.astype(np.float32)
    if not out:
        raise ValueError(f"{path} holds no arrays")
    return out


def format_activation_table(rows: list[ActivationRow]) -> str:
    head = (f"{'tensor':>22} {'granularity':>14} {'floor':>8} | {'quant':>8} {'regular':>8} {'flushed':>8} {'GEMM':>8} | "
            f"{'#scales':>7} {'log2 s min/med/max':>20}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.name:>22} {r.granularity:>14} {r.amax_floor:8.1e} | {r.quant_error:8.2e} {r.regular_error:8.2e} "
            f"{r.flushed_to_zero:8.2%} {r.gemm_error:8.2e} | {r.n_scales:7d} "
            f"{r.log2_scale_min:6.1f} {r.log2_scale_median:6.1f} {r.log2_scale_max:6.1f}"
        )
    return "\n".join(lines)


def plot_scales(scales: dict[str, dict[str, np.ndarray]], path: pathlib.Path, title: str) -> None:
    """One panel per tensor: histograms of log2(scale), tiles and blocks; the per-tensor scale."""
    names = list(scales)
    cols = min(len(names), 3)
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    for ax, name in zip(axes.ravel(), names):
        s = scales[name]
        lo = min(v.min() for v in s.values())
        hi = max(v.max() for v in s.values())
        bins = np.linspace(np.floor(lo) - 0.5, np.ceil(hi) + 0.5, 60)
        for gran in ("tile 1x128", "block 128x128"):
            ax.hist(s[gran], bins=bins, weights=np.full(s[gran].size, 1 / s[gran].size), histtype="step",
                    lw=1.5, label=f"{gran} ({s[gran].size})")
        ax.axvline(s["tensor"][0], color="k", ls="--", label="per tensor")
        ax.set_yscale("log")  # the few outlier tiles/blocks are the point
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("log2(scale)")
        ax.set_ylabel("fraction of scales")
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(names):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_rows(rows, path_stem: pathlib.Path) -> None:
    dicts = [dataclasses.asdict(r) for r in rows]
    path_stem.with_suffix(".json").write_text(json.dumps(dicts, indent=1))
    with open(path_stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    p.add_argument("--activations", type=pathlib.Path, default=None, help=".npz of {name: array} to analyse")
    p.add_argument("--ks", type=int, nargs="+", default=list(d.ks))
    p.add_argument("--factors", type=float, nargs="+", default=list(d.outlier_factors))
    p.add_argument("--m", type=int, default=d.m)
    p.add_argument("--n", type=int, default=d.n)
    p.add_argument("--outliers", type=int, default=d.n_outliers)
    p.add_argument("--outlier-ratio", type=float, default=d.outlier_ratio)
    p.add_argument("--histogram-k", type=int, default=d.histogram_k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dy-floor", type=float, default=d.dy_floor,
                   help="amax floor of the arrays named '*:dy' (default: the recipe's gradient floor)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    config = Config(
        ks=tuple(args.ks), outlier_factors=tuple(args.factors), m=args.m, n=args.n, n_outliers=args.outliers,
        outlier_ratio=args.outlier_ratio, histogram_k=args.histogram_k, seed=args.seed,
        activations=None if args.activations is None else str(args.activations), dy_floor=args.dy_floor,
    )
    out = args.out or (OUT if args.activations is None else OUT / args.activations.stem)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(config.seed)
    t0 = time.perf_counter()
    command = "python experiments/scaling_granularity.py" + (
        "" if args.activations is None else f" --activations {args.activations.name}")
    summary = [f"# Scaling granularity of activations (`{command}`)", ""]

    if args.activations is not None:
        tensors = load_activations(args.activations)
        title = f"log2 of the activation scales: {args.activations.name}"
    else:
        gemm = granularity_errors(config.ks, config.outlier_factors, m=config.m, n=config.n,
                                  n_outliers=config.n_outliers, seed=config.seed)
        summary += [f"GEMM error by granularity (activations x weights), M=N={config.m}, "
                    f"{config.n_outliers} outlier channels (x scaled by the factor, w divided by it); "
                    "GEMM = vs the exact product, regular = quantization error of x on the other channels, "
                    "accum = reference GEMM vs f64 oracle",
                    "", "```", format_table(gemm), "```", ""]
        _write_rows(gemm, out / "gemm_errors")
        tensors = {}
        for factor in config.outlier_factors:
            x, _, _ = outlier_problem(config.m, config.n, config.histogram_k, factor, config.n_outliers, rng)
            tensors["no outliers" if factor == 1 else f"outliers x{factor:.0e}"] = x
        title = (f"log2 of the activation scales: N(0,1), {config.m}x{config.histogram_k}, "
                 f"{config.n_outliers} outlier channels")

    rows, scales = [], {}
    for name, x in tensors.items():
        r, s = activation_rows(name, x, config, rng)
        rows += r
        scales[name] = s
    summary += ["Activation quantization by granularity (GEMM: against N(0, 1/K) weights in 128x128 blocks, "
                "per tensor for a per-tensor x; regular: channels with amax <= "
                f"{config.outlier_ratio} x the median channel's)",
                "", "```", format_activation_table(rows), "```"]
    text = "\n".join(summary)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    _write_rows(rows, out / "activation_errors")
    plot_scales(scales, out / "scale_histograms.png", title)
    seconds = time.perf_counter() - t0
    (out / "config.json").write_text(json.dumps(
        dict(dataclasses.asdict(config), tile=TILE, jax=jax.__version__, seconds=round(seconds, 1)),
        indent=1))
    print(f"({seconds:.1f} s; wrote {out})")


if __name__ == "__main__":
    main()

"""Power-of-two (UE8M0) scales vs exact FP32 scales (DeepSeek-V3 §3.3 / Appendix: pow2 scales).

    python experiments/pow2_scales.py                   # ~30 s on 2 CPUs
    python experiments/pow2_scales.py --m 128 --k 1024 --out /tmp/pow2

A power-of-two scale is the FP32 scale rounded up to 2**ceil(log2 s) (`quantize(..., pow2_scale=True)`),
so a block's amax lands in (224, 448] instead of exactly on 448: up to one binade of E4M3's range
is left unused ("headroom"), values sink toward the subnormals, and the rounding grid moves. This
measures what that costs, per distribution of the activations:

- quantization error of x with 1x128 tiles, 128x128 blocks, per tensor: normwise
  ||Q(x) - x||_F / ||x||_F (the largest values dominate it) and the mean elementwise |Q(x) - x| / |x|;
- the fraction of non-zero values flushed to zero, and the mean headroom log2(448 / max|q|) in bits;
- the GEMM error of Q(x) Q(w)^T (the reference GEMM, chunked FP32 accumulation) against the exact
  float64 product of the unquantized inputs, w ~ N(0, 1/K) quantized in 128x128 blocks (per tensor
  with a per-tensor x), both operands with the same kind of scale.

The same x (and w) serve both scale kinds, so the comparison is paired. Writes `config.json`,
`results.csv`, `results.json`, `summary.md` and `pow2_vs_fp32.png` under `--out`. (The loss impact
in training is a separate experiment.)
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

from jfp8.error_study import outlier_problem  # noqa: E402
from jfp8.fp8 import BLOCKS, E4M3_MAX, quantize  # noqa: E402
from jfp8.reference import scaled_matmul_reference  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "pow2"
GRANULARITIES = {"tile 1x128": BLOCKS["tile"], "block 128x128": BLOCKS["block"], "tensor": BLOCKS["tensor"]}
_quantize = jax.jit(quantize, static_argnums=1, static_argnames=("pow2_scale",))
_reference = jax.jit(scaled_matmul_reference, static_argnums=2)


def make_activations(name: str, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """x (m, k) float32 from a named distribution."""
    if name == "normal":
        x = rng.standard_normal((m, k))
    elif name == "uniform":
        x = rng.uniform(-1, 1, (m, k))
    elif name == "student-t3":  # heavy tails
        x = rng.standard_t(3, (m, k))
    elif name == "lognormal rows":  # token magnitudes spread over ~6 binades
        x = rng.standard_normal((m, k)) * np.exp(rng.normal(0, 2, (m, 1)))
    elif name == "channel outliers x100":
        x, _, _ = outlier_problem(m, 1, k, 100.0, 4, rng)
    elif name == "normal x1e-6":  # amax below jfp8's AMAX_FLOOR (1e-4): the floor sets the scale
        x = rng.standard_normal((m, k)) * 1e-6
    else:
        raise ValueError(f"unknown distribution {name!r}")
    return x.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Config:
    distributions: tuple[str, ...] = (
        "normal", "uniform", "student-t3", "lognormal rows", "channel outliers x100", "normal x1e-6",
    )
    m: int = 256
    k: int = 2048
    n: int = 256
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Row:
    distribution: str
    granularity: str
    scale: str  # "fp32" | "pow2"
    quant_error: float  # ||Q(x) - x||_F / ||x||_F (dominated by the largest values)
    mean_rel_error: float  # mean over non-zero x of |Q(x) - x| / |x| (every value counts alike)
    flushed_to_zero: float
    headroom_bits: float  # mean over blocks of log2(448 / max |q|): 0 for fp32 scales, [0, 1) for pow2
    gemm_error: float


def _rel(err, ref) -> float:
    return float(np.linalg.norm(err) / np.linalg.norm(ref))


def measure(dist: str, x: np.ndarray, w: np.ndarray) -> list[Row]:
    x64 = x.astype(np.float64)
    exact = x64 @ w.astype(np.float64).T
    rows = []
    for gran, block in GRANULARITIES.items():
        for pow2 in (False, True):
            qx = _quantize(jnp.asarray(x), block, pow2_scale=pow2)
            qw = _quantize(jnp.asarray(w), None if block is None else BLOCKS["block"], pow2_scale=pow2)
            deq = np.asarray(qx.dequantize(jnp.float32), np.float64)
            out = np.asarray(_reference(qx, qw, jnp.float32), np.float64)
            # max |q| per block, from the data: how much of E4M3's range the scale lets the block use
            q = np.abs(np.asarray(qx.data.astype(jnp.float32), np.float64))
            if block is None:
                qmax = q.max(keepdims=True)
            else:
                bm, bk = block
                qmax = q.reshape(q.shape[0] // bm, bm, q.shape[1] // bk, bk).max(axis=(1, 3))
            qmax = qmax[qmax > 0]
            nonzero = x != 0
            rows.append(Row(
                distribution=dist, granularity=gran, scale="pow2" if pow2 else "fp32",
                quant_error=_rel(deq - x64, x64),
                mean_rel_error=float(np.mean(np.abs(deq[nonzero] - x64[nonzero]) / np.abs(x64[nonzero]))),
                flushed_to_zero=float(np.mean(deq[nonzero] == 0)),
                headroom_bits=float(np.mean(np.log2(E4M3_MAX / qmax))),
                gemm_error=_rel(out - exact, exact),
            ))
    return rows


def format_table(rows: list[Row]) -> str:
    keyed = {(r.distribution, r.granularity, r.scale): r for r in rows}
    head = (f"{'distribution':>22} {'granularity':>14} | {'quant fp32':>10} {'pow2':>9} {'ratio':>6} | "
            f"{'elem fp32':>9} {'pow2':>9} {'ratio':>6} | "
            f"{'GEMM fp32':>9} {'pow2':>9} {'ratio':>6} | {'flushed fp32/pow2':>17} {'headroom':>8}")
    lines = [head, "-" * len(head)]
    for dist, gran in dict.fromkeys((r.distribution, r.granularity) for r in rows):
        f, p = keyed[(dist, gran, "fp32")], keyed[(dist, gran, "pow2")]
        lines.append(
            f"{dist:>22} {gran:>14} | "
            f"{f.quant_error:10.3e} {p.quant_error:9.3e} {p.quant_error / f.quant_error:6.3f} | "
            f"{f.mean_rel_error:9.3e} {p.mean_rel_error:9.3e} {p.mean_rel_error / f.mean_rel_error:6.3f} | "
            f"{f.gemm_error:9.3e} {p.gemm_error:9.3e} {p.gemm_error / f.gemm_error:6.3f} | "
            f"{f.flushed_to_zero:8.3%}/{p.flushed_to_zero:7.3%} | "
            f"{f.headroom_bits:9.2f}/{p.headroom_bits:4.2f} bits"
        )
    return "\n".join(lines)


def plot(rows: list[Row], config: Config, path: pathlib.Path) -> None:
    """Left: quantization error per distribution (fp32 vs pow2, tiles and blocks); right: the
    pow2 / fp32 ratio of the quantization and the GEMM errors."""
    keyed = {(r.distribution, r.granularity, r.scale): r for r in rows}
    dists = list(config.distributions)
    grans = list(GRANULARITIES)
    x = np.arange(len(dists))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(15, 4.8))
    width = 0.8 / (2 * len(grans))
    for i, gran in enumerate(grans):
        for j, scale in enumerate(("fp32", "pow2")):
            vals = [keyed[(d, gran, scale)].quant_error for d in dists]
            ax0.bar(x + (2 * i + j - len(grans) + 0.5) * width, vals, width,
                    label=f"{gran}, {scale}", hatch="//" if scale == "pow2" else None,
                    color=f"C{i}", alpha=0.5 if scale == "pow2" else 0.9)
    ax0.set_yscale("log")
    ax0.set_ylabel("||Q(x) - x|| / ||x||")
    ax0.set_title("E4M3 quantization error of the activations")
    width = 0.8 / len(grans)
    for i, gran in enumerate(grans):
        q = [keyed[(d, gran, "pow2")].quant_error / keyed[(d, gran, "fp32")].quant_error for d in dists]
        e = [keyed[(d, gran, "pow2")].mean_rel_error / keyed[(d, gran, "fp32")].mean_rel_error for d in dists]
        g = [keyed[(d, gran, "pow2")].gemm_error / keyed[(d, gran, "fp32")].gemm_error for d in dists]
        off = (i - (len(grans) - 1) / 2) * width
        ax1.bar(x + off, q, width * 0.9, color=f"C{i}", alpha=0.9, label=f"{gran}: quantization (normwise)")
        ax1.plot(x + off, e, "wo", mec="k", ms=6, label="elementwise mean" if i == 0 else None)
        ax1.plot(x + off, g, "k^", ms=7, label="GEMM (x and w)" if i == 0 else None)
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.set_yscale("log")
    ax1.set_ylabel("error with pow2 scales / with fp32 scales")
    ax1.set_title(f"Cost of power-of-two scales (GEMM: {config.m}x{config.k} @ ({config.n}x{config.k})^T)")
    ax0.set_ylim(min(r.quant_error for r in rows) / 2, None)
    for ax in (ax0, ax1):
        ax.set_xticks(x, dists, rotation=20, fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    ax0.legend(fontsize=7, ncol=3, loc="lower center")
    ax1.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    p.add_argument("--distributions", nargs="+", default=list(d.distributions))
    p.add_argument("--m", type=int, default=d.m)
    p.add_argument("--k", type=int, default=d.k)
    p.add_argument("--n", type=int, default=d.n)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    args = p.parse_args(argv)
    config = Config(distributions=tuple(args.distributions), m=args.m, k=args.k, n=args.n, seed=args.seed)

    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    rows = []
    for dist in config.distributions:
        x = make_activations(dist, config.m, config.k, rng)
        w = (rng.standard_normal((config.n, config.k)) / np.sqrt(config.k)).astype(np.float32)
        rows += measure(dist, x, w)
    seconds = time.perf_counter() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    dicts = [dataclasses.asdict(r) for r in rows]
    (args.out / "results.json").write_text(json.dumps(dicts, indent=1))
    with open(args.out / "results.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(dicts[0]))
        wr.writeheader()
        wr.writerows(dicts)
    (args.out / "config.json").write_text(json.dumps(
        dict(dataclasses.asdict(config), jax=jax.__version__, seconds=round(seconds, 1)), indent=1))
    plot(rows, config, args.out / "pow2_vs_fp32.png")
    text = "\n".join([
        "# Power-of-two vs FP32 scales (`python experiments/pow2_scales.py`)", "",
        f"x {config.m}x{config.k} from each distribution, w ~ N(0, 1/K) {config.n}x{config.k}; quant = "
        "||Q(x) - x|| / ||x||, elem = mean |Q(x) - x| / |x|, GEMM = reference GEMM vs the exact "
        "product of the unquantized inputs; ratio = pow2 / fp32; headroom = mean log2(448 / max |q|) "
        "per block.", "",
        "```", format_table(rows), "```",
    ])
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"({seconds:.1f} s; wrote {args.out})")


if __name__ == "__main__":
    main()

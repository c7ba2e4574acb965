"""How much error each scaling granularity adds to a GEMM, with and without channel outliers.

DeepSeek-V3 §3.3 motivates 1x128 activation tiles and 128x128 weight blocks by outliers: one
large activation channel forces a per-tensor scale so large that ordinary values lose their
precision or flush to zero. This module measures that on synthetic data, for the demo and tests.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jfp8.fp8 import TILE, Block, quantize
from jfp8.reference import scaled_matmul_oracle, scaled_matmul_reference

#: name -> (activation block, weight block)
GRANULARITIES: dict[str, tuple[Block, Block]] = {
    "per-tensor": (None, None),
    "tile x block": ((1, TILE), (TILE, TILE)),  # DeepSeek-V3
    "block x block": ((TILE, TILE), (TILE, TILE)),
}


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    k: int
    outlier_factor: float  # 1.0: no outliers
    granularity: str
    gemm_error: float  # ||Q(x) Q(w)^T - x w^T||_F / ||x w^T||_F, exact product in float64
    regular_channel_error: float  # quantization error of x on the channels without outliers
    accumulation_error: float  # reference GEMM vs the f64 oracle on the same FP8 operands


def outlier_problem(
    m: int, n: int, k: int, outlier_factor: float, n_outliers: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (m, k) ~ N(0, 1) with `n_outliers` channels scaled by `outlier_factor`, and w (n, k) with
    those channels divided by it, so `x @ w.T` has the same distribution as without outliers
    (SmoothQuant's equivalence): the error then measures only the harm done to the other channels.

    Returns (x, w, indices of the regular channels).
    """
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    channels = rng.choice(k, size=min(n_outliers, k), replace=False)
    x[:, channels] *= outlier_factor
    w[:, channels] /= outlier_factor
    return x, w, np.setdiff1d(np.arange(k), channels)


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(err) / np.linalg.norm(ref))


def granularity_errors(
    ks=(256, 1024, 4096),
    outlier_factors=(1.0, 1e3, 1e5),
    *,
    m: int = 256,
    n: int = 256,
    n_outliers: int = 4,
    seed: int = 0,
) -> list[ErrorRow]:
    """One `ErrorRow` per (K, outlier factor, granularity), on fresh data from `seed`."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in ks:
        for factor in outlier_factors:
            x, w, regular = outlier_problem(m, n, k, factor, n_outliers, rng)
            exact = x.astype(np.float64) @ w.astype(np.float64).T
            for name, (a_block, b_block) in GRANULARITIES.items():
                a, b = quantize(jnp.asarray(x), a_block), quantize(jnp.asarray(w), b_block)
                out = np.asarray(scaled_matmul_reference(a, b, jnp.float32), np.float64)
                x_deq = np.asarray(a.dequantize(jnp.float32), np.float64)
                rows.append(
                    ErrorRow(
                        k=k,
                        outlier_factor=float(factor),
                        granularity=name,
                        gemm_error=_rel(out - exact, exact),
                        regular_channel_error=_rel(
                            x_deq[:, regular] - x[:, regular], x[:, regular].astype(np.float64)
                        ),
                        accumulation_error=_rel(out - scaled_matmul_oracle(a, b), exact),
                    )
                )
    return rows


def format_table(rows: list[ErrorRow]) -> str:
    """A plain-text table: one line per (K, outlier factor), one column group per granularity."""
    names = list(GRANULARITIES)
    head = f"{'K':>6} {'outliers':>9} | " + " | ".join(f"{nm:^25}" for nm in names)
    sub = f"{'':>6} {'':>9} | " + " | ".join(f"{'GEMM':>8} {'regular':>8} {'accum':>7}" for _ in names)
    lines = [head, sub, "-" * len(head)]
    keyed = {(r.k, r.outlier_factor, r.granularity): r for r in rows}
    for k, factor in dict.fromkeys((r.k, r.outlier_factor) for r in rows):
        label = "none" if factor == 1.0 else f"x{factor:.0e}"
        cells = []
        for nm in names:
            r = keyed[(k, factor, nm)]
            cells.append(
                f"{r.gemm_error:8.2e} {r.regular_channel_error:8.2e} {r.accumulation_error:7.1e}"
            )
        lines.append(f"{k:>6} {label:>9} | " + " | ".join(cells))
    return "\n".join(lines)

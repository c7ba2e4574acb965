"""A bit-level simulator of the FP8 tensor-core accumulator (DeepSeek-V3 §3.3).

DeepSeek-V3 §3.3, "Increasing Accumulation Precision": on H800 the FP8 GEMM accumulates in the
tensor cores with about 14 bits kept (the addends are aligned to the largest exponent by
right-shifting and the bits past the kept width are truncated), which gives a maximum relative
error near 2 % at K = 4096; promoting the partial sums to FP32 every N_C = 128 K-elements, where
the per-tile scales are applied, removes the problem. `simulated_scaled_matmul` replays that
accumulator exactly, with the numbers of bits, the MMA K-step, the promotion interval and the
rounding as knobs (`AccumulatorModel`), so the claim can be measured rather than assumed.

The model, step by step, for one output element (all of it vectorised over the (M, N) output):

1. Operands are E4M3 values without their scales; every product is exact (8 significant bits),
   as in the tensor core's multipliers.
2. The K axis is cut into MMA steps of `mma_k` products (32 for a Hopper FP8 wgmma instruction).
   Per step the products meet the limited-precision partial `p` (which starts at 0):
   - `alignment="group"`: the `mma_k` products are summed exactly into `g`; then `p` and `g` are
     aligned to the larger of their two exponents `e` (2**e <= |x| < 2**(e+1)) by cutting them to
     multiples of the quantum `q = 2**(e - kept_bits + 1)`, and added exactly.
   - `alignment="product"`: each product and `p` are aligned to the largest exponent among all
     `mma_k + 1` addends and cut to that quantum, then added exactly (closer to the report's
     wording "aligned to the largest exponent by right-shifting"; more error, since every product
     loses its low bits rather than only their sum).
   The sum is then rounded to `kept_bits` significant bits at its own exponent (only matters on a
   carry). "Cut" is `rounding`: "truncate" (toward zero, as on the hardware) or "nearest"
   (round half to even, the what-if).
3. Every `promotion_interval` K-elements (N_C), the partial is promoted: `acc += f32(p) * (sa *
   sb)` in FP32, with the scales of that interval, and `p` restarts at 0 (DeepSeek-V3 / DeepGEMM:
   the promotion happens on the CUDA cores, which is where the per-tile scales can be applied).
   `promotion_interval=None` never promotes: `p` runs over the whole K and is scaled once at the
   end, as a pre-DeepSeek FP8 GEMM with per-tensor scales in its epilogue does.

What the model assumes, and what it leaves out:

- `kept_bits` counts significant bits including the leading one (a float's precision p): 14 is an
  e8m13 ("FP22") accumulator, 24 would be FP32. The report's "around 14 bits" is read this way;
  sweep 13..16 to see how much the reading matters.
- Scales can only be applied at promotion points, so they must be constant inside each promotion
  interval: a tile- or block-scaled operand (one scale per 128 K-elements) needs N_C dividing 128;
  for N_C > 128 or None the operands must be scaled per tensor (`quantize(x, None)`), which is what
  a GEMM without promotion had to use. This is checked, not worked around.
- Exponent range is unlimited (the accumulator never overflows or flushes to zero) and the
  products are not subnormal-flushed; the hardware's exact internal adder tree, the order of the
  32 products inside an instruction and any extra guard bits are unknown and not modelled beyond
  the two `alignment` variants.
- The arithmetic is exact, in float64: E4M3 products are multiples of 2**-18 below 2**18, so the
  exact sum of one MMA step (up to 2**17 products) fits in 53 bits; cutting to a quantum scales by
  a power of two, truncates or rounds, and scales back, which is exact; after the cut every addend
  of a step is a multiple of one quantum q and below 2**(e+1), so their sum has at most
  kept_bits + log2(mma_k + 1) + 1 significant bits and is exact too, whatever K. The simulator
  therefore traces its own jitted loop under `jax.enable_x64` (the rest of the program keeps
  x64 off); it is meant for concrete arrays, and gives the same result under an outer `jax.jit`.

With `kept_bits=None` ("fp32") the partial over each promotion interval is an FP32 `dot` of the
FP8 chunk, exactly as in `scaled_matmul_reference`; with `promotion_interval=128` the two are the
same computation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.fp8 import TILE, Fp8Tensor, move_bytes, quantize
from jfp8.reference import check_nt_operands, chunk_operand, scaled_matmul_oracle

Rounding = Literal["truncate", "nearest"]
Alignment = Literal["group", "product"]

#: The K-width of one Hopper FP8 wgmma instruction (m64nNk32): products added per MMA step.
HOPPER_MMA_K = 32
#: The kept precision the report measured on H800 ("around 14 bits"), read as e8m13.
HOPPER_KEPT_BITS = 14
#: An f32 partial holds at most this many significant bits (promotion converts `p` to f32).
_MAX_KEPT_BITS = int(jnp.finfo(jnp.float32).nmant) + 1  # 24


@dataclasses.dataclass(frozen=True)
class AccumulatorModel:
    """How the tensor-core accumulator is simulated (see the module docstring for the model).

    Attributes:
      kept_bits: significant bits of the limited-precision partial (14 ~ Hopper FP8), or None (or
        "fp32") for the exact FP32 baseline, which equals `scaled_matmul_reference` at N_C = 128.
      mma_k: products per MMA step (32 for Hopper FP8 wgmma).
      promotion_interval: N_C, K-elements between promotions to FP32; a multiple of `mma_k`, or
        None for never (one scaling at the end; per-tensor operands only).
      rounding: "truncate" (toward zero, the hardware) or "nearest" (half to even).
      alignment: "group" (exact sum per MMA step, then aligned with the partial) or "product"
        (each product aligned to the step's largest exponent before summing).
    """

    kept_bits: int | None = HOPPER_KEPT_BITS
    mma_k: int = HOPPER_MMA_K
    promotion_interval: int | None = TILE
    rounding: Rounding = "truncate"
    alignment: Alignment = "group"

    def __post_init__(self):
        if self.kept_bits == "fp32":
            object.__setattr__(self, "kept_bits", None)
        kb = self.kept_bits
        valid = isinstance(kb, int) and not isinstance(kb, bool) and 2 <= kb <= _MAX_KEPT_BITS
        if kb is not None and not valid:
            raise ValueError(
                f"kept_bits must be an int in [2, {_MAX_KEPT_BITS}] (significant bits, 14 ~ Hopper) "
                f"or None / 'fp32' for the exact FP32 baseline; got {kb!r}"
            )
        if not isinstance(self.mma_k, int) or self.mma_k < 1:
            raise ValueError(f"mma_k must be a positive int (32 on Hopper), got {self.mma_k!r}")
        nc = self.promotion_interval
        if nc is not None and (not isinstance(nc, int) or nc < 1 or nc % self.mma_k):
            raise ValueError(
                f"promotion_interval must be None or a positive multiple of mma_k={self.mma_k}, "
                f"got {nc!r}"
            )
        if self.rounding not in ("truncate", "nearest"):
            raise ValueError(f"rounding must be 'truncate' or 'nearest', got {self.rounding!r}")
        if self.alignment not in ("group", "product"):
            raise ValueError(f"alignment must be 'group' or 'product', got {self.alignment!r}")

    @classmethod
    def fp32(cls, promotion_interval: int | None = TILE) -> AccumulatorModel:
        """Exact FP32 accumulation: `scaled_matmul_reference` when N_C = 128."""
        return cls(kept_bits=None, promotion_interval=promotion_interval)

    @classmethod
    def hopper(cls, promotion_interval: int | None = None) -> AccumulatorModel:
        """The H800 tensor core as the report describes it; no promotion by default."""
        return cls(kept_bits=HOPPER_KEPT_BITS, promotion_interval=promotion_interval)

    @classmethod
    def deepseek(cls) -> AccumulatorModel:
        """Hopper's accumulator with DeepSeek-V3's promotion every N_C = 128."""
        return cls(kept_bits=HOPPER_KEPT_BITS, promotion_interval=TILE)

    @property
    def label(self) -> str:
        bits = "fp32" if self.kept_bits is None else f"{self.kept_bits}b"
        nc = "none" if self.promotion_interval is None else str(self.promotion_interval)
        return f"{bits}/NC={nc}/{self.rounding}/{self.alignment}"


def _check_scales_fit(t: Fp8Tensor, name: str, model: AccumulatorModel) -> None:
    """Per-128 scales can only be applied at promotion points, so N_C must divide the tile."""
    if t.block is None:
        return
    nc = model.promotion_interval
    if nc is None or nc > TILE or TILE % nc:
        raise ValueError(
            f"{name} is scaled per {TILE} K-elements (block {t.block}), but promotion_interval={nc} "
            f"would have to apply several scales inside one limited-precision partial, which the "
            f"hardware cannot do: quantize {name} per tensor (quantize(x, None)) for N_C > {TILE} or "
            f"None, or use a promotion_interval dividing {TILE}"
        )


def _operand(t: Fp8Tensor, kp: int) -> tuple[jax.Array, jax.Array]:
    """(data [rows, kp] e4m3, scales [rows, kp // 128] f32), zero data past K.

    Padding past the last 128-chunk only happens for per-tensor operands (N_C > 128 or None); the
    scale is repeated there, because a promotion interval ending in the padding applies the scale
    of its last step to real products.
    """
    kp128 = -(-t.logical[1] // TILE) * TILE
    data, s = chunk_operand(t, kp128)
    data = move_bytes(lambda d: jnp.pad(d, ((0, 0), (0, kp - kp128))), data)
    s = jnp.pad(s, ((0, 0), (0, (kp - kp128) // TILE)), mode="edge")
    return data, s


# Exact power-of-two arithmetic on float64 through the bits (no log2/exp2, cheaper than frexp):
# every value the accumulator sees is 0 or a multiple of 2**-18 below 2**54, far from the f64
# subnormal and overflow ranges, so the exponent field is the whole story.
_F64_BIAS = 1023
_F64_MANT = 52
_MIN_EXP = -200  # stands for the exponent of 0: below any real addend, and 2**±(it + bits) is finite


def _exponent(x: jax.Array) -> jax.Array:
    """floor(log2 |x|) of f64 x, as int64; _MIN_EXP for 0."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int64)
    e = ((bits >> _F64_MANT) & 0x7FF) - _F64_BIAS
    return jnp.maximum(e, _MIN_EXP)


def _pow2(e: jax.Array) -> jax.Array:
    """2.0**e in f64 for int64 e in the normal range."""
    return jax.lax.bitcast_convert_type((e + _F64_BIAS) << _F64_MANT, jnp.float64)


def _cut(x: jax.Array, quantum_exp: jax.Array, rounding: Rounding) -> jax.Array:
    """x cut to a multiple of 2**quantum_exp (f64, exact: scaling by powers of two)."""
    y = x * _pow2(-quantum_exp)
    y = jnp.trunc(y) if rounding == "truncate" else jnp.round(y)  # jnp.round: half to even
    return y * _pow2(quantum_exp)


def _to_precision(x: jax.Array, kept_bits: jax.Array, rounding: Rounding) -> jax.Array:
    """x rounded to `kept_bits` significant bits at its own exponent."""
    return _cut(x, _exponent(x) - kept_bits + 1, rounding)


def _mma_step(p, a_s, b_s, kept_bits, rounding: Rounding, alignment: Alignment):
    """One MMA step: the partial p [M, N] plus the products of a_s [M, k] and b_s [N, k] (f64)."""
    if alignment == "group":
        g = a_s @ b_s.T  # exact: products and their sums are exact in f64
        e = jnp.maximum(_exponent(p), _exponent(g))
        qe = e - kept_bits + 1
        s = _cut(p, qe, rounding) + _cut(g, qe, rounding)
    else:
        prods = a_s[:, None, :] * b_s[None, :, :]  # [M, N, k], exact
        e = jnp.maximum(_exponent(p), jnp.max(_exponent(prods), axis=-1))
        qe = e - kept_bits + 1
        s = _cut(p, qe, rounding) + jnp.sum(_cut(prods, qe[..., None], rounding), axis=-1)
    return _to_precision(s, kept_bits, rounding)


def _piece_scales(s: jax.Array, kp: int, span: int) -> jax.Array:
    """[kp // span, rows]: the scale of each `span`-wide piece of K (that of its first element;
    constant inside the piece, checked by `_check_scales_fit`). s is [rows, kp // 128]."""
    starts = np.arange(0, kp, span) // TILE
    return s[:, starts].T


@functools.partial(jax.jit, static_argnames=("kp", "mma_k", "rounding", "alignment"))
def _simulate_limited(a, b, promote, kept_bits, *, kp, mma_k, rounding, alignment):
    """The limited-precision path, traced under x64. a (M, K), b (N, K) `Fp8Tensor`s; promote [S]
    bool: promote after MMA step s; kept_bits: int scalar (traced: one compile for all widths)."""
    a_data, sa = _operand(a, kp)  # [M, Kp] e4m3, [M, Kp // 128] f32
    b_data, sb = _operand(b, kp)
    m, n, steps = a_data.shape[0], b_data.shape[0], kp // mma_k
    a_steps = a_data.astype(jnp.float64).reshape(m, steps, mma_k).transpose(1, 0, 2)  # [S, M, k]
    b_steps = b_data.astype(jnp.float64).reshape(n, steps, mma_k).transpose(1, 0, 2)  # [S, N, k]

    def step(carry, xs):
        acc, p = carry  # [M, N] f32, [M, N] f64
        a_s, b_s, sa_s, sb_s, prom = xs
        p = _mma_step(p, a_s, b_s, kept_bits, rounding, alignment)
        # Promotion: the partial (exact in f32, kept_bits <= 24) times the interval's scales.
        promoted = acc + p.astype(jnp.float32) * (sa_s[:, None] * sb_s[None, :])
        acc = jnp.where(prom, promoted, acc)
        p = jnp.where(prom, jnp.zeros_like(p), p)
        return (acc, p), None

    init = (jnp.zeros((m, n), jnp.float32), jnp.zeros((m, n), jnp.float64))
    xs = (a_steps, b_steps, _piece_scales(sa, kp, mma_k), _piece_scales(sb, kp, mma_k), promote)
    (acc, _), _ = jax.lax.scan(step, init, xs)
    return acc


@functools.partial(jax.jit, static_argnames=("kp", "interval"))
def _simulate_fp32(a, b, *, kp, interval):
    """The FP32 path: per promotion interval, an f32 `dot` of the FP8 chunk, then its scales, in
    order: `scaled_matmul_reference` when interval = 128."""
    a_data, sa = _operand(a, kp)
    b_data, sb = _operand(b, kp)
    m, n, chunks = a_data.shape[0], b_data.shape[0], kp // interval
    a_c = a_data.reshape(m, chunks, interval).transpose(1, 0, 2)  # [I, M, N_C]
    b_c = b_data.reshape(n, chunks, interval).transpose(1, 0, 2)  # [I, N, N_C]

    def promote(acc, xs):
        a_i, b_i, sa_i, sb_i = xs
        partial = jax.lax.dot_general(
            a_i, b_i, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return acc + partial * (sa_i[:, None] * sb_i[None, :]), None

    xs = (a_c, b_c, _piece_scales(sa, kp, interval), _piece_scales(sb, kp, interval))
    acc, _ = jax.lax.scan(promote, jnp.zeros((m, n), jnp.float32), xs)
    return acc


def simulated_scaled_matmul(
    a: Fp8Tensor, b: Fp8Tensor, model: AccumulatorModel = AccumulatorModel(), out_dtype=jnp.float32
) -> jax.Array:
    """`a @ b.T` accumulated the way `model` says the tensor core does (see the module docstring).

    Args:
      a: (M, K) `Fp8Tensor`: tile-scaled `(1, 128)`, `(bm, 128)` blocks, or per tensor.
      b: (N, K) `Fp8Tensor`: `(128, 128)` blocks, `(1, 128)` tiles, or per tensor. Operands scaled
        per 128 K-elements need a promotion interval dividing 128 (the scales are applied at
        promotion); for N_C > 128 or None quantize them per tensor.
      model: the accumulator; `AccumulatorModel.fp32()` reproduces `scaled_matmul_reference`.
      out_dtype: bfloat16 or float32.

    Returns:
      (M, N) in `out_dtype`. K is zero-padded up to whole MMA steps, 128-chunks and promotion
      intervals (zeros change nothing in the accumulator).
    """
    check_nt_operands(a, b, out_dtype)
    _check_scales_fit(a, "a", model)
    _check_scales_fit(b, "b", model)
    nc = model.promotion_interval
    unit = math.lcm(TILE, model.mma_k, nc or 1)
    kp = max(-(-a.logical[1] // unit) * unit, unit)
    nc = nc or kp  # None: one interval; the scales are constant along K (checked above)
    if model.kept_bits is None:
        return _simulate_fp32(a, b, kp=kp, interval=nc).astype(out_dtype)
    promote = (np.arange(kp // model.mma_k) + 1) % (nc // model.mma_k) == 0  # [S]
    with jax.enable_x64(True):
        out = _simulate_limited(
            a,
            b,
            jnp.asarray(promote),
            jnp.asarray(model.kept_bits, jnp.int64),
            kp=kp,
            mma_k=model.mma_k,
            rounding=model.rounding,
            alignment=model.alignment,
        )
        out = out.astype(jnp.float32)
    return out.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Measuring the accumulator against the float64 oracle (experiments/accumulation_precision.py and
# notebooks/02_accumulation_precision.ipynb share this).

Distribution = Literal["normal", "positive"]
#: Per-element relative errors divide by max(|exact|, REL_FLOOR * rms(exact)), so that outputs
#: near zero (cancellation) do not turn a tiny absolute error into an unbounded relative one.
REL_FLOOR = 0.1


#: `quantize` compiled as one program (much faster to compile at many shapes than op by op).
_quantize = jax.jit(quantize, static_argnums=1)


def accumulation_inputs(
    m: int, n: int, k: int, distribution: Distribution, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """x (m, k) and w (n, k), float32: i.i.d. N(0, 1) ("normal") or |N(0, 1)| ("positive").

    With signed inputs the partial sums grow like sqrt(K) and the truncation errors partly cancel;
    all-positive inputs make every partial sum grow like K and every truncation err the same way,
    the worst case for a truncating accumulator.
    """
    if distribution not in ("normal", "positive"):
        raise ValueError(f"distribution must be 'normal' or 'positive', got {distribution!r}")
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if distribution == "positive":
        x, w = np.abs(x), np.abs(w)
    return x, w


def relative_errors(y: np.ndarray, exact: np.ndarray, floor: float = REL_FLOOR) -> dict[str, float]:
    """Error of y against exact (float64): per element `|y - exact| / max(|exact|, floor * rms)`
    as max_rel and mean_rel, its signed mean (bias: truncation shrinks sums toward zero), and the
    normwise fro_rel = ||y - exact||_F / ||exact||_F."""
    y, exact = np.asarray(y, np.float64), np.asarray(exact, np.float64)
    denom = np.maximum(np.abs(exact), floor * np.sqrt(np.mean(exact**2)))
    rel = (y - exact) / denom
    return {
        "max_rel": float(np.max(np.abs(rel))),
        "mean_rel": float(np.mean(np.abs(rel))),
        "bias": float(np.mean(rel * np.sign(exact))),  # < 0: pulled toward zero
        "fro_rel": float(np.linalg.norm(y - exact) / np.linalg.norm(exact)),
    }


@dataclasses.dataclass(frozen=True)
class SweepRow:
    distribution: str
    k: int
    promotion_interval: int | None
    kept_bits: int | None
    rounding: str
    alignment: str
    max_rel: float
    mean_rel: float
    bias: float
    fro_rel: float


def accumulation_sweep(
    ks=(256, 1024, 4096),
    models=(AccumulatorModel.hopper(), AccumulatorModel.deepseek(), AccumulatorModel.fp32()),
    distributions=("normal", "positive"),
    *,
    m: int = 64,
    n: int = 64,
    floor: float = REL_FLOOR,
    seed: int = 0,
) -> list[SweepRow]:
    """Error of `simulated_scaled_matmul` against `scaled_matmul_oracle` for every (distribution,
    K, model), on the same per-tensor-scaled operands for all models of one (distribution, K), so
    that only the accumulation differs (per-tensor scaling is what allows N_C > 128 or None)."""
    rng = np.random.default_rng(seed)
    rows = []
    for dist in distributions:
        for k in ks:
            x, w = accumulation_inputs(m, n, k, dist, rng)
            a, b = _quantize(jnp.asarray(x), None), _quantize(jnp.asarray(w), None)
            exact = scaled_matmul_oracle(a, b)
            for model in models:
                y = np.asarray(simulated_scaled_matmul(a, b, model, jnp.float32))
                rows.append(
                    SweepRow(
                        distribution=dist,
                        k=k,
                        promotion_interval=model.promotion_interval,
                        kept_bits=model.kept_bits,
                        rounding=model.rounding,
                        alignment=model.alignment,
                        **relative_errors(y, exact, floor),
                    )
                )
    return rows


# ---------------------------------------------------------------------------------------------
# How far a Hopper kernel may be from the reference. The interpreter's wgmma is an exact matmul,
# so there the kernels equal `scaled_matmul_reference` bit for bit; the tensor core sums each
# 128-chunk in its limited accumulator, so on hardware they cannot. The bound below is what the
# simulator predicts for that accumulator, read pessimistically, times a margin: it is used by the
# `gpu`-marked tests and the GPU session's smoke stage. tests/test_hardware_bound.py checks that
# real bugs (a wrong or stale scale, a stale or dropped chunk, a transposed tile) land far outside.

#: The hardware read pessimistically: one kept bit fewer than the report's ~14, and every product
#: aligned to its MMA step's largest exponent (more truncation than aligning the step's sum).
HARDWARE_WORST_CASE = AccumulatorModel(kept_bits=HOPPER_KEPT_BITS - 1, alignment="product")
#: Margin over the simulated worst case, for what the model leaves out (the adder tree's order,
#: guard bits, the input distribution of one draw).
HARDWARE_MARGIN = 4.0
#: The bound never goes below f32 summation-order noise.
F32_ORDER_FLOOR = 1e-6


def _squared_errors(pairs) -> tuple[float, float]:
    """(sum ||sim - exact||^2, sum ||exact||^2) over (a, b) problems, `sim` under
    HARDWARE_WORST_CASE and `exact` the float64 oracle."""
    num = den = 0.0
    for a, b, model in pairs:
        exact = scaled_matmul_oracle(a, b)
        sim = np.asarray(simulated_scaled_matmul(a, b, model), np.float64)
        num += float(np.sum((sim - exact) ** 2))
        den += float(np.sum(exact**2))
    return num, den


def _bound(num: float, den: float, margin: float) -> float:
    rel = math.sqrt(num / den) if den > 0 else 0.0
    return margin * max(rel, F32_ORDER_FLOOR)


def hardware_error_bound(
    a: Fp8Tensor, b: Fp8Tensor, *, model: AccumulatorModel = HARDWARE_WORST_CASE,
    margin: float = HARDWARE_MARGIN,
) -> float:
    """The largest `rel_error(kernel(a, b), scaled_matmul_reference(a, b))` a correct
    Hopper kernel may show: `margin` x the simulated error of `model` against the f64 oracle on
    these very operands (never below F32_ORDER_FLOOR). A bug-free kernel that lands above it means
    the accumulator is worse than the model; the smoke stage and the GPU tests say so.

    a (M, K) and b (N, K) as for `scaled_matmul_reference`. Runs the simulator (float64, exact on
    any device); about a second at 256 x 256 x 512 on a CPU core.
    """
    return _bound(*_squared_errors([(a, b, model)]), margin)


def _rows(t: Fp8Tensor, start: int, stop: int) -> Fp8Tensor:
    """Rows [start, stop) of a row-scaled (1, 128) or per-tensor operand."""
    if t.block not in (None, (1, TILE)):
        raise ValueError(f"row slicing needs a (1, {TILE})-tiled or per-tensor operand, got {t.block}")
    scale = t.scale if t.block is None else t.scale[..., start:stop, :]
    return Fp8Tensor(t.data[..., start:stop, :], scale, t.block, (stop - start, t.logical[1]))


def grouped_hardware_error_bound(
    lhs: Fp8Tensor, rhs: Fp8Tensor, group_sizes, *, model: AccumulatorModel = HARDWARE_WORST_CASE,
    margin: float = HARDWARE_MARGIN,
) -> float:
    """`hardware_error_bound` for `grouped_scaled_matmul_reference(lhs, rhs, group_sizes)`: each
    group's rows against its weight, the errors pooled over the whole (T, N) output."""
    ends = np.cumsum(np.asarray(group_sizes, np.int64))
    pairs, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            w = Fp8Tensor(rhs.data[g], rhs.scale[g], rhs.block, rhs.logical)
            pairs.append((_rows(lhs, start, int(end)), w, model))
        start = int(end)
    return _bound(*_squared_errors(pairs), margin)


def grouped_wgrad_hardware_error_bound(
    lhs_t: Fp8Tensor, rhs_t: Fp8Tensor, group_sizes, *,
    model: AccumulatorModel = HARDWARE_WORST_CASE, margin: float = HARDWARE_MARGIN,
) -> float:
    """`hardware_error_bound` for `grouped_wgrad_reference(lhs_t, rhs_t, group_sizes)`: group g is
    the dense problem over the whole token axis with the other groups' tokens zeroed (the
    reference's `in_g` mask; the 128-token chunks and their scales stay where they are)."""
    ends = np.cumsum(np.asarray(group_sizes, np.int64))
    tokens = np.arange(lhs_t.data.shape[-1])
    pairs, start = [], 0
    for end in ends:
        if end > start:
            keep = jnp.asarray((tokens >= start) & (tokens < end))
            masked = [Fp8Tensor(jnp.where(keep, t.data, jnp.zeros((), t.data.dtype)), t.scale,
                                t.block, t.logical) for t in (lhs_t, rhs_t)]
            pairs.append((*masked, model))
        start = int(end)
    return _bound(*_squared_errors(pairs), margin)

"""The tensor-core accumulation simulator: its FP32 baseline is the reference GEMM, its
limited-precision path equals a scalar re-implementation of the model, and its errors behave as
DeepSeek-V3 §3.3 says (grow with K without promotion, bounded with N_C = 128)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8 import TILE, dequantize_f64, quantize, scaled_matmul_oracle, scaled_matmul_reference
from jfp8.accumulation import (
    AccumulatorModel,
    accumulation_inputs,
    relative_errors,
    simulated_scaled_matmul,
)
from helpers import fresh_rng as _rng


# Compiled as one program each: far quicker to compile at a new shape than op by op.
_quantize = jax.jit(quantize, static_argnums=1)
_reference = jax.jit(scaled_matmul_reference, static_argnums=2)


def _scalar_model(a: np.ndarray, b: np.ndarray, sa, sb, model: AccumulatorModel) -> float:
    """One output element of the model with Python floats (exact here) and math.frexp/ldexp.

    a, b: [K] E4M3 values without scales; sa(j), sb(j): the scales of K-element j.
    """
    kept, mk = model.kept_bits, model.mma_k
    cut_ = math.trunc if model.rounding == "truncate" else round  # round(): half to even

    def exponent(x):
        return math.frexp(x)[1] - 1 if x else -(10**6)

    def cut(x, qe):
        return math.ldexp(cut_(math.ldexp(x, -qe)), qe)

    k = len(a)
    nc = model.promotion_interval or k
    acc, p = np.float32(0), 0.0
    for start in range(0, k, mk):
        prods = [float(a[j]) * float(b[j]) for j in range(start, min(start + mk, k))]
        if model.alignment == "group":
            g = math.fsum(prods)
            qe = max(exponent(p), exponent(g)) - kept + 1
            s = cut(p, qe) + cut(g, qe)
        else:
            qe = max([exponent(p)] + [exponent(x) for x in prods]) - kept + 1
            s = cut(p, qe) + math.fsum(cut(x, qe) for x in prods)
        p = cut(s, exponent(s) - kept + 1)
        end = start + mk
        if end % nc == 0 or end >= k:
            acc = np.float32(acc + np.float32(p) * (np.float32(sa(start)) * np.float32(sb(start))))
            p = 0.0
    return float(acc)


@pytest.mark.parametrize(
    "a_block,b_block,nc,rounding,alignment",
    [
        ((1, TILE), (TILE, TILE), 128, "truncate", "group"),
        ((1, TILE), (1, TILE), 64, "nearest", "group"),
        (None, None, None, "truncate", "product"),
        (None, None, 256, "truncate", "group"),
        (None, (TILE, TILE), 128, "nearest", "product"),
    ],
    ids=["tile-block-128-trunc", "tile-tile-64-nearest", "tensor-none-product", "tensor-256-trunc",
         "tensor-block-128-nearest-product"],
)
def test_limited_path_equals_scalar_model(a_block, b_block, nc, rounding, alignment):
    rng, seed = _rng()
    m, n, k = 3, 2, 300  # K not a multiple of 32, 128 or N_C: the tails are zero-padded
    x = rng.standard_normal((m, k)).astype(np.float32) * 10
    w = np.abs(rng.standard_normal((n, k))).astype(np.float32)
    qa, qb = _quantize(jnp.asarray(x), a_block), _quantize(jnp.asarray(w), b_block)
    model = AccumulatorModel(kept_bits=10, promotion_interval=nc, rounding=rounding, alignment=alignment)
    out = np.asarray(simulated_scaled_matmul(qa, qb, model))
    ad = np.asarray(qa.data[:m, :k].astype(jnp.float32), np.float64)
    bd = np.asarray(qb.data[:n, :k].astype(jnp.float32), np.float64)
    sa_full = np.asarray(qa.expanded_scale(), np.float64)
    sb_full = np.asarray(qb.expanded_scale(), np.float64)
    want = np.array([
        [_scalar_model(ad[i], bd[j], lambda c, i=i: sa_full[i, c], lambda c, j=j: sb_full[j, c], model)
         for j in range(n)]
        for i in range(m)
    ])
    # Equal up to the last f32 rounding of the promotion (XLA may fuse acc + p * s into an FMA);
    # a model difference would show at the 2**-10 level of kept_bits=10.
    np.testing.assert_allclose(out, want, rtol=2e-7, atol=2e-7 * np.abs(want).max(), err_msg=f"seed {seed}")


@pytest.mark.parametrize(
    "a_block,b_block,m,n,k",
    [((1, TILE), (TILE, TILE), 33, 70, 1000), ((1, TILE), (1, TILE), 64, 64, 512), (None, None, 17, 5, 384)],
)
def test_fp32_model_equals_reference(a_block, b_block, m, n, k):
    rng, seed = _rng()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qa, qb = _quantize(jnp.asarray(x), a_block), _quantize(jnp.asarray(w), b_block)
    ref = np.asarray(_reference(qa, qb, jnp.float32), np.float64)
    out = np.asarray(simulated_scaled_matmul(qa, qb, AccumulatorModel.fp32()), np.float64)
    assert out.shape == (m, n)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max(), err_msg=f"seed {seed}")
    bf16 = simulated_scaled_matmul(qa, qb, AccumulatorModel.fp32(), jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16


def test_error_grows_with_k_without_promotion_and_is_bounded_with_it():
    rng, seed = _rng()
    none, nc128 = AccumulatorModel.hopper(), AccumulatorModel.deepseek()
    errs = {}
    for k in (512, 4096, 16384):  # per-tensor operands: one compile per K serves both models
        x, w = accumulation_inputs(16, 16, k, "positive", rng)  # no cancellation to hide the error
        ta, tb = _quantize(jnp.asarray(x), None), _quantize(jnp.asarray(w), None)
        exact = scaled_matmul_oracle(ta, tb)
        errs[k] = tuple(
            relative_errors(simulated_scaled_matmul(ta, tb, model), exact)["max_rel"]
            for model in (none, nc128)
        )
    # DeepSeek-V3's operands (1x128 tiles x 128x128 blocks) at the largest K.
    qa, qb = _quantize(jnp.asarray(x), (1, TILE)), _quantize(jnp.asarray(w), (TILE, TILE))
    deepseek = relative_errors(simulated_scaled_matmul(qa, qb, nc128), scaled_matmul_oracle(qa, qb))
    deepseek = deepseek["max_rel"]
    msg = f"seed {seed}: {errs}, tile x block {deepseek}"
    assert errs[512][0] < errs[4096][0] < errs[16384][0], msg
    assert errs[16384][0] > 10 * errs[512][0], msg  # ~linear in K for a biased (truncating) sum
    # With promotion each 128-chunk partial loses < 4 steps x 2**-(14-1) relatively, whatever K.
    bound = (TILE // 32) * 2.0**-13
    assert all(e < bound for _, e in errs.values()) and deepseek < bound, msg
    assert errs[16384][1] < errs[16384][0] / 20, msg


def test_truncation_is_worse_than_round_to_nearest_on_average():
    rng, seed = _rng()
    x, w = accumulation_inputs(32, 32, 4096, "normal", rng)
    ta, tb = _quantize(jnp.asarray(x), None), _quantize(jnp.asarray(w), None)
    exact = scaled_matmul_oracle(ta, tb)

    def err(**model):
        y = simulated_scaled_matmul(ta, tb, AccumulatorModel(promotion_interval=None, **model))
        return relative_errors(y, exact)

    trunc, near = err(kept_bits=14), err(kept_bits=14, rounding="nearest")
    assert trunc["mean_rel"] >= near["mean_rel"], f"seed {seed}: {trunc} vs {near}"
    # More kept bits, less error; per-product alignment loses more than aligning the group sum.
    more, prod = err(kept_bits=18), err(kept_bits=14, alignment="product")
    assert more["mean_rel"] < trunc["mean_rel"] < prod["mean_rel"], f"seed {seed}"


def test_same_result_under_an_outer_jit():
    rng, seed = _rng()
    x, w = accumulation_inputs(8, 8, 512, "normal", rng)
    ta, tb = _quantize(jnp.asarray(x), None), _quantize(jnp.asarray(w), None)
    model = AccumulatorModel.hopper()
    jitted = jax.jit(lambda a, b: simulated_scaled_matmul(a, b, model))(ta, tb)
    eager = simulated_scaled_matmul(ta, tb, model)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager), f"seed {seed}")


def test_oracle_inputs_are_exact_products():
    """The simulator's premise: products and sums of E4M3 values are exact in float64."""
    rng, _ = _rng()
    qa = quantize(jnp.asarray(rng.standard_normal((4, 16384)), jnp.float32) * 400, None)
    d = dequantize_f64(qa) / float(qa.scale[0, 0])  # raw E4M3 values
    assert np.all(d * 2.0**9 == np.round(d * 2.0**9))  # multiples of the smallest subnormal


def test_invalid_configurations_raise():
    x = jnp.ones((4, 256), jnp.float32)
    tile, tensor = _quantize(x, (1, TILE)), _quantize(x, None)
    for nc in (None, 256, 96):  # 96: a multiple of the MMA step, but not a divisor of the tile
        with pytest.raises(ValueError, match="per tensor"):
            simulated_scaled_matmul(tile, tensor, AccumulatorModel(promotion_interval=nc))
    simulated_scaled_matmul(tensor, tensor, AccumulatorModel(promotion_interval=None))  # fine
    with pytest.raises(ValueError, match="kept_bits"):
        AccumulatorModel(kept_bits=30)
    with pytest.raises(ValueError, match="multiple of mma_k"):
        AccumulatorModel(promotion_interval=48)
    with pytest.raises(ValueError, match="rounding"):
        AccumulatorModel(rounding="stochastic")
    assert AccumulatorModel(kept_bits="fp32").kept_bits is None

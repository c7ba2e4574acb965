"""jfp8.quantize: round-trip bounds, scales, zero/huge/NaN blocks, tails, batch axes, bad input."""

import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jfp8
from jfp8 import E4M3_MAX, TILE, Fp8Tensor, quantize
from helpers import fresh_rng as _rng
from helpers import load_experiment
from pallas_kernels import fp8_math

BLOCKS = [(1, TILE), (TILE, 1), (TILE, TILE), None, (4, 32)]
# E4M3 keeps 3 mantissa bits: round-to-nearest error is at most 2^-4 relative in the normal range,
# and half the smallest subnormal step (2^-9 / 2) times the scale below it.
REL_HALF_ULP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10

# Jitted for the 50 round-trip cases: eagerly, each primitive compiles on its own at every new
# shape, a few times slower than one program per case. Eager and jitted numerics are compared by
# TestQuantizeVariants below.
_quantize = jax.jit(quantize, static_argnums=1)


def _check_roundtrip_bound(x: np.ndarray, t: Fp8Tensor, seed: int) -> None:
    deq = np.asarray(t.dequantize(jnp.float32), np.float64)
    scale = np.asarray(t.expanded_scale(), np.float64)[..., : x.shape[-2], : x.shape[-1]]
    xf = x.astype(np.float64)
    bound = np.maximum(np.abs(xf) * REL_HALF_ULP, scale * SUBNORMAL_HALF_STEP) * (1 + 1e-6)
    err = np.abs(deq - xf)
    assert np.all(err <= bound), (
        f"seed {seed}: worst excess {np.max(err - bound)} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 300), (128, 256), (2, 3, 70, 129)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_roundtrip_within_e4m3_bound(shape, block, dtype):
    rng, seed = _rng()
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # what quantize sees
    t = _quantize(jnp.asarray(x, dtype), block)
    chex.assert_type(t.data, jnp.float8_e4m3fn)
    chex.assert_type(t.scale, jnp.float32)
    assert t.shape == shape and t.logical == shape[-2:]
    _check_roundtrip_bound(x, t, seed)


class TestQuantizeVariants(chex.TestCase):
    """Same numerics with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_scales_and_padding(self):
        rng, seed = _rng()
        x = rng.standard_normal((130, 300)).astype(np.float32)
        q = self.variant(lambda v: quantize(v, (1, TILE)))(jnp.asarray(x))
        chex.assert_shape(q.data, (130, 384))  # K padded with zeros to whole tiles
        chex.assert_shape(q.scale, (130, 3))
        np.testing.assert_array_equal(np.asarray(q.data[:, 300:], np.float32), 0.0)
        # scale = amax * f32(1/448) per 128-wide row tile (amax >= the 1e-4 floor here)
        xp = np.pad(x, ((0, 0), (0, 84))).reshape(130, 3, TILE)
        expect = np.abs(xp).max(-1) * np.float32(1 / np.float32(E4M3_MAX))
        np.testing.assert_array_equal(np.asarray(q.scale), expect, err_msg=f"seed {seed}")

    @chex.variants(with_jit=True, without_jit=True)
    def test_pow2_scales_are_powers_of_two_and_round_up(self):
        rng, seed = _rng()
        x = jnp.asarray(rng.standard_normal((64, 512)) * 10.0 ** rng.uniform(-3, 3, (64, 1)), jnp.float32)
        exact = quantize(x, (1, TILE))
        p2 = self.variant(lambda v: quantize(v, (1, TILE), pow2_scale=True))(x)
        s, se = np.asarray(p2.scale, np.float64), np.asarray(exact.scale, np.float64)
        mant, _ = np.frexp(s)
        np.testing.assert_array_equal(mant, 0.5, err_msg=f"seed {seed}: not powers of two")
        assert np.all(s >= se) and np.all(s < 2 * se), f"seed {seed}: not the next power of two"
        # with a power-of-two scale nothing can exceed the E4M3 range, and the round trip is bounded
        _check_roundtrip_bound(np.asarray(x), p2, seed)

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_blocks_get_finite_scales(self):
        x = jnp.zeros((256, 256), jnp.float32).at[:128, :128].set(1.0)
        for block in BLOCKS:
            q = self.variant(lambda v, b=block: quantize(v, b))(x)
            assert np.all(np.isfinite(np.asarray(q.scale))) and np.all(np.asarray(q.scale) > 0)
            np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(x))

    @chex.variants(with_jit=True, without_jit=True)
    def test_huge_values_saturate_not_nan(self):
        rng, _ = _rng()
        x = rng.standard_normal((4, 256)).astype(np.float32)
        x[0, 3] = 3e38  # the amax; without the clip, rounding would push x/scale past 448 -> NaN
        x[1, :] *= 1e30
        q = self.variant(lambda v: quantize(v, (1, TILE)))(jnp.asarray(x))
        deq = np.asarray(q.dequantize())
        assert np.all(np.isfinite(deq))
        np.testing.assert_allclose(deq[0, 3], 3e38, rtol=2**-4)
        assert np.max(np.abs(np.asarray(q.data, np.float32))) <= E4M3_MAX

    @chex.variants(with_jit=True, without_jit=True)
    def test_nan_and_inf_poison_their_block_only(self):
        x = np.ones((256, 384), np.float32)
        x[5, 130] = np.nan  # tile (5, 1); block (0, 1)
        x[200, 300] = np.inf  # tile (200, 2); block (1, 2)
        x[7, 10] = -np.inf  # tile (7, 0); block (0, 0)
        for block, bad in [
            ((1, TILE), {(5, 1), (200, 2), (7, 0)}),
            ((TILE, TILE), {(0, 1), (1, 2), (0, 0)}),
        ]:
            q = self.variant(lambda v, b=block: quantize(v, b))(jnp.asarray(x))
            s = np.asarray(q.scale)
            nan_at = set(zip(*np.nonzero(np.isnan(s))))
            assert nan_at == bad, (block, nan_at)
            deq = np.asarray(q.dequantize())
            bm, bk = block
            for r, c in bad:
                assert np.all(np.isnan(deq[r * bm : (r + 1) * bm, c * bk : (c + 1) * bk]))
            assert np.isfinite(deq).sum() == deq.size - len(bad) * bm * bk
        q = self.variant(lambda v: quantize(v, None))(jnp.asarray(x))
        assert np.all(np.isnan(np.asarray(q.dequantize())))


@pytest.mark.parametrize("block", [(1, TILE), (TILE, TILE)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_multiplies_in_f32_and_rounds_once(dtype, block):
    """As DeepSeek-V3's FP8 -> BF16 `weight_dequant`: E4M3 widened to f32, times the f32 scale,
    one rounding to `dtype` (numpy oracle), eagerly and under jit."""
    rng, seed = _rng()
    m, k = 130, 300
    # rows over ten decades; data * scale stays inside f16's range (65504)
    x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-6, 4, (m, 1))
    q = quantize(jnp.asarray(x, jnp.float32), block)
    bm, bk = block
    scale = np.repeat(np.repeat(np.asarray(q.scale), bm, 0), bk, 1)[:m, :k]
    exact = np.asarray(q.data).astype(np.float32)[:m, :k] * scale  # one f32 rounding
    want = exact.astype(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16)
    for got in (q.dequantize(dtype), jax.jit(lambda t: t.dequantize(dtype))(q)):
        chex.assert_type(got, dtype)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), want.view(np.uint16), err_msg=f"seed {seed}"
        )
    if dtype == jnp.bfloat16:  # and within half a BF16 ulp (plus the f32 product's) of the f64 value
        exact64 = np.asarray(q.data).astype(np.float64)[:m, :k] * scale.astype(np.float64)
        err = np.abs(np.asarray(want, np.float64) - exact64)
        assert np.all(err <= np.abs(exact64) * (2.0**-8 + 2.0**-23)), f"seed {seed}"  # u = 2^-8


def test_batch_axes_are_independent():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((3, 2, 40, 200)), jnp.float32)
    for block in BLOCKS:
        # the batch and each of its matrices quantized in one program per block (eagerly, every
        # op of every quantization compiled apart: 19 s of this test's 20)
        q, parts = jax.jit(lambda x: (quantize(x, block), [[quantize(x[i, j], block) for j in range(2)]
                                                           for i in range(3)]))(x)
        for i in range(3):
            for j in range(2):
                qi = parts[i][j]
                np.testing.assert_array_equal(
                    np.asarray(q.data[i, j]).view(np.uint8), np.asarray(qi.data).view(np.uint8), err_msg=f"seed {seed}"
                )
                np.testing.assert_array_equal(np.asarray(q.scale[i, j]), np.asarray(qi.scale))


@pytest.mark.parametrize("bk", [TILE, 64])
def test_row_tiles_with_a_k_tail_equal_the_padded_quantization(bk):
    """1 x bk tiles over a K shorter than one tile (the logical columns quantized and the E4M3 bytes
    padded, issue 44): the same scales and bytes as quantizing x padded with zeros to bk columns
    (the path every longer K takes), NaN and ±Inf rows (whose padding encodes to NaN), all-zero
    tails, power-of-two scales, every dtype and batch axes included."""
    rng, seed = _rng()
    # Jitted, as a training step runs it (one program per shape instead of every op compiled
    # eagerly: 4x quicker), both scale rules in one program; the first trial also eagerly.
    tail = jax.jit(lambda x: [quantize(x, (1, bk), pow2_scale=pow2) for pow2 in (False, True)])
    padded = jax.jit(lambda x, kp: [quantize(jnp.pad(x, ((0, 0), (0, 0), (0, kp - x.shape[-1]))), (1, bk),
                                             pow2_scale=pow2) for pow2 in (False, True)], static_argnums=1)
    for trial in range(12):
        m, k = int(rng.integers(1, 40)), int(rng.integers(1, bk))
        dtype = [jnp.bfloat16, jnp.float32, jnp.float16][trial % 3]
        x = rng.standard_normal((2, m, k)) * np.exp(3 * rng.normal(size=(2, m, 1)))
        if trial % 2 == 0:
            x[0, 0, -1], x[1, -1, 0], x[0, -1, k // 2] = np.nan, np.inf, -np.inf
        if trial % 4 == 1:
            x[..., -min(k, 3):] = 0
        x = jnp.asarray(x, dtype)
        kp = -(-k // bk) * bk
        runs = [(tail(x), padded(x, kp))] + ([(
            [quantize(x, (1, bk), pow2_scale=pow2) for pow2 in (False, True)],
            [quantize(jnp.pad(x, ((0, 0), (0, 0), (0, kp - k))), (1, bk), pow2_scale=pow2) for pow2 in (False, True)],
        )] if trial == 0 else [])
        for tails, paddeds in runs:
            for got, want, pow2 in zip(tails, paddeds, (False, True)):
                assert got.logical == (m, k) and got.data.shape == want.data.shape, (seed, trial)
                np.testing.assert_array_equal(
                    np.asarray(got.data).view(np.uint8), np.asarray(want.data).view(np.uint8),
                    err_msg=f"seed {seed} trial {trial} {m}x{k} {dtype.__name__} pow2={pow2}")
                np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))


def test_a_fused_producer_keeps_its_rounding_before_the_quantizer():
    """Inside jit, x's producer must not fuse into the quantizer and lose its rounding to x's dtype
    to XLA's excess precision (a bf16 product, computed in f32 on the CPU, reaches the quantizer
    unrounded): the quantization of a K-tail activation under one jit equals the quantization of
    the materialized activation (without the tail path's barrier it does not)."""
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((512, 64)), jnp.bfloat16)
    scaled = lambda x: x * jnp.bfloat16(1.37)  # noqa: E731
    fused = jax.jit(lambda x: quantize(scaled(x), (1, TILE)))(x)
    apart = quantize(jax.jit(scaled)(x), (1, TILE))
    np.testing.assert_array_equal(np.asarray(fused.data).view(np.uint8), np.asarray(apart.data).view(np.uint8),
                                  err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(fused.scale), np.asarray(apart.scale), err_msg=f"seed {seed}")


def test_column_layout_transposes_exactly():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((300, 70)), jnp.float32)
    a, b = quantize(x, (TILE, 1)).mT, quantize(x.T, (1, TILE))
    assert a.block == b.block == (1, TILE) and a.logical == b.logical == (70, 300)
    np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_fp8tensor_is_a_pytree_that_jit_and_vmap_carry():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((4, 50, 260)), jnp.float32)
    q = jax.jit(lambda v: quantize(v, (1, TILE)))(x)
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 2
    q2 = jax.tree.unflatten(treedef, leaves)
    assert q2.block == (1, TILE) and q2.shape == (4, 50, 260)
    per_item = jax.vmap(lambda v: quantize(v, (1, TILE)))(x)
    np.testing.assert_array_equal(np.asarray(per_item.scale), np.asarray(q.scale))
    deq = jax.vmap(lambda t: t.dequantize())(q)
    chex.assert_shape(deq, (4, 50, 260))


def test_outliers_only_hurt_their_own_tiles():
    rng, seed = _rng()
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    # One outlier channel inside K tile 0, of a fixed size (a random one made the per-tensor amax,
    # hence the ratio below, vary from 8x to 20x): ordinary values fall below E4M3's subnormals.
    x[:, 5] = 1e6
    clean = np.s_[:, TILE:]
    deq = np.asarray(quantize(jnp.asarray(x), (1, TILE)).dequantize(), np.float64)
    err_tile = np.linalg.norm(deq[clean] - x[clean]) / np.linalg.norm(x[clean])
    deq_t = np.asarray(quantize(jnp.asarray(x), None).dequantize(), np.float64)
    err_tensor = np.linalg.norm(deq_t[clean] - x[clean]) / np.linalg.norm(x[clean])
    assert err_tile < 0.03, (seed, err_tile)  # the clean E4M3 error (~2.6 %)
    assert err_tensor > 10 * err_tile, (seed, err_tensor, err_tile)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (jnp.ones((4, 4), jnp.int32), TypeError, "floating-point"),
        (jnp.ones((4, 4), jnp.complex64), TypeError, "floating-point"),
        (jnp.ones((4,), jnp.float32), ValueError, "ndim >= 2"),
    ],
)
def test_bad_input_is_a_clear_error(bad, exc, match):
    with pytest.raises(exc, match=match):
        quantize(bad)


@pytest.mark.parametrize("block", [(0, 128), (128,), (1.0, 128), "tile"])
def test_bad_block_is_a_clear_error(block):
    with pytest.raises(ValueError, match="block must be"):
        quantize(jnp.ones((4, 4)), block)


def test_empty_input():
    q = quantize(jnp.zeros((0, 300)), (1, TILE))
    assert q.shape == (0, 300) and q.dequantize().shape == (0, 300)


def test_public_constants_come_from_finfo():
    assert jfp8.E4M3_MAX == float(jnp.finfo(jnp.float8_e4m3fn).max) == 448.0


# ------------------------------------------------------------------------------------------------
# The CPU's integer E4M3 cast (`fp8_math.e4m3_bits`, what `quantize` lowers to on the CPU) against
# XLA's own cast. All 2^32 f32 patterns: experiments/e4m3_cast_check.py.

def _native_e4m3_bits(q):
    return jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)


def _rounding_boundaries() -> np.ndarray:
    """Every finite E4M3 magnitude, every midpoint between neighbours (the ties) and the f32 values
    next to both, the overflow edge (464, 480) and the specials, with both signs."""
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mags = np.unique(np.abs(e4m3[np.isfinite(e4m3)]))
    mids = np.concatenate([(mags[1:] + mags[:-1]) / 2, np.float32([464.0, 480.0, 2**-10])])
    points = np.concatenate([mags, mids, 3 * mids])
    points = np.concatenate([points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(0))])
    specials = np.float32([np.inf, np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45, 5e-39])
    points = np.concatenate([points, specials]).astype(np.float32)
    nans = np.uint32([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA5A5A5]).view(np.float32)
    return np.concatenate([points, -points, nans, -nans])


def test_integer_e4m3_cast_equals_xlas_at_every_rounding_boundary():
    q = jnp.asarray(_rounding_boundaries())
    want = np.asarray(jax.jit(_native_e4m3_bits)(q))
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8_math.e4m3_bits)(q)), want)
    # What quantize calls: the integer cast when lowered for the CPU, XLA's elsewhere.
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8_math.cast_e4m3)(q)).view(np.uint8), want)


def test_integer_e4m3_cast_equals_xlas_on_every_f32_near_e4m3s_range():
    """Every positive f32 from 2^-11 (under half the smallest subnormal) up to 2^10 (past the
    overflow to NaN): 21 binades, 176 M bit patterns, in chunks."""
    size = 1 << 23  # one binade per call

    @jax.jit
    def mismatches(start):
        q = jax.lax.bitcast_convert_type(start + jnp.arange(size, dtype=jnp.uint32), jnp.float32)
        return jnp.sum(_native_e4m3_bits(q) != fp8_math.e4m3_bits(q))

    bad = {e: int(mismatches(jnp.uint32(e << 23))) for e in range(127 - 11, 127 + 10)}
    assert not any(bad.values()), {e - 127: n for e, n in bad.items() if n}


def test_quantize_lowers_to_the_integer_cast_on_the_cpu():
    """The CPU's quantizer really takes the integer cast (else its speed-up would silently go)."""
    text = jax.jit(quantize).lower(jnp.zeros((4, 128), jnp.float32)).as_text()
    assert "shift_right_logical" in text, text
    assert not re.search(r"stablehlo\.convert [^\n]*-> tensor<[^>]*f8E4M3FN>", text), text


def test_cast_e4m3_differentiates_as_the_cast_on_every_platform():
    q = jnp.asarray([0.3, -2.0, 100.0], jnp.float32)
    grad = jax.grad(lambda q: fp8_math.cast_e4m3(q).astype(jnp.float32).sum())(q)
    want = jax.grad(lambda q: q.astype(jnp.float8_e4m3fn).astype(jnp.float32).sum())(q)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want))
    assert np.all(np.asarray(want) == 1.0)


def test_cast_e4m3_lowers_to_xlas_cast_off_the_cpu():
    """The integer cast is the CPU's only: lowered for CUDA, `cast_e4m3` is one convert."""
    text = jax.jit(fp8_math.cast_e4m3).trace(jnp.zeros((4,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "f8E4M3FN" in text and "shift_right" not in text, text


def test_the_exhaustive_check_runs_and_reports_mismatches(capsys, monkeypatch):
    """experiments/e4m3_cast_check.py on two chunks: 0 mismatches, and a wrong cast is caught."""
    check = load_experiment("e4m3_cast_check")
    assert check.main(["--chunk-log2", "20", "--chunks", "2"]) == 0
    assert "0 mismatches" in capsys.readouterr().out
    # A cast that is wrong on one pattern of the chunk (f32 +0 -> E4M3 -0): the check must say so.
    monkeypatch.setattr(check, "e4m3_bits", lambda q: fp8_math.e4m3_bits(jnp.where(q == 0, -0.0, q)))
    assert check.main(["--chunk-log2", "20", "--chunks", "1"]) == 1
    assert "mismatches" in capsys.readouterr().out

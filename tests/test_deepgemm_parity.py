"""jfp8's quantizer against DeepGEMM's reference quantizers, bit for bit (scales and E4M3 bytes).

The oracle (`deepgemm_oracle`) is a numpy port of `per_token_cast_to_fp8`,
`per_channel_cast_to_fp8` and `per_block_cast_to_fp8` as PyTorch executes them on CUDA, with
PyTorch's own f32 -> E4M3 conversion; it shares no code with jfp8. Finite inputs only (for NaN
and Inf blocks jfp8 deliberately differs: see tests/test_quantize.py).
"""

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import deepgemm_oracle as dg
from helpers import fresh_rng
from jfp8 import E4M3_MAX, TILE, quantize
from pallas_kernels.fp8_math import AMAX_FLOOR, scale_from_amax

F32_MAX = float(np.finfo(np.float32).max)
# amax = E4M3_MAX * 2^k puts the scale on a power of two; k beyond this overflows f32.
POW2_RANGE = range(-40, 120)
ORACLES = {
    (1, TILE): dg.per_token_cast_to_fp8,
    (TILE, 1): dg.per_channel_cast_to_fp8,
    (TILE, TILE): dg.per_block_cast_to_fp8,
}


def _around(values, ulps: int = 3) -> np.ndarray:
    """Each positive f32 value and its `ulps` neighbours on either side."""
    bits = np.asarray(values, np.float32).view(np.int32)[:, None] + np.arange(-ulps, ulps + 1)
    out = bits.ravel().view(np.float32)
    return out[np.isfinite(out) & (out >= 0)]


def _edge_amaxes() -> np.ndarray:
    """Where a slip in the scale formula shows: the clamp, the scale's power-of-two boundaries,
    the subnormals below the clamp, the top of the f32 range."""
    centers = [AMAX_FLOOR, np.finfo(np.float32).smallest_subnormal, 1.0, F32_MAX, E4M3_MAX]
    centers += [E4M3_MAX * 2.0**k for k in POW2_RANGE]
    return np.concatenate([_around(np.asarray(centers, np.float32)), np.float32([0.0])])


def _wide_amaxes(rng, n: int) -> np.ndarray:
    """`n` f32 values uniform in bit pattern (so in exponent) from 1e-6 to the f32 max."""
    lo, hi = (np.float32(v).view(np.uint32) for v in (1e-6, F32_MAX))
    return rng.integers(lo, hi, n, dtype=np.uint32, endpoint=True).view(np.float32)


def test_oracle_cast_is_round_to_nearest_even():
    """The oracle's port of PyTorch's E4M3 conversion equals ml_dtypes' (round to nearest even)
    on every tie between E4M3 neighbours, one ulp either side, and random values up to 464 (past
    448 PyTorch does not saturate, and DeepGEMM never gets there)."""
    rng, seed = fresh_rng()
    e4m3 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # 0..448
    ties = np.float32(np.append((e4m3[:-1] + e4m3[1:]) / 2, E4M3_MAX + 16))  # 464: 448 or NaN
    v = np.concatenate([_around(ties, 1), rng.uniform(0, 464, 10**5).astype(np.float32)])
    v = np.concatenate([v, -v])
    want = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(dg.c10_e4m3fn_bits(v), want, err_msg=f"seed {seed}")


class TestScaleFromAmax(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(False, True)
    def test_matches_deepgemm(self, pow2_scale):
        rng, seed = fresh_rng()
        amax = np.concatenate([_edge_amaxes(), _wide_amaxes(rng, 1 << 18)])
        got = self.variant(lambda a: scale_from_amax(a, pow2_scale))(jnp.asarray(amax))
        want = dg.scale_from_amax(amax, pow2_scale)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), want.view(np.uint32), err_msg=f"seed {seed}"
        )

    def test_the_oracle_tells_the_division_forms_apart(self):
        """PyTorch's CPU (a true division by 448) and CUDA (times f32(1/448)) scales differ on
        about half of all amax values, so the test above decides between them."""
        rng, seed = fresh_rng()
        amax = _wide_amaxes(rng, 1 << 14)
        differ = np.mean(dg.scale_from_amax(amax, False, "cpu") != dg.scale_from_amax(amax, False))
        assert 0.4 < differ < 0.6, (seed, differ)


def _hard_matrix(rng, shape, dtype) -> np.ndarray:
    """f32 values (exactly representable in `dtype`) whose blocks span the f32 range: each row
    scaled by 10^U(-9, 37), elements spread over 2^-24..1 of it (E4M3 subnormals and zeros), and
    rows with the amax on a power-of-two scale boundary, below the clamp, all f32 subnormals,
    zero, or near the f32 max."""
    m, n = shape
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-24, 0, shape)
    x *= 10.0 ** rng.uniform(-9, 37, (m, 1)) / np.max(np.abs(x), axis=1, keepdims=True)
    zero, below_clamp, subnormal, pow2, huge = rng.choice(m, 5, replace=False)  # distinct rows
    x[zero, :] = 0.0
    x[below_clamp, :] *= AMAX_FLOOR * rng.uniform(0.01, 1) / np.max(np.abs(x[below_clamp]))
    x[subnormal, :] *= 1e-39 / np.max(np.abs(x[subnormal]))
    x[pow2, :] = x[pow2] / np.max(np.abs(x[pow2])) * E4M3_MAX * 2.0 ** rng.choice(POW2_RANGE[:-1])
    x[huge, rng.integers(n)] = -3e38
    return np.asarray(jnp.asarray(x.astype(np.float32), dtype).astype(jnp.float32))


class TestQuantizeMatchesDeepGEMM(chex.TestCase):
    # bf16 is what DeepGEMM quantizes; f32 input once (both are widened to f32 first).
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        *[(block, pow2_scale, jnp.bfloat16) for block in ORACLES for pow2_scale in (False, True)],
        ((1, TILE), False, jnp.float32),
    )
    def test_bit_for_bit(self, block, pow2_scale, dtype):
        rng, seed = fresh_rng()
        shape = (256, 300) if block == (TILE, 1) else (200, 300)  # DeepGEMM: per-channel M % 128 == 0
        x = _hard_matrix(rng, shape, dtype)
        q = self.variant(lambda v: quantize(v, block, pow2_scale=pow2_scale))(jnp.asarray(x, dtype))
        want_data, want_scale = ORACLES[block](x, pow2_scale)
        _assert_equal(q, want_data, want_scale, f"seed {seed}")


def _assert_equal(q, want_data, want_scale, msg: str) -> None:
    m, n = want_data.shape
    np.testing.assert_array_equal(
        np.asarray(q.scale).view(np.uint32), want_scale.view(np.uint32), err_msg=f"{msg}: scales"
    )
    np.testing.assert_array_equal(
        np.asarray(q.data)[:m, :n].view(np.uint8), want_data, err_msg=f"{msg}: E4M3 bytes"
    )


@pytest.mark.parametrize(
    "block,pow2_scale", [((1, TILE), False), ((TILE, 1), True), ((TILE, TILE), False)], ids=str
)
def test_kernels_match_deepgemm(block, pow2_scale):
    """The Mosaic GPU quantize kernels (interpreted) against the oracle directly."""
    rng, seed = fresh_rng()
    x = _hard_matrix(rng, (256, 384), jnp.bfloat16)
    xb = jnp.asarray(x, jnp.bfloat16)
    q = quantize(xb, block, pow2_scale=pow2_scale, impl="mosaic", interpret=True)
    _assert_equal(q, *ORACLES[block](x, pow2_scale), f"seed {seed}")

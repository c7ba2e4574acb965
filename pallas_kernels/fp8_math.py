"""The elementwise FP8 rules shared by `jfp8.quantize` and the Pallas quantization kernels.

Kept in `pallas_kernels` (JAX only) so that both the XLA reference and the kernels call the very
same functions: their results are bit-identical by construction, not by coincidence.
"""

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
# DeepGEMM clamps a block's amax from below so an all-zero block gets a finite, non-zero scale.
AMAX_FLOOR = 1e-4
# DeepSeek-V3's scaling tile and its promotion interval N_C: one FP32 scale per 128 contraction
# elements, and partial sums are promoted to FP32 every 128 K-elements.
TILE = 128
# Scales are computed as amax * (1 / 448) with this f32 constant rather than amax / 448: XLA
# rewrites division by a constant into this multiplication under jit but not eagerly, so writing
# the multiplication ourselves keeps jit, eager and kernels bit-identical.
INV_E4M3_MAX = float(1.0 / jnp.float32(E4M3_MAX))
F32_MAX = float(jnp.finfo(jnp.float32).max)


def scale_from_amax(amax: jax.Array, pow2_scale: bool) -> jax.Array:
    """The FP32 scale of a block from its amax (max |x|, +inf when the block holds a NaN or Inf).

    scale = max(amax, AMAX_FLOOR) * (1 / E4M3_MAX), optionally rounded up to a power of two (UE8M0), and
    NaN for a non-finite block so that the whole block dequantizes to NaN instead of to a silently
    wrong finite number. Shared by `quantize` and the Pallas quantization kernels.
    """
    scale = jnp.maximum(amax, jnp.float32(AMAX_FLOOR)) * jnp.float32(INV_E4M3_MAX)
    if pow2_scale:
        # Round a positive normal float up to a power of two with integer arithmetic, which is
        # exact everywhere (no log2/exp2): add all-ones to the mantissa, then clear it.
        bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
        bits = (bits + jnp.int32(0x007FFFFF)) & jnp.int32(-0x00800000)  # 0xFF800000
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(amax == jnp.inf, jnp.float32(jnp.nan), scale)


def reciprocal(scale: jax.Array) -> jax.Array:
    """1 / scale, computed once per block (NaN stays NaN)."""
    return jnp.float32(1) / scale


def encode_scaled(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """x * (1 / scale), clipped to ±E4M3_MAX and cast to E4M3 (XLA's cast does not saturate).

    Multiplying by the per-block reciprocal rather than dividing is deliberate: XLA rewrites
    `x / broadcast(scale)` into exactly this under jit, so writing it ourselves makes jit, eager
    and the kernels agree bit for bit (a true division can move the quotient by one ulp and flip
    an E4M3 rounding tie). `inv_scale` is broadcastable to `x`; NaN there gives NaN data.
    """
    q = jnp.clip(x.astype(jnp.float32) * inv_scale, -E4M3_MAX, E4M3_MAX)
    q = jnp.where(jnp.isnan(inv_scale), jnp.float32(jnp.nan), q)
    return q.astype(FP8_DTYPE)


def encode(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`encode_scaled(x, reciprocal(scale))`; `scale` is broadcastable to `x` and its reciprocal is
    taken before broadcasting (once per block)."""
    return encode_scaled(x, reciprocal(scale))


def abs_for_amax(x: jax.Array) -> jax.Array:
    """|x| in f32, with NaN and ±Inf mapped to +Inf so that any max-reduction flags them.

    Written as `|x| <= f32 max` (false exactly for ±Inf and NaN) because Mosaic GPU has no
    `is_finite` lowering: the kernels call this very function.
    """
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.where(a <= jnp.float32(F32_MAX), a, jnp.float32(jnp.inf))

"""The elementwise FP8 rules shared by `jfp8.quantize` and the Pallas quantization kernels.

Kept in `pallas_kernels` (JAX only) so that both the XLA reference and the kernels call the very
same functions: their results are bit-identical by construction, not by coincidence.

They are also DeepGEMM's reference quantizers bit for bit: each step is one correctly rounded f32
operation (the scale a product, its reciprocal an IEEE division, the encode a product) followed by
a round-to-nearest-even cast, with no sum that a compiler could contract into an FMA, so XLA, the
kernels and PyTorch on CUDA round identically. The kernels take the reciprocal through
`pallas_kernels._mgpu.ieee_reciprocal` (`rcp.rn.f32`): Mosaic GPU compiles a plain `/` to PTX's
approximate `div.full.f32`, `jnp.sqrt` to `sqrt.approx.f32`, and contracts `a * b + c` into one
`fma.rn.f32`, as XLA:CPU does (`benchmarks/hopper/float_rounding.py`; its record in
`benchmarks/results/hopper-build/float-rounding-h100_sxm.json`). tests/test_deepgemm_parity.py
checks the rules against a numpy port of DeepGEMM's code.
"""

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
# DeepGEMM clamps a block's amax from below so an all-zero block gets a finite, non-zero scale.
# jfp8 keeps that floor for activations and weights (bit for bit DeepGEMM's quantizers there).
AMAX_FLOOR = 1e-4
# The floor of activation gradients: the amax whose scale is the smallest normal f32, 448 * 2^-126
# (~5.3e-36). Gradients of a mean loss scale as 1/tokens and routinely lie under 1e-4, where
# DeepGEMM's floor would replace DeepSeek-V3's fine-grained online scaling by one fixed scale. No
# lower floor works: XLA (on the CPU, measured) flushes subnormal f32 results to zero, so a scale
# under 2^-126 would become 0 and its reciprocal inf. Under this floor a tile loses nothing that
# f32 holds as a normal number: every normal element still encodes to an E4M3 value >= 1.
GRAD_AMAX_FLOOR = float(E4M3_MAX * float(jnp.finfo(jnp.float32).tiny))
# DeepSeek-V3's scaling tile and its promotion interval N_C: one FP32 scale per 128 contraction
# elements, and partial sums are promoted to FP32 every 128 K-elements.
TILE = 128
# Scales are amax * f32(1 / 448), not amax / 448: bit for bit what DeepGEMM's reference quantizers
# (`per_token_cast_to_fp8`, `per_block_cast_to_fp8`) compute on the GPU, where PyTorch evaluates
# `amax / 448.0` as a product with the reciprocal rounded once on the host (its CUDA
# `div_true_kernel`: "a * reciprocal(b)"; on the CPU PyTorch divides, one ulp off on ~half of the
# amaxes). XLA:CPU does the same to `x / c` for any scalar c, under jit and eagerly, so writing
# the product keeps jit, eager and the kernels identical too. tests/test_deepgemm_parity.py.
# numpy, not jnp: importing jfp8 must not start jax's backend (jax.distributed.initialize must
# come first in a multi-process run).
INV_E4M3_MAX = float(np.float32(1) / np.float32(E4M3_MAX))
F32_MAX = float(jnp.finfo(jnp.float32).max)


def check_amax_floor(amax_floor: float) -> float:
    """`amax_floor` as a float, or a ValueError saying which floors are valid."""
    f = float(amax_floor)
    if not (GRAD_AMAX_FLOOR <= f <= F32_MAX):
        raise ValueError(
            f"amax_floor={amax_floor!r}: it must be finite and at least {GRAD_AMAX_FLOOR:.4g} "
            "(448 * 2^-126, the amax whose scale is the smallest normal f32: smaller scales flush to "
            f"zero). Use AMAX_FLOOR ({AMAX_FLOOR}) for activations and weights, GRAD_AMAX_FLOOR for gradients"
        )
    return f


def scale_from_amax(amax: jax.Array, pow2_scale: bool, amax_floor: float = AMAX_FLOOR) -> jax.Array:
    """The FP32 scale of a block from its amax (max |x|, +inf when the block holds a NaN or Inf).

    scale = max(amax, amax_floor) * f32(1 / E4M3_MAX), one correctly rounded f32 product, as
    DeepGEMM's `amax.clamp(1e-4) / 448.0` on CUDA for the default floor (activations, weights;
    gradients use `GRAD_AMAX_FLOOR`, which binds only where the scale would not be a normal f32);
    optionally rounded up to a power of two (UE8M0, DeepGEMM's `ceil_to_ue8m0`); NaN for a non-finite block so that the whole block dequantizes to
    NaN instead of to a silently wrong finite number (DeepGEMM gives an Inf block an Inf scale).
    Shared by `quantize` and the Pallas quantization kernels.
    """
    scale = jnp.maximum(amax, jnp.float32(amax_floor)) * jnp.float32(INV_E4M3_MAX)
    if pow2_scale:
        # Round a positive normal float up to a power of two with integer arithmetic, which is
        # exact everywhere (no log2/exp2): add all-ones to the mantissa, then clear it. Equal to
        # `ceil_to_ue8m0` (exponent + (mantissa != 0), clamped to [1, 254]) for every scale here:
        # 2^-126 <= scale <= f32 max / 448 < 2^120 is normal, so its clamp never acts.
        bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
        bits = (bits + jnp.int32(0x007FFFFF)) & jnp.int32(-0x00800000)  # 0xFF800000
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(amax == jnp.inf, jnp.float32(jnp.nan), scale)


def reciprocal(scale: jax.Array) -> jax.Array:
    """1 / scale, computed once per block (NaN stays NaN)."""
    return jnp.float32(1) / scale


def encode_scaled(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """x * (1 / scale), clipped to ±E4M3_MAX and cast to E4M3 (XLA's cast does not saturate).

    DeepGEMM's `(x * (1.0 / sf)).to(torch.float8_e4m3fn)`: one f32 product with the per-block
    reciprocal (PyTorch's `1.0 / sf` is `sf.reciprocal()`, an IEEE division), then round to nearest
    even. PyTorch's cast does not saturate either (480 and up become NaN), but the quotient never
    exceeds 448 by more than a few ulps and both round that to 448, so the clip changes nothing
    there. Multiplying rather than dividing also matches XLA, which rewrites `x / broadcast(scale)`
    into exactly this; jit, eager and the kernels agree bit for bit. `inv_scale` is broadcastable to
    `x`; NaN there gives NaN data.
    """
    return _scaled(x, inv_scale).astype(FP8_DTYPE)


def _scaled(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """`encode_scaled`'s f32 values before the cast: the product, clipped, NaN where the scale is."""
    q = jnp.clip(x.astype(jnp.float32) * inv_scale, -E4M3_MAX, E4M3_MAX)
    return jnp.where(jnp.isnan(inv_scale), jnp.float32(jnp.nan), q)


def encode(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`encode_scaled(x, reciprocal(scale))`, the XLA quantizer's: `scale` is broadcastable to `x`
    and its reciprocal is taken before broadcasting (once per block). The cast is `cast_e4m3`'s,
    the same bits as `encode_scaled`'s."""
    return cast_e4m3(_scaled(x, reciprocal(scale)))


@jax.custom_jvp
def cast_e4m3(q: jax.Array) -> jax.Array:
    """`q.astype(float8_e4m3fn)` for f32 `q`, the same bits for every f32, computed with integer
    arithmetic where the computation is lowered for the CPU. Differentiates as the cast does (the
    tangent cast along) on every platform, not as the integer arithmetic would (zero).

    XLA:CPU's f32 -> E4M3 cast rounds each element in slow generic code (through f16): on the
    2-core machine it takes 3.4x as long as `e4m3_bits` on a 2048 x 1024 array, and the FP8 `tiny`
    steps run about 10 % faster with `e4m3_bits` (issue 44). Other platforms keep the cast (one
    instruction on a GPU; the Pallas kernels call `encode_scaled`). The two agree on all 2^32 f32
    bit patterns (`experiments/e4m3_cast_check.py`; the tests check every rounding boundary).
    """
    return jax.lax.platform_dependent(
        q, cpu=lambda q: jax.lax.bitcast_convert_type(e4m3_bits(q), FP8_DTYPE),
        default=lambda q: q.astype(FP8_DTYPE))


@cast_e4m3.defjvp
def _cast_e4m3_jvp(primals, tangents):
    (q,), (dq,) = primals, tangents
    return cast_e4m3(q), dq.astype(FP8_DTYPE)


# f32 bit patterns of E4M3's smallest normal (2^-6), and of 2^14, whose f32 ulp is E4M3's
# subnormal step 2^-9.
_F32_2_POW_M6 = 0x3C800000
_F32_2_POW_14 = 0x46800000


def e4m3_bits(q: jax.Array) -> jax.Array:
    """The uint8 bits of f32 `q` cast to E4M3 (round to nearest even, NaN above 464 and for
    ±Inf and NaN, as XLA's cast), computed with integer and f32 arithmetic only.

    Normal results (|q| >= 2^-6): the f32 bits rounded to 3 mantissa bits at bit 20 (adding
    0x7FFFF plus the kept lowest bit rounds ties to even; a carry moves into the exponent), then
    rebiased from 127 to 7. Subnormal results: |q| + 2^14 in f32, whose ulp is 2^-9, rounds |q| to
    a multiple of 2^-9 by the FPU's round to nearest even, and its low bits count them (0..8; 8 is
    2^-6, E4M3's 0x08). Everything past 448's rounding range (464 and up, ±Inf, NaN) comes out
    above 0x7F and is clamped to 0x7F, E4M3's NaN; the sign is ORed back last (-0 -> 0x80).
    """
    # lax ops and operators only: jnp.where and jnp.signbit are jitted functions, each a call in
    # the HLO that XLA must inline, for every quantization of a step.
    bits = jax.lax.bitcast_convert_type(q.astype(jnp.float32), jnp.uint32)
    mag = bits & jnp.uint32(0x7FFFFFFF)
    # (mag + 0x7FFFF + lsb) >> 20, rebiased, with the rebias folded into the constant (exact: a
    # multiple of 2^20, mod 2^32; only mag >= 2^-6 keeps this value, and there nothing wraps).
    rounding = jnp.uint32((0x7FFFF - ((127 - 7) << 23)) % 2**32)
    normal = (mag + rounding + ((mag >> 20) & jnp.uint32(1))) >> 20
    shifted = jax.lax.bitcast_convert_type(mag, jnp.float32) + jnp.float32(2.0**14)  # |q| + 2^14
    subnormal = jax.lax.bitcast_convert_type(shifted, jnp.uint32) - jnp.uint32(_F32_2_POW_14)
    out = jax.lax.select(mag < jnp.uint32(_F32_2_POW_M6), subnormal, normal)
    out = jax.lax.min(out, jnp.full_like(out, 0x7F))
    return (out | ((bits >> 24) & jnp.uint32(0x80))).astype(jnp.uint8)


def abs_for_amax(x: jax.Array) -> jax.Array:
    """|x| in f32, with NaN and ±Inf mapped to +Inf so that any max-reduction flags them.

    Written as `|x| <= f32 max` (false exactly for ±Inf and NaN) because Mosaic GPU has no
    `is_finite` lowering: the kernels call this very function. The mapping must come before the
    max, per element: XLA:CPU's max reductions do not propagate NaN in every order (tried
    2026-11-27: |x| with a NaN-propagating amax fixed up once per block gave the reference and the
    interpreted `quantize_tile_and_retile_t` different finite column scales where a column held
    a NaN), while +Inf wins every max whatever the order.
    """
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.where(a <= jnp.float32(F32_MAX), a, jnp.float32(jnp.inf))

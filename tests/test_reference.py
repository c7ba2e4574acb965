"""The reference GEMMs against the float64 oracle and against the exact product of the inputs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8 import (
    FP8_DTYPE,
    TILE,
    dequantize_f64,
    grouped_scaled_matmul_reference,
    grouped_wgrad_reference,
    quantize,
    scaled_matmul_oracle,
    scaled_matmul_reference,
)
from helpers import fresh_rng as _rng

PAIRINGS = {
    "tile x block": ((1, TILE), (TILE, TILE)),  # Fprop, Dgrad
    "tile x tile": ((1, TILE), (1, TILE)),  # Wgrad (operands already transposed to NT)
    "tensor x tensor": (None, None),
    "block x block": ((TILE, TILE), (TILE, TILE)),
}
U = 2.0**-4  # E4M3 relative half-ulp

# Jitted: eagerly, every primitive of quantize and of the references compiles on its own at each
# new shape, a few times slower than one program. (Eager against jitted numerics: the variants
# in tests/test_quantize.py and TestReferenceVariants below.)
_quantize = jax.jit(quantize, static_argnums=1)
_reference = jax.jit(scaled_matmul_reference, static_argnums=2)
_grouped_reference = jax.jit(grouped_scaled_matmul_reference, static_argnums=3)
_grouped_wgrad_reference = jax.jit(grouped_wgrad_reference)


def _elementwise_quant_error_bound(x: np.ndarray, q) -> np.ndarray:
    """Per-element bound on |dequantize(q) - x|: half an ulp, or half the subnormal step."""
    scale = np.asarray(q.expanded_scale(), np.float64)[: x.shape[0], : x.shape[1]]
    return np.maximum(np.abs(x) * U, scale * 2.0**-10) * (1 + 1e-6)


def _gemm_quant_bound(x, w, qa, qb) -> np.ndarray:
    """|Q(x) Q(w)^T - x w^T| <= ex |w|^T + |x| ew^T + ex ew^T, elementwise (f64)."""
    ex, ew = _elementwise_quant_error_bound(x, qa), _elementwise_quant_error_bound(w, qb)
    ax, aw = np.abs(x), np.abs(w)
    return ex @ aw.T + ax @ ew.T + ex @ ew.T


@pytest.mark.parametrize("pairing", PAIRINGS, ids=str)
@pytest.mark.parametrize(
    "m,n,k", [(1, 1, 1), (65, 200, 128), (130, 70, 384), (64, 256, 1024), (33, 129, 4096), (17, 300, 700)]
)
def test_reference_matches_oracle_and_quantization_bound(pairing, m, n, k):
    rng, seed = _rng()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1)).astype(np.float32)
    a_block, b_block = PAIRINGS[pairing]
    qa, qb = _quantize(jnp.asarray(x), a_block), _quantize(jnp.asarray(w), b_block)
    out = np.asarray(_reference(qa, qb, jnp.float32), np.float64)
    chex.assert_shape(out, (m, n))
    oracle = scaled_matmul_oracle(qa, qb)
    # Same FP8 operands: only the f32 accumulation differs from the oracle.
    mag = np.abs(dequantize_f64(qa)) @ np.abs(dequantize_f64(qb)).T
    assert np.all(np.abs(out - oracle) <= 2e-6 * mag + 1e-30), f"seed {seed}"
    # Against the unquantized inputs: within the E4M3 quantization bound, element by element.
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = _gemm_quant_bound(x.astype(np.float64), w.astype(np.float64), qa, qb) + 2e-6 * mag
    assert np.all(np.abs(out - exact) <= bound), f"seed {seed}: {np.max(np.abs(out - exact) - bound)}"


class TestReferenceVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_bf16_output_is_the_rounded_f32_output(self):
        rng, seed = _rng()
        qa = quantize(jnp.asarray(rng.standard_normal((40, 512)), jnp.float32))
        qb = quantize(jnp.asarray(rng.standard_normal((72, 512)), jnp.float32), (TILE, TILE))
        f = self.variant(scaled_matmul_reference, static_argnums=2)
        f32 = f(qa, qb, jnp.float32)
        bf16 = f(qa, qb, jnp.bfloat16)
        chex.assert_type(bf16, jnp.bfloat16)
        chex.assert_trees_all_equal(bf16, f32.astype(jnp.bfloat16))
        rel = np.linalg.norm(np.asarray(f32) - scaled_matmul_oracle(qa, qb)) / np.linalg.norm(
            scaled_matmul_oracle(qa, qb)
        )
        assert rel < 1e-6, f"seed {seed}: {rel}"


def test_promotion_is_per_chunk_in_order():
    """The accumulation is sum_c (dot_c * s_a,c * s_b,c) in chunk order, not one long dot."""
    rng, seed = _rng()
    qa = quantize(jnp.asarray(rng.standard_normal((8, 512)), jnp.float32))
    qb = quantize(jnp.asarray(rng.standard_normal((16, 512)), jnp.float32), (TILE, TILE))
    a = np.asarray(qa.data, np.float32)
    b = np.asarray(qb.data, np.float32)[:16]  # the data is padded to whole 128-row blocks
    sa, sb = np.asarray(qa.scale), np.repeat(np.asarray(qb.scale), TILE, axis=0)[:16]
    acc = np.zeros((8, 16), np.float32)
    for c in range(4):
        part = (a[:, c * TILE : (c + 1) * TILE] @ b[:, c * TILE : (c + 1) * TILE].T).astype(np.float32)
        acc = acc + part * (sa[:, c, None] * sb[None, :, c])
    # The chunk dots themselves sum 128 products in f32 in an implementation-defined order, so
    # allow f32 rounding relative to the output's scale (a wrong promotion structure is off by
    # orders of magnitude more).
    np.testing.assert_allclose(
        np.asarray(scaled_matmul_reference(qa, qb, jnp.float32)), acc, rtol=1e-6,
        atol=1e-6 * np.abs(acc).max(), err_msg=f"seed {seed}",
    )


def test_column_scaled_operands_via_mT():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((300, 64)), jnp.float32)  # tokens x features
    dy = jnp.asarray(rng.standard_normal((300, 48)), jnp.float32)
    xt, dyt = quantize(x, (TILE, 1)).mT, quantize(dy, (TILE, 1)).mT
    dw = np.asarray(scaled_matmul_reference(xt, dyt, jnp.float32), np.float64)
    exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    assert np.linalg.norm(dw - exact) / np.linalg.norm(exact) < 0.06, f"seed {seed}"
    with pytest.raises(ValueError, match="mT"):
        scaled_matmul_reference(quantize(x, (TILE, 1)), quantize(dy, (TILE, 1)))


@pytest.mark.parametrize(
    "sizes", [[100, 0, 150, 20], [0, 0, 300, 0], [1, 2, 3, 4], [128, 128, 0, 44]], ids=str
)
def test_grouped_references_match_the_oracle(sizes):
    rng, seed = _rng()
    t, k, n = 300, 256, 200
    g = len(sizes)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _quantize(x, (1, TILE)), _quantize(w, (TILE, TILE))
    # gs is an argument of the jitted references: the four size lists share one compile
    out = np.asarray(_grouped_reference(lhs, rhs, gs, jnp.float32), np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    xd, wd = dequantize_f64(lhs), dequantize_f64(rhs)
    for gi in range(g):
        rows = slice(starts[gi], starts[gi + 1])
        ref = xd[rows] @ wd[gi].T
        np.testing.assert_allclose(out[rows], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(initial=1))
    assert np.all(out[starts[-1] :] == 0), "rows past the groups must be zero"

    dy = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    xt, dyt = _quantize(x, (TILE, 1)).mT, _quantize(dy, (TILE, 1)).mT
    dw = np.asarray(_grouped_wgrad_reference(xt, dyt, gs), np.float64)
    chex.assert_shape(dw, (g, k, n))
    xtd, dytd = dequantize_f64(xt), dequantize_f64(dyt)
    for gi in range(g):
        cols = slice(starts[gi], starts[gi + 1])
        ref = xtd[:, cols] @ dytd[:, cols].T
        np.testing.assert_allclose(dw[gi], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(initial=1), err_msg=f"seed {seed}")


def test_grouped_wgrad_skips_chunks_of_other_groups():
    """A NaN in another group's 128-token chunk must not leak into this group's gradient."""
    x = np.ones((256, 8), np.float32)
    x[200, 0] = np.nan  # chunk 1 belongs to group 1 only
    xt = quantize(jnp.asarray(x), (TILE, 1)).mT
    dyt = quantize(jnp.ones((256, 8), jnp.float32), (TILE, 1)).mT
    dw = np.asarray(grouped_wgrad_reference(xt, dyt, jnp.asarray([128, 128], jnp.int32)))
    assert np.all(np.isfinite(dw[0])) and np.all(np.isnan(dw[1][0]))
    np.testing.assert_allclose(dw[0], 128.0, rtol=1e-6)  # scales are amax * f32(1/448)


@pytest.mark.parametrize(
    "a_shape,b_shape,kwargs,exc,match",
    [
        ((4, 256), (8, 128), {}, ValueError, "contraction sizes differ"),
        ((4, 256), (8, 256), {"out_dtype": jnp.float16}, ValueError, "out_dtype"),
    ],
)
def test_bad_input_is_a_clear_error(a_shape, b_shape, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        scaled_matmul_reference(quantize(jnp.ones(a_shape)), quantize(jnp.ones(b_shape)), **kwargs)


def test_non_fp8_operand_is_a_clear_error():
    with pytest.raises(TypeError, match="Fp8Tensor"):
        scaled_matmul_reference(jnp.ones((4, 128)), quantize(jnp.ones((4, 128))))
    with pytest.raises(ValueError, match="vmap"):
        scaled_matmul_reference(quantize(jnp.ones((2, 4, 128))), quantize(jnp.ones((4, 128))))


def test_group_sizes_checks():
    lhs, rhs = quantize(jnp.ones((10, 128))), quantize(jnp.ones((2, 8, 128)), (TILE, TILE))
    with pytest.raises(ValueError, match="shape \\(2,\\)"):
        grouped_scaled_matmul_reference(lhs, rhs, jnp.asarray([5, 5, 0], jnp.int32))
    with pytest.raises(ValueError, match="more than the 10 rows"):
        grouped_scaled_matmul_reference(lhs, rhs, jnp.asarray([6, 5], jnp.int32))
    with pytest.raises(TypeError, match="integers"):
        grouped_scaled_matmul_reference(lhs, rhs, jnp.asarray([5.0, 5.0]))


def test_reference_under_vmap_for_batches():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((3, 20, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((30, 256)), jnp.float32)
    qb = quantize(w, (TILE, TILE))
    out = jax.vmap(lambda xi: scaled_matmul_reference(quantize(xi), qb, jnp.float32))(x)
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(out[i]), np.asarray(scaled_matmul_reference(quantize(x[i]), qb, jnp.float32))
        )


def test_fp8_data_moves_are_byte_moves():
    """`jfp8.fp8.move_bytes` (slices, zero pads, gathers, transposes of FP8 data, on their uint8
    views: XLA:CPU otherwise moves f8 through f16) moves every one of the 256 E4M3 bit patterns,
    NaNs and -0 included, exactly as numpy moves the bytes, jitted or not; pads are +0 (byte 0)."""
    from jfp8.fp8 import as_bytes, from_bytes, move_bytes
    from jfp8.reference import zero_past_k

    rng, seed = _rng()
    raw = rng.permutation(256).astype(np.uint8).reshape(16, 16)
    x = jax.lax.bitcast_convert_type(jnp.asarray(raw), FP8_DTYPE)
    rows = jnp.asarray(rng.integers(0, 16, size=40), jnp.int32)
    moves = {
        "transpose": (lambda d: jnp.swapaxes(d, -1, -2), raw.T),
        "slice-and-pad": (lambda d: jnp.pad(d[:10, :7], ((0, 0), (0, 9))), np.pad(raw[:10, :7], ((0, 0), (0, 9)))),
        "take": (lambda d: jnp.take(d, rows, axis=0), raw[np.asarray(rows)]),
        "chunks": (lambda d: d.reshape(16, 2, 8).transpose(1, 0, 2), raw.reshape(16, 2, 8).transpose(1, 0, 2)),
        # chunk_operand's cut to K: a mask where the data is wide enough, a pad where it is not
        "zero past k, wider": (lambda d: zero_past_k(d, 5, 12), np.pad(raw[:, :5], ((0, 0), (0, 7)))),
        "zero past k, as wide": (lambda d: zero_past_k(d, 9, 16), np.pad(raw[:, :9], ((0, 0), (0, 7)))),
        "zero past k, all of it": (lambda d: zero_past_k(d, 16, 16), raw),
        "zero past k, narrower": (lambda d: zero_past_k(d[:, :11], 11, 20), np.pad(raw[:, :11], ((0, 0), (0, 9)))),
    }
    for name, (fn, want) in moves.items():
        for run in (lambda: move_bytes(fn, x), jax.jit(lambda: move_bytes(fn, x))):
            got = run()
            assert got.dtype == FP8_DTYPE, name
            np.testing.assert_array_equal(np.asarray(as_bytes(got)), want, err_msg=f"{name} seed={seed}")
    np.testing.assert_array_equal(np.asarray(as_bytes(from_bytes(as_bytes(x), FP8_DTYPE))), raw)
    y = jnp.ones((3, 3), jnp.bfloat16)  # other dtypes: the move itself
    assert move_bytes(lambda d: d.T, y).dtype == jnp.bfloat16 and as_bytes(y) is y


def test_chunk_width():
    from jfp8.reference import chunk_width

    assert [chunk_width(None, c) for c in range(3)] == [TILE] * 3
    assert [chunk_width(64, 0), chunk_width(32, 0), chunk_width(1, 0), chunk_width(128, 0)] == [64, 32, 32, TILE]
    assert [chunk_width(300, c) for c in range(3)] == [TILE, TILE, 64]  # 44 -> 64
    assert [chunk_width(264, c) for c in range(3)] == [TILE, TILE, 32]
    assert chunk_width(0, 0) == 0 and chunk_width(200, 2) == 0  # nothing left: an empty dot


FINITE_CODES = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)  # E4M3 but its two NaNs


@pytest.mark.parametrize("f32", [False, True], ids=["e4m3", "f32-of-e4m3"])
@pytest.mark.parametrize("k", [8, 32, 40, 64, 96, 100, 120, 127, 200, 264, 416, 1100])
def test_last_chunk_trimmed_to_k_gives_the_same_bits(k, f32):
    """`chunked_matmul(..., k=K)` skips the zero columns of the last chunk past K's next multiple
    of 32 (issue 44: tiny's K 32 and 64 padded to 128 quadrupled or doubled the CPU's work). Its
    f32 bytes must equal the full chunks' at fresh shapes, E4M3 values over their whole range
    (a NaN and a -0 planted), as E4M3 and as their exact f32 values (what the grouped reference
    passes) and both paths of the loop (unrolled; over 8 chunks: the scan, where k is not used). A backend whose dot sums a zero-padded chunk in another order fails here, as
    XLA:CPU does with the last chunk cut at K itself (CHUNK_TAIL_MULTIPLE = 1 fails at K 127)."""
    from jfp8.reference import chunked_matmul

    rng, seed = _rng()
    m, n = int(rng.integers(1, 2100)), int(rng.integers(1, 300))
    kp = -(-k // TILE) * TILE
    chunks = kp // TILE

    def operand(rows):
        raw = rng.choice(FINITE_CODES, size=(rows, kp))
        raw.flat[rng.integers(0, raw.size, size=2)] = [0x7F, 0x80]  # a NaN and a -0
        raw[:, k:] = 0  # the columns past K are zeros, as chunk_operand leaves them
        data = jax.lax.bitcast_convert_type(jnp.asarray(raw), FP8_DTYPE)
        return data.astype(jnp.float32) if f32 else data

    a, b = operand(m), operand(n)
    sa = jnp.asarray(np.exp2(rng.integers(-8, 8, size=(m, chunks))), jnp.float32)
    sb = jnp.asarray(np.exp2(rng.integers(-8, 8, size=(n, chunks))), jnp.float32)
    full = np.asarray(chunked_matmul(a, sa, b, sb))
    trimmed = np.asarray(chunked_matmul(a, sa, b, sb, k=k))
    np.testing.assert_array_equal(trimmed.view(np.uint32), full.view(np.uint32), err_msg=f"m={m} n={n} seed={seed}")

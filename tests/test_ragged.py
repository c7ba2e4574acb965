"""The BF16 baseline's grouped GEMMs (`jfp8.api.ragged_dot`, `ragged_dot_grads`): jax's Mosaic GPU
ragged dots (`pallas_kernels.ragged`) against the reference (`jfp8.reference.ragged_dot_reference`)
and an f64 oracle, in the Mosaic GPU interpreter (NaN-initialised buffers) and on a Hopper GPU.

The kernels sum in their own order, so they are not held to the reference's bits: each output is
held to its BF16 rounding plus the FP32 sums' error, |y - oracle| <= 2^-8 |oracle| + 2^-20 Σ|x·w|
(half a BF16 ulp is at most 2^-9 of the value; an FP32 sum of K terms errs by < K 2^-24 Σ|x·w|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8.api import ragged_dot, ragged_dot_grads
from jfp8.ops import grouped_fp8_linear
from jfp8.recipe import Fp8Recipe
from jfp8.reference import ragged_dot_grads_reference, ragged_dot_reference
from pallas_kernels import _mgpu, ragged
from pallas_kernels.ragged import transposed_ragged_dot_mgpu
from tma_stores import interpret  # fails on a store Hopper would spill


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _sizes(rng: np.random.Generator, groups: int, total: int) -> np.ndarray:
    """Random sizes summing to `total`, one group empty (and one of them the last, sometimes)."""
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    zero = rng.integers(groups)
    sizes[(zero + 1) % groups] += sizes[zero]
    sizes[zero] = 0
    return sizes.astype(np.int32)


def _operands(seed: int, t: int, k: int, n: int, groups: int, used: int, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, k, n)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((t, n)), dtype)
    return x, w, jnp.asarray(_sizes(rng, groups, used)), dy


def _group_of_rows(sizes: np.ndarray, t: int) -> np.ndarray:
    return np.searchsorted(np.cumsum(sizes), np.arange(t), side="right")  # G past the sum


def _oracle(x, w, sizes, dy):
    """f64 (y, dx, dw) and the Σ|·| of each output's terms, from the operands as the kernels see
    them (x's dtype; w rounded to it)."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(x.dtype).astype(jnp.float32), np.float64)
    dy64 = np.asarray(dy.astype(jnp.float32), np.float64)
    g = _group_of_rows(np.asarray(sizes), x.shape[0])
    y, dx = np.zeros((x.shape[0], w.shape[2])), np.zeros(x.shape)
    ay, adx = np.zeros_like(y), np.zeros_like(dx)
    dw, adw = np.zeros(w.shape), np.zeros(w.shape)
    for gi in range(w.shape[0]):
        rows = g == gi
        y[rows], ay[rows] = x64[rows] @ w64[gi], np.abs(x64[rows]) @ np.abs(w64[gi])
        dx[rows], adx[rows] = dy64[rows] @ w64[gi].T, np.abs(dy64[rows]) @ np.abs(w64[gi]).T
        dw[gi], adw[gi] = x64[rows].T @ dy64[rows], np.abs(x64[rows]).T @ np.abs(dy64[rows])
    return (y, ay), (dx, adx), (dw, adw)


def _assert_within(out, oracle_and_abs, what: str, seed: int, roundings: int = 1):
    """Within `roundings` BF16 roundings of partial sums (each < 2^-8 of Σ|terms| past the first)."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    oracle, absolute = oracle_and_abs
    assert out.shape == oracle.shape, (what, out.shape, oracle.shape)
    err = np.abs(out - oracle)
    bound = 2.0**-8 * np.abs(oracle) + (roundings - 1) * 2.0**-8 * absolute + 2.0**-20 * absolute
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (f"seed={seed}: {what}: {bad.sum()} of {bad.size} outside the bound, worst "
                           f"{np.max(np.where(np.isfinite(err), err - bound, np.inf)):.3g} at {np.argwhere(bad)[0]}")


# Tokens not a multiple of the 128-row block, rows past the groups' sum, an empty group, one group.
CASES = [
    (300, 256, 128, 3, 280),
    (129, 128, 256, 4, 129),
    (200, 128, 128, 1, 77),
]


@pytest.mark.parametrize("t,k,n,groups,used", CASES)
def test_kernels_match_the_oracle_in_the_interpreter(t, k, n, groups, used):
    seed = _seed()
    x, w, sizes, dy = _operands(seed, t, k, n, groups, used)
    assert ragged.unsupported(x, w) is None
    y = interpret(ragged_dot, x, w, sizes, impl="mosaic")
    dx, dw = interpret(ragged_dot_grads, x, w, sizes, dy, impl="mosaic")
    (oy, odx, odw) = _oracle(x, w, sizes, dy)
    _assert_within(y, oy, "y", seed)
    _assert_within(dx, odx, "dx", seed)
    _assert_within(dw, odw, "dw", seed)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    past = _group_of_rows(np.asarray(sizes), t) == groups
    assert np.all(np.asarray(y)[past] == 0) and np.all(np.asarray(dx)[past] == 0), seed
    # The reference is held to the same bound (the bound is not loose enough to pass anything: a
    # result from the wrong group's weights fails it, below).
    _assert_within(ragged_dot_reference(x, w, sizes), oy, "reference y", seed)
    rdx, rdw = ragged_dot_grads_reference(x, w, sizes, dy)
    _assert_within(rdx, odx, "reference dx", seed)
    # The reference's dW (autodiff of its scan) adds each 256-row work item's partial product into
    # a BF16 cotangent: one rounding per item, not one per output as the kernel's.
    _assert_within(rdw, odw, "reference dw", seed, roundings=-(-t // 256) + 1)


def test_the_bound_sees_a_wrong_group():
    seed = _seed()
    x, w, sizes, dy = _operands(seed, 300, 256, 128, 3, 280)
    (oy, _, _) = _oracle(x, w, sizes, dy)
    shifted = ragged_dot_reference(x, jnp.roll(w, 1, axis=0), sizes)
    with pytest.raises(AssertionError):
        _assert_within(shifted, oy, "y", seed)


def test_f16_inputs():
    seed = _seed()
    x, w, sizes, dy = _operands(seed, 160, 128, 128, 2, 150, jnp.float16)
    (oy, _, odw) = _oracle(x, w, sizes, dy)
    _assert_within(interpret(ragged_dot, x, w, sizes, impl="mosaic"), oy, "y", seed)
    _assert_within(interpret(ragged_dot_grads, x, w, sizes, dy, impl="mosaic")[1], odw, "dw", seed)


def test_the_bf16_baseline_op_runs_the_kernels_under_autodiff():
    """`grouped_fp8_linear` with `Fp8Recipe.off()` (the BF16 baseline's experts): forward and both
    gradients through the kernels, each within the bound of the f64 oracle."""
    seed = _seed()
    x, w, sizes, dy = _operands(seed, 256, 128, 256, 3, 250)
    recipe = Fp8Recipe.off(impl="mosaic", interpret=True)

    def loss(x, w):
        y = grouped_fp8_linear(x, w, sizes, recipe)
        return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    oy, odx, odw = _oracle(x, w, sizes, dy)
    _assert_within(y, oy, "y", seed)
    _assert_within(dx, odx, "dx", seed)
    _assert_within(dw, odw, "dw", seed)


def test_shapes_the_kernels_do_not_take():
    x, w, sizes, dy = _operands(0, 64, 96, 128, 2, 64)
    assert "K=96" in ragged.unsupported(x, w)
    with pytest.raises(NotImplementedError, match="K=96"):
        ragged_dot(x, w, sizes, impl="mosaic", interpret=True)
    # "auto" runs the reference there, with its bits.
    np.testing.assert_array_equal(ragged_dot(x, w, sizes, impl="auto", interpret=True),
                                  ragged_dot_reference(x, w, sizes))
    assert "dtype float32" in ragged.unsupported(x.astype(jnp.float32), w)


@pytest.mark.parametrize("t", [256, 276, 5])
def test_lowered_for_hopper_from_a_cpu_host(t):
    """The three kernels lower for CUDA here (the transposed one reads the SM count from the build
    target, not from this machine's CPU device), and jax's module is left as it was. Also where
    the tokens are not a multiple of 8 (jax's TMA copies take 8-row tiles: 276 tokens failed to
    lower on an H100, 2026-11-28, before `ragged` padded them) or fewer than 8."""
    x, w, sizes, dy = _operands(0, t, 128, 256, 4, t)
    before = transposed_ragged_dot_mgpu.jax
    with _mgpu.build_target("NVIDIA H100 80GB HBM3", 132):
        text = _mgpu.lower_for_cuda(
            lambda x, w, s, dy: (ragged_dot(x, w, s, impl="mosaic"), ragged_dot_grads(x, w, s, dy, impl="mosaic")),
            x, w, sizes, dy)
    assert text.count("mosaic_gpu") >= 3
    assert transposed_ragged_dot_mgpu.jax is before is jax


@pytest.mark.gpu
def test_on_gpu_within_the_bound():
    seed = _seed()
    for t, k, n, groups, used in [(4000, 1024, 768, 8, 3900), *CASES]:
        x, w, sizes, dy = _operands(seed, t, k, n, groups, used)
        y = ragged_dot(x, w, sizes, impl="mosaic")
        dx, dw = ragged_dot_grads(x, w, sizes, dy, impl="mosaic")
        oy, odx, odw = _oracle(x, w, sizes, dy)  # numpy, on the host
        _assert_within(y, oy, f"y {t, k, n}", seed)
        _assert_within(dx, odx, f"dx {t, k, n}", seed)
        _assert_within(dw, odw, f"dw {t, k, n}", seed)

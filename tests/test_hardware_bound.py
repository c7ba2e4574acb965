"""The error bound a Hopper kernel is held to (`jfp8.accumulation.hardware_error_bound`).

On hardware the FP8 tensor core sums each 128-chunk in a limited accumulator, so the kernels
cannot match `scaled_matmul_reference` bit for bit as they do in the interpreter. The bound must
(1) admit every plausible reading of that accumulator and (2) reject real kernel bugs by a wide
margin. (2) is checked with mutants of the chunked computation: each is a bug a kernel could have.
"""

import numpy as np
import jax.numpy as jnp
import pytest

import jfp8
from jfp8.accumulation import (
    HARDWARE_MARGIN,
    AccumulatorModel,
    grouped_hardware_error_bound,
    grouped_wgrad_hardware_error_bound,
    hardware_error_bound,
    simulated_scaled_matmul,
)
from jfp8.reference import rel_error
from jfp8.reference import chunk_operand

TILE = jfp8.TILE
# A mutant must land at least this many bounds away: far outside, not just outside.
SEPARATION = 10.0


def _seed() -> int:
    return int(np.random.default_rng().integers(1 << 31))


def _operands(seed, m, n, k, b_block=(TILE, TILE)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.normal(size=(m, 1)))
    w = rng.standard_normal((n, k)) * np.exp(rng.normal(size=(n, 1)))
    return (jfp8.quantize(jnp.asarray(x, jnp.float32), (1, TILE)),
            jfp8.quantize(jnp.asarray(w, jnp.float32), b_block))


def _chunks(t, kp):
    data, s = chunk_operand(t, kp)
    return np.asarray(data, np.float64), np.asarray(s, np.float64)  # [R, Kp], [R, C]


def _chunked(ad, sa, bd, sb):
    """sum over chunks c of (A_c B_c^T) * sa_c sb_c, in float64: the promotion loop."""
    out = np.zeros((ad.shape[0], bd.shape[0]))
    for c in range(sa.shape[1]):
        cols = slice(c * TILE, (c + 1) * TILE)
        out += (ad[:, cols] @ bd[:, cols].T) * np.outer(sa[:, c], sb[:, c])
    return out


def _mutants(a, b):
    """Each kernel bug as its output on (a, b)."""
    kp = -(-a.logical[1] // TILE) * TILE
    ad, sa = _chunks(a, kp)
    bd, sb = _chunks(b, kp)
    last = sa.shape[1] - 1
    out = {}
    # The scale of the wrong 128-row block of b (an indexing slip in the scale loads).
    sb_wrong = sb.copy()
    sb_wrong[:TILE] = sb[TILE:2 * TILE]
    out["wrong_b_block_scale"] = _chunked(ad, sa, bd, sb_wrong)
    # a's scale one chunk late (the scale pipeline one stage behind the data).
    out["stale_a_scale"] = _chunked(ad, np.roll(sa, 1, axis=1), bd, sb)
    # The last chunk computed from the previous chunk's operands (a slot refilled too late).
    ad_stale, bd_stale = ad.copy(), bd.copy()
    ad_stale[:, last * TILE:] = ad[:, (last - 1) * TILE:last * TILE]
    bd_stale[:, last * TILE:] = bd[:, (last - 1) * TILE:last * TILE]
    out["stale_chunk"] = _chunked(ad_stale, sa, bd_stale, sb)
    # The last chunk never promoted (the loop one iteration short).
    out["dropped_chunk"] = _chunked(ad[:, :last * TILE], sa[:, :last], bd[:, :last * TILE], sb[:, :last])
    # The promotion applies b's scale only.
    out["missing_a_scale"] = _chunked(ad, np.ones_like(sa), bd, sb)
    # One 128 x 128 output tile stored transposed.
    good = _chunked(ad, sa, bd, sb)
    tile = good.copy()
    tile[:TILE, :TILE] = good[:TILE, :TILE].T
    out["transposed_tile"] = tile
    out = {name: y[: a.logical[0], : b.logical[0]] for name, y in out.items()}
    return out


@pytest.mark.parametrize("b_block", [(TILE, TILE), (1, TILE)], ids=["tile_x_block", "tile_x_tile"])
def test_mutants_land_far_outside_the_bound(b_block):
    """The smoke stage's dense shape, with a K tail (500 = 3 chunks + 116)."""
    seed = _seed()
    a, b = _operands(seed, 256, 384, 500, b_block)
    bound = hardware_error_bound(a, b)
    ref = np.asarray(jfp8.scaled_matmul_reference(a, b, jnp.float32))
    assert 1e-4 < bound < 1e-2, (seed, bound)  # the predicted hardware error, not a blanket
    for name, y in _mutants(a, b).items():
        err = rel_error(y, ref)
        assert err >= SEPARATION * bound, f"seed={seed}: mutant {name}: error {err:.2e}, bound {bound:.2e}"


def test_plausible_accumulators_fit_inside_the_bound():
    """Every reading of the hardware the simulator offers, as strict as the report's 14 bits or
    looser, is inside the bound, with room (a correct kernel never sits on its edge)."""
    seed = _seed()
    a, b = _operands(seed, 128, 256, 1024)
    bound = hardware_error_bound(a, b)
    ref = np.asarray(jfp8.scaled_matmul_reference(a, b, jnp.float32))
    for model in [AccumulatorModel.deepseek(),
                  AccumulatorModel(alignment="product"),
                  AccumulatorModel(kept_bits=13),
                  AccumulatorModel(kept_bits=16, rounding="nearest"),
                  AccumulatorModel.fp32()]:
        err = rel_error(simulated_scaled_matmul(a, b, model), ref)
        limit = bound if model.kept_bits == 13 else bound / 2
        assert err <= limit, f"seed={seed}: {model.label}: {err:.2e} > {limit:.2e}"
    # The bound is margin x the pessimistic model: exactly that model sits at 1 / margin of it.
    worst = rel_error(simulated_scaled_matmul(a, b, AccumulatorModel(
        kept_bits=13, alignment="product")), ref)
    assert worst == pytest.approx(bound / HARDWARE_MARGIN, rel=0.02)


def test_grouped_bounds_pool_the_groups():
    """Grouped Fprop and Wgrad bounds are of the same size as the dense one, and a group without
    rows or tokens changes nothing."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((256, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 200, 300)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((256, 130)), jnp.float32)
    a, b = jfp8.quantize(x, (1, TILE)), jfp8.quantize(w, (TILE, TILE))
    dense = hardware_error_bound(a, jfp8.quantize(w[0], (TILE, TILE)))
    for sizes in ([100, 0, 156], [256, 0, 0], [0, 128, 100]):
        g = grouped_hardware_error_bound(a, b, sizes)
        assert dense / 3 < g < 3 * dense, (seed, sizes, g, dense)
        xt, dyt = jfp8.quantize(x, (TILE, 1)).mT, jfp8.quantize(dy, (TILE, 1)).mT
        gw = grouped_wgrad_hardware_error_bound(xt, dyt, sizes)
        assert dense / 3 < gw < 3 * dense, (seed, sizes, gw, dense)
    assert grouped_hardware_error_bound(a, b, [0, 0, 0]) == pytest.approx(4e-6)  # the floor


def test_relative_error_edge_cases():
    assert rel_error(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_error(np.ones(3), np.zeros(3)) == float("inf")
    assert np.isnan(rel_error(np.array([np.nan, 1.0]), np.ones(2)))
    assert not rel_error(np.array([np.nan, 1.0]), np.ones(2)) <= 1.0

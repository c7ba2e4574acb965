"""The grouped (MoE) FP8 kernels (`pallas_kernels.grouped_gemm`) against the grouped references.

On CPU the kernels run in the Mosaic GPU interpreter, which fills every buffer it allocates (the
output included) with NaN: an output row the kernel fails to write cannot pass a comparison.
Lowering for CUDA then checks the Hopper limits the interpreter ignores.

Comparison strength:
- Bit-identical for "exact" operands: every nonzero E4M3 magnitude is in [16, 448] (values whose
  magnitudes lie within a factor 16 of their scaling block's amax), so the values are even, every
  product a multiple of 4, and every 128-term chunk sum below 2**24 * 4: exact in f32 whatever
  the summation order. Then only the promotion, its chunk order and the final cast can differ,
  and they must match bit for bit.
- For Gaussian operands a chunk sum is not exact in f32, and XLA's CPU dot (reference) and the
  interpreter's matmul (kernel) sum in different orders: each output must then be within
  1e-6 * sum |a_i b_i| (f64) of the reference, the scale of a summation-order difference.

Both forms of each kernel run here: `GroupedGemmConfig()` (warp-specialized: a TMA warpgroup and
two wgmma warpgroups, persistent CTAs walking several tiles) and `GroupedGemmConfig.simple()`.

Each interpreted call costs seconds whatever its size, so each call covers several edge cases.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8.accumulation import (
    grouped_hardware_error_bound,
    grouped_wgrad_hardware_error_bound,
)
from jfp8.reference import rel_error
from jfp8.fp8 import Fp8Tensor, quantize
from jfp8.reference import (
    dequantize_f64,
    group_ids,
    grouped_scaled_matmul_reference,
    grouped_wgrad_reference,
)
from pallas_kernels import _mgpu
from pallas_kernels.fp8_math import FP8_DTYPE, TILE
from pallas_kernels.configs import GroupedGemmConfig
from pallas_kernels.grouped_gemm import _grouped_matmul_call, grouped_scaled_matmul
from pallas_kernels.grouped_wgrad import _grouped_wgrad_call, grouped_wgrad
from pallas_kernels.schedule import row_tile_work
from pallas_kernels.shapes import GROUPED_SHAPES
from helpers import assert_bitwise_equal as _assert_bitwise_equal
from helpers import on_cpu as _on_cpu
from tma_stores import interpret as _interpret  # fails on a store Hopper would spill
from tma_stores import interpret_detecting_races as _interpret_detecting_races

# Jitted once per shape: eager quantization and references would compile op by op in every test.
_quantize = jax.jit(quantize, static_argnums=1)
_matmul_reference = jax.jit(grouped_scaled_matmul_reference, static_argnums=3)
_wgrad_reference = jax.jit(grouped_wgrad_reference, static_argnums=3)

# Magnitudes in [1/EXACT_RANGE, 1] times a factor that is constant over each scaling block.
EXACT_RANGE = 16
SIMPLE = GroupedGemmConfig.simple()
SIMPLE_FIELDS = dataclasses.asdict(SIMPLE)
FAST = GroupedGemmConfig()
# Issue 19's switches of the warp-specialized form, each alone (measured side by side on a GPU).
VARIANTS = {
    "cluster-n": dataclasses.replace(FAST, cluster_n=2),  # column-tile pairs share a (multicast)
    "scalar-b": dataclasses.replace(FAST, scalar_b_scale=True),  # Fprop: one weight scale per step
    "early-scales": dataclasses.replace(FAST, early_scale_loads=True),  # scales read before wgmma
    # issue 45: the stage released right after the wgmma's wait, the proxy fence in the producer
    "lean": dataclasses.replace(FAST, early_scale_loads=True, lean_release=True),
}
# Issue 45: 256-row tiles in clusters along N (the rule's pick at the benchmark shapes), each
# consumer promoting its 128 rows in two 64-row waves; Fprop/Dgrad only (bf16 output): beside
# an f32 output tile (the Wgrad's) two stages do not fit.
TALL = dataclasses.replace(FAST, tile_m=256, cluster_n=2, max_concurrent_steps=3)
# Summation-order tolerance, relative to sum |a_i b_i|.
ORDER_RTOL = 1e-6


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _values(rng: np.random.Generator, shape, exact: bool) -> np.ndarray:
    if exact:
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(1 / EXACT_RANGE, 1, shape)
    return rng.standard_normal(shape)


def _sizes(rng: np.random.Generator, groups: int, total: int) -> np.ndarray:
    """Random group sizes summing to `total`, with at least one empty group when G >= 3."""
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    if groups >= 3:
        zero = rng.integers(groups)
        sizes[(zero + 1) % groups] += sizes[zero]
        sizes[zero] = 0
    return sizes.astype(np.int32)




def _assert_within(out, ref, abs_product, rtol, seed):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape, seed)
    excess = np.abs(out - ref) - rtol * abs_product
    assert (excess <= 0).all(), (
        f"seed={seed}: {(excess > 0).sum()} outputs off by more than {rtol} * sum|a b| "
        f"(worst at {np.unravel_index(np.argmax(excess), excess.shape)})"
    )


# ------------------------------------------------------------------------------------------------
# grouped_scaled_matmul (Fprop / Dgrad)
# ------------------------------------------------------------------------------------------------


def _row_operands(seed, t, k, n, sizes, *, exact):
    """lhs = quantize(x, (1, 128)) with per-row magnitudes; rhs = quantize(w, (128, 128)), one
    magnitude per group (so every 128x128 block stays within the exact range)."""
    rng = np.random.default_rng(seed)
    x = _values(rng, (t, k), exact) * np.exp(rng.normal(size=(t, 1)))
    w = _values(rng, (len(sizes), n, k), exact) * np.exp(rng.normal(size=(len(sizes), 1, 1)))
    lhs = _quantize(jnp.asarray(x, jnp.float32), (1, TILE))
    rhs = _quantize(jnp.asarray(w, jnp.float32), (TILE, TILE))
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _matmul(lhs: Fp8Tensor, rhs: Fp8Tensor, sizes, out_dtype, config=None):
    return grouped_scaled_matmul(
        lhs.data, lhs.scale, rhs.data, rhs.scale, sizes,
        n=rhs.shape[1], out_dtype=out_dtype, config=config,
    )


def _matmul_abs_product(lhs: Fp8Tensor, rhs: Fp8Tensor, sizes) -> np.ndarray:
    """(T, N) f64: sum_k |lhs[t, k] rhs[g(t), :, k]|, zero past the groups."""
    a, b = np.abs(dequantize_f64(lhs)), np.abs(dequantize_f64(rhs))  # [T, K], [G, N, K]
    ids = np.asarray(group_ids(sizes, a.shape[0]))
    out = np.zeros((a.shape[0], b.shape[1]))
    for g in range(b.shape[0]):
        out[ids == g] = a[ids == g] @ b[g].T
    return out


# (T, K, N, group sizes or G for random sizes, rows past the groups, out_dtype, config):
# odd T (padded rows), three chunks, an N tail over two N tiles, random groups straddling row
# tiles, an empty group, rows past the groups (the pseudo-group's zero stores); a group holding
# every row next to empty ones, one chunk; T = 1 with K = 1 (one zero-padded chunk); 64-column
# tiles (the warp-specialized form takes any tile_n: its weight scales come per column).
EXACT_MATMUL_CASES = [
    (203, 384, 200, 3, 9, jnp.float32, FAST),
    (203, 384, 200, 3, 9, jnp.bfloat16, dataclasses.replace(SIMPLE, tile_m=128)),
    (130, 128, 128, [0, 130, 0], 0, jnp.bfloat16, SIMPLE),
    (1, 1, 24, [0, 1], 0, jnp.bfloat16, FAST),
    (260, 256, 200, 4, 0, jnp.bfloat16, dataclasses.replace(FAST, tile_n=64, max_concurrent_steps=2)),
    # issue 19's switches together: 3 column tiles in clusters along N (the last cluster's
    # second CTA past N), the scalar weight scale and early scale loads; then the scalar scale
    # with two 64-column tiles per weight block
    (203, 384, 330, 3, 9, jnp.bfloat16,
     dataclasses.replace(FAST, cluster_n=2, scalar_b_scale=True, early_scale_loads=True)),
    (260, 256, 200, 4, 0, jnp.float32,
     dataclasses.replace(FAST, tile_n=64, scalar_b_scale=True, max_concurrent_steps=2, persistent=False)),
    # 256-row tiles: random groups straddling them, both waves of both consumers holding rows
    (600, 384, 330, 3, 9, jnp.bfloat16, TALL),
]


@pytest.mark.parametrize("t,k,n,groups,past,out_dtype,config", EXACT_MATMUL_CASES)
def test_matmul_bit_identical_to_reference(t, k, n, groups, past, out_dtype, config):
    seed = _seed()
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, groups, t - past) if isinstance(groups, int) else groups
    lhs, rhs, sizes = _row_operands(seed, t, k, n, sizes, exact=True)
    out = _interpret(_matmul, lhs, rhs, sizes, out_dtype, config)
    ref = _matmul_reference(lhs, rhs, sizes, out_dtype)
    _assert_bitwise_equal(out, ref, f"{seed} sizes={sizes}")


# Store tails (`tma_stores`: a TMA store that Mosaic lowers as a flat copy must not run past an
# inner axis's end), with fixed groups so that every case issues them: group boundaries at odd
# rows, so each consumer's ladder of row stores (`_store_rows`) includes its one-row copy, in
# the column tile that ends past N (56 columns past 200 in bf16, 32 past the swizzle width 224
# in f32); empty groups first and between; the last group's rows running to the array's end,
# or 7 rows past the groups (the pseudo-group's zeros, one-row copy included); clusters along N
# over 3 column tiles, the last cluster's second CTA wholly past N.
STORE_TAIL_MATMUL_CASES = {
    "simple-bf16": (203, 200, [0, 101, 0, 102], jnp.bfloat16, SIMPLE),
    "simple-past-groups": (203, 72, [101, 0, 95], jnp.float32, SIMPLE),
    "fast-f32": (203, 200, [0, 101, 0, 102], jnp.float32, FAST),
    "cluster-n-bf16": (203, 330, [0, 101, 0, 95], jnp.bfloat16, VARIANTS["cluster-n"]),
}


@pytest.mark.parametrize("case", STORE_TAIL_MATMUL_CASES)
def test_matmul_store_tails(case):
    t, n, sizes, out_dtype, config = STORE_TAIL_MATMUL_CASES[case]
    seed = _seed()
    lhs, rhs, sizes = _row_operands(seed, t, TILE, n, sizes, exact=True)
    out = _interpret(_matmul, lhs, rhs, sizes, out_dtype, config)
    _assert_bitwise_equal(out, _matmul_reference(lhs, rhs, sizes, out_dtype), f"{seed} sizes={sizes}")


@pytest.mark.parametrize("config", [FAST, SIMPLE], ids=["fast", "simple"])
def test_matmul_gaussian_within_summation_order(config):
    seed = _seed()
    sizes = _sizes(np.random.default_rng(seed), 3, 120)
    lhs, rhs, sizes = _row_operands(seed, 128, 256, 72, sizes, exact=False)
    out = _interpret(_matmul, lhs, rhs, sizes, jnp.float32, config)
    ref = _matmul_reference(lhs, rhs, sizes, jnp.float32)
    _assert_within(out, ref, _matmul_abs_product(lhs, rhs, sizes), ORDER_RTOL, seed)


def test_row_tile_work_writes_every_row_once_with_its_group():
    """The work items cover each row exactly once, with its group (G past the groups)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    work = jax.jit(row_tile_work, static_argnums=(1, 2))
    for rows, groups, tile_m in [(1, 1, 64), (300, 4, 64), (513, 8, 128)]:
        for _ in range(5):
            sizes = _sizes(rng, groups, int(rng.integers(0, rows + 1)))
            items = map(np.asarray, work(jnp.asarray(sizes), rows, tile_m))
            owner = np.full(rows, -1)
            for g, tile, lo, hi in zip(*items):
                assert tile * tile_m <= lo <= hi <= (tile + 1) * tile_m, (seed, sizes)
                assert (owner[lo:hi] == -1).all(), f"seed={seed} sizes={sizes}: row stored twice"
                owner[lo:hi] = g
            ids = np.searchsorted(np.cumsum(sizes), np.arange(rows), side="right")  # G past them
            np.testing.assert_array_equal(owner, ids, f"seed={seed} sizes={sizes}")


# ------------------------------------------------------------------------------------------------
# grouped_wgrad
# ------------------------------------------------------------------------------------------------


def _token_operands(seed, t, k, n, sizes, *, exact):
    """lhs_t = quantize(x, (128, 1)).mT (K, T), rhs_t = quantize(dy, (128, 1)).mT (N, T), with
    per-feature magnitudes (constant over each 128-token block)."""
    rng = np.random.default_rng(seed)
    x = _values(rng, (t, k), exact) * np.exp(rng.normal(size=(1, k)))
    dy = _values(rng, (t, n), exact) * np.exp(rng.normal(size=(1, n)))
    lhs_t = _quantize(jnp.asarray(x, jnp.float32), (TILE, 1)).mT
    rhs_t = _quantize(jnp.asarray(dy, jnp.float32), (TILE, 1)).mT
    return lhs_t, rhs_t, jnp.asarray(sizes, jnp.int32)


def _wgrad(lhs_t: Fp8Tensor, rhs_t: Fp8Tensor, sizes, out_dtype, config=None):
    return grouped_wgrad(
        lhs_t.data, lhs_t.scale, rhs_t.data, rhs_t.scale, sizes,
        t=lhs_t.shape[1], out_dtype=out_dtype, config=config,
    )


def _wgrad_abs_product(lhs_t: Fp8Tensor, rhs_t: Fp8Tensor, sizes) -> np.ndarray:
    """(G, K, N) f64: sum over the tokens of g of |lhs_t[:, t]| |rhs_t[:, t]|."""
    a, b = np.abs(dequantize_f64(lhs_t)), np.abs(dequantize_f64(rhs_t))  # [K, T], [N, T]
    ids = np.asarray(group_ids(sizes, a.shape[1]))
    return np.stack([a[:, ids == g] @ b[:, ids == g].T for g in range(len(sizes))])


# (T, K, N, group sizes or G for random sizes, tokens past the groups, out_dtype, config):
# groups straddling 128-token chunks, empty groups (zero stores), tokens past the groups, a T
# tail, tile_n 64 (both forms); one group holding every token over two chunks; T = 1 with N = 8
# in a 32-column tile; K = 200 over two 128-row tiles, the second partial.
EXACT_WGRAD_CASES = [
    (300, 128, 64, 3, 20, jnp.float32, dataclasses.replace(SIMPLE, tile_n=64)),
    (300, 128, 64, 3, 20, jnp.float32, dataclasses.replace(FAST, tile_n=64)),
    (256, 64, 128, [0, 256, 0], 0, jnp.bfloat16, SIMPLE),
    (1, 64, 8, [1], 0, jnp.float32, dataclasses.replace(FAST, tile_n=32)),
    (400, 200, 128, 4, 0, jnp.bfloat16, FAST),
    # clusters along N over 3 column tiles, with early scale loads
    (300, 128, 72, 3, 20, jnp.float32,
     dataclasses.replace(FAST, tile_n=32, cluster_n=2, early_scale_loads=True)),
]


@pytest.mark.parametrize("t,k,n,groups,past,out_dtype,config", EXACT_WGRAD_CASES)
def test_wgrad_bit_identical_to_reference(t, k, n, groups, past, out_dtype, config):
    seed = _seed()
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, groups, t - past) if isinstance(groups, int) else groups
    lhs_t, rhs_t, sizes = _token_operands(seed, t, k, n, sizes, exact=True)
    out = _interpret(_wgrad, lhs_t, rhs_t, sizes, out_dtype, config)
    ref = _wgrad_reference(lhs_t, rhs_t, sizes, out_dtype)
    _assert_bitwise_equal(out, ref, f"{seed} sizes={sizes}")


# Store tails (`tma_stores`): N of one column tile, whose (rows, N) store windows are contiguous
# in GMEM, with K = 200 ending inside the last row tile: its rows past K must not reach the next
# group's gradient; clusters along N, the cluster's second CTA wholly past N. Empty groups first
# and between, the last group's tokens running to the end.
STORE_TAIL_WGRAD_CASES = {
    "simple": (128, [0, 150, 0, 150], jnp.float32, SIMPLE),
    "fast-bf16": (128, [0, 150, 0, 150], jnp.bfloat16, FAST),
    "cluster-n": (64, [150, 0, 150], jnp.float32, dataclasses.replace(VARIANTS["cluster-n"], tile_n=64)),
}


@pytest.mark.parametrize("case", STORE_TAIL_WGRAD_CASES)
def test_wgrad_store_tails(case):
    n, sizes, out_dtype, config = STORE_TAIL_WGRAD_CASES[case]
    seed = _seed()
    lhs_t, rhs_t, sizes = _token_operands(seed, 300, 200, n, sizes, exact=True)
    out = _interpret(_wgrad, lhs_t, rhs_t, sizes, out_dtype, config)
    _assert_bitwise_equal(out, _wgrad_reference(lhs_t, rhs_t, sizes, out_dtype), f"{seed} sizes={sizes}")


@pytest.mark.parametrize("config", [FAST, SIMPLE], ids=["fast", "simple"])
def test_wgrad_gaussian_with_k_and_n_tails(config):
    """K = 100 (rows padded to 104 for TMA; with 64-row tiles two, the second partial), N = 72."""
    seed = _seed()
    sizes = _sizes(np.random.default_rng(seed), 3, 190)
    lhs_t, rhs_t, sizes = _token_operands(seed, 200, 100, 72, sizes, exact=False)
    out = _interpret(_wgrad, lhs_t, rhs_t, sizes, jnp.float32, config)
    ref = _wgrad_reference(lhs_t, rhs_t, sizes, jnp.float32)
    _assert_within(out, ref, _wgrad_abs_product(lhs_t, rhs_t, sizes), ORDER_RTOL, seed)


@pytest.mark.parametrize("config", [FAST, SIMPLE], ids=["fast", "simple"])
def test_wgrad_masks_other_groups_tokens(config):
    """A NaN in group 0's data, in the chunk group 1 shares, stays out of group 1's gradient; in
    the fast form the NaN sits in the second consumer warpgroup's rows (row 70 of a 128-row tile)."""
    seed = _seed()
    lhs_t, rhs_t, sizes = _token_operands(seed, 200, 128, 64, [100, 100], exact=True)
    data = np.asarray(lhs_t.data).copy()
    data[70, 99] = np.nan  # token 99 (group 0) of chunk 0, which also holds tokens 100..127
    lhs_t = dataclasses.replace(lhs_t, data=jnp.asarray(data))
    out = np.asarray(_interpret(_wgrad, lhs_t, rhs_t, sizes, jnp.float32, config))
    ref = np.asarray(_wgrad_reference(lhs_t, rhs_t, sizes, jnp.float32))
    assert np.isnan(out[0, 70]).all() and np.isfinite(out[1]).all(), f"seed={seed}"
    _assert_bitwise_equal(out, ref, seed)


def test_persistent_ctas_walk_every_tile_without_races():
    """The fast forms on 2 CTAs, each walking several tiles through the same SMEM stages and
    output tile: every output element written (the outputs start as NaN), bit-identical to the
    references, and the race detector finds no unordered access between the TMA warpgroup, the
    two consumers, TMA and the reused SMEM. Forward: 3 chunks over 2 stages, a row tile
    straddling two groups, an empty group, the pseudo-group's zero rows, an N tail. Wgrad: dynamic
    K loops of 2 and 1 chunks sharing a chunk, an empty group's zero tiles, a K tail."""
    seed = _seed()
    config = dataclasses.replace(FAST, max_concurrent_steps=2, grid_tile_group=2)
    lhs, rhs, sizes = _row_operands(seed, 200, 384, 200, [100, 0, 90], exact=True)
    call = functools.partial(_grouped_matmul_call, n=200, out_dtype=jnp.float32, config=config, num_sms=2)
    out, races = _interpret_detecting_races(call, lhs.data, lhs.scale, rhs.data, rhs.scale, sizes)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _matmul_reference(lhs, rhs, sizes, jnp.float32), seed)

    lhs_t, rhs_t, sizes = _token_operands(seed, 300, 200, 64, [150, 0, 130], exact=True)
    call = functools.partial(_grouped_wgrad_call, out_dtype=jnp.float32,
                             config=dataclasses.replace(config, tile_n=32), num_sms=2)
    out, races = _interpret_detecting_races(call, lhs_t.data, lhs_t.scale, rhs_t.data, rhs_t.scale, sizes)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _wgrad_reference(lhs_t, rhs_t, sizes, jnp.float32), seed)


def _walk_without_races(config, wgrad_config, *, rows=200, n=330, row_sizes=(100, 0, 90), wgrad_k=200):
    """Forward at N = 330 (3 column tiles: with clusters along N the last cluster's second CTA
    computes a tile past N) and Wgrad at N = 72, both on 2 "SMs" with ragged and empty groups:
    every output written, bit-identical, no race. (Other sizes for taller tiles.)"""
    seed = _seed()
    lhs, rhs, sizes = _row_operands(seed, rows, 384, n, list(row_sizes), exact=True)
    call = functools.partial(_grouped_matmul_call, n=n, out_dtype=jnp.float32, config=config, num_sms=2)
    out, races = _interpret_detecting_races(call, lhs.data, lhs.scale, rhs.data, rhs.scale, sizes)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _matmul_reference(lhs, rhs, sizes, jnp.float32), seed)

    lhs_t, rhs_t, sizes = _token_operands(seed, 300, wgrad_k, 72, [150, 0, 130], exact=True)
    call = functools.partial(_grouped_wgrad_call, out_dtype=jnp.float32, config=wgrad_config, num_sms=2)
    out, races = _interpret_detecting_races(call, lhs_t.data, lhs_t.scale, rhs_t.data, rhs_t.scale, sizes)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _wgrad_reference(lhs_t, rhs_t, sizes, jnp.float32), seed)


@pytest.mark.parametrize("cluster_n", [1, 2], ids=["one-cta", "one-cluster-along-n"])
def test_wgrad_long_groups_run_rounds_from_any_slot(cluster_n):
    """The Wgrad's interior chunks (its first and last peeled off) in rounds of the stages
    (`_mainloop._static_slot_chunks`): groups of 4 to 9 chunks on one CTA over 3 stages, so the
    work items start in every slot and the first loop, the rounds and the leftovers all run;
    a 1-chunk group (no interior, the last chunk's `cond` false) and an empty group between
    them; alone and in a cluster of 2 along N. (Its scales
    read early, as the lean loop reads them, it keeps the one-chunk loop: `_round_form`.)
    Bit-identical, no race."""
    seed = _seed()
    config = dataclasses.replace(FAST, tile_n=32, max_concurrent_steps=3, cluster_n=cluster_n)
    # chunks per group: 9, 0, 1 (tokens 1100-1139 of chunk 8), 6, 6
    lhs_t, rhs_t, sizes = _token_operands(seed, 2400, 128, 40, [1100, 0, 40, 560, 700], exact=True)
    call = functools.partial(_grouped_wgrad_call, out_dtype=jnp.float32, config=config, num_sms=cluster_n)
    out, races = _interpret_detecting_races(call, lhs_t.data, lhs_t.scale, rhs_t.data, rhs_t.scale, sizes)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _wgrad_reference(lhs_t, rhs_t, sizes, jnp.float32), f"{seed} sizes={sizes}")


def test_clusters_along_n_walk_every_tile_without_races():
    """Issue 19's switches on 1 persistent cluster of 2 CTAs (2 "SMs"), each walking several
    cluster tiles: column tiles 2j and 2j + 1 of one work item share a's chunks, and with 3
    column tiles the last cluster's second CTA computes a tile past N. Forward with the scalar
    weight scale and early scale loads; Wgrad (dynamic K loops, masked shared chunks) with early
    loads. Every output written, bit-identical, no race."""
    config = dataclasses.replace(FAST, cluster_n=2, max_concurrent_steps=2, grid_tile_group=2,
                                 scalar_b_scale=True, early_scale_loads=True)
    _walk_without_races(config, dataclasses.replace(config, tile_n=32, scalar_b_scale=False))


def test_tall_tiles_walk_every_tile_without_races():
    """256-row tiles, lean, on 1 cluster of 2 along N: each consumer's two 64-row waves across K
    steps, tiles and work items (groups straddling a row tile: two items; the interpreter gives
    each wave an accumulator of its own, the lowered kernel shares one); 64-wide for the f32
    output tile. Then the Wgrad with 256 K rows a tile (dynamic K loops,
    masked shared chunks). Every output written, bit-identical, no race."""
    config = dataclasses.replace(TALL, tile_n=64, max_concurrent_steps=2, early_scale_loads=True,
                                 lean_release=True)
    _walk_without_races(config, config, rows=600, n=200, row_sizes=(300, 0, 250), wgrad_k=300)


@pytest.mark.parametrize("cluster_n", [1, 2], ids=["persistent", "clusters-along-n"])
def test_lean_release_walks_every_tile_without_races(cluster_n):
    """`lean_release` (each consumer releases a stage right after its wgmma's wait, the producer
    fences before the refill) in both kernels, persistent on 2 CTAs or on 1 cluster of 2, with
    the other tests' ragged groups: bit-identical, no race. The Wgrad's consumers also write a
    shared chunk's stage (the other groups' tokens masked) before its wgmma."""
    config = dataclasses.replace(VARIANTS["lean"], cluster_n=cluster_n, max_concurrent_steps=2, grid_tile_group=2)
    _walk_without_races(config, dataclasses.replace(config, tile_n=32))


# ------------------------------------------------------------------------------------------------
# Validation, empty problems, CUDA lowering, GPU.
# ------------------------------------------------------------------------------------------------


def test_empty_problems_return_zeros_without_a_kernel():
    fp8 = lambda *shape: jnp.zeros(shape, FP8_DTYPE)  # noqa: E731
    ones = lambda *shape: jnp.ones(shape, jnp.float32)  # noqa: E731
    out = grouped_scaled_matmul(
        fp8(0, 128), ones(0, 1), fp8(2, 128, 128), ones(2, 1, 1), jnp.zeros(2, jnp.int32), n=100
    )
    assert out.shape == (0, 100) and out.dtype == jnp.bfloat16
    out = grouped_scaled_matmul(
        fp8(5, 128), ones(5, 1), fp8(0, 128, 128), ones(0, 1, 1), jnp.zeros(0, jnp.int32), n=3
    )
    np.testing.assert_array_equal(out, np.zeros((5, 3)))
    no_tokens = jnp.zeros(3, jnp.int32)
    out = grouped_wgrad(fp8(8, 0), ones(8, 0), fp8(16, 0), ones(16, 0), no_tokens, t=0)
    np.testing.assert_array_equal(out, np.zeros((3, 8, 16)))
    no_groups = jnp.zeros(0, jnp.int32)
    out = grouped_wgrad(fp8(8, 128), ones(8, 1), fp8(16, 128), ones(16, 1), no_groups, t=5)
    assert out.shape == (0, 8, 16)


def _matmul_args(**change):
    args = dict(
        lhs_data=jnp.zeros((8, 256), FP8_DTYPE),
        lhs_scale=jnp.ones((8, 2), jnp.float32),
        rhs_data=jnp.zeros((2, 128, 256), FP8_DTYPE),
        rhs_scale=jnp.ones((2, 1, 2), jnp.float32),
        group_sizes=jnp.array([3, 4], jnp.int32),
        n=100,
    )
    return args | change


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(lhs_data=jnp.zeros((8, 256), jnp.bfloat16)), TypeError, "lhs_data must be"),
        (dict(rhs_data=jnp.zeros((128, 256), FP8_DTYPE)), ValueError, "rhs_data must be 3-D"),
        (dict(lhs_scale=jnp.ones((8, 2), jnp.bfloat16)), TypeError, "lhs_scale must be float32"),
        (dict(lhs_scale=jnp.ones((8, 3), jnp.float32)), ValueError, "lhs_scale must have shape"),
        (dict(rhs_scale=jnp.ones((2, 2, 2), jnp.float32)), ValueError, "rhs_scale must have"),
        (dict(rhs_data=jnp.zeros((2, 128, 384), FP8_DTYPE)), ValueError, "contraction sizes"),
        (
            dict(lhs_data=jnp.zeros((8, 200), FP8_DTYPE)),
            ValueError,
            "not a multiple of 128",
        ),
        (dict(n=129), ValueError, "padded to 256 rows"),
        (dict(group_sizes=jnp.array([3, 4, 0], jnp.int32)), ValueError, r"shape \(2,\)"),
        (dict(group_sizes=jnp.array([3.0, 4.0])), TypeError, "integers"),
        (dict(group_sizes=jnp.array([5, 4], jnp.int32)), ValueError, "sum to 9"),
        (dict(group_sizes=jnp.array([-1, 4], jnp.int32)), ValueError, ">= 0"),
        (dict(out_dtype=jnp.float16), ValueError, "out_dtype"),
        (dict(config=dataclasses.replace(SIMPLE, tile_n=64)), NotImplementedError, "tile_n=128"),
    ],
)
def test_matmul_invalid_inputs_raise(change, error, match):
    with pytest.raises(error, match=match):
        grouped_scaled_matmul(**_matmul_args(**change))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(t=300), ValueError, "384 token columns"),
        (dict(rhs_t_data=jnp.zeros((16, 128), FP8_DTYPE)), ValueError, "token columns"),
        (dict(rhs_t_scale=jnp.ones((16, 3), jnp.float32)), ValueError, "rhs_t_scale must have"),
        (dict(group_sizes=jnp.array([[1]], jnp.int32)), ValueError, "group_sizes must have"),
        (dict(group_sizes=jnp.array([200, 1], jnp.int32)), ValueError, "sum to 201, more than the 200"),
        (dict(lhs_t_data=jnp.zeros((8, 256), jnp.float8_e5m2)), TypeError, "lhs_t_data must"),
    ],
)
def test_wgrad_invalid_inputs_raise(change, error, match):
    args = dict(
        lhs_t_data=jnp.zeros((8, 256), FP8_DTYPE),
        lhs_t_scale=jnp.ones((8, 2), jnp.float32),
        rhs_t_data=jnp.zeros((16, 256), FP8_DTYPE),
        rhs_t_scale=jnp.ones((16, 2), jnp.float32),
        group_sizes=jnp.array([100, 50], jnp.int32),
        t=200,
    )
    with pytest.raises(error, match=match):
        grouped_wgrad(**(args | change))


@pytest.mark.parametrize(
    "fields,match",
    [
        # the fast form: two 64-row consumer warpgroups, the dense kernel's limits
        (dict(tile_m=64), "multiple of 128"), (dict(tile_m=384), "at most 256"),
        (dict(tile_n=8), "tile_n=8"), (dict(tile_n=48 + 1), "tile_n=49"),
        (dict(max_concurrent_steps=0), "max_concurrent_steps"), (dict(grid_tile_group=0), "grid_tile_group"),
        # the simple form
        (dict(SIMPLE_FIELDS, tile_m=96), "multiple of 64"), (dict(SIMPLE_FIELDS, tile_m=320), "up to 256"),
        (dict(SIMPLE_FIELDS, tile_n=48), "multiple of 32"), (dict(SIMPLE_FIELDS, tile_n=288), "up to 256"),
        (dict(SIMPLE_FIELDS, max_concurrent_steps=0), "max_concurrent_steps"),
        (dict(SIMPLE_FIELDS, persistent=True), "needs warp_specialized"),
        # issue 19's switches: the fast form's rules; the simple form has none of them
        (dict(cluster_n=3), "cluster_n=3"), (dict(scalar_b_scale=True, tile_n=256), "tile_n must divide"),
        (dict(SIMPLE_FIELDS, cluster_n=2), "cluster_n=2 needs warp_specialized"),
        (dict(SIMPLE_FIELDS, scalar_b_scale=True), "scalar_b_scale=True needs warp_specialized"),
        (dict(SIMPLE_FIELDS, early_scale_loads=True), "early_scale_loads=True needs warp_specialized"),
        (dict(SIMPLE_FIELDS, lean_release=True), "lean_release=True needs warp_specialized"),
        (dict(lean_release=True), "early_scale_loads=True"),  # the scales must be in registers first
    ],
)
def test_invalid_config_raises(fields, match):
    with pytest.raises(ValueError, match=match):
        GroupedGemmConfig(**fields)


def _lower_matmul(groups, t, n, k, out_dtype=jnp.bfloat16, config=None):
    S, np_ = jax.ShapeDtypeStruct, -(-n // TILE) * TILE
    args = (
        S((t, k), FP8_DTYPE), S((t, k // TILE), jnp.float32),
        S((groups, np_, k), FP8_DTYPE), S((groups, np_ // TILE, k // TILE), jnp.float32),
        S((groups,), jnp.int32),
    )
    return _mgpu.lower_for_cuda(
        lambda *a: grouped_scaled_matmul(*a, n=n, out_dtype=out_dtype, config=config), *args
    )


def _lower_wgrad(groups, t, n, k, out_dtype=jnp.float32, config=None):
    S, tp = jax.ShapeDtypeStruct, -(-t // TILE) * TILE
    args = (
        S((k, tp), FP8_DTYPE), S((k, tp // TILE), jnp.float32),
        S((n, tp), FP8_DTYPE), S((n, tp // TILE), jnp.float32),
        S((groups,), jnp.int32),
    )
    return _mgpu.lower_for_cuda(
        lambda *a: grouped_wgrad(*a, t=t, out_dtype=out_dtype, config=config), *args
    )


# (G, T, N, K, out_dtype): the benchmark shapes, then tails: odd T (rows padded for TMA), N not
# a multiple of 128 nor of 8, a tiny problem.
MATMUL_LOWERING_CASES = [
    (s.groups, s.groups * s.rows_per_group, s.n, s.k, jnp.bfloat16) for s in GROUPED_SHAPES
] + [
    (3, 1001, 100, 384, jnp.bfloat16),
    (5, 777, 4100, 256, jnp.float32),
    (1, 1, 1, 128, jnp.float32),
]

# (G, T, N, K, out_dtype): the Wgrad of the same layers ((K, N) = (in, out) features), then
# tails: T not a multiple of 128, K and N rows not multiples of 8 (padded for TMA), tiny sizes.
WGRAD_LOWERING_CASES = [
    (s.groups, s.groups * s.rows_per_group, s.n, s.k, jnp.float32) for s in GROUPED_SHAPES
] + [
    (3, 1001, 100, 203, jnp.bfloat16),
    (5, 777, 4100, 4, jnp.float32),
    (2, 1, 1, 1, jnp.float32),
]


@pytest.mark.parametrize("variant", ["chosen", *VARIANTS, "tall"])  # chosen: `tuning.grouped_config`
@pytest.mark.parametrize("groups,t,n,k,out_dtype", MATMUL_LOWERING_CASES)
def test_matmul_lowers_for_hopper(groups, t, n, k, out_dtype, variant):
    config = TALL if variant == "tall" else VARIANTS.get(variant)
    if variant == "tall" and out_dtype == jnp.float32:  # no room beside an f32 tile
        config = dataclasses.replace(config, tile_n=64)
    assert "mosaic_gpu" in _lower_matmul(groups, t, n, k, out_dtype, config)


@pytest.mark.parametrize("variant", ["chosen", "cluster-n", "early-scales", "lean"])  # b is tile-scaled
@pytest.mark.parametrize("groups,t,n,k,out_dtype", WGRAD_LOWERING_CASES)
def test_wgrad_lowers_for_hopper(groups, t, n, k, out_dtype, variant):
    assert "mosaic_gpu" in _lower_wgrad(groups, t, n, k, out_dtype, VARIANTS.get(variant))


def test_lowers_with_other_tilings():
    """The simple forms, and fast forms with other tiles, at the first benchmark shape."""
    s = GROUPED_SHAPES[0]
    shape = (s.groups, s.groups * s.rows_per_group, s.n, s.k)
    simple_deep = dataclasses.replace(SIMPLE, tile_m=128, max_concurrent_steps=4)
    for config in (SIMPLE, simple_deep, dataclasses.replace(FAST, tile_n=256, max_concurrent_steps=3)):
        assert "mosaic_gpu" in _lower_matmul(*shape, jnp.bfloat16, config)
    for config in (SIMPLE, dataclasses.replace(SIMPLE, tile_m=128, tile_n=32, max_concurrent_steps=3),
                   dataclasses.replace(FAST, tile_m=256, tile_n=64, max_concurrent_steps=3, persistent=False)):
        assert "mosaic_gpu" in _lower_wgrad(*shape, jnp.float32, config)


@pytest.mark.parametrize("config", [FAST, SIMPLE], ids=["fast", "simple"])
def test_lowering_rejects_a_config_over_the_smem_budget(config):
    """4 stages of (256 + 256) x 128 FP8 bytes plus a 256 x 256 f32 output tile: over 227 KiB."""
    config = dataclasses.replace(config, tile_m=256, tile_n=256, max_concurrent_steps=4)
    with pytest.raises(ValueError, match="shared memory"):
        _lower_wgrad(8, 4096, 4096, 7168, jnp.float32, config)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", [FAST, SIMPLE, *VARIANTS.values(), dataclasses.replace(TALL, tile_n=64)],
                         ids=["fast", "simple", *VARIANTS, "tall-64"])  # 64 wide: beside the Wgrad's f32 tile
def test_on_gpu_matches_reference(config):
    """Hardware sums each 128-chunk with ~14 bits: each kernel is held to the simulated
    accumulator's error on its own operands (`jfp8.accumulation`), against a CPU reference."""
    seed = _seed()
    # Sized for a GPU window (issue 42; 4000 rows x 1024 x 700 took the simulated bounds ~1 min a
    # config on one core): ragged groups over several row tiles, 8 K chunks through the stages.
    sizes = _sizes(np.random.default_rng(seed), 6, 1400)
    small = _sizes(np.random.default_rng(seed + 1), 6, 250)
    # Many rows, and few rows with the config `tuning.grouped_config` picks (config=None).
    for t, sizes_i, cfg in ((1500, sizes, config), (256, small, None)):
        lhs, rhs, sizes_j = _row_operands(seed, t, 900, 320, sizes_i, exact=False)
        out = np.asarray(_matmul(lhs, rhs, sizes_j, jnp.float32, cfg))
        ref = _on_cpu(_matmul_reference, lhs, rhs, sizes_j, jnp.float32)
        err, bound = rel_error(out, ref), grouped_hardware_error_bound(lhs, rhs, sizes_i)
        assert err <= bound, f"seed={seed} T={t}: Fprop error {err:.3e} > bound {bound:.3e}"

    lhs_t, rhs_t, sizes_j = _token_operands(seed, 1500, 256, 320, sizes, exact=False)
    out = np.asarray(_wgrad(lhs_t, rhs_t, sizes_j, jnp.float32, config))
    ref = _on_cpu(_wgrad_reference, lhs_t, rhs_t, sizes_j, jnp.float32)
    err, bound = rel_error(out, ref), grouped_wgrad_hardware_error_bound(lhs_t, rhs_t, sizes)
    assert err <= bound, f"seed={seed}: Wgrad error {err:.3e} > bound {bound:.3e}"
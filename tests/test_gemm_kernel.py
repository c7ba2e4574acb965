"""The Hopper tile-scaled GEMM kernel (`pallas_kernels.gemm`) against the reference GEMM.

On CPU the kernel runs in the Mosaic GPU interpreter, which fills every buffer it allocates (the
output included) with NaN, so a tile the kernel fails to write cannot pass an equality check;
lowering for CUDA then checks the Hopper limits the interpreter ignores (wgmma layouts, TMA
boxes and strides, the SMEM budget).

Comparison strength, found by experiment:
- Bit-identical (`_assert_bitwise_equal`) when every 128-element chunk product is exact in f32:
  data that are small integers (|q| <= 16, so |partial| <= 128 * 256 < 2**24), with the real
  scales of `jfp8.quantize`. Then only the promotion `out + partial * (sa * sb)`, its order over
  K chunks and the final cast can differ, and they are reproduced exactly.
- Relative Frobenius error <= 1e-6 for Gaussian data quantized by `jfp8.quantize`: a chunk
  product of general E4M3 values is not exact in f32, and the reference's XLA CPU dot sums it in
  an order that changes with the matrix shape (e.g. N=200 vs N=256), unlike the interpreter's
  per-tile matmul, so the last bit of some outputs differs. Those tests use f32 outputs, since a
  one-ulp f32 difference can flip a bf16 rounding.

Both launch structures are tested: `GemmConfig.simple()` and the default (warp-specialized,
persistent, grouped tile order). The interpreter runs the warp-specialized form as three
warpgroup threads with real mbarriers, and its race detector checks their synchronization; a
persistent CTA walks several tiles only when there are more tiles than SMs, so those tests
launch the kernel with a small SM count.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8.accumulation import hardware_error_bound
from jfp8.reference import rel_error
from jfp8.fp8 import Fp8Tensor, quantize
from jfp8.reference import scaled_matmul_reference
from pallas_kernels import gemm
from pallas_kernels._mainloop import tile_at
from pallas_kernels import configs
from pallas_kernels.configs import out_shape
from pallas_kernels.fp8_math import FP8_DTYPE, TILE
from pallas_kernels.shapes import DENSE_SHAPES
from helpers import assert_bitwise_equal as _assert_bitwise_equal
from helpers import on_cpu as _on_cpu
from tma_stores import interpret as _interpret  # fails on a store Hopper would spill
from tma_stores import interpret_detecting_races as _interpret_detecting_races

# The weight pairing (b_block_rows = 128, Fprop/Dgrad) and the tile pairing (1, Wgrad).
B_BLOCKS = {TILE: (TILE, TILE), 1: (1, TILE)}
# |q| <= 16: integers that E4M3 holds exactly, with chunk products exact in f32.
SMALL_INT = 16


# Jitted: eager dispatch compiles every small op per shape, which dominates these small tests.
_reference = jax.jit(scaled_matmul_reference, static_argnums=2)


@functools.partial(jax.jit, static_argnums=2)
def _quantize_pair(x, w, b_block_rows):
    return quantize(x, (1, TILE)), quantize(w, B_BLOCKS[b_block_rows])


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _operands(seed: int, m: int, n: int, k: int, b_block_rows: int, *, exact: bool):
    """(a, b) Fp8Tensors: a = quantize(x, (1, 128)), b = quantize(w, (128, 128) or (1, 128)).

    Rows of x and w get random magnitudes so that the scales vary. With `exact`, the data are
    replaced by small integers (zero in the padding, as quantize leaves it) under the same scales.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.normal(size=(m, 1)))
    w = rng.standard_normal((n, k)) * np.exp(rng.normal(size=(n, 1)))
    a, b = _quantize_pair(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), b_block_rows
    )
    if exact:
        a, b = (_small_int_data(t, rng) for t in (a, b))
    return a, b


def _small_int_data(t: Fp8Tensor, rng: np.random.Generator) -> Fp8Tensor:
    q = rng.integers(-SMALL_INT, SMALL_INT + 1, size=t.data.shape).astype(np.float32)
    rows, k = t.logical
    q[rows:, :] = 0
    q[:, k:] = 0
    return dataclasses.replace(t, data=jnp.asarray(q).astype(FP8_DTYPE))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _kernel(a: Fp8Tensor, b: Fp8Tensor, b_block_rows: int, out_dtype, config=None):
    return gemm.scaled_matmul(
        a.data, a.scale, b.data, b.scale,
        n=b.logical[0], b_block_rows=b_block_rows, out_dtype=out_dtype, config=config,
    )


SIMPLE = gemm.GemmConfig.simple()
FAST = gemm.GemmConfig()
CLUSTER = dataclasses.replace(FAST, cluster_m=2)  # 2-CTA clusters along M, b multicast
CLUSTER_N = dataclasses.replace(FAST, cluster_n=2)  # 2-CTA clusters along N, a multicast
SCALAR_B = dataclasses.replace(FAST, scalar_b_scale=True)  # b's block scale as one scalar
EARLY = dataclasses.replace(FAST, early_scale_loads=True)  # scales read before the wgmma
RUN_AHEAD = dataclasses.replace(FAST, run_ahead=True)  # one pipeline over a CTA's tiles
# The stage released right after the wgmma's wait, the proxy fence in the producer (issue 45).
LEAN = dataclasses.replace(FAST, early_scale_loads=True, lean_release=True)
# 128 x 192 tiles (over two weight blocks) with the scalar scale per 64-column slice; 2 stages
# leave room for an f32 output tile.
WIDE = dataclasses.replace(SCALAR_B, tile_n=192, max_concurrent_steps=2)
# 256-row tiles (DeepGEMM's 256 x 128): each consumer promotes its 128 rows in two 64-row waves
# through one accumulator; 3 stages leave room for the 64 KiB bf16 output tile.
TALL = dataclasses.replace(FAST, tile_m=256, max_concurrent_steps=3)
CONFIGS = {"simple": SIMPLE, "fast": FAST, "cluster": CLUSTER, "cluster-n": CLUSTER_N,
           "scalar-b": SCALAR_B, "early-scales": EARLY, "run-ahead": RUN_AHEAD, "wide": WIDE,
           "lean": LEAN, "tall": TALL}

# (M, N, K, b_block_rows, out_dtype): M/N tails within and past one tile, b with padded rows
# (N=200 and 136 under 128x128 blocks), K tails (K=200 -> 2 chunks), 1 and 4 chunks (more
# chunks than SMEM stages in the simple form).
EXACT_CASES = [
    (64, 128, 256, TILE, jnp.float32),
    (65, 200, 200, TILE, jnp.bfloat16),
    (65, 200, 200, 1, jnp.float32),
    (1, 24, 128, 1, jnp.bfloat16),
    (72, 136, 512, TILE, jnp.float32),
]


@pytest.mark.parametrize(
    "m,n,k,b_block_rows,out_dtype,config",
    [(*case, "simple") for case in EXACT_CASES]
    # The fast form's other combinations (tile-scaled b with f32 output, several chunks per
    # stage) are covered by the tests below.
    + [(*EXACT_CASES[1], "fast"), (*EXACT_CASES[3], "fast")]
    # the scalar b scale with block-scaled b, and tile-scaled b (which keeps the vector)
    + [(*EXACT_CASES[1], "scalar-b"), (*EXACT_CASES[2], "scalar-b")]
    + [(*EXACT_CASES[2], "early-scales"), (*EXACT_CASES[4], "early-scales")]
    + [(*EXACT_CASES[1], "run-ahead"), (*EXACT_CASES[4], "run-ahead")]
    + [(*EXACT_CASES[2], "lean"), (*EXACT_CASES[4], "lean")]
    # two waves per consumer: rows in both waves of both consumers, the last tile partial
    + [(300, 200, 384, TILE, jnp.bfloat16, "tall"), (*EXACT_CASES[1], "tall")],
)
def test_bit_identical_to_reference(m, n, k, b_block_rows, out_dtype, config):
    seed = _seed()
    a, b = _operands(seed, m, n, k, b_block_rows, exact=True)
    out = _interpret(_kernel, a, b, b_block_rows, out_dtype, CONFIGS[config])
    _assert_bitwise_equal(out, _reference(a, b, out_dtype), seed)


@pytest.mark.parametrize("config", ["fast", "scalar-b"])
def test_split_kernel_alone_is_the_whole_matmul(config):
    """The benchmark's kernel-only row: `split_scaled_matmul`'s operands, laid out eagerly outside
    the kernel's jit, then the kernel alone, give `scaled_matmul`'s bits (M = 65: a padded output
    sliced back; N = 200: b's last block partial)."""
    seed = _seed()
    m, n, k, b_block_rows, out_dtype = EXACT_CASES[1]
    a, b = _operands(seed, m, n, k, b_block_rows, exact=True)

    def split_then_run():
        operands, kernel = gemm.split_scaled_matmul(a.data, a.scale, b.data, b.scale, n=n, b_block_rows=b_block_rows,
                                                    out_dtype=out_dtype, config=CONFIGS[config])
        operands = jax.block_until_ready(operands)
        return jax.jit(kernel)(*operands), operands

    out, operands = _interpret(split_then_run)
    chunks = a.scale.shape[1]
    assert operands[2].shape == (chunks, 68)  # a's scales K-chunk-major, rows padded to 16 bytes
    assert out.shape == (m, n)
    _assert_bitwise_equal(out, _reference(a, b, out_dtype), seed)


def _call_detecting_races(config, m, n, b_block_rows, num_sms, seed, chunks=3):
    """The kernel on `chunks` K chunks of exact operands, launched on `num_sms` CTAs (None: one
    per tile) in the interpreter with the race detector on: (output [m, n] f32, races, a, b)."""
    a, b = _operands(seed, m, n, chunks * TILE, b_block_rows, exact=True)
    scalar_b = config.scalar_b and b_block_rows == TILE
    operands = gemm._kernel_operands(a.data, a.scale, b.data, b.scale, n, b_block_rows, scalar_b, config.tile_n)
    shape = out_shape(m, n, jnp.float32, config)
    tiles = (-(-m // config.tile_m), -(-n // config.tile_n))
    call = gemm._gemm_call(shape, jnp.float32, config, tiles, num_sms=num_sms, scalar_b=scalar_b)
    out, races = _interpret_detecting_races(call, *operands)
    return np.asarray(out)[:m, :n], races, a, b


LEAN_RACE_CASES = {
    # Several tiles per CTA over 2 stages (3 chunks a tile: stages reused across tiles); b's
    # block scale as a scalar box ...
    "ws": (dataclasses.replace(LEAN, max_concurrent_steps=2, grid_tile_group=2), 200, 200, TILE, 3),
    # ... and a tile-scaled b (Wgrad operands): a per-column scale vector read from the stage.
    "ws-tile-scaled-b": (dataclasses.replace(LEAN, max_concurrent_steps=2, grid_tile_group=2), 200, 200, 1, 3),
    # Clusters: the "consumed" cluster barrier, and refills multicast into both CTAs' stages.
    "cluster-m": (dataclasses.replace(LEAN, cluster_m=2, max_concurrent_steps=2, grid_tile_group=2),
                  330, 200, TILE, 2),
    "cluster-n": (dataclasses.replace(LEAN, cluster_n=2, max_concurrent_steps=2), 200, 330, TILE, 2),
    # The rule's 128 x 192 tiles along M: two blocks' scales per K step.
    "rule-192-cluster-m": (dataclasses.replace(LEAN, tile_n=192, cluster_m=2, max_concurrent_steps=2),
                           330, 500, TILE, 4),
    # 256-row tiles: the stage released after the second wave's wait; a tile-scaled b.
    "256-rows": (dataclasses.replace(LEAN, tile_m=256, tile_n=64, max_concurrent_steps=2), 300, 200, 1, 3),
}


@pytest.mark.parametrize("case", LEAN_RACE_CASES)
def test_lean_release_is_bit_identical_without_races(case):
    """`lean_release`: each consumer arrives on a stage's "consumed" barrier right after its
    wgmma's wait, with the scales already in registers and no fence of its own; the producer
    fences before the refill. Bit-identical, and the race detector finds nothing."""
    config, m, n, b_block_rows, num_sms = LEAN_RACE_CASES[case]
    seed = _seed()
    out, races, a, b = _call_detecting_races(config, m, n, b_block_rows, num_sms, seed)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _reference(a, b, jnp.float32), seed)


def test_lean_release_needs_the_producers_proxy_fence(monkeypatch, capsys):
    """Without any proxy fence (DeepGEMM's loop: none on the consumers, none on the producer)
    the race detector reports the refills' TMA writes (async proxy) as racing with the
    consumers' scale loads (generic proxy), and nothing else: the fp8 tiles are read by the
    wgmma (async proxy), ordered by its wait and the mbarriers alone. The bits are the same."""
    from pallas_kernels import _mainloop

    monkeypatch.setattr(_mainloop, "_producer_fence", lambda: None)
    config, m, n, b_block_rows, num_sms = LEAN_RACE_CASES["ws"]
    seed = _seed()
    out, races, a, b = _call_detecting_races(config, m, n, b_block_rows, num_sms, seed)
    report = capsys.readouterr().out
    reads = [line for line in report.splitlines() if line.strip().startswith("read of")]
    assert races and reads, report[-2000:]
    assert all("_load_scales" in line for line in reads), reads
    assert report.count("RACE DETECTED") == len(reads)
    _assert_bitwise_equal(out, _reference(a, b, jnp.float32), seed)


@pytest.mark.parametrize(
    "config,k",
    [
        # tile_m=128 in one warpgroup (two wgmma row blocks), tile_n=64, no TMA overlap.
        (dataclasses.replace(SIMPLE, tile_m=128, tile_n=64, max_concurrent_steps=1), 256),
        # Warp-specialized on its own: one CTA per tile, 64-wide tiles, 2 stages for 3 chunks.
        (gemm.GemmConfig(tile_n=64, max_concurrent_steps=2, persistent=False), 300),
        # 2-CTA clusters on 64-wide tiles (b's 64-row chunk multicast in halves of 32), tile-scaled b.
        (dataclasses.replace(CLUSTER, tile_n=64, max_concurrent_steps=2), 300),
    ],
    ids=["one-warpgroup-128x64", "ws-not-persistent", "cluster-64"],
)
def test_bit_identical_with_other_tilings(config, k):
    seed = _seed()
    a, b = _operands(seed, 130, 100, k, 1, exact=True)
    out = _interpret(_kernel, a, b, 1, jnp.float32, config)
    _assert_bitwise_equal(out, _reference(a, b, jnp.float32), seed)


@pytest.mark.parametrize(
    "config",
    [
        dataclasses.replace(SCALAR_B, tile_n=64),  # two column tiles per weight block
        dataclasses.replace(SIMPLE, scalar_b_scale=True, tile_n=32),  # one warpgroup, four
        dataclasses.replace(CLUSTER, scalar_b_scale=True, tile_n=32, max_concurrent_steps=2),
        dataclasses.replace(SIMPLE, scalar_b_scale=True, early_scale_loads=True),
        dataclasses.replace(SCALAR_B, early_scale_loads=True, cluster_m=2),
        # clusters along N: the two CTAs' column tiles in one block (64) or in two blocks (128)
        dataclasses.replace(CLUSTER_N, scalar_b_scale=True, tile_n=64, max_concurrent_steps=2),
        dataclasses.replace(CLUSTER_N, scalar_b_scale=True, early_scale_loads=True, persistent=False),
        # tiles over two blocks, promoted in slices: 192 = 3 x 64 (tile 1 starts mid-block) ...
        dataclasses.replace(SCALAR_B, tile_n=192, max_concurrent_steps=2),
        dataclasses.replace(SCALAR_B, tile_n=192, max_concurrent_steps=2, early_scale_loads=True,
                            cluster_n=2, run_ahead=True),
        # ... and 256 = 2 x 128 (one warpgroup: two 128 x 256 f32 stages and tile leave no room)
        dataclasses.replace(SIMPLE, scalar_b_scale=True, tile_n=256),
    ],
    ids=["ws-64", "one-warpgroup-32", "cluster-32", "one-warpgroup-early", "cluster-early",
         "cluster-n-64", "cluster-n-128-early", "ws-192", "ws-192-cluster-n-early-run-ahead",
         "one-warpgroup-256"],
)
def test_scalar_b_scale_picks_each_tiles_block(config):
    """With `scalar_b_scale` each column tile reads the scale of the weight block it lies in
    (tile ni in block ni // (128 / tile_n)), or a wider tile each 64- or 128-column slice's
    block; N = 300 ends inside a third, partial block."""
    seed = _seed()
    a, b = _operands(seed, 330, 300, 384, TILE, exact=True)
    out = _interpret(_kernel, a, b, TILE, jnp.float32, config)
    _assert_bitwise_equal(out, _reference(a, b, jnp.float32), seed)


@pytest.mark.parametrize(
    "m,n,k,b_block_rows,config",
    [(96, 160, 300, TILE, "simple"), (40, 72, 256, 1, "simple"), (96, 160, 300, TILE, "fast")],
)
def test_quantized_gaussian_matches_reference(m, n, k, b_block_rows, config):
    seed = _seed()
    a, b = _operands(seed, m, n, k, b_block_rows, exact=False)
    out = np.asarray(_interpret(_kernel, a, b, b_block_rows, jnp.float32, CONFIGS[config]))
    ref = np.asarray(_reference(a, b, jnp.float32))
    assert out.shape == (m, n)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= 1e-6, f"seed={seed}: relative Frobenius error {err}"


def test_interpreter_poisons_unwritten_output():
    """A launch that covers only the first of two row tiles leaves the second tile NaN.

    This is what makes the equality tests above meaningful: an output tile the kernel forgot to
    store would be NaN, never an accidentally right value.
    """
    seed = _seed()
    config = SIMPLE
    m, n = 2 * config.tile_m, config.tile_n
    a, b = _operands(seed, m, n, TILE, 1, exact=True)
    operands = gemm._kernel_operands(a.data, a.scale, b.data, b.scale, n, 1)
    call = gemm._gemm_call((m, n), jnp.float32, config, tiles=(1, 1))
    out = np.asarray(_interpret(call, *operands))
    ref = np.asarray(_reference(a, b, jnp.float32))
    _assert_bitwise_equal(out[: config.tile_m], ref[: config.tile_m], seed)
    assert np.isnan(out[config.tile_m :]).all()


@pytest.mark.parametrize(
    "config,m,n,num_sms",
    [
        # 2 x 2 tiles of 128 x 128 on 3 CTAs: CTA 0 computes two tiles, reusing its stages (3
        # chunks over 2 stages) and output tile; the last row and column tiles are partial.
        (dataclasses.replace(FAST, max_concurrent_steps=2, grid_tile_group=2), 200, 200, 3),
        # The one-warpgroup persistent form: 3 x 2 tiles of 64 x 128 on 4 CTAs.
        (dataclasses.replace(SIMPLE, persistent=True, grid_tile_group=2), 130, 200, 4),
        # 2-CTA clusters: 3 row tiles (odd: the last cluster's second CTA computes a tile wholly
        # past M) x 2 column tiles = 2 x 2 cluster tiles, on 1 persistent cluster (2 "SMs") ...
        (dataclasses.replace(CLUSTER, max_concurrent_steps=2, grid_tile_group=2), 330, 200, 2),
        # ... and one cluster per cluster tile.
        (dataclasses.replace(CLUSTER, max_concurrent_steps=2, persistent=False), 330, 200, None),
        # The promotion variants: the scalar b scale read before the wgmma, in clusters.
        (dataclasses.replace(CLUSTER, max_concurrent_steps=2, scalar_b_scale=True, early_scale_loads=True),
         330, 200, 2),
        # Clusters along N: 2 row tiles x 3 column tiles (odd: the last cluster's second CTA
        # computes a tile wholly past N) = 2 x 2 cluster tiles, a multicast, persistent and not.
        (dataclasses.replace(CLUSTER_N, max_concurrent_steps=2, grid_tile_group=2), 200, 330, 2),
        (dataclasses.replace(CLUSTER_N, max_concurrent_steps=2, persistent=False), 200, 330, None),
        # One pipeline over each CTA's tiles: 3 row x 2 column tiles on 4 CTAs (2, 2, 1, 1 tiles),
        # the producer loading a tile's chunks while the consumers finish the previous tile ...
        (dataclasses.replace(RUN_AHEAD, max_concurrent_steps=2, grid_tile_group=2), 330, 200, 4),
        # ... with every variant on top, in clusters along M and along N.
        (dataclasses.replace(RUN_AHEAD, max_concurrent_steps=2, cluster_m=2, scalar_b_scale=True,
                             early_scale_loads=True), 330, 200, 2),
        (dataclasses.replace(RUN_AHEAD, cluster_n=2), 200, 330, 2),  # 4 stages, 3 K steps a tile
        # The tuning rule's 128 x 192 tiles in clusters along M (b's chunk and box multicast):
        # 3 row tiles x 3 column tiles, the third over a partial block, on 2 persistent clusters.
        (dataclasses.replace(FAST, tile_n=192, cluster_m=2, max_concurrent_steps=2,
                             scalar_b_scale=True), 330, 500, 4),
        # 256-row tiles in clusters along N (DeepGEMM's layout; 64 wide here, for the f32 output
        # tile): 3 row tiles x 4 column tiles on 2 persistent clusters, two 64-row waves per
        # consumer (the interpreter gives each wave an accumulator of its own; the lowered
        # kernel's shared one is checked by the deviceless build and on hardware).
        (dataclasses.replace(FAST, tile_m=256, tile_n=64, cluster_n=2, max_concurrent_steps=2),
         600, 200, 4),
    ],
    ids=["ws", "one-warpgroup", "cluster-persistent", "cluster", "cluster-scalar-early",
         "cluster-n-persistent", "cluster-n", "run-ahead", "run-ahead-cluster-scalar-early",
         "run-ahead-cluster-n", "rule-192-cluster", "256-rows-cluster-n"],
)
def test_persistent_ctas_walk_every_tile_without_races(config, m, n, num_sms):
    """CTAs that each own several tiles write every output element (the outputs start as NaN),
    bit-identical to the reference, and the race detector finds no unordered access between the
    producer, the consumers, TMA and the reused SMEM."""
    seed = _seed()
    a, b = _operands(seed, m, n, 3 * TILE, TILE, exact=True)
    scalar_b = config.scalar_b_scale  # b is block-scaled here
    operands = gemm._kernel_operands(a.data, a.scale, b.data, b.scale, n, TILE, scalar_b, config.tile_n)
    shape = out_shape(m, n, jnp.float32, config)
    tiles = (-(-m // config.tile_m), -(-n // config.tile_n))
    call = gemm._gemm_call(shape, jnp.float32, config, tiles, num_sms=num_sms, scalar_b=scalar_b)
    out, races = _interpret_detecting_races(call, *operands)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(np.asarray(out)[:m, :n], _reference(a, b, jnp.float32), seed)


@pytest.mark.parametrize("static_buffers", [True, False])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_static_slot_rounds_visit_each_step_once_in_its_slot(monkeypatch, stages, static_buffers):
    """`_static_slot_chunks` (the consumers' K loop: a first loop to the next round of the
    stages, rounds with static slots, the steps left over) calls its chunk once per step, in
    order, each in slot step % stages with that stage's barrier, from any starting step (the
    step counter runs on across a CTA's tiles) and for any K loop length, 1 to 3 rounds."""
    from pallas_kernels import _mainloop, _mgpu

    monkeypatch.setattr(_mgpu, "interpreting", lambda: True)  # no accumulator outside a kernel
    span = 4 * stages + 2

    def chunk(k, carry, slot=None, chain=None, buf_slot=None, waited=False):
        del k, chain
        step, (seen, start) = carry
        barrier = jax.lax.rem(step, stages) if slot is None else slot
        buf = barrier if buf_slot is None else buf_slot
        row = jnp.stack([step, jnp.int32(barrier), jnp.int32(buf), jnp.int32(waited)])
        return step + 1, (seen.at[step - start].set(row), start)

    @jax.jit
    def visit(start, k_steps):
        seen = jnp.full((span, 4), -1, jnp.int32)
        step, (seen, _) = _mainloop._static_slot_chunks(chunk, lambda s: None, (start, (seen, start)),
                                                        k_steps, stages, (64, 128), static_buffers=static_buffers)
        return step, seen

    for start in range(0, 2 * stages + 1):
        for k_steps in range(1, 3 * stages + 2):
            step, seen = map(np.asarray, visit(jnp.int32(start), jnp.int32(k_steps)))
            assert step == start + k_steps
            # A round's first chunk finds its stage waited for (before the round's accumulator);
            # every other chunk waits itself.
            head = min((stages - start % stages) % stages, k_steps)
            in_rounds = range(start + head, start + head + (k_steps - head) // stages * stages)
            want = np.array([[s, s % stages, s % stages, int(s in in_rounds and s % stages == 0)]
                             for s in range(start, start + k_steps)])
            np.testing.assert_array_equal(seen[:k_steps], want, err_msg=f"start={start} k_steps={k_steps}")
            assert (seen[k_steps:] == -1).all()


@pytest.mark.parametrize(
    "config,m,n,chunks,num_sms",
    [
        # 3 stages, 7 K chunks a tile, 3 tiles on one CTA: tiles start at steps 0, 7 and 14
        # (slots 0, 1, 2), so the rounds of static slots start after 0, 2 and 1 steps and
        # leave 1, 2 and 0 over.
        (dataclasses.replace(FAST, max_concurrent_steps=3, tile_n=64), 100, 150, 7, 1),
        # The lean release, 256-row tiles: two 64-row waves a chunk (one accumulator for a
        # round's waves when lowered; the interpreter gives each its own).
        (dataclasses.replace(LEAN, max_concurrent_steps=3, tile_m=256, tile_n=64), 300, 100, 5, 1),
    ],
    ids=["3-stages-7-chunks", "lean-256-rows-5-chunks"],
)
def test_k_loops_of_any_length_from_any_slot(config, m, n, chunks, num_sms):
    """The consumers' K loop from every slot a tile can start at, over more chunks than stages:
    bit-identical to the reference, no races."""
    seed = _seed()
    out, races, a, b = _call_detecting_races(config, m, n, TILE, num_sms, seed, chunks=chunks)
    assert not races, f"seed={seed}: see the RACE DETECTED report in the captured stdout"
    _assert_bitwise_equal(out, _reference(a, b, jnp.float32), seed)


@pytest.mark.parametrize(
    "tiles,group", [((1, 1), 8), ((5, 7), 2), ((16, 2), 8), ((3, 9), 8)]
)
def test_tile_order_visits_every_tile_once(tiles, group):
    """The grouped order is a permutation of the tiles, and consecutive tile numbers (CTAs that
    run together) stay within one group of `group` row tiles."""
    config = dataclasses.replace(FAST, grid_tile_group=group)
    lin = jnp.arange(tiles[0] * tiles[1], dtype=jnp.int32)
    mi, ni = jax.jit(jax.vmap(lambda i: tile_at(i, tiles, config)))(lin)
    order = list(zip(np.asarray(mi).tolist(), np.asarray(ni).tolist()))
    assert sorted(order) == [(i, j) for i in range(tiles[0]) for j in range(tiles[1])]
    g = min(group, tiles[0])
    for k, (i, _) in enumerate(order):
        assert i // g == min(k // (g * tiles[1]), (tiles[0] - 1) // g), (k, order)


@pytest.mark.parametrize("m,n,kp", [(0, 16, 128), (16, 0, 128), (0, 0, 128), (4, 16, 0)])
def test_empty_problem_returns_zeros_without_launch(m, n, kp):
    """Outside the interpreter: a launch on this CPU would raise "Only interpret mode..."."""
    chunks = kp // TILE
    out = gemm.scaled_matmul(
        jnp.zeros((m, kp), FP8_DTYPE), jnp.ones((m, chunks), jnp.float32),
        jnp.zeros((n, kp), FP8_DTYPE), jnp.ones((n, chunks), jnp.float32),
        n=n, b_block_rows=1, out_dtype=jnp.float32,
    )
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert not np.asarray(out).any()


def _valid_args():
    return dict(
        a_data=jnp.zeros((8, 256), FP8_DTYPE),
        a_scale=jnp.ones((8, 2), jnp.float32),
        b_data=jnp.zeros((128, 256), FP8_DTYPE),
        b_scale=jnp.ones((1, 2), jnp.float32),
        n=100,
        b_block_rows=TILE,
    )


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(a_data=jnp.zeros((8, 256), jnp.bfloat16)), TypeError, "a_data must be"),
        (dict(b_data=jnp.zeros((128, 256), jnp.float8_e5m2)), TypeError, "b_data must be"),
        (dict(a_scale=jnp.ones((8, 2), jnp.bfloat16)), TypeError, "a_scale must be float32"),
        (dict(out_dtype=jnp.float16), ValueError, "out_dtype"),
        (dict(b_block_rows=64), ValueError, "b_block_rows"),
        (
            dict(a_data=jnp.zeros((8, 200), FP8_DTYPE), b_data=jnp.zeros((128, 200), FP8_DTYPE)),
            ValueError,
            "multiple of 128",
        ),
        (dict(b_data=jnp.zeros((128, 384), FP8_DTYPE)), ValueError, "Kp differs"),
        (dict(n=129), ValueError, "n must be"),
        (dict(a_scale=jnp.ones((8, 3), jnp.float32)), ValueError, "a_scale must have shape"),
        (dict(b_scale=jnp.ones((128, 2), jnp.float32)), ValueError, "b_scale must have shape"),
        (dict(b_block_rows=1), ValueError, "b_scale must have shape"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    args = _valid_args() | change
    with pytest.raises(error, match=match):
        gemm.scaled_matmul(**args)


@pytest.mark.parametrize(
    "fields",
    [
        dict(tile_m=96),
        dict(tile_m=512),
        dict(tile_m=64),  # warp-specialized: 64 rows for each of 2 consumer warpgroups at least
        dict(tile_m=192),
        dict(tile_n=8),
        dict(tile_n=320),
        dict(max_concurrent_steps=0),
        dict(grid_tile_group=0),
        dict(cluster_m=3),
        dict(cluster_m=0),
        dict(cluster_m=2, tile_m=64, warp_specialized=False),  # the simple pipeline cannot multicast
        dict(cluster_n=3),
        dict(cluster_n=2, tile_m=64, warp_specialized=False),
        dict(cluster_m=2, cluster_n=2),  # a 2 x 2 cluster is not built
        dict(scalar_b_scale=True, tile_n=160),  # slices of 32 columns: not built
        dict(scalar_b_scale=True, tile_n=48),
        dict(tile_n=16),  # its 64-byte column-scale slot would misalign TMA's next slot
        dict(tile_n=48),
        dict(run_ahead=True, persistent=False),  # one tile per CTA: nothing to run ahead into
        dict(run_ahead=True, tile_m=64, warp_specialized=False),
        dict(lean_release=True),  # the scales must be in registers before the stage is released
        dict(lean_release=True, early_scale_loads=True, run_ahead=True),  # jax's pipeline releases
        dict(lean_release=True, early_scale_loads=True, tile_m=64, warp_specialized=False),
    ],
)
def test_invalid_config_raises(fields):
    with pytest.raises(ValueError):
        gemm.GemmConfig(**fields)


LOWERING_CASES = (
    [(s.m, s.n, s.k, TILE, jnp.bfloat16) for s in DENSE_SHAPES]
    + [(s.m, s.n, s.k, 1, jnp.float32) for s in DENSE_SHAPES[:2]]
    + [
        (1, 1, 128, 1, jnp.bfloat16),
        (65, 200, 384, TILE, jnp.float32),
        (3, 201, 200, 1, jnp.bfloat16),
        (129, 13, 128, TILE, jnp.float32),
        (4097, 2111, 7168, TILE, jnp.bfloat16),
    ]
)


@pytest.mark.parametrize(
    "m,n,k,b_block_rows,out_dtype,config",
    # 256 x 128 tiles leave no room for a second stage beside an f32 output tile (ws-tall below)
    [(*case, config) for case in LOWERING_CASES for config in CONFIGS
     if not (config == "tall" and case[-1] == jnp.float32)],
)
def test_lowers_for_hopper(m, n, k, b_block_rows, out_dtype, config):
    text = gemm.lower_scaled_matmul(
        m, n, k, b_block_rows=b_block_rows, out_dtype=out_dtype, config=CONFIGS[config]
    )
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("config", [dataclasses.replace(SCALAR_B, tile_n=192),
                                    dataclasses.replace(SCALAR_B, tile_n=256, max_concurrent_steps=3)],
                         ids=["192x4", "256x3"])
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=str)
def test_wide_tiles_lower_at_the_benchmark_shapes(shape, config):
    """The forms the bisect rows time (bf16 output, as many stages as fit)."""
    text = gemm.lower_scaled_matmul(shape.m, shape.n, shape.k, b_block_rows=TILE,
                                    out_dtype=jnp.bfloat16, config=config)
    assert "mosaic_gpu" in text


# Each change of the fast form alone.
PARTIAL_CONFIGS = {
    "deeper-pipeline": dataclasses.replace(SIMPLE, tile_m=128, max_concurrent_steps=4),
    "ws-only": dataclasses.replace(SIMPLE, tile_m=128, warp_specialized=True),
    "persistent-grouped-only": dataclasses.replace(SIMPLE, persistent=True, grid_tile_group=8),
    "ws-cluster-only": dataclasses.replace(SIMPLE, tile_m=128, warp_specialized=True, cluster_m=2),
    "ws-cluster-n-only": dataclasses.replace(SIMPLE, tile_m=128, warp_specialized=True, cluster_n=2),
}


@pytest.mark.parametrize("config", PARTIAL_CONFIGS)
def test_each_change_lowers_for_hopper(config):
    text = gemm.lower_scaled_matmul(
        4097, 2111, 7168, b_block_rows=1, out_dtype=jnp.float32, config=PARTIAL_CONFIGS[config]
    )
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "config,out_dtype,chunks",
    [
        (FAST, jnp.float32, 56),
        (dataclasses.replace(FAST, tile_n=96), jnp.bfloat16, 2),  # 2 of the 4 stages allocated
        (gemm.GemmConfig(256, 32, 3, warp_specialized=False, persistent=False), jnp.float32, 9),
        (CLUSTER, jnp.bfloat16, 7),  # cluster barriers are mbarriers too
        (CLUSTER_N, jnp.float32, 3),
        (dataclasses.replace(SCALAR_B, tile_n=64), jnp.float32, 5),  # a 128-byte b-scale box
        (RUN_AHEAD, jnp.bfloat16, 2),  # a dynamic grid allocates all 4 stages for 2 K steps
    ],
)
def test_smem_estimate_equals_mosaic_count(config, out_dtype, chunks, monkeypatch):
    """`gemm.smem_bytes` is Mosaic GPU's own count: with the budget set to it the kernel lowers,
    one byte less and Mosaic rejects it (its bound is lowered through a private knob)."""
    from jax.experimental.mosaic.gpu import core as mosaic_core

    need = gemm.smem_bytes(config, out_dtype, chunks)
    lower = functools.partial(
        gemm.lower_scaled_matmul, 512, 512, chunks * TILE, b_block_rows=TILE,
        out_dtype=out_dtype, config=config,
    )
    monkeypatch.setattr(configs, "SMEM_BYTES", 2 * need)  # let `check_smem` pass: test Mosaic's
    monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", need)
    assert "mosaic_gpu" in lower()
    monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", need - 1)
    with pytest.raises(ValueError, match=f"smem_bytes={need} "):
        lower()


@pytest.mark.parametrize(
    "config",
    [
        gemm.GemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=4, warp_specialized=False),
        gemm.GemmConfig(tile_n=256, max_concurrent_steps=4),
        gemm.GemmConfig(max_concurrent_steps=5),  # 5 x 33 KiB + a 64 KiB f32 tile
        gemm.GemmConfig(tile_m=256, max_concurrent_steps=2),  # 2 x 49 KiB + a 128 KiB f32 tile
    ],
    ids=["one-warpgroup", "ws-wide", "ws-deep", "ws-tall"],
)
def test_a_config_over_the_smem_budget_is_rejected(config):
    """Rejected before lowering, so in the interpreter (which has no SMEM limit) too."""
    with pytest.raises(ValueError, match="shared memory.*lower max_concurrent_steps"):
        gemm.lower_scaled_matmul(
            4096, 4096, 7168, b_block_rows=TILE, out_dtype=jnp.float32, config=config
        )
    a, b = _operands(_seed(), 8, 16, 7 * TILE, TILE, exact=True)
    with pytest.raises(ValueError, match="shared memory"):
        _interpret(_kernel, a, b, TILE, jnp.float32, config)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a Hopper GPU")
@pytest.mark.parametrize("b_block_rows", [TILE, 1])
@pytest.mark.parametrize(
    "config,m,n,k",
    # Every form with tails in M, N and K and more K chunks (9) than any form's stages (the rings
    # wrap); the library's own choice (`tuning.dense_config`) also at a small-M DeepSeek-V3 shape.
    # Sized for a GPU window (issue 42): 1000 x 1500 x 2000 took its simulated bound ~30 s a
    # test on one core, and `pytest -m gpu` never finished inside its stage.
    [*((c, 300, 400, 1100) for c in CONFIGS), ("chosen", 300, 400, 1100), ("chosen", 48, 2112, 7168)],
)
def test_on_gpu_matches_reference(m, n, k, b_block_rows, config):
    seed = _seed()
    a, b = _operands(seed, m, n, k, b_block_rows, exact=False)
    cfg = CONFIGS.get(config)
    if config == "tall":  # the waves' shared accumulator on hardware, 64 wide beside an f32 tile
        cfg = dataclasses.replace(cfg, tile_n=64)
    out = np.asarray(_kernel(a, b, b_block_rows, jnp.float32, cfg))
    ref = _on_cpu(_reference, a, b, jnp.float32)
    # The tensor core sums each 128-chunk with ~14 bits, not f32: bit-exactness is the
    # interpreter's, and hardware is held to the simulated accumulator's error (with margin).
    err, bound = rel_error(out, ref), hardware_error_bound(a, b)
    assert err <= bound, f"seed={seed}: relative Frobenius error {err:.3e} > bound {bound:.3e}"


def test_interpreting_a_cluster_with_few_cpu_devices_warns(monkeypatch):
    """With fewer CPU devices than `_mgpu.INTERPRET_CLUSTER_CPU_DEVICES` the interpreter deadlocked
    on 2-CTA clusters refilling 4 stages (2026-11-28): tracing such a kernel for the interpreter
    says so and how to avoid it; without clusters, or with enough devices, it says nothing."""
    from pallas_kernels import _mgpu

    a, b = _operands(_seed(), 130, 100, 300, 1, exact=True)
    # Configs no other test traces, so that the kernel is built here and not taken from jit's cache.
    clustered = dataclasses.replace(CLUSTER, grid_tile_group=5)
    alone = dataclasses.replace(FAST, grid_tile_group=5)
    with _mgpu.interpret_mode(True):
        monkeypatch.setattr(_mgpu, "INTERPRET_CLUSTER_CPU_DEVICES", len(jax.devices("cpu")) + 1)
        with pytest.warns(RuntimeWarning, match="xla_force_host_platform_device_count"):
            _kernel.trace(a, b, 1, jnp.float32, clustered)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _kernel.trace(a, b, 1, jnp.float32, alone)
            monkeypatch.setattr(_mgpu, "INTERPRET_CLUSTER_CPU_DEVICES", len(jax.devices("cpu")))
            _kernel.trace(a, b, 1, jnp.float32, dataclasses.replace(clustered, grid_tile_group=6))


def test_tma_slots_are_128_byte_multiples():
    """cp.async.bulk.tensor needs a 128-byte aligned SMEM address: a ring of 16-byte slots (the
    scalar b scale's box until 2026-11-26) faulted from slot 1 on an H100, which neither the
    interpreter nor ptxas can see. The check rejects such a slot; the scale box fills one."""
    from pallas_kernels import _hopper

    _hopper.check_tma_slot("box", (_hopper.SCALE_BOX,), jnp.float32)
    _hopper.check_tma_slot("tile", (64, TILE), jnp.float8_e4m3fn)
    for shape in [(4,), (16,), (48,)]:
        with pytest.raises(ValueError, match="multiple of 128"):
            _hopper.check_tma_slot("scales", shape, jnp.float32)

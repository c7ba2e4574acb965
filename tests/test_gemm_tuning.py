"""`pallas_kernels.tuning`: the config the dense GEMM runs when the caller gives none.

The choice may only move speed: every config it can return must be valid, fit the SMEM budget,
lower for Hopper, and compute the reference's bits (the interpreter runs the small-M forms).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import gemm, tuning
from pallas_kernels._mgpu import H100_DEVICE_KIND, H100_NUM_SMS
from pallas_kernels.fp8_math import TILE
from pallas_kernels.configs import SMEM_BYTES, GroupedGemmConfig
from pallas_kernels._hopper import WGMMA_M
from pallas_kernels.shapes import (
    DENSE_SHAPES,
    GROUPED_SHAPES,
    SMALL_GROUPED_SHAPES,
    SMALL_M_SHAPES,
)
from test_gemm_kernel import _kernel, _operands, _reference, _seed
from helpers import assert_bitwise_equal, interpret

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hopper"))

FAST = gemm.GemmConfig()


@pytest.fixture(autouse=True)
def _no_table(monkeypatch, tmp_path):
    """Tests see no measured table unless they write one (a committed table must not change
    what the rule tests check)."""
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "no-table.json"))
    monkeypatch.setenv(tuning.GROUPED_TABLE_ENV, str(tmp_path / "no-grouped-table.json"))


# The rule's picks at the benchmark shapes (bf16 output, block-scaled b): tile_m, tile_n,
# cluster_m, cluster_n: DeepGEMM's choice at every dense shape (128 x 192 along M at
# 4096 x 2112 x 7168, 256 x 128 along N elsewhere); for the grouped kernels, which have no
# clusters along M, 256 x 128 along N (DeepGEMM: 128 x 192 along M).
DENSE_PICKS = {
    (4096, 2112, 7168): (128, 192, 2, 1),
    (4096, 24576, 1536): (256, 128, 1, 2),
    (4096, 7168, 16384): (256, 128, 1, 2),
    (4096, 4096, 7168): (256, 128, 1, 2),
    (4096, 7168, 2048): (256, 128, 1, 2),
    (8192, 8192, 8192): (256, 128, 1, 2),
}
GROUPED_PICKS = {shape: (256, 128, 1, 2) for shape in GROUPED_SHAPES}
# The benchmark shapes where the pick's modelled L2 bytes per FLOP are no more than those of
# DeepGEMM's choice, modelled the same way (issue 45's target): all of them. A shape that stops
# meeting it fails here until this and the docs are updated.
L2_TARGET_MET = {tuple(s) for s in DENSE_SHAPES}
WAVE_EFFICIENCY_TARGET = 0.88


def _layout(config) -> tuple[int, int, int, int]:
    lay = tuning.Layout.of(config)
    return lay.tile_m, lay.tile_n, lay.cluster_m, lay.cluster_n


def _deepgemm(m, n, k, groups=1):
    """DeepGEMM's SM90 choice at this shape on 132 SMs (`benchmarks/hopper/anchors.py` re-derives
    its heuristic), as a `tuning.Layout`."""
    import anchors

    kind = "Normal" if groups == 1 else "MGroupedContiguous"
    c = anchors.deepgemm_config(m, n, k, groups, kind, num_sms=H100_NUM_SMS)["chosen"]
    return tuning.Layout(c["block_m"], c["block_n"], c["cluster_m"], c["cluster_n"])


@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=str)
def test_rule_picks_at_the_benchmark_shapes(shape):
    config = tuning.rule_config(*shape, jnp.bfloat16, H100_NUM_SMS)
    assert _layout(config) == DENSE_PICKS[tuple(shape)]
    got = tuning.modelled(config, *shape, H100_NUM_SMS)
    assert got.wave_efficiency >= WAVE_EFFICIENCY_TARGET
    # never slower in the model than the 128 x 128 default it replaces
    assert got.cycles <= tuning.modelled(FAST, *shape, H100_NUM_SMS).cycles
    deepgemm = tuning.modelled(_deepgemm(*shape), *shape, H100_NUM_SMS)
    assert (got.l2_bytes_per_flop <= deepgemm.l2_bytes_per_flop) == (tuple(shape) in L2_TARGET_MET)
    # f32 output and a tile-scaled b (Wgrad): the same kind of choice, within what fits
    for out_dtype, scalar_b in ((jnp.float32, True), (jnp.bfloat16, False)):
        other = tuning.rule_config(*shape, out_dtype, H100_NUM_SMS, scalar_b=scalar_b)
        assert tuning.Layout.of(other) in tuning.DENSE_LAYOUTS and (scalar_b or other.tile_n <= TILE)
    # and they lower, through the front door's choice (config=None), with either b
    for b_block_rows in (TILE, 1):
        assert "mosaic_gpu" in gemm.lower_scaled_matmul(*shape, b_block_rows=b_block_rows,
                                                        out_dtype=jnp.bfloat16, config=None)


def test_modelled_waves_and_bytes_by_hand():
    """Issue 45's arithmetic: 4096 x 2112 x 7168 on 132 SMs."""
    m, n, k = 4096, 2112, 7168
    steps = k // TILE
    # 128 x 128 tiles: 32 x 17 = 544, 544 / 132 = 4.12 waves; the fifth has 16 tiles for 132
    # SMs, so the SMs hold a tile 544 / (5 x 132) = 82.4 % of the time.
    got = tuning.modelled(FAST, m, n, k, H100_NUM_SMS)
    assert got.tiles == 544 and round(got.waves, 2) == 4.12 and round(got.wave_efficiency, 3) == 0.824
    # per tile and K step: a's 128 x 128 chunk and 128 f32 scales, b's chunk and one 128-byte
    # scale box: 16896 + 16512 bytes; each tile stores 128 x 128 bf16.
    assert got.l2_bytes == 544 * (steps * (16896 + 16512) + 128 * 128 * 2)
    assert got.flops == 2 * m * n * k
    # MMA: 128 x 128 x 128 x 2 / 8192 FLOP a cycle = 512 cycles a step; L2: 33408 bytes at
    # 6144 / 132 = 46.5 bytes a cycle = 717.7 cycles, the longer; five waves.
    per_tile = steps * 33408 * 132 / 6144 + 128 * 128 * 2 * 132 / 6144
    assert abs(got.cycles - 5 * per_tile) <= 1
    # 128 x 192 in clusters of two along M: 32 x 11 = 352 tiles as 176 clusters on 66 pairs of
    # SMs, 2.67 waves in 3: 352 / 396 = 88.9 %; each CTA fetches half of b's chunk and box.
    wide = tuning.modelled(tuning.Layout(128, 192, cluster_m=2), m, n, k, H100_NUM_SMS)
    assert wide.tiles == 352 and round(wide.waves, 2) == 2.67
    assert round(wide.wave_efficiency, 3) == 0.889
    assert wide.l2_bytes == 352 * (steps * (16896 + (192 * 128 + 128) / 2) + 128 * 192 * 2)
    # tensor-bound: 768 MMA cycles a step against 29248 bytes / 46.5 = 628.4
    assert abs(wide.cycles - 3 * (steps * 768 + 128 * 192 * 2 * 132 / 6144)) <= 1
    # an odd number of row tiles: the last cluster's second CTA is launched for nothing
    odd = tuning.modelled(tuning.Layout(128, 128, cluster_m=2), 3 * 128, 128, TILE, 2)
    assert (odd.tiles, odd.wave_efficiency) == (3, 0.75)


@pytest.mark.parametrize("m,n", [(0, 100), (100, 0), (0, 0)])
def test_empty_problems_model_as_no_work(m, n):
    """No rows (an MoE step whose experts got no token) or no columns: nothing to model, and the
    rules still pick (the kernels then launch nothing)."""
    for lay in tuning.DENSE_LAYOUTS:
        got = tuning.modelled(lay, m, n, TILE, H100_NUM_SMS)
        assert (got.tiles, got.waves, got.l2_bytes, got.flops, got.cycles) == (0, 0.0, 0, 0, 0)
    assert tuning.grouped_rule_config(m, n, TILE, jnp.bfloat16, H100_NUM_SMS).tile_m == 128
    assert tuning.dense_config(m, n, TILE, jnp.bfloat16) is not None


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 20000),
    n=st.integers(1, 30000),
    chunks=st.integers(1, 160),
    out_dtype=st.sampled_from([jnp.bfloat16, jnp.float32]),
    num_sms=st.sampled_from([1, 8, 114, 132]),
    scalar_b=st.booleans(),
)
def test_rule_is_valid_fits_smem_and_models_fastest(m, n, chunks, out_dtype, num_sms, scalar_b):
    kp = chunks * TILE
    config = tuning.rule_config(m, n, kp, out_dtype, num_sms, scalar_b=scalar_b)  # validated
    assert gemm.smem_bytes(config, out_dtype, chunks) <= SMEM_BYTES
    assert config.warp_specialized or tuning.Layout.of(config) in tuning.ONE_WARPGROUP_LAYOUTS
    tiles = -(-m // config.tile_m) * -(-n // config.tile_n)
    model = lambda c: tuning.modelled(c, m, n, kp, num_sms, out_dtype=out_dtype,  # noqa: E731
                                      scalar_b=scalar_b)
    if not config.warp_specialized:  # one warpgroup: tiles narrowed until the grid covers the SMs
        assert config.tile_m == WGMMA_M and config.max_concurrent_steps >= 2
        no_gain = -(-n // (config.tile_n // 2)) == -(-n // config.tile_n)
        assert tiles >= num_sms or config.tile_n == tuning.MIN_TILE_N or no_gain
        wider = -(-m // config.tile_m) * -(-n // (2 * config.tile_n))
        assert config.tile_n == gemm.GemmConfig().tile_n or wider < num_sms
        if m <= WGMMA_M:
            return
        # M > 64: only where the warp-specialized pick leaves SMs idle and models slower by more
        # than the model's resolution (`tuning._few_tiles`)
        ws = tuning.rule_config(m, n, kp, out_dtype, num_sms, scalar_b=scalar_b, few_tiles=False)
        assert ws.warp_specialized and model(ws).tiles < num_sms
        assert model(config).cycles < model(ws).cycles * (1 - tuning.MODEL_RESOLUTION)
        return
    assert m > WGMMA_M
    lay = tuning.Layout.of(config)
    assert lay in tuning.DENSE_LAYOUTS and (scalar_b or lay.tile_n <= TILE)
    assert lay.cluster_m * lay.cluster_n == 1 or tiles > num_sms  # clusters over > 1 wave only
    assert config.max_concurrent_steps >= 2

    def fits(r):  # the rival's config as the rule would stage it fits SMEM
        rival = tuning._staged(gemm.GemmConfig(tile_m=r.tile_m, tile_n=r.tile_n, cluster_m=r.cluster_m,
                                               cluster_n=r.cluster_n), kp, out_dtype)
        return gemm.smem_bytes(rival, out_dtype, chunks, scalar_b=False) <= SMEM_BYTES

    rivals = [r for r in tuning.DENSE_LAYOUTS if (scalar_b or r.tile_n <= TILE) and fits(r)
              and (r.cluster_m * r.cluster_n == 1
                   or -(-m // r.tile_m) * -(-n // r.tile_n) > num_sms)]
    # fastest in the model within its resolution, and the fewest L2 bytes among those as fast
    fewest = min(model(r).cycles for r in rivals)
    assert model(lay).cycles <= fewest * (1 + tuning.MODEL_RESOLUTION)
    as_fast = [r for r in rivals if model(r).cycles <= fewest * (1 + tuning.MODEL_RESOLUTION)]
    assert model(lay).l2_bytes == min(model(r).l2_bytes for r in as_fast)
    if model(lay).tiles < num_sms:  # SMs left idle: the one-warpgroup form was no faster
        narrow = tuning._narrowed(gemm.GemmConfig.simple(), -(-m // WGMMA_M), n, kp, out_dtype, num_sms,
                                  deepen=True)
        assert model(narrow).cycles >= model(lay).cycles * (1 - tuning.MODEL_RESOLUTION)


@pytest.mark.parametrize("shape", SMALL_M_SHAPES, ids=str)
@pytest.mark.parametrize(
    "b_block_rows,out_dtype", [(TILE, jnp.bfloat16), (1, jnp.float32)], ids=["fprop", "wgrad"]
)
def test_small_m_choices_lower_for_hopper(shape, b_block_rows, out_dtype):
    """The rule's picks at the memory-bound shapes (`gemm.lower_scaled_matmul` with config=None,
    on an abstract H100), with either pairing and output dtype."""
    config = tuning.dense_config(shape.m, shape.n, shape.k, out_dtype)
    assert config != FAST
    assert "mosaic_gpu" in gemm.lower_scaled_matmul(
        shape.m, shape.n, shape.k, b_block_rows=b_block_rows, out_dtype=out_dtype, config=None
    )


# The `gpu` preset's dense Wgrads (d_model 768, 32 x 1024 tokens; M, N, tokens): where 128-row tiles
# leave most of the 132 SMs idle, the rule picks one warpgroup on 64 x 64 tiles (modelled about
# 1.5x faster than the 128 x 64 it picked before, 2x faster than 128 x 128); where they nearly
# fill the SMs, it keeps them.
FEW_TILE_WGRADS = {
    (768, 384, 32768): (64, 64), (384, 1024, 32768): (64, 64), (256, 1536, 32768): (64, 64),
    (768, 320, 32768): (64, 64), (256, 768, 32768): (64, 64), (768, 512, 32768): (64, 64),
    (1024, 768, 32768): (128, 64), (1536, 768, 32768): (128, 128), (2048, 768, 32768): (128, 128),
}


@pytest.mark.parametrize("shape", FEW_TILE_WGRADS, ids=str)
def test_few_tile_wgrads_pick_one_warpgroup_64_row_tiles(shape):
    config = tuning.rule_config(*shape, jnp.float32, H100_NUM_SMS, scalar_b=False)
    assert (config.tile_m, config.tile_n) == FEW_TILE_WGRADS[shape]
    assert config.warp_specialized == (config.tile_m > WGMMA_M)
    ws = tuning.rule_config(*shape, jnp.float32, H100_NUM_SMS, scalar_b=False, few_tiles=False)
    model = lambda c: tuning.modelled(c, *shape, H100_NUM_SMS, out_dtype=jnp.float32,  # noqa: E731
                                      scalar_b=False)
    if not config.warp_specialized:
        assert model(ws).tiles < H100_NUM_SMS and model(config).tiles > model(ws).tiles
        assert model(config).cycles < model(ws).cycles * (1 - tuning.MODEL_RESOLUTION)
        assert config.max_concurrent_steps == tuning.MAX_STAGES
    else:
        assert config == ws
    assert "mosaic_gpu" in gemm.lower_scaled_matmul(*shape, b_block_rows=1, out_dtype=jnp.float32, config=None)


@pytest.mark.parametrize(
    "m,n,k,b_block_rows,out_dtype",
    [
        (40, 300, 384, TILE, jnp.bfloat16),  # M <= 64: one warpgroup, 64 x 64 tiles, 3 stages
        (136, 200, 640, 1, jnp.float32),  # M > 64, few tiles: one warpgroup, 64 x 64 tiles, 5 chunks
    ],
)
def test_chosen_config_is_bit_identical_to_reference(m, n, k, b_block_rows, out_dtype):
    seed = _seed()
    a, b = _operands(seed, m, n, k, b_block_rows, exact=True)
    chosen = tuning.dense_config(m, n, a.data.shape[1], out_dtype)
    assert chosen.tile_n < FAST.tile_n  # the narrowed forms, not the default
    out = interpret(_kernel, a, b, b_block_rows, out_dtype, None)
    assert_bitwise_equal(out, _reference(a, b, out_dtype), seed)


def _write_table(path, entries, kind=None):
    table = {"device": H100_DEVICE_KIND, "entries": entries}
    path.write_text(json.dumps(table | ({} if kind is None else {"kind": kind})))


def test_a_measured_table_wins_at_the_nearest_m(monkeypatch, tmp_path):
    path = tmp_path / "table.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    small = dict(tile_m=64, tile_n=64, max_concurrent_steps=6, warp_specialized=False,
                 persistent=False, grid_tile_group=1)
    mid = dict(tile_m=128, tile_n=64, max_concurrent_steps=5)
    large = dict(tile_m=128, tile_n=128, max_concurrent_steps=3)
    _write_table(path, [
        dict(m=m, n=7168, kp=2048, out_dtype="bfloat16", config=config)
        for m, config in ((64, small), (128, mid), (4096, large))
    ])
    choose = lambda m, n=7168, kp=2048, dt=jnp.bfloat16: tuning.dense_config(  # noqa: E731
        m, n, kp, dt, device_kind=H100_DEVICE_KIND, num_sms=H100_NUM_SMS)
    rule = lambda m: tuning.rule_config(m, 7168, 2048, jnp.bfloat16, H100_NUM_SMS)  # noqa: E731
    assert choose(32) == choose(48) == choose(90) == gemm.GemmConfig(**small)  # 90: nearer 64
    assert choose(91) == choose(256) == gemm.GemmConfig(**mid)
    assert choose(2048) == choose(8192) == gemm.GemmConfig(**large)
    # No measured M within a factor 2: the rule.
    assert choose(16) == rule(16) and choose(300) == rule(300) and choose(100000) == rule(100000)
    # Another N, K or output dtype: the rule.
    assert choose(4096, n=4096) == tuning.rule_config(4096, 4096, 2048, jnp.bfloat16, H100_NUM_SMS)
    assert choose(4096, dt=jnp.float32) == tuning.rule_config(4096, 7168, 2048, jnp.float32,
                                                              H100_NUM_SMS)
    # ... and the table wins where the rule would pick a cluster (4096 x 7168 x 2048: along N)
    assert rule(4096).cluster_n == 2 and choose(4096) == gemm.GemmConfig(**large)
    # A rewritten table is read again.
    _write_table(path, [dict(m=64, n=7168, kp=2048, out_dtype="bfloat16", config=large)])
    assert choose(48) == gemm.GemmConfig(**large)


@pytest.mark.parametrize(
    "text",
    ["not json", json.dumps({"entries": [{"m": 64}]}),
     json.dumps({"entries": [dict(m=64, n=1, kp=128, out_dtype="bfloat16",
                                  config=dict(tile_m=48))]})],
    ids=["not-json", "missing-fields", "invalid-config"],
)
def test_a_broken_table_is_a_clear_error(monkeypatch, tmp_path, text):
    path = tmp_path / "table.json"
    path.write_text(text)
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    with pytest.raises(ValueError, match="tune_gemm.py"):
        tuning.dense_config(64, 1, 128, jnp.bfloat16, device_kind="x", num_sms=132)


def test_the_table_is_per_device_model_and_kernel(monkeypatch):
    monkeypatch.delenv(tuning.TABLE_ENV)
    monkeypatch.delenv(tuning.GROUPED_TABLE_ENV)
    path = tuning.table_path("NVIDIA H100 80GB HBM3")
    assert path.parent == tuning.TABLE_DIR and path.name == "gemm-nvidia-h100-80gb-hbm3.json"
    assert np.all([tuning.table_path(k) != path for k in ("NVIDIA H200", "NVIDIA H100 PCIe")])
    grouped = tuning.table_path("NVIDIA H100 80GB HBM3", "grouped")
    assert grouped.parent == tuning.TABLE_DIR and grouped.name == "grouped-nvidia-h100-80gb-hbm3.json"
    with pytest.raises(ValueError, match="table kind"):
        tuning.table_path("NVIDIA H100 80GB HBM3", "dense")


def test_a_measured_grouped_table_wins_and_stays_apart(monkeypatch, tmp_path):
    """The grouped kernel reads its own table (GroupedGemmConfig entries, M = all groups' rows),
    the dense kernel never does, and a problem outside it gets the grouped rule."""
    path = tmp_path / "grouped.json"
    monkeypatch.setenv(tuning.GROUPED_TABLE_ENV, str(path))
    tuned = dict(tile_m=128, tile_n=64, max_concurrent_steps=6, grid_tile_group=1)
    four = dict(tile_m=128, tile_n=128, max_concurrent_steps=2, grid_tile_group=1)
    _write_table(path, [
        dict(m=32768, n=4096, kp=7168, out_dtype="bfloat16", groups=8, config=tuned),
        dict(m=32768, n=4096, kp=7168, out_dtype="bfloat16", groups=4, config=four),
    ], kind="grouped")
    choose = lambda rows, n=4096, groups=8: tuning.grouped_config(  # noqa: E731
        rows, n, 7168, jnp.bfloat16, groups=groups, device_kind=H100_DEVICE_KIND,
        num_sms=H100_NUM_SMS)
    assert choose(20000) == choose(60000) == GroupedGemmConfig(**tuned)
    assert choose(32768, groups=4) == GroupedGemmConfig(**four)  # same rows, other G
    rule = lambda rows, n=4096: tuning.grouped_rule_config(  # noqa: E731
        rows, n, 7168, jnp.bfloat16, H100_NUM_SMS)
    assert rule(32768).cluster_n == 2  # what the table overrides
    assert choose(32768, groups=2) == rule(32768)  # no entry for 2 groups: the rule
    assert choose(32768, n=7168) == rule(32768, n=7168)  # the rule
    assert choose(1000) == tuning.grouped_rule_config(1000, 4096, 7168, jnp.bfloat16, H100_NUM_SMS)
    dense = tuning.dense_config(32768, 4096, 7168, jnp.bfloat16, device_kind=H100_DEVICE_KIND,
                                num_sms=H100_NUM_SMS)
    assert dense == tuning.rule_config(32768, 4096, 7168, jnp.bfloat16, H100_NUM_SMS)
    path.write_text("not json")
    with pytest.raises(ValueError, match="grouped tuning table"):
        choose(32768)


def test_a_table_of_the_other_kind_is_an_error(monkeypatch, tmp_path):
    """GemmConfig and GroupedGemmConfig have the same fields: only the table's kind tells them
    apart, so a grouped table named as the dense one (or the reverse) must not be used."""
    path = tmp_path / "table.json"
    _write_table(path, [dict(m=64, n=7168, kp=2048, out_dtype="bfloat16", groups=8,
                             config=dict(tile_m=128))], kind="grouped")
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    with pytest.raises(ValueError, match="'grouped' table, not a 'gemm' one"):
        tuning.dense_config(64, 7168, 2048, jnp.bfloat16, device_kind="x", num_sms=132)
    monkeypatch.setenv(tuning.GROUPED_TABLE_ENV, str(path))
    assert tuning.grouped_config(64, 7168, 2048, jnp.bfloat16, groups=8, device_kind="x",
                                 num_sms=132) == GroupedGemmConfig(tile_m=128)  # the table's


# ---------------------------------------------------------------------------------------------
# benchmarks/tune_gemm.py: what it would measure, and the table it writes.


@pytest.fixture(scope="module")
def tune():
    from test_benchmarks import _load

    return _load("tune_gemm")


@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (4096, 4096, 7168), (3, 100, 200)])
def test_tuner_candidates_start_with_the_rule_and_fit(tune, m, n, k):
    kp = -(-k // TILE) * TILE
    found = tune.candidates(m, n, kp, jnp.dtype(jnp.float32), H100_NUM_SMS)
    assert found[0] == tuning.rule_config(m, n, kp, jnp.float32, H100_NUM_SMS)
    assert FAST in found and len(set(found)) == len(found) > 4
    assert all(gemm.smem_bytes(c, jnp.float32, kp // TILE) <= SMEM_BYTES for c in found)
    # 2-CTA clusters are tried where there are two row tiles to share b, and named apart
    clustered = [c for c in found if c.cluster_m == 2]
    assert bool(clustered) == (m > 128), clustered
    assert all("-c2" in tune.config_name(c) for c in clustered)
    # ... and along N where there are two column tiles to share a
    along_n = [c for c in found if c.cluster_n == 2]
    assert bool(along_n) == (m > 64 and n > 128), along_n
    assert all(("-n2" in tune.config_name(c)) == (c.cluster_n == 2) for c in found)
    assert any(not c.scalar_b for c in found) and any(c.scalar_b for c in found)
    assert all(("-vb" in tune.config_name(c)) == (not c.scalar_b) for c in found)
    assert all(("-es" in tune.config_name(c)) == c.early_scale_loads for c in found)
    assert all(("-ra" in tune.config_name(c)) == c.run_ahead for c in found)
    assert any(c.run_ahead for c in found) == (m > 64)
    wide = [c for c in found if c.tile_n > 128]
    assert bool(wide) == (m > 64 and n > 128) and all(c.scalar_b for c in wide), wide
    assert len({tune.config_name(c) for c in found}) == len(found)


def test_tuner_cli_without_a_gpu(tune, capsys):
    assert tune.main(["--dry-run", "--shapes", "64x7168x2048"]) == 0
    assert "64x7168x2048: " in capsys.readouterr().out
    assert tune.main(["--shapes", "64x7168x2048"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_tuner_table_round_trip(tune, monkeypatch, tmp_path):
    """Rows as `main` records them -> the fastest per problem -> merged into an existing table
    (other problems kept, no temporary file left) -> what `dense_config` returns."""
    def row(m, config, ms, *roles):
        return dict(m=m, n=7168, k=2048, kp=2048, out_dtype="bfloat16", ms=ms, tflops=1.0,
                    impl=tune.config_name(config), config=dataclasses.asdict(config),
                    roles=list(roles))

    narrow = gemm.GemmConfig(tile_n=64, max_concurrent_steps=6)
    rows = [row(128, FAST, 2.0, "default"), row(128, narrow, 1.0),
            row(128, tuning.rule_config(128, 7168, 2048, jnp.bfloat16, 132), 1.5, "rule"),
            row(4096, FAST, 3.0, "rule", "default"), row(4096, narrow, 4.0)]
    entry, big = tune.best_entries(rows)
    assert entry["config"] == dataclasses.asdict(narrow)
    assert entry["speedup_vs_default"] == 2.0 and entry["speedup_vs_rule"] == 1.5
    # Where the rule's pick is the default, one row is both.
    assert big["config"] == dataclasses.asdict(FAST)
    assert big["speedup_vs_default"] == big["speedup_vs_rule"] == 1.0

    path = tmp_path / "gemm-test.json"
    other = dict(m=64, n=1, kp=128, out_dtype="float32", config=dataclasses.asdict(FAST))
    _write_table(path, [other, dict(entry, config=dataclasses.asdict(FAST))])
    tune.merge_table(path, [entry, big], H100_DEVICE_KIND)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    table = json.loads(path.read_text())
    assert table["device"] == H100_DEVICE_KIND and len(table["entries"]) == 3
    assert table["kind"] == "gemm"
    with pytest.raises(ValueError, match="a 'gemm' table"):
        tune.merge_table(path, [dict(entry, groups=8)], H100_DEVICE_KIND, "grouped")
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    assert tuning.dense_config(100, 7168, 2048, jnp.bfloat16, device_kind="x", num_sms=132) == narrow
    assert tuning.dense_config(5000, 7168, 2048, jnp.bfloat16, device_kind="x", num_sms=132) == FAST
    assert tuning.dense_config(64, 1, 128, jnp.float32, device_kind="x", num_sms=132) == FAST


def test_tuner_end_to_end_in_the_interpreter(tune, monkeypatch, tmp_path):
    """`main` as on a Hopper GPU, with the kernels in the Mosaic GPU interpreter at a tiny
    problem (three candidates: the rule's pick, the default, one more): each is checked and
    timed, and the fastest lands in the table, which `dense_config` then returns."""
    from pallas_kernels import _mgpu

    every = tune.candidates
    monkeypatch.setattr(tune, "candidates", lambda *args: every(*args)[:3])
    monkeypatch.setattr(tune, "is_hopper", lambda device=None: True)
    argv = ["--shapes", "48x256x256", "--out", str(tmp_path), "--warmup", "0", "--repeats", "1",
            "--inner", "1", "--max-seconds", "0.5"]
    with _mgpu.interpret_mode(True):
        assert tune.main(argv) == 0
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("tune_gemm-*.json")]
    assert len(record["rows"]) == 3 and not record["failed"] and not record["skipped"]
    assert {role for r in record["rows"] for role in r["roles"]} == {"rule", "default"}
    best = min(record["rows"], key=lambda r: r["ms"])
    monkeypatch.setenv(tuning.TABLE_ENV, record["table"])
    tabled = tuning.table_config(48, 256, 256, jnp.bfloat16, "any")  # not the rule by chance
    chosen = tuning.dense_config(48, 256, 256, jnp.bfloat16, device_kind="any", num_sms=132)
    assert tabled == chosen == gemm.GemmConfig(**best["config"])
    assert [e["impl"] for e in record["entries"]] == [best["impl"]]


@pytest.mark.parametrize("shape", [(8, 32, 4096, 7168), (8, 4096, 4096, 7168), (3, 5, 100, 200)])
def test_grouped_tuner_candidates_start_with_the_rule_and_fit(tune, shape):
    g, r, n, k = shape
    kp = -(-k // TILE) * TILE
    found = tune.grouped_candidates(g * r, n, kp, jnp.dtype(jnp.float32), H100_NUM_SMS)
    assert found[0] == tuning.grouped_rule_config(g * r, n, kp, jnp.float32, H100_NUM_SMS)
    assert GroupedGemmConfig() in found and GroupedGemmConfig.simple() in found
    assert len(set(found)) == len(found) > 4
    assert all(gemm.smem_bytes(c, jnp.float32, kp // TILE) <= SMEM_BYTES
               for c in found if c.warp_specialized)
    # issue 19's switches are tried, named apart; clusters along N only over two column tiles
    assert any(not c.scalar_b for c in found if c.warp_specialized) and any(c.early_scale_loads for c in found)
    along_n = [c for c in found if c.cluster_n == 2]
    assert along_n and all(n > c.tile_n for c in along_n), along_n
    assert len({tune.config_name(c) for c in found}) == len(found)


def test_grouped_problems_with_the_same_rows_stay_apart(tune):
    """8 x 4096 and 4 x 8192 rows are both M = 32768: the groups keep them two problems, each
    with its own winner and its own speed-ups."""
    def row(groups, config, ms, *roles):
        return dict(m=32768, groups=groups, n=4096, k=7168, kp=7168, out_dtype="bfloat16", ms=ms,
                    tflops=1.0, impl=tune.config_name(config), config=dataclasses.asdict(config),
                    roles=list(roles))

    narrow = GroupedGemmConfig(tile_n=64)
    rows = [row(8, GroupedGemmConfig(), 2.0, "rule", "default"), row(8, narrow, 1.0),
            row(4, GroupedGemmConfig(), 1.05, "rule", "default"), row(4, narrow, 1.0)]
    by_groups = {e["groups"]: e for e in tune.best_entries(rows)}
    assert set(by_groups) == {4, 8}
    assert by_groups[8]["speedup_vs_default"] == 2.0 and by_groups[4]["speedup_vs_default"] == 1.05
    assert by_groups[8]["candidates"] == by_groups[4]["candidates"] == 2


def test_grouped_tuner_cli_checks_the_shape_kind(tune, capsys):
    assert tune.main(["--grouped", "--dry-run", "--shapes", "8x32x4096x7168"]) == 0
    assert "8x32x4096x7168: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main(["--grouped", "--shapes", "64x7168x2048"])
    assert "GxRxNxK" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x32x4096x7168"])
    with pytest.raises(SystemExit):
        tune.main(["--grouped", "--shapes", "1x8x32x4096x7168"])
    assert "GxRxNxK" in capsys.readouterr().err


def test_grouped_tuner_end_to_end_in_the_interpreter(tune, monkeypatch, tmp_path):
    """`main --grouped` as on a Hopper GPU, the kernels in the interpreter at a tiny MoE problem
    (three candidates): checked, timed, the fastest in the grouped table, which
    `grouped_config` then returns (and the dense table is not written)."""
    from pallas_kernels import _mgpu

    every = tune.grouped_candidates
    monkeypatch.setattr(tune, "grouped_candidates", lambda *args: every(*args)[:3])
    monkeypatch.setattr(tune, "is_hopper", lambda device=None: True)
    argv = ["--grouped", "--shapes", "2x64x256x256", "--out", str(tmp_path), "--warmup", "0",
            "--repeats", "1", "--inner", "1", "--max-seconds", "0.5"]
    with _mgpu.interpret_mode(True):
        assert tune.main(argv) == 0
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("tune_grouped-*.json")]
    assert record["kind"] == "grouped" and not record["failed"] and not record["skipped"]
    assert len(record["rows"]) == 3 and {r["groups"] for r in record["rows"]} == {2}
    assert {role for r in record["rows"] for role in r["roles"]} == {"rule", "default"}
    best = min(record["rows"], key=lambda r: r["ms"])
    assert pathlib.Path(record["table"]).name.startswith("grouped-")
    assert not list(tmp_path.glob("gemm-*.json"))
    monkeypatch.setenv(tuning.GROUPED_TABLE_ENV, record["table"])
    tabled = tuning.table_config(128, 256, 256, jnp.bfloat16, "any", kind="grouped", groups=2)
    chosen = tuning.grouped_config(128, 256, 256, jnp.bfloat16, groups=2, device_kind="any",
                                   num_sms=132)
    assert tabled == chosen == GroupedGemmConfig(**best["config"])


# ---------------------------------------------------------------------------------------------
# The grouped kernel's rule.


@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=str)
def test_grouped_rule_picks_at_the_moe_shapes(shape):
    """256 x 128 tiles in clusters along N (a's 256-row chunk multicast), counted with a row
    tile more per group boundary (`grouped_rule_config`): fewer L2 bytes per FLOP than
    DeepGEMM's 128 x 192 along M, modelled the same way, and as fast in the model."""
    rows = shape.groups * shape.rows_per_group
    config = tuning.grouped_config(rows, shape.n, shape.k, jnp.bfloat16, groups=shape.groups)
    assert _layout(config) == GROUPED_PICKS[shape]
    model = functools.partial(tuning.modelled, m=rows, n=shape.n, kp=shape.k, num_sms=H100_NUM_SMS,
                              groups=shape.groups)
    got = model(config)
    assert got.wave_efficiency >= WAVE_EFFICIENCY_TARGET
    assert got.cycles <= model(GroupedGemmConfig()).cycles
    deepgemm = model(_deepgemm(rows, shape.n, shape.k, shape.groups))
    # as fast within the model's resolution (N 7168, K 2048: 1.8 % more cycles, its wave count)
    assert got.l2_bytes_per_flop <= deepgemm.l2_bytes_per_flop
    assert got.cycles <= deepgemm.cycles * (1 + tuning.MODEL_RESOLUTION)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 50000), n=st.integers(1, 20000), chunks=st.integers(1, 120),
       out_dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
def test_grouped_rule_is_valid_and_fits_smem(rows, n, chunks, out_dtype):
    groups = 1 + rows % 9
    config = tuning.grouped_rule_config(rows, n, chunks * TILE, out_dtype, H100_NUM_SMS, groups=groups)
    assert config.warp_specialized and tuning.Layout.of(config) in tuning.GROUPED_LAYOUTS
    # clusters only over more than one wave of the tiles the model counts (a row tile more per
    # group boundary); tiles taller than 128 rows only for groups averaging their height
    tiles = (-(-rows // config.tile_m) + groups - 1) * -(-n // config.tile_n)
    assert config.cluster_n == 1 or tiles > H100_NUM_SMS
    assert config.tile_m <= TILE or rows >= groups * config.tile_m
    assert gemm.smem_bytes(config, out_dtype, chunks) <= SMEM_BYTES


@pytest.mark.parametrize("shape,tile_n", list(zip(SMALL_GROUPED_SHAPES, (64, 128))), ids=str)
def test_grouped_rule_at_few_rows_per_expert_lowers(shape, tile_n):
    """The tuner's small grouped shapes (2 row tiles at the fewest): N = 4096 makes 64 tiles of
    128 columns, half the SMs idle, so 64-wide tiles (1 wave of 128) model faster; N = 7168
    makes 112, and 64-wide tiles would need a second wave. Both lower."""
    from test_grouped_kernel import _lower_matmul

    rows = shape.groups * shape.rows_per_group
    config = tuning.grouped_rule_config(rows, shape.n, shape.k, jnp.bfloat16, H100_NUM_SMS)
    assert config.tile_n == tile_n and config.cluster_n == 1
    assert "mosaic_gpu" in _lower_matmul(shape.groups, rows, shape.n, shape.k, config=config)


def test_grouped_small_problem_choice_lowers_and_matches_the_reference():
    """Few token rows: narrower column tiles (the rule), lowered at a DeepSeek-V3 width, and in
    the interpreter equal to the grouped reference with empty and ragged groups."""
    from test_grouped_kernel import _lower_matmul

    # 256 rows in 2 groups: at most 3 row tiles of 128, 48 tiles of 128 columns or 96 of 64,
    # one wave either way, and the narrower tile moves fewer bytes per step
    assert tuning.grouped_config(256, 2048, 7168, jnp.bfloat16, groups=2).tile_n == 64
    assert "mosaic_gpu" in _lower_matmul(2, 256, 2048, 7168)
    # in 8 groups: up to 9 row tiles, 144 tiles of 128 columns, more than one wave, so 2-CTA
    # clusters along N are allowed and model fastest (the tiles the model counts, groups included)
    eight = tuning.grouped_config(256, 2048, 7168, jnp.bfloat16, groups=8)
    assert (eight.tile_m, eight.tile_n, eight.cluster_n) == (128, 128, 2)
    assert "mosaic_gpu" in _lower_matmul(8, 256, 2048, 7168, config=eight)

    import jfp8

    rng = np.random.default_rng(_seed())
    x = jnp.asarray(rng.standard_normal((200, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 300, 256)) / 16, jnp.float32)
    sizes = jnp.asarray([120, 0, 70], jnp.int32)
    a, b = jfp8.quantize(x, (1, TILE)), jfp8.quantize(w, (TILE, TILE))
    assert tuning.grouped_config(200, 300, 256, jnp.float32, groups=3).tile_n == 64
    got = jfp8.grouped_scaled_matmul(a, b, sizes, out_dtype=jnp.float32, interpret=True)
    want = jfp8.grouped_scaled_matmul_reference(a, b, sizes, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_benchmark_rows_record_the_config_and_the_model():
    """bench_gemm's and bench_grouped's kernel rows carry the config that ran, where it came
    from, and the model's numbers for it (`_bench.kernel_info`), as JSON."""
    from helpers import load_benchmark

    dense, grouped = load_benchmark("bench_gemm"), load_benchmark("bench_grouped")
    info = dense._chosen(4096, 2112, 7168)
    assert info["config_source"] == "rule"
    assert gemm.GemmConfig(**info["config"]) == tuning.rule_config(4096, 2112, 7168, jnp.bfloat16,
                                                                   H100_NUM_SMS)
    assert info["modelled"]["tiles"] == 352 and round(info["modelled"]["wave_efficiency"], 3) == 0.889
    info = grouped._chosen(8, 8 * 4096, 4096, 7168)
    assert GroupedGemmConfig(**info["config"]).cluster_n == 2
    assert info["modelled"]["l2_bytes_per_flop"] == info["modelled"]["l2_bytes"] / (2 * 8 * 4096 * 4096 * 7168)
    # the Wgrad's output is each group's K x N, its contraction the group's tokens
    wgrad = grouped._wgrad_info(GroupedGemmConfig(), 8, 4096, 4096, 7168, "default")
    assert wgrad["modelled"]["tiles"] == 8 * (7168 // 128) * (4096 // 128)
    assert wgrad["modelled"]["flops"] == 2 * 8 * 7168 * 4096 * 4096
    assert json.loads(json.dumps(wgrad)) == wgrad

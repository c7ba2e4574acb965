"""The fused FP8 quantization kernels (`pallas_kernels.quantize`) against `jfp8.quantize`.

On CPU the kernels run in the Mosaic GPU interpreter, which initialises every buffer it allocates,
the outputs included, with NaN (`test_interpreter_poisons_unwritten_output` shows it): a block the
kernel forgets to write cannot pass the bit-exact comparisons below. Lowering for CUDA then checks
the Hopper limits the interpreter ignores (TMA boxes and strides, layouts, the SMEM budget).
The interpreter clips every TMA store per axis, which the hardware does not do for the stores
Mosaic lowers as flat copies: every interpreted run also checks that no store relies on that
(`tma_stores.flat_store_spills`, the cause of `quantize_grad`'s mismatch on an H100).

Interpreted runs cost about a second each, mostly compilation, nearly independent of the shape:
every case packs its special values (outliers, zero blocks, NaN/Inf blocks, huge values, tails)
into one matrix instead of spreading them over many launches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jfp8.fp8 import quantize
from pallas_kernels import _mgpu
from pallas_kernels import quantize as qk
from pallas_kernels.fp8_math import AMAX_FLOOR, FP8_DTYPE, GRAD_AMAX_FLOOR, TILE, abs_for_amax, encode
from helpers import on_cpu
from tma_stores import flat_store_spills, spilled_elements

KERNELS = ("tile", "block", "column", "column_t", "retile")
# "block_t": `quantize_block_and_transpose`, the block quantizer that also writes the transpose;
# "both": `quantize_tile_and_column_t`, a gradient's (1, 128) tiles and transposed (128, 1) tiles;
# "both_retile": `quantize_tile_and_retile_t`, an activation's (1, 128) tiles and their re-tiling.
ALL_KINDS = (*KERNELS, "block_t", "both", "both_retile")
BOTH_KINDS = ("both", "both_retile")  # one kernel body, 4 chunks per CTA


@functools.partial(jax.jit, static_argnames=("kind", "pow2_scale", "amax_floor"))
def _reference(x, *, kind: str, pow2_scale: bool, amax_floor: float = AMAX_FLOOR):
    """(data, scale) of `jfp8.quantize` for kernel `kind` (and, for block_t, the data
    transposed), jitted as the jfp8 layer runs it (and because eager dispatch compiles every
    small op per shape). Jitted and eager `quantize` gave identical bits for all three
    granularities when this was written."""
    if kind == "retile":
        x = quantize(x, (1, TILE), pow2_scale=pow2_scale, amax_floor=amax_floor).dequantize(jnp.float32)
    block = {"tile": (1, TILE), "block": (TILE, TILE), "block_t": (TILE, TILE)}.get(kind, (TILE, 1))
    if kind == "both":
        t, c = (quantize(x, b, pow2_scale=pow2_scale, amax_floor=amax_floor) for b in ((1, TILE), (TILE, 1)))
        return t.data, t.scale, c.mT.data, c.mT.scale
    if kind == "both_retile":  # the (1, 128) tiles, and `retile` of them
        t = quantize(x, (1, TILE), pow2_scale=pow2_scale, amax_floor=amax_floor)
        c = quantize(t.dequantize(jnp.float32), (TILE, 1), pow2_scale=pow2_scale, amax_floor=amax_floor)
        return t.data, t.scale, c.mT.data, c.mT.scale
    t = quantize(x, block, pow2_scale=pow2_scale, amax_floor=amax_floor)
    if kind == "block_t":
        return t.data, t.scale, t.mT.data
    t = t.mT if kind in ("column_t", "retile") else t
    return t.data, t.scale


def _kernel(x, *, kind: str, pow2_scale: bool, config=None, amax_floor: float = AMAX_FLOOR):
    """Kernel `kind` on x, with `config` or (None) that kernel's default config."""
    kw = dict(pow2_scale=pow2_scale, amax_floor=amax_floor) | ({} if config is None else dict(config=config))
    if kind == "retile":  # its input is the (1, 128)-tiled tensor
        t = quantize(x, (1, TILE), pow2_scale=pow2_scale, amax_floor=amax_floor)
        return qk.retile_tile_to_column_t(t.data, t.scale, m=x.shape[0], k=x.shape[1], **kw)
    if kind.startswith("column"):
        return qk.quantize_column(x, transpose=kind == "column_t", **kw)
    fn = {"tile": qk.quantize_tile, "block": qk.quantize_block,
          "block_t": qk.quantize_block_and_transpose, "both": qk.quantize_tile_and_column_t,
          "both_retile": qk.quantize_tile_and_retile_t}[kind]
    return fn(x, **kw)


def _interpret(fn, *args, detect_races: bool = False, **kwargs):
    """`fn(...)` with its Mosaic GPU kernels in the interpreter (NaN-initialised buffers), failing
    if any of its TMA stores would write past an inner axis's end on Hopper (`tma_stores`)."""
    try:
        with flat_store_spills() as spills, _mgpu.interpret_mode(True, detect_races=detect_races):
            out = jax.block_until_ready(fn(*args, **kwargs))
    except Exception:
        reset_gpu_interpret_mode_state()  # the interpreter's state is unusable after a failure
        raise
    assert not spills, (
        "TMA stores that Mosaic lowers as flat copies run past an inner axis of their array, "
        "which Hopper writes into the next rows (destination shape, window, elements): "
        f"{spills[:4]}"
    )
    return out


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _hard_input(seed: int, shape, dtype) -> jax.Array:
    """Gaussian rows of random magnitude with ×1000 outliers, plus (when the shape has room):
    a zero 128 x 128 block, a row of tiny values (amax below the floor), NaN, ±Inf, ±3e38
    (finite, but x * 448 would overflow), -0.0, all past row 128 so that the zero block stays."""
    rng = np.random.default_rng(seed)
    m, k = shape
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, size=(m, 1)))
    x = np.where(rng.random(shape) < 0.01, x * 1000, x)
    x[:TILE, :TILE] = 0
    if m > TILE + 2:
        x[TILE, :] *= 1e-6
        specials = [np.nan, np.inf, -np.inf, 3e38, -3e38, -0.0]
        rows = rng.choice(np.arange(TILE + 1, m), size=len(specials), replace=False)
        cols = rng.integers(0, k, size=len(specials))
        x[rows, cols] = specials
    return jnp.asarray(x, dtype)


def _assert_bit_equal(got, want, what: str, seed: int) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, seed)
    bits = {1: np.uint8, 4: np.uint32}[got.dtype.itemsize]
    diff = got.view(bits) != want.view(bits)
    assert not diff.any(), (
        f"seed={seed}: {what}: {diff.sum()} of {diff.size} differ, first at {np.argwhere(diff)[0]}"
    )


def _assert_outputs_equal(got, want, what: str, seed: int) -> None:
    """Every output of a kernel (data, scale[, data transposed]) against the reference's."""
    assert len(got) == len(want), (what, len(got), len(want))
    for name, g, w in zip(("data", "scale", "transposed data", "transposed scale"), got, want):
        _assert_bit_equal(g, w, f"{what} {name}", seed)


def _check(kind: str, seed: int, shape, dtype, pow2_scale: bool, *, detect_races=False, **kw):
    x = _hard_input(seed, shape, dtype)
    got = _interpret(_kernel, x, kind=kind, pow2_scale=pow2_scale, detect_races=detect_races, **kw)
    _assert_outputs_equal(got, _reference(x, kind=kind, pow2_scale=pow2_scale), kind, seed)


_DEFAULT = qk.QuantizeConfig()
# The slot-ring form the GPU session benchmarks beside the default (fits f32 input in every kernel).
RING = qk.QuantizeConfig(chunks=16, column_chunks=8, stages=2)
# (kind, shape, dtype, pow2_scale, config), chosen so that each of the three kernel bodies (row
# scales: tile; column reduction: block, column; transposed: column_t, retile) sees bf16 and f32
# input, pow2 scales on and off, and a non-default tiling; one launch each (see the module doc).
# (300, 200): row tails (300 = 2 x 128 + 44), K not a multiple of 128 (zero-filled by TMA) nor of
# 16 (the column kernel's output slice). (257, 130) f32: rows of 130 x 4 bytes are not 16-byte
# aligned (the input pad path), one row past a 128-row block.
HARD_CASES = [
    ("tile", (300, 200), jnp.bfloat16, False, qk.QuantizeConfig(rows=128)),
    ("tile", (257, 130), jnp.float32, True, _DEFAULT),
    # 3 chunks per CTA: the last CTA has chunks past the end (zero-filled, stores dropped).
    ("block", (300, 200), jnp.bfloat16, True, qk.QuantizeConfig(column_chunks=3)),
    ("column", (257, 130), jnp.float32, False, _DEFAULT),
    ("column_t", (257, 130), jnp.float32, True, _DEFAULT),
    ("column_t", (300, 200), jnp.bfloat16, False, _DEFAULT),
    # Shapes TMA can tile in swizzled SMEM (rows a multiple of 8, widths of the 128-byte swizzle
    # span: 64 bf16, 32 f32; 64 for the column kernels' E4M3 output), which take the swizzled
    # kernels, still with tails: 264 = 2 x 128 + 8 rows, K = 320 = 2.5 chunks, 448 = 3.5 chunks.
    ("tile", (264, 320), jnp.bfloat16, True, _DEFAULT),
    ("tile", (136, 448), jnp.float32, False, _DEFAULT),
    ("block", (264, 320), jnp.bfloat16, False, qk.QuantizeConfig(column_chunks=3)),
    ("column", (136, 448), jnp.float32, True, _DEFAULT),
    ("column_t", (264, 320), jnp.bfloat16, True, _DEFAULT),
    ("column_t", (136, 448), jnp.float32, False, _DEFAULT),
    # The unswizzled form on a shape the swizzled one would take.
    ("tile", (264, 320), jnp.bfloat16, False, qk.QuantizeConfig.simple()),
    # Slot rings (`stages` < chunks per CTA): slots refilled and output slots reused, with tails
    # (7.5 chunks through 3 slots; in the others a last CTA with chunks past the end), swizzled
    # or not.
    ("tile", (264, 960), jnp.bfloat16, True, qk.QuantizeConfig(chunks=8, stages=3)),
    ("block", (300, 1000), jnp.float32, False, qk.QuantizeConfig(column_chunks=5, stages=2)),
    ("column", (136, 1088), jnp.float32, True, qk.QuantizeConfig(column_chunks=4, stages=2)),
    ("column_t", (600, 320), jnp.bfloat16, False, qk.QuantizeConfig(chunks=4, stages=1)),
    # The block quantizer that also writes the transpose: unswizzled with tails on both axes and
    # spare chunks past the end, swizzled (f32), and a slot ring.
    ("block_t", (300, 200), jnp.bfloat16, True, qk.QuantizeConfig(column_chunks=3)),
    ("block_t", (264, 320), jnp.float32, False, _DEFAULT),
    ("block_t", (300, 1000), jnp.float32, False, qk.QuantizeConfig(column_chunks=5, stages=2)),
    # A gradient's two forms in one pass: unswizzled with tails on both axes (and N not a
    # multiple of 4: the column scales' padded rows), swizzled f32 through its default ring with
    # a last CTA whose chunks run past the end, one slot, and 3 slots for 4 chunks (all 4 at
    # once would not fit SMEM).
    ("both", (300, 130), jnp.bfloat16, True, qk.BOTH_CONFIG),
    ("both", (264, 640), jnp.float32, False, qk.BOTH_CONFIG),
    ("both", (136, 1088), jnp.bfloat16, False, qk.QuantizeConfig(column_chunks=4, stages=1)),
    ("both", (257, 448), jnp.bfloat16, True, qk.QuantizeConfig(column_chunks=4, stages=3)),
    # An activation's two forms (the column pass on the dequantized tiles): the same four forms.
    ("both_retile", (300, 130), jnp.bfloat16, True, qk.BOTH_CONFIG),
    ("both_retile", (264, 640), jnp.float32, False, qk.BOTH_CONFIG),
    ("both_retile", (136, 1088), jnp.bfloat16, False, qk.QuantizeConfig(column_chunks=4, stages=1)),
    ("both_retile", (257, 448), jnp.bfloat16, True, qk.QuantizeConfig(column_chunks=4, stages=3)),
]


@pytest.mark.parametrize("kind,shape,dtype,pow2_scale,config", HARD_CASES)
def test_bit_identical_to_quantize(kind, shape, dtype, pow2_scale, config):
    _check(kind, _seed(), shape, dtype, pow2_scale, config=config)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bit_identical_at_the_gradient_floor(kind):
    """The floor is a parameter of every kernel body: at `GRAD_AMAX_FLOOR` (gradients) the kernels
    give the reference's bits on a gradient-sized input (the hard input times 2^-100, amaxes from
    ~1e-40 to ~1e-25, a zero block, tiles under the floor, NaN/Inf), where the 1e-4 floor would
    have bound on every tile. bf16 input: it has f32's exponent range."""
    seed = _seed()
    shape = (300, 200) if kind in ("tile", "both", "both_retile", "retile") else (264, 320)
    x = (_hard_input(seed, shape, jnp.float32) * 2.0**-100).astype(jnp.bfloat16)
    pow2 = kind in ("block", "column_t", "both", "both_retile")
    got = _interpret(_kernel, x, kind=kind, pow2_scale=pow2, amax_floor=GRAD_AMAX_FLOOR)
    want = _reference(x, kind=kind, pow2_scale=pow2, amax_floor=GRAD_AMAX_FLOOR)
    _assert_outputs_equal(got, want, kind, seed)
    # Not the default floor's result: the floor reached the kernel.
    default = _reference(x, kind=kind, pow2_scale=pow2)
    assert not np.array_equal(np.asarray(got[1]), np.asarray(default[1])), (kind, seed)


@pytest.mark.parametrize(
    "kind,shape,config",
    [
        ("retile", (300, 200), qk.QuantizeConfig(rows=128)),  # unswizzled
        ("retile", (264, 320), qk.QuantizeConfig(rows=128)),  # swizzled
        ("retile", (600, 320), qk.QuantizeConfig(chunks=4, stages=2)),  # a slot ring
        ("tile", (264, 960), qk.QuantizeConfig(chunks=8, stages=2)),
        # Two stores per chunk (data and per-column scales) through reused output slots.
        ("column", (136, 1088), qk.QuantizeConfig(column_chunks=4, stages=2)),
        ("block", (300, 1000), qk.QuantizeConfig(column_chunks=5, stages=2)),
        # Its f16 bounce reused by every chunk; two stores per chunk through a ring.
        ("block_t", (264, 640), qk.QuantizeConfig(column_chunks=3)),
        ("block_t", (300, 1000), qk.QuantizeConfig(column_chunks=5, stages=2)),
        # Three stores per chunk through its 2-slot ring; the bounce reused by every half-chunk.
        ("both", (264, 1088), qk.BOTH_CONFIG),
        ("both_retile", (264, 1088), qk.BOTH_CONFIG),
    ],
)
def test_bit_identical_without_smem_races(kind, shape, config):
    """Race detector on: the transposing kernels reuse their SMEM bounce buffers for every chunk
    of a CTA (retile: its input is always E4M3 + f32 scales), and the slot rings refill input
    slots by TMA and reuse output slots while TMA stores may still read them."""
    _check(kind, _seed(), shape, jnp.bfloat16, False, detect_races=True, config=config)
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("kind", ["tile", "column", "retile", "block_t", "both", "both_retile"])  # each body
def test_single_element(kind):
    """M = K = 1 (f16): one element, the rest padding (zero-filled loads, dropped stores)."""
    _check(kind, _seed(), (1, 1), jnp.float16, True)


def _stacked_reference(w, pow2_scale):
    t = jax.jit(functools.partial(quantize, block=(TILE, TILE), pow2_scale=pow2_scale))(w)
    return t.data, t.scale, t.mT.data


@pytest.mark.parametrize(
    "shape,dtype,config",
    [
        ((3, 256, 200), jnp.bfloat16, _DEFAULT),  # K tail: unswizzled
        ((2, 128, 320), jnp.float32, qk.QuantizeConfig(column_chunks=2, stages=1)),  # swizzled ring
    ],
)
def test_stacked_matrices_are_transposed_one_by_one(shape, dtype, config):
    """[G, M, K] (experts): each matrix's blocks and its own transpose [G, Kp, M], bit for bit;
    each matrix has its own magnitudes, so a block that mixed two would change the scales."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, size=(shape[0], 1, 1)))
    w = jnp.asarray(w, dtype)
    pow2_scale = bool(rng.integers(2))
    got = _interpret(qk.quantize_block_and_transpose, w, pow2_scale=pow2_scale, config=config)
    _assert_outputs_equal(got, _stacked_reference(w, pow2_scale), f"stacked {shape}", seed)


# ---------------------------------------------------------------------------------------------
# Tails and partial CTAs, where a TMA store may run past the end of its array.

# A CTA of each kernel: tile 64 rows x 4 chunks; column_t, retile 64 output rows (input columns)
# x 4 chunks of 128 input rows; block, block_t, column 128 rows x 2 chunks; both 128 rows x 4
# chunks (`BOTH_CONFIG`). Per kernel: an array one chunk wide (its data windows are contiguous in
# GMEM: a chunk past it would be a flat copy into the next rows) with a partial last CTA of rows,
# and a partial CTA of chunks whose last chunk is partial and whose next one is missing (partial
# CTAs in both dimensions). bf16, each kernel's default config.
_ROWS_CTA = {"tile": 64, "column_t": 64, "retile": 64}  # others: 128 rows per CTA
TAIL_CASES = [
    ("tile", (200, 100)),  # K one chunk; 200 = 3 x 64 + 8 rows
    ("tile", (136, 300)),  # 3 chunks of a CTA's 4, the last one partial
    ("column_t", (100, 200)),  # M one chunk (output [200, 128]); 200 output rows = 3 x 64 + 8
    ("column_t", (300, 136)),
    ("retile", (100, 200)),
    ("retile", (300, 136)),
    ("block", (300, 100)),  # K one chunk, 300 = 2 x 128 + 44 rows
    ("block", (200, 300)),  # 3 chunks: the second CTA holds a partial chunk and a missing one
    ("block_t", (300, 100)),
    ("block_t", (200, 300)),
    ("column", (300, 100)),
    ("column", (200, 300)),
    ("both", (300, 100)),  # N one chunk: d is [300, 128]
    ("both", (200, 300)),  # 3 chunks of 4, the last partial: column scales past N in their row
    ("both", (100, 300)),  # M one chunk: dt is [300, 128]
    ("both_retile", (300, 100)),
    ("both_retile", (200, 300)),
    ("both_retile", (100, 300)),
]


@pytest.mark.parametrize("kind,shape", TAIL_CASES)
def test_tails_and_partial_ctas(kind, shape):
    m, k = shape
    chunk_axis = m if kind in ("column_t", "retile") else k
    row_axis = k if kind in ("column_t", "retile") else m
    assert chunk_axis % TILE and row_axis % _ROWS_CTA.get(kind, TILE)  # tails on both axes
    _check(kind, _seed(), shape, jnp.bfloat16, False)


def test_gradient_quantizer_at_the_h100_smoke_shape():
    """`quantize_tile_and_column_t` on the GPU smoke's form (256 x 384 bf16, rows spread over
    e^N(0, 1): 3 column chunks, a CTA owns 4). On an H100 it differed from the reference in 495
    and 491 bytes: the fourth chunk's [1, 128] row of column scales (a flat copy) landed on the
    next row block's first 128 column scales (see `tma_stores`). The interpreter clips that
    store and was exact; the store check in `_interpret` is what fails without the fix."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2 * TILE, 3 * TILE)) * np.exp(rng.normal(size=(2 * TILE, 1)))
    x = jnp.asarray(x, jnp.bfloat16)
    got = _interpret(_kernel, x, kind="both", pow2_scale=False, amax_floor=GRAD_AMAX_FLOOR)
    want = _reference(x, kind="both", pow2_scale=False, amax_floor=GRAD_AMAX_FLOOR)
    _assert_outputs_equal(got, want, "both", seed)


def test_flat_store_model():
    """`tma_stores.spilled_elements` on the windows that matter: a [1, 128] row past the end of a
    middle row spills into the next row; at the last row the flat copy is clamped where the
    array ends; a window that is not contiguous (a tensor-map store) is clipped, whatever it
    covers; a [rows, 128] window of an array 128 wide past its columns spills whole rows."""
    row = (slice(0, 1), slice(3 * TILE, 4 * TILE))
    assert spilled_elements(row, (2, 3 * TILE)) == TILE  # the H100 smoke's column scales
    assert spilled_elements((slice(1, 2), row[1]), (2, 3 * TILE)) == 0  # past the array's end
    assert spilled_elements((slice(0, 1), slice(TILE, 2 * TILE)), (2, TILE + 4)) == TILE - 4
    tile = (slice(0, TILE), slice(TILE, 2 * TILE))
    assert spilled_elements(tile, (2 * TILE, TILE + 4)) == 0  # not contiguous: tensor map
    assert spilled_elements(tile, (2 * TILE, TILE)) == TILE * TILE  # onto rows 1 to 128
    assert spilled_elements((slice(TILE, 2 * TILE), slice(0, TILE)), (TILE + 8, TILE)) == 0


def _row_store_kernel(out_shape, window):
    """A kernel that TMA-stores one SMEM tile into `window` (a tuple of pl.ds) of its output."""
    box = tuple(w.size for w in window)

    def body(o_gmem, o_smem):
        o_smem[...] = jnp.zeros(box, jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[window])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        scratch_types=[plgpu.SMEM(box, jnp.float32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )


@pytest.mark.parametrize(
    "out_shape,window,flat",
    [
        ((2, 3 * TILE), (pl.ds(0, 1), pl.ds(TILE, TILE)), True),  # a row of scales
        ((2 * TILE, TILE), (pl.ds(0, TILE), pl.ds(0, TILE)), True),  # whole rows
        ((2 * TILE, 2 * TILE), (pl.ds(0, TILE), pl.ds(0, TILE)), False),  # a tile of wider rows
    ],
)
def test_flat_store_model_matches_mosaic_lowering(out_shape, window, flat):
    """The premise of `tma_stores` in the pinned jax: Mosaic GPU lowers an unswizzled store whose
    GMEM window is contiguous to the flat `cp.async.bulk.global.shared::cta` copy, clamped only
    at the array's end, and any other window to a tensor-map store (which clips per axis)."""
    text = _mgpu.lower_for_cuda(lambda: _row_store_kernel(out_shape, window)())
    assert ("cp.async.bulk.global.shared::cta.bulk_group" in text) == flat


def test_interpreter_poisons_unwritten_output():
    """A kernel that stores only the first half of its output leaves the second half NaN.

    This is what makes the equality tests meaningful: a block a kernel forgot to store would be
    NaN, never an accidentally right value.
    """

    def body(o_gmem, o_smem):
        o_smem[...] = jnp.zeros((TILE, TILE), jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(0, TILE)])
        plgpu.wait_smem_to_gmem(0)

    half_writer = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((2 * TILE, TILE), jnp.float32),
        scratch_types=[plgpu.SMEM((TILE, TILE), jnp.float32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    out = np.asarray(_interpret(half_writer))
    assert (out[:TILE] == 0).all() and np.isnan(out[TILE:]).all()


# ---------------------------------------------------------------------------------------------
# The restated elementwise rules and the reference's own consistency.


def test_abs_for_amax_flags_every_non_finite_value():
    specials = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 1.0, -2.5, 3.4028235e38, -3.4028235e38,
                np.inf, -np.inf, np.nan, -np.nan]
    for dtype in (jnp.float32, jnp.bfloat16):
        x = np.asarray(jnp.asarray(specials, dtype), np.float32)
        want = np.where(np.isfinite(x), np.abs(x), np.inf).astype(np.float32)
        _assert_bit_equal(abs_for_amax(jnp.asarray(x)), want, f"abs_for_amax {dtype}", 0)


def test_encode_is_the_same_under_jit_and_eagerly():
    """`encode` multiplies by the per-block reciprocal, which is what XLA makes of a division by a
    broadcast scale under jit: on values at and next to E4M3 rounding ties, jit and eager agree
    bit for bit (a true division would differ on some of them)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    scale = np.float32(rng.uniform(1e-3, 1e3, size=(64, 1)))
    scale[3] = np.nan
    grid = np.asarray(jnp.arange(-448, 449, 2, dtype=jnp.float32).astype(FP8_DTYPE), np.float32)
    ties = (grid[:-1] + grid[1:]) / 2  # midpoints between E4M3 neighbours
    q = rng.choice(np.concatenate([grid, ties]), size=(64, 128)).astype(np.float32)
    x = np.float32(q * scale * np.float32(1 + rng.integers(-2, 3, size=q.shape) * 2.0**-23))
    _assert_bit_equal(jax.jit(encode)(x, scale), encode(jnp.asarray(x), jnp.asarray(scale)), "encode", seed)


# ---------------------------------------------------------------------------------------------
# Edge cases and errors (no launch).


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_empty_input_returns_empty_without_launch(kind, shape):
    """Outside the interpreter: a launch on this CPU would raise."""
    x = jnp.zeros(shape, jnp.bfloat16)
    got = _kernel(x, kind=kind, pow2_scale=False)
    want = jax.eval_shape(functools.partial(_reference, kind=kind, pow2_scale=False), x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype


def test_empty_stack_returns_empty_without_launch():
    w = jnp.zeros((0, 256, 384), jnp.float32)
    got = qk.quantize_block_and_transpose(w)
    assert [g.shape for g in got] == [(0, 256, 384), (0, 2, 3), (0, 384, 256)]


@pytest.mark.parametrize(
    "x,error,match",
    [
        (jnp.zeros((2, 200, 256), jnp.bfloat16), ValueError, "multiple of 128"),
        (jnp.zeros((2, 2, 128, 128), jnp.bfloat16), ValueError, r"\[G, M, K\]"),
        (jnp.zeros((8,), jnp.float32), ValueError, r"\[G, M, K\]"),
        (jnp.zeros((2, 128, 8), jnp.int32), TypeError, "bf16, f16 or f32"),
    ],
)
def test_block_t_invalid_input_raises(x, error, match):
    with pytest.raises(error, match=match):
        qk.quantize_block_and_transpose(x)


def test_both_needs_whole_16_byte_row_scale_groups():
    with pytest.raises(ValueError, match="column_chunks a multiple of 4"):
        qk.quantize_tile_and_column_t(
            jnp.zeros((8, 8), jnp.bfloat16), config=qk.QuantizeConfig(column_chunks=2)
        )


@pytest.mark.parametrize("kind", ["tile", "block", "column", "column_t"])
@pytest.mark.parametrize(
    "x,error,match",
    [
        (jnp.zeros((4, 8, 8), jnp.bfloat16), ValueError, "2-D"),
        (jnp.zeros((8,), jnp.float32), ValueError, "2-D"),
        (jnp.zeros((8, 8), jnp.int32), TypeError, "bf16, f16 or f32"),
        (jnp.zeros((8, 8), FP8_DTYPE), TypeError, "bf16, f16 or f32"),
    ],
)
def test_invalid_input_raises(kind, x, error, match):
    with pytest.raises(error, match=match):
        _kernel(x, kind=kind, pow2_scale=False)


@pytest.mark.parametrize(
    "data,scale,error,match",
    [
        (jnp.zeros((8, 256), jnp.bfloat16), jnp.ones((8, 2)), TypeError, "float8_e4m3fn"),
        (jnp.zeros((8, 256), FP8_DTYPE), jnp.ones((8, 2), jnp.bfloat16), TypeError, "f32"),
        (jnp.zeros((8, 200), FP8_DTYPE), jnp.ones((8, 2)), ValueError, "data must be"),
        (jnp.zeros((8, 256), FP8_DTYPE), jnp.ones((8, 1)), ValueError, "scale"),
        (jnp.zeros((9, 256), FP8_DTYPE), jnp.ones((9, 2)), ValueError, "logical shape"),
    ],
)
def test_retile_invalid_input_raises(data, scale, error, match):
    with pytest.raises(error, match=match):
        qk.retile_tile_to_column_t(data, scale, m=8, k=200)


@pytest.mark.parametrize(
    "fields", [dict(rows=96), dict(chunks=6), dict(chunks=0), dict(column_chunks=0), dict(stages=0)]
)
def test_invalid_config_raises(fields):
    with pytest.raises(ValueError):
        qk.QuantizeConfig(**fields)


# ---------------------------------------------------------------------------------------------
# CUDA lowering at real sizes, and the real kernels on a GPU.


def _for_kind(kind: str, config: qk.QuantizeConfig) -> qk.QuantizeConfig:
    """`config` made valid for `kind`: "both" takes 4 chunks per CTA (16-byte scale rows) in a
    2-slot ring, its default, whatever the config's own chunking (its other fields are kept)."""
    if kind not in BOTH_KINDS:
        return config
    return dataclasses.replace(config, column_chunks=qk.BOTH_CONFIG.column_chunks,
                               stages=qk.BOTH_CONFIG.stages)


def _lower(kind: str, m: int, k: int, dtype, config=None) -> str:
    S = jax.ShapeDtypeStruct
    if kind == "retile":
        kp = -(-k // TILE) * TILE
        fn = functools.partial(
            qk.retile_tile_to_column_t, m=m, k=k, config=config or qk.QuantizeConfig()
        )
        return _mgpu.lower_for_cuda(fn, S((m, kp), FP8_DTYPE), S((m, kp // TILE), jnp.float32))
    fn = functools.partial(_kernel, kind=kind, pow2_scale=True, config=config)
    return _mgpu.lower_for_cuda(fn, S((m, k), dtype))


# DeepSeek-V3 sizes and tails (K = 2112 is 16.5 chunks; 300 x 130 has tails on both axes); each
# kernel at two of them, both input dtypes.
_SHAPES = [(4096, 7168, jnp.bfloat16), (8192, 8192, jnp.float32), (4096, 2112, jnp.bfloat16),
           (300, 130, jnp.float32)]
LOWERING_CASES = [(kind, *_SHAPES[(i + j) % 4]) for i, kind in enumerate(KERNELS) for j in (0, 3)]


@pytest.mark.parametrize(
    "kind,m,k,dtype",
    [
        *LOWERING_CASES,
        # Weights: f32 masters (the largest SMEM of the defaults: 2 chunks of input, of E4M3
        # output and of its transpose, and a half-chunk f16 bounce), bf16, tails.
        ("block_t", 7168, 2048, jnp.float32),
        ("block_t", 2048, 7168, jnp.bfloat16),
        ("block_t", 300, 130, jnp.float32),
        # Gradients: bf16 and f32 at DeepSeek-V3 sizes, tails.
        ("both", 4096, 7168, jnp.bfloat16),
        ("both", 4096, 7168, jnp.float32),
        ("both", 4096, 2112, jnp.bfloat16),
        ("both", 300, 130, jnp.float32),
        ("both", 256, 60, jnp.bfloat16),  # padded to 64 columns: see the swizzle test
        # Activations: the same kernel body with the column pass on the dequantized tiles.
        ("both_retile", 4096, 7168, jnp.bfloat16),
        ("both_retile", 300, 130, jnp.float32),
    ],
)
def test_lowers_for_hopper(kind, m, k, dtype):
    assert "mosaic_gpu" in _lower(kind, m, k, dtype)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reciprocal_is_correctly_rounded_on_hopper(kind):
    """Mosaic GPU compiles an f32 `1 / x` as `rcp.approx.f32` (LLVM's -nvptx-prec-divf32=1), up
    to one ulp off the reference's reciprocal: on an H100 that flipped E4M3 ties in `retile`,
    which the interpreter (exact division) cannot show. Every kernel takes its
    scales' reciprocals as `rcp.rn.f32` (`_mgpu.ieee_reciprocal`) and divides nowhere."""
    S = jax.ShapeDtypeStruct
    if kind == "retile":
        fn = functools.partial(qk.retile_tile_to_column_t, m=256, k=384)
        text = _mgpu.lower_for_cuda(fn, S((256, 384), FP8_DTYPE), S((256, 3), jnp.float32))
    else:
        fn = functools.partial(_kernel, kind=kind, pow2_scale=False)
        text = _mgpu.lower_for_cuda(fn, S((256, 384), jnp.bfloat16))
    assert "rcp.rn.f32" in text
    assert "divf" not in text and "rcp.approx" not in text


def test_ieee_reciprocal_outside_kernels():
    """In XLA (and so in the interpreter) the primitive is the plain, correctly rounded division,
    specials included; it batches and rejects other dtypes."""
    x = np.random.default_rng(_seed()).standard_normal(4096).astype(np.float32)
    # No input with a subnormal reciprocal (XLA:CPU flushes those to zero, rcp.rn keeps them):
    # scales lie in [2^-126, 2^120] (`fp8_math.scale_from_amax`), so kernels never meet one.
    x = np.concatenate([x, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 2.0**-126, 2.0**120])])
    want = np.float32(1) / x
    np.testing.assert_array_equal(np.asarray(jax.jit(_mgpu.ieee_reciprocal)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(_mgpu.ieee_reciprocal)(x)), want)
    with pytest.raises(TypeError, match="float32"):
        _mgpu.ieee_reciprocal(jnp.ones(3, jnp.bfloat16))


def test_stacked_block_t_lowers_for_hopper():
    """The experts' weights of a DeepSeek-V3 MoE layer, [G, K, N] f32, in one launch."""
    fn = qk.quantize_block_and_transpose
    assert "mosaic_gpu" in _mgpu.lower_for_cuda(fn, jax.ShapeDtypeStruct((8, 7168, 2048), jnp.float32))


@pytest.mark.parametrize("kind", ["tile", "column", "retile", "block_t", "both", "both_retile"])  # each body
def test_lowers_a_single_element(kind):
    """TMA boxes larger than the whole array, and a 1-element row padded to 16 bytes."""
    assert "mosaic_gpu" in _lower(kind, 1, 1, jnp.bfloat16)


@pytest.mark.parametrize(
    "kind,config,dtype",
    [
        ("tile", qk.QuantizeConfig(rows=128, chunks=4), jnp.float16),
        ("column", qk.QuantizeConfig(column_chunks=1), jnp.float32),
        ("retile", qk.QuantizeConfig(rows=128, chunks=4), None),
        ("tile", qk.QuantizeConfig(chunks=16, stages=4), jnp.bfloat16),
        *[(kind, RING, jnp.float32) for kind in ("tile", "block", "column", "column_t")],
        ("block", qk.QuantizeConfig(column_chunks=8, stages=2), jnp.float32),
        ("column_t", qk.QuantizeConfig(chunks=16, stages=3), jnp.bfloat16),
        ("retile", qk.QuantizeConfig(chunks=16, stages=3), None),
    ],
)
def test_lowers_with_other_tiling(kind, config, dtype):
    assert "mosaic_gpu" in _lower(kind, 4096, 7168, dtype, config)


@pytest.mark.parametrize(
    "kind,m,k,dtype,swizzled",
    [
        ("tile", 4096, 7168, jnp.bfloat16, True),
        ("tile", 4100, 7168, jnp.bfloat16, False),  # rows not a multiple of 8
        ("tile", 4096, 7200, jnp.float32, True),  # 7200 = 225 x 32
        ("tile", 4096, 7172, jnp.float32, False),  # not a multiple of the 32-float span
        ("block", 4096, 7168, jnp.float32, True),
        ("column", 4096, 7200, jnp.float32, False),  # f32 input fits; its E4M3 columns don't
        ("column_t", 4096, 2112, jnp.bfloat16, True),
        ("column_t", 4092, 2112, jnp.bfloat16, False),
        ("retile", 4096, 2112, None, True),
        ("retile", 4100, 2112, None, False),
        ("block_t", 7168, 2048, jnp.float32, True),
        ("block_t", 7172, 2048, jnp.bfloat16, False),
        ("both", 4096, 7168, jnp.bfloat16, True),
        ("both", 4096, 7200, jnp.float32, True),
        ("both", 4096, 7172, jnp.float32, False),
        # x padded to 16-byte rows is whole swizzle spans, but dy's width (dt's rows) is not a
        # multiple of 8.
        ("both", 4096, 7166, jnp.bfloat16, False),
        ("both", 256, 30, jnp.float32, False),
        ("both_retile", 4096, 7168, jnp.bfloat16, True),
        ("both_retile", 4096, 7166, jnp.bfloat16, False),
    ],
)
def test_swizzles_exactly_where_tma_can_tile(kind, m, k, dtype, swizzled, monkeypatch):
    """The default config stages the tiles in swizzled SMEM on the shapes whose arrays are all whole
    8-row, swizzle-span-wide tiles (`qk._swizzle_fits`; Mosaic would also take a dimension
    smaller than one tile, which stays unswizzled), and those kernels lower; `simple()` never
    does."""
    asked = []

    def spy(shape, dtype, swizzled):
        asked.append(swizzled)
        return smem(shape, dtype, swizzled)

    smem = qk._smem
    monkeypatch.setattr(qk, "_smem", spy)
    assert "mosaic_gpu" in _lower(kind, m, k, dtype, _for_kind(kind, _DEFAULT))
    assert asked and set(asked) == {swizzled}
    asked.clear()
    _lower(kind, m, k, dtype, _for_kind(kind, qk.QuantizeConfig.simple()))
    assert asked and set(asked) == {False}


def test_lowering_rejects_a_config_over_the_smem_budget():
    """3 chunks of f32 [128, 128] input plus E4M3 output exceed 227 KiB."""
    config = qk.QuantizeConfig(column_chunks=3)
    with pytest.raises(ValueError, match="shared memory"):
        _lower("block", 4096, 7168, jnp.float32, config)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a Hopper GPU")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_on_gpu_matches_reference(kind):
    """Swizzled (bf16 and f32: 128-byte tiles of 64 and of 32 elements), unswizzled (a shape
    TMA cannot tile; `simple()` on one it can) and a slot ring, bit for bit."""
    seed = _seed()
    for shape, dtype, pow2_scale, config in [
        ((4096, 7168), jnp.bfloat16, False, _DEFAULT),
        ((4096, 2112), jnp.float32, True, _DEFAULT),
        ((300, 130), jnp.float32, True, _DEFAULT),
        ((4096, 7168), jnp.bfloat16, False, qk.QuantizeConfig.simple()),
        ((4096, 7168), jnp.float32, False, RING),
    ]:
        x = _hard_input(seed, shape, dtype)
        got = jax.jit(_kernel, static_argnames=("kind", "pow2_scale", "config"))(
            x, kind=kind, pow2_scale=pow2_scale, config=_for_kind(kind, config)
        )
        want = on_cpu(functools.partial(_reference, kind=kind, pow2_scale=pow2_scale), x)  # the CPU's bits
        _assert_outputs_equal(got, want, f"{kind} {shape} {config}", seed)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a Hopper GPU")
def test_stacked_block_t_on_gpu_matches_reference():
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 2048, 1024)) * np.exp2(rng.integers(-8, 9, size=(8, 1, 1)))
    w = jnp.asarray(w, jnp.float32)
    got = jax.jit(qk.quantize_block_and_transpose)(w)
    _assert_outputs_equal(got, on_cpu(_stacked_reference, w, False), "stacked on GPU", seed)

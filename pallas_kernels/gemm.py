"""Tile-scaled E4M3 NT GEMM for Hopper (sm_90), written with Pallas Mosaic GPU.

Computes `out = a @ b.T` for FP8 operands that carry one FP32 scale per row (a) or per row block
(b) and per 128 contraction elements, with DeepSeek-V3's promotion (report §3.3, "Increasing
Accumulation Precision"): each 128-wide K chunk is multiplied by a fp8 `wgmma` into a *zeroed* FP32
accumulator, and the partial sum is then scaled and added to the running FP32 result in
registers:

    out = 0                                              # [tile_m, tile_n] f32, registers
    for c in range(Kp // 128):                           # in this order
        partial = wgmma(a[:, c], b[:, c].T)              # FP8 x FP8 -> f32, fresh accumulator
        out = out + partial * (sa[:, c, None] * sb[None, :, c])

which is exactly `jfp8.reference.scaled_matmul_reference`, operation for operation. Because the
K tile equals the scaling block (`TILE` = 128), every K step is one promotion. Bit-exactness is a
claim about the Mosaic GPU interpreter, whose wgmma is an exact matmul (the tests check it there):
on a Hopper GPU the tensor core sums each chunk's products in its own limited-precision
accumulator, the very reason for the promotion, and the outputs are held to
`jfp8.accumulation.hardware_error_bound` instead.

Launch structure, two forms selected by `GemmConfig`:

- `GemmConfig.simple()`, the correct-first form: one CTA of one warpgroup per 64 x 128 output
  tile. `plgpu.emit_pipeline` streams the K chunks of a, b and their scales GMEM -> SMEM with TMA
  (2 stages), and the same warpgroup waits for each chunk, runs the wgmma, waits for it and
  promotes.
- `GemmConfig()`, the fast form (the default): 128 x 128 tiles, 4 SMEM stages, warp-specialized
  (`plgpu.emit_pipeline_warp_specialized`: warpgroup 2 only issues TMA, with 40 registers per
  thread; consumer warpgroups 0 and 1 each own 64 rows of the tile, with 232 registers), and
  persistent (one CTA per SM looping over tiles in a grouped order, `plgpu.nd_loop` +
  `plgpu.planar_snake`). The stages are allocated once per CTA and reused by every tile.
  The four changes are independent fields, so each can be measured alone.

In both, the fp8 tiles are in the 128-byte swizzle that wgmma needs, b is stored K-major, `(N, K)`,
and handed to wgmma transposed (fp8 wgmma takes no other B layout), and each warpgroup casts its
rows in registers and TMA-stores them through a swizzled SMEM tile, leaving the store in flight
until that SMEM is needed again. The numerics do not depend on the config: every output element
gets the same chunk products promoted in the same order. Called without a config,
`scaled_matmul` runs the one `tuning.dense_config` picks for the problem: `GemmConfig()` wherever
128 x 128 tiles fill the GPU (every DENSE_SHAPES entry), narrower or one-warpgroup forms for
small M, or what `experiments/tune_gemm.py` measured best on this GPU model.

Predicted effects, to be measured on a GPU (nothing here has been timed; `experiments/
bench_gemm.py` times the picked config, and `--config` rows flip the fields one at a time from
`GemmConfig.simple()`):
1. Deeper pipeline (`max_concurrent_steps` 2 -> 4). With 2 stages only the next chunk's copies
   are in flight while one is computed, so each step can wait a full TMA round trip from L2/HBM.
   More stages hide that latency; expected to help most where per-tile compute is shortest
   relative to load latency (tile_n small, or few CTAs per SM). Sweep 2..5 at fixed tiles.
2. Warp specialization. In the simple form the tensor cores idle while the one warpgroup waits
   for TMA, waits for its wgmma, and promotes (a multiply-add per accumulator element per 128 K).
   With two consumers, one's promotion (FMA units) overlaps the other's wgmma (tensor cores), and
   the 128-row tile halves the b traffic per FLOP compared with 64 rows. Expected to be the
   largest gain at every DENSE_SHAPES entry; to separate the two causes, compare
   `GemmConfig(warp_specialized=False, tile_m=128, ...)` with the default.
3. Persistent grid. Removes a CTA launch, barrier setup and pipeline fill per tile, and lets the
   producer fetch the next tile's first chunks while the consumers store the previous tile.
   Expected to matter most at short K (4096x24576x1536, 4096x7168x2048), where fill and epilogue
   are a larger share of a tile's time; it does not remove wave quantization (tiles % 132).
4. Grouped tile order (`grid_tile_group` = 8 row tiles). A wave of 132 concurrent 128 x 128
   tiles then spans 8 row tiles x about 17 column tiles, i.e. 25 distinct 128-row panels of a and
   b (128 x K bytes each), instead of about 4 + 56 = 60 in row order at N = 7168 (1 + 132 at
   N = 24576). Concurrent CTAs move through K at similar rates, so a panel shared within a wave
   should come from HBM about once: per wave 2 * 132 * 128^2 * K FLOP over 25 * 128 * K bytes is
   ~1350 FLOP/byte, against ~560 for 60 panels, and the H100 datasheet ratio (1979 TFLOP/s over
   3.35 TB/s) is ~590. Expected: less DRAM read traffic (`ncu` dram bytes) at every shape, and
   higher throughput where panels do not also survive in the 50 MB L2 between waves (large K:
   4096x7168x16384, 8192^3).
Also to check on the GPU: the SASS should show `QGMMA` for the wgmma and `SETMAXNREG` in the
warp-specialized form; the per-chunk `commit_smem` (proxy fence + warpgroup barrier, see
`_promote`) is expected to cost little, since the other consumer's wgmma runs meanwhile.

Tails: TMA zero-fills loads past the inputs' edges (zero data and zero scales add exact zeros)
and drops stores past the output's edge, so partial tiles need no masking in the kernel. What
TMA cannot do is tile a GMEM array whose rows are not a multiple of 8 (or whose columns are not a
multiple of the swizzle width) for a swizzled copy: only then does the wrapper zero-pad (a, b
rows; output rows/columns, sliced afterwards), at the cost of one copy of that array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mgpu
from pallas_kernels.fp8_math import FP8_DTYPE, TILE

# The K tile of the kernel is the scaling block: one promotion per K step.
TILE_K = TILE
# Hopper TMA: every GMEM stride but the innermost must be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16
# Swizzled SMEM tiles are 8 rows high, and TMA then tiles the GMEM array the same way: its rows
# must be a multiple of 8 and its columns a multiple of the swizzle width (the tails are padded).
SWIZZLE_ROWS = 8
# A warpgroup's wgmma covers 64 rows; one TMA box dimension spans at most 256 elements.
WGMMA_M = 64
MAX_TMA_BOX = 256
# The narrowest output tile whose bf16 rows can be swizzled (32 bytes).
MIN_TILE_N = 16
# Warp specialization: consumer (wgmma) warpgroups per CTA, besides the one producer (TMA)
# warpgroup, and the registers per thread the producer keeps (setmaxnreg; the rest of the
# register file goes to the consumers). 40 is what jax's Hopper matmul gives its producer.
WS_CONSUMER_WGS = 2
WS_PRODUCER_REGISTERS = 40
# Shared memory per block on Hopper (opt-in maximum, 227 KiB), and the alignment of each SMEM
# buffer (the 128-byte swizzle repeats every 8 rows = 1024 bytes).
SMEM_BYTES = 227 * 1024
SMEM_ALIGN = 1024
BARRIER_BYTES = 8
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_B_BLOCK_ROWS = (1, TILE)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling and launch structure of the kernel. The defaults are the fast form (see the module
    docstring); `GemmConfig.simple()` is the correct-first one.

    Attributes:
      tile_m: output rows per CTA, a multiple of 64 (one warpgroup's wgmma M); with
        `warp_specialized`, a multiple of 128, split evenly between the consumer warpgroups.
      tile_n: output columns per CTA, a multiple of 16 and at most 256 (wgmma N, TMA box, and
        a swizzled bf16 output row). A warpgroup computing r rows holds f32 register tiles of
        r x tile_n (`partial`, the scale product, `out`), each 64 registers/thread at 64 x 128;
        at tile_n = 256 they take 3 x 128, more than a thread has (232 for a warp-specialized
        consumer, 255 otherwise), and spill.
      max_concurrent_steps: SMEM stages: K steps whose TMA copies may be in flight at once.
      warp_specialized: one producer warpgroup issues the TMA copies and `WS_CONSUMER_WGS`
        consumer warpgroups run wgmma and the promotion on their rows of the tile; otherwise one
        warpgroup does both.
      persistent: launch one CTA per SM (at most one per tile), each looping over its tiles, so
        that a tile's epilogue overlaps the next tile's loads; otherwise one CTA per tile.
      grid_tile_group: row tiles walked together along the tile order (L2 reuse); 1 walks the
        tiles row by row.
    """

    tile_m: int = 128
    tile_n: int = 128
    max_concurrent_steps: int = 4
    warp_specialized: bool = True
    persistent: bool = True
    grid_tile_group: int = 8

    def __post_init__(self):
        rows = WGMMA_M * (WS_CONSUMER_WGS if self.warp_specialized else 1)
        if self.tile_m < rows or self.tile_m % rows or self.tile_m > MAX_TMA_BOX:
            why = f" ({WS_CONSUMER_WGS} consumer warpgroups)" if self.warp_specialized else ""
            raise ValueError(
                f"tile_m={self.tile_m} must be a multiple of {rows}{why} and at most {MAX_TMA_BOX}"
            )
        if self.tile_n < MIN_TILE_N or self.tile_n % MIN_TILE_N or self.tile_n > MAX_TMA_BOX:
            raise ValueError(
                f"tile_n={self.tile_n} must be a multiple of {MIN_TILE_N} and at most {MAX_TMA_BOX}"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
        if self.grid_tile_group < 1:
            raise ValueError(f"grid_tile_group={self.grid_tile_group} must be >= 1")

    @classmethod
    def simple(cls) -> GemmConfig:
        """The correct-first form: one warpgroup per CTA on a 64 x 128 tile, 2 stages, one CTA
        per tile in row order."""
        return cls(
            tile_m=64,
            tile_n=128,
            max_concurrent_steps=2,
            warp_specialized=False,
            persistent=False,
            grid_tile_group=1,
        )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _swizzle_elems(dtype, row_elems: int) -> int:
    """Elements per swizzled row segment: the largest swizzle (<= 128 B) that divides a row."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.find_swizzle(row_elems * itemsize * 8) // itemsize


def _swizzled(dtype, row_elems: int) -> tuple:
    """SMEM layout of a tile with rows of `row_elems`: 8-row tiles, the widest swizzle.

    The fp8 wgmma operands get the 128-byte swizzle (a row of TILE_K fp8 is 128 bytes); the
    output tile gets it too for tile_n * itemsize >= 128, for bank-conflict-free stores.
    """
    elems = _swizzle_elems(dtype, row_elems)
    return (
        plgpu.TilingTransform((SWIZZLE_ROWS, elems)),
        plgpu.SwizzleTransform(elems * jnp.dtype(dtype).itemsize),
    )


def _zeros(shape: tuple[int, int]) -> jax.Array:
    """An f32 register tile of zeros in the wgmma accumulator layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _promote(a_smem, b_smem, sa_smem, sb_smem, out: jax.Array) -> jax.Array:
    """One K chunk for one warpgroup: fresh FP32 wgmma, then `out + partial * (sa * sb)`.

    a_smem [rows, TILE_K], b_smem [tile_n, TILE_K] (K-major), sa_smem [rows], sb_smem [tile_n];
    out [rows, tile_n] f32 in registers, rows a multiple of 64.
    """
    rows, cols = out.shape
    wgmma_layout = plgpu.Layout.WGMMA

    def chunk_product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))  # b is K-major: pass b.T
        plgpu.wgmma_wait(0)  # the promotion needs the finished partial sum
        return acc_ref[...]

    # The named scopes are the regions `_mgpu.profile` times per warpgroup (nothing otherwise).
    with jax.named_scope("wgmma"):
        partial = pl.run_scoped(chunk_product, plgpu.ACC((rows, cols), jnp.float32))  # zeroed
    with jax.named_scope("promote"):
        sa = plgpu.load(sa_smem, layout=wgmma_layout.reduce(1))  # [rows] per output row
        sb = plgpu.load(sb_smem, layout=wgmma_layout.reduce(0))  # [cols] per output column
        sa, sb = lax.broadcast_in_dim(sa, out.shape, [0]), lax.broadcast_in_dim(sb, out.shape, [1])
        out = out + partial * (sa * sb)
        # The pipeline hands this stage back to TMA next. The scale loads above are generic-proxy
        # reads and TMA writes through the async proxy, which PTX orders only across a proxy
        # fence (`fence.proxy.async`, here with a warpgroup barrier); without it the
        # interpreter's race detector reports the stage's next TMA write as racing with them.
        plgpu.commit_smem()
    return out


def _in_specs(config, mi, ni, k_first=0) -> list[plgpu.BlockSpec]:
    """K step k of output tile (mi, ni): a, b (128-byte swizzled fp8) and their scales, from K
    chunk `k_first + k` on (a group's first chunk in the grouped Wgrad)."""
    tm, tn = config.tile_m, config.tile_n
    fp8_tile = _swizzled(FP8_DTYPE, TILE_K)
    return [
        plgpu.BlockSpec((tm, TILE_K), lambda k: (mi, k_first + k), transforms=fp8_tile),
        plgpu.BlockSpec((tn, TILE_K), lambda k: (ni, k_first + k), transforms=fp8_tile),
        plgpu.BlockSpec((None, tm), lambda k: (k_first + k, mi)),
        plgpu.BlockSpec((None, tn), lambda k: (k_first + k, ni)),
    ]


def _tile_at(lin, tiles: tuple[int, int], config: GemmConfig) -> tuple[jax.Array, jax.Array]:
    """(row tile, column tile) number `lin` of the tile order.

    A grouped ("planar snake") order: `grid_tile_group` row tiles side by side, walked column
    by column, the direction flipping from one group to the next, so that the tiles running at
    the same time share few a and b panels.
    """
    group = min(config.grid_tile_group, tiles[0])
    return plgpu.planar_snake(lin, tiles, 0, group)  # minor dim 0: groups of row tiles


def _for_each_tile(config: GemmConfig, tiles: tuple[int, int], tile_fn) -> None:
    """Calls `tile_fn(mi, ni)` for this CTA's output tiles: non-persistent, CTA i computes tile
    i of `_tile_at`; persistent, CTA i computes tiles i, i + #CTAs, i + 2 #CTAs, ..."""
    if not config.persistent:
        tile_fn(*_tile_at(lax.axis_index("sm"), tiles, config))
        return

    @plgpu.nd_loop((tiles[0] * tiles[1],), collective_axes="sm")
    def _(loop_info):
        tile_fn(*_tile_at(loop_info.index[0], tiles, config))


def _store_tile(out: jax.Array, out_smem, out_gmem_tile) -> None:
    """Registers -> swizzled SMEM -> TMA store, which drops rows/columns past the output's edge.

    The store is left in flight (it overlaps the next tile's main loop); only before `out_smem`
    is written again do we wait for the previous store to have read it.
    """
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[...] = out.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem_tile)


def _simple_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, out_smem, *, config, tiles):
    """One warpgroup per CTA: TMA and wgmma issued from the same warpgroup.

    Refs (C = Kp // TILE_K; primes mark the padded extents of `_kernel_operands`/`_out_shape`):
      a_gmem [M', Kp] e4m3, b_gmem [Nb', Kp] e4m3 (K-major), sa_gmem [C, M''] f32, sb_gmem
      [C, N''] f32 (scales, K chunk-major), out_gmem [M_out, N_out], out_smem [tile_m, tile_n].
    """
    tm, tn = config.tile_m, config.tile_n

    def tile(mi, ni):
        out = plgpu.emit_pipeline(
            lambda _, a_smem, b_smem, sa_smem, sb_smem, out: _promote(
                a_smem, b_smem, sa_smem, sb_smem, out
            ),
            grid=(a_gmem.shape[1] // TILE_K,),
            in_specs=_in_specs(config, mi, ni),
            max_concurrent_steps=config.max_concurrent_steps,
            init_carry=_zeros((tm, tn)),
        )(a_gmem, b_gmem, sa_gmem, sb_gmem)
        _store_tile(out, out_smem, out_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])

    _for_each_tile(config, tiles, tile)
    plgpu.wait_smem_to_gmem(0)


def warp_specialized_tiles(config, operands, out_dtype, schedule, *, out_transforms=(), dynamic_k=False):
    """The warp-specialized main loop, shared by the dense and the grouped kernels.

    Runs in a kernel of `WS_CONSUMER_WGS + 1` warpgroups (thread axis "wg"): warpgroup
    `WS_CONSUMER_WGS` only issues TMA; consumer warpgroup w (0 <= w < WS_CONSUMER_WGS) owns rows
    [w * wm, (w + 1) * wm) of each (tile_m, tile_n) tile, wm = tile_m / WS_CONSUMER_WGS. Each
    consumer runs `_promote` on its rows with its own FP32 registers and stores its rows itself,
    so the consumers only meet at the pipeline's "consumed" barrier: while one promotes a chunk
    (FMA units), the other's wgmma can occupy the tensor cores.

    The SMEM stages and the output tile are allocated once, for every tile the CTA computes (a
    scoped allocation per tile would synchronise the three warpgroups at every tile), and sized
    by `operands` = (a [M', Kp], b [N', Kp], sa [C, M''], sb [C, N'']), GMEM refs as in
    `_simple_kernel`. Then `schedule(run_tile, wg, out_rows)` runs on every warpgroup, with
    `out_rows` this consumer's rows of the output tile, and calls, the same way on all of them,

        run_tile(mi, ni, views, epilogue, *, k_first=0, k_steps=C, before_chunk=None)

    for each output tile: the K loop of tile (mi, ni) over `views` (refs shaped like `operands`,
    e.g. one group's weight), from chunk `k_first` for `k_steps` chunks (dynamic with
    `dynamic_k`), with `before_chunk(step, a_rows)` run by each consumer on its rows of a chunk
    before the wgmma; then `epilogue(out, out_rows)` on each consumer, out its [wm, tile_n] f32
    result.
    """
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    chunks = operands[0].shape[1] // TILE_K

    def pipeline(mi, ni, k_first=0, k_steps=chunks, body=None, compute_context=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=WS_PRODUCER_REGISTERS,
            in_specs=_in_specs(config, mi, ni, k_first),
            wg_axis="wg",
            num_compute_wgs=WS_CONSUMER_WGS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    # A static grid shorter than the pipeline allocates fewer stages; a dynamic one allocates all.
    alloc_steps = max(chunks, config.max_concurrent_steps) if dynamic_k else chunks
    out_tile = plgpu.SMEM((tm, tn), out_dtype, transforms=out_transforms)

    @functools.partial(
        pl.run_scoped,
        stages=pipeline(0, 0, k_steps=alloc_steps).get_allocations(*operands),
        out_smem=out_tile,
        collective_axes="wg",
    )
    def _(stages, out_smem):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * wm, wm)  # this consumer's rows of the tile

        def run_tile(mi, ni, views, epilogue, *, k_first=0, k_steps=chunks, before_chunk=None):
            def body(idx, a_smem, b_smem, sa_smem, sb_smem, out):
                a_rows = a_smem.at[rows]
                if before_chunk is not None:
                    before_chunk(idx[0], a_rows)
                return _promote(a_rows, b_smem, sa_smem.at[rows], sb_smem, out)

            def compute_context(run_pipeline):
                epilogue(run_pipeline(_zeros((wm, tn))), out_smem.at[rows])

            pipeline(mi, ni, k_first, k_steps, body, compute_context)(*views, allocations=stages)

        schedule(run_tile, wg, out_smem.at[rows])

    plgpu.wait_smem_to_gmem(0)


def _ws_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config, tiles):
    """Warp-specialized dense GEMM (`warp_specialized_tiles`) over the tiles of `_for_each_tile`.
    Refs as in `_simple_kernel`."""
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    operands = (a_gmem, b_gmem, sa_gmem, sb_gmem)

    def schedule(run_tile, wg, _):
        def tile(mi, ni):
            def epilogue(out, out_rows):
                rows = out_gmem.at[pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)]
                _store_tile(out, out_rows, rows)

            run_tile(mi, ni, operands, epilogue)

        _for_each_tile(config, tiles, tile)

    warp_specialized_tiles(
        config, operands, out_gmem.dtype, schedule, out_transforms=_swizzled(out_gmem.dtype, tn)
    )


def _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype) -> None:
    for name, x in (("a_data", a_data), ("b_data", b_data)):
        if x.ndim != 2 or x.dtype != FP8_DTYPE:
            raise TypeError(
                f"{name} must be a 2-D {jnp.dtype(FP8_DTYPE)} array, got {x.dtype}{list(x.shape)}"
            )
    for name, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    if b_block_rows not in _B_BLOCK_ROWS:
        raise ValueError(
            f"b_block_rows must be 1 (tile-scaled b) or {TILE} (block-scaled b), got {b_block_rows}"
        )
    m, kp = a_data.shape
    b_rows, b_kp = b_data.shape
    if kp % TILE_K:
        raise ValueError(f"Kp={kp} must be a multiple of {TILE_K}: zero-pad K to whole scale tiles")
    if b_kp != kp:
        raise ValueError(f"Kp differs: a_data is {a_data.shape} and b_data is {b_data.shape}")
    if not isinstance(n, int) or not 0 <= n <= b_rows:
        raise ValueError(f"n must be an int between 0 and the {b_rows} rows of b_data, got {n!r}")
    chunks = kp // TILE_K
    if a_scale.shape != (m, chunks):
        raise ValueError(
            f"a_scale must have shape (M, Kp // {TILE_K}) = {(m, chunks)}, got {a_scale.shape}"
        )
    b_scale_shape = (-(-b_rows // b_block_rows), chunks)
    if b_scale.shape != b_scale_shape:
        raise ValueError(
            f"b_scale must have shape (ceil(rows / b_block_rows), Kp // {TILE_K}) = {b_scale_shape}"
            f" for b_data {b_data.shape} and b_block_rows={b_block_rows}, got {b_scale.shape}"
        )


def _tma_extent(size: int, tile: int, align: int = 1) -> int:
    """The smallest extent >= size that a swizzled TMA copy can tile: a multiple of `tile`, or,
    for a dimension within one tile, a multiple of `align` (16-byte rows for a minor dimension)."""
    return _round_up(size, align) if size <= tile else _round_up(size, tile)


def _pad_axis(x: jax.Array, axis: int, extent: int) -> jax.Array:
    """Zero-pads `x` along `axis` to `extent` (no copy when it is already that long)."""
    pad = extent - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows):
    """The layouts the kernel's TMA copies need.

    - Scales go K chunk-major, `[C, rows]`, so one K step's scales for a tile are one contiguous
      TMA box; b's are expanded to one scale per output column (a 128x128 block's scale repeated
      over its rows), which serves both pairings with one kernel. Both are small (1/32 of the
      fp8 data) and padded to 16-byte rows for TMA.
    - The fp8 operands' rows are zero-padded to a multiple of 8 for the swizzled TMA: this copies
      a (or b) only when it has more than 8 rows and their count is not a multiple of 8.
    """
    f32_align = TMA_ALIGN_BYTES // 4
    sa = _pad_axis(a_scale.T, 1, _round_up(a_scale.shape[0], f32_align))  # [C, M']
    sb = jnp.repeat(b_scale, b_block_rows, axis=0)[:n] if b_block_rows > 1 else b_scale[:n]
    sb = _pad_axis(sb.T, 1, _round_up(n, f32_align))  # [C, N']
    a_data = _pad_axis(a_data, 0, _tma_extent(a_data.shape[0], SWIZZLE_ROWS))
    b_data = _pad_axis(b_data, 0, _tma_extent(b_data.shape[0], SWIZZLE_ROWS))
    return a_data, b_data, sa, sb


def smem_bytes(config: GemmConfig, out_dtype, chunks: int) -> int:
    """Shared memory the kernel allocates, in bytes, for `chunks` = Kp // 128 K steps.

    Per stage a [tile_m, 128] and b [tile_n, 128] fp8 tile and their f32 scales, plus the output
    tile and the pipeline's mbarriers (one per stage, two with warp specialization: "produced"
    and "consumed"); each buffer starts on a 1024-byte boundary. The pipelines allocate no more
    stages than there are K steps. This reproduces Mosaic GPU's own count
    (`tests/test_gemm_kernel.py` checks it), so a config is rejected before lowering, in the
    interpreter too, with the fields to change.
    """
    stages = min(config.max_concurrent_steps, chunks)
    tm, tn = config.tile_m, config.tile_n
    f32 = jnp.dtype(jnp.float32).itemsize
    buffers = (
        stages * tm * TILE_K,  # a, fp8
        stages * tn * TILE_K,  # b, fp8
        stages * tm * f32,  # a's scales
        stages * tn * f32,  # b's scales
        tm * tn * jnp.dtype(out_dtype).itemsize,  # output tile
    )
    barriers = stages * (2 if config.warp_specialized else 1)
    return sum(_round_up(b, SMEM_ALIGN) for b in buffers) + barriers * BARRIER_BYTES


def _check_smem(config: GemmConfig, out_dtype, chunks: int) -> None:
    need = smem_bytes(config, out_dtype, chunks)
    if need > SMEM_BYTES:
        raise ValueError(
            f"{config} with {jnp.dtype(out_dtype)} output needs {need} bytes of shared memory, "
            f"over the {SMEM_BYTES} a Hopper block can have: lower max_concurrent_steps, "
            "tile_n or tile_m"
        )


def _out_shape(m: int, n: int, out_dtype, config: GemmConfig) -> tuple[int, int]:
    """The kernel's output array: (M, n), padded only where the swizzled TMA store cannot tile it.

    Rows go to a multiple of 8 and columns to a multiple of the swizzle width (64 bf16 or 32 f32
    at tile_n=128); a dimension within one swizzle tile only needs 16-byte rows. When padded, the
    result is sliced afterwards (one extra pass over the output; none for aligned shapes).
    """
    cols = _swizzle_elems(out_dtype, config.tile_n)
    align = TMA_ALIGN_BYTES // jnp.dtype(out_dtype).itemsize
    return _tma_extent(m, SWIZZLE_ROWS), _tma_extent(n, cols, align)


def launch_tiles(kernel, out_type, config, num_tiles: int, num_sms: int | None = None, **kwargs):
    """`plgpu.kernel` over `num_tiles` output tiles: one CTA per tile, or with `config.persistent`
    one per SM (`num_sms`, the device's when None; fewer CTAs for fewer tiles), on grid axis
    "sm"; with `config.warp_specialized`, `WS_CONSUMER_WGS + 1` warpgroups on thread axis "wg"."""
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    ctas = min(num_tiles, num_sms) if config.persistent else num_tiles
    if config.warp_specialized:
        kwargs.update(num_threads=WS_CONSUMER_WGS + 1, thread_name="wg")
    kwargs.update(_mgpu.compiler_params())  # profiler events, inside `_mgpu.profile` only
    return plgpu.kernel(kernel, out_type=out_type, grid=(ctas,), grid_names=("sm",), **kwargs)


def _gemm_call(
    out_shape: tuple[int, int],
    out_dtype,
    config: GemmConfig,
    tiles: tuple[int, int],
    num_sms: int | None = None,
):
    """The Mosaic GPU kernel over `tiles = (row tiles, column tiles)` output tiles."""
    out_type = jax.ShapeDtypeStruct(out_shape, out_dtype)
    kernel = _ws_kernel if config.warp_specialized else _simple_kernel
    kernel = functools.partial(kernel, config=config, tiles=tiles)
    scratch = {}
    if not config.warp_specialized:
        transforms = _swizzled(out_dtype, config.tile_n)
        scratch["out_smem"] = plgpu.SMEM((config.tile_m, config.tile_n), out_dtype, transforms=transforms)
    return launch_tiles(kernel, out_type, config, tiles[0] * tiles[1], num_sms, scratch_types=scratch)


def scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    n: int,
    b_block_rows: int,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
) -> jax.Array:
    """`a @ b[:n].T` with per-128-K-chunk FP32 promotion (DeepSeek-V3 §3.3), on Hopper.

    Args:
      a_data: (M, Kp) float8_e4m3fn, Kp a multiple of 128 (K zero-padded).
      a_scale: (M, Kp // 128) float32: the scale of row m in K chunk c.
      b_data: (Nb_rows, Kp) float8_e4m3fn, stored K-major; Nb_rows >= n (rows past n are ignored).
      b_scale: (ceil(Nb_rows / b_block_rows), Kp // 128) float32.
      n: the number of output columns (logical rows of b).
      b_block_rows: 128 for 128x128-block-scaled b (Fprop, Dgrad), 1 for 1x128-tile-scaled b
        (Wgrad: the b scale varies per output column).
      out_dtype: bfloat16 or float32.
      config: tiling; when None, `tuning.dense_config` picks one for this problem and GPU (a
        measured table where one covers it, else a rule).

    Returns:
      (M, n) array in `out_dtype`: `jfp8.reference.scaled_matmul_reference`, operation for
      operation, except for the order of the FP32 additions inside one 128-wide chunk product
      (the tensor core's, or the interpreter's matmul).
    """
    _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype)
    out_dtype = jnp.dtype(out_dtype)
    m, kp = a_data.shape
    if m == 0 or n == 0 or kp == 0:
        return jnp.zeros((m, n), out_dtype)  # nothing to launch; K = 0 sums to zero
    if config is None:
        from pallas_kernels import tuning  # imports this module

        config = tuning.dense_config(m, n, kp, out_dtype)
    _check_smem(config, out_dtype, kp // TILE_K)
    operands = _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows)
    m_out, n_out = _out_shape(m, n, out_dtype, config)
    tiles = (pl.cdiv(m, config.tile_m), pl.cdiv(n, config.tile_n))
    out = _gemm_call((m_out, n_out), out_dtype, config, tiles)(*operands)
    return out if (m_out, n_out) == (m, n) else out[:m, :n]


def lower_scaled_matmul(
    m: int,
    n: int,
    k: int,
    *,
    b_block_rows: int,
    b_rows: int | None = None,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
) -> str:
    """StableHLO text of `scaled_matmul` lowered for CUDA at these shapes, without running it.

    The operands are laid out as jfp8 stores them: K zero-padded to whole 128-chunks, and b's rows
    (`b_rows`) padded to whole blocks of `b_block_rows` unless given. Lowering is where Mosaic GPU
    checks the Hopper limits (wgmma layouts, TMA boxes and strides, the SMEM budget).
    """
    b_rows = _round_up(n, b_block_rows) if b_rows is None else b_rows
    kp = _round_up(k, TILE_K)
    chunks = kp // TILE_K
    args = (
        jax.ShapeDtypeStruct((m, kp), FP8_DTYPE),
        jax.ShapeDtypeStruct((m, chunks), jnp.float32),
        jax.ShapeDtypeStruct((b_rows, kp), FP8_DTYPE),
        jax.ShapeDtypeStruct((-(-b_rows // b_block_rows), chunks), jnp.float32),
    )
    fn = functools.partial(
        scaled_matmul, n=n, b_block_rows=b_block_rows, out_dtype=out_dtype, config=config
    )
    return _mgpu.lower_for_cuda(fn, *args)

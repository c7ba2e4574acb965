"""The GEMM kernels' configurations (frozen dataclasses) and their shared-memory accounting.

`GemmConfig` tiles the dense kernel, `GroupedGemmConfig` the grouped ones; `smem_bytes` counts
what a config allocates so that an oversized one is rejected with the fields to change before
lowering (in the interpreter too), and `out_shape` is the padded output the TMA store writes.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels._hopper import (
    BARRIER_BYTES,
    LANE_SCALE_STEP,
    MAX_TMA_BOX,
    MIN_TILE_N,
    SCALE_BOX,
    SMEM_ALIGN,
    SMEM_BYTES,
    SWIZZLE_ROWS,
    TILE_K,
    TMA_ALIGN_BYTES,
    TMA_SMEM_ALIGN_BYTES,
    WGMMA_M,
    WGMMA_MAX_N,
    WS_CONSUMER_WGS,
    round_up,
    swizzle_elems,
    tma_extent,
)
from pallas_kernels.fp8_math import TILE

# tile_n steps: bf16 output rows of at least 32 bytes (swizzled), and the tile's f32 column
# scales (a tile-scaled b: Wgrad, tile x tile) one or more whole 128-byte TMA slots.
TILE_N_STEP = max(MIN_TILE_N, TMA_SMEM_ALIGN_BYTES // 4)


# The narrowest column slice `scalar_b_scale` promotes with its own scalar in a tile wider than
# one weight block (a 192-wide tile starts at column 0 or 64 of a block).
SCALE_PIECE = 64


def block_pieces(tile_n: int) -> tuple[int, int]:
    """(width, count) of the column slices of a tile that each lie in one 128-column weight block
    wherever the tile starts (tiles start at multiples of tile_n): the whole tile when it divides
    128; 64 x 3 for 192; 128 x 2 for 256."""
    width = math.gcd(tile_n, TILE)
    return width, tile_n // width


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling and launch structure of the kernel. The defaults are the fast form (see the module
    docstring); `GemmConfig.simple()` is the correct-first one.

    Attributes:
      tile_m: output rows per CTA, a multiple of 64 (one warpgroup's wgmma M); with
        `warp_specialized`, a multiple of 128, split evenly between the consumer warpgroups.
        A warpgroup with more than 64 rows (256-row tiles) promotes them in 64-row waves
        through one accumulator, so it holds its rows' result and one 64-row partial sum
        (128 + 64 registers a thread at 256 x 128; `_mainloop._promote_waves`).
      tile_n: output columns per CTA, a multiple of 16 and at most 256 (wgmma N, TMA box, and
        a swizzled bf16 output row). A warpgroup computing r rows holds f32 register tiles of
        r x tile_n (`partial`, the scale product, `out`), each 64 registers/thread at 64 x 128;
        at tile_n = 256 they take 3 x 128, more than a thread has (232 for a warp-specialized
        consumer, 255 otherwise), and spill. `scalar_b_scale` drops the scale product: 2 x 96
        at 192.
      max_concurrent_steps: SMEM stages: K steps whose TMA copies may be in flight at once.
      warp_specialized: one producer warpgroup issues the TMA copies and `WS_CONSUMER_WGS`
        consumer warpgroups run wgmma and the promotion on their rows of the tile; otherwise one
        warpgroup does both.
      persistent: launch one CTA per SM (at most one per tile), each looping over its tiles, so
        that a tile's epilogue overlaps the next tile's loads; otherwise one CTA per tile.
      grid_tile_group: row tiles walked together along the tile order (L2 reuse); 1 walks the
        tiles row by row.
      cluster_m: CTAs per thread-block cluster, along M: 1 (no clusters) or 2. At 2 the two CTAs
        of a cluster compute row tiles 2i and 2i + 1 of the same column tile, and each K step's
        b chunk and b scales are fetched once per cluster: each CTA loads half and TMA-multicasts
        it into both CTAs' SMEM, halving b's L2 -> SMEM traffic. A stage is then freed only when
        both CTAs have consumed it (a cluster barrier). Needs `warp_specialized` (the simple
        pipeline has no collective copies). Off by default until a GPU run measures it.
      cluster_n: CTAs per cluster along N: 1 or 2. At 2 the two CTAs compute column tiles 2j and
        2j + 1 of the same row tile and share each K step's a chunk and a scales the same way
        (a multicast): the choice where b is the panel re-read less, and the only one for the
        grouped kernels, whose neighbouring row tiles may belong to different groups' weights.
        At most one of `cluster_m`, `cluster_n` exceeds 1; needs `warp_specialized`.
      scalar_b_scale: when b is block-scaled (128 x 128 weights: Fprop, Dgrad), read its scale
        for a K step as the one scalar it is over the tile (one 128-byte TMA box and one SMEM load;
        `sa * sb` on the row vector before broadcasting) instead of a tile_n-wide per-column
        vector (a 128-float copy, a layout load and a [rows, tile_n] multiply, holding about 32
        more registers per consumer thread). Needs 128 % tile_n == 0 (the tile's columns in one
        weight block) or tile_n a multiple of 64: then a 192- or 256-wide tile, which spans two
        weight blocks, is promoted in `block_pieces` (64- or 128-column slices, each in one
        block) with one scalar each, all read from one 128-byte box per K step. Tile-scaled b
        (Wgrad) keeps the vector. None (the default): on wherever the tile allows it
        (`scalar_b`); True: required; False: the per-column vector. On by default since the
        deviceless Hopper build (docs/gpu.md) counted the main loop per 128-K block: 122
        instructions instead of 203 (64 FMUL and 16 vector scale loads fewer, as DeepGEMM's), at
        the same 168 registers and no spills; the bits are the same either way.
      early_scale_loads: read a K step's scales from SMEM before issuing its wgmma (their latency
        then overlaps the tensor cores) instead of after the wgmma's wait; the scale vectors are
        then live across the wgmma. Off by default until measured.
      lean_release: hand a K step's stage back to the producer right after its wgmma's wait,
        before the promotion, as DeepGEMM does: the scales are already in registers
        (`early_scale_loads`, required: they live in the stage released) and the consumer issues
        no proxy fence or warpgroup barrier per K step. The proxy fence that orders the
        consumers' generic-proxy scale reads before the stage's next TMA write moves to the
        producer, after its wait on the stage and before the refill (`_mainloop.branch_once_tiles`),
        off the consumers' critical path. Needs `warp_specialized` and not `run_ahead` (jax's
        pipeline releases its own stages). Off by default until compute-sanitizer's racecheck
        is clean on a GPU (docs/gpu.md).
      run_ahead: run each persistent CTA's tiles as one jax warp-specialized pipeline over all
        its (tile, K step) pairs: each consumer stores a tile after its last chunk (a `cond` in
        the K loop) and carries zeros into the next. The default loop (`branch_once_tiles`)
        already loads the next tile's first chunks while the consumers finish this one; this
        form is the same schedule through jax's pipeline, kept as a bisect row. The grid is
        dynamic (the CTA's tile count), so all `max_concurrent_steps` stages are allocated even
        for fewer K steps. Needs `persistent` and `warp_specialized`. Off by default.
    """

    tile_m: int = 128
    tile_n: int = 128
    max_concurrent_steps: int = 4
    warp_specialized: bool = True
    persistent: bool = True
    grid_tile_group: int = 8
    cluster_m: int = 1
    cluster_n: int = 1
    scalar_b_scale: bool | None = None
    early_scale_loads: bool = False
    run_ahead: bool = False
    lean_release: bool = False

    def __post_init__(self):
        rows = WGMMA_M * (WS_CONSUMER_WGS if self.warp_specialized else 1)
        if self.tile_m < rows or self.tile_m % rows or self.tile_m > MAX_TMA_BOX:
            why = f" ({WS_CONSUMER_WGS} consumer warpgroups)" if self.warp_specialized else ""
            raise ValueError(
                f"tile_m={self.tile_m} must be a multiple of {rows}{why} and at most {MAX_TMA_BOX}"
            )
        if self.tile_n < TILE_N_STEP or self.tile_n % TILE_N_STEP or self.tile_n > MAX_TMA_BOX:
            raise ValueError(
                f"tile_n={self.tile_n} must be a multiple of {TILE_N_STEP} and at most {MAX_TMA_BOX}"
                f" (a tile's f32 column scales fill whole {TMA_SMEM_ALIGN_BYTES}-byte TMA slots)"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
        if self.grid_tile_group < 1:
            raise ValueError(f"grid_tile_group={self.grid_tile_group} must be >= 1")
        for axis in ("cluster_m", "cluster_n"):
            if getattr(self, axis) not in (1, 2):
                raise ValueError(f"{axis}={getattr(self, axis)} must be 1 (no clusters) or 2")
        if self.cluster_m > 1 and self.cluster_n > 1:
            raise ValueError("cluster_m=2 with cluster_n=2 (a 2 x 2 cluster) is not built: "
                             "set one of them to 1")
        if self.scalar_b_scale and not _scalar_b_fits(self.tile_n):
            raise ValueError(f"scalar_b_scale needs tile_n to divide {TILE} (one weight block per "
                             f"tile) or to be a multiple of {SCALE_PIECE} (slices of one block "
                             f"each), got {self.tile_n}")
        if self.run_ahead and not (self.persistent and self.warp_specialized):
            raise ValueError("run_ahead=True needs persistent=True and warp_specialized=True: it "
                             "pipelines one persistent CTA's tiles through its producer warpgroup")
        if self.lean_release and not (self.warp_specialized and self.early_scale_loads and not self.run_ahead):
            raise ValueError("lean_release=True needs warp_specialized=True, early_scale_loads=True (the "
                             "scales live in the stage it releases before the promotion) and "
                             "run_ahead=False (jax's pipeline releases its own stages)")
        if max(self.cluster_m, self.cluster_n) > 1 and not self.warp_specialized:
            axis = "cluster_m" if self.cluster_m > 1 else "cluster_n"
            raise ValueError(f"{axis}=2 needs warp_specialized=True: the simple pipeline has no "
                             "multicast (collective) copies")

    @property
    def scalar_b(self) -> bool:
        """Whether a block-scaled b's scale is read as one scalar per block (`scalar_b_scale`,
        resolved: None means wherever the tile allows)."""
        return _scalar_b_fits(self.tile_n) if self.scalar_b_scale is None else self.scalar_b_scale

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


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiling and launch structure of the grouped kernels; the contraction tile is always `TILE`
    (the promotion step). The defaults are the fast form, `GroupedGemmConfig.simple()` the
    correct-first one (see the module docstring).

    Attributes:
      tile_m: output rows per CTA (token rows for `grouped_scaled_matmul`, K rows for
        `grouped_wgrad`). Simple form: a multiple of 64 up to 256 (one warpgroup holds the chunk
        accumulator and the running sum, 2 * tile_m * tile_n / 128 f32 registers a thread).
        Warp-specialized: a multiple of 128 up to 256, split between the consumer warpgroups.
      tile_n: output columns per CTA, at most 256. Simple form: a multiple of 32 (the tile's
        column-scale vector is TMA-loaded), and `grouped_scaled_matmul` needs `TILE` (one
        weight-block scale per tile). Warp-specialized: a multiple of 16 (the weight-block scales
        arrive expanded per column, as in the dense kernel).
      max_concurrent_steps: chunks in flight in the TMA pipeline (SMEM slots per operand).
      warp_specialized: one TMA warpgroup and two wgmma warpgroups per CTA
        (`_mainloop.branch_once_tiles`); otherwise one warpgroup per CTA does both.
      persistent: one CTA per SM walking its share of the (work item, column tile) pairs; needs
        `warp_specialized` (the simple kernels launch one CTA per tile).
      grid_tile_group: row tiles (work items) walked together along the tile order (L2 reuse of a
        group's weight and of the token rows); 1 walks them row by row.
      cluster_n: 2 runs the CTAs in clusters of two along N (`GemmConfig.cluster_n`): column tiles
        2j and 2j + 1 of one work item (Fprop/Dgrad: one row tile of one group) or of one (group,
        K tile) (Wgrad) share each step's a chunk by TMA multicast. Both CTAs of a cluster then
        run the same group's K loop, which clusters along M could not promise (neighbouring row
        tiles may be different groups'). Warp-specialized form only; off until measured.
      scalar_b_scale: `grouped_scaled_matmul` reads each weight block's scale as one scalar per K
        step (`GemmConfig.scalar_b_scale`; needs 128 % tile_n == 0; None, the default: wherever
        the tile allows). The Wgrad's b is tile-scaled and keeps its per-column vector.
        Warp-specialized form only (the simple Fprop kernel reads one scalar per block anyway).
      early_scale_loads: read a K step's scales before issuing its wgmma
        (`GemmConfig.early_scale_loads`), both kernels. Warp-specialized form only; off until
        measured.
      lean_release: release a K step's stage right after its wgmma's wait, with the proxy
        fence in the producer (`GemmConfig.lean_release`; needs `early_scale_loads`), both
        kernels. Warp-specialized form only; off until racecheck is clean on a GPU.
    """

    tile_m: int = 128
    tile_n: int = TILE
    max_concurrent_steps: int = 4
    warp_specialized: bool = True
    persistent: bool = True
    grid_tile_group: int = 8
    cluster_n: int = 1
    scalar_b_scale: bool | None = None
    early_scale_loads: bool = False
    lean_release: bool = False

    def __post_init__(self):
        if self.warp_specialized:
            # The dense kernel's rules: the same main loop runs both.
            GemmConfig(self.tile_m, self.tile_n, self.max_concurrent_steps, True, self.persistent,
                       self.grid_tile_group, cluster_n=self.cluster_n,
                       scalar_b_scale=self.scalar_b_scale, early_scale_loads=self.early_scale_loads,
                       lean_release=self.lean_release)
            if self.scalar_b_scale and TILE % self.tile_n:
                raise ValueError(f"the grouped kernels' scalar_b_scale needs one weight block per "
                                 f"tile: tile_n must divide {TILE}, got {self.tile_n}")
            return
        for field in ("cluster_n", "scalar_b_scale", "early_scale_loads", "lean_release"):
            if getattr(self, field) != getattr(GroupedGemmConfig, field):
                raise ValueError(f"{field}={getattr(self, field)} needs warp_specialized=True (the "
                                 "simple grouped kernels run their own pipeline)")
        if not 0 < self.tile_m <= WGMMA_MAX_N or self.tile_m % WGMMA_M:
            raise ValueError(f"tile_m={self.tile_m} must be a multiple of {WGMMA_M} up to 256")
        if not 0 < self.tile_n <= WGMMA_MAX_N or self.tile_n % LANE_SCALE_STEP:
            raise ValueError(f"tile_n={self.tile_n} must be a multiple of {LANE_SCALE_STEP} up to 256")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
        if self.persistent:
            raise ValueError("persistent=True needs warp_specialized=True (the simple grouped "
                             "kernels launch one CTA per tile)")

    @property
    def scalar_b(self) -> bool:
        """Whether the warp-specialized Fprop/Dgrad kernel reads a weight block's scale as one
        scalar (`scalar_b_scale`, resolved: None means wherever 128 % tile_n == 0)."""
        if not self.warp_specialized:
            return False
        return TILE % self.tile_n == 0 if self.scalar_b_scale is None else self.scalar_b_scale

    @classmethod
    def simple(cls) -> GroupedGemmConfig:
        """The correct-first form: one warpgroup per CTA on a 64 x 128 tile, 2 stages, one CTA
        per tile (per work item and column tile for `grouped_scaled_matmul`)."""
        return cls(tile_m=64, tile_n=TILE, max_concurrent_steps=2, warp_specialized=False,
                   persistent=False, grid_tile_group=1)


def _scalar_b_fits(tile_n: int) -> bool:
    """A tile whose columns lie in one weight block, or in whole 64-column slices of blocks."""
    return TILE % tile_n == 0 or tile_n % SCALE_PIECE == 0


def smem_bytes(config: GemmConfig, out_dtype, chunks: int, *, scalar_b: bool | None = None) -> int:
    """Shared memory the kernel allocates, in bytes, for `chunks` = Kp // 128 K steps.

    `scalar_b`: whether b's scales arrive as one 128-byte box per stage (`config.scalar_b`, the
    default, for a block-scaled b) or as a tile_n-wide vector (False: a tile-scaled b, Wgrad).
    Per stage a [tile_m, 128] and b [tile_n, 128] fp8 tile and their f32 scales, plus the output
    tile and the pipeline's mbarriers (one per stage, two with warp specialization: "produced"
    and "consumed"); each buffer starts on a 1024-byte boundary. The pipelines allocate no more
    stages than there are K steps (all of them with `run_ahead`). This reproduces Mosaic GPU's own count
    (`tests/test_gemm_kernel.py` checks it), so a config is rejected before lowering, in the
    interpreter too, with the fields to change.
    """
    stages = min(config.max_concurrent_steps, chunks)
    if getattr(config, "run_ahead", False):  # a dynamic grid: every stage
        stages = config.max_concurrent_steps
    tm, tn = config.tile_m, config.tile_n
    f32 = jnp.dtype(jnp.float32).itemsize
    if scalar_b is None:
        scalar_b = config.scalar_b
    buffers = (
        stages * tm * TILE_K,  # a, fp8
        stages * tn * TILE_K,  # b, fp8
        stages * tm * f32,  # a's scales
        stages * (SCALE_BOX if scalar_b else tn) * f32,  # b's scales: a 128-byte box, or a vector
        tm * tn * jnp.dtype(out_dtype).itemsize,  # output tile
    )
    barriers = stages * (2 if config.warp_specialized else 1)
    return sum(round_up(b, SMEM_ALIGN) for b in buffers) + barriers * BARRIER_BYTES

def check_smem(config: GemmConfig, out_dtype, chunks: int, *, scalar_b: bool | None = None) -> None:
    need = smem_bytes(config, out_dtype, chunks, scalar_b=scalar_b)
    if need > SMEM_BYTES:
        raise ValueError(
            f"{config} with {jnp.dtype(out_dtype)} output needs {need} bytes of shared memory, "
            f"over the {SMEM_BYTES} a Hopper block can have: lower max_concurrent_steps, "
            "tile_n or tile_m"
        )

def out_shape(m: int, n: int, out_dtype, config: GemmConfig) -> tuple[int, int]:
    """The kernel's output array: (M, n), padded only where the swizzled TMA store cannot tile it.

    Rows go to a multiple of 8 and columns to a multiple of the swizzle width (64 bf16 or 32 f32
    at tile_n=128); a dimension within one swizzle tile only needs 16-byte rows. When padded, the
    result is sliced afterwards (one extra pass over the output; none for aligned shapes).
    """
    cols = swizzle_elems(out_dtype, config.tile_n)
    align = TMA_ALIGN_BYTES // jnp.dtype(out_dtype).itemsize
    return tma_extent(m, SWIZZLE_ROWS), tma_extent(n, cols, align)

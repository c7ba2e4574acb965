"""The GEMM main loop shared by the dense and the grouped kernels: one K chunk's wgmma and FP32
promotion (`promote`), the TMA block specs of a K step, the persistent tile walk, the output
tile's store, and the warp-specialized loop that runs them (`branch_once_tiles`: each warpgroup
branches to its role once and walks all of the CTA's tiles), or jax's warp-specialized pipeline
over all of a persistent CTA's (tile, K chunk) steps (`run_ahead_tiles`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mgpu
from pallas_kernels._hopper import (
    SCALE_BOX,
    TILE_K,
    WARPGROUP_THREADS,
    WGMMA_M,
    WS_CONSUMER_WGS,
    WS_PRODUCER_REGISTERS,
    check_tma_slot,
    swizzled,
    zeros,
)
from pallas_kernels.configs import GemmConfig, block_pieces
from pallas_kernels.fp8_math import FP8_DTYPE


class AccChain:
    """One wgmma accumulator (64 rows) that consecutive chunk products of a warpgroup go through:
    each product after the first gets its zeros written into the last one's partial-sum
    registers (`_mgpu.zeros_in_registers_of`), so that ptxas neither issues it before the last
    promotion has read them nor gives it registers of its own (`_promote_waves` explains why
    that spills). Lowering only; in the interpreter each product takes a fresh accumulator."""

    def __init__(self, acc_ref, zeroed: bool = False):
        """`zeroed`: the accumulator holds zeros (fresh from `run_scoped`, nothing between it
        and the first product), which the first wgmma then reads as none."""
        self.acc_ref, self.last, self.zeroed = acc_ref, None, zeroed

    def product(self, a_smem, b_t) -> jax.Array:
        """a_smem @ b_t into the accumulator from zero; reading it waits for the wgmma."""
        if self.last is not None:  # the last partial sum is dead: its registers take the zeros
            self.acc_ref[...] = _mgpu.zeros_in_registers_of(self.last)
        elif not self.zeroed:  # zeros next to the wgmma, which then reads none (`RZ, !UPT`)
            self.acc_ref[...] = zeros(self.acc_ref.shape)
        plgpu.wgmma(self.acc_ref, a_smem, b_t)
        self.last = self.acc_ref[...]
        return self.last


def promote(a_smem, b_smem, sa_smem, sb_smem, out: jax.Array, *, scalar_b: bool = False,
            early_scales: bool = False, release=None, chain: AccChain | None = None) -> jax.Array:
    """One K chunk for one warpgroup: fresh FP32 wgmma, then `out + partial * (sa * sb)`.

    a_smem [rows, TILE_K], b_smem [tile_n, TILE_K] (K-major), sa_smem [rows], sb_smem [tile_n]
    (one scale per output column), or with `scalar_b` [SCALE_BOX] whose element p is the scale
    of the weight block under column slice p of `block_pieces(tile_n)` (one slice unless the tile
    is wider than a block; `GemmConfig.scalar_b_scale`); out [rows, tile_n] f32 in
    registers, rows a multiple of 64. Either way each element gets `partial * (sa[r] * sb[c])`
    with the same f32 values, so the bits do not depend on the form. With `early_scales`
    (`GemmConfig.early_scale_loads`) the scale vectors are read from SMEM before the wgmma is
    issued, so that their latency overlaps it, instead of after its wait.

    `release()` (`GemmConfig.lean_release`; needs `early_scales`), when given, hands the stage
    back right after the wgmma's wait, before the promotion, and this function then issues no
    proxy fence: its caller's producer fences before refilling the stage. Otherwise the caller
    releases the stage after this returns, and the fence is issued here. With `chain` the
    products go through its accumulator (a static round of chunks, `_static_slot_chunks`)
    instead of a fresh one.
    """
    if release is not None and not early_scales:
        raise ValueError("release needs early_scales: the scales live in the stage it releases")
    rows, cols = out.shape
    if rows > WGMMA_M:  # a 256-row tile's consumer (or one warpgroup's tile of over 64 rows)
        return _promote_waves(a_smem, b_smem, sa_smem, sb_smem, out, scalar_b=scalar_b,
                              early_scales=early_scales, release=release, chain=chain)

    def load_scales():
        return _load_scales(sa_smem, sb_smem, cols, scalar_b)

    def chunk_product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))  # b is K-major: pass b.T
        if release is None:
            plgpu.wgmma_wait(0)  # the promotion needs the finished partial sum
        # (else the wait that ends `run_scoped` of an accumulator is the one wait: one fewer
        # WARPGROUP.DEPBAR per K step)
        return acc_ref[...]

    if early_scales:
        with jax.named_scope("scales"):
            sa, sb = load_scales()
    # The named scopes are the regions `_mgpu.profile` times per warpgroup (nothing otherwise).
    with jax.named_scope("wgmma"):
        if chain is not None:
            partial = chain.product(a_smem, b_smem.transpose((1, 0)))
        else:
            partial = pl.run_scoped(chunk_product, plgpu.ACC((rows, cols), jnp.float32))  # zeroed
    if release is not None:
        # The wgmma has read the stage (its wait ended `run_scoped`) and the scales are in
        # registers: each thread's mbarrier arrive (release semantics) orders its own reads of
        # the stage before the producer's wait, and no warpgroup barrier is needed.
        release()
    with jax.named_scope("promote"):
        if not early_scales:
            sa, sb = load_scales()
        out = _promoted(out, partial, sa, sb)
        if release is None:
            # The pipeline hands this stage back to TMA next. The scale loads above are
            # generic-proxy reads and TMA writes through the async proxy, which PTX orders only
            # across a proxy fence (`fence.proxy.async`, here with a warpgroup barrier); without
            # it the interpreter's race detector reports the stage's next TMA write as racing
            # with them. (`plgpu.commit_smem` compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S +
            # a 128-thread BAR.SYNC, per K step on the consumers' critical path.)
            plgpu.commit_smem()
    return out

def _promote_waves(a_smem, b_smem, sa_smem, sb_smem, out: jax.Array, *, scalar_b: bool,
                   early_scales: bool, release, chain: AccChain | None = None) -> jax.Array:
    """`promote` of rows = 64 w in w waves of 64 rows, DeepGEMM's schedule for a 256-row tile:
    wave i's wgmma into the accumulator, its wait, its promotion into rows [64 i, 64 i + 64) of
    `out`, then wave i + 1's wgmma into the same accumulator registers. One wave's partial sum
    is live beside the result (64 + 128 registers a thread for a consumer's 128 x 128), where
    one 128-row accumulator needs 128 + 128, more than a consumer's 232, and spills.

    Zeroing the accumulator anew for each wave is not enough: ptxas then gives the next wave's
    wgmma registers of its own and issues it before the last wave's promotion has read its
    partial sum, both partial sums live (196 bytes of spills at 256 x 128, ptxas 13.5). So the
    next wave's zeros are written into the last wave's partial-sum registers
    (`_mgpu.zeros_in_registers_of`, through an `AccChain`: the caller's, which then also links
    this chunk's first wave to the last chunk's last one): the wgmma that overwrites them must
    wait for the promotion that reads them, and both waves' QGMMAs use the same registers
    (0 spills). The stage is released (`release`) after the last wave's wait; the bits are
    `promote`'s, element by element."""
    rows, cols = out.shape
    waves, wave_rows = rows // WGMMA_M, WGMMA_M
    _, pieces = block_pieces(cols)

    def load_scales(w, b_scalars):
        """Wave w's scales, with the weight blocks' scalars read once for all waves (as DeepGEMM
        reads its b scale once per K block); a per-column vector is read again per wave rather
        than held across the next wave's wgmma."""
        return _load_scales(sa_smem.at[pl.ds(w * wave_rows, wave_rows)], sb_smem, cols, scalar_b, b_scalars)

    def read_b_scalars():
        return [sb_smem[p] for p in range(pieces)] if scalar_b else None

    def product(acc_ref, w):  # wave w's chunk product; reading it waits for the wgmma
        plgpu.wgmma(acc_ref, a_smem.at[pl.ds(w * wave_rows, wave_rows)], b_smem.transpose((1, 0)))
        return acc_ref[...]

    def waves_of(chain):
        """The waves through `chain`, or, with None, each through a fresh accumulator of its
        own: in the GPU interpreter, which models no registers and cannot store into an
        accumulator (the values are the same: zeros, then the chunk product)."""
        b_scalars = None
        if early_scales:
            with jax.named_scope("scales"):
                b_scalars = read_b_scalars()
                scales = [load_scales(w, b_scalars) for w in range(waves)]
        promoted, partial = [], None
        for w in range(waves):
            with jax.named_scope("wgmma"):
                if chain is None:
                    partial = pl.run_scoped(functools.partial(product, w=w), plgpu.ACC((wave_rows, cols), jnp.float32))
                else:
                    partial = chain.product(a_smem.at[pl.ds(w * wave_rows, wave_rows)], b_smem.transpose((1, 0)))
            if release is not None and w == waves - 1:
                release()  # the scales are in registers and the stage is read
            with jax.named_scope("promote"):
                if not early_scales and w == 0:
                    b_scalars = read_b_scalars()
                sa, sb = scales[w] if early_scales else load_scales(w, b_scalars)
                promoted.append(_promoted(out[w * wave_rows:(w + 1) * wave_rows], partial, sa, sb))
        return jnp.concatenate(promoted, axis=0)

    if chain is not None or _mgpu.interpreting():
        out = waves_of(chain)
    else:  # zeroed for wave 0
        out = pl.run_scoped(lambda acc_ref: waves_of(AccChain(acc_ref, zeroed=True)), plgpu.ACC((wave_rows, cols), jnp.float32))
    if release is None:
        plgpu.commit_smem()  # as `promote`'s
    return out


def _load_scales(sa_rows, sb_smem, cols: int, scalar_b: bool, b_scalars=None):
    """A promotion's scales from the stage: (row scales times each column slice's weight-block
    scalar, one array per `block_pieces` slice; None) with `scalar_b` (the scalars read here
    unless given as `b_scalars`), else (row scales [rows], column scales [cols])."""
    wgmma_layout = plgpu.Layout.WGMMA
    sa = plgpu.load(sa_rows, layout=wgmma_layout.reduce(1))  # [rows] per output row
    if scalar_b:  # scale the row vector by each slice's block scale (broadcast later)
        _, pieces = block_pieces(cols)
        return [sa * (sb_smem[p] if b_scalars is None else b_scalars[p]) for p in range(pieces)], None
    return sa, plgpu.load(sb_smem, layout=wgmma_layout.reduce(0))  # [cols] per output column


def _promoted(out, partial, sa, sb):
    """`out + partial * (sa * sb)` from `_load_scales`' scales: per column slice with its own
    scalar for a tile over two weight blocks, else broadcast row (and column) scales."""
    rows, cols = out.shape
    width, pieces = block_pieces(cols)
    if sb is None and pieces == 1:
        return out + partial * lax.broadcast_in_dim(sa[0], out.shape, [0])
    if sb is None:  # a tile over two weight blocks: each slice with its own scalar
        part = [slice(p * width, (p + 1) * width) for p in range(pieces)]
        return jnp.concatenate(
            [out[:, c] + partial[:, c] * lax.broadcast_in_dim(s, (rows, width), [0])
             for c, s in zip(part, sa)], axis=1)
    sa, sb = lax.broadcast_in_dim(sa, out.shape, [0]), lax.broadcast_in_dim(sb, out.shape, [1])
    return out + partial * (sa * sb)


def cluster_shape(config) -> tuple[int, int]:
    """CTAs per thread-block cluster along (M, N): `cluster_m` row tiles of one column tile share
    b; `cluster_n` column tiles of one row tile share a. At most one of them exceeds 1."""
    return getattr(config, "cluster_m", 1), getattr(config, "cluster_n", 1)


def in_specs(config, mi, ni, k_first=0, *, scalar_b: bool = False) -> list[plgpu.BlockSpec]:
    """K step k of output tile (mi, ni), from K chunk `k_first + k` on (a group's first chunk in
    the grouped Wgrad): `step_specs` with a fixed tile."""
    return step_specs(config, lambda k: (mi, ni, k_first + k), scalar_b=scalar_b)


def step_specs(config, locate, *, scalar_b: bool = False) -> list[plgpu.BlockSpec]:
    """The TMA block specs of pipeline step s, which reads K chunk c of output tile (mi, ni) for
    `(mi, ni, c) = locate(s)`: a, b (128-byte swizzled fp8) and their scales. In a cluster along
    M the CTAs share (ni, c), so b and its scales are collective: one multicast load per
    cluster; along N they share (mi, c), and a and its scales are.

    b's scales: per output column, `[C, N']`; with `scalar_b`, per weight block, `[C, blocks *
    SCALE_BOX]` (each block's scale repeated to one 128-byte TMA box), the box of the tile's block,
    or for tiles wider than a block per column tile, `[C, tiles * SCALE_BOX]`, box j holding the
    block scales of tile j's `block_pieces`. A box is too small to split between a cluster's
    CTAs, so each loads its own."""
    tm, tn = config.tile_m, config.tile_n
    fp8_tile = swizzled(FP8_DTYPE, TILE_K)
    cm, cn = cluster_shape(config)
    shared_a, shared_b = (("cluster",) if c > 1 else () for c in (cn, cm))

    def at(index):  # block index from (mi, ni, c)
        return lambda s: index(*locate(s))

    check_tma_slot("a's scales", (tm,), jnp.float32)
    check_tma_slot("b's scales", (SCALE_BOX if scalar_b else tn,), jnp.float32)
    if scalar_b and tn > TILE_K:  # one box per column tile: its slices' block scales
        sb_spec = plgpu.BlockSpec((None, SCALE_BOX), at(lambda mi, ni, c: (c, ni)))
    elif scalar_b:  # one box per weight block, shared by its column tiles
        tiles_per_block = TILE_K // tn
        sb_spec = plgpu.BlockSpec((None, SCALE_BOX), at(lambda mi, ni, c: (c, ni // tiles_per_block)))
    else:
        sb_spec = plgpu.BlockSpec((None, tn), at(lambda mi, ni, c: (c, ni)), collective_axes=shared_b)
    return [
        plgpu.BlockSpec((tm, TILE_K), at(lambda mi, ni, c: (mi, c)), transforms=fp8_tile,
                        collective_axes=shared_a),
        plgpu.BlockSpec((tn, TILE_K), at(lambda mi, ni, c: (ni, c)), transforms=fp8_tile,
                        collective_axes=shared_b),
        plgpu.BlockSpec((None, tm), at(lambda mi, ni, c: (c, mi)), collective_axes=shared_a),
        sb_spec,
    ]

def tile_at(lin, tiles: tuple[int, int], config: GemmConfig) -> tuple[jax.Array, jax.Array]:
    """(row tile, column tile) number `lin` of the tile order.

    A grouped ("planar snake") order: `grid_tile_group` row tiles side by side, walked column
    by column, the direction flipping from one group to the next, so that the tiles running at
    the same time share few a and b panels.
    """
    group = min(config.grid_tile_group, tiles[0])
    return plgpu.planar_snake(lin, tiles, 0, group)  # minor dim 0: groups of row tiles

def cluster_tiles(config, tiles: tuple[int, int]) -> tuple[int, int]:
    """The grid of cluster tiles: `cluster_m` row tiles of one column tile, or `cluster_n` column
    tiles of one row tile, per cluster."""
    cm, cn = cluster_shape(config)
    return pl.cdiv(tiles[0], cm), pl.cdiv(tiles[1], cn)


def for_each_tile(config: GemmConfig, tiles: tuple[int, int], tile_fn, *, init_carry=None):
    """Calls `tile_fn(mi, ni)` for this CTA's output tiles: non-persistent, CTA i computes tile
    i of `tile_at`; persistent, CTA i computes tiles i, i + #CTAs, i + 2 #CTAs, ...
    With `init_carry`, `tile_fn(mi, ni, carry)` returns the next carry, and the last is returned.

    In clusters (`cluster_m` or `cluster_n` = 2) the walk is over cluster tiles (grid axis "sm"
    counts clusters) and CTA c of a cluster computes row tile `cluster_m * i + c` of column tile
    j (along M), or column tile `cluster_n * j + c` of row tile i (along N). Both CTAs run every
    step, because each loads half of the shared operand: when the tiles along the cluster's axis
    are odd, the last cluster's second CTA computes a tile wholly past the output, whose loads TMA
    zero-fills and whose store it drops.
    """
    grid = cluster_tiles(config, tiles)
    carried = init_carry is not None
    if not config.persistent:
        return tile_fn(*cta_tile(config, tiles, lax.axis_index("sm")), *((init_carry,) if carried else ()))
    if not carried:
        @plgpu.nd_loop((grid[0] * grid[1],), collective_axes="sm")
        def _(loop_info):
            tile_fn(*cta_tile(config, tiles, loop_info.index[0]))
        return None

    @plgpu.nd_loop((grid[0] * grid[1],), collective_axes="sm", init_carry=init_carry)
    def last(loop_info, carry):
        return tile_fn(*cta_tile(config, tiles, loop_info.index[0]), carry)

    return last


def cta_tile(config, tiles: tuple[int, int], lin) -> tuple[jax.Array, jax.Array]:
    """This CTA's (row tile, column tile) of cluster tile number `lin` (`for_each_tile`)."""
    cm, cn = cluster_shape(config)
    mi, ni = tile_at(lin, cluster_tiles(config, tiles), config)
    if cm > 1:
        return mi * cm + lax.axis_index("cluster"), ni
    if cn > 1:
        return mi, ni * cn + lax.axis_index("cluster")
    return mi, ni

def store_tile(out: jax.Array, out_smem, out_gmem_tile) -> None:
    """Registers -> swizzled SMEM -> TMA store, which drops rows/columns past the output's edge.

    The store is left in flight (it overlaps the next tile's main loop); only before `out_smem`
    is written again do we wait for the previous store to have read it.
    """
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[...] = out.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem_tile)

def branch_once_tiles(config, operands, out_dtype, schedule, *, out_transforms=(), dynamic_k=False,
                      scalar_b=False):
    """The warp-specialized main loop, shared by the dense and the grouped kernels: the warpgroups
    branch to their roles once per kernel, not once per tile.

    Runs in a kernel of `WS_CONSUMER_WGS + 1` warpgroups (thread axis "wg"): warpgroup
    `WS_CONSUMER_WGS` only issues TMA; consumer warpgroup w (0 <= w < WS_CONSUMER_WGS) owns rows
    [w * wm, (w + 1) * wm) of each (tile_m, tile_n) tile, wm = tile_m / WS_CONSUMER_WGS, runs
    `promote` on them with its own FP32 registers and stores them itself, so the consumers only
    meet at the "consumed" barrier: while one promotes a chunk (FMA units), the other's wgmma can
    occupy the tensor cores.

    Why not jax's warp-specialized pipeline once per tile (this project's loop until issue 31):
    the pipeline splits the warpgroups, sets their register budgets and drains its stages at
    every call, so whatever the tile loop keeps live the producer must hold within its
    `WS_PRODUCER_REGISTERS` across each `setmaxnreg` (the grouped Fprop spilled 32 bytes there,
    clusters along N 28 to 76), and the next tile's loads wait for the last one's K loop to end.
    Here each role loops over the CTA's tiles on its own, as DeepGEMM's kernels do:
    the TMA warpgroup (`WS_CONSUMER_WGS`) lowers its registers once and issues every tile's K
    steps, the consumers raise theirs once and run every tile's K loop and epilogue. The roles
    meet only at the stages' barriers ("produced": the stage's four TMA loads landed; "consumed":
    both consumers finished with it), numbered by a step counter that runs on over the tiles.
    The consumers walk a tile's K steps in rounds of the stages with constant slots, as
    DeepGEMM does (`_static_slot_chunks`; `_round_form` says which form a tile gets).

    The producer refills a stage as soon as both consumers release it, whichever tile the next
    step belongs to, so it runs ahead across tile boundaries. The SMEM stages and the output tile
    are allocated once for all the CTA's tiles. `operands` =
    (a [M', Kp], b [N', Kp], sa [C, M''], sb [C, N'']) gives the stages' shapes. Then

        schedule(k_tile, wg, out_rows, step) -> step

    runs on every warpgroup (the producer's `out_rows` are unused) and must visit the same tiles
    in the same order on all of them, threading `step` (a traced int32, 0 at first) through

        k_tile(mi, ni, views, epilogue, step, *, k_first=0, k_steps=C, edge_chunk=None) -> step

    for each tile with a K loop: tile (mi, ni) of `views` (refs shaped like `operands`, e.g. one
    group's weight) from chunk `k_first` for `k_steps` chunks (at least one; traced with
    `dynamic_k`), with `edge_chunk(k, a_rows)` run by each consumer on its rows of the loop's
    first and last chunks (k = 0 and k_steps - 1, once if they are one) before their wgmma:
    those two are peeled off the loop, so that its body, every interior chunk, carries none of
    that work (the grouped Wgrad's masking of other groups' tokens, 257 of the 469 instructions
    its loop had per chunk); then, on each consumer, `epilogue(out, out_rows)` with out its
    [wm, tile_n] f32 result. Work without a K loop (a tile of zeros) the schedule does
    itself, on the consumers (the warpgroups given `out_rows`).

    In clusters the shared operand is multicast (`step_specs`): a stage is then refilled in both
    CTAs at once, so "consumed" is a cluster barrier that both CTAs' consumers arrive at, and both
    CTAs must run the same K loops (the schedule's tiles of one cluster tile do).
    """
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    lean = getattr(config, "lean_release", False)
    # the consumers' K loop (`_static_slot_chunks`)
    rounds = _round_form(wm, tn, scalar_b, getattr(config, "early_scale_loads", False))
    chunks = operands[0].shape[1] // TILE_K
    # A static K loop shorter than the pipeline needs fewer stages; a dynamic one may use all.
    stages = config.max_concurrent_steps if dynamic_k else min(config.max_concurrent_steps, chunks)
    # Every K loop of a static length that the stages divide starts in slot 0: the consumers
    # then run rounds only (no first loop or leftovers to compile).
    aligned = not dynamic_k and chunks % stages == 0
    shape_specs = in_specs(config, 0, 0, scalar_b=scalar_b)
    buffers = [
        plgpu.SMEM((stages, *_block_shape(spec)), ref.dtype, transforms=getattr(spec, "transforms", ()))
        for spec, ref in zip(shape_specs, operands)
    ]

    def scoped(bufs, produced, consumed, out_smem):
        wg = lax.axis_index("wg")
        step0 = jnp.int32(0)

        @pl.when(wg == WS_CONSUMER_WGS)
        def _producer():
            plgpu.set_max_registers(WS_PRODUCER_REGISTERS, action="decrease")

            def k_tile(mi, ni, views, epilogue, step, *, k_first=0, k_steps=chunks, edge_chunk=None):
                del epilogue, edge_chunk  # the consumers' part
                specs = in_specs(config, mi, ni, k_first, scalar_b=scalar_b)

                def load(k, step):
                    slot = lax.rem(step, stages)

                    @pl.when(step >= stages)  # the stage's previous K step is consumed
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])
                        if lean:  # the consumers' scale reads, then this refill: `_producer_fence`
                            _producer_fence()

                    for spec, ref, buf in zip(specs, views, bufs):
                        plgpu.copy_gmem_to_smem(ref.at[_block_slices(spec, k)], buf.at[slot], produced.at[slot],
                                                collective_axes=spec.collective_axes or None)
                    return step + 1

                return lax.fori_loop(0, k_steps, load, step)

            last = schedule(k_tile, wg, None, step0)

            # Wait for the consumers to release the last stages, as every one before them was
            # waited for before its reload, so that each barrier completes exactly its phases.
            @pl.loop(lax.max(last - stages, 0), last)
            def _(step):
                plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

        @pl.when(wg < WS_CONSUMER_WGS)
        def _consumers():
            plgpu.set_max_registers(_consumer_registers(), action="increase")
            rows = pl.ds(wg * wm, wm)  # this consumer's rows of the tile
            out_rows = out_smem.at[rows]

            def k_tile(mi, ni, views, epilogue, step, *, k_first=0, k_steps=chunks, edge_chunk=None):
                del mi, ni, views, k_first  # the producer's part

                def chunk(k, carry, edge=False, slot=None, chain=None, buf_slot=None, waited=False):
                    step, out = carry
                    if slot is None:
                        slot = lax.rem(step, stages)
                    if not waited:
                        plgpu.barrier_wait(produced.at[slot])
                    bslot = slot if buf_slot is None else buf_slot
                    if edge:
                        edge_chunk(k, bufs[0].at[bslot].at[rows])
                    release = functools.partial(plgpu.barrier_arrive, consumed.at[slot])
                    out = _promote_rows(config, rows, *(buf.at[bslot] for buf in bufs), out, scalar_b,
                                        release=release if lean else None, chain=chain)
                    if not lean:
                        release()
                    return step + 1, out

                if aligned and not (isinstance(k_steps, int) and k_steps == chunks):
                    raise ValueError("a static K loop of another length than the operands' would leave "
                                     "the next tile's first step outside slot 0")

                def run_chunks(carry, lo, hi):  # chunks lo, ..., hi - 1 (none if hi <= lo)
                    if rounds is None:
                        return lax.fori_loop(lo, hi, chunk, carry)
                    count = hi - lo
                    if not isinstance(count, int):  # a dynamic loop of one chunk has none between its edges
                        count = lax.max(count, 0)
                    return _static_slot_chunks(chunk, lambda s: plgpu.barrier_wait(produced.at[s]), carry,
                                               count, stages, (WGMMA_M, tn), static_buffers=rounds == "static",
                                               aligned=aligned)

                carry = (step, zeros((wm, tn)))
                if edge_chunk is None:
                    carry = run_chunks(carry, 0, k_steps)
                else:  # the first and last chunks peeled off: the loop's body has no edge work
                    edge = functools.partial(chunk, edge=True)
                    carry = run_chunks(edge(0, carry), 1, k_steps - 1)
                    carry = lax.cond(k_steps > 1, lambda c: edge(k_steps - 1, c), lambda c: c, carry)
                step, out = carry
                epilogue(out, out_rows)
                return step

            schedule(k_tile, wg, out_rows, step0)

    if cluster_shape(config) == (1, 1):
        consumed = plgpu.Barrier(num_arrivals=WS_CONSUMER_WGS, num_barriers=stages)
    else:
        consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=WS_CONSUMER_WGS,
                                        num_barriers=stages)
    pl.run_scoped(
        scoped,
        bufs=buffers,
        produced=plgpu.Barrier(num_arrivals=len(buffers), num_barriers=stages),
        consumed=consumed,
        out_smem=plgpu.SMEM((tm, tn), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    plgpu.wait_smem_to_gmem(0)


def _round_form(wm: int, tn: int, scalar_b: bool, early_scales: bool = False) -> str | None:
    """How a consumer of `wm` x `tn` rows runs its K loop, by the registers a thread holds for
    its result and the 64-row accumulator beside it (ptxas 13.5, measured by the deviceless
    build, each choice the one without spills):

    - up to 128 (128 x 128 tiles and narrower): "static", rounds of the stages with every SMEM
      offset a constant (`_static_slot_chunks`); ptxas hoists each stage's wgmma descriptors
      out of the loop, and they fit beside;
    - up to 192 with a weight block's scalar scale (256 x 128, 128 x 192): "computed", rounds
      whose SMEM offsets are computed per chunk (hoisted, the descriptors spilled 208 and 108
      bytes);
    - else (a tile-scaled b's per-column scale vector beside 192, or read before the wgmma
      and so held across it, `early_scales`; a 256-wide tile): None, one chunk per iteration,
      its slot computed (rounds spilled 8 bytes at 256 x 128 with a tile-scaled b, 24 at
      128 x 128 with its scales read early)."""
    regs = (wm + WGMMA_M) * tn // WARPGROUP_THREADS
    if early_scales and not scalar_b:
        return None
    if regs <= 128:
        return "static"
    if regs <= 192 and scalar_b:
        return "computed"
    return None


def _static_slot_chunks(chunk, wait, carry, k_steps, stages: int, acc_shape, *, static_buffers: bool = True,
                        aligned: bool = False):
    """`k_steps` calls of `chunk(k, carry, slot=..., ...)` from step `carry[0]` (the step counter
    runs on across a CTA's tiles), DeepGEMM's loop over its stages: a first loop (slots computed)
    up to the next step whose slot is 0, a loop over whole rounds of the stages whose body is one
    chunk per stage with the slot a constant, then the steps left over (slots computed).

    In a round each chunk's barrier, phase bit and (with `static_buffers`) SMEM offsets are
    constants, instead of a `rem` by the stage count, a phase bit taken by a computed shift and
    descriptors built from a computed address per chunk (the per-K-block arithmetic that kept
    the main loop over issue 45's 100 instructions per 64 x 128 x 128); without
    `static_buffers` the round's SMEM offsets come from its first step's slot (0, which the
    compiler cannot see), so that ptxas does not hoist every stage's descriptors into registers.
    A round's wgmmas share one accumulator (`AccChain`), its zeros right after the first
    stage's wait (`wait(0)`). `k` is unused. `aligned`: the caller guarantees that `carry[0]` is
    a multiple of `stages` and `k_steps` a static one, so that rounds alone run (and only their
    code is compiled: the first loop and the leftovers cost a chunk's code each)."""
    if aligned and (not isinstance(k_steps, int) or k_steps % stages):
        raise ValueError(f"aligned rounds need a static K loop that {stages} stages divide, got {k_steps}")
    step = carry[0]
    if aligned:
        head = 0
    else:
        head = lax.min(lax.rem(stages - lax.rem(step, stages), stages), k_steps)
        carry = lax.fori_loop(0, head, chunk, carry)
    rest = k_steps - head

    def round_(r, carry):
        base = None if static_buffers else lax.rem(carry[0], stages)  # 0, computed

        def run(chain):
            c = carry
            for s in range(stages):
                c = chunk(r, c, slot=s, chain=chain, buf_slot=None if base is None else base + s, waited=s == 0)
            return c

        # The first stage's wait comes before the accumulator's zeros, so that nothing lies
        # between those and the first wgmma (which then reads none: `RZ, !UPT`).
        wait(0)
        if _mgpu.interpreting():
            return run(None)
        return pl.run_scoped(lambda acc_ref: run(AccChain(acc_ref, zeroed=True)), plgpu.ACC(acc_shape, jnp.float32))

    carry = lax.fori_loop(0, rest // stages, round_, carry)
    if aligned:
        return carry
    return lax.fori_loop(0, rest % stages, chunk, carry)


def _producer_fence() -> None:
    """With `lean_release`: the proxy fence between the consumers' reads of a stage and its
    refill, issued by the producer after its wait on the stage, before the TMA copies.

    The consumers read a stage's scales through the generic proxy and TMA overwrites them
    through the async proxy; PTX orders the two only with a proxy fence on the causality path
    between them (the read, the consumer's mbarrier arrive, the producer's wait, the refill).
    The default loop fences on each consumer before its arrive (`promote`); this fence sits on
    the same path after the producer's wait, off the consumers' critical path, and in the CTA
    that issues the refill. Without any fence the interpreter's race detector reports the
    refills as racing with the scale loads (tests/test_gemm_kernel.py). `plgpu.commit_smem` is
    Pallas' spelling of the fence; its warpgroup barrier only joins the producer's own threads."""
    plgpu.commit_smem()


def _consumer_registers() -> int:
    """Each consumer's `setmaxnreg` budget: what the producer leaves of 512 per thread slot
    (jax's pipeline gives the same), a multiple of 8, at most 256."""
    return min(256, (512 - WS_PRODUCER_REGISTERS) // WS_CONSUMER_WGS) // 8 * 8


def _block_shape(spec) -> tuple[int, ...]:
    return tuple(b for b in spec.block_shape if b is not None)


def _block_slices(spec, k) -> tuple:
    """The GMEM slices of `spec`'s block at K step `k` (a `None` block dim is an index)."""
    return tuple(i if b is None else pl.ds(i * b, b) for i, b in zip(spec.index_map(k), spec.block_shape))


def run_ahead_tiles(config, operands, out_dtype, tiles: tuple[int, int], units: int, epilogue, *,
                    out_transforms=(), scalar_b=False):
    """The persistent warp-specialized dense loop as one jax pipeline over all of this CTA's
    (tile, K chunk) steps (`GemmConfig.run_ahead`): the producer loads the next tile's first
    chunks while the consumers finish this one, as in `branch_once_tiles`, but through
    `plgpu.emit_pipeline_warp_specialized`, with the tile's store in a `cond` in the K loop.

    Step s of CTA (or cluster) `sm` is chunk s % C of its tile s // C, cluster tile number
    `sm + (s // C) * units` of the `for_each_tile` walk (`units` CTAs or clusters, as launched).
    Each consumer carries its rows' FP32 result across the steps; after a tile's last chunk it
    runs `epilogue(out, out_rows, mi, ni, wg)` and carries zeros into the next tile. The
    additions are the same as `branch_once_tiles`', in the same order."""
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    chunks = operands[0].shape[1] // TILE_K
    grid = cluster_tiles(config, tiles)
    first = lax.axis_index("sm")
    my_tiles = lax.div(grid[0] * grid[1] - first + units - 1, units)  # >= 1: units <= tiles

    def locate(step):
        mi, ni = cta_tile(config, tiles, first + lax.div(step, chunks) * units)
        return mi, ni, lax.rem(step, chunks)

    def scoped(stages, out_smem):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * wm, wm)

        def body(idx, a_smem, b_smem, sa_smem, sb_smem, out):
            out = _promote_rows(config, rows, a_smem, b_smem, sa_smem, sb_smem, out, scalar_b)
            mi, ni, chunk = locate(idx[0])

            def finish_tile(out):  # store it; the next tile starts from zero
                epilogue(out, out_smem.at[rows], mi, ni, wg)
                return zeros((wm, tn))

            return lax.cond(chunk == chunks - 1, finish_tile, lambda out: out, out)

        def compute_context(run_pipeline):
            run_pipeline(zeros((wm, tn)))

        specs = step_specs(config, locate, scalar_b=scalar_b)
        _ws_pipeline(config, specs, my_tiles * chunks, body, compute_context)(*operands, allocations=stages)

    # The grid is dynamic (the CTA's tile count), so the pipeline allocates every stage.
    alloc_steps = max(chunks, config.max_concurrent_steps)
    _with_ws_scratch(config, operands, out_dtype, out_transforms, alloc_steps, scalar_b, scoped)


def _promote_rows(config, rows, a_smem, b_smem, sa_smem, sb_smem, out, scalar_b, release=None, chain=None):
    """`promote` on one consumer's rows of a K step's SMEM tiles."""
    return promote(a_smem.at[rows], b_smem, sa_smem.at[rows], sb_smem, out, scalar_b=scalar_b,
                   early_scales=getattr(config, "early_scale_loads", False), release=release, chain=chain)


def _ws_pipeline(config, specs, steps, body=None, compute_context=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=WS_PRODUCER_REGISTERS,
        in_specs=specs,
        wg_axis="wg",
        num_compute_wgs=WS_CONSUMER_WGS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )


def _with_ws_scratch(config, operands, out_dtype, out_transforms, alloc_steps, scalar_b, fn) -> None:
    """`fn(stages, out_smem)` on every warpgroup, with the SMEM stages and the output tile
    allocated once for all the CTA's tiles (a scoped allocation per tile would synchronise the
    three warpgroups at every tile); then waits for the last output store."""
    specs = in_specs(config, 0, 0, scalar_b=scalar_b)
    out_tile = plgpu.SMEM((config.tile_m, config.tile_n), out_dtype, transforms=out_transforms)
    pl.run_scoped(fn, stages=_ws_pipeline(config, specs, alloc_steps).get_allocations(*operands),
                  out_smem=out_tile, collective_axes="wg")
    plgpu.wait_smem_to_gmem(0)


def persistent_units(config, num_tiles: int, num_sms: int | None = None) -> int:
    """CTAs (clusters, in clusters) that `launch_tiles` launches for `num_tiles` (cluster) tiles."""
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    cm, cn = cluster_shape(config)
    return min(num_tiles, num_sms // (cm * cn)) if config.persistent else num_tiles


def launch_tiles(kernel, out_type, config, num_tiles: int, num_sms: int | None = None, **kwargs):
    """`plgpu.kernel` over `num_tiles` output tiles (cluster tiles, `cluster_tiles`, in clusters):
    one CTA (cluster) per tile, or with `config.persistent` one CTA per SM (`num_sms`, the
    device's when None; fewer for fewer tiles), on grid axis "sm", and cluster axis "cluster" of
    `cluster_m * cluster_n` CTAs; with `config.warp_specialized`, `WS_CONSUMER_WGS + 1` warpgroups on thread axis "wg"."""
    cm, cn = cluster_shape(config)
    c = cm * cn
    units = persistent_units(config, num_tiles, num_sms)  # CTAs, or clusters
    if c > 1:
        kwargs.update(cluster=(c,), cluster_names=("cluster",))
        _mgpu.warn_if_interpreted_cluster_may_hang(c)
    if config.warp_specialized:
        kwargs.update(num_threads=WS_CONSUMER_WGS + 1, thread_name="wg")
    kwargs.update(_mgpu.compiler_params())  # profiler events, inside `_mgpu.profile` only
    return plgpu.kernel(kernel, out_type=out_type, grid=(units,), grid_names=("sm",), **kwargs)


def chunk_product(a_smem, b_smem, shape: tuple[int, int]) -> jax.Array:
    """`a @ b.T` of one 128-wide chunk: FP8 wgmma into a fresh (zeroed) f32 accumulator.

    B is stored K-major (N, 128) and passed transposed: FP8 wgmma takes no other B layout. Reading
    the accumulator waits for the wgmma, so the pipeline may refill both SMEM slots afterwards.
    """

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.T)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

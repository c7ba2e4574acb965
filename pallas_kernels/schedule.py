"""The grouped GEMMs' work schedule, in plain XLA: which (row tile, group) pairs the row-grouped
kernel visits, and where each group's rows or tokens start and end. Shared by the kernels and
by `jfp8.reference`'s grouped references, so both walk the same items."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._hopper import cdiv


def group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, ends), each (G,) int32: the row range of every group in the sorted batch."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    return ends - sizes, ends

def tiles_touched(starts: jax.Array, ends: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """(first, count): the first tile of `tile` rows that each range touches, and how many it
    touches (0 for an empty range)."""
    first = starts // tile
    return first, jnp.where(ends > starts, (ends - 1) // tile - first + 1, 0)

def row_tile_work(group_sizes: jax.Array, rows: int, tile_m: int) -> tuple[jax.Array, ...]:
    """The (row tile, group) work items of the row-grouped GEMM, computed in XLA.

    A row tile that straddles group boundaries is visited once per group it holds, and every visit
    stores only that group's rows, so each output row is written exactly once, with its own
    group's weight. The rows past `sum(group_sizes)` form a pseudo-group `G` whose items store
    zeros without any matmul.

    Returns:
      `(group, tile, lo, hi)`, each `(cdiv(rows, tile_m) + G,)` int32 (a static bound on the
      number of items): item i stores rows `[lo, hi)` of row tile `tile` with the weight of
      `group`. Unused items have `group == G` and `lo == hi`.
    """
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    tail = jnp.maximum(rows - jnp.sum(sizes), 0)[None]
    starts, ends = group_bounds(jnp.concatenate([sizes, tail]))  # [G + 1]
    first, count = tiles_touched(starts, ends, tile_m)
    item_ends = jnp.cumsum(count)  # [G + 1]: items up to the end of each (pseudo-)group
    items = jnp.arange(cdiv(rows, tile_m) + groups, dtype=jnp.int32)
    # Every item against every group end at once, one fusion ([items, G + 1], small: items are
    # about rows / tile_m + G). jnp's default method is a binary search in a while loop, which on a
    # GPU launches ~5 small kernels per halving (6 halvings for 32 groups): 24 such loops put 832
    # launches and 2.3 ms in the `gpu` preset's predicted FP8 step (benchmarks/step_model.py).
    # The same integers either way.
    group = jnp.searchsorted(item_ends, items, side="right", method="compare_all").astype(jnp.int32)
    used = group <= groups
    group = jnp.minimum(group, groups)
    tile = first[group] + items - (item_ends[group] - count[group])
    lo = jnp.maximum(starts[group], tile * tile_m)
    hi = jnp.minimum(ends[group], (tile + 1) * tile_m)
    zero = jnp.zeros_like(items)
    return group, jnp.where(used, tile, zero), jnp.where(used, lo, zero), jnp.where(used, hi, zero)

def check_group_sizes(group_sizes: jax.Array, rows: int, groups: int | None = None) -> None:
    if group_sizes.ndim != 1 or (groups is not None and group_sizes.shape[0] != groups):
        want = "(G,)" if groups is None else f"({groups},), one size per weight"
        raise ValueError(f"group_sizes must have shape {want}, got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers (int32), got {group_sizes.dtype}")
    if isinstance(group_sizes, jax.core.Tracer):
        return  # traced (under jit): the values cannot be checked here
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes}")
    if sizes.sum() > rows:
        raise ValueError(f"group_sizes sum to {sizes.sum()}, more than the {rows} input rows")

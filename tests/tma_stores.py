"""What a Mosaic GPU kernel's TMA stores write on Hopper, where the interpreter cannot tell.

The interpreter clips every SMEM -> GMEM copy to the destination's shape, axis by axis, as a
tensor-map TMA store does on the hardware. But Mosaic GPU (jax 0.11.2) does not lower every store
to a tensor-map store: in the Lane semantics Pallas passes `OOBFillMode.UNDEFINED` for stores
(`jax/_src/pallas/mosaic_gpu/primitives.py`, `_copy_smem_to_gmem_lowering`), and
`LaunchContext.async_copy` (`jax/experimental/mosaic/gpu/launch_context.py`,
`is_simple_contiguous_copy`) then emits a plain `cp.async.bulk.global.shared::cta` for any window
that is contiguous in GMEM (and unswizzled in SMEM): a flat byte copy whose length is clamped only
at the end of the whole array. Such a window that runs past the end of an inner axis does not
lose its out-of-bounds part on the hardware; it writes it into the next rows of the array.

On an H100 that is what made `quantize_tile_and_column_t` differ from the reference at 256 x 384
(docs/gpu.md, "First contact"): the column scales of a chunk past the last column, a [1, 128]
f32 row, landed on the next row block's first 128 column scales (491 and 495 differing bytes at
the two recorded seeds, exactly).

`flat_store_spills()` records, while the interpreter runs, every store whose window is contiguous
in GMEM and whose flat, end-clamped extent differs from the clipped one: a store the hardware
would spill. It ignores the SMEM swizzle (a swizzled source takes the tensor map, which clips),
so it is stricter than the hardware there; a kernel that never relies on clipping along an
inner axis passes it either way.
"""

from __future__ import annotations

import contextlib
import math

from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

import helpers


def _window(rng: tuple) -> tuple[list[int], list[int]]:
    """(starts, sizes) of an interpreter access range; an integer index is a size-1 window."""
    starts, sizes = [], []
    for r in rng:
        if isinstance(r, int):
            starts.append(r)
            sizes.append(1)
            continue
        if r.step not in (None, 1):
            raise NotImplementedError(f"strided store window {rng}")
        starts.append(r.start)
        sizes.append(r.stop - r.start)
    return starts, sizes


def _contiguous(sizes: list[int], shape: tuple[int, ...]) -> bool:
    """Mosaic GPU's `check_contiguous_slice` for a row-major GMEM array: every axis but those of
    size 1 has the stride the window itself would have."""
    return all(
        size == 1 or math.prod(shape[d + 1:]) == math.prod(sizes[d + 1:])
        for d, size in enumerate(sizes)
    )


def spilled_elements(rng: tuple, shape: tuple[int, ...]) -> int:
    """Elements that a flat, end-clamped copy of window `rng` writes outside the window's clipped
    part (0 for a window that is not contiguous: that one takes the tensor map, which clips)."""
    starts, sizes = _window(rng)
    if not _contiguous(sizes, shape):
        return 0
    offset = sum(s * math.prod(shape[d + 1:]) for d, s in enumerate(starts))
    flat = max(0, min(offset + math.prod(sizes), math.prod(shape)) - offset)
    clipped = interpret_utils.clip_range_to_shape(rng, shape)
    inside = 0 if clipped is None else math.prod(_window(clipped)[1])
    return flat - inside


@contextlib.contextmanager
def flat_store_spills():
    """Yields a list that collects, for every TMA store the interpreter runs in the block, whose
    flat copy would spill on Hopper, (destination shape, window, spilled elements)."""
    clip = gpu_callbacks._clip_store_to_shape  # the interpreter's per-axis clip of every store

    spills = []

    def checked(access, val, shape):
        n = spilled_elements(access.range, tuple(shape))
        if n:
            spills.append((tuple(shape), access.range, n))
        return clip(access, val, shape)

    gpu_callbacks._clip_store_to_shape = checked
    try:
        yield spills
    finally:
        gpu_callbacks._clip_store_to_shape = clip


@contextlib.contextmanager
def no_flat_store_spills():
    """Fails the block (after it ran) if any of its TMA stores would spill on Hopper
    (`flat_store_spills`): for wrapping every interpreted run of a test file."""
    with flat_store_spills() as spills:
        yield
    assert not spills, (
        "TMA stores that Mosaic lowers as flat copies run past an inner axis of their array, "
        "which Hopper writes into the next rows (destination shape, window, elements): "
        f"{spills[:4]}"
    )


def interpret(fn, *args, **kwargs):
    """`helpers.interpret`, failing if any TMA store would write past an inner axis's end on
    Hopper, where Mosaic lowers it as a flat copy that the interpreter's per-axis clip hides."""
    with no_flat_store_spills():
        return helpers.interpret(fn, *args, **kwargs)


def interpret_detecting_races(fn, *args):
    """`helpers.interpret_detecting_races` with `interpret`'s store check."""
    with no_flat_store_spills():
        return helpers.interpret_detecting_races(fn, *args)

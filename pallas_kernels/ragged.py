"""The BF16 baseline's grouped (MoE) GEMMs on Hopper: jax's own Mosaic GPU ragged-dot kernels
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` and `transposed_ragged_dot_mgpu`), held to
the contract jfp8's grouped ops have: `jax.lax.ragged_dot(x, w, group_sizes)` with an FP32
accumulator, output in x's dtype, `sum(group_sizes) <= T` and zeros in the rows past the sum.

Why not `jax.lax.ragged_dot` itself: XLA 0.11.2 lowers it for a GPU to a dense masked dot over
every group (G times the FLOPs, a `[T, G, K]` operand), and the reference's scan over work items
(`jfp8.reference.ragged_dot_reference`) copies its whole FP32 accumulator every step on a GPU.
A BF16 step timed through either would flatter FP8. These are the well-kept kernels jax ships;
jfp8 only adapts their inputs:

* `ragged_matmul(x, w, group_sizes)`: x [T, K] @ w[g] [K, N] per group (Fprop).
* `ragged_matmul_nt(dy, w, group_sizes)`: dy [T, N] @ w[g]ᵀ (Dgrad; w as stored, [G, K, N]).
* `ragged_wgrad(x, dy, group_sizes)`: x_gᵀ · dy_g per group, [G, K, N] (Wgrad).

`unsupported(x, w)` says which shapes they do not take (the caller runs the reference there).
Their summation order is the tensor core's, not the reference's: results agree to BF16 rounding
of FP32 sums, not to the bit (tests/test_ragged.py, in the Mosaic GPU interpreter).
"""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from pallas_kernels import _mgpu
from pallas_kernels._hopper import pad_rows

# Not tuned on hardware (no GPU has run them in jfp8 yet): jax's own search space's middle, chosen
# because it compiles deviceless for the H100 without spills (benchmarks/hopper_build.py).
CONFIG = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported(x: jax.Array, w: jax.Array) -> str | None:
    """Why the three kernels cannot take x [T, K] and w [G, K, N], or None when they can.

    Every GEMM of the forward and backward must fit: K and N are each a contracted axis (a
    multiple of block_k) and an output axis, stored in whole 128-wide tiles (a narrower last tile
    would be stored by a flat bulk copy past its row's end: tests/tma_stores.py)."""
    tile = CONFIG["block_n"]
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"dtype {x.dtype} (jax's ragged kernels take bf16 and f16)"
    t, k = x.shape
    g, _, n = w.shape
    if t == 0 or g == 0:
        return "an empty problem"
    if k % tile or n % tile:
        return f"K={k} or N={n} not a multiple of {tile}"
    return None


def _covering(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Group sizes summing to `rows` (the last group takes the rows past the sum, which jax's
    kernel would leave unwritten), and the true sum (rows at or past it are zeroed after)."""
    total = jnp.sum(group_sizes)
    return group_sizes.at[-1].add(rows - total), total


def _zero_past(y: jax.Array, total: jax.Array) -> jax.Array:
    return jnp.where(jnp.arange(y.shape[0])[:, None] < total, y, jnp.zeros((), y.dtype))


# jax's kernels copy token rows with TMA in whole 8-row tiles: a token count that is not a
# multiple of 8 failed to lower ("dimension 0 must have size smaller or a multiple of its tiling
# 8", 276 tokens on an H100, 2026-11-28). The tokens get zero rows up to a multiple of 8, as the
# jfp8 kernels' operands do (`_hopper.pad_rows`).


def ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [T, K] (sorted by group) @ w [G, K, N] per group -> [T, N] in x's dtype."""
    rows = x.shape[0]
    x = pad_rows(x)
    sizes, total = _covering(group_sizes, x.shape[0])
    y = ragged_dot_mgpu.ragged_dot(x, w.astype(x.dtype), group_sizes=sizes, **CONFIG)
    return _zero_past(y, total)[:rows]


def ragged_matmul_nt(dy: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """dy [T, N] @ w[g]ᵀ per group, w [G, K, N] as stored -> [T, K] in dy's dtype."""
    rows = dy.shape[0]
    dy = pad_rows(dy)
    sizes, total = _covering(group_sizes, dy.shape[0])
    y = ragged_dot_mgpu.ragged_dot(dy, w.astype(dy.dtype), group_sizes=sizes, transpose_rhs=True, **CONFIG)
    return _zero_past(y, total)[:rows]


class _JaxWithSms:
    """`jax`, but for `devices()`: one device with the given SM count."""

    def __init__(self, real, sms: int):
        self._real, self._device = real, types.SimpleNamespace(core_count=sms)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def devices(self, *args, **kwargs):
        return [self._device]


@contextlib.contextmanager
def _sm_count_from_build_target():
    """jax 0.11.2's transposed kernel sizes its persistent grid from `jax.devices()[0].core_count`,
    which is a CPU's (no such attribute) when lowering deviceless or in the interpreter. Inside this
    block, its module sees the SM count jfp8's kernels use (`_mgpu.num_sms`: the build target's,
    the GPU's, else an H100's); nothing else of jax changes."""
    module = transposed_ragged_dot_mgpu
    real = module.jax
    module.jax = _JaxWithSms(real, _mgpu.num_sms())
    try:
        yield
    finally:
        module.jax = real


def ragged_wgrad(x: jax.Array, dy: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x_gᵀ · dy_g per group over the token axis: x [T, K], dy [T, N] -> [G, K, N] in x's dtype
    (FP32 accumulation). Tokens past sum(group_sizes) belong to no group; empty groups give 0."""
    with _sm_count_from_build_target():  # zero token rows past T belong to no group
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            pad_rows(x), pad_rows(dy.astype(x.dtype)), group_sizes=group_sizes, **CONFIG)

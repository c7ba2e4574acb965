"""A deliberately racy Mosaic GPU kernel and its clean twin: the proof that a race detector sees.

A clean compute-sanitizer racecheck on the real kernels says something only if racecheck flags
the kind of bug it is trusted to find. The bug the kernels' pipelines could have is a stage
released before it is read: the consumer arrives on the stage's "consumed" barrier, the producer
refills the stage, and the consumer reads the refill. Both kernels here run that pipeline over
one SMEM stage, one producer warpgroup and one consumer warpgroup: the producer writes step s's
values into the stage and arrives on "produced"; the consumer waits for them, copies the stage to
its output, and arrives on "consumed", which the producer waits on before the next step. The
mutant arrives on "consumed" *before* its copy, so the producer's next write races the consumer's
read. The stage is written and read by the warpgroups' own threads (not TMA), which every race
detector models.

The GPU session runs both under racecheck (`gpu_smoke.py --kernel mutant_early_release` and
`mutant_clean_release`); tests/test_gpu_session.py runs both under the Mosaic GPU interpreter's
race detector on the CPU, where the mutant must be flagged and the twin must not.

On an H100 racecheck flagged neither (0 hazards everywhere). So a third kernel, `unsynchronized`,
races with no barrier at all: the producer writes every step into the stage and the consumer
copies it out, neither waiting on anything. That is the hazard racecheck is built for (no
__syncthreads between a write and another warp's read); if racecheck misses it too while it
flags the same hazard in plain CUDA (`hopper/racecheck_controls.cu`), it does not instrument
Mosaic GPU's kernels, and its silence on them means nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

STEPS = 4
ROWS, COLS = 64, 64  # one warpgroup's register tile of f32 (the three SMEM buffers: 144 KiB)
PRODUCER, CONSUMER = 1, 0  # warpgroup indices


def _body(x_gmem, o_gmem, x_smem, stage, o_smem, loaded, produced, consumed, *, early_release: bool):
    wg = lax.axis_index("wg")
    if early_release is None:  # `unsynchronized`: no barrier between the stage's writes and reads
        _unsynchronized(x_gmem, o_gmem, x_smem, stage, o_smem, loaded, wg)
        return

    @pl.when(wg == PRODUCER)
    def _producer():
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, loaded)
        plgpu.barrier_wait(loaded)
        for step in range(STEPS):
            if step:
                plgpu.barrier_wait(consumed)  # the stage is free again
            stage[...] = x_smem[step]
            plgpu.barrier_arrive(produced)
        plgpu.barrier_wait(consumed)  # the last step's release: every phase completes

    @pl.when(wg == CONSUMER)
    def _consumer():
        for step in range(STEPS):
            plgpu.barrier_wait(produced)
            if early_release:  # the bug: released before it is read
                plgpu.barrier_arrive(consumed)
            o_smem[step] = stage[...]
            if not early_release:
                plgpu.barrier_arrive(consumed)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)


def _unsynchronized(x_gmem, o_gmem, x_smem, stage, o_smem, loaded, wg):
    @pl.when(wg == PRODUCER)
    def _producer():
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, loaded)
        plgpu.barrier_wait(loaded)
        for step in range(STEPS):
            stage[...] = x_smem[step]

    @pl.when(wg == CONSUMER)
    def _consumer():
        for step in range(STEPS):
            o_smem[step] = stage[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames="early_release")
def release_pipeline(x: jax.Array, *, early_release: bool | None) -> jax.Array:
    """x: (STEPS, ROWS, COLS) float32 -> the same values, passed through the one-stage pipeline.

    With `early_release=False` the result equals x on any hardware; with True it may hold a later
    step's values wherever the race is lost (on hardware it usually is not, which is why a
    detector and not the output has to find it). With None (`unsynchronized`) nothing orders the
    stage's writes and reads: the result is whatever the consumer happened to read."""
    if x.shape != (STEPS, ROWS, COLS) or x.dtype != jnp.float32:
        raise ValueError(f"x must be float32 {(STEPS, ROWS, COLS)}, got {x.dtype} {x.shape}")
    kernel = plgpu.kernel(
        functools.partial(_body, early_release=early_release),
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=[
            plgpu.SMEM(x.shape, x.dtype),
            plgpu.SMEM((ROWS, COLS), x.dtype),
            plgpu.SMEM(x.shape, x.dtype),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
        ],
        num_threads=2,
        thread_name="wg",
    )
    return kernel(x)

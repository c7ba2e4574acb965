"""Checkpoints with orbax: written atomically, so a killed run never leaves a half-written step.

orbax writes each step into a temporary directory (`<step>.orbax-checkpoint-tmp*`) and renames it
into place once every process has written its part; a temporary directory is never restored. A
checkpoint holds the whole training state pytree (parameters, optimizer state, router biases,
step, RNG key; the data position is the step, since batches are a pure function of (seed, step))
and JSON metadata.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores the training state under `directory` (keeps the newest `keep`).

    In a multi-process job every process creates one on the same directory and calls `save` and
    `restore` together; each writes and reads the shards of its own devices. `remove_partial`:
    delete the temporary directories of saves that never completed (a killed run's); only the
    run that owns the directory may, since a running save looks the same.
    """

    def __init__(self, directory: str | pathlib.Path, keep: int = 2, remove_partial: bool = False):
        self.directory = pathlib.Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=remove_partial),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps saved here, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Writes `state` (a pytree of arrays) and `meta` (JSON) for `step`, and waits until the
        step is committed on disk."""
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, step: int | None, like):
        """(state, meta) of `step` (the newest when None), shaped like the pytree `like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory} to resume from")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        return out["state"], out["meta"]

    def close(self) -> None:
        self._manager.close()

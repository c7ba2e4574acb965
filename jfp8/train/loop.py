"""The training loop: a jitted train step, evaluation, metrics, checkpoints and resume.

One `train(config)` call trains a `jfp8.nn.Transformer` on a byte-level corpus and writes, under
`config.out`: `config.json` (the resolved configuration), `metrics.jsonl` (one JSON object per
logged step, with `step`, `loss`, its parts, `lr`, `tokens_per_s`; evaluation lines carry
`val_loss`), and `checkpoints/` (orbax, atomic). `resume=True` continues from the newest
checkpoint; the batches are a pure function of (seed, step), so a resumed run's losses equal the
uninterrupted run's step for step. In a multi-process job (`jfp8.mesh.initialize_distributed`)
every process runs `train` on the same `out`: each builds only its rows of each batch, all write
and restore the checkpoints together, and process 0 alone writes the metrics, the configuration
and the progress bar.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.train import data
from jfp8.train.checkpoint import Checkpointer
from jfp8.train.config import _BOOKKEEPING, PRESET_TRAINING, PRESETS, Precision, TrainConfig  # noqa: F401  re-exported
from jfp8.train.step import TrainSetup, build, scaled_value_and_grad  # noqa: F401  re-exported

class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss; the last good checkpoint is kept."""

@jax.jit
def _finite(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite: one program for the whole state."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)

def _all_finite(tree) -> bool:
    return bool(_finite(tree))

# How long the processes of a job wait for each other's compiles (`_compile_together`).
COMPILE_BARRIER_S = 1800

def _compile_together(train_step, eval_step, state: dict, tokens) -> None:
    """A multi-process job's loop programs compiled before any of them runs, then a barrier.

    On the CPU, processes other than 0 never read jax's persistent cache back: their cache keys
    differ from process 0's (XLA's CPU topology fingerprint is per process) and only process 0
    writes entries. So on a second start (a resume) process 0 loads its steps at once while the
    others compile theirs, and gloo gives a process 30 s to join a collective's first use: a
    longer compile failed the job ("Gloo context initialization failed: ... GetKeyValue() timed
    out"; CI saw it once, in a resumed 2-process job on a loaded machine). Compiled here, the steps
    are what the jitted calls then run (jax reuses the executables)."""
    train_step.lower(state["params"], state["rest"], state["opt_state"], tokens).compile()
    eval_step.lower(state["params"], state["rest"], tokens).compile()
    _finite.lower(state).compile()
    from jfp8 import mesh as meshes

    meshes.barrier("jfp8-train-compiled", timeout_s=COMPILE_BARRIER_S)

def _trim_metrics(path: pathlib.Path, last_step: int) -> None:
    """Drops lines logged after `last_step` (a killed run may have logged past its checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))

def train(
    config: TrainConfig, *, resume: bool = False, stop_after: int | None = None, mesh=None
) -> dict:
    """Trains; returns a summary dict. `stop_after` ends the run after that step as if it had been
    killed there (tests of resume). With a `jax.sharding.Mesh` of axes ("data", "expert")
    (`jfp8.mesh.make_mesh`, over the devices of every process of a job), the step runs data- and
    expert-parallel (FP8 dispatch)."""
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    data.check_seq_len(split, config.seq_len)
    if mesh is None:
        model_cfg, graphdef, params, rest, tx, schedule, train_step, eval_step = build(config)
        place = lambda make_rows, shape: jax.device_put(make_rows(slice(None)))  # noqa: E731
    else:
        from jfp8 import mesh as meshes
        from jfp8.train import sharded

        model_cfg, graphdef, params, rest, tx, schedule, train_step, eval_step = (
            sharded.build_sharded(config, mesh)
        )
        place = functools.partial(meshes.shard_rows, mesh=mesh)  # this process's rows only
    writer = jax.process_index() == 0  # of metrics.jsonl, config.json and the progress bar
    opt_state = tx.init(params)
    if mesh is not None:
        # Moments placed like their parameters, as the step returns them: else step 2 compiles again.
        opt_state = meshes.shard_params(opt_state, mesh)
        meshes.barrier("jfp8-train-setup")  # before the first collectives (orbax's, the steps')
    ckpt = Checkpointer(out / "checkpoints", keep=config.keep_checkpoints, remove_partial=True)
    metrics_path = out / "metrics.jsonl"
    start = 0
    state = {"params": params, "rest": rest, "opt_state": opt_state}
    if resume and ckpt.latest_step() is not None:
        # Through TrainConfig, so that fields added since the run was saved take their defaults.
        saved = TrainConfig.from_json(json.loads((out / "config.json").read_text())).to_json()
        now = config.to_json()
        differ = [k for k in now if k not in _BOOKKEEPING and saved.get(k) != now[k]]
        if differ:
            raise ValueError(
                f"--resume: {out / 'config.json'} differs from this run's configuration in {differ}; "
                "resume with the same settings, or start a new run in another --out"
            )
        state, meta = ckpt.restore(None, state)
        start = int(meta["step"])
        if writer:
            _trim_metrics(metrics_path, start)
    elif writer:
        metrics_path.write_text("")
    if writer:
        (out / "config.json").write_text(json.dumps(config.to_json(), indent=1) + "\n")
    if mesh is None:
        # Restored arrays are committed to a device; commit fresh ones too, so that a resumed run
        # (and the next segment of a segmented one) reuses the compiled step instead of recompiling.
        state = jax.device_put(state, jax.devices()[0])

    params, rest, opt_state = state["params"], state["rest"], state["opt_state"]
    shape = (config.batch_size, config.seq_len)
    val = [place(functools.partial(data.eval_batch, split.val, *shape, config.eval_batches, i), shape)
           for i in range(config.eval_batches)]
    if mesh is not None and jax.process_count() > 1:
        _compile_together(train_step, eval_step, {"params": params, "rest": rest, "opt_state": opt_state}, val[0])
    tokens_per_step = config.batch_size * config.seq_len
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    make = lambda step: place(  # noqa: E731
        functools.partial(data.train_batch, split.train, *shape, config.batch_seed, step), shape
    )
    bar = _progress(config, start, end) if writer else _NoBar()
    t_start = t_log = time.perf_counter()
    last = {}
    prefetch = data.Prefetcher(make, start, end)
    try:
        with (metrics_path if writer else pathlib.Path(os.devnull)).open("a") as log:
            for step, tokens in prefetch:
                params, rest, opt_state, m = train_step(params, rest, opt_state, tokens)
                done = step + 1
                if done % config.log_every == 0 or done == end:
                    m = {k: _to_json_number(v) for k, v in m.items()}
                    if m.get("dropped_assignments", 0):
                        raise RuntimeError(f"step {done}: {m['dropped_assignments']:.0f} expert assignments dropped")
                    if not math.isfinite(m["loss"]):
                        raise NonFiniteLossError(
                            f"loss is {m['loss']} at step {done}; stopping. The last good checkpoint "
                            f"(step {ckpt.latest_step()}) is in {ckpt.directory}; lower the learning "
                            "rate or check the data, then resume from it with --resume"
                        )
                    now = time.perf_counter()
                    steps_since = done - (last.get("step", start))
                    m.update(step=done, lr=float(schedule(step)),
                             tokens_per_s=steps_since * tokens_per_step / (now - t_log))
                    t_log, last = now, m
                    if done % config.eval_every == 0 or done == config.steps:
                        m["val_loss"] = float(np.mean([float(eval_step(params, rest, v)) for v in val]))
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                                    **_worst_layer(m, model_cfg.moe_layer_names))
                # `stop_after` emulates a run killed after that step: no extra evaluation or
                # checkpoint, exactly like the uninterrupted run at that step.
                if done % config.ckpt_every == 0 or done == config.steps:
                    state = {"params": params, "rest": rest, "opt_state": opt_state}
                    if not _all_finite(state):
                        raise NonFiniteLossError(
                            f"non-finite parameters after step {done}; not saving them. The last good "
                            f"checkpoint (step {ckpt.latest_step()}) is in {ckpt.directory}"
                        )
                    ckpt.save(done, state, {"step": done, "seed": config.seed})
                bar.update(1)
    finally:
        prefetch.close()
        bar.close()
        ckpt.close()
    wall = time.perf_counter() - t_start
    return {
        "steps": end,
        "tokens": (end - start) * tokens_per_step,
        "wall_s": wall,
        "tokens_per_s": (end - start) * tokens_per_step / wall if wall > 0 else float("nan"),
        "final_loss": last.get("loss"),
        "final_val_loss": last.get("val_loss"),
    }

class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass

def _progress(config: TrainConfig, start: int, end: int):
    if not config.progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=end, initial=start, desc=f"{config.preset}/{config.precision}", unit="step")

def _to_json_number(v):
    """A metric as a float, or a list of numbers (per-layer metrics; integer ones stay integers)."""
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a)
    return a.tolist()

def _worst_layer(m: dict, names: tuple[str, ...]) -> dict:
    """The progress line's balance readout: the worst MoE layer's max/mean load and dead experts."""
    ratios = m.get("load_max_over_mean") or []
    if not ratios:
        return {}
    i = int(np.argmax(ratios))
    return {"load": f"{ratios[i]:.2f}@{names[i]}", "dead": int(max(m["dead_experts"]))}

def worst_load(row: dict) -> float:
    """The worst MoE layer's max/mean expert load of a metrics.jsonl row; reads the per-layer
    `load_max_over_mean` list, or the scalar `max_over_mean_load` of runs logged before it."""
    if "load_max_over_mean" in row:
        return max(row["load_max_over_mean"])
    return row["max_over_mean_load"]

def last_quarter_balance(rows: list[dict], steps: int, names: list[str] | tuple[str, ...]) -> dict:
    """Each MoE layer's balance over the logged steps of the last quarter of a `steps`-step run:
    {"load_max_over_mean": mean of max/mean load, "dead_experts_mean", "dead_experts_max"}, each
    {layer name: value}; empty dicts when no step of the last quarter was logged."""
    tail = [r for r in rows if r["step"] > 0.75 * steps]
    if not tail:
        return {"load_max_over_mean": {}, "dead_experts_mean": {}, "dead_experts_max": {}}
    load = np.array([r["load_max_over_mean"] for r in tail], float)  # [logged steps, layers]
    dead = np.array([r["dead_experts"] for r in tail])
    return {
        "load_max_over_mean": dict(zip(names, load.mean(0).tolist())),
        "dead_experts_mean": dict(zip(names, dead.mean(0).tolist())),
        "dead_experts_max": dict(zip(names, dead.max(0).astype(int).tolist())),
    }

def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl file."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]

"""A finished run's validation loss on the whole validation split, from its saved checkpoints.

The training loop evaluates a few fixed batches as it goes (cheap, and enough to watch a run).
A comparison between runs needs more: `evaluate_checkpoints` restores the checkpoints a run
kept (`TrainConfig.keep_checkpoints`) and evaluates each on every byte of the validation split,
so that the number is not one draw of a small evaluation set.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jfp8.train import data
from jfp8.train.checkpoint import Checkpointer
from jfp8.train.config import TrainConfig
from jfp8.train.step import build


def evaluate_checkpoints(run_dir: str | pathlib.Path, steps: list[int] | None = None,
                         batch_size: int = 64) -> dict[int, float]:
    """{step: cross-entropy (nats/byte) on the whole validation split} for each kept checkpoint
    of the run in `run_dir` (or only `steps`), with the run's own model, precision and corpus."""
    run = pathlib.Path(run_dir)
    config_path = run / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: pass the --out directory of a training run")
    config = TrainConfig.from_json(json.loads(config_path.read_text()))
    ckpt = Checkpointer(run / "checkpoints", keep=config.keep_checkpoints)
    try:
        saved = ckpt.all_steps()
        missing = sorted(set(steps or ()) - set(saved))
        if missing or not saved:
            raise FileNotFoundError(
                f"{run / 'checkpoints'} holds steps {saved}, not {missing or 'any'}; train with "
                "ckpt_every and keep_checkpoints that keep the steps to evaluate"
            )
        setup = build(config)
        like = {"params": setup.params, "rest": setup.rest, "opt_state": setup.tx.init(setup.params)}
        split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
        windows = data.validation_windows(split.val, config.seq_len)
        out = {}
        for step in steps or saved:
            state, _ = ckpt.restore(step, like)
            # eval_step's CE is a mean over its batch; weight each batch by its windows.
            total = 0.0
            for lo in range(0, len(windows), batch_size):
                batch = windows[lo : lo + batch_size]
                total += float(setup.eval_step(state["params"], state["rest"], batch)) * len(batch)
            out[step] = total / len(windows)
        return out
    finally:
        ckpt.close()


def mean_validation_ce(per_step: dict[int, float]) -> float:
    """The average over the evaluated checkpoints (the number a comparison reports)."""
    return float(np.mean(list(per_step.values())))

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
                         batch_size: int = 64, progress: bool | None = None) -> dict[int, float]:
    """{step: cross-entropy (nats/byte) on the whole validation split} for each kept checkpoint
    of the run in `run_dir` (or only `steps`), with the run's own model, precision and corpus.

    `progress`: a progress bar over the batches (minutes on a CPU); None shows it when the run
    trained with one (`TrainConfig.progress`)."""
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
        todo = steps or saved
        starts = range(0, len(windows), batch_size)
        bar = _progress(config.progress if progress is None else progress, len(todo) * len(starts),
                        f"{run.name}: whole-split validation")
        out = {}
        for step in todo:
            state, _ = ckpt.restore(step, like)
            bar.set_postfix_str(f"step {step}")
            # eval_step's CE is a mean over its batch; weight each batch by its windows.
            total = 0.0
            for lo in starts:
                batch = windows[lo : lo + batch_size]
                total += float(setup.eval_step(state["params"], state["rest"], batch)) * len(batch)
                bar.update()
            out[step] = total / len(windows)
        bar.close()
        return out
    finally:
        ckpt.close()


def _progress(show: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", disable=not show)


def mean_validation_ce(per_step: dict[int, float]) -> float:
    """The average over the evaluated checkpoints (the number a comparison reports)."""
    return float(np.mean(list(per_step.values())))

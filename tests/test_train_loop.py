"""The training loop on the tiny preset: the loss falls, resume is exact, bad input is refused."""

import dataclasses
import json

import pytest

from jfp8.train.loop import NonFiniteLossError, TrainConfig, read_metrics, train
from jfp8.train.optim import OptimizerConfig

TINY = TrainConfig(
    preset="tiny", steps=12, batch_size=4, seq_len=64, log_every=1, eval_every=6, eval_batches=2,
    ckpt_every=6, optimizer=OptimizerConfig(peak_lr=3e-3, warmup_steps=2), progress=False,
)


@pytest.mark.slow
def test_tiny_fp8_loss_decreases_and_metrics_are_written(tmp_path):
    cfg = dataclasses.replace(TINY, steps=30, eval_every=15, ckpt_every=30, out=str(tmp_path / "run"))
    summary = train(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"step", "loss", "ce", "mtp_ce", "balance", "lr", "tokens_per_s"} <= set(rows[0])
    first, last = sum(r["ce"] for r in rows[:3]) / 3, sum(r["ce"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)  # from ~5.5 nats (uniform over 256 bytes) down
    assert rows[-1]["val_loss"] < rows[14]["val_loss"] < 5.6
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["precision"] == "fp8" and saved["model"]["recipe"]["fprop"] is True
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 64


@pytest.mark.slow
def test_resume_replays_the_uninterrupted_run_exactly(tmp_path):
    full = train(dataclasses.replace(TINY, out=str(tmp_path / "full")))
    cut = dataclasses.replace(TINY, out=str(tmp_path / "cut"))
    train(cut, stop_after=8)  # "killed" after step 8; the newest checkpoint is step 6
    rows_cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert rows_cut[-1]["step"] == 8
    train(cut, resume=True)
    a = read_metrics(tmp_path / "full" / "metrics.jsonl")
    b = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, 13))
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "mtp_ce", "balance", "grad_norm", "val_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    assert full["final_loss"] == a[-1]["loss"]


def test_resume_refuses_a_different_configuration(tmp_path):
    # TINY's model, optimizer and steps: the step functions compiled by the other tests are reused.
    cfg = dataclasses.replace(TINY, ckpt_every=1, out=str(tmp_path / "r"))
    train(cfg, stop_after=2)
    with pytest.raises(ValueError, match="differs"):
        train(dataclasses.replace(cfg, seed=1), resume=True)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = dataclasses.replace(
        TINY, steps=20, ckpt_every=1, eval_every=100, out=str(tmp_path / "nan"),
        optimizer=OptimizerConfig(peak_lr=1e9, warmup_steps=0, clip_norm=1e9),
    )
    with pytest.raises(NonFiniteLossError, match="last good checkpoint"):
        train(cfg)
    from jfp8.train.checkpoint import Checkpointer

    latest = Checkpointer(tmp_path / "nan" / "checkpoints").latest_step()
    assert latest is not None and latest >= 1  # the good steps before the blow-up were kept


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(dataclasses.replace(TINY, corpus=str(tmp_path / "nope.txt"), out=str(tmp_path / "a")))
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be " * 5)
    with pytest.raises(ValueError, match="does not fit the data"):
        train(dataclasses.replace(TINY, corpus=str(small), out=str(tmp_path / "b")))
    with pytest.raises(ValueError, match="preset"):
        TrainConfig(preset="huge")
    with pytest.raises(ValueError, match="max_seq_len"):
        dataclasses.replace(TINY, seq_len=10**6).model_config()

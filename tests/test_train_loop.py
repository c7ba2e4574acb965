"""The training loop on the tiny preset: the loss falls, resume is exact, bad input is refused."""

import dataclasses
import json

import pytest

from jfp8.train.loop import NonFiniteLossError, TrainConfig, read_metrics, train
from jfp8.train.optim import OptimizerConfig
from helpers import ONE_MOE_LAYER_OVERRIDES

# Every test below but the non-finite one runs this model, optimizer and schedule (steps=30), so
# they share one compiled train step and one eval step (`_step_functions` is cached on them);
# eval_every, ckpt_every, log_every and out are bookkeeping and may differ without a recompile.
TINY = TrainConfig(
    preset="tiny", steps=30, batch_size=4, seq_len=64, log_every=1, eval_every=5, eval_batches=2,
    ckpt_every=30, optimizer=OptimizerConfig(peak_lr=3e-3, warmup_steps=2), progress=False,
)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted 30-step run: the loss test reads it, the resume test replays it."""
    out = tmp_path_factory.mktemp("loop") / "full"
    summary = train(dataclasses.replace(TINY, out=str(out)))
    return out, summary


@pytest.mark.slow
def test_tiny_fp8_loss_decreases_and_metrics_are_written(full_run):
    out, summary = full_run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"step", "loss", "ce", "mtp_ce", "balance", "lr", "tokens_per_s"} <= set(rows[0])
    first, last = sum(r["ce"] for r in rows[:3]) / 3, sum(r["ce"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)  # from ~5.5 nats (uniform over 256 bytes) down
    assert rows[-1]["val_loss"] < rows[14]["val_loss"] < 5.6
    saved = json.loads((out / "config.json").read_text())
    assert saved["precision"] == "fp8" and saved["model"]["recipe"]["fprop"] is True
    # per-MoE-layer balance readouts, named in config.json (tiny: block 1 and the MTP block)
    assert saved["moe_layer_names"] == ["block1", "mtp"]
    n_r, k = saved["model"]["n_routed"], saved["model"]["top_k"]
    for r in rows:
        assert len(r["load_max_over_mean"]) == len(r["dead_experts"]) == len(r["bias_spread"]) == 2
        assert all(1.0 <= x <= n_r / k for x in r["load_max_over_mean"]), r["load_max_over_mean"]
        assert all(isinstance(d, int) and 0 <= d <= n_r - k for d in r["dead_experts"])
        assert all(x >= 0 for x in r["bias_spread"])
    # γ_t = κ·lr_t of the same step, frozen (0) in the last 3 % = 1 of 30 steps
    kappa = saved["model"]["bias_lr_ratio"]
    for r in rows[:-1]:
        assert r["bias_gamma"] == pytest.approx(kappa * r["lr"], rel=1e-5), r
    assert rows[-1]["bias_gamma"] == 0.0
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 64


@pytest.mark.slow
def test_resume_replays_the_uninterrupted_run_exactly(full_run, tmp_path):
    full_out, full = full_run
    cut = dataclasses.replace(TINY, ckpt_every=6, out=str(tmp_path / "cut"))
    train(cut, stop_after=8)  # "killed" after step 8; the newest checkpoint is step 6
    rows_cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert rows_cut[-1]["step"] == 8
    train(cut, resume=True)  # steps 7..30 again from the step-6 checkpoint: evaluations at 10..30
    a = read_metrics(full_out / "metrics.jsonl")
    b = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, 31))
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "mtp_ce", "balance", "grad_norm", "val_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    assert full["final_loss"] == a[-1]["loss"]


def test_resume_refuses_a_different_configuration(tmp_path):
    # TINY's model, optimizer and steps: the step functions compiled for full_run are reused.
    cfg = dataclasses.replace(TINY, ckpt_every=1, out=str(tmp_path / "r"))
    train(cfg, stop_after=2)
    with pytest.raises(ValueError, match="differs"):
        train(dataclasses.replace(cfg, seed=1), resume=True)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # Its own optimizer means its own compile, so a smaller model than TINY's (one MoE block, no
    # dense block, no MTP; still the FP8 recipe): what is tested is the loop's (the divergence, its
    # detection, the checkpoint kept), which does not depend on the model's size. About 40 % of
    # TINY's compile time.
    cfg = dataclasses.replace(
        TINY, steps=20, ckpt_every=1, eval_every=100, out=str(tmp_path / "nan"),
        optimizer=OptimizerConfig(peak_lr=1e9, warmup_steps=0, clip_norm=1e9),
        model_overrides=ONE_MOE_LAYER_OVERRIDES,
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


@pytest.mark.slow
def test_evaluate_checkpoints_is_the_mean_over_every_validation_window(tmp_path, capsys):
    import numpy as np

    from jfp8.train import data
    from jfp8.train.evaluate import evaluate_checkpoints, mean_validation_ce
    from jfp8.train.step import build

    # A small corpus keeps the whole-split evaluation cheap: its validation tenth is 5 windows of
    # 64 bytes and a tail of 40 that no window covers. TINY's model and schedule: no new compile
    # of the train step.
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(data.load_bytes(None)[:3600].tobytes())
    cfg = dataclasses.replace(TINY, corpus=str(corpus), eval_every=100, ckpt_every=10, keep_checkpoints=2,
                              out=str(tmp_path / "run"))
    train(cfg)
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [20, 30]

    got = evaluate_checkpoints(tmp_path / "run", batch_size=4)  # batches of 4 and 1 windows
    assert sorted(got) == [20, 30]
    assert mean_validation_ce(got) == pytest.approx((got[20] + got[30]) / 2)

    # Oracle: each window on its own, restored by hand, the plain mean over windows.
    split = data.train_val_split(data.load_bytes(str(corpus)), cfg.val_fraction)
    assert split.val.size == 360
    windows = data.validation_windows(split.val, cfg.seq_len)
    assert windows.shape == (5, 64) and np.array_equal(windows.reshape(-1), split.val[:320])
    from jfp8.train.checkpoint import Checkpointer

    setup = build(cfg)
    like = {"params": setup.params, "rest": setup.rest, "opt_state": setup.tx.init(setup.params)}
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", keep=2)
    try:
        for step in (20, 30):
            state, _ = ckpt.restore(step, like)
            each = [float(setup.eval_step(state["params"], state["rest"], w[None])) for w in windows]
            assert got[step] == pytest.approx(np.mean(each), rel=1e-5), (step, got[step], each)
    finally:
        ckpt.close()
    assert got[30] != got[20]  # two different checkpoints were read, not one twice

    assert evaluate_checkpoints(tmp_path / "run", steps=[30], batch_size=4) == {30: got[30]}
    # The run trained without a progress bar, so its evaluation shows none unless asked.
    assert "whole-split validation" not in capsys.readouterr().err
    assert evaluate_checkpoints(tmp_path / "run", steps=[30], batch_size=4, progress=True) == {30: got[30]}
    bar = capsys.readouterr().err
    assert "run: whole-split validation" in bar and "2/2" in bar and "step 30" in bar, bar
    with pytest.raises(FileNotFoundError, match=r"holds steps \[20, 30\], not \[10\]"):
        evaluate_checkpoints(tmp_path / "run", steps=[10])
    with pytest.raises(FileNotFoundError, match="--out directory of a training run"):
        evaluate_checkpoints(tmp_path / "nowhere")


def test_validation_windows_and_data_seed():
    import numpy as np

    from jfp8.train import data

    v = np.arange(10, dtype=np.uint8)
    assert data.validation_windows(v, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="shorter than seq_len=11"):
        data.validation_windows(v, 11)
    assert TINY.batch_seed == TINY.seed == 0
    assert dataclasses.replace(TINY, seed=3).batch_seed == 3
    assert dataclasses.replace(TINY, seed=3, data_seed=1003).batch_seed == 1003
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        dataclasses.replace(TINY, keep_checkpoints=0)

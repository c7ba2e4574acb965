"""experiments/balancing.py without training: every arm's command builds a valid run
configuration, and the committed small-preset table follows from the committed metrics."""

import json
import pathlib
import shutil

import pytest

from test_parity_seeds import EXPERIMENTS, _load

RESULTS = EXPERIMENTS / "results" / "balancing-small"


@pytest.fixture(scope="module")
def bal():
    return _load("balancing")


@pytest.fixture(scope="module")
def train_moe():
    return _load("train_moe")


def test_every_arm_builds_its_model(bal, train_moe, tmp_path):
    for arm in bal.ARMS:
        cmd = bal.command(arm, "bf16", 3, tmp_path / arm)
        assert cmd[1] == "experiments/train_moe.py"
        cfg = train_moe.config_from_args(train_moe.parser().parse_args(cmd[2:]))
        assert (cfg.preset, cfg.steps, cfg.seed) == (bal.preset(arm), bal.steps_of(arm), 3)
        model = cfg.model_config()  # the overrides name real fields with valid values
        overrides = dict(kv.split("=") for kv in bal.ARMS[arm].split(","))
        assert model.bias_rule == overrides["bias_rule"], arm
        if "bias_lr_ratio" in overrides:
            assert model.bias_lr_ratio == pytest.approx(float(overrides["bias_lr_ratio"])), arm
    small = bal.command("small-clipped-lr50", "fp8", 0, tmp_path / "x")
    assert small[small.index("--batch-size") + 1] == "8" and small[small.index("--warmup") + 1] == "30"


def test_unknown_arm_is_refused_with_the_choices(bal, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bal.main(["--out", str(tmp_path), "--arms", "small-clipped-lr99", "--summarize-only"])
    err = capsys.readouterr().err
    assert "small-clipped-lr99" in err and "small-clipped-lr50" in err


def _number_or_str(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def test_committed_small_summary_follows_from_its_metrics(bal, tmp_path):
    committed = json.loads((RESULTS / "summary.json").read_text())["runs"]
    out = tmp_path / "balancing-small"
    shutil.copytree(RESULTS / "runs", out / "runs")
    seed0 = [arm for arm in bal.ARMS if bal.preset(arm) == "small"]
    bal.main(["--out", str(out), "--arms", ",".join(seed0), "--summarize-only"])
    bal.main(["--out", str(out), "--arms", "small-clipped-lr15,small-clipped-lr50", "--seed", "1", "--summarize-only"])
    again = json.loads((out / "summary.json").read_text())["runs"]
    assert set(again) == set(committed) == {f"{arm}-bf16" for arm in seed0} | {
        "small-clipped-lr15-bf16-s1", "small-clipped-lr50-bf16-s1"}
    for name, run in again.items():  # each run was trained with its arm's overrides, on the protocol
        config = json.loads((out / "runs" / name / "config.json").read_text())
        want = dict(kv.split("=") for kv in bal.ARMS[run["arm"]].split(","))
        assert config["model_overrides"] == {k: _number_or_str(v) for k, v in want.items()}, name
        assert (config["preset"], config["steps"], config["seed"]) == ("small", 100, run["seed"]), name
        for key in ("last_quarter_load_max_over_mean", "last_quarter_dead_experts_max", "final_val_ce", "steps"):
            assert run[key] == committed[name][key], (name, key)
    assert (out / "table.md").exists() and (out / "balance.png").stat().st_size > 0

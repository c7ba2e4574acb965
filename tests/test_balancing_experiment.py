"""experiments/balancing.py: every arm's command builds a valid run configuration, the committed
small-preset table follows from the committed metrics, and the gate probe reads the early
checkpoints of a stopped tiny run (the one test that trains)."""

import json
import pathlib
import shutil

import pytest

from helpers import EXPERIMENTS, load_experiment as _load

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
        assert model.bias_schedule == overrides.get("bias_schedule", model.bias_schedule), arm
        if "bias_lr_ratio" in overrides:
            assert model.bias_lr_ratio == pytest.approx(float(overrides["bias_lr_ratio"])), arm
    small = bal.command("small-clipped-lr50", "fp8", 0, tmp_path / "x")
    assert small[small.index("--batch-size") + 1] == "8" and small[small.index("--warmup") + 1] == "30"
    long = bal.command("long-clipped-lr50", "bf16", 0, tmp_path / "x")  # the same protocol, 3x longer
    assert long[long.index("--steps") + 1] == "300" and long[long.index("--warmup") + 1] == "30"
    assert long[long.index("--batch-size") + 1] == "8" and long[long.index("--seq-len") + 1] == "256"


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
    seed1 = ["small-clipped-lr15", "small-clipped-lr50", "small-clipped-lr50-nw", "long-clipped-lr15", "long-clipped-lr50"]
    bal.main(["--out", str(out), "--arms", ",".join(seed1), "--seed", "1", "--summarize-only"])
    again = json.loads((out / "summary.json").read_text())["runs"]
    assert set(again) == set(committed) == {f"{arm}-bf16" for arm in seed0} | {f"{arm}-bf16-s1" for arm in seed1}
    for name, run in again.items():  # each run was trained with its arm's overrides, on the protocol
        config = json.loads((out / "runs" / name / "config.json").read_text())
        want = dict(kv.split("=") for kv in bal.ARMS[run["arm"]].split(","))
        assert config["model_overrides"] == {k: _number_or_str(v) for k, v in want.items()}, name
        assert (config["preset"], config["steps"], config["seed"]) == ("small", bal.steps_of(run["arm"]), run["seed"]), name
        for key in ("last_quarter_load_max_over_mean", "last_quarter_dead_experts_max", "final_val_ce", "steps"):
            assert run[key] == committed[name][key], (name, key)
    assert (out / "table.md").exists() and (out / "balance.png").stat().st_size > 0


@pytest.mark.slow
def test_gate_probe_reads_early_checkpoints_of_a_stopped_run(bal, train_moe, tmp_path):
    import jfp8.nn.moe as moe_module

    run, router_scores = tmp_path / "run", moe_module.router_scores
    train_moe.main(["--preset", "tiny", "--precision", "bf16", "--steps", "6", "--batch-size", "2",
                    "--seq-len", "32", "--log-every", "1", "--eval-every", "6", "--ckpt-every", "2",
                    "--keep-checkpoints", "3", "--stop-after", "4", "--no-progress", "--out", str(run)])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # stopped after step 4 of a 6-step schedule
    assert json.loads((run / "config.json").read_text())["steps"] == 6
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    bal.main(["--out", str(tmp_path / "probe"), "--gate-probe", str(run), "--probe-steps", "2", "4"])
    probe = json.loads((tmp_path / "probe" / "gate_probe.json").read_text())
    assert moe_module.router_scores is router_scores  # the recording patch is undone
    assert set(probe["steps"]) == {"2", "4"}
    for step, layers in probe["steps"].items():
        assert set(layers) == {"block1", "mtp"}
        # the checkpoint's biases are the ones the log wrote after that step's update
        logged = rows[int(step) - 1]["bias_spread"]
        assert [layers[n]["bias_spread"] for n in ("block1", "mtp")] == pytest.approx(logged, abs=1e-4), step
        for stats in layers.values():
            assert stats["preference_spread"] > 0 and stats["logit_token_std"] > 0
            assert 0 < stats["score_token_std"] < 0.5 and 0 < stats["common_fraction"] < 1
            assert 1 <= stats["load_max_over_mean"] <= 2  # tiny: N_r/K = 4/2
    with pytest.raises(SystemExit):
        bal.main(["--out", str(tmp_path / "probe"), "--gate-probe", str(run)])
    with pytest.raises(SystemExit, match="--stop-after"):
        train_moe.main(["--preset", "tiny", "--stop-after", "0", "--out", str(tmp_path / "bad")])

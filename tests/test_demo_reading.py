"""The demo's reading of one FP8-vs-BF16 gap (experiments/compare_precision.py): the committed band
widened by the cross-machine spread (experiments/cross_machine.py), what to look at outside it, and
the plot that draws both."""

import json
import math
import pathlib

import numpy as np
import pytest

from helpers import load_experiment as _load


@pytest.fixture(scope="module")
def cp():
    return _load("compare_precision")


@pytest.fixture(scope="module")
def cm():
    return _load("cross_machine")


def _band(rng, seeds=6):
    gaps = rng.normal(-0.003, 0.007, seeds)
    return {"pairs": [{"seed": s, "gap": float(g)} for s, g in enumerate(gaps)], "mean_gap": float(gaps.mean()),
            "ci95": [float(gaps.mean() - 0.008), float(gaps.mean() + 0.008)], "sd_gap": float(gaps.std(ddof=1)),
            "null_sd": 0.0076}


def test_a_gap_is_read_against_seeds_and_machines_together(cp):
    rng = np.random.default_rng()
    band = _band(rng)
    cross = {"run_sd": float(rng.uniform(0.002, 0.008)), "n": 6}
    cross["pair_sd"] = math.sqrt(2) * cross["run_sd"]
    sd = math.hypot(band["sd_gap"], cross["pair_sd"])
    assert cp.total_sd(band, cross) == pytest.approx(sd)
    assert cp.total_sd(band, None) == band["sd_gap"]

    z_in = float(rng.uniform(-1.9, 1.9))
    inside = cp.read_gap(band["mean_gap"] + z_in * sd, band, cross, seed=0)
    assert f"{z_in:+.1f} SD from the committed mean: inside the spread of seeds and machines" in inside
    assert f"SD {100 * sd:.3f} %" in inside and "6 BF16 runs" in inside
    d = band["mean_gap"] + z_in * sd - band["pairs"][0]["gap"]
    assert f"{d / cross['pair_sd']:+.1f} cross-machine SDs" in inside  # the same seed, committed elsewhere

    z_out = float(rng.choice([-1, 1]) * rng.uniform(2.1, 5))
    outside = cp.read_gap(band["mean_gap"] + z_out * sd, band, cross, seed=17)
    assert f"{z_out:+.1f} SD from the committed mean, outside ±2 SD of seeds and machines" in outside
    assert "parity.png" in outside and "--seed 1" in outside and "last_quarter_load_max_over_mean" in outside
    assert "cross-machine SDs" not in outside  # no committed pair with seed 17

    # The band alone would have called the case (-2.5 SD) an alarm; with machines it need not.
    gap = band["mean_gap"] - 2.5 * band["sd_gap"]
    assert "outside ±2 SD" in cp.read_gap(gap, band, None, 0)
    assert "No cross-machine measurement" in cp.read_gap(gap, band, None, 0)
    assert "inside the spread" in cp.read_gap(gap, band, {"run_sd": band["sd_gap"], "pair_sd": 2 * band["sd_gap"],
                                                          "n": 3}, 0)
    assert "no committed noise band for this protocol" in cp.read_gap(gap, None, cross, 0)


def test_the_plot_labels_the_band_and_the_bar(cp, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    rng = np.random.default_rng()
    rows = lambda: [{"step": s, "ce": 3 - s / 100 + rng.normal(0, 0.01), "val_loss": 3 - s / 100,  # noqa: E731
                     "load_max_over_mean": [1.1, 1.2]} for s in range(0, 201, 10)]
    band = _band(rng)
    cross = {"run_sd": 0.006, "pair_sd": 0.0085, "n": 6}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    cp.plot(rows(), rows(), tmp_path / "parity.png", "tiny", gap=-0.01, band=band, cross=cross)
    assert (tmp_path / "parity.png").stat().st_size > 0
    ax1 = figures[0].axes[1]
    labels = [t.get_text() for t in ax1.get_legend().get_texts()]
    assert "committed band: mean ± 2 SD (seeds and machines)" in labels
    assert "±0.25 % (DeepSeek-V3's bar)" in labels and "this pair, whole validation split" in labels
    (span,) = ax1.patches  # the band, drawn where the text puts it
    sd = 100 * cp.total_sd(band, cross)
    ys = ax1.transData.inverted().transform(span.get_transform().transform(span.get_path().vertices))[:, 1]
    assert (ys.min(), ys.max()) == pytest.approx((100 * band["mean_gap"] - 2 * sd, 100 * band["mean_gap"] + 2 * sd))


def _fake_bf16_run(run: pathlib.Path, val_ce: float, **model):
    run.mkdir(parents=True)
    config = {"preset": "tiny", "seed": 0, "out": str(run), "progress": False,
              "model": {"d_model": 64, "recipe": {"fprop": False, "dgrad": False, "wgrad": False}, **model}}
    (run / "config.json").write_text(json.dumps(config))
    (run / "eval.json").write_text(json.dumps({"val_ce": val_ce}))


def test_cross_machine_spread_is_the_rms_of_the_same_runs(cm, tmp_path):
    rng = np.random.default_rng()
    names = ["s0-bf16", "s1-bf16", "s2-bf16", "s0-bf16-data1000"]
    va = rng.uniform(2.2, 2.4, len(names))
    vb = va * (1 + rng.normal(0, 0.006, len(names)))
    for n, a, b in zip(names, va, vb):
        _fake_bf16_run(tmp_path / "a" / "runs" / n, float(a))
        _fake_bf16_run(tmp_path / "b" / "runs" / n, float(b), bias_gain=1.0)  # a field added since: neutral
    _fake_bf16_run(tmp_path / "a" / "runs" / "s3-bf16", 2.3)  # not finished on B yet: left out
    _fake_bf16_run(tmp_path / "a" / "runs" / "s0-fp8", 2.3)  # FP8 runs are not compared
    s = cm.main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"), "--out", str(tmp_path / "out")])
    d = (vb - va) / va
    assert sorted(r["run"] for r in s["runs"]) == sorted(names) and s["n"] == 4
    assert s["run_sd"] == pytest.approx(np.sqrt(np.mean(d ** 2)))
    assert s["pair_sd"] == pytest.approx(np.sqrt(2) * s["run_sd"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["command"].startswith(
        "python experiments/cross_machine.py --a")
    _fake_bf16_run(tmp_path / "c" / "runs" / "s0-bf16", 2.3, d_model=32)
    with pytest.raises(SystemExit, match="not the same run"):
        cm.compare(tmp_path / "a", tmp_path / "c")
    with pytest.raises(SystemExit, match="no BF16 run"):
        cm.compare(tmp_path / "a", tmp_path / "out")


def test_committed_cross_machine_summary_is_consistent(cp):
    s = cp.cross_machine_spread()
    if s is None:
        pytest.skip("no committed experiments/results/cross-machine/summary.json")
    d = np.array([r["relative_difference"] for r in s["runs"]])
    assert s["n"] == len(d) >= 3
    for r in s["runs"]:
        assert r["relative_difference"] == pytest.approx((r["val_ce_b"] - r["val_ce_a"]) / r["val_ce_a"])
    assert s["run_sd"] == pytest.approx(np.sqrt(np.mean(d ** 2)))
    assert s["pair_sd"] == pytest.approx(np.sqrt(2) * s["run_sd"])
    assert "experiments/cross_machine.py" in s["command"]

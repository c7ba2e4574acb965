"""experiments/parity_seeds.py's statistics on synthetic finished runs (no training), and the
demo's reading of one gap against the committed band."""

import json
import math
import pathlib

import pytest

from helpers import ONE_MOE_LAYER, load_experiment as _load


@pytest.fixture(scope="module")
def ps():
    return _load("parity_seeds")


# t quantile 0.975 with 2 degrees of freedom (3 pairs), from tables: the interval's half-width is
# T2 * sd / sqrt(3).
T2 = 4.302652729911275


def fake_run(run: pathlib.Path, val_ce: float, steps: int, loads=(1.1, 1.2), dead=(0, 0), final_val=None):
    """What `complete` leaves behind: config.json, metrics.jsonl and eval.json."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"moe_layer_names": ["block1", "mtp"]}))
    rows = [{"step": s, "val_loss": final_val if final_val is not None else val_ce,
             "load_max_over_mean": [loads[0] + (s == steps) * 0.4, loads[1]], "dead_experts": list(dead)}
            for s in range(10, steps + 1, 10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.json").write_text(json.dumps({"val_ce": val_ce, "per_step": {}}))


def fake_experiment(ps, out, fp8, bf16, other, steps=200):
    runs = ps.plan(len(fp8), len(other), out, steps)
    for s, (a, b) in enumerate(zip(fp8, bf16)):
        fake_run(out / "runs" / f"s{s}-fp8", a, steps, final_val=a + 0.01)
        fake_run(out / "runs" / f"s{s}-bf16", b, steps, dead=(1, 0))
    for s, c in enumerate(other):
        fake_run(out / "runs" / f"s{s}-bf16-data{s + 1000}", c, steps)
    return runs


def test_plan_pairs_null_pairs_and_shards(ps, tmp_path):
    runs = ps.plan(6, 3, tmp_path, 200)
    assert len(runs) == 15
    for s in range(6):
        a, b = runs[f"s{s}-fp8"], runs[f"s{s}-bf16"]
        assert (a.precision, b.precision) == ("fp8", "bf16")
        assert a.seed == b.seed == s and a.batch_seed == b.batch_seed == s
        assert ps.protocol(a) == ps.protocol(b)
    for s in range(3):
        n = runs[f"s{s}-bf16-data{s + 1000}"]
        assert n.precision == "bf16" and n.seed == s and n.batch_seed == s + 1000  # same init, other order
    names = list(runs)
    shard1 = [n for i, n in enumerate(names) if i % 2 == 0]
    # the FP8 runs (the slow ones) are spread evenly over two shards
    assert sum(n.endswith("fp8") for n in shard1) == 3


def test_summary_statistics_match_hand_computation(ps, tmp_path):
    fp8, bf16, other = [2.01, 2.00, 2.02], [2.0, 2.0, 2.0], [2.002, 1.998]
    runs = fake_experiment(ps, tmp_path, fp8, bf16, other)
    s = ps.summarize(tmp_path, runs, 3, 2, 200)
    gaps = [0.005, 0.0, 0.01]
    assert [p["gap"] for p in s["pairs"]] == pytest.approx(gaps)
    assert s["mean_gap"] == pytest.approx(0.005)
    assert s["sd_gap"] == pytest.approx(0.005)
    half = T2 * 0.005 / math.sqrt(3)
    assert s["ci95"] == pytest.approx([0.005 - half, 0.005 + half])
    assert s["null_sd"] == pytest.approx(0.001)  # RMS of +0.1 % and -0.1 %
    assert [n["gap"] for n in s["null_pairs"]] == pytest.approx([0.001, -0.001])
    # the loop's final 4-batch number is kept beside it (here every FP8 run's is 0.01 higher)
    assert s["pairs"][1]["gap_final_4_batches"] == pytest.approx(0.01 / 2.0)
    assert s["claim"].startswith("not shown") and f"±{100 * half:.2f} %" in s["claim"]
    # balance: the last quarter (logged steps 160..200, five rows) of each layer, and the most dead experts
    b = s["balance"]["s0-fp8"]
    assert b["load_max_over_mean"]["block1"] == pytest.approx(1.1 + 0.4 / 5)
    assert b["load_max_over_mean"]["mtp"] == pytest.approx(1.2)
    assert s["balance"]["s0-bf16"]["dead_experts_max"] == {"block1": 1, "mtp": 0}
    # written atomically, and the files agree
    assert json.loads((tmp_path / "summary.json").read_text())["ci95"] == pytest.approx(s["ci95"])
    md = (tmp_path / "summary.md").read_text()
    assert "+0.500 %" in md and "claim: not shown" in md
    assert (tmp_path / "parity_seeds.png").stat().st_size > 0
    assert not list(tmp_path.glob("summary.json.*"))


def test_claim_within_the_bar_only_when_the_interval_is_inside(ps, tmp_path):
    runs = fake_experiment(ps, tmp_path, [2.0010, 2.0000, 2.0006], [2.0, 2.0, 2.0], [2.0])
    s = ps.summarize(tmp_path, runs, 3, 1, 200)
    lo, hi = s["ci95"]
    assert -0.0025 < lo < hi < 0.0025
    assert s["claim"].startswith("FP8 within 0.25 % of BF16")
    assert ps.claim(-0.0024, 0.0026).startswith("not shown")
    assert ps.claim(-0.0026, 0.0).startswith("not shown")
    assert ps.claim(math.nan, math.nan) == "not enough pairs for an interval"


def test_interval_against_scipy_free_oracle(ps):
    import random

    rng = random.Random()
    gaps = [rng.gauss(0.001, 0.004) for _ in range(3)]
    m = sum(gaps) / 3
    sd = math.sqrt(sum((g - m) ** 2 for g in gaps) / 2)
    mean, lo, hi = ps.interval(gaps)
    assert mean == pytest.approx(m)
    assert (lo, hi) == pytest.approx((m - T2 * sd / math.sqrt(3), m + T2 * sd / math.sqrt(3)))


def test_summarize_refuses_unfinished_runs(ps, tmp_path):
    runs = fake_experiment(ps, tmp_path, [2.0, 2.0], [2.0, 2.0], [])
    (tmp_path / "runs" / "s1-bf16" / "eval.json").unlink()
    with pytest.raises(SystemExit, match=r"runs not finished: \['s1-bf16'\]"):
        ps.summarize(tmp_path, runs, 2, 0, 200)


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1"], "at least 2"),
    (["--null-pairs", "7"], "must not exceed --seeds"),
    (["--steps", "40"], "at least 60"),
    (["--shard", "3/2"], "K/N"),
    (["--shard", "x"], "K/N"),
])
def test_bad_arguments_are_clear_errors(ps, tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        ps.main(["--out", str(tmp_path), *argv])


def test_the_demo_is_read_against_the_committed_band(ps, tmp_path):
    """The README's demo (compare_precision --preset tiny --steps 200) follows the experiment's
    protocol, so its gap is read against the committed summary; another protocol is not."""
    cp = _load("compare_precision")
    demo = cp.run_configs(cp.parser().parse_args(["--preset", "tiny", "--steps", "200", "--out", str(tmp_path)]))
    assert ps.protocol(demo["fp8"]) == ps.protocol(ps.run_config(0, "fp8", tmp_path))
    assert demo["fp8"].ckpt_every == ps.CKPT_EVERY and demo["fp8"].keep_checkpoints == ps.EVALUATED

    summary = tmp_path / "summary.json"
    band = {"protocol": ps.protocol(demo["fp8"]), "pairs": [{}] * 6, "mean_gap": -0.001,
            "ci95": [-0.004, 0.002], "sd_gap": 0.003, "null_sd": 0.002}
    summary.write_text(json.dumps(band))
    assert ps.committed_band(demo["fp8"], summary) == band
    assert ps.committed_band(demo["bf16"], summary) == band  # precision is not part of the protocol
    other = cp.run_configs(cp.parser().parse_args(["--preset", "tiny", "--steps", "100", "--out", str(tmp_path)]))
    assert ps.committed_band(other["fp8"], summary) is None
    assert ps.committed_band(demo["fp8"], tmp_path / "absent.json") is None

    inside = ps.read_against_band(0.002, band)  # (0.002 + 0.001) / 0.003 = +1 SD
    assert "+1.0 SD from the committed mean (ordinary run-to-run noise)" in inside
    assert "6 seeds" in inside and "[-0.400 %, +0.200 %]" in inside
    assert "outside ±2 SD" in ps.read_against_band(-0.0071, band)
    assert "an anecdote" in ps.read_against_band(0.002, None)


def test_committed_summary_is_complete_and_consistent(ps):
    """The committed experiment: at least 6 pairs and 3 null pairs, its numbers recomputed from its
    own per-seed rows, and the claim the interval supports."""
    s = json.loads(ps.DEFAULT_SUMMARY.read_text())
    assert len(s["pairs"]) >= 6 and len(s["null_pairs"]) >= 3
    mean, lo, hi = ps.interval([p["gap"] for p in s["pairs"]])
    assert (s["mean_gap"], *s["ci95"]) == pytest.approx((mean, lo, hi))
    for p in s["pairs"]:
        assert p["gap"] == pytest.approx(ps.gap(p["val_ce_fp8"], p["val_ce_bf16"]))
    assert s["claim"] == ps.claim(lo, hi)
    assert s["protocol"] == ps.protocol(ps.run_config(0, "fp8", pathlib.Path("x")))


@pytest.mark.slow
def test_compare_precision_end_to_end_on_a_small_corpus(tmp_path, capsys):
    """The demo's script on the tiny model cut to one MoE block: the gap is the whole-split one,
    over the kept checkpoints, and is read against the band."""
    from jfp8.train import data

    cp = _load("compare_precision")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(data.load_bytes(None)[:3600].tobytes())
    out = tmp_path / "cmp"
    s = cp.main(["--preset", "tiny", "--model", ONE_MOE_LAYER, "--steps", "30", "--batch-size", "4", "--seq-len", "64",
                 "--lr", "3e-3", "--warmup", "2", "--eval-every", "5", "--log-every", "1", "--ckpt-every", "10",
                 "--corpus", str(corpus), "--no-progress", "--out", str(out)])
    assert s["evaluated_steps"] == [10, 20, 30]
    assert s["relative_gap"] == pytest.approx(
        (s["val_ce_whole_split_fp8"] - s["val_ce_whole_split_bf16"]) / s["val_ce_whole_split_bf16"])
    for precision in ("fp8", "bf16"):
        each = json.loads((out / precision / "config.json").read_text())
        assert each["precision"] == precision and each["keep_checkpoints"] == 3
    assert json.loads((out / "summary.json").read_text())["relative_gap"] == s["relative_gap"]
    assert "no committed noise band for this protocol" in s["read_against_committed_band"]
    printed = capsys.readouterr().out
    assert f"FP8 - BF16 validation CE gap: {100 * s['relative_gap']:+.3f} %" in printed
    assert (out / "parity.png").exists()

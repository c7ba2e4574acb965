"""FP8 vs BF16 with error bars: seeded pairs of runs, against a BF16-vs-BF16 noise floor.

    python experiments/parity_seeds.py --out experiments/results/parity-seeds            # all runs
    python experiments/parity_seeds.py --out DIR --shard 1/2 & python ... --shard 2/2   # two processes
    python experiments/parity_seeds.py --out DIR --summarize                               # tables only

One pair is an anecdote: a small MoE run is chaotic, so one FP8-vs-BF16 gap mixes the recipe's
effect with run-to-run noise. This experiment trains

- **pairs**: for each seed s, an FP8 run and a BF16 run with the same initialisation and data
  order (seed s);
- **null pairs**: for a few seeds, a second BF16 run with the same initialisation but another
  data order (`data_seed` = s + 1000). Two BF16 runs differ by no recipe at all, so their gap is
  the noise floor a perturbation of a run produces.

Every run is the demo's (`experiments/compare_precision.py --preset tiny --steps 200`): the
`tiny` preset's training settings, checkpoints at the last three multiples of 20 steps, each
evaluated on the whole validation split (`jfp8.train.evaluate`); a run's number is the mean of
those three. The gap of a pair is (a - b) / b of these numbers.

Writes DIR/runs/<name>/ (train_moe.py runs, plus eval.json), DIR/summary.json (pairs, null_pairs,
mean_gap, ci95, null_sd, per-seed rows, the claim the interval supports, each run's expert
balance over the last quarter), DIR/summary.md and DIR/parity_seeds.png. Runs that finished are
skipped and killed runs resume, so the command can be re-run until it completes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import tempfile

import numpy as np
from scipy import stats

from jfp8.recipe import Fp8Recipe
from jfp8.train.config import PRESET_TRAINING, TrainConfig
from jfp8.train.evaluate import evaluate_checkpoints, mean_validation_ce
from jfp8.train.loop import last_quarter_balance, read_metrics, train
from jfp8.train.optim import OptimizerConfig

PRESET = "tiny"
STEPS = PRESET_TRAINING[PRESET]["steps"]
# Checkpoints every CKPT_EVERY steps, the last EVALUATED of them kept and evaluated.
CKPT_EVERY = 20
EVALUATED = 3
NULL_DATA_SEED_OFFSET = 1000
# The bar of DeepSeek-V3 (Appendix B.1): FP8 within 0.25 % of BF16.
TARGET = 0.0025
DEFAULT_SUMMARY = pathlib.Path(__file__).resolve().parent / "results" / "parity-seeds" / "summary.json"


def run_config(seed: int, precision: str, out: pathlib.Path, data_seed: int | None = None,
               steps: int = STEPS) -> TrainConfig:
    """One run of the protocol (the demo's settings; see the module docstring)."""
    d = PRESET_TRAINING[PRESET]
    return TrainConfig(
        preset=PRESET, precision=precision, steps=steps, batch_size=d["batch_size"], seq_len=d["seq_len"],
        seed=seed, data_seed=data_seed, eval_every=max(steps // 10, 1), log_every=10,
        ckpt_every=CKPT_EVERY, keep_checkpoints=EVALUATED,
        optimizer=OptimizerConfig(peak_lr=d["peak_lr"], warmup_steps=d["warmup"]),
        out=str(out), progress=False,
    )


def protocol(config: TrainConfig) -> dict:
    """What a run's number depends on; a gap is read against the committed band only when its
    runs followed the same protocol."""
    d = {"preset": config.preset, "steps": config.steps, "batch_size": config.batch_size,
         "seq_len": config.seq_len, "peak_lr": config.optimizer.peak_lr,
         "warmup": config.optimizer.warmup_steps, "ckpt_every": config.ckpt_every,
         "evaluated_checkpoints": config.keep_checkpoints, "evaluation": "whole validation split",
         "corpus": config.corpus, "model_overrides": dict(config.model_overrides),
         "recipe_overrides": dict(config.recipe_overrides), "loss_scale": config.loss_scale,
         # The FP8 runs' gradient amax floor: 1e-4 before the recipe gave gradients their own floor.
         "grad_amax_floor": Fp8Recipe(**dict(config.recipe_overrides)).grad_amax_floor}
    return json.loads(json.dumps(d))  # as it reads back from summary.json


def plan(seeds: int, null_pairs: int, out: pathlib.Path, steps: int) -> dict[str, TrainConfig]:
    """{run name: config}: the pairs' runs first, then the null pairs' second BF16 runs."""
    runs = {}
    for s in range(seeds):
        # Alternating the order within a pair spreads the (slower) FP8 runs evenly over --shard 1/2, 2/2.
        for precision in ("fp8", "bf16") if s % 2 == 0 else ("bf16", "fp8"):
            runs[f"s{s}-{precision}"] = run_config(s, precision, out / "runs" / f"s{s}-{precision}", steps=steps)
    for s in range(null_pairs):
        ds = s + NULL_DATA_SEED_OFFSET
        runs[f"s{s}-bf16-data{ds}"] = run_config(s, "bf16", out / "runs" / f"s{s}-bf16-data{ds}", ds, steps)
    return runs


def write_atomic(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def complete(config: TrainConfig) -> dict:
    """Trains (or resumes) one run and evaluates its kept checkpoints; returns its eval.json."""
    run = pathlib.Path(config.out)
    done = run / "eval.json"
    if done.exists():
        return json.loads(done.read_text())
    train(config, resume=True)
    per_step = evaluate_checkpoints(run)  # the EVALUATED kept: the last multiples of CKPT_EVERY
    result = {"val_ce": mean_validation_ce(per_step), "per_step": {str(k): v for k, v in per_step.items()}}
    write_atomic(done, json.dumps(result, indent=1) + "\n")
    return result


def gap(a: float, b: float) -> float:
    return (a - b) / b


def interval(gaps: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean and the two-sided 95 % Student-t interval of the mean."""
    g = np.asarray(gaps, float)
    m = float(g.mean())
    if g.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.975, g.size - 1) * g.std(ddof=1) / math.sqrt(g.size))
    return m, m - half, m + half


def claim(lo: float, hi: float) -> str:
    """The sentence the interval supports, against the 0.25 % bar."""
    if not math.isfinite(lo):
        return "not enough pairs for an interval"
    if -TARGET < lo and hi < TARGET:
        return f"FP8 within 0.25 % of BF16: the 95 % CI [{100 * lo:+.3f} %, {100 * hi:+.3f} %] lies inside ±0.25 %"
    return (f"not shown: the 95 % CI [{100 * lo:+.3f} %, {100 * hi:+.3f} %] does not lie inside ±0.25 %; "
            f"this experiment resolves gaps of about ±{100 * (hi - lo) / 2:.2f} % (the CI's half-width)")


def balance(run: pathlib.Path, steps: int) -> dict:
    """Each MoE layer's max/mean load averaged over the last quarter, and its most dead experts."""
    rows = read_metrics(run / "metrics.jsonl")
    names = json.loads((run / "config.json").read_text())["moe_layer_names"]
    b = last_quarter_balance(rows, steps, names)
    return {"load_max_over_mean": b["load_max_over_mean"], "dead_experts_max": b["dead_experts_max"]}


def summarize(out: pathlib.Path, runs: dict[str, TrainConfig], seeds: int, null_pairs: int, steps: int) -> dict:
    missing = [n for n, c in runs.items() if not (pathlib.Path(c.out) / "eval.json").exists()]
    if missing:
        raise SystemExit(f"runs not finished: {missing}; run without --summarize (or each --shard) first")
    ev = {n: json.loads((pathlib.Path(c.out) / "eval.json").read_text()) for n, c in runs.items()}
    last = {n: read_metrics(pathlib.Path(c.out) / "metrics.jsonl")[-1] for n, c in runs.items()}
    pairs = [{
        "seed": s,
        "val_ce_fp8": ev[f"s{s}-fp8"]["val_ce"], "val_ce_bf16": ev[f"s{s}-bf16"]["val_ce"],
        "gap": gap(ev[f"s{s}-fp8"]["val_ce"], ev[f"s{s}-bf16"]["val_ce"]),
        # The number the training loop logs (4 fixed batches, final step only), for comparison.
        "gap_final_4_batches": gap(last[f"s{s}-fp8"]["val_loss"], last[f"s{s}-bf16"]["val_loss"]),
    } for s in range(seeds)]
    nulls = []
    for s in range(null_pairs):
        other = f"s{s}-bf16-data{s + NULL_DATA_SEED_OFFSET}"
        nulls.append({
            "seed": s, "data_seed": s + NULL_DATA_SEED_OFFSET,
            "val_ce_bf16": ev[f"s{s}-bf16"]["val_ce"], "val_ce_bf16_other_order": ev[other]["val_ce"],
            "gap": gap(ev[other]["val_ce"], ev[f"s{s}-bf16"]["val_ce"]),
        })
    mean, lo, hi = interval([p["gap"] for p in pairs])
    # The two arms of a null pair are exchangeable, so the null gap has mean 0: its spread is the RMS.
    null_sd = float(np.sqrt(np.mean([n["gap"] ** 2 for n in nulls]))) if nulls else math.nan
    summary = {
        "protocol": protocol(runs["s0-fp8"]),
        "pairs": pairs,
        "null_pairs": nulls,
        "mean_gap": mean,
        "ci95": [lo, hi],
        "sd_gap": float(np.std([p["gap"] for p in pairs], ddof=1)) if len(pairs) > 1 else math.nan,
        "null_sd": null_sd,
        "sd_gap_final_4_batches": (float(np.std([p["gap_final_4_batches"] for p in pairs], ddof=1))
                                   if len(pairs) > 1 else math.nan),
        "claim": claim(lo, hi),
        "balance": {n: balance(pathlib.Path(c.out), steps) for n, c in runs.items()},
        "note": "gap = (a - b) / b of the validation cross-entropy (nats/byte), each run's mean over its "
                f"last {EVALUATED} checkpoints on the whole validation split; ci95: Student-t interval of "
                "the mean paired gap; null_sd: RMS of the BF16-vs-BF16 (other data order) gaps",
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(out / "summary.md", markdown(summary))
    plot(summary, out / "parity_seeds.png")
    return summary


def markdown(s: dict) -> str:
    pct = lambda x: f"{100 * x:+.3f} %"  # noqa: E731
    lines = [
        "# FP8 vs BF16 with error bars (`experiments/parity_seeds.py`)", "",
        f"Protocol: {json.dumps(s['protocol'])}", "",
        "| seed | FP8 val CE | BF16 val CE | gap | gap, final 4 batches only |", "|---|---|---|---|---|",
        *[f"| {p['seed']} | {p['val_ce_fp8']:.5f} | {p['val_ce_bf16']:.5f} | {pct(p['gap'])} | "
          f"{pct(p['gap_final_4_batches'])} |" for p in s["pairs"]],
        "", "| null pair (seed, data seed) | BF16 val CE | BF16, other order | gap |", "|---|---|---|---|",
        *[f"| {n['seed']}, {n['data_seed']} | {n['val_ce_bf16']:.5f} | {n['val_ce_bf16_other_order']:.5f} | "
          f"{pct(n['gap'])} |" for n in s["null_pairs"]],
        "",
        f"- mean paired gap {pct(s['mean_gap'])}, 95 % CI [{pct(s['ci95'][0])}, {pct(s['ci95'][1])}] "
        f"({len(s['pairs'])} pairs); SD of the paired gaps {100 * s['sd_gap']:.3f} % "
        f"({100 * s['sd_gap_final_4_batches']:.3f} % with the loop's final 4-batch evaluation)",
        f"- noise floor (null pairs): SD {100 * s['null_sd']:.3f} % ({len(s['null_pairs'])} pairs)",
        f"- claim: {s['claim']}", "",
        "Expert balance, max/mean load over the last quarter (worst layer) and most dead experts:", "",
        "| run | worst layer load | dead experts |", "|---|---|---|",
        *[f"| {n} | {max(b['load_max_over_mean'].values()):.3f} | {max(b['dead_experts_max'].values())} |"
          for n, b in s["balance"].items()],
        "",
    ]
    return "\n".join(lines)


def plot(s: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(s["pairs"])
    ax.axhspan(-200 * s["null_sd"], 200 * s["null_sd"], color="gray", alpha=0.2, label="null band (±2 SD)")
    ax.plot([p["seed"] for p in s["pairs"]], [100 * p["gap"] for p in s["pairs"]], "o", label="FP8 − BF16, per seed")
    ax.plot([n["seed"] + 0.15 for n in s["null_pairs"]], [100 * n["gap"] for n in s["null_pairs"]], "x",
            color="gray", label="BF16 − BF16 (other data order)")
    lo, hi = s["ci95"]
    ax.errorbar([n - 0.3], [100 * s["mean_gap"]], yerr=[[100 * (s["mean_gap"] - lo)], [100 * (hi - s["mean_gap"])]],
                fmt="s", color="C3", capsize=4, label="mean, 95 % CI")
    for y, label in ((100 * TARGET, "±0.25 % (DeepSeek-V3's bar)"), (-100 * TARGET, None)):
        ax.axhline(y, color="C3", lw=0.8, ls=":", label=label)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("seed")
    ax.set_ylabel("validation CE gap [%]")
    ax.set_title(f"FP8 vs BF16, {s['protocol']['preset']} preset, {s['protocol']['steps']} steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def committed_band(config: TrainConfig, summary_path: pathlib.Path = DEFAULT_SUMMARY) -> dict | None:
    """The committed summary when its runs followed `config`'s protocol (else None): what a
    newcomer's single gap is read against."""
    if not summary_path.exists():
        return None
    s = json.loads(summary_path.read_text())
    return s if s.get("protocol") == protocol(config) else None


def read_against_band(gap_: float, band: dict | None) -> str:
    """A sentence placing one pair's gap in the committed band."""
    if band is None:
        return ("no committed noise band for this protocol (experiments/results/parity-seeds/ holds the "
                "tiny preset at its default steps): one pair's gap is an anecdote")
    lo, hi = band["ci95"]
    z = (gap_ - band["mean_gap"]) / band["sd_gap"]
    return (f"committed band ({len(band['pairs'])} seeds, experiments/results/parity-seeds): mean gap "
            f"{100 * band['mean_gap']:+.3f} %, 95 % CI [{100 * lo:+.3f} %, {100 * hi:+.3f} %], one pair's SD "
            f"{100 * band['sd_gap']:.3f} %, BF16-vs-BF16 noise SD {100 * band['null_sd']:.3f} %. This gap is "
            f"{z:+.1f} SD from the committed mean" + (" (ordinary run-to-run noise)." if abs(z) <= 2 else
                                                      " (outside ±2 SD: look at this run)."))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seeds", type=int, default=6, help="FP8/BF16 pairs (seeds 0..N-1)")
    p.add_argument("--null-pairs", type=int, default=3, help="BF16/BF16 pairs (seeds 0..N-1, other data order)")
    p.add_argument("--steps", type=int, default=STEPS, help="training steps of every run (the band is for the default)")
    p.add_argument("--shard", default="1/1", help="K/N: train only every N-th run starting at the K-th")
    p.add_argument("--summarize", action="store_true", help="only write the summary from finished runs")
    return p


def main(argv=None) -> dict | None:
    args = parser().parse_args(argv)
    if args.seeds < 2:
        raise SystemExit("--seeds must be at least 2 for an interval")
    if args.null_pairs > args.seeds:
        raise SystemExit("--null-pairs must not exceed --seeds (a null pair reuses its seed's BF16 run)")
    if args.steps < CKPT_EVERY * EVALUATED:
        raise SystemExit(f"--steps must be at least {CKPT_EVERY * EVALUATED} (three checkpoints are evaluated)")
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shard must be K/N with 1 <= K <= N, got {args.shard!r}") from None
    out = pathlib.Path(args.out)
    runs = plan(args.seeds, args.null_pairs, out, args.steps)
    if not args.summarize:
        for i, (name, config) in enumerate(runs.items()):
            if i % n == k - 1:
                print(f"[parity_seeds] {name}: {complete(config)['val_ce']:.5f}", flush=True)
        if n > 1 and any(not (pathlib.Path(c.out) / "eval.json").exists() for c in runs.values()):
            print("[parity_seeds] other shards still running; re-run with --summarize when all are done")
            return None
    s = summarize(out, runs, args.seeds, args.null_pairs, args.steps)
    print(markdown(s))
    return s


if __name__ == "__main__":
    main()

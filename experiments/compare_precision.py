"""The FP8-vs-BF16 parity experiment (DeepSeek-V3 Appendix B.1: FP8 within 0.25 % of BF16).

    python experiments/compare_precision.py --preset tiny --steps 200 --out runs/parity-tiny

Trains the same model twice with the same seed, initialisation and data order, once with the
DeepSeek-V3 FP8 recipe and once with it off (BF16 GEMMs), then writes DIR/fp8/, DIR/bf16/ (each a
train_moe.py run), DIR/parity.png (loss curves, the relative difference per step, and the worst MoE layer's
max/mean expert load) and DIR/summary.json: final train and validation loss of each, `relative_gap`
((fp8 - bf16) / bf16 of the validation loss on the whole validation split, averaged over each
run's last three checkpoints, 20 steps apart), tokens, steps, wall time, tokens/s, and each MoE
layer's max/mean expert load averaged over the last quarter of training.

One pair's gap is an anecdote: it prints the gap next to the committed noise band of
`experiments/parity_seeds.py` (seeded pairs and BF16-vs-BF16 pairs on this protocol) when the
runs followed that protocol. The band is widened by the spread of one pair across CPU machines
(`experiments/cross_machine.py`: the same BF16 runs trained on two machines differ), added in
quadrature to the seed-to-seed SD: conservative, since a new machine's shift is partly the same
chaos the seeds already sample. Both are read from their committed summaries when the demo runs.
"""

import dataclasses
import json
import math
import pathlib
import sys

import numpy as np

from jfp8.train import compile_cache
from jfp8.train.evaluate import evaluate_checkpoints, mean_validation_ce
from jfp8.train.loop import last_quarter_balance, read_metrics, train, worst_load

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity_seeds import CKPT_EVERY, EVALUATED, committed_band, read_against_band, write_atomic  # noqa: E402
from train_moe import config_from_args, parser as train_parser  # noqa: E402

CROSS_MACHINE = pathlib.Path(__file__).resolve().parent / "results" / "cross-machine" / "summary.json"
# DeepSeek-V3's bar (Appendix B.1), drawn on the plot.
TARGET = 0.0025
# What to look at when a gap is far outside the band.
LOOK_AT = ("look at this run: parity.png (does either loss curve spike or diverge?), the expert balance "
           "in summary.json (last_quarter_load_max_over_mean_*: 1 is balanced, N_r/K = 2 for tiny is a "
           "collapsed router), whether the setup is the pinned one (jax/jaxlib 0.11.2 from constraints.txt, "
           "the bundled corpus); then run again with --seed 1 --out runs/parity-tiny-s1 to see whether "
           "the gap repeats")


def cross_machine_spread(path: pathlib.Path = CROSS_MACHINE) -> dict | None:
    """The committed cross-machine measurement (experiments/cross_machine.py), None if absent."""
    return json.loads(path.read_text()) if path.exists() else None


def total_sd(band: dict, cross: dict | None) -> float:
    """One pair's SD on a machine other than the band's: seed-to-seed and cross-machine in quadrature."""
    return math.hypot(band["sd_gap"], cross["pair_sd"] if cross else 0.0)


def read_gap(gap: float, band: dict | None, cross: dict | None, seed: int) -> str:
    """What one demo gap means against the committed band widened by the cross-machine spread,
    and what to look at if it lies far outside."""
    if band is None:
        return read_against_band(gap, None)
    sd = total_sd(band, cross)
    z = (gap - band["mean_gap"]) / sd
    lo, hi = band["ci95"]
    pct = lambda x: f"{100 * x:+.3f} %"  # noqa: E731
    lines = [
        f"Committed band ({len(band['pairs'])} seeds, experiments/results/parity-seeds): mean gap "
        f"{pct(band['mean_gap'])}, 95 % CI of that mean [{pct(lo)}, {pct(hi)}]; one pair's gap spreads by "
        f"SD {100 * band['sd_gap']:.3f} % across seeds."
    ]
    if cross:
        lines.append(
            f"CPU results differ across machines: the same run trained on two machines moved by RMS "
            f"{100 * cross['run_sd']:.3f} % ({cross['n']} BF16 runs, experiments/results/cross-machine), "
            f"so one pair's gap by SD {100 * cross['pair_sd']:.3f} %. Together: SD {100 * sd:.3f} %."
        )
    else:
        lines.append("No cross-machine measurement is committed (experiments/results/cross-machine): the band "
                     "holds the seed-to-seed spread only, and another CPU can move a gap further.")
    same = [p for p in band["pairs"] if p.get("seed") == seed]
    if same and cross:
        d = gap - same[0]["gap"]
        lines.append(f"The committed seed {seed} pair gave {pct(same[0]['gap'])}; this one differs by {pct(d)}, "
                     f"{d / cross['pair_sd']:+.1f} cross-machine SDs.")
    if abs(z) <= 2:
        lines.append(
            f"This gap is {z:+.1f} SD from the committed mean: inside the spread of seeds and machines, "
            "ordinary. One pair cannot tell FP8 from BF16 at this size; the committed interval says how close they are."
        )
    else:
        lines.append(f"This gap is {z:+.1f} SD from the committed mean, outside ±2 SD of seeds and machines: {LOOK_AT}.")
    return "\n".join(lines)


def plot(fp8: list[dict], bf16: list[dict], path: pathlib.Path, title: str,
         gap: float | None = None, band: dict | None = None, cross: dict | None = None) -> None:
    """Loss curves, the gap per step with the whole-split gap (`gap`, at the last step) and the
    committed band (mean ± 2 SD of seeds and machines), and the worst MoE layer's balance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(7, 8.5), sharex=True)
    for name, rows in (("BF16", bf16), ("FP8", fp8)):
        ax0.plot([r["step"] for r in rows], [r["ce"] for r in rows], label=f"{name} train CE")
        ev = [r for r in rows if "val_loss" in r]
        ax0.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o--", label=f"{name} val CE")
    ax0.set_ylabel("cross-entropy (nats/byte)")
    ax0.legend()
    ax0.set_title(title)
    by_step = {r["step"]: r["ce"] for r in bf16}
    steps = [r["step"] for r in fp8 if r["step"] in by_step]
    gap_per_step = [100 * (r["ce"] - by_step[r["step"]]) / by_step[r["step"]] for r in fp8 if r["step"] in by_step]
    ax1.plot(steps, gap_per_step, label="train CE (each logged step's batch)", lw=0.8)
    ev_b = {r["step"]: r["val_loss"] for r in bf16 if "val_loss" in r}
    ev = [(r["step"], 100 * (r["val_loss"] - ev_b[r["step"]]) / ev_b[r["step"]])
          for r in fp8 if "val_loss" in r and r["step"] in ev_b]
    if ev:
        ax1.plot(*zip(*ev), "o--", label="val CE (the loop's 4 batches)")
    if band is not None:
        mean, sd = 100 * band["mean_gap"], 100 * total_sd(band, cross)
        what = "seeds and machines" if cross else "seeds"
        ax1.axhspan(mean - 2 * sd, mean + 2 * sd, color="C2", alpha=0.15,
                    label=f"committed band: mean ± 2 SD ({what})")
        ax1.axhline(mean, color="C2", lw=0.8)
    if gap is not None:
        ax1.plot([fp8[-1]["step"]], [100 * gap], "D", color="C3", ms=8, label="this pair, whole validation split")
    for y, label in ((100 * TARGET, "±0.25 % (DeepSeek-V3's bar)"), (-100 * TARGET, None)):
        ax1.axhline(y, color="gray", lw=0.8, ls=":", label=label)
    ax1.set_ylabel("(FP8 - BF16) / BF16 [%]")
    ax1.legend(fontsize=7)
    for name, rows in (("BF16", bf16), ("FP8", fp8)):
        ax2.plot([r["step"] for r in rows], [worst_load(r) for r in rows], label=name)
    ax2.axhline(1, color="gray", lw=0.8, ls=":")
    ax2.set_ylabel("max/mean expert load\n(worst MoE layer)")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_seconds(rows: list[dict], tokens_per_step: int) -> float:
    """Training wall time from the metrics (the logged intervals, compilation included), so that
    it survives a resumed run."""
    steps = [0] + [r["step"] for r in rows]
    return sum((b - a) * tokens_per_step / r["tokens_per_s"] for a, b, r in zip(steps, steps[1:], rows))


def parser():
    p = train_parser()
    p.description = __doc__
    p.set_defaults(ckpt_every=CKPT_EVERY)
    return p


def run_configs(args) -> dict:
    """{"fp8": config, "bf16": config}: the same run but for the precision (and its recipe)."""
    base = config_from_args(args)
    out = pathlib.Path(args.out)
    return {
        precision: dataclasses.replace(
            base, precision=precision, out=str(out / precision), keep_checkpoints=EVALUATED,
            recipe_overrides=base.recipe_overrides if precision == "fp8" else (),
        )
        for precision in ("fp8", "bf16")
    }


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    compile_cache.enable()  # a second start with the same programs skips XLA's compile
    out = pathlib.Path(args.out)
    configs = run_configs(args)
    results, whole = {}, {}
    for precision, cfg in configs.items():
        results[precision] = train(cfg, resume=args.resume)
        whole[precision] = evaluate_checkpoints(out / precision)
    fp8, bf16 = read_metrics(out / "fp8" / "metrics.jsonl"), read_metrics(out / "bf16" / "metrics.jsonl")
    val8, val16 = fp8[-1]["val_loss"], bf16[-1]["val_loss"]
    per_step = cfg.batch_size * cfg.seq_len
    gap = (mean_validation_ce(whole["fp8"]) - mean_validation_ce(whole["bf16"])) / mean_validation_ce(whole["bf16"])
    band, cross = committed_band(configs["fp8"]), cross_machine_spread()
    reading = read_gap(gap, band, cross, configs["fp8"].seed)
    names = json.loads((out / "fp8" / "config.json").read_text())["moe_layer_names"]
    wall = {"fp8": train_seconds(fp8, per_step), "bf16": train_seconds(bf16, per_step)}
    summary = {
        "preset": args.preset,
        "steps": results["fp8"]["steps"],
        "tokens": results["fp8"]["steps"] * per_step,
        "final_train_loss_fp8": fp8[-1]["ce"],
        "final_train_loss_bf16": bf16[-1]["ce"],
        "final_val_loss_fp8": val8,
        "final_val_loss_bf16": val16,
        "val_ce_whole_split_fp8": mean_validation_ce(whole["fp8"]),
        "val_ce_whole_split_bf16": mean_validation_ce(whole["bf16"]),
        "evaluated_steps": sorted(whole["fp8"]),
        "relative_gap": gap,
        "relative_gap_final_4_batches": (val8 - val16) / val16,
        "max_abs_relative_gap_train_ce_last_quarter": float(np.max(np.abs([
            (a["ce"] - b["ce"]) / b["ce"] for a, b in zip(fp8, bf16) if a["step"] > 0.75 * results["fp8"]["steps"]
        ] or [np.nan]))),
        "wall_s_fp8": wall["fp8"],
        "wall_s_bf16": wall["bf16"],
        "tokens_per_s_fp8": results["fp8"]["steps"] * per_step / wall["fp8"],
        "tokens_per_s_bf16": results["bf16"]["steps"] * per_step / wall["bf16"],
        "last_quarter_load_max_over_mean_fp8": last_quarter_balance(fp8, results["fp8"]["steps"], names)["load_max_over_mean"],
        "last_quarter_load_max_over_mean_bf16": last_quarter_balance(bf16, results["fp8"]["steps"], names)["load_max_over_mean"],
        "read_against_committed_band": reading,
        "committed_band_sd_seeds_and_machines": total_sd(band, cross) if band else None,
        "note": "relative_gap: of the validation CE on the whole validation split, each run's mean over its "
                "last kept checkpoints (evaluated_steps); losses are byte-level cross-entropy in nats; train CE excludes the MTP and balance "
                "terms; wall time is the sum of the logged intervals (compilation included)",
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    plot(fp8, bf16, out / "parity.png", f"{args.preset}: FP8 (DeepSeek-V3 recipe) vs BF16", gap, band, cross)
    print(json.dumps(summary, indent=1))
    print(f"\nFP8 - BF16 validation CE gap: {100 * gap:+.3f} % (whole validation split, mean of steps "
          f"{', '.join(map(str, summary['evaluated_steps']))})\n{reading}")
    print(f"plot: {out / 'parity.png'}\nsummary: {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()

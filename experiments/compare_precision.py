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
runs followed that protocol.
"""

import dataclasses
import json
import pathlib
import sys

import numpy as np

from jfp8.train.evaluate import evaluate_checkpoints, mean_validation_ce
from jfp8.train.loop import last_quarter_balance, read_metrics, train, worst_load

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity_seeds import CKPT_EVERY, EVALUATED, committed_band, read_against_band, write_atomic  # noqa: E402
from train_moe import config_from_args, parser as train_parser  # noqa: E402


def plot(fp8: list[dict], bf16: list[dict], path: pathlib.Path, title: str) -> None:
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
    gap = [100 * (r["ce"] - by_step[r["step"]]) / by_step[r["step"]] for r in fp8 if r["step"] in by_step]
    ax1.plot(steps, gap, label="train CE")
    ev_b = {r["step"]: r["val_loss"] for r in bf16 if "val_loss" in r}
    ev = [(r["step"], 100 * (r["val_loss"] - ev_b[r["step"]]) / ev_b[r["step"]])
          for r in fp8 if "val_loss" in r and r["step"] in ev_b]
    if ev:
        ax1.plot(*zip(*ev), "o--", label="val CE")
    for y in (0.25, -0.25):
        ax1.axhline(y, color="gray", lw=0.8, ls=":")
    ax1.set_ylabel("(FP8 - BF16) / BF16 [%]")
    ax1.legend()
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
    band = committed_band(configs["fp8"])
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
        "read_against_committed_band": read_against_band(gap, band),
        "note": "relative_gap: of the validation CE on the whole validation split, each run's mean over its "
                "last kept checkpoints (evaluated_steps); losses are byte-level cross-entropy in nats; train CE excludes the MTP and balance "
                "terms; wall time is the sum of the logged intervals (compilation included)",
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    plot(fp8, bf16, out / "parity.png", f"{args.preset}: FP8 (DeepSeek-V3 recipe) vs BF16")
    print(json.dumps(summary, indent=1))
    print(f"\nFP8 - BF16 validation CE gap: {100 * gap:+.3f} % (whole validation split, mean of steps "
          f"{', '.join(map(str, summary['evaluated_steps']))})\n{read_against_band(gap, band)}")
    print(f"plot: {out / 'parity.png'}\nsummary: {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()

"""Expert balance under the router-bias update rules, on the tiny preset.

    python experiments/balancing.py --out experiments/results/balancing-tiny            # every arm
    python experiments/balancing.py --out DIR --arms sign-lr,clipped-lr15 --precision fp8 bf16

Each arm is one `experiments/train_moe.py` run (the command is written into the summary) of the
tiny preset, 200 steps, seed 0 (or --seed), logged every step, with 16 routed experts top-2 (`e16-` arms) or
the preset's 4 experts top-2 (`e4-` arms). An arm changes only the router-bias update:

  const1e-3     the old rule: b += 1e-3·sign(mean − load) every step, never frozen
  sign-lr       b += κ·lr_t·sign(mean − load), κ = 1e-3/2.2e-4 (DeepSeek-V3's γ/peak LR), frozen
                for the last 3 % of steps
  clipped-lrK   b += K·lr_t·clip((mean − load)/mean, ±1), frozen for the last 3 %
  clipped-3e-2  b += 3e-2·clip((mean − load)/mean, ±1), never frozen (the issue's CPU probe)

Reads each run's metrics.jsonl and writes DIR/summary.json and DIR/summary.md: per MoE layer, the
max/mean load averaged over the last quarter of training and the dead experts (mean and max over
those steps), and the final validation CE. Runs are kept under DIR/runs/ (metrics and config only;
checkpoints are deleted).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np

from jfp8.train.loop import last_quarter_balance, read_metrics, worst_load

STEPS = 200
E16 = "n_routed=16"
DSV3 = "bias_lr_ratio=4.545454545454545"  # 1e-3 / 2.2e-4, DeepSeek-V3's γ / peak LR
OLD = "bias_schedule=constant,bias_gamma=0.001,bias_freeze_frac=0"
ARMS = {
    "e16-const1e-3": f"{E16},bias_rule=sign,{OLD}",
    "e16-sign-lr": f"{E16},bias_rule=sign,bias_schedule=lr,{DSV3}",
    "e16-clipped-lr4.5": f"{E16},bias_rule=clipped,bias_schedule=lr,{DSV3}",
    "e16-clipped-lr15": f"{E16},bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=15",
    "e16-clipped-3e-2": f"{E16},bias_rule=clipped,bias_schedule=constant,bias_gamma=0.03,bias_freeze_frac=0",
    "e16-sign-lr15": f"{E16},bias_rule=sign,bias_schedule=lr,bias_lr_ratio=15",
    "e4-const1e-3": f"bias_rule=sign,{OLD}",
    "e4-sign-lr": f"bias_rule=sign,bias_schedule=lr,{DSV3}",
    "e4-clipped-lr15": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=15",
}


def command(arm: str, precision: str, seed: int, out: pathlib.Path) -> list[str]:
    return [
        sys.executable, "experiments/train_moe.py", "--preset", "tiny", "--precision", precision,
        "--steps", str(STEPS), "--seed", str(seed), "--log-every", "1", "--ckpt-every", str(STEPS),
        "--no-progress", "--model", ARMS[arm], "--out", str(out),
    ]


def summarize_run(run: pathlib.Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    names = json.loads((run / "config.json").read_text())["moe_layer_names"]
    bal = last_quarter_balance(rows, STEPS, names)
    return {
        "layers": names,
        "last_quarter_load_max_over_mean": {k: round(v, 4) for k, v in bal["load_max_over_mean"].items()},
        "last_quarter_dead_experts_mean": {k: round(v, 3) for k, v in bal["dead_experts_mean"].items()},
        "last_quarter_dead_experts_max": bal["dead_experts_max"],
        "final_bias_spread": dict(zip(names, np.round(rows[-1]["bias_spread"], 4).tolist())),
        "final_val_ce": rows[-1].get("val_loss"),
        "steps_logged": len(rows),
    }


def plot(out: pathlib.Path, runs: dict) -> None:
    """DIR/balance.png: the worst MoE layer's max/mean load per step, one panel per expert count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({name.split("-")[0] for name in runs})
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups):
        for name in runs:
            if name.startswith(group + "-"):
                rows = read_metrics(out / "runs" / name / "metrics.jsonl")
                ax.plot([r["step"] for r in rows], [worst_load(r) for r in rows], lw=1, label=name)
        ax.axhline(1.3, color="gray", lw=0.8, ls=":")
        ax.axvline(3 * STEPS // 4, color="gray", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("max/mean load, worst layer")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "balance.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, among {list(ARMS)}")
    p.add_argument("--precision", nargs="+", default=["bf16"], choices=("bf16", "fp8"))
    p.add_argument("--seed", type=int, default=0, help="runs of a seed other than 0 are named ...-s<seed>")
    p.add_argument("--summarize-only", action="store_true", help="re-read the runs under --out/runs")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"runs": {}}
    for arm in filter(None, args.arms.split(",")):
        for precision in args.precision:
            name = f"{arm}-{precision}" + (f"-s{args.seed}" if args.seed else "")
            run = out / "runs" / name
            cmd = command(arm, precision, args.seed, run)
            if not args.summarize_only:
                print(" ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                shutil.rmtree(run / "checkpoints", ignore_errors=True)
            summary["runs"][name] = {
                "arm": arm, "precision": precision, "seed": args.seed, "model_overrides": ARMS[arm],
                "command": "python " + " ".join(cmd[1:]), **summarize_run(run),
            }
    out.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| run | max/mean load, last quarter (per layer) | dead experts, last quarter mean / max | final val CE |",
             "|---|---|---|---|"]
    for name, r in summary["runs"].items():
        loads = ", ".join(f"{k} {v:.2f}" for k, v in r["last_quarter_load_max_over_mean"].items())
        dead = ", ".join(f"{k} {r['last_quarter_dead_experts_mean'][k]:.2f} / {r['last_quarter_dead_experts_max'][k]}"
                         for k in r["layers"])
        lines.append(f"| {name} | {loads} | {dead} | {r['final_val_ce']:.4f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(out, summary["runs"])
    print("\n".join(lines))


if __name__ == "__main__":
    main()

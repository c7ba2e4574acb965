"""Recipe ablations in training: 128x128 blocks for the Dgrad input, and power-of-two scales.

    python experiments/recipe_ablation.py --preset small --steps 300 --batch-size 8 --seq-len 256 \
        --warmup 30 --eval-every 50 --log-every 1 --probe-every 100 --out experiments/results/ablation-small
    ... --loss-scale 16384 --out experiments/results/ablation-small-ls16k   # dy above the amax floor

DeepSeek-V3 Appendix B.2 reports that quantizing the activation gradient dy (the Dgrad input) in
128x128 blocks, instead of 1x128 tiles, made a 16B MoE diverge after ~300B tokens. This trains the
same model, seed, initialisation and data order once per arm:

  deepseek       the DeepSeek-V3 recipe: dy in 1x128 tiles, FP32 scales
  dgrad-128x128  dy quantized in 128x128 blocks for Dgrad (`Fp8Recipe(grad_block=(128, 128))`)
  pow2           every scale rounded up to a power of two (`Fp8Recipe(pow2_scale=True)`)

and every `--probe-every` steps measures, at each arm's current parameters and on fixed held-out
batches, the relative error of the parameter gradient against an FP32 reference (no FP8, FP32
activations; `jfp8.train.probes.gradient_errors`), with the BF16 model's error as the floor.

Writes DIR/<arm>/ (train_moe.py runs: config.json, metrics.jsonl; checkpoints are not kept in
git), DIR/probes.jsonl and DIR/probes.csv (step, arm, GEMMs, parameter group, relative error),
DIR/summary.json, DIR/summary.md and DIR/ablation.png (loss curves, gap to the deepseek arm,
gradient error over training). `--resume` continues a stopped experiment: probed steps are kept,
each arm's training resumes from its checkpoint.

    python experiments/recipe_ablation.py --combine DIR DIR ... --out DIR

reads seed replicates of one command (the same arguments but `--seed`) and writes each arm's
whole-split gap per seed, its mean, 95 % Student-t interval and sign count to seeds.json/seeds.md:
one seed's gap is an anecdote.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np

from jfp8.recipe import Fp8Recipe
from jfp8.train.evaluate import evaluate_checkpoints
from jfp8.train.loop import build, last_quarter_balance, read_metrics, train, worst_load
from jfp8.train.probes import gradient_errors, load_run, val_batches

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity_seeds import interval, write_atomic  # noqa: E402
from train_moe import config_from_args, parser as train_parser  # noqa: E402

ARMS = {
    "deepseek": (),
    "dgrad-128x128": (("grad_block", (128, 128)),),
    "pow2": (("pow2_scale", True),),
}
BASELINE = "deepseek"


def parser():
    p = train_parser()
    p.description = __doc__
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {list(ARMS)}")
    p.add_argument("--probe-every", type=int, default=50, help="steps between gradient-error probes")
    p.add_argument("--probe-batches", type=int, default=2, help="held-out batches per probe")
    p.add_argument("--combine", nargs="+", metavar="DIR", default=None,
                   help="read finished experiments (seed replicates of one protocol) and write each arm's "
                        "gap over them, with its 95 %% interval, to --out (seeds.json, seeds.md); trains nothing")
    return p


def combine(dirs: list[str], out: pathlib.Path) -> dict:
    """Each arm's whole-split gap to the deepseek arm over seed replicates of one protocol: the
    per-seed gaps, their mean and two-sided 95 % Student-t interval, and how many are positive."""
    runs = []
    for d in map(pathlib.Path, dirs):
        path = d / "summary.json"
        if not path.exists():
            raise SystemExit(f"--combine: {path} not found; pass directories of finished recipe_ablation.py runs")
        summary = json.loads(path.read_text())
        config = json.loads((d / BASELINE / "config.json").read_text())
        runs.append((d, summary, config))
    # Replicates differ in the seed (and where they were written) only.
    protocol = {json.dumps({k: v for k, v in c.items() if k not in ("seed", "out")}, sort_keys=True)
                for _, _, c in runs}
    if len(protocol) > 1:
        raise SystemExit("--combine: the runs' deepseek configs differ beyond the seed; combine only seed "
                         "replicates of one command")
    seeds = [c["seed"] for _, _, c in runs]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"--combine: seeds {seeds} repeat; each directory must be another seed")
    arms = {}
    for arm in runs[0][1]["arms"]:
        if arm == BASELINE or not all(arm in s["arms"] for _, s, _ in runs):
            continue
        gaps = [s["arms"][arm]["gap_vs_deepseek"] for _, s, _ in runs]
        mean, lo, hi = interval(gaps)
        arms[arm] = {"gaps": gaps, "mean_gap": mean, "ci95": [lo, hi], "positive": sum(g > 0 for g in gaps),
                     "worst_last_quarter_load": max(s["arms"][arm]["last_quarter_max_over_mean_load"] for _, s, _ in runs)}
    first = runs[0][1]
    result = {"preset": first["preset"], "steps": first["steps"], "loss_scale": first["loss_scale"],
              "seeds": seeds, "runs": [str(d) for d, _, _ in runs],
              "deepseek_val_ce": [s["arms"][BASELINE]["final_val_ce"] for _, s, _ in runs],
              "worst_last_quarter_load_deepseek": max(
                  s["arms"][BASELINE]["last_quarter_max_over_mean_load"] for _, s, _ in runs),
              "arms": arms,
              "note": "gap: (val CE - deepseek val CE) / deepseek val CE, each on the whole validation split at "
                      "the final step, paired by seed; ci95: Student-t interval of the mean gap over seeds"}
    lines = [f"# Recipe ablation over seeds ({first['preset']}, {first['steps']} steps, loss scale "
             f"{first['loss_scale']:g}; seeds {', '.join(map(str, seeds))})", "",
             "Gap = (val CE − deepseek val CE) / deepseek val CE on the whole validation split, paired by seed. "
             "The interval is the two-sided 95 % Student-t interval of the mean gap.", "",
             "| arm | gap per seed | mean | 95 % interval | positive |", "|---|---|---|---|---|"]
    for arm, a in arms.items():
        per = ", ".join(f"{100 * g:+.2f} %" for g in a["gaps"])
        ci = "n/a (one seed)" if not np.isfinite(a["ci95"][0]) else \
            f"[{100 * a['ci95'][0]:+.2f} %, {100 * a['ci95'][1]:+.2f} %]"
        lines.append(f"| {arm} | {per} | {100 * a['mean_gap']:+.2f} % | {ci} | {a['positive']} of {len(a['gaps'])} |")
    out.mkdir(parents=True, exist_ok=True)
    lines += ["", "Sources: " + ", ".join(
        f"[{d.name}]({os.path.relpath(d / 'summary.md', out)})" for d, _, _ in runs) + "."]
    write_atomic(out / "seeds.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out / "seeds.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def run_arm(base, arm: str, probe_steps: list[int], batches, out: pathlib.Path, done: set) -> list[dict]:
    """Trains one arm in segments ending at the probe steps and probes the gradient after each,
    appending the rows to DIR/probes.jsonl; (arm, step) pairs in `done` (a resumed experiment)
    are skipped."""
    cfg = dataclasses.replace(base, precision="fp8", recipe_overrides=ARMS[arm], out=str(out / arm))
    recipe = cfg.model_config().recipe
    for step in probe_steps:
        if (arm, step) in done:
            continue
        if step > 0:
            train(cfg, resume=step != probe_steps[1], stop_after=step)
            _, params, rest = load_run(cfg.out, step)
        else:
            _, _, params, rest, *_ = build(cfg)
        t = time.perf_counter()
        errors = gradient_errors(cfg.model_config(), params, rest, batches, {arm: recipe},
                                 bf16_floor=arm == BASELINE, loss_scale=cfg.loss_scale)
        rows = []
        for name, e in errors.items():
            rows.append({"step": step, "arm": arm, "gemms": name, "group": "all", "rel_error": e["rel_error"],
                         "cosine": e["cosine"]})
            rows += [{"step": step, "arm": arm, "gemms": name, "group": g, "rel_error": v, "cosine": None}
                     for g, v in e["groups"].items()]
        with (out / "probes.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"[{arm}] step {step}: gradient rel. error {errors[arm]['rel_error']:.3e} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)


def plot(metrics: dict[str, list[dict]], probes: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    for arm, rows in metrics.items():
        ax0.plot([r["step"] for r in rows], [r["ce"] for r in rows], label=f"{arm} train CE")
        ev = [r for r in rows if "val_loss" in r]
        ax0.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o--", label=f"{arm} val CE")
    ax0.set_ylabel("cross-entropy (nats/byte)")
    ax0.set_title(title)
    ax0.legend(fontsize=7)
    base = {r["step"]: r["ce"] for r in metrics.get(BASELINE, [])}
    for arm, rows in metrics.items():
        if arm == BASELINE or not base:
            continue
        pts = [(r["step"], 100 * (r["ce"] - base[r["step"]]) / base[r["step"]]) for r in rows if r["step"] in base]
        ax1.plot(*zip(*pts), label=f"{arm} vs {BASELINE} (train CE)")
    ax1.axhline(0, color="gray", lw=0.8)
    ax1.set_ylabel("relative gap [%]")
    ax1.legend(fontsize=7)
    for (arm, gemms) in sorted({(r["arm"], r["gemms"]) for r in probes}):
        pts = sorted((r["step"], r["rel_error"]) for r in probes
                     if r["arm"] == arm and r["gemms"] == gemms and r["group"] == "all")
        label = f"{arm} params, BF16 GEMMs (floor)" if gemms == "bf16" else f"{arm}"
        ax2.plot(*zip(*pts), "o-" if gemms != "bf16" else "x:", label=label)
    ax2.set_yscale("log")
    ax2.set_ylabel("‖g − g_FP32‖ / ‖g_FP32‖")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(load: float | None) -> str:
    return "not logged" if load is None else f"{load:.2f}"


def _dead(n: int | None) -> str:
    return "-" if n is None else str(n)


def whole_split_ce(out: pathlib.Path, arms: list[str], step: int) -> dict[str, float]:
    """{arm: cross-entropy of its step-`step` checkpoint on the whole validation split}, cached in
    DIR/whole_split.json (written atomically) so that a resumed experiment does not redo it."""
    path = out / "whole_split.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    for arm in arms:
        if cached.get(arm, {}).get("step") != step:
            ce = evaluate_checkpoints(out / arm, [step])[step]
            cached[arm] = {"step": step, "val_ce": ce}
            write_atomic(path, json.dumps(cached, indent=1) + "\n")
            print(f"[{arm}] step {step}: whole-split validation CE {ce:.5f}", flush=True)
    return {arm: cached[arm]["val_ce"] for arm in arms}


def summarize(metrics: dict[str, list[dict]], probes: list[dict], cfg, command: str,
              whole: dict[str, float]) -> tuple[dict, str]:
    final = {arm: rows[-1] for arm, rows in metrics.items()}
    base_val = whole.get(BASELINE)
    summary = {"preset": cfg.preset, "steps": cfg.steps, "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
               "loss_scale": cfg.loss_scale, "arms": {}}
    for arm, rows in metrics.items():
        f = final[arm]
        # The worst MoE layer's max/mean load, averaged over the logged steps of the last quarter
        # (the balancing protocol's measure, experiments/balancing.py), and at the last step.
        tail = last_quarter_balance(rows, cfg.steps, list(range(len(rows[-1]["load_max_over_mean"]))))
        summary["arms"][arm] = {
            "recipe_overrides": {k: v for k, v in ARMS[arm]},
            "final_train_ce": f["ce"],
            "final_val_ce": whole[arm],  # on the whole validation split
            "final_val_ce_eval_set": f["val_loss"],  # the training loop's few evaluation batches
            "gap_vs_deepseek": None if base_val is None else (whole[arm] - base_val) / base_val,
            "finite": all(np.isfinite(r["loss"]) for r in rows),
            "max_grad_norm": max(r["grad_norm"] for r in rows),
            "final_max_over_mean_load": worst_load(f),
            "last_quarter_max_over_mean_load": max(tail["load_max_over_mean"].values(), default=None),
            "last_quarter_steps_logged": sum(r["step"] > 0.75 * cfg.steps for r in rows),
            "last_quarter_dead_experts_max": max(tail["dead_experts_max"].values(), default=None),
            "gradient_rel_error": {
                r["step"]: r["rel_error"] for r in probes if r["arm"] == arm and r["gemms"] == arm and r["group"] == "all"
            },
        }
    floor = {r["step"]: r["rel_error"] for r in probes if r["gemms"] == "bf16" and r["group"] == "all"}
    summary["bf16_floor_gradient_rel_error"] = floor
    steps = sorted({r["step"] for r in probes})
    lines = [f"# Recipe ablations in training (`{command}`)", "",
             f"{cfg.preset} preset, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} bytes, loss scale "
             f"{cfg.loss_scale:g}, seed {cfg.seed} (the same init and data for every arm). Val CE = the final checkpoint's cross-entropy on the whole validation split; gap = (val CE - deepseek val CE) / deepseek val CE. Gradient error = "
             "‖g − g_FP32‖/‖g_FP32‖ of the full parameter gradient on held-out batches at that arm's "
             "parameters (routing flips included); BF16 floor = the same for BF16 GEMMs at the "
             "deepseek arm's parameters. Load = the worst MoE layer's max/mean expert load, averaged over "
             "the logged steps of the last quarter of training (≤ 1.3 is the balancing target); dead = the most "
             "experts of any layer that got no token in one logged step of that quarter.", "", "```",
             f"{'arm':>14} | {'final val CE':>12} {'gap':>8} | {'finite':>6} {'max |g|':>8} {'load, last ¼':>13} {'dead':>4} | "
             + " ".join(f"{'err@' + str(s):>9}" for s in steps),
             "-" * (77 + 10 * len(steps))]
    for arm, a in summary["arms"].items():
        gap = "" if a["gap_vs_deepseek"] is None else f"{100 * a['gap_vs_deepseek']:+.2f}%"
        errs = " ".join(f"{a['gradient_rel_error'].get(s, float('nan')):9.2e}" for s in steps)
        lines.append(f"{arm:>14} | {a['final_val_ce']:12.5f} {gap:>8} | {str(a['finite']):>6} "
                     f"{a['max_grad_norm']:8.3f} {_fmt(a['last_quarter_max_over_mean_load']):>13} {_dead(a['last_quarter_dead_experts_max']):>4} | {errs}")
    if floor:
        lines.append(f"{'BF16 floor':>14} | {'':>12} {'':>8} | {'':>6} {'':>8} {'':>13} {'':>4} | "
                     + " ".join(f"{floor.get(s, float('nan')):9.2e}" for s in steps))
    lines.append("```")
    groups = sorted({r["group"] for r in probes if r["group"] != "all"})
    last = steps[-1]
    lines += ["", f"Gradient error by parameter group at step {last}:", "", "```",
              f"{'arm':>14} | " + " ".join(f"{g:>14}" for g in groups)]
    for gemms in [*summary["arms"], "bf16"]:
        by = {r["group"]: r["rel_error"] for r in probes if r["gemms"] == gemms and r["step"] == last}
        if by:
            lines.append(f"{gemms:>14} | " + " ".join(f"{by.get(g, float('nan')):14.3e}" for g in groups))
    lines.append("```")
    return summary, "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.combine:
        return combine(args.combine, pathlib.Path(args.out))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if args.precision != "fp8" or args.recipe:
        raise SystemExit("recipe_ablation.py sets the precision and recipe of each arm itself; "
                         "drop --precision/--recipe")
    base = config_from_args(args)
    if args.probe_every < 1 or base.steps % args.probe_every:
        raise SystemExit(f"--probe-every must divide --steps ({base.steps}); got {args.probe_every}")
    base = dataclasses.replace(base, ckpt_every=args.probe_every)
    out = pathlib.Path(args.out)
    # Probe batches: the last held-out batches, disjoint from the ones evaluation uses first.
    batches = val_batches(base, base.eval_batches + args.probe_batches)[base.eval_batches:]
    probe_steps = list(range(0, base.steps + 1, args.probe_every))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "probes.jsonl"
    if not args.resume or not log.exists():
        log.write_text("")
        # A fresh experiment in an old directory must not read the old runs' whole-split losses.
        (out / "whole_split.json").unlink(missing_ok=True)
    done = {(r["arm"], r["step"]) for r in read_metrics(log)}
    for arm in arms:
        run_arm(base, arm, probe_steps, batches, out, done)
    probes = [r for r in read_metrics(log) if r["arm"] in arms]
    metrics = {arm: read_metrics(out / arm / "metrics.jsonl") for arm in arms}
    with (out / "probes.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(probes[0]))
        w.writeheader()
        w.writerows(probes)
    given = argv if argv is not None else sys.argv[1:]
    command = "python experiments/recipe_ablation.py " + " ".join(a for a in given if a != "--resume")
    summary, text = summarize(metrics, probes, base, command, whole_split_ce(out, arms, base.steps))
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(out / "summary.md", text)
    scaled = f", loss scale {base.loss_scale:g}" if base.loss_scale != 1 else ""
    plot(metrics, probes, out / "ablation.png", f"{base.preset}{scaled}: " + " vs ".join(arms))
    print(text)
    print(f"plot: {out / 'ablation.png'}")
    return summary


if __name__ == "__main__":
    main()

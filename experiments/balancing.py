"""Expert balance under the router-bias update rules, on the tiny and small presets.

    python experiments/balancing.py --out experiments/results/balancing-tiny            # the tiny arms
    python experiments/balancing.py --out DIR --arms e16-sign-lr,e16-clipped-lr15 --precision fp8 bf16
    python experiments/balancing.py --out experiments/results/balancing-small --arms small-clipped-lr15,small-clipped-lr50

Each arm is one `experiments/train_moe.py` run (the command is written into the summary), seed 0
(or --seed). `e16-` and `e4-` arms: the tiny preset, 200 steps logged every step, with 16 routed
experts top-2 (`e16-`) or the preset's 4 experts top-2 (`e4-`). `small-` arms: the small preset (16
routed experts top-2), 100 steps of 8 x 256 bytes with 30 warmup steps, logged every 5 steps (the
recipe ablation's protocol). `long-` arms: the same, 300 steps, logged every step (the last
quarter of 100 steps still holds the recovery from the early collapse; see the summary). An arm
changes only the router-bias update:

  const1e-3     the old rule: b += 1e-3·sign(mean − load) every step, never frozen
  sign-lr       b += κ·lr_t·sign(mean − load), κ = 1e-3/2.2e-4 (DeepSeek-V3's γ/peak LR), frozen
                for the last 3 % of steps
  clipped-lrK   b += K·lr_t·clip((mean − load)/mean, ±1), frozen for the last 3 %
  clipped-3e-2  b += 3e-2·clip((mean − load)/mean, ±1), never frozen (the issue's CPU probe)
  clipped-1e-1  (small) b += 1e-1·clip((mean − load)/mean, ±1), frozen for the last 3 %
  -gN / -aX     (small) the clipped rule's bias_gain N; the sequence-wise loss's balance_alpha X
  -nw           (small) γ_t = K·lr_max(t, warmup): no warmup of γ (bias_schedule=lr_decay)

Reads each run's metrics.jsonl and writes DIR/summary.json and DIR/table.md: per MoE layer, the
max/mean load averaged over the last quarter of training and the dead experts (mean and max over
those steps), and the final validation CE. Runs are kept under DIR/runs/ (metrics and config only;
checkpoints are deleted).

    python experiments/balancing.py --out DIR --floor RUN_DIR [--floor-step 200]

measures how balanced one step's loads can be at a run's batch size: it takes a checkpoint of a
trained run, sets its router biases so that the loads pooled over 16 training batches are balanced
(the clipped rule applied to the pooled loads, 40 times, γ 0.02 decaying ×0.93), and writes to
DIR/floor.json the max/mean load per layer of 32 other batches, one batch at a time (the number
the training log averages) and pooled, with the floor of independent tokens. What the per-batch
number keeps above 1 is the batch's own content, which no bias can remove.

    python experiments/balancing.py --out DIR --gate-probe RUN_DIR --probe-steps 30 40

reads the gate at a run's checkpoints (one validation batch through the model) and writes to
DIR/gate_probe.json per MoE layer: `preference_spread`, max − min over experts of the gate logit
averaged over tokens (the token-independent preference the bias must cancel);
`logit_token_std` and `score_token_std`, the spread over tokens of one expert's logit and
sigmoid score (median over experts: how finely the bias can steer); `bias_spread`;
`common_fraction`, the share of the gate input's energy in its mean over tokens; and the batch's
`load_max_over_mean`. Early checkpoints of a full-length run come from `train_moe.py
--ckpt-every 10 --keep-checkpoints 4 --stop-after 40`.
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

_SMALL = ["--batch-size", "8", "--seq-len", "256", "--warmup", "30"]
# an arm's prefix -> (preset, steps, the train_moe.py arguments besides precision, seed, model, out)
PROTOCOLS = {
    "e16": ("tiny", 200, ["--log-every", "1", "--ckpt-every", "200"]),
    "e4": ("tiny", 200, ["--log-every", "1", "--ckpt-every", "200"]),
    "small": ("small", 100, [*_SMALL, "--log-every", "5", "--eval-every", "100"]),
    # logged every step: a last-quarter average over every 5th (10th) step moved one layer by 0.03 (0.07)
    "long": ("small", 300, [*_SMALL, "--log-every", "1", "--eval-every", "100", "--ckpt-every", "300"]),
}
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
    "small-clipped-lr15": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=15",
    "small-clipped-lr30": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=30",
    "small-clipped-lr50": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=50",
    "small-clipped-1e-1": "bias_rule=clipped,bias_schedule=constant,bias_gamma=0.1",
    "small-clipped-lr100": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=100",
    "small-clipped-lr15-g4": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=15,bias_gain=4",
    "small-clipped-lr50-g4": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=50,bias_gain=4",
    "small-clipped-3e-2": "bias_rule=clipped,bias_schedule=constant,bias_gamma=0.03",
    # κ = 50 plus a stronger complementary sequence-wise loss (eq. 17; DeepSeek-V3's α = 1e-4):
    # its gradient reaches the gate, against the token-independent preference the bias must cancel.
    "small-clipped-lr50-a1e-3": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=50,balance_alpha=0.001",
    "small-clipped-lr50-a1e-2": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=50,balance_alpha=0.01",
    # γ_t = K·lr_max(t, warmup): the learning rate's decay without its warmup (DeepSeek-V3 held
    # γ = 0.001 from step 0 while its learning rate warmed up), against the ceiling of N_r/K that
    # every tied arm sits at while γ climbs from 0 through the 30 warmup steps.
    "small-clipped-lr50-nw": "bias_rule=clipped,bias_schedule=lr_decay,bias_lr_ratio=50",
    # the small protocol run 300 steps: the worst layer is still coming down from the ceiling at
    # step 75 of 100, so the last quarter of a 100-step run measures the transient
    "long-clipped-lr15": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=15",
    "long-clipped-lr50": "bias_rule=clipped,bias_schedule=lr,bias_lr_ratio=50",
}


def protocol_of(arm: str) -> tuple[str, int, list[str]]:
    """(preset, steps, train_moe.py arguments) of an arm, from its prefix."""
    return PROTOCOLS[arm.split("-")[0]]


def preset(arm: str) -> str:
    return protocol_of(arm)[0]


def steps_of(arm: str) -> int:
    return protocol_of(arm)[1]


def command(arm: str, precision: str, seed: int, out: pathlib.Path) -> list[str]:
    _, steps, protocol = protocol_of(arm)
    return [
        sys.executable, "experiments/train_moe.py", "--preset", preset(arm), "--precision", precision,
        "--steps", str(steps), "--seed", str(seed), *protocol,
        "--no-progress", "--model", ARMS[arm], "--out", str(out),
    ]


def summarize_run(run: pathlib.Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    config = json.loads((run / "config.json").read_text())
    names = config["moe_layer_names"]
    bal = last_quarter_balance(rows, config["steps"], names)
    return {
        "layers": names,
        "last_quarter_load_max_over_mean": {k: round(v, 4) for k, v in bal["load_max_over_mean"].items()},
        "last_quarter_dead_experts_mean": {k: round(v, 3) for k, v in bal["dead_experts_mean"].items()},
        "last_quarter_dead_experts_max": bal["dead_experts_max"],
        "final_bias_spread": dict(zip(names, np.round(rows[-1]["bias_spread"], 4).tolist())),
        "final_val_ce": rows[-1].get("val_loss"),
        "steps": config["steps"],
        "steps_logged": len(rows),
    }


def plot(out: pathlib.Path, runs: dict) -> None:
    """DIR/balance.png: the worst MoE layer's max/mean load per step, one panel per expert count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({name.split("-")[0] for name in runs})  # e16, e4, small: one panel each
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups):
        for name in runs:
            if name.startswith(group + "-"):
                rows = read_metrics(out / "runs" / name / "metrics.jsonl")
                ax.plot([r["step"] for r in rows], [worst_load(r) for r in rows], lw=1, label=name)
        ax.axhline(1.3, color="gray", lw=0.8, ls=":")
        steps = steps_of(next(r["arm"] for name, r in runs.items() if name.startswith(group + "-")))
        ax.axvline(3 * steps // 4, color="gray", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("max/mean load, worst layer")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "balance.png", dpi=110)
    plt.close(fig)


def load_floor(run_dir: pathlib.Path, step: int | None, fit_batches: int = 16, test_batches: int = 32,
               iterations: int = 40) -> dict:
    """See the module docstring (`--floor`)."""
    import jax.numpy as jnp
    from flax import nnx

    from jfp8.nn import router_biases
    from jfp8.train import data
    from jfp8.train.probes import load_model

    config, model = load_model(run_dir, step)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    layers = model.moe_layers()
    forward = nnx.jit(lambda m, tokens: m(tokens)[1].expert_loads)

    def loads(biases, seed, n):
        for moe, b in zip(layers, biases):
            moe.router_bias[...] = jnp.asarray(b, jnp.float32)
        batches = [data.train_batch(split.train, config.batch_size, config.seq_len, seed, s) for s in range(n)]
        return np.stack([np.asarray(forward(model, jnp.asarray(b))) for b in batches]).astype(np.float64)

    def max_over_mean(x):
        return x.max(-1) / x.mean(-1)

    trained = np.asarray(router_biases(model), np.float64)
    before = loads(trained, 99, test_batches)
    biases = trained
    for it in range(iterations):
        pooled = loads(biases, 7, fit_batches).sum(0)
        error = (pooled.mean(-1, keepdims=True) - pooled) / pooled.mean(-1, keepdims=True)
        biases = biases + 0.02 * 0.93**it * np.clip(error, -1, 1)
    after = loads(biases, 99, test_batches)
    n_assign = int(after[0, 0].sum())
    independent = np.random.default_rng(0).multinomial(n_assign, [1 / after.shape[-1]] * after.shape[-1], size=4000)
    names = json.loads((run_dir / "config.json").read_text())["moe_layer_names"]
    per_layer = lambda x: dict(zip(names, np.round(x, 4).tolist()))  # noqa: E731
    return {
        "run": str(run_dir), "step": step, "batch": [config.batch_size, config.seq_len],
        "trained_biases": {"per_batch": per_layer(max_over_mean(before).mean(0)),
                           "pooled": per_layer(max_over_mean(before.sum(0)))},
        "balanced_biases": {"per_batch": per_layer(max_over_mean(after).mean(0)),
                            "pooled": per_layer(max_over_mean(after.sum(0)))},
        "independent_tokens": round(float(max_over_mean(independent).mean()), 4),
    }


def gate_probe(run_dir: pathlib.Path, steps: list[int]) -> dict:
    """See the module docstring (`--gate-probe`)."""
    import jax.numpy as jnp

    import jfp8.nn.moe as moe_module
    from jfp8.nn import router_biases
    from jfp8.train.probes import load_model, val_batches

    names = json.loads((run_dir / "config.json").read_text())["moe_layer_names"]
    captured, router_scores = [], moe_module.router_scores

    def recording(x, gate):  # each MoE layer's gate input, logits and scores, in layer order
        scores = router_scores(x, gate)
        x64 = np.asarray(x, np.float64)
        captured.append((x64, x64 @ np.asarray(gate, np.float64), scores))
        return scores

    out = {"run": str(run_dir), "steps": {}}
    moe_module.router_scores = recording
    try:
        for step in steps:
            captured.clear()
            config, model = load_model(run_dir, step)
            cfg = config.model_config()
            _, aux = model(jnp.asarray(val_batches(config, 1)[0]))  # eager: every layer records once
            if len(captured) != len(names):
                raise RuntimeError(f"recorded {len(captured)} gates for the {len(names)} MoE layers {names}")
            layers = {}
            for name, (x, logits, scores), bias, model_loads in zip(
                names, captured, router_biases(model), aux.expert_loads
            ):
                loads = np.asarray(moe_module.expert_loads(moe_module.route(scores, bias, cfg)[0], cfg.n_routed))
                if not np.array_equal(loads, np.asarray(model_loads)):  # the recorded gate is the one that routed
                    raise RuntimeError(f"{name}: probe loads {loads.tolist()} != the model's {np.asarray(model_loads).tolist()}")
                mean_logit, bias = logits.mean(0), np.asarray(bias)
                layers[name] = {
                    "preference_spread": round(float(mean_logit.max() - mean_logit.min()), 4),
                    "logit_token_std": round(float(np.median(logits.std(0))), 4),
                    "score_token_std": round(float(np.median(np.asarray(scores, np.float64).std(0))), 4),
                    "bias_spread": round(float(bias.max() - bias.min()), 4),
                    "common_fraction": round(float((x.mean(0) ** 2).sum() / (x**2).sum(1).mean()), 4),
                    "load_max_over_mean": round(float(loads.max() / loads.mean()), 4),
                }
            out["steps"][str(step)] = layers
    finally:
        moe_module.router_scores = router_scores
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    tiny_arms = ",".join(arm for arm in ARMS if preset(arm) == "tiny")
    p.add_argument("--arms", default=tiny_arms, help=f"comma-separated, among {list(ARMS)} (default: the tiny ones)")
    p.add_argument("--precision", nargs="+", default=["bf16"], choices=("bf16", "fp8"))
    p.add_argument("--seed", type=int, default=0, help="runs of a seed other than 0 are named ...-s<seed>")
    p.add_argument("--summarize-only", action="store_true", help="re-read the runs under --out/runs")
    p.add_argument("--floor", metavar="RUN_DIR", help="measure the per-batch load floor of this run's checkpoint")
    p.add_argument("--floor-step", type=int, help="the checkpoint for --floor (default: the newest)")
    p.add_argument("--gate-probe", metavar="RUN_DIR", help="the gate's scores at some checkpoints of this run")
    p.add_argument("--probe-steps", type=int, nargs="+", help="the checkpoints for --gate-probe")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.gate_probe:
        if not args.probe_steps:
            p.error("--gate-probe needs --probe-steps (checkpoints kept in RUN_DIR/checkpoints)")
        probe = gate_probe(pathlib.Path(args.gate_probe), args.probe_steps)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gate_probe.json").write_text(json.dumps(probe, indent=1) + "\n")
        print(json.dumps(probe, indent=1))
        return
    if args.floor:
        floor = load_floor(pathlib.Path(args.floor), args.floor_step)
        out.mkdir(parents=True, exist_ok=True)
        (out / "floor.json").write_text(json.dumps(floor, indent=1) + "\n")
        print(json.dumps(floor, indent=1))
        return
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"runs": {}}
    arms = [arm for arm in args.arms.split(",") if arm]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose among {list(ARMS)}")
    for arm in arms:
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

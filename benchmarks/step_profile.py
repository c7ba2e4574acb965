"""Where a compiled training step spends its time, measured: a profiler trace of a few steps, each
kernel charged to the step model's category of the HLO instruction that launched it.

    from step_profile import profile_steps
    summary = profile_steps(compiled, state, batches, steps=3, log_dir=tmp)   # bench_step --profile 3

`jax.profiler.trace` records every kernel with the HLO instruction it ran for (`args.hlo_op`) and
its module (`args.hlo_module`). On a GPU those are CUPTI's kernel records on the device's
"Stream #..." lines (the derived "XLA Ops" / "XLA Modules" lines, which repeat them, are left
out); on the CPU they are XLA:CPU's thunks on the host's worker threads (the CPU rehearsal of the
same parsing). Each instruction is classified by `step_model.step_ops` over the executable's own
optimized HLO (`compiled.as_text()`), so the measured categories are the model's categories: the
model's prediction and this measurement line up row by row. Control flow (while, conditional,
call) is not charged: on the CPU its thunk spans its body's, which are charged themselves.

Per profiled step (durations summed over the steps, divided by their number):
  wall_ms          each step's wall time with its loss read back, median
  kernel_ms        the kernels' summed durations (CPU: thread time over both cores, may exceed wall)
  busy_ms          GPU only: the union of the kernel intervals (the device's busy time); wall -
                   busy is time the device waited (launch gaps, the host)
  categories       per category: ms, launches, and the model's bytes / FLOPs of those launches with
                   the rate they imply (GB/s or TFLOP/s)
  quantizers       per quantizer kind and input size: launches, µs per launch, GB/s (bytes read +
                   written, as the model counts them): the quantizers' speed inside the step
  unattributed     kernels whose instruction the HLO does not name (top 12 by time) and their ms
A profile that finds no kernel events says so (`error`) instead of raising: the timed steps stand.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import step_model  # noqa: E402

_CONTROL = ("while", "conditional", "call", "async-start", "async-done")
# Lines of a GPU trace derived from the kernels (each kernel again, or spans of them): not kernels.
_DERIVED = ("XLA Ops", "XLA Modules", "Steps", "TraceContext", "Framework", "Source code", "XLA TraceMe")


def instruction_ops(hlo_text: str) -> tuple[str, dict[str, step_model.Op], set[str]]:
    """The module's name, {instruction name: the model's Op} for every instruction that may launch a
    kernel (in any computation: while bodies and every branch), and its control-flow instructions."""
    module = step_model.parse_module(hlo_text)
    m = re.search(r"^HloModule ([\w.\-]+)", hlo_text, flags=re.M)
    name = m.group(1) if m else ""
    ops, control = {}, set()
    for body in module.computations.values():  # every branch and body; fusion bodies launch nothing
        for instr in body:
            if instr.opcode in _CONTROL:
                control.add(instr.name)
            elif (op := step_model.classify(instr, module)) is not None:
                ops[instr.name] = op
    return name, ops, control


def load_trace(log_dir: str | os.PathLike) -> dict:
    """The newest trace JSON (`*.trace.json.gz`, else a perfetto one) under `log_dir`."""
    files = sorted(glob.glob(os.path.join(str(log_dir), "**", "*trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *trace.json.gz under {log_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def kernel_events(trace: dict, module: str | None) -> tuple[list[dict], dict]:
    """The kernel events of `module` (None: of every module) and where they came from. GPU: the
    device processes' stream lines; no device process (CPU): the host's threads."""
    events = trace.get("traceEvents", [])
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n.upper()}

    def ours(e):
        a = e.get("args") or {}
        return e.get("ph") == "X" and "hlo_op" in a and (module is None or a.get("hlo_module", module) == module)

    def line(e):
        return threads.get((e["pid"], e.get("tid")), "")

    if devices:
        on_device = [e for e in events if e.get("pid") in devices and ours(e)]
        streams = [e for e in on_device if line(e).startswith("Stream")]
        kept = streams or [e for e in on_device if not line(e).startswith(_DERIVED)]
        source = "device stream lines" if streams else "device lines other than the derived ones"
    else:
        kept = [e for e in events if ours(e)]
        source = "host threads (no device process: XLA:CPU thunks)"
    return kept, {"source": source, "processes": sorted(set(procs.values())),
                  "lines": sorted({line(e) for e in kept})[:20], "on_device": bool(devices)}


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _rate(nbytes: float, flops: float, seconds: float) -> dict:
    if seconds <= 0:
        return {}
    return {"tflops": flops / seconds / 1e12} if flops else {"gbps": nbytes / seconds / 1e9} if nbytes else {}


def summarize(events: list[dict], ops: dict, control: set[str], steps: int) -> dict:
    """Per-step sums of `events` (durations in µs) by the model's category."""
    cats = collections.defaultdict(lambda: {"ms": 0.0, "launches": 0.0, "bytes": 0.0, "flops": 0.0})
    quant = collections.defaultdict(lambda: {"launches": 0.0, "us": 0.0, "bytes": 0.0})
    stray = collections.Counter()
    intervals = []
    for e in events:
        name, dur = e["args"]["hlo_op"], float(e.get("dur", 0.0))
        if name in control:
            continue
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
        op = ops.get(name)
        if op is None:
            stray[name] += dur
            continue
        c = cats[op.category]
        c["ms"] += dur / 1e3
        c["launches"] += 1
        c["bytes"] += op.bytes
        c["flops"] += op.flops
        if op.category.startswith("quantize"):
            q = quant[(op.category, op.elements)]
            q["launches"] += 1
            q["us"] += dur
            q["bytes"] += op.bytes
    per = 1.0 / steps
    categories = {k: {"ms": v["ms"] * per, "launches": v["launches"] * per, "bytes": v["bytes"] * per,
                      "flops": v["flops"] * per, **_rate(v["bytes"], v["flops"], v["ms"] / 1e3)}
                  for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms"])}
    quantizers = [{"kind": k[0], "input_elements": k[1], "launches": v["launches"] * per,
                   "us_per_launch": v["us"] / v["launches"], "gbps": v["bytes"] / (v["us"] / 1e6) / 1e9}
                  for k, v in sorted(quant.items(), key=lambda kv: -kv[1]["us"]) if v["us"] > 0]
    kernel_ms = sum(e[1] - e[0] for e in intervals) / 1e3 * per
    return {"kernel_ms": kernel_ms, "busy_ms": _union_us(intervals) / 1e3 * per, "categories": categories,
            "quantizers": quantizers, "unattributed_ms": sum(stray.values()) / 1e3 * per,
            "unattributed": [{"hlo_op": n, "ms": d / 1e3 * per} for n, d in stray.most_common(12)]}


def profile_steps(compiled, state: tuple, batches: list, steps: int, log_dir: str | os.PathLike) -> tuple[dict, tuple]:
    """Run `steps` more training steps of `compiled` (each synchronised) under the profiler and
    summarize them. Returns (summary, the state after them)."""
    import jax

    module, ops, control = instruction_ops(compiled.as_text())
    walls = []
    with jax.profiler.trace(str(log_dir)):
        for i in range(steps):
            t = time.perf_counter()
            *state, metrics = compiled(*state, batches[i % len(batches)])
            float(metrics["loss"])  # synchronises
            walls.append(time.perf_counter() - t)
    state = tuple(state)
    try:
        events, where = kernel_events(load_trace(log_dir), module)
    except (OSError, ValueError) as e:
        return {"error": f"no trace read: {type(e).__name__}: {e}", "steps": steps}, state
    out = {"steps": steps, "module": module, "wall_ms": statistics.median(walls) * 1e3,
           "wall_ms_each": [w * 1e3 for w in walls], **where}
    if not events:
        out["error"] = f"the trace holds no kernel events of module {module!r} ({where['source']})"
        return out, state
    out.update(summarize(events, ops, control, steps))
    if not where["on_device"]:
        del out["busy_ms"]  # threads overlap on the CPU: their union is not a device's busy time
    return out, state


def kernel_time(fn, sync, calls: int, log_dir: str | os.PathLike) -> dict:
    """Device time of one call of `fn()` (a jitted function, operands bound): `calls` calls, each
    synchronised, under the profiler; per call the kernels' summed durations (`kernel_ms`), their
    union (`busy_ms`, GPU only) and the kernels it launches (an op's wrapper adds XLA kernels around
    a Mosaic one). Host dispatch, which the wall clock of a short call can be made of, is not in
    it. A trace without kernel events gives {"error": ...}."""
    import jax

    with jax.profiler.trace(str(log_dir)):
        for _ in range(calls):
            sync(fn())
    try:
        events, where = kernel_events(load_trace(log_dir), None)
    except (OSError, ValueError) as e:
        return {"error": f"no trace read: {type(e).__name__}: {e}"}
    if not events:
        return {"error": f"the trace holds no kernel events ({where['source']})"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
             if not e["args"]["hlo_op"].startswith(_CONTROL)]
    out = {"calls": calls, "kernel_ms": sum(b - a for a, b in spans) / 1e3 / calls,
           "kernels_per_call": len(spans) / calls, "source": where["source"]}
    if where["on_device"]:
        out["busy_ms"] = _union_us(spans) / 1e3 / calls
    return out


def profile_lines(p: dict) -> list[str]:
    """A profile summary as printed lines."""
    if "error" in p:
        return [f"    profile: {p['error']}"]
    busy = f", device busy {p['busy_ms']:.2f} ms" if "busy_ms" in p else ""
    out = [f"    profile ({p['steps']} steps, {p['source']}): wall {p['wall_ms']:.2f} ms, kernels "
           f"{p['kernel_ms']:.2f} ms{busy}, unattributed {p['unattributed_ms']:.2f} ms"]
    for c, r in p["categories"].items():
        rate = (f", {r['tflops']:.3g} TFLOP/s" if "tflops" in r else f", {r['gbps']:.3g} GB/s" if "gbps" in r else "")
        out.append(f"      {c:28s} {r['ms']:9.3f} ms  {r['launches']:6.0f} launches{rate}")
    return out

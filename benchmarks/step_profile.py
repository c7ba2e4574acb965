"""Where a compiled training step spends its time, measured: a profiler trace of a few steps, each
kernel charged to the step model's category of the HLO instruction that launched it.

    from step_profile import profile_steps
    summary = profile_steps(compiled, state, batches, steps=3, log_dir=tmp)   # bench_step --profile 3

`jax.profiler.trace` records every kernel with the HLO instruction it ran for (`args.hlo_op`) and
its module (`args.hlo_module`). On a GPU those are CUPTI's kernel records on the device's
"Stream #..." lines (the derived "XLA Ops" / "XLA Modules" lines, which repeat them, are left
out); on the CPU they are XLA:CPU's thunks on the host's worker threads (the CPU rehearsal of the
same parsing). Each instruction is classified by `step_model.classify` over the executable's own
optimized HLO (`compiled.as_text()`), and its runs per step counted by `step_model.step_ops`, so the
measured categories are the model's categories: the model's prediction and this measurement line
up row by row. Control flow (while, conditional,
call) is not charged: on the CPU its thunk spans its body's, which are charged themselves.

Per profiled step (durations summed over the steps, divided by their number):
  wall_ms          each step's wall time with its loss read back, median
  kernel_ms        the kernels' summed durations (CPU: thread time over both cores, may exceed wall)
  busy_ms          GPU only: the union of the kernel intervals (the device's busy time). Compare it
                   with the timed step (`step_ms`), not with the profiled wall: under a profiler XLA
                   runs its command buffers (CUDA graphs) thunk by thunk and CUPTI adds its own
                   cost, so the profiled steps' wall time and gaps overstate the timed steps'
  categories       per category: ms, kernels (events), runs (the instructions' executions: one may
                   launch several kernels, a sort or a memset before a reduction), the model's bytes /
                   FLOPs of those runs and the rate they imply (GB/s or TFLOP/s)
  quantizers       per quantizer kind, input size and bytes: runs, µs per run, GB/s (bytes read +
                   written, as the model counts them): the quantizers' speed inside the step
  unattributed     kernels whose instruction the HLO does not name (top 12 by time) and their ms
The category ms are kernel time only; the model's prediction adds a launch cost per kernel.
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


def instruction_ops(hlo_text: str) -> tuple[str, dict[str, step_model.Op], set[str], dict[str, float]]:
    """The module's name, {instruction name: the model's Op} for every instruction that may launch a
    kernel (in any computation: while bodies and every branch), its control-flow instructions, and
    {instruction name: times it runs per step} where the model knows (while bodies by their trip
    counts; of a conditional, the branch the model prices)."""
    hlo_text = step_model.strip_payloads(hlo_text)  # a Mosaic kernel's serialized module is megabytes
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
    runs = collections.Counter()
    for op in step_model.step_ops(module):
        runs[op.name] += op.count
    return name, ops, control, dict(runs)


def load_trace(log_dir: str | os.PathLike, since: float | None = None) -> dict:
    """The newest trace JSON (`*.trace.json.gz`, else a perfetto one) under `log_dir`, written at or
    after `since` (a `time.time()`) if given: a reused directory's older trace is never read."""
    files = sorted(glob.glob(os.path.join(str(log_dir), "**", "*trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if since is not None:
        files = [f for f in files if os.path.getmtime(f) >= since - 1.0]
    if not files:
        raise FileNotFoundError(f"no *trace.json.gz under {log_dir}" + (" from this run" if since else ""))
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def kernel_events(trace: dict, module: str | None, device: bool | None = None) -> tuple[list[dict], dict]:
    """The kernel events of `module` (None: of every module) and where they came from. On a device
    (`device` True, or None and the trace has a device process): the device processes' stream
    lines; on the CPU: the host's threads (XLA:CPU's thunks), only the innermost of nested ones."""
    events = trace.get("traceEvents", [])
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n.upper()}
    on_device = bool(devices) if device is None else device

    def ours(e):
        a = e.get("args") or {}
        return e.get("ph") == "X" and "hlo_op" in a and (module is None or a.get("hlo_module", module) == module)

    def line(e):
        return threads.get((e["pid"], e.get("tid")), "")

    if on_device:
        on_dev = [e for e in events if e.get("pid") in devices and ours(e)]
        streams = [e for e in on_dev if line(e).startswith("Stream")]
        kept = streams or [e for e in on_dev if not line(e).startswith(_DERIVED)]
        source = ("device stream lines" if streams else "device lines other than the derived ones" if devices
                  else "no device process in the trace (did the profiler see the GPU?)")
    else:
        kept = innermost([e for e in events if ours(e)])
        source = "host threads (no device process: XLA:CPU thunks)"
    return kept, {"source": source, "processes": sorted(set(procs.values())),
                  "lines": sorted({line(e) for e in kept})[:20], "on_device": on_device}


def innermost(events: list[dict]) -> list[dict]:
    """`events` without those that enclose another on the same thread (a control-flow thunk of
    XLA:CPU spans its body's thunks, which are charged themselves)."""
    outer = set()
    by_line = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_line[(e.get("pid"), e.get("tid"))].append(i)
    for idx in by_line.values():
        idx.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i].get("dur", 0.0))))
        stack: list[int] = []  # open events, each enclosing the next
        for i in idx:
            start = float(events[i]["ts"])
            end = start + float(events[i].get("dur", 0.0))
            while stack and (top_end := float(events[stack[-1]]["ts"]) + float(events[stack[-1]].get("dur", 0.0))) \
                    < end or stack and top_end <= start:
                stack.pop()  # ends before this one does, or as it starts: not its parent
            if stack:
                outer.add(stack[-1])
            stack.append(i)
    return [e for i, e in enumerate(events) if i not in outer]


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


def summarize(events: list[dict], ops: dict, control: set[str], steps: int, runs: dict | None = None) -> dict:
    """Per-step sums of `events` (durations in µs) by the model's category. The bytes and FLOPs
    behind each rate are the model's per run of an instruction, times its runs (`runs` per step,
    else one per event): an instruction may launch several kernels (a sort, a memset before a
    reduction) and still moves its bytes once."""
    runs = runs or {}
    per_instr = collections.defaultdict(lambda: [0, 0.0])  # name -> [events, µs]
    stray = collections.Counter()
    intervals = []
    for e in events:
        name, dur = e["args"]["hlo_op"], float(e.get("dur", 0.0))
        if name in control:
            continue
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
        if name in ops:
            per_instr[name][0] += 1
            per_instr[name][1] += dur
        else:
            stray[name] += dur
    cats = collections.defaultdict(lambda: {"ms": 0.0, "kernels": 0.0, "runs": 0.0, "bytes": 0.0, "flops": 0.0})
    quant = collections.defaultdict(lambda: {"runs": 0.0, "us": 0.0, "bytes": 0.0})
    for name, (n, us) in per_instr.items():
        op = ops[name]
        r = runs[name] * steps if name in runs else n
        c = cats[op.category]
        c["ms"] += us / 1e3
        c["kernels"] += n
        c["runs"] += r
        c["bytes"] += op.bytes * r
        c["flops"] += op.flops * r
        if op.category.startswith("quantize"):
            q = quant[(op.category, op.elements, op.bytes)]
            q["runs"] += r
            q["us"] += us
            q["bytes"] += op.bytes * r
    per = 1.0 / steps
    categories = {k: {"ms": v["ms"] * per, "kernels": v["kernels"] * per, "runs": v["runs"] * per,
                      "bytes": v["bytes"] * per, "flops": v["flops"] * per,
                      **_rate(v["bytes"], v["flops"], v["ms"] / 1e3)}
                  for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms"])}
    quantizers = [{"kind": k[0], "input_elements": k[1], "bytes_per_run": k[2], "runs": v["runs"] * per,
                   "us_per_run": v["us"] / v["runs"], "gbps": v["bytes"] / (v["us"] / 1e6) / 1e9}
                  for k, v in sorted(quant.items(), key=lambda kv: -kv[1]["us"]) if v["us"] > 0 and v["runs"]]
    kernel_ms = sum(e[1] - e[0] for e in intervals) / 1e3 * per
    return {"kernel_ms": kernel_ms, "busy_ms": _union_us(intervals) / 1e3 * per, "categories": categories,
            "quantizers": quantizers, "unattributed_ms": sum(stray.values()) / 1e3 * per,
            "unattributed": [{"hlo_op": n, "ms": d / 1e3 * per} for n, d in stray.most_common(12)]}


def profile_steps(compiled, state: tuple, batches: list, steps: int, log_dir: str | os.PathLike) -> tuple[dict, tuple]:
    """Run `steps` more training steps of `compiled` (each synchronised) under the profiler and
    summarize them. Returns (summary, the state after them)."""
    import jax

    module, ops, control, runs = instruction_ops(compiled.as_text())
    walls = []
    started = time.time()
    with jax.profiler.trace(str(log_dir)):
        for i in range(steps):
            t = time.perf_counter()
            *state, metrics = compiled(*state, batches[i % len(batches)])
            float(metrics["loss"])  # synchronises
            walls.append(time.perf_counter() - t)
    state = tuple(state)
    try:
        on_gpu = jax.devices()[0].platform != "cpu"
        events, where = kernel_events(load_trace(log_dir, since=started), module, device=on_gpu)
    except (OSError, ValueError) as e:
        return {"error": f"no trace read: {type(e).__name__}: {e}", "steps": steps}, state
    out = {"steps": steps, "module": module, "wall_ms": statistics.median(walls) * 1e3,
           "wall_ms_each": [w * 1e3 for w in walls], **where}
    if not events:
        out["error"] = f"the trace holds no kernel events of module {module!r} ({where['source']})"
        return out, state
    out.update(summarize(events, ops, control, steps, runs))
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

    on_gpu = jax.devices()[0].platform != "cpu"
    started = time.time()
    with jax.profiler.trace(str(log_dir)):
        for _ in range(calls):
            sync(fn())
    try:
        events, where = kernel_events(load_trace(log_dir, since=started), None, device=on_gpu)
    except (OSError, ValueError) as e:
        return {"error": f"no trace read: {type(e).__name__}: {e}"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events]
    kernel_ms = sum(b - a for a, b in spans) / 1e3 / calls
    if not kernel_ms > 0:
        return {"error": f"the trace holds no kernel time ({where['source']})"}
    out = {"calls": calls, "kernel_ms": kernel_ms, "kernels_per_call": len(spans) / calls, "source": where["source"]}
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
        out.append(f"      {c:28s} {r['ms']:9.3f} ms  {r['kernels']:6.0f} kernels{rate}")
    return out

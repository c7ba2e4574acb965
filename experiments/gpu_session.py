"""Everything a GPU session does for issue #4, in one command, inside about 9 minutes.

    bash scripts/gpu_session.sh                       # on the GPU machine (the device `run` tool)
    bash scripts/gpu_session.sh --gemm-config tile_m=128,tile_n=128 --gemm-config tile_m=64
    python experiments/gpu_session.py --dry-run       # anywhere: the plan, nothing run
    python experiments/gpu_session.py --quick         # CPU: tiny benchmarks, GPU stages skipped

Stages, in order, each a subprocess with its own timeout (a failure or timeout of one does not
stop the others; all share `--budget-s`, and a stage that would start with too little left is
skipped with that reason):
  env            device, driver, jax / jaxlib / torch / triton versions, CUDA tools found
  pytest_gpu     `pytest -m gpu tests`: the kernel tests that need a Hopper GPU
  bench_gemm     experiments/bench_gemm.py at the issue's dense shapes (8192^3 first, then
                 DeepSeek-V3 M=4096 with K >= 7168), plus any --gemm-config rows
  bench_grouped  experiments/bench_grouped.py at the MoE shapes (8 experts x 4096 rows first),
                 plus any --grouped-config rows
  bench_quantize experiments/bench_quantize.py against the measured copy bandwidth, plus any
                 --quantize-config rows (e.g. swizzle=false, the unswizzled kernels)
  bench_linear   experiments/bench_linear.py: forward + backward of one fp8_linear layer (every
                 quantization included) against the bf16 x @ w, at DeepSeek-V3 shapes
  sass           each jfp8 kernel run once with MOSAIC_GPU_DUMP_TO set (jaxlib/mosaic/gpu/dump.cc:
                 PTX, ptxas log and nvdisasm SASS per Mosaic module); QGMMA / HGMMA / HMMA counted
                 per module; PTX is assembled with ptxas + cuobjdump when no SASS was written
  memcheck       compute-sanitizer --tool memcheck on the same run-each-kernel-once script
  racecheck      compute-sanitizer --tool racecheck, likewise
  tune_gemm      (only with --stages tune_gemm, a device call of its own) experiments/tune_gemm.py:
                 candidate GemmConfigs per shape (small M first), the winners written to the
                 table gemm-<device>.json under --out, to commit as pallas_kernels/tuned/
  tune_grouped   (only with --stages tune_grouped, likewise) tune_gemm.py --grouped: candidate
                 GroupedGemmConfigs per MoE shape, table grouped-<device>.json
GPU-only stages are skipped, with the reason, where there is no Hopper GPU or no tool.

Results go to `--out` (default $OUT when set, else benchmarks/results), at most 8 files, as
the device tool returns at most 8: the four benchmark records, gpu_session-<device>-<date>.json
(stage statuses, reasons, SASS counts, sanitizer summaries, rewritten after every stage),
gpu_session-<device>-<date>.log (every stage's output), sass-<device>-<date>.tar.gz, and with
a tuning stage its record and table (run each as a call of its own: then 4 files).
The short table at the end is the summary to read first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
# In the order they run: the kernels' correctness and the issue's benchmarks first; the layer
# benchmark, an extra, after the SASS and the sanitizers.
STAGES = ("env", "pytest_gpu", "bench_gemm", "bench_grouped", "bench_quantize", "sass", "memcheck",
          "racecheck", "bench_linear", "tune_gemm", "tune_grouped")
# The tuning stages each take a whole device call of their own (11-14 configs per shape): only
# when asked for.
TUNING_STAGES = ("tune_gemm", "tune_grouped")
DEFAULT_STAGES = tuple(s for s in STAGES if s not in TUNING_STAGES)
# The issue's shapes, most important first (a budget cut drops the tail).
GEMM_SHAPES = ("8192x8192x8192", "4096x4096x7168", "4096x7168x16384", "4096x2112x7168",
               "4096x24576x1536", "4096x7168x2048", "64x7168x16384", "128x7168x2048")
GROUPED_SHAPES = ("8x4096x4096x7168", "4x8192x4096x7168", "8x4096x7168x2048")
QUANTIZE_SHAPES = ("8192x8192:bfloat16", "4096x7168:bfloat16", "7168x2048:float32")
LINEAR_SHAPES = ("4096x7168x2048", "4096x4096x7168", "4096x2112x7168")
# CPU (--quick): tiny problems, XLA paths only.
QUICK_ARGS = {
    "bench_gemm": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
    "bench_grouped": ["--shapes", "2x128x128x256", "--warmup", "1", "--repeats", "2"],
    "bench_quantize": ["--shapes", "256x256:bfloat16", "--warmup", "1", "--repeats", "2"],
    "bench_linear": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
}
TIMEOUTS = dict(env=45, pytest_gpu=120, bench_gemm=170, bench_grouped=110, bench_quantize=70,
                bench_linear=60, sass=60, memcheck=75, racecheck=75, tune_gemm=520, tune_grouped=520)
MIN_STAGE_SECONDS = 15
SASS_OPS = ("QGMMA", "HGMMA", "HMMA", "IMMA")
# Where CUDA tools may live besides PATH: the toolkit, and the copies Triton ships.
TOOL_DIRS = ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/nvidia/*/bin",
             "/usr/local/cuda-*/bin")


# ------------------------------------------------------------------------------ environment


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    dirs = [d for pattern in TOOL_DIRS for d in sorted(glob.glob(pattern))]
    try:  # Triton wheels carry ptxas, cuobjdump and nvdisasm
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            dirs.append(str(pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin"))
    except (ImportError, ValueError):
        pass
    for d in dirs:
        path = pathlib.Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str | None  # None: no NVIDIA GPU seen
    compute_cap: str | None
    why_not: str | None  # why GPU stages cannot run, or None

    @property
    def hopper(self) -> bool:
        return self.why_not is None


def detect_gpu() -> Gpu:
    """The GPU as nvidia-smi sees it, without initialising CUDA in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Gpu(None, None, "no NVIDIA GPU (nvidia-smi not found)")
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return Gpu(None, None, f"nvidia-smi failed: {e}")
    if not out:
        return Gpu(None, None, "nvidia-smi lists no GPU")
    name, _, cap = (p.strip() for p in out.splitlines()[0].partition(","))
    if not cap.startswith("9."):
        return Gpu(name, cap, f"{name} (compute capability {cap}) is not a Hopper GPU (9.x)")
    return Gpu(name, cap, None)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-") or "unknown"


# ------------------------------------------------------------------------------ stages


@dataclasses.dataclass
class Stage:
    name: str
    argv: list[str]
    timeout: float
    skip: str | None = None  # reason the stage is not run
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # filled in by `run_stage`
    status: str = "planned"
    seconds: float = 0.0
    rc: int | None = None
    summary: dict = dataclasses.field(default_factory=dict)
    output: str = ""


def _python() -> str:
    return sys.executable or "python3"


def _sanitizer_env() -> dict[str, str]:
    # Plain allocations sized per buffer (memcheck then sees real bounds), no autotuning launches,
    # no CUDA graphs: only the kernels of the script are launched.
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
            "XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer="}


def plan(args, gpu: Gpu, work: pathlib.Path) -> list[Stage]:
    py, me = _python(), str(pathlib.Path(__file__).resolve())
    out = str(args.out)
    quick = args.quick or not gpu.hopper
    no_gpu = None if gpu.hopper else gpu.why_not
    sanitizer = find_tool("compute-sanitizer")
    (work / "sass").mkdir(parents=True, exist_ok=True)  # MOSAIC_GPU_DUMP_TO does not create it
    stages = []

    def bench(name, script, shapes, extra=()):
        timeout = TIMEOUTS[name]
        argv = [py, str(REPO / "experiments" / script), "--out", out, "--max-seconds", "3"]
        argv += QUICK_ARGS[name] if quick else ["--shapes", *shapes]
        argv += list(extra)
        return Stage(name, argv, timeout)

    stages.append(Stage("env", [py, me, "--worker", "env"], TIMEOUTS["env"],
                        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
    stages.append(Stage("pytest_gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                       "--continue-on-collection-errors",
                                       f"--junitxml={work / 'pytest.xml'}", str(REPO / "tests")],
                        TIMEOUTS["pytest_gpu"], skip=no_gpu))
    gemm_extra = [a for c in args.gemm_config for a in ("--config", c)]
    stages.append(bench("bench_gemm", "bench_gemm.py", args.gemm_shapes, gemm_extra))
    grouped_extra = [a for c in args.grouped_config for a in ("--config", c)]
    stages.append(bench("bench_grouped", "bench_grouped.py", args.grouped_shapes, grouped_extra))
    quantize_extra = [a for c in args.quantize_config for a in ("--config", c)]
    stages.append(bench("bench_quantize", "bench_quantize.py", args.quantize_shapes, quantize_extra))
    stages.append(Stage("sass", [py, me, "--worker", "kernels"], TIMEOUTS["sass"], skip=no_gpu,
                        env={"MOSAIC_GPU_DUMP_TO": str(work / "sass"),
                             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
    for tool in ("memcheck", "racecheck"):
        skip = no_gpu or (None if sanitizer else "compute-sanitizer not found on PATH or in the CUDA dirs")
        stages.append(Stage(tool, [sanitizer or "compute-sanitizer", "--tool", tool, "--print-limit", "100",
                                   py, me, "--worker", "kernels"], TIMEOUTS[tool], skip=skip,
                            env=_sanitizer_env()))
    stages.append(bench("bench_linear", "bench_linear.py", args.linear_shapes))
    for name, extra in (("tune_gemm", []), ("tune_grouped", ["--grouped"])):
        stages.append(Stage(name, [py, str(REPO / "experiments" / "tune_gemm.py"), *extra, "--out",
                                   out, "--max-seconds", "2", "--repeats", "7"],
                            TIMEOUTS[name], skip=no_gpu))
    chosen = set(args.stages)
    for s in stages:
        if s.name not in chosen:
            s.skip = "not selected (--stages)"
    return stages


def run_stage(stage: Stage, env: dict[str, str]) -> None:
    """Runs the stage's command in its own process group; kills the group at the timeout."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        try:
            proc = subprocess.Popen(stage.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**env, **stage.env}, start_new_session=True)
        except OSError as e:
            stage.status, stage.output = "failed", f"could not start: {e}"
            return
        try:
            stage.rc = proc.wait(timeout=stage.timeout)
            stage.status = "ok" if stage.rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            stage.status = "timeout"
        log.seek(0)
        stage.output = log.read()
    stage.seconds = time.perf_counter() - t0


# ------------------------------------------------------------------------------ stage summaries


def summarize_pytest(work: pathlib.Path, output: str) -> dict:
    xml = work / "pytest.xml"
    if xml.exists():
        import xml.etree.ElementTree as ET

        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    tail = output.strip().splitlines()[-1:] or [""]
    return {"last_line": tail[0]}


def _timed_script(stage: str) -> bool:
    """The stages that run a benchmark-style script (shapes, --budget-s, one JSON record)."""
    return stage.startswith("bench_") or stage in TUNING_STAGES


def summarize_bench(out: pathlib.Path, name: str, since: float) -> dict:
    paths = [p for p in out.glob(f"{name}-*.json") if p.stat().st_mtime >= since - 1]
    if not paths:
        return {"record": None}
    path = max(paths, key=lambda p: p.stat().st_mtime)
    record = json.loads(path.read_text())
    return {"record": path.name, "rows": len(record.get("rows", [])),
            "failed": len(record.get("failed", [])), "skipped": len(record.get("skipped", []))}


def count_sass(text: str) -> dict[str, int]:
    """Occurrences of each matrix instruction of `SASS_OPS` in disassembly text (as opcodes)."""
    return {op: len(re.findall(rf"\b{op}(?:\.[A-Z0-9_]+)*\b", text)) for op in SASS_OPS}


def _ptx_to_sass(ptx: pathlib.Path) -> str | None:
    ptxas, cuobjdump = find_tool("ptxas"), find_tool("cuobjdump")
    if not (ptxas and cuobjdump):
        return None
    cubin = ptx.with_suffix(".cubin")
    try:
        subprocess.run([ptxas, "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True,
                       capture_output=True, timeout=120)
        out = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    ptx.with_suffix(".cuobjdump.sass").write_text(out)
    return out


def summarize_sass(dump: pathlib.Path, tarball: pathlib.Path) -> dict:
    """Matrix-instruction counts per dumped Mosaic module, and a tarball of the dumps."""
    modules = {}
    sass_files = sorted(p for p in dump.glob("*.sass")) if dump.exists() else []
    source = "nvdisasm (MOSAIC_GPU_DUMP_TO)"
    if not sass_files and dump.exists():
        source = "ptxas -arch=sm_90a + cuobjdump --dump-sass on the dumped PTX"
        for ptx in sorted(dump.glob("*.ptx")):
            if _ptx_to_sass(ptx) is not None:
                sass_files.append(ptx.with_suffix(".cuobjdump.sass"))
    for path in sass_files:
        modules[path.name.split(".")[0]] = count_sass(path.read_text(errors="replace"))
    for ptx in sorted(dump.glob("*.ptx")) if dump.exists() else []:
        text = ptx.read_text(errors="replace")
        entry = modules.setdefault(ptx.name.split(".")[0], {})
        entry["ptx_wgmma_e4m3"] = len(re.findall(r"wgmma\.mma_async[^\n;]*e4m3", text))
        entry["ptx_wgmma"] = len(re.findall(r"wgmma\.mma_async", text))
    if dump.exists() and any(dump.iterdir()):
        keep = [p for p in dump.iterdir() if p.suffix in (".sass", ".ptx", ".ptxas", ".sass_ctrl")]
        big = sum(p.stat().st_size for p in dump.iterdir()) > 64 << 20
        with tarfile.open(tarball, "w:gz") as tar:
            for p in sorted(keep if big else dump.iterdir()):
                tar.add(p, arcname=f"sass/{p.name}")
    totals = {op: sum(m.get(op, 0) for m in modules.values()) for op in SASS_OPS}
    return {"source": source if sass_files else "no SASS produced", "modules": modules,
            "totals": totals, "tarball": tarball.name if tarball.exists() else None}


def kernel_lines(output: str) -> list[str]:
    """The run-each-kernel-once script's verdicts ('KERNEL <name>: ok (<error>)')."""
    return [line for line in output.splitlines() if line.startswith("KERNEL")]


def summarize_sanitizer(output: str) -> dict:
    summary = {"kernels": kernel_lines(output)}
    for key, pattern in (("errors", r"ERROR SUMMARY:\s*(\d+)"),
                         ("hazards", r"RACECHECK SUMMARY:\s*(\d+)")):
        found = re.findall(pattern, output)
        if found:
            summary[key] = int(found[-1])
    summary["kernels_checked"] = "KERNELS OK" in output
    return summary


def summarize_env(output: str) -> dict:
    for line in output.splitlines():
        if line.startswith("GPU_SESSION_ENV "):
            return json.loads(line[len("GPU_SESSION_ENV "):])
    return {}


# ------------------------------------------------------------------------------ the table


def _grouped_label(groups: int, rows: int, n: int, k: int) -> str:
    """GxRxNxK (R rows per group) for a grouped problem recorded with all groups' rows."""
    return f"{groups}x{rows // groups}x{n}x{k}"


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def stage_line(s: Stage) -> str:
    status = s.status
    note = s.skip if s.status == "skipped" else ""
    sm = s.summary
    if s.name == "env" and sm:
        note = f"{sm.get('device')} | jax {sm.get('jax')} | torch {sm.get('torch')}"
    elif s.name == "pytest_gpu" and "tests" in sm:
        note = f"{sm['tests']} tests, {sm['failures']} failures, {sm['errors']} errors, {sm['skipped']} skipped"
    elif _timed_script(s.name) and sm.get("record"):
        note = f"{sm['rows']} rows, {sm['failed']} failed, {sm['skipped']} skipped"
    elif s.name == "sass" and "totals" in sm:
        note = " ".join(f"{k} {v}" for k, v in sm["totals"].items()) + f" in {len(sm['modules'])} modules"
    elif s.name in ("memcheck", "racecheck") and s.status != "skipped":
        note = f"errors {sm.get('errors', '?')}" + (f", hazards {sm['hazards']}" if "hazards" in sm else "")
    return f"{s.name:15s} {status:8s} {s.seconds:7.1f}  {note}"


def gemm_table(record: dict) -> list[str]:
    rows = record.get("rows", [])
    base = {"xla-bf16": "bf16", "xla-fp8-per-tensor": "fp8/t", "torch-fp8-blockwise": "torch-bw"}
    lines = [f"dense GEMM, TFLOP/s      {'bf16':>7} {'fp8/t':>7} {'torch-bw':>8} | "
             f"{'jfp8 impl':28s} {'TFLOP/s':>7} {'x bf16':>6} {'x t-bw':>6} {'%fp8pk':>6}"]
    shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows))
    for shape in shapes:
        at = {r["impl"]: r for r in rows if (r["m"], r["n"], r["k"]) == shape}
        b = {v: at.get(k, {}).get("tflops") for k, v in base.items()}
        left = f"{'x'.join(map(str, shape)):24s} {_fmt(b['bf16'], '.4g'):>7} {_fmt(b['fp8/t'], '.4g'):>7} {_fmt(b['torch-bw'], '.4g'):>8}"
        mine = [r for name, r in at.items() if name.startswith("jfp8")]
        for i, r in enumerate(mine or [None]):
            if r is None:
                lines.append(f"{left} | (no jfp8 row)")
                continue
            ratios = r.get("ratio_vs", {})
            lines.append(f"{left if i == 0 else ' ' * len(left)} | {r['impl']:28s} {_fmt(r['tflops'], '.4g'):>7} "
                         f"{_fmt(r.get('ratio_vs_bf16'), '.2f'):>6} {_fmt(ratios.get('torch-fp8-blockwise'), '.2f'):>6} "
                         f"{_fmt(r.get('frac_fp8_peak') and 100 * r['frac_fp8_peak']):>6}")
    return lines


def grouped_table(record: dict) -> list[str]:
    rows = record.get("rows", [])
    lines = [f"grouped GEMM, TFLOP/s    {'einsum':>7} {'ragged':>7} {'mgpu':>7} | {'jfp8':>7} "
             f"{'x einsum':>8} {'x ragged':>8} {'x mgpu':>6} {'%fp8pk':>6}"]
    for key in dict.fromkeys((r["groups"], r["m"], r["n"], r["k"]) for r in rows):
        at = {r["impl"]: r for r in rows if (r["groups"], r["m"], r["n"], r["k"]) == key}
        g, m, n, k = key
        t = lambda name: at.get(name, {}).get("tflops")  # noqa: E731
        for name, r in at.items():
            if not name.startswith("jfp8"):
                continue
            rv = r.get("ratio_vs", {})
            lines.append(
                f"{_grouped_label(g, m, n, k):24s} {_fmt(t('xla-bf16-einsum'), '.4g'):>7} {_fmt(t('xla-ragged-dot-bf16'), '.4g'):>7} "
                f"{_fmt(t('mgpu-ragged-dot-bf16'), '.4g'):>7} | {_fmt(r['tflops'], '.4g'):>7} "
                f"{_fmt(rv.get('xla-bf16-einsum'), '.2f'):>8} {_fmt(rv.get('xla-ragged-dot-bf16'), '.2f'):>8} "
                f"{_fmt(rv.get('mgpu-ragged-dot-bf16'), '.2f'):>6} {_fmt(r.get('frac_fp8_peak') and 100 * r['frac_fp8_peak']):>6}")
    return lines


def linear_table(record: dict) -> list[str]:
    """fp8_linear forward + backward against the bf16 layer, per shape."""
    rows = record.get("rows", [])
    lines = [f"linear fwd+bwd, ms       {'bf16':>8} | {'fp8 impl':14s} {'ms':>8} {'x bf16':>6} "
             f"{'err/f32':>8}"]
    for key in dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows):
        at = {r["impl"]: r for r in rows if (r["m"], r["n"], r["k"]) == key}
        base = at.get("bf16", {}).get("ms")
        for name, r in at.items():
            if name == "bf16":
                continue
            lines.append(f"{'x'.join(map(str, key)):24s} {_fmt(base, '.3f'):>8} | {name:14s} "
                         f"{_fmt(r['ms'], '.3f'):>8} {_fmt(r.get('ratio_vs_bf16'), '.2f'):>6} "
                         f"{_fmt(r.get('err_vs_f32'), '.1e'):>8}")
    return lines


def quantize_table(record: dict) -> list[str]:
    lines = [f"quantize, GB/s (copy {_fmt(record.get('copy_gbps'), '.4g')} GB/s)   {'GB/s':>7} {'of copy':>7}"]
    for r in record.get("rows", []):
        if r["kernel"] == "copy":
            continue
        frac = r.get("frac_of_copy")
        config = r["impl"][r["impl"].index("["):] if "[" in r["impl"] else ""
        lines.append(f"{r['kernel'] + config:24s} {'%dx%d:%s' % (r['m'], r['k'], r['dtype']):25s} {_fmt(r['gbps'], '.4g'):>7} "
                     f"{_fmt(frac and 100 * frac, '.1f'):>6}%")
    return lines


def tune_table(record: dict) -> list[str]:
    """Per problem: the fastest config tune_gemm measured (its record's `entries`), and its
    speed-up over the default config and over the rule's pick."""
    kind = "grouped" if record.get("kind") == "grouped" else "GEMM"
    lines = [f"{kind} tuning ({record.get('out_dtype')} out)  {'best config':>40s} {'TFLOP/s':>7} "
             f"{'x dflt':>6} {'x rule':>6}"]
    for e in record.get("entries", []):
        problem = (_grouped_label(e["groups"], e["m"], e["n"], e["kp"]) if "groups" in e
                   else f"{e['m']}x{e['n']}x{e['kp']}")
        lines.append(f"{problem:24s} {e['impl']:>40s} {_fmt(e['tflops'], '.4g'):>7} "
                     f"{_fmt(e['speedup_vs_default'], '.2f'):>6} {_fmt(e['speedup_vs_rule'], '.2f'):>6}")
    return lines


# Issue #4's speed targets: (benchmark, what, baseline impl or None, bound). Dense: 8192^3 and
# DeepSeek-V3's M=4096 shapes with K >= 7168; grouped: every MoE shape; quantizers: every
# kernel's default row against the copy bandwidth.
DENSE_TARGET_SHAPES = ((8192, 8192, 8192), (4096, 2112, 7168), (4096, 7168, 16384),
                       (4096, 4096, 7168))
TARGETS = (
    ("bench_gemm", "x XLA bf16", "xla-bf16", 1.6),
    ("bench_gemm", "x torch blockwise FP8", "torch-fp8-blockwise", 1.0),
    ("bench_grouped", "x bf16 einsum", "xla-bf16-einsum", 1.4),
    ("bench_grouped", "x bf16 ragged_dot_mgpu", "mgpu-ragged-dot-bf16", 1.4),
    ("bench_quantize", "of copy bandwidth", None, 0.7),
)


def target_verdicts(records: dict[str, dict]) -> list[dict]:
    """Each of issue #4's targets at each problem, from the benchmark records (name -> record):
    the measured value, the bound, and "pass", "FAIL" or "not measured" (no jfp8 row on the
    Mosaic kernels, or no baseline row)."""
    verdicts = []
    for bench, what, baseline, bound in TARGETS:
        rows = records.get(bench, {}).get("rows", [])
        if bench == "bench_quantize":
            mine = [r for r in rows if r["impl"].startswith("jfp8-mosaic-") and "[" not in r["impl"]]
            wanted = [(f"{r['kernel']} {r['m']}x{r['k']}:{r['dtype']}", r.get("frac_of_copy"))
                      for r in mine]
        else:
            if bench == "bench_gemm":
                keys = DENSE_TARGET_SHAPES
                key_of = lambda r: (r["m"], r["n"], r["k"])  # noqa: E731
            else:
                keys = list(dict.fromkeys((r["groups"], r["m"], r["n"], r["k"]) for r in rows))
                key_of = lambda r: (r["groups"], r["m"], r["n"], r["k"])  # noqa: E731
            mine = {key_of(r): r for r in rows if r["impl"] == "jfp8-mosaic"}
            wanted = []
            for key in keys:
                label = "x".join(map(str, key)) if bench == "bench_gemm" else _grouped_label(*key)
                wanted.append((label, mine.get(key, {}).get("ratio_vs", {}).get(baseline)))
        if not wanted:
            wanted = [("(no jfp8-mosaic row)", None)]
        for problem, value in wanted:
            verdict = "not measured" if value is None else ("pass" if value >= bound else "FAIL")
            verdicts.append(dict(benchmark=bench, problem=problem, target=what, bound=bound,
                                 value=value, verdict=verdict))
    return verdicts


def targets_table(verdicts: list[dict]) -> list[str]:
    lines = [f"issue #4 targets          {'problem':28s} {'target':24s} {'value':>6} {'bound':>5}"]
    for v in verdicts:
        lines.append(f"{v['benchmark']:25s} {v['problem']:28s} {v['target']:24s} "
                     f"{_fmt(v['value'], '.2f'):>6} {v['bound']:5.2f}  {v['verdict']}")
    return lines


def _records(stages: list[Stage], out: pathlib.Path) -> dict[str, dict]:
    """The benchmark and tuning records this session wrote, by stage name (unreadable ones
    left out)."""
    records = {}
    for s in stages:
        name = s.summary.get("record")
        if name:
            try:
                records[s.name] = json.loads((out / name).read_text())
            except (OSError, ValueError):
                pass
    return records


def final_table(stages: list[Stage], out: pathlib.Path, header: str) -> str:
    lines = [f"== gpu_session: {header} ==", f"{'stage':15s} {'status':8s} {'secs':>7}  summary"]
    lines += [stage_line(s) for s in stages]
    records = _records(stages, out)
    for name, table in (("bench_gemm", gemm_table), ("bench_grouped", grouped_table),
                        ("bench_quantize", quantize_table), ("bench_linear", linear_table),
                        ("tune_gemm", tune_table),
                        ("tune_grouped", tune_table)):
        if name in records:
            lines.append("")
            try:
                lines += table(records[name])
            except (KeyError, ValueError, TypeError) as e:
                lines.append(f"{name}: could not tabulate its record: {type(e).__name__}: {e}")
    if any(name in records for name in ("bench_gemm", "bench_grouped", "bench_quantize")):
        lines.append("")
        try:
            lines += targets_table(target_verdicts(records))
        except (KeyError, ValueError, TypeError) as e:
            lines.append(f"targets: could not evaluate: {type(e).__name__}: {e}")
    lines.append(f"\nresults in {out}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ workers


def worker_env() -> int:
    """Prints the software and hardware this session ran on, as one JSON line."""
    import platform

    import jax

    info = {"python": platform.python_version(), "jax": jax.__version__}
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    dev = jax.devices()[0]
    info.update(device=dev.device_kind, platform=dev.platform, devices=len(jax.devices()),
                compute_capability=getattr(dev, "compute_capability", None),
                cores=getattr(dev, "core_count", None))
    for module in ("torch", "triton", "flax", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except Exception as e:  # noqa: BLE001 - recorded
            info[module] = f"unavailable ({type(e).__name__})"
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["torch_sees_gpu"] = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        pass
    info["tools"] = {t: find_tool(t) for t in ("nvcc", "ptxas", "nvdisasm", "cuobjdump", "compute-sanitizer")}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit"
        info["nvidia_smi"] = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
    print(json.dumps(info, indent=1))
    print("GPU_SESSION_ENV " + json.dumps(info), flush=True)
    return 0


def worker_kernels() -> int:
    """Every jfp8 Mosaic GPU kernel once at a small shape, each checked against its reference.

    The script the SASS dump and compute-sanitizer run: inputs come from numpy (few XLA kernels
    besides ours), and a wrong result is an error too.
    """
    import jax.numpy as jnp
    import numpy as np

    import jfp8

    rng = np.random.default_rng(0)
    m, n, k, tile = 256, 256, 512, jfp8.TILE
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), np.float32) / np.sqrt(k))
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32))
    sizes = jnp.asarray([100, 0, 156], jnp.int32)
    wg = jnp.asarray(rng.standard_normal((3, n, k), np.float32) / np.sqrt(k))
    a = jfp8.quantize(x, (1, tile))
    a_small = jfp8.quantize(x[:48], (1, tile))  # small M: the one-warpgroup form (tuning rule)
    x_tails = x[:250, :500].astype(jnp.bfloat16)  # unswizzled quantizers, tails on both axes

    def default_config_gemm():
        """The 128 x 128 warp-specialized persistent form, which the rule does not pick at
        this size."""
        from jfp8.reference import chunk_operand
        from pallas_kernels import gemm

        b = jfp8.quantize(w, (tile, tile))
        a_data, a_scale = chunk_operand(a, k)
        return gemm.scaled_matmul(a_data, a_scale, b.data, b.scale, n=n, b_block_rows=tile,
                                  out_dtype=jnp.float32, config=gemm.GemmConfig())

    def err(out, ref):
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))

    def bits_differ(t, ref):
        return sum(int(np.sum(np.asarray(u).view(np.uint8) != np.asarray(v).view(np.uint8)))
                   for u, v in ((t.data, ref.data), (t.scale, ref.scale)))

    checks = {
        "gemm_tile_x_block": lambda: err(
            jfp8.scaled_matmul(a, jfp8.quantize(w, (tile, tile)), out_dtype=jnp.float32, impl="mosaic"),
            jfp8.scaled_matmul_reference(a, jfp8.quantize(w, (tile, tile)), jnp.float32)),
        "gemm_default_config": lambda: err(
            default_config_gemm(), jfp8.scaled_matmul_reference(a, jfp8.quantize(w, (tile, tile)), jnp.float32)),
        "gemm_small_m": lambda: err(
            jfp8.scaled_matmul(a_small, jfp8.quantize(w, (tile, tile)), out_dtype=jnp.float32, impl="mosaic"),
            jfp8.scaled_matmul_reference(a_small, jfp8.quantize(w, (tile, tile)), jnp.float32)),
        "gemm_tile_x_tile": lambda: err(
            jfp8.scaled_matmul(a, jfp8.quantize(w, (1, tile)), out_dtype=jnp.float32, impl="mosaic"),
            jfp8.scaled_matmul_reference(a, jfp8.quantize(w, (1, tile)), jnp.float32)),
        "grouped_matmul": lambda: err(
            jfp8.grouped_scaled_matmul(a, jfp8.quantize(wg, (tile, tile)), sizes, out_dtype=jnp.float32,
                                       impl="mosaic"),
            jfp8.grouped_scaled_matmul_reference(a, jfp8.quantize(wg, (tile, tile)), sizes, jnp.float32)),
        "grouped_wgrad": lambda: err(
            jfp8.grouped_wgrad_matmul(jfp8.quantize(x, (tile, 1)).mT, jfp8.quantize(dy, (tile, 1)).mT, sizes,
                                      impl="mosaic"),
            jfp8.grouped_wgrad_reference(jfp8.quantize(x, (tile, 1)).mT, jfp8.quantize(dy, (tile, 1)).mT,
                                         sizes, jnp.float32)),
        "quantize_tile": lambda: bits_differ(jfp8.quantize(x, (1, tile), impl="mosaic"), a),
        "quantize_tile_unswizzled": lambda: bits_differ(jfp8.quantize(x_tails, (1, tile), impl="mosaic"),
                                                        jfp8.quantize(x_tails, (1, tile))),
        "quantize_block": lambda: bits_differ(jfp8.quantize(w, (tile, tile), impl="mosaic"),
                                              jfp8.quantize(w, (tile, tile))),
        "quantize_weight_both": lambda: sum(
            bits_differ(t, ref) for t, ref in zip(
                jfp8.quantize_weight(wg, impl="mosaic"), jfp8.quantize_weight(wg))),
        "quantize_grad_both": lambda: sum(
            bits_differ(t, ref) for t, ref in zip(
                jfp8.quantize_grad(dy, impl="mosaic"), jfp8.quantize_grad(dy))),
        "quantize_column_t": lambda: bits_differ(jfp8.quantize_wgrad_operand(x, impl="mosaic"),
                                                 jfp8.quantize_wgrad_operand(x)),
        "retile": lambda: bits_differ(jfp8.retile_wgrad_operand(a, impl="mosaic"), jfp8.retile_wgrad_operand(a)),
    }
    bad = 0
    for name, check in checks.items():
        try:
            e = check()
            ok = e <= 1e-5 if isinstance(e, float) else e == 0
            print(f"KERNEL {name}: {'ok' if ok else 'WRONG'} ({e})", flush=True)
        except Exception as ex:  # noqa: BLE001 - every kernel gets its turn
            ok = False
            print(f"KERNEL {name}: FAILED {type(ex).__name__}: {str(ex)[:500]}", flush=True)
        bad += not ok
    print("KERNELS OK" if bad == 0 else f"KERNELS: {bad} failed", flush=True)
    return 1 if bad else 0


# ------------------------------------------------------------------------------ main


def default_out() -> pathlib.Path:
    return pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=None, help="results dir ($OUT, else benchmarks/results)")
    p.add_argument("--budget-s", type=float, default=540, help="the whole session's wall-clock budget")
    p.add_argument("--stages", type=lambda s: [x for x in s.split(",") if x], default=list(DEFAULT_STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (default: all but the tuning stages)")
    p.add_argument("--gemm-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GemmConfig benched as its own row (repeatable; passed to bench_gemm --config)")
    p.add_argument("--grouped-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GroupedGemmConfig benched as its own row (repeatable; bench_grouped --config)")
    p.add_argument("--quantize-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a QuantizeConfig benched as its own rows (repeatable; bench_quantize --config)")
    p.add_argument("--gemm-shapes", nargs="+", default=list(GEMM_SHAPES))
    p.add_argument("--grouped-shapes", nargs="+", default=list(GROUPED_SHAPES))
    p.add_argument("--quantize-shapes", nargs="+", default=list(QUANTIZE_SHAPES))
    p.add_argument("--linear-shapes", nargs="+", default=list(LINEAR_SHAPES))
    p.add_argument("--quick", action="store_true", help="tiny benchmark shapes (implied without a Hopper GPU)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the table; run nothing")
    p.add_argument("--assume-hopper", action="store_true",
                   help="with --dry-run: plan as on an H100 (to read the GPU commands anywhere)")
    p.add_argument("--worker", choices=("env", "kernels"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "env":
        return worker_env()
    if args.worker == "kernels":
        return worker_kernels()
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    args.out = (args.out or default_out()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    if args.assume_hopper and not args.dry_run:
        p.error("--assume-hopper only plans: use it with --dry-run")
    gpu = Gpu("NVIDIA H100 80GB HBM3 (assumed)", "9.0", None) if args.assume_hopper else detect_gpu()
    today = datetime.date.today().isoformat()
    device = slug(gpu.name or "cpu")
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu_session-"))
    stages = plan(args, gpu, work)
    summary_path = args.out / f"gpu_session-{device}-{today}.json"
    log_path = args.out / f"gpu_session-{device}-{today}.log"
    tarball = args.out / f"sass-{device}-{today}.tar.gz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    print(f"gpu_session: {gpu.name or 'no GPU'} ({gpu.why_not or 'Hopper'}); budget {args.budget_s:.0f} s; "
          f"results in {args.out}", flush=True)

    def save():
        record = dict(date=today, gpu=gpu.name, compute_capability=gpu.compute_cap, hopper=gpu.hopper,
                      budget_s=args.budget_s, dry_run=args.dry_run, argv=sys.argv[1:] if argv is None else argv,
                      stages=[{k: v for k, v in dataclasses.asdict(s).items() if k not in ("output", "env")}
                              | {"env": s.env} for s in stages])
        try:
            record["targets"] = target_verdicts(_records(stages, args.out))
        except (KeyError, ValueError, TypeError) as e:  # a malformed record must not lose the rest
            record["targets"] = f"could not evaluate: {type(e).__name__}: {e}"
        summary_path.write_text(json.dumps(record, indent=1) + "\n")

    with open(log_path, "w", encoding="utf-8") as log:
        for s in stages:
            left = args.budget_s - (time.perf_counter() - start)
            if s.skip is None and left < MIN_STAGE_SECONDS:
                s.skip = f"session budget spent ({left:.0f} s left of {args.budget_s:.0f})"
            if s.skip is not None:
                s.status = "skipped"
            elif args.dry_run:
                s.status = "dry-run"
            else:
                s.timeout = min(s.timeout, left)
                if _timed_script(s.name):  # it stops starting shapes in time
                    share = 0.8 if s.name in TUNING_STAGES else 0.6
                    s.argv += ["--budget-s", f"{max(s.timeout * share, 5):.0f}"]
                stage_start = time.time()
                run_stage(s, env)
                if s.name == "env":
                    s.summary = summarize_env(s.output)
                elif s.name == "pytest_gpu":
                    s.summary = summarize_pytest(work, s.output)
                elif _timed_script(s.name):
                    s.summary = summarize_bench(args.out, s.name, stage_start)
                elif s.name == "sass":
                    s.summary = summarize_sass(work / "sass", tarball) | {"kernels": kernel_lines(s.output)}
                else:
                    s.summary = summarize_sanitizer(s.output)
            command = " ".join(s.argv)
            log.write(f"\n===== {s.name}: {s.status} ({s.seconds:.1f} s) =====\n$ {command}\n")
            if s.skip:
                log.write(f"skipped: {s.skip}\n")
            log.write(s.output[-400_000:])
            log.flush()
            print(stage_line(s) + ("" if not args.dry_run else f"\n    $ {command}"), flush=True)
            save()
    shutil.rmtree(work, ignore_errors=True)
    header = f"{gpu.name or 'no GPU'} | {today}"
    env_summary = stages[0].summary
    if env_summary:
        header += f" | jax {env_summary.get('jax')} | torch {env_summary.get('torch')}"
    print("\n" + final_table(stages, args.out, header), flush=True)
    failed = [s.name for s in stages if s.status in ("failed", "timeout")]
    if failed:
        print(f"stages failed or timed out: {', '.join(failed)} (see {log_path.name})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

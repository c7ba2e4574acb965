"""A GPU window in device calls: the correctness record first (smoke, then check: 5 and 3 minutes
with their starts), then FP8 against BF16 end to end (e2e, step, losses), then the kernels (bench, then
bisect when time is left); docs/gpu.md keeps the plan.

    bash scripts/gpu_session.sh                     # record 1: env, smoke (each kernel form alone), pytest -m gpu
    bash scripts/gpu_session.sh --command check     # record 2: compute-sanitizer, the training check
    bash scripts/gpu_session.sh --command e2e       # fp8_linear at the layer shapes, the routed-expert block
    bash scripts/gpu_session.sh --command step      # the wide preset's training step, FP8 and BF16
    bash scripts/gpu_session.sh --command losses    # 100 steps of each from the same seed: the loss gap
    bash scripts/gpu_session.sh --command bench     # dense, grouped, quantize, fp8_linear benchmarks
    bash scripts/gpu_session.sh --command bisect    # GemmConfig bisection, ncu, Mosaic profile
    bash scripts/gpu_session.sh --command tune_gemm     # optional further calls: the tuning tables
    bash scripts/gpu_session.sh --command tune_grouped
    python benchmarks/gpu_session.py --dry-run     # anywhere: every call's plan, in order
    python benchmarks/gpu_session.py --rehearse --command smoke   # CPU: the same plumbing, kernels
                                                    # in the Mosaic GPU interpreter, tiny shapes

Each stage is a subprocess in its own process group with its own timeout; a failing stage does
not stop the next one. All stages of a call share `--budget-s`; a stage that would start with too
little left is skipped, with that reason.

Stages:
  env            device, driver, versions, the CUDA tools found (ptxas, nvdisasm, cuobjdump, ncu,
                 compute-sanitizer) and pytest-timeout
  smoke          each kernel form of benchmarks/gpu_smoke.py in a subprocess of its own (45 s
                 each, 4 at a time): compiled?, correct within the hardware bound (GEMMs) or bit-exact
                 (quantizers)?, and, from the compiler's dumps (MOSAIC_GPU_DUMP_PTX/PTXAS/SASS),
                 registers, spill bytes, ptxas warnings (C7508: setmaxnreg ignored; serialized
                 wgmma), QGMMA/HGMMA, USETMAXREG and LDL/STL counts
  pytest_gpu     `pytest -m gpu` with a per-test timeout (pytest-timeout) and faulthandler dumps,
                 a process per test file, side by side
  racecheck, memcheck, synccheck
                 compute-sanitizer, one process per tool, over the default dense, grouped and
                 quantizer forms with partial tiles (gpu_smoke.SANITIZER_FORMS), filtered to the
                 Mosaic kernels; racecheck first runs a planted race and its clean twin
                 (gpu_mutants.py), and its verdict on the kernels counts only if it flagged it
  train_check    benchmarks/gpu_train_check.py: FP8 steps of tiny and gpu through the kernels
                 against the same steps on the reference; the four stages of the check call run
                 side by side
  bench_linear_layer, bench_moe_block, bench_step
                 benchmarks/bench_linear.py --shapes layer, bench_moe_block.py, bench_step.py:
                 FP8 against BF16 per layer, per routed-expert block and per training step
  bench_step_losses
                 bench_step.py --steps 100 (the losses call): FP8's and BF16's mean loss over
                 steps 81-100 from the same seed and batches, against issue 43's 1.5 % (`loss_goal`)
  bench_*        benchmarks/bench_{gemm,grouped,quantize,linear}.py at the DeepSeek-V3 shapes,
                 every row checked against its reference before it is timed
  bisect_gemm    bench_gemm at 8192^3, 4096x7168x16384 and the few-tile 768x384x32768 with one row
                 per GemmConfig variant (issue 19's switches, warp_specialized, persistent, tile_n,
                 stages, tile order)
  bisect_grouped bench_grouped at the first grouped shape with one row per GroupedGemmConfig
                 variant (issue 19's switches: clusters along N, scalar weight scale, early loads)
  bench_grouped_wgrad, bisect_grouped_wgrad
                 bench_grouped --op wgrad: the MoE Wgrad beside bf16 einsum, ragged_dot_general and
                 jax's transposed_ragged_dot_mgpu (last in the bench call), and its variants at the
                 first grouped shape (last in the bisect call)
  bisect_quantize
                 bench_quantize at the wide step's 16384x2048 bf16 and a 7168x2048 f32 weight: the
                 quantizers the step runs beside configs that fit more CTAs per SM (last in the
                 bisect call)
  ncu            Nsight Compute on the default dense kernel at 8192^3 (one launch after a warm-up):
                 speed of light, tensor pipe, L2/DRAM throughput, clocks
  profile        the same launch with the Mosaic GPU profiler: time in the `wgmma` and `promote`
                 regions of the main loop, per warpgroup
  tune_gemm / tune_grouped
                 benchmarks/tune_gemm.py: candidate configs per problem, the winners' table

Nothing is lost when a call is cut off: every stage streams into
`gpu_session-<device>-<date>-<command>.log` as it runs, and the summary
`gpu_session-<device>-<date>-<command>.json` (stage statuses, the smoke rows, pytest counts,
sanitizer and ncu readings, the speed targets) is rewritten after every stage and every smoke
kernel. The device returns at most 8 files a call, hence one log per call rather than one per
stage; the smoke stage's compiler dumps go into `smoke-dumps-<device>-<date>.tar.gz`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import importlib.util
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

BENCHMARKS = pathlib.Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
import gpu_reports  # noqa: E402
import gpu_tables  # noqa: E402
from provenance import commit_info, git as _git  # noqa: E402
from pallas_kernels import shapes  # noqa: E402  (plain tuples: no jax)

COMMANDS = {
    # The correctness record (issue 42), two calls: "smoke" then "check".
    "smoke": ("env", "smoke", "pytest_gpu"),
    "check": ("racecheck", "memcheck", "synccheck", "train_check"),
    # FP8 against BF16 end to end (issue 43): the layer at its four shapes and the routed-expert
    # block (one call, <= 3 minutes), then the training step of the wide preset (a call of its own).
    "e2e": ("bench_linear_layer", "bench_moe_block"),
    "step": ("bench_step",),
    # Issue 43's loss goal, a call of its own: 100 steps of FP8 and BF16 from the same seed.
    "losses": ("bench_step_losses",),
    "bench": ("bench_gemm", "bench_grouped", "bench_quantize", "bench_linear", "bench_grouped_wgrad"),
    "bisect": ("bisect_gemm", "bisect_grouped", "ncu", "profile", "bisect_grouped_wgrad", "bisect_quantize"),
    "tune_gemm": ("tune_gemm",),
    "tune_grouped": ("tune_grouped",),
}
# A GPU window's plan, each a device call of its own: the correctness record first, then the speed
# end to end, then the kernels' rows.
PLAN = ("smoke", "check", "e2e", "step", "losses", "bench", "bisect")
# The check call's four stages run side by side inside its 150 s budget: each may take nearly all of it.
TIMEOUTS = dict(env=45, smoke=150, pytest_gpu=200, racecheck=140, memcheck=130, synccheck=130, train_check=140,
                bench_linear_layer=140, bench_moe_block=60, bench_step=230, bench_step_losses=320,
                bench_gemm=170, bench_grouped=110,
                bench_quantize=110, bench_linear=90, bench_grouped_wgrad=60, bisect_gemm=200, bisect_grouped=90,
                ncu=90, profile=60, bisect_grouped_wgrad=60, bisect_quantize=80,
                tune_gemm=450, tune_grouped=450)
SMOKE_KERNEL_TIMEOUT = 45.0
SMOKE_FIRST_TIMEOUT = 75.0  # the first kernels also pay for CUDA and jax start-up
# Smoke forms run this many at a time, each in its own process (a fault stays in its process's
# CUDA context): compiling dominates a form's time and the GPU machines have 16 cores.
SMOKE_JOBS = 4
PYTEST_TEST_TIMEOUT = 60
MIN_STAGE_SECONDS = 15
# The test files with `gpu`-marked tests, each run in a process of its own (`worker_pytest_gpu`),
# quantizers first: the cheapest, and the swizzled layouts only hardware checks.
GPU_TEST_FILES = ("test_quantize_kernels.py", "test_gemm_kernel.py", "test_grouped_kernel.py", "test_ragged.py",
                  "test_attention.py")
# A call's wall clock. The record's two calls are 5 and 3 minutes with their starts (~30 s each on
# an H100, 2026-11-26); the speed calls follow in what is left of a window's 15 minutes. pytest -m
# gpu gets 200 s (its 90 s covered one file of four on the H100, 2026-11-28): a smoke of the
# default forms and the tests fit the smoke call's 300 s; every form and the tests do not (about
# 150 + 200 s), so a whole record runs the two as calls of their own (docs/gpu.md). The layer rows
# get 140 s now that each also computes CPU slices (on the H100, 2026-11-28, a 66 s share of a
# 130 s call ran three of the four shapes).
DEFAULT_BUDGET_S = 400
BUDGETS = {"smoke": 300, "check": 150, "e2e": 210, "step": 240, "losses": 330}

# The benchmark shapes (pallas_kernels/shapes.py), most important first: a budget cut drops the
# tail. The square 8192^3, then DeepSeek-V3's M=4096 shapes with the long K of the speed targets.
def _x(*dims) -> str:
    return "x".join(map(str, dims))


def _first(shape) -> tuple:
    return (tuple(shape) != (8192, 8192, 8192), shape.k < 7168, -shape.k)


GEMM_SHAPES = tuple(_x(*s) for s in sorted(shapes.DENSE_SHAPES, key=_first)) + tuple(
    _x(*s) for s in shapes.SMALL_M_SHAPES)
GROUPED_SHAPES = tuple(_x(*s) for s in shapes.GROUPED_SHAPES)
QUANTIZE_SHAPES = tuple(f"{m}x{k}:{dtype}" for m, k, dtype in shapes.QUANTIZE_SHAPES)
LINEAR_SHAPES = tuple(_x(*s) for s in sorted(shapes.DENSE_SHAPES, key=_first) if s.m == 4096)[:3]
# Last, a few-tile problem (the gpu preset's 768 -> 384 projection's shape over its 32k tokens, as
# a Fprop: 18 tiles of 128 x 128): the rule's one-warpgroup 64 x 64 pick (the default row) beside
# the warp-specialized 128 x 64 (`tile_n=64`) and 128 x 128 ones (`tuning._few_tiles`, predicted).
FEW_TILE_SHAPE = "768x384x32768"
BISECT_SHAPES = GEMM_SHAPES[:1] + tuple(s for s in GEMM_SHAPES if s.startswith("4096x7168x16384")) + (
    FEW_TILE_SHAPE,)
# One switch of the default GemmConfig() per row, then the simple form; issue 19's variants
# (each alone and together) first, since a budget cut drops whole shapes. The scalar b scale is
# on by default since the deviceless build's census (docs/gpu.md): its row turns it off.
BISECT_CONFIGS = ("cluster_m=2", "scalar_b_scale=false", "early_scale_loads=true", "cluster_n=2", "run_ahead=true",
                  "cluster_m=2,scalar_b_scale=true", "cluster_m=2,scalar_b_scale=true,early_scale_loads=true",
                  "cluster_m=2,scalar_b_scale=true,early_scale_loads=true,run_ahead=true",
                  "tile_n=192,scalar_b_scale=true", "tile_n=256,scalar_b_scale=true,max_concurrent_steps=3",
                  "warp_specialized=false,persistent=false,tile_m=64,grid_tile_group=1,max_concurrent_steps=2",
                  "persistent=false", "grid_tile_group=1", "tile_n=64", "max_concurrent_steps=3",
                  "max_concurrent_steps=5", "tile_m=256,max_concurrent_steps=3")
# The grouped kernels' switches (GroupedGemmConfig; the Wgrad ignores scalar_b_scale), each alone
# and together, at the first grouped shape (8 experts x 4096 rows, N=4096, K=7168).
GROUPED_BISECT_CONFIGS = ("cluster_n=2", "scalar_b_scale=false", "early_scale_loads=true",
                          "cluster_n=2,scalar_b_scale=true,early_scale_loads=true")
# The grouped Wgrad's (its b is tile-scaled: no scalar scale), last in the bisect call.
WGRAD_BISECT_CONFIGS = ("cluster_n=2", "early_scale_loads=true", "cluster_n=2,early_scale_loads=true")
# The quantizers the training step runs, beside forms that fit more CTAs per SM (docs/gpu.md, "A
# lead on the quantizer rates": only tile and retile fit two by default): one SMEM slot (two CTAs
# for the both-forms kernels), and one chunk per CTA (two CTAs for the weight quantizer with an
# f32 master since its transpose goes through SMEM in quarters); at the wide step's most frequent
# tensor and an f32 master weight, last in the bisect call.
QUANTIZE_BISECT_SHAPES = ("16384x2048:bfloat16", "7168x2048:float32")
QUANTIZE_BISECT_ONLY = ("copy,jfp8-mosaic-tile,jfp8-mosaic-block-t,jfp8-mosaic-grad,jfp8-mosaic-activation,"
                        "jfp8-xla-tile,jfp8-xla-block-t,jfp8-xla-grad,jfp8-xla-activation")
# XLA's own quantizers (jfp8-xla-* rows, `Fp8Recipe(quantize_impl="xla")`) in the bench call: at
# the first quantize shape only (the wide step's most frequent tensor), after every kernel row.
QUANTIZE_XLA_ROWS = 1
QUANTIZE_BISECT_CONFIGS = ("column_chunks=4,stages=1", "column_chunks=1")
PROFILE_SHAPE = "8192x8192x8192"
# What compute-sanitizer runs (one process per tool, the forms in order): the default dense,
# grouped Fprop and grouped Wgrad kernels and every quantizer, each with a partial tile
# (`gpu_smoke.SANITIZER_FORMS`). Racecheck first runs the deliberately racy mutant and its clean
# twin (`gpu_mutants.py`): its silence on the kernels counts only if it flagged the mutant.
SANITIZER_KERNELS = ("gemm_default_tails", "grouped_fprop", "grouped_wgrad", "quantize_tile_tails",
                     "quantize_block_tails", "quantize_weight_tails", "quantize_grad_tails",
                     "quantize_column_t_tails", "retile_tails", "quantize_activation_tails")
MUTANT, MUTANT_TWIN = "mutant_early_release", "mutant_clean_release"
# A race with no barrier at all, in a Mosaic kernel: flagged if racecheck instruments Mosaic GPU's
# kernels (on the H100 it flagged neither mutant).
MUTANT_UNSYNCHRONIZED = "mutant_unsynchronized"
MUTANT_FORMS = (MUTANT, MUTANT_TWIN, MUTANT_UNSYNCHRONIZED)
# The same hazards in plain CUDA (hopper/racecheck_controls.cu, built here and carried like
# DeepGEMM's harness): whether racecheck sees anything on the machine, and mbarrier ordering.
RACECHECK_CONTROLS = BENCHMARKS / "hopper" / "bin" / "racecheck_controls"
# --print-limit for the probes (controls, planted races): every report of one probe printed (a
# planted race may report every byte of its stage); the kernels' process keeps 50.
PROBE_PRINT_LIMIT = 10000
# Issue 45's lean main loop (no per-block fence on the consumers) becomes a default only after
# racecheck is clean on it, in clusters too (a multicast refill lands in the other CTA's stage).
LEAN_FORMS = ("gemm_lean_release", "grouped_fprop_lean_release", "gemm_lean_release_128x192_cluster_m",
              "gemm_lean_release_256x128_cluster_n",  # these two: released after the second wave
              "grouped_fprop_lean_release_256x128_cluster_n")
SANITIZED = {"racecheck": ("racecheck", (*MUTANT_FORMS, *SANITIZER_KERNELS, *LEAN_FORMS)),
             "memcheck": ("memcheck", SANITIZER_KERNELS),
             "synccheck": ("synccheck", SANITIZER_KERNELS)}
# The record's training check: FP8 steps with the kernels against the reference, same GPU.
TRAIN_CHECK_ARGS = ["--presets", "tiny", "gpu", "--steps", "5", "--batch", "4"]
# The Mosaic GPU kernels' CUDA names contain this (`<body>_mosaic_gpu_kernel`): the filter for
# ncu and compute-sanitizer, so that XLA's own kernels are not instrumented.
MOSAIC_KERNEL_SUBSTRING = "mosaic_gpu"

# --rehearse (CPU): tiny shapes, XLA paths in the benchmarks, kernels in the interpreter.
QUICK_ARGS = {
    "bench_gemm": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
    "bench_grouped": ["--shapes", "2x128x128x256", "--warmup", "1", "--repeats", "2"],
    "bench_quantize": ["--shapes", "256x256:bfloat16", "--warmup", "1", "--repeats", "2"],
    "bench_linear": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
    "bisect_gemm": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
    "bisect_grouped": ["--shapes", "2x128x128x256", "--warmup", "1", "--repeats", "2"],
    "bench_grouped_wgrad": ["--shapes", "2x128x128x256", "--warmup", "1", "--repeats", "2"],
    "bisect_grouped_wgrad": ["--shapes", "2x128x128x256", "--warmup", "1", "--repeats", "2"],
    "bisect_quantize": ["--shapes", "256x256:bfloat16", "--warmup", "1", "--repeats", "2"],
}
# The end-to-end stages' GPU arguments (their scripts' GPU defaults otherwise): the wide4k preset's
# step (where the step model predicts FP8 ahead), then wide's if the budget lets it start, each
# precision's steps after the first capped, then 3 steps per precision under the profiler: each
# kernel's device time by the step model's categories.
E2E_ARGS = {"bench_linear_layer": ["--shapes", "layer"], "bench_moe_block": [],
            "bench_step": ["--presets", "wide4k", "wide", "--max-seconds", "30", "--profile", "3"],
            # README's front door as written (issue 43: "run as written on the GPU machine"): 100
            # steps per precision at wide4k (predicted 17 s each; bench_step caps each precision's
            # steps at its default 120 s, hence the call's 330 s); a run cut short cannot judge
            # steps 81-100 and says so.
            "bench_step_losses": ["--presets", "wide4k", "--steps", "100"]}
QUICK_E2E_ARGS = {
    "bench_linear_layer": ["--shapes", "128x256x256", "--warmup", "1", "--repeats", "2"],
    "bench_moe_block": ["--shapes", "64x128x128x2", "--warmup", "1", "--repeats", "2"],
    "bench_step": ["--presets", "tiny", "--batch", "2", "--seq-len", "32", "--steps", "4", "--timed-from", "2",
                   "--model", "n_layers=1,n_dense_layers=0,mtp=false", "--profile", "1"],
    "bench_step_losses": ["--presets", "tiny", "--batch", "2", "--seq-len", "32", "--steps", "10",
                          "--timed-from", "2", "--model", "n_layers=1,n_dense_layers=0,mtp=false"],
}
# Each end-to-end stage's script (bench_<x>.py otherwise).
E2E_SCRIPTS = {"bench_linear_layer": "bench_linear.py", "bench_step_losses": "bench_step.py"}
# --rehearse: the training check's plumbing at the tiny preset, both sides on XLA (the kernels in
# the interpreter take minutes per step; `gpu_train_check.py --interpret` runs them, by hand).
REHEARSAL_TRAIN_CHECK_ARGS = ["--presets", "tiny", "--steps", "2", "--batch", "2"]
# A rehearsal's smoke stage: a real form in the interpreter, a form whose compiler dump is a
# committed sample (parsers end to end), a hang (the timeout and kill) and a crash.
REHEARSAL_SMOKE = ("quantize_tile", "_sample_dump", "_hang", "_crash")
REHEARSAL_SMOKE_TIMEOUT = 60.0
REHEARSAL_HANG_TIMEOUT = 4.0

TOOL_DIRS = ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/nvidia/*/bin",
             "/opt/nvidia/nsight-compute/*", "/usr/local/cuda-*/bin")
SMOKE_DUMP_ENV = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_SASS": "1"}


# ------------------------------------------------------------------------------ environment


def find_tool(name: str) -> str | None:
    """`name` on PATH, in the CUDA directories, or in the CUDA toolkit pip packages."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [d for pattern in TOOL_DIRS for d in sorted(glob.glob(pattern))]
    dirs += [str(pathlib.Path(root) / "bin") for root in _pip_cuda_roots()]
    spec = importlib.util.find_spec("triton")  # Triton wheels carry ptxas, cuobjdump, nvdisasm
    if spec and spec.origin:
        dirs.append(str(pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin"))
    for d in dirs:
        path = pathlib.Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _pip_cuda_roots() -> list[str]:
    """The CUDA roots jax itself would find in pip packages (jax._src.lib._cuda_path's order)."""
    roots = []
    for module in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            roots.append(str(loc))
    return roots


def _is_root(path: str, *, disasm: bool) -> bool:
    p = pathlib.Path(path)
    ok = (p / "bin" / "ptxas").is_file() and any((p / "nvvm" / "libdevice").glob("libdevice*.bc"))
    return ok and (not disasm or (p / "bin" / "nvdisasm").is_file())


def cuda_root_for_dumps() -> tuple[dict[str, str], str]:
    """(env, note): the CUDA_ROOT the smoke subprocesses need for Mosaic GPU to disassemble
    (it runs `<root>/bin/nvdisasm`; jax sets MOSAIC_GPU_CUDA_ROOT from CUDA_ROOT at import and
    overwrites any value of its own, and XLA takes ptxas and libdevice from the same root)."""
    if os.environ.get("CUDA_ROOT"):
        return {}, f"CUDA_ROOT={os.environ['CUDA_ROOT']} (given)"
    candidates = _pip_cuda_roots() + ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"))
    default = next((c for c in candidates if _is_root(c, disasm=False)), None)
    if default and _is_root(default, disasm=True):
        return {}, f"jax's CUDA root {default} has nvdisasm"
    full = next((c for c in candidates if _is_root(c, disasm=True)), None)
    if full:
        return {"CUDA_ROOT": full}, f"CUDA_ROOT={full} (jax's own root {default} has no nvdisasm)"
    return {}, "no CUDA root with ptxas, libdevice and nvdisasm: SASS from ptxas + cuobjdump on the PTX"


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


# ------------------------------------------------------------------------------ the plan


@dataclasses.dataclass
class Stage:
    name: str
    argv: list[str]
    timeout: float
    skip: str | None = None  # why the stage is not run
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    kind: str = "command"  # "command", "bench" (writes a record), "smoke" (many subprocesses)
    # Runs side by side with the consecutive stages that are concurrent too (each its own process
    # and output file, appended to the log when it ends): the record's second call.
    concurrent: bool = False
    # filled in when it runs
    status: str = "planned"
    seconds: float = 0.0
    rc: int | None = None
    summary: dict = dataclasses.field(default_factory=dict)


def _python() -> str:
    return sys.executable or "python3"


def _pytest_timeout_available() -> bool:
    return importlib.util.find_spec("pytest_timeout") is not None


def plan(command: str, args, gpu: Gpu, work: pathlib.Path) -> list[Stage]:
    """The stages of one call, in order, with their commands (not run)."""
    py, me, smoke = _python(), str(pathlib.Path(__file__).resolve()), str(BENCHMARKS / "gpu_smoke.py")
    out = args.out
    rehearse = args.rehearse
    no_gpu = None if (gpu.hopper or rehearse) else gpu.why_not
    gpu_only = None if gpu.hopper else (gpu.why_not or "needs a Hopper GPU")
    stages = []

    def bench(name, script, shapes, extra=(), out_dir=out):
        argv = [py, str(BENCHMARKS / script), "--out", str(out_dir), "--max-seconds", "3"]
        argv += QUICK_ARGS[name] if rehearse or not gpu.hopper else ["--shapes", *shapes]
        return Stage(name, argv + list(extra), TIMEOUTS[name], kind="bench")

    def configs(flag, texts):
        return [a for c in texts for a in (flag, c)]

    for name in COMMANDS[command]:
        if name == "env":
            stages.append(Stage("env", [py, me, "--worker", "env"], TIMEOUTS["env"],
                                env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        elif name == "smoke":
            kernels = list(REHEARSAL_SMOKE if rehearse else args.smoke_kernels or _smoke_names())
            kernels += [f"gemm[{c}]" for c in args.gemm_config]
            kernels += [f"grouped[{c}]" for c in args.grouped_config]
            root_env, root_note = ({}, "rehearsal: no dumps") if rehearse else cuda_root_for_dumps()
            env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **root_env}
            if not rehearse:
                env.update(SMOKE_DUMP_ENV)
            stage = Stage("smoke", [py, smoke, "--kernel", "<each>"] + (["--interpret"] if rehearse else []),
                          TIMEOUTS["smoke"], skip=no_gpu, env=env, kind="smoke")
            stage.summary = {"kernels": kernels, "cuda_root": root_note}
            stages.append(stage)
        elif name == "pytest_gpu":
            files = ("test_quantize_kernels.py",) if rehearse else GPU_TEST_FILES
            argv = [py, me, "--worker", "pytest_gpu", "--junit-dir", str(work), "--files", ",".join(files)]
            # One process per file side by side: none may take 75 % of the GPU up front (jax's
            # default), or the others run out of memory (35 of 61 tests, an H100, 2026-11-28).
            stages.append(Stage("pytest_gpu", argv, TIMEOUTS["pytest_gpu"], skip=no_gpu,
                                env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        elif name == "bench_gemm":
            stages.append(bench(name, "bench_gemm.py", args.gemm_shapes, configs("--config", args.gemm_config)))
        elif name == "bench_grouped":
            stages.append(bench(name, "bench_grouped.py", args.grouped_shapes,
                                configs("--config", args.grouped_config)))
        elif name == "bench_grouped_wgrad":
            stages.append(bench(name, "bench_grouped.py", args.grouped_shapes, ["--op", "wgrad"]))
        elif name == "bench_quantize":
            stages.append(bench(name, "bench_quantize.py", args.quantize_shapes,
                                [*configs("--config", args.quantize_config), "--xla-rows", str(QUANTIZE_XLA_ROWS)]))
        elif name == "bench_linear":
            stages.append(bench(name, "bench_linear.py", args.linear_shapes))
        elif name in E2E_ARGS:
            script = E2E_SCRIPTS.get(name, f"{name}.py")
            argv = [py, str(BENCHMARKS / script), "--out", str(out),
                    *(QUICK_E2E_ARGS[name] if rehearse or not gpu.hopper else E2E_ARGS[name])]
            stages.append(Stage(name, argv, TIMEOUTS[name], kind="bench"))
        elif name == "bisect_gemm":
            # Its own folder: the record is bench_gemm's, and call 2 writes one too.
            extra = configs("--config", [*BISECT_CONFIGS, *args.gemm_config])
            stages.append(bench(name, "bench_gemm.py", BISECT_SHAPES, extra, out_dir=out / "bisect"))
        elif name == "bisect_grouped":
            extra = configs("--config", [*GROUPED_BISECT_CONFIGS, *args.grouped_config])
            stages.append(bench(name, "bench_grouped.py", GROUPED_SHAPES[:1], extra, out_dir=out / "bisect"))
        elif name == "bisect_grouped_wgrad":
            extra = ["--op", "wgrad", *configs("--config", WGRAD_BISECT_CONFIGS)]
            stages.append(bench(name, "bench_grouped.py", GROUPED_SHAPES[:1], extra, out_dir=out / "bisect"))
        elif name == "bisect_quantize":
            only = ["--only", QUANTIZE_BISECT_ONLY] if gpu.hopper and not rehearse else []  # CPU: jfp8-xla-* rows
            extra = [*only, *configs("--config", QUANTIZE_BISECT_CONFIGS)]
            stages.append(bench(name, "bench_quantize.py", QUANTIZE_BISECT_SHAPES, extra, out_dir=out / "bisect"))
        elif name == "ncu":
            stages.append(Stage("ncu", [py, me, "--worker", "ncu"], TIMEOUTS["ncu"], skip=gpu_only))
        elif name == "profile":
            argv = [py, smoke, "--launch", PROFILE_SHAPE, "--repeats", "2", "--profile-dir",
                    str(work / "profile")]
            stages.append(Stage("profile", argv, TIMEOUTS["profile"], skip=gpu_only,
                                env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        elif name in SANITIZED:
            tool, kernels = SANITIZED[name]
            argv = [py, me, "--worker", "sanitizer", "--tool", tool, *(a for k in kernels for a in ("--kernel", k))]
            stages.append(Stage(name, argv, TIMEOUTS[name], skip=gpu_only, concurrent=True))
        elif name == "train_check":
            argv = [py, str(BENCHMARKS / "gpu_train_check.py"), "--out", str(out),
                    *(REHEARSAL_TRAIN_CHECK_ARGS if rehearse or not gpu.hopper else TRAIN_CHECK_ARGS)]
            stages.append(Stage(name, argv, TIMEOUTS[name], skip=no_gpu, concurrent=True,
                                env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        elif name in ("tune_gemm", "tune_grouped"):
            argv = [py, str(BENCHMARKS / "tune_gemm.py"), *(["--grouped"] if name == "tune_grouped" else []),
                    "--out", str(out), "--max-seconds", "2", "--repeats", "7"]
            stages.append(Stage(name, argv, TIMEOUTS[name], skip=gpu_only, kind="bench"))
    if args.stages:
        for s in stages:
            if s.name not in args.stages:
                s.skip = "not selected (--stages)"
    return stages


def _smoke_names() -> list[str]:
    """The smoke forms, in run order (importing jax here initialises no device): every form, then
    the sanitizer's partial-tile forms (the record checks each quantizer at a tail on hardware)."""
    from gpu_smoke import KERNELS, SANITIZER_FORMS

    return [*KERNELS, *(k for k in SANITIZER_FORMS if k not in KERNELS)]


# ------------------------------------------------------------------------------ running


class Log:
    """The call's log: stage headers written here, subprocess output appended by the OS as it
    comes (the child's stdout/stderr are this file), read back by offset to summarise."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def offset(self) -> int:
        return os.fstat(self.fd).st_size

    def since(self, offset: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def close(self) -> None:
        os.close(self.fd)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def run_process(argv, env, timeout, stdout, stderr) -> tuple[str, int | None]:
    """Runs argv in its own process group; kills the group at the timeout. -> (status, rc)."""
    try:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=REPO, env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        os.write(stderr if isinstance(stderr, int) else stderr.fileno(), f"could not start: {e}\n".encode())
        return "failed", None
    try:
        rc = proc.wait(timeout=max(timeout, 1))
        return ("ok" if rc == 0 else "failed"), rc
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return "timeout", None


def run_smoke(stage: Stage, env: dict, log: Log, ctx: Session) -> None:
    """Each kernel form in a process of its own, `ctx.args.smoke_jobs` at a time: stderr (the
    worker's messages) to a file per form, appended to the log when the form ends; stdout (the
    compiler's dumps) to another, parsed into the form's row. Rows keep the forms' order."""
    dumps = ctx.work / "smoke"
    dumps.mkdir(exist_ok=True)
    kernels = stage.summary["kernels"]
    rows = stage.summary.setdefault("rows", [])
    rows[:] = [{"kernel": k} for k in kernels]
    deadline = time.perf_counter() + stage.timeout
    jobs = max(1, ctx.args.smoke_jobs)
    pending = list(range(len(kernels)))
    running: dict[int, tuple[subprocess.Popen, float, float]] = {}  # index -> (process, start, limit)
    while pending or running:
        while pending and len(running) < jobs:
            i = pending.pop(0)
            kernel, left = kernels[i], deadline - time.perf_counter()
            if left < 5:
                rows[i].update(status="skipped", failure=f"smoke stage budget spent ({left:.0f} s left)")
                continue
            limit = REHEARSAL_SMOKE_TIMEOUT if ctx.rehearse else (
                SMOKE_FIRST_TIMEOUT if i < jobs else SMOKE_KERNEL_TIMEOUT)
            if kernel == "_hang":
                limit = REHEARSAL_HANG_TIMEOUT
            limit = min(limit, left)
            argv = [a if a != "<each>" else kernel for a in stage.argv]
            log.write(f"--- smoke {kernel} started (timeout {limit:.0f} s)\n")
            with open(dumps / f"{slug(kernel)}.txt", "wb") as out, open(dumps / f"{slug(kernel)}.err", "wb") as err:
                try:
                    proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=REPO, env={**env, **stage.env},
                                            start_new_session=True, stdin=subprocess.DEVNULL)
                except OSError as e:
                    rows[i].update(status="failed", failure=f"could not start: {e}")
                    continue
            running[i] = (proc, time.perf_counter(), limit)
        time.sleep(0.1)
        for i, (proc, t0, limit) in list(running.items()):
            timed_out = proc.poll() is None and time.perf_counter() - t0 > limit
            if proc.poll() is None and not timed_out:
                continue
            if timed_out:
                _kill_group(proc)
            del running[i]
            _finish_smoke_row(rows[i], kernels[i], proc.returncode, timed_out, limit,
                              time.perf_counter() - t0, dumps, log, ctx)
    bad = [r["kernel"] for r in rows if r["status"] != "ok" and not r["kernel"].startswith("_")]
    stage.status = "ok" if not bad else "failed"
    stage.summary["failed"] = bad


def _finish_smoke_row(row: dict, kernel: str, rc: int | None, timed_out: bool, limit: float, seconds: float,
                      dumps: pathlib.Path, log: Log, ctx: Session) -> None:
    """One finished form: its messages into the log, its result and compiler dump into its row."""
    messages = (dumps / f"{slug(kernel)}.err").read_text(errors="replace")
    log.write(messages)
    row["seconds"] = round(seconds, 2)
    result = _smoke_result(messages)
    row.update({k: result[k] for k in ("seed", "shape", "metric", "error", "bound", "failure", "detail") if k in result})
    if timed_out:
        row["status"] = "timeout"
        row["failure"] = f"no result within {limit:.0f} s (hang or slow compile)"
    elif not result:
        row["status"] = "failed"
        row["failure"] = f"exit status {rc}, no SMOKE result (crash before the check: see the log)"
    else:
        row["status"] = "ok" if result.get("ok") else ("WRONG" if "failure" not in result else "failed")
    if row["status"] != "ok":  # which CUDA error, if any: a fault is this form's row and no other's
        row["cuda_error"] = gpu_reports.first_cuda_error(messages)
    dump_path = dumps / f"{slug(kernel)}.txt"
    text = dump_path.read_text(errors="replace")
    row.update(gpu_reports.summarize_dump(text))
    row["deviceless"] = gpu_reports.compare_to_deviceless(row, deviceless_rows(ctx.gpu.name).get(kernel))
    row["sass_source"] = "mosaic dump" if row["sass"] else None
    if not row["sass"] and gpu_reports.ptx_modules(text) and not ctx.rehearse:
        sass = "".join(filter(None, (_ptx_to_sass(ptx, dumps / slug(kernel)) for ptx in gpu_reports.ptx_modules(text))))
        if sass:
            row["sass"] = gpu_reports.count_sass(sass)
            row["sass_functions"] = gpu_reports.sass_functions(sass)
            row["sass_source"] = "ptxas -arch=sm_90a + cuobjdump on the dumped PTX"
            with open(dump_path, "a") as f:
                f.write("\n// ---- SASS from ptxas + cuobjdump ----\n" + sass)
    log.write(f"--- smoke {kernel}: {row['status']} in {row['seconds']} s (registers {row['registers']}, "
              f"spill bytes {row['spill_bytes']}, SASS {row['sass'] or 'none'}; against the deviceless "
              f"build: {'same' if row['deviceless']['same'] else row['deviceless']['differences']})\n")
    ctx.pack_dumps(dumps)
    ctx.save()


DEVICELESS = REPO / "benchmarks" / "results" / "hopper-build"
# A stage whose record another script names (the layer shapes are bench_linear's rows).
RECORD_OF = {"bench_linear_layer": "bench_linear", "bench_step_losses": "bench_step"}


def deviceless_rows(device_kind: str | None) -> dict[str, dict]:
    """{form: row} of the committed deviceless build for this GPU (benchmarks/hopper_build.py;
    an H200's own file, else the H100's), {} when there is none."""
    target = "h200" if "H200" in (device_kind or "") else "h100_sxm"
    path = DEVICELESS / f"kernels-{target}.json"
    if not path.exists():
        return {}
    return {r["form"]: r for r in json.loads(path.read_text())["rows"]}


def _smoke_result(text: str) -> dict:
    found = [line for line in text.splitlines() if line.startswith("SMOKE result ")]
    if not found:
        return {}
    try:
        return json.loads(found[-1][len("SMOKE result "):])
    except ValueError:
        return {}


def _ptx_to_sass(ptx: str, stem: pathlib.Path) -> str | None:
    """SASS for dumped PTX when Mosaic GPU could not disassemble it itself."""
    ptxas, disasm = find_tool("ptxas"), find_tool("cuobjdump")
    if not (ptxas and disasm):
        return None
    src, cubin = stem.with_suffix(".ptx"), stem.with_suffix(".cubin")
    src.write_text(ptx)
    try:
        subprocess.run([ptxas, "-arch=sm_90a", "-o", str(cubin), str(src)], check=True,
                       capture_output=True, timeout=120)
        return subprocess.run([disasm, "--dump-sass", str(cubin)], check=True, capture_output=True,
                              text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def summarize(stage: Stage, text: str, ctx: Session, since: float) -> dict:
    """A finished stage's summary, from its output (`text`) and the files it wrote."""
    if stage.name == "env":
        for line in text.splitlines():
            if line.startswith("GPU_SESSION_ENV "):
                return json.loads(line[len("GPU_SESSION_ENV "):])
        return {}
    if stage.name == "pytest_gpu":
        parsed = {p.stem.removeprefix("pytest-"): gpu_reports.parse_junit(p.read_text())
                  for p in sorted(ctx.work.glob("pytest-*.xml"))}
        if parsed:
            out = {k: sum(r[k] for r in parsed.values()) for k in ("tests", "failures", "errors", "skipped")}
            out["failed"] = [f for r in parsed.values() for f in r["failed"]]
            out["files"] = {name: {k: r[k] for k in ("tests", "failures", "errors", "skipped")}
                            for name, r in parsed.items()}
            return out
        tail = text.strip().splitlines()[-1:] or [""]
        return {"last_line": tail[0]}
    if stage.kind == "bench":
        bisect = stage.name.startswith("bisect_")
        out = ctx.args.out / "bisect" if bisect else ctx.args.out
        name = stage.name.replace("bisect_", "bench_") if bisect else RECORD_OF.get(stage.name, stage.name)
        paths = [p for p in out.glob(f"{name}-*.json") if p.stat().st_mtime >= since - 1]
        if not paths:
            return {"record": None}
        path = max(paths, key=lambda p: p.stat().st_mtime)
        record = json.loads(path.read_text())
        return {"record": str(path.relative_to(ctx.args.out)), "rows": len(record.get("rows", [])),
                "failed": len(record.get("failed", [])), "skipped": len(record.get("skipped", []))}
    if stage.name == "ncu":
        launches = gpu_reports.parse_ncu_csv(text)
        note = next((line for line in text.splitlines() if line.startswith("NCU ")), None)
        return {"launches": launches, "note": note}
    if stage.name == "profile":
        traces = sorted((ctx.work / "profile").glob("*.json"), key=lambda p: p.stat().st_mtime) if (ctx.work / "profile").exists() else []
        regions = {}
        for path in traces[-1:]:  # the last launch: after the warm-up
            regions = gpu_reports.summarize_profile(json.loads(path.read_text()))
        return {"traces": len(traces), "regions": regions}
    if stage.name in SANITIZED:
        summary = gpu_reports.parse_sanitizer(gpu_reports.last_process(text))  # the kernels' process
        summary["forms"] = gpu_reports.sanitizer_by_form(text)
        summary["filter"] = next((line for line in text.splitlines() if line.startswith("SANITIZER ")), None)
        if stage.name == "racecheck":
            summary.update(gpu_reports.racecheck_verdict(summary["forms"], MUTANT, MUTANT_TWIN))
            summary["blindness"] = gpu_reports.racecheck_blindness(summary["forms"])
        return summary
    if stage.name == "train_check":
        rows = [json.loads(line[len("TRAIN_CHECK "):]) for line in text.splitlines() if line.startswith("TRAIN_CHECK ")]
        return {"rows": rows, "ok": bool(rows) and all(r.get("ok") for r in rows)}
    return {}


@dataclasses.dataclass
class Session:
    """One call's context: what it writes where, and the summary it keeps rewriting."""

    args: argparse.Namespace
    command: str
    gpu: Gpu
    work: pathlib.Path
    stages: list[Stage]
    rehearse: bool

    @property
    def stem(self) -> str:
        return f"gpu_session-{slug(self.gpu.name or 'cpu')}-{datetime.date.today().isoformat()}-{self.command}"

    @property
    def summary_path(self) -> pathlib.Path:
        return self.args.out / f"{self.stem}.json"

    @property
    def log_path(self) -> pathlib.Path:
        return self.args.out / f"{self.stem}.log"

    def records(self) -> dict[str, dict]:
        records = {}
        for s in self.stages:
            name = s.summary.get("record") if s.kind == "bench" else None
            if name:
                try:
                    records[s.name] = json.loads((self.args.out / name).read_text())
                except (OSError, ValueError):
                    pass
        return records

    def save(self) -> None:
        """The summary JSON, written whole to a temporary file and renamed over the old one."""
        record = dict(
            date=datetime.date.today().isoformat(), gpu=self.gpu.name, compute_capability=self.gpu.compute_cap,
            hopper=self.gpu.hopper, command=self.command, rehearsal=self.rehearse, **commit_info(),
            budget_s=self.args.budget_s, dry_run=self.args.dry_run, argv=self.args.argv,
            stages=[dataclasses.asdict(s) for s in self.stages],
        )
        smoke = next((s for s in self.stages if s.name == "smoke"), None)
        if smoke is not None:
            record["smoke"] = smoke.summary.get("rows", [])
        pytest_stage = next((s for s in self.stages if s.name == "pytest_gpu"), None)
        if pytest_stage is not None and pytest_stage.status not in ("planned", "dry-run", "skipped"):
            record["pytest_gpu"] = pytest_stage.summary
        try:
            record["targets"] = gpu_tables.target_verdicts(
                {k: v for k, v in self.records().items() if not k.startswith("bisect_")})
        except (KeyError, ValueError, TypeError) as e:  # a malformed record must not lose the rest
            record["targets"] = f"could not evaluate: {type(e).__name__}: {e}"
        losses = self.records().get("bench_step_losses")
        if losses is not None:
            try:
                record["loss_goal"] = gpu_tables.loss_verdicts(losses)
            except (KeyError, ValueError, TypeError) as e:
                record["loss_goal"] = f"could not evaluate: {type(e).__name__}: {e}"
        tmp = self.summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        os.replace(tmp, self.summary_path)

    def pack_dumps(self, dumps: pathlib.Path) -> None:
        tarball = self.args.out / f"smoke-dumps-{slug(self.gpu.name or 'cpu')}-{datetime.date.today().isoformat()}.tar.gz"
        tmp = tarball.with_suffix(".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for p in sorted(dumps.glob("*.txt")):
                tar.add(p, arcname=f"smoke-dumps/{p.name}")
        os.replace(tmp, tarball)


def _repeat_note(repeat: dict | None) -> str:
    """The training check's determinism reading (`gpu_train_check.same_state`), for its line."""
    if not repeat:
        return ""
    if "error" in repeat:
        return f", step 1's repeat failed ({repeat['error'][:60]})"
    if repeat.get("same_bits"):
        return ", step 1 repeats bit for bit"
    names = ", ".join(repeat.get("first_differing", [])[:3])
    return f", step 1 NOT repeatable ({repeat.get('differing')} of {repeat.get('leaves')} leaves differ: {names} ...)"


def stage_line(s: Stage) -> str:
    note = s.skip if s.status == "skipped" else ""
    sm = s.summary
    if s.name == "env" and sm:
        note = f"{sm.get('device')} | jax {sm.get('jax')} | torch {sm.get('torch')}"
    elif s.name == "smoke" and sm.get("rows"):
        rows = sm["rows"]
        counts = {st: sum(r["status"] == st for r in rows) for st in ("ok", "WRONG", "failed", "timeout", "skipped")}
        note = ", ".join(f"{v} {k}" for k, v in counts.items() if v) + f" of {len(rows)} kernels"
    elif s.name == "pytest_gpu" and "tests" in sm:
        note = f"{sm['tests']} tests, {sm['failures']} failures, {sm['errors']} errors, {sm['skipped']} skipped"
    elif s.kind == "bench" and sm.get("record"):
        note = f"{sm['rows']} rows, {sm['failed']} failed, {sm['skipped']} skipped ({sm['record']})"
    elif s.name in SANITIZED and s.status not in ("skipped", "dry-run", "planned"):
        note = f"errors {sm.get('errors', '?')}" + (f", hazards {sm['hazards']}" if "hazards" in sm else "")
        if "verdict" in sm:
            note += f"; {sm['verdict']}"
        if sm.get("blindness"):
            note += f"; controls: {sm['blindness']['reading']}"
    elif s.name == "train_check" and sm.get("rows"):
        note = "; ".join(f"{r['preset']}: {'ok' if r.get('ok') else 'FAILED'}"
                         + (f" (rel. loss diff {r['rel_diff'][0]:.1e} .. {r['rel_diff'][-1]:.1e})" if r.get("rel_diff") else
                            f" ({r.get('failure', '')[:80]})")
                         + _repeat_note(r.get("repeatable"))
                         for r in sm["rows"])
    elif s.name == "profile" and sm.get("regions"):
        note = " ".join(f"{k} {v['per_warpgroup_us']:.0f} us/wg" for k, v in sm["regions"].items())
    elif s.name == "ncu" and sm.get("launches") is not None:
        note = f"{len(sm['launches'])} launch(es) profiled" + (f"; {sm['note']}" if sm.get("note") else "")
    return f"{s.name:20s} {s.status:8s} {s.seconds:7.1f}  {note}"


def final_table(ctx: Session, header: str) -> str:
    lines = [f"== gpu_session {ctx.command}: {header} ==", f"{'stage':20s} {'status':8s} {'secs':>7}  summary"]
    lines += [stage_line(s) for s in ctx.stages]
    smoke = next((s for s in ctx.stages if s.name == "smoke"), None)
    if smoke is not None and smoke.summary.get("rows"):
        lines += ["", *gpu_tables.smoke_table(smoke.summary["rows"])]
    records = ctx.records()
    for name, table in (("bench_gemm", gpu_tables.gemm_table), ("bench_grouped", gpu_tables.grouped_table),
                        ("bench_quantize", gpu_tables.quantize_table), ("bench_linear", gpu_tables.linear_table),
                        ("bench_linear_layer", gpu_tables.linear_table), ("bench_moe_block", gpu_tables.block_table),
                        ("bench_step", gpu_tables.step_table),
                        ("bench_step_losses", gpu_tables.step_table),
                        ("bench_step_losses", gpu_tables.losses_table),
                        ("bench_grouped_wgrad", gpu_tables.grouped_table),
                        ("bisect_gemm", gpu_tables.gemm_table), ("bisect_grouped", gpu_tables.grouped_table),
                        ("bisect_grouped_wgrad", gpu_tables.grouped_table),
                        ("bisect_quantize", gpu_tables.quantize_table),
                        ("tune_gemm", gpu_tables.tune_table),
                        ("tune_grouped", gpu_tables.tune_table)):
        if name in records:
            lines.append("")
            try:
                lines += table(records[name])
            except (KeyError, ValueError, TypeError) as e:
                lines.append(f"{name}: could not tabulate its record: {type(e).__name__}: {e}")
    if any(name in records for name in ("bench_gemm", "bench_grouped", "bench_quantize")):
        lines.append("")
        try:
            lines += gpu_tables.targets_table(gpu_tables.target_verdicts(
                {k: v for k, v in records.items() if not k.startswith("bisect_")}))
        except (KeyError, ValueError, TypeError) as e:
            lines.append(f"targets: could not evaluate: {type(e).__name__}: {e}")
    lines.append(f"\nresults in {ctx.args.out}")
    return "\n".join(lines)


RESULTS = REPO / "benchmarks" / "results"
# What users run: the default configs, and what the tuning rule picks at large problems with a bf16
# output (256-row tiles, dense and grouped) and for a layer's Wgrad over 8192 tokens (2-CTA
# clusters along M, f32 out, its 4-stage ring refilled).
DEFAULT_FORMS = ("gemm_default", "gemm_rule_256x128_cluster_n", "gemm_rule_wgrad", "gemm_rule_wgrad_long_k",
                 "grouped_fprop", "grouped_fprop_rule_256x128_cluster_n", "grouped_wgrad", "quantize_tile",
                 "quantize_grad")


def last_record(results: pathlib.Path = RESULTS) -> dict | None:
    """The newest committed record of a real GPU (not a rehearsal or dry run): {"path", "date",
    "commit", "clean"}, clean when its smoke and pytest stages were ok; None when there is none."""
    found = []
    for path in results.glob("**/gpu_session-*-smoke.json"):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if r.get("hopper") and not r.get("rehearsal") and not r.get("dry_run"):
            ok = {s["name"]: s["status"] == "ok" for s in r.get("stages", [])}
            found.append({"path": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
                          "date": r.get("date"), "commit": r.get("commit"),
                          "clean": bool(ok.get("smoke") and ok.get("pytest_gpu"))})
    return max(found, key=lambda r: (r["date"] or "", r["path"])) if found else None


def window_opening(record: dict | None) -> str:
    """What a GPU window opens with (issue 42): the whole record when `pallas_kernels/` changed
    since the last one (or there is none, or it was not clean), else a smoke of the default forms."""
    if record is None or not record["commit"]:
        return "the whole record (no committed record of a GPU names its commit)"
    changed = _git("diff", "--name-only", record["commit"], "--", "pallas_kernels/")
    if changed is None:
        return f"the whole record (cannot compare with the last record's commit {record['commit'][:10]})"
    if changed.strip() or not record["clean"]:
        why = "pallas_kernels/ changed" if changed.strip() else "it was not clean"
        return f"the whole record: {why} since the last one ({record['commit'][:10]}, {record['date']})"
    return (f"a smoke of the default forms (--smoke-kernels {','.join(DEFAULT_FORMS)}): pallas_kernels/ is as "
            f"the clean record of {record['date']} ran it")


def _stage_groups(stages: list[Stage]) -> list[list[Stage]]:
    """The stages in run order, consecutive concurrent ones grouped (every other stage alone)."""
    groups: list[list[Stage]] = []
    for s in stages:
        if s.concurrent and groups and groups[-1][-1].concurrent:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _run_concurrent(stages: list[Stage], env: dict, log: Log, ctx: Session) -> None:
    """Starts every stage at once, each in its own process group with its own timeout and output
    file; each stage's output goes into the log, under its header, when it ends."""
    running = []
    for s in stages:
        output = tempfile.TemporaryFile()
        log.write(f"\n----- {s.name} started ({time.strftime('%H:%M:%S')}): {' '.join(s.argv)}\n")
        try:
            proc = subprocess.Popen(s.argv, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env={**env, **s.env},
                                    start_new_session=True, stdin=subprocess.DEVNULL)
        except OSError as e:
            s.status, s.summary = "failed", {"failure": f"could not start: {e}"}
            continue
        running.append((s, proc, output, time.perf_counter(), time.time()))
    while running:
        time.sleep(0.2)
        for item in list(running):
            s, proc, output, t0, since = item
            timed_out = proc.poll() is None and time.perf_counter() - t0 > s.timeout
            if proc.poll() is None and not timed_out:
                continue
            running.remove(item)
            if timed_out:
                _kill_group(proc)
            s.status = "timeout" if timed_out else ("ok" if proc.returncode == 0 else "failed")
            s.rc, s.seconds = proc.returncode, time.perf_counter() - t0
            output.seek(0)
            text = output.read().decode("utf-8", "replace")
            log.write(f"\n===== {s.name} ({s.seconds:.1f} s, ran beside the others of its call) =====\n"
                      f"$ {' '.join(s.argv)}\n{text}===== {s.name}: {s.status} in {s.seconds:.1f} s\n")
            s.summary = summarize(s, text, ctx, since)
            ctx.save()


def run_command(command: str, args, gpu: Gpu) -> int:
    args = argparse.Namespace(**{
        **vars(args), "budget_s": args.budget_s or BUDGETS.get(command, DEFAULT_BUDGET_S),
        "smoke_jobs": args.smoke_jobs or (2 if args.rehearse else SMOKE_JOBS)})
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu_session-"))
    stages = plan(command, args, gpu, work)
    ctx = Session(args, command, gpu, work, stages, args.rehearse)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"gpu_session {command}: {gpu.name or 'no GPU'} ({gpu.why_not or 'Hopper'})"
          f"{' -- rehearsal on the CPU' if args.rehearse else ''}; budget {args.budget_s:.0f} s; "
          f"log {ctx.log_path}", flush=True)
    log = Log(ctx.log_path)
    start = time.perf_counter()
    try:
        for group in _stage_groups(stages):
            ready = []
            for s in group:
                left = args.budget_s - (time.perf_counter() - start)
                if s.skip is None and left < MIN_STAGE_SECONDS:
                    s.skip = f"call budget spent ({left:.0f} s left of {args.budget_s:.0f})"
                if s.skip is not None:
                    s.status = "skipped"
                elif args.dry_run:
                    s.status = "dry-run"
                else:
                    s.timeout = min(s.timeout, left)
                    if s.kind == "bench":  # it stops starting problems in time
                        share = 0.8 if s.name.startswith("tune") else 0.6
                        s.argv += ["--budget-s", f"{max(s.timeout * share, 5):.0f}"]
                    ready.append(s)
            if len(group) > 1:
                _run_concurrent(ready, env, log, ctx)
            for s in group:
                if s in ready and len(group) == 1:
                    log.write(f"\n===== {s.name} ({time.strftime('%H:%M:%S')}) =====\n$ {' '.join(s.argv)}\n")
                    t0, offset, since = time.perf_counter(), log.offset(), time.time()
                    if s.kind == "smoke":
                        run_smoke(s, env, log, ctx)
                    else:
                        s.status, s.rc = run_process(s.argv, {**env, **s.env}, s.timeout, log.fd, log.fd)
                        s.summary = summarize(s, log.since(offset), ctx, since)
                    s.seconds = time.perf_counter() - t0
                    log.write(f"===== {s.name}: {s.status} in {s.seconds:.1f} s\n")
                elif s not in ready:
                    log.write(f"\n===== {s.name} ({time.strftime('%H:%M:%S')}) =====\n$ {' '.join(s.argv)}\n")
                    if s.skip is not None:
                        log.write(f"skipped: {s.skip}\n")
                extra = ""
                if args.dry_run:
                    extra = f"\n    $ {' '.join(s.argv)}"
                    if s.kind == "smoke":
                        extra += f"\n    kernels, in order: {', '.join(s.summary['kernels'])}"
                    if s.name == "racecheck":
                        extra += ("\n    plain-CUDA controls: " + (str(RACECHECK_CONTROLS) if RACECHECK_CONTROLS.is_file() else
                                  "NOT BUILT (python benchmarks/hopper/racecheck_controls.py --build, then carry "
                                  "benchmarks/hopper/bin)"))
                print(stage_line(s) + extra, flush=True)
                ctx.save()
    finally:
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    header = f"{gpu.name or 'no GPU'} | {datetime.date.today().isoformat()}"
    env_summary = next((s.summary for s in stages if s.name == "env"), None)
    if env_summary:
        header += f" | jax {env_summary.get('jax')} | torch {env_summary.get('torch')}"
    table = final_table(ctx, header)
    print("\n" + table, flush=True)
    with open(ctx.log_path, "a") as f:
        f.write("\n" + table + "\n")
    failed = [s.name for s in stages if s.status in ("failed", "timeout")]
    if failed:
        print(f"stages failed or timed out: {', '.join(failed)} (see {ctx.log_path.name})")
    return 1 if failed else 0


# ------------------------------------------------------------------------------ workers


def pytest_gpu_argv(junit: pathlib.Path, test_file: str) -> list[str]:
    """`pytest -m gpu` over one test file, JUnit XML to `junit`."""
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE",
            "--continue-on-collection-errors", f"--junitxml={junit}",
            "-o", f"faulthandler_timeout={PYTEST_TEST_TIMEOUT - 10}"]
    if _pytest_timeout_available():
        argv.append(f"--timeout={PYTEST_TEST_TIMEOUT}")
    return argv + [str(REPO / "tests" / test_file)]


def worker_pytest_gpu(junit_dir: str, files: str) -> int:
    """`pytest -m gpu`, one process per test file, all at once, each file's output printed whole
    when it ends. A kernel fault leaves the process's CUDA context unusable (a sticky error), so
    one process for all files failed every test after the first fault and then segfaulted (an
    H100, 2026-11-26); a process per file keeps the other files' results, and running them side by
    side fits the record's first call (their compiles dominate; the GPU machine has 16 cores)."""
    procs = []
    for name in filter(None, files.split(",")):
        junit = pathlib.Path(junit_dir) / f"pytest-{pathlib.Path(name).stem}.xml"
        output = tempfile.TemporaryFile()
        procs.append((name, output, subprocess.Popen(pytest_gpu_argv(junit, name), stdout=output,
                                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
    rc = 0
    for name, output, proc in procs:
        rc = proc.wait() or rc
        output.seek(0)
        print(f"--- pytest -m gpu {name}: exit {proc.returncode}", flush=True)
        sys.stdout.write(output.read().decode(errors="replace"))
        sys.stdout.flush()
    return rc


def worker_env() -> int:
    """Prints the software and hardware this call runs on, as one JSON line."""
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
    try:
        from jax._src import lib as jax_lib

        info["jax_cuda_root"] = jax_lib.cuda_path
    except Exception:  # noqa: BLE001
        pass
    info["smoke_cuda_root"] = cuda_root_for_dumps()[1]
    info["pytest_timeout"] = _pytest_timeout_available()
    info["tools"] = {t: find_tool(t) for t in ("nvcc", "ptxas", "nvdisasm", "cuobjdump", "ncu",
                                                "compute-sanitizer")}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit"
        info["nvidia_smi"] = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
    print(json.dumps(info, indent=1))
    print("GPU_SESSION_ENV " + json.dumps(info), flush=True)
    return 0


def _kernel_filter(help_text: str, flag_style: str) -> list[str]:
    """The option that restricts a tool to the Mosaic kernels, as this tool version spells it
    (read off its --help), or [] when it has none."""
    if "--kernel-name" in help_text:
        value = f"kns={MOSAIC_KERNEL_SUBSTRING}" if flag_style == "sanitizer" else f"regex:{MOSAIC_KERNEL_SUBSTRING}"
        return ["--kernel-name", value]
    if flag_style == "sanitizer" and "--filter" in help_text:
        return ["--filter", f"kns={MOSAIC_KERNEL_SUBSTRING}"]
    return []


def worker_sanitizer(tool: str, kernels: list[str]) -> int:
    """compute-sanitizer on smoke forms, in order, in one process (`gpu_smoke.py --kernel A --kernel
    B ...`), restricted to the Mosaic kernels where it can be. Each form announces itself on stderr
    (`SMOKE start`) before its launches, which attributes each report to the form that made it."""
    exe = find_tool("compute-sanitizer")
    if exe is None:
        print("SANITIZER not found", flush=True)
        return 2
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30).stdout
    flt = _kernel_filter(help_text, "sanitizer")
    extra = racecheck_options(help_text) if tool == "racecheck" else []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
           "XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer="}
    base = [exe, "--tool", tool, "--print-limit", "50", *extra]
    rc = 0
    if tool == "racecheck":
        # First what tells a blind racecheck apart: the plain-CUDA controls, then the Mosaic
        # mutants with nothing filtered (so that a silent mutant cannot be the filter's doing).
        # A probe's reports must not be cut short by another's (--print-limit counts per process):
        # each runs in a process of its own, with room for every report it may print.
        probe_options = racecheck_options(help_text, probe=True)
        probe = [exe, "--tool", tool, "--print-limit", str(PROBE_PRINT_LIMIT), *probe_options]
        rc |= _racecheck_controls(probe)
        for mutant in [k for k in kernels if k in MUTANT_FORMS]:
            print(f"SANITIZER_MUTANTS {tool} on {mutant}, no filter, {' '.join(probe_options) or 'default options'}",
                  flush=True)
            argv = [*probe, _python(), str(BENCHMARKS / "gpu_smoke.py"), "--kernel", mutant, "--seed", "0"]
            rc |= subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode
        kernels = [k for k in kernels if k not in MUTANT_FORMS]
    if kernels:
        print(f"SANITIZER {tool} on {', '.join(kernels)}, filter {' '.join(flt) or 'none (not in --help)'}"
              f"{', ' + ' '.join(extra) if extra else ''}", flush=True)
        argv = [*base, *flt, _python(), str(BENCHMARKS / "gpu_smoke.py"),
                *(a for k in kernels for a in ("--kernel", k)), "--seed", "0"]
        rc |= subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode
    return rc


def racecheck_options(help_text: str, probe: bool = False) -> list[str]:
    """racecheck's most sensitive reporting, in the options this version's --help lists (an option
    it does not list is left out rather than failing the run): every hazard detected and reported,
    info level included (the default hides it: compute-sanitizer's manual), and 64 mbarriers
    tracked per block (the count otherwise comes from nvcc's compiler information, which Mosaic
    GPU's kernels, built by ptxas from Mosaic's PTX, may not carry). `probe` (the controls and the
    planted races, small kernels): info-level hazards also printed, and every synchronization
    event traced into the log, which shows whether racecheck saw a kernel's barriers at all."""
    options = []
    for flag, value, probe_only in (("--racecheck-detect-level", "info", False), ("--racecheck-report", "all", False),
                                    ("--num-cuda-barriers", "64", False), ("--print-level", "info", True),
                                    ("--racecheck-trace-sync", "yes", True)):
        if flag in help_text and (probe or not probe_only):
            options += [flag, value]
    return options


def _racecheck_controls(base: list[str], binary: pathlib.Path | None = None, timeout: float = 60) -> int:
    """Each plain-CUDA control under racecheck (`base`: the tool's argv), in a process of its own,
    its output announced as a smoke form (`control_<kernel>`) so that its reports are charged to
    it, and its own verdict (a clean twin's output must be exact) as that form's result."""
    if str(BENCHMARKS / "hopper") not in sys.path:
        sys.path.insert(0, str(BENCHMARKS / "hopper"))
    import racecheck_controls

    binary = RACECHECK_CONTROLS if binary is None else binary
    if not binary.is_file():
        print(f"RACECHECK_CONTROLS missing: no {binary} (build it with "
              "benchmarks/hopper/racecheck_controls.py --build and carry benchmarks/hopper/bin)", flush=True)
        return 0  # the verdict says the controls did not run; the mutants and kernels still do
    rc = 0
    for kernel, _racy in racecheck_controls.KERNELS:
        print(f"SMOKE start control_{kernel} seed=0", flush=True)
        try:
            r = subprocess.run([*base, str(binary), kernel], capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            text, code = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:  # its output comes as bytes here, whatever `text` said
            out = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
            text, code = f"{out.decode(errors='replace')}\ntimed out after {timeout:.0f} s", 124
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
        result = racecheck_controls.parse(text) or {"kernel": kernel, "ok": False, "error": f"exit {code}, no result line"}
        print("SMOKE result " + json.dumps({**result, "kernel": f"control_{kernel}"}), flush=True)
        rc |= code != 0 and not result.get("ok", False)
    return rc


def worker_ncu() -> int:
    """Nsight Compute on the default dense kernel at PROFILE_SHAPE, the launch after a warm-up."""
    exe = find_tool("ncu")
    if exe is None:
        print("NCU not found", flush=True)
        return 2
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
    metrics = []
    try:  # the tensor-pipe counters this ncu knows for Hopper (names differ between versions)
        query = subprocess.run([exe, "--query-metrics", "--chip", "gh100"], capture_output=True,
                               text=True, timeout=60).stdout
        names = re.findall(r"^(sm__pipe_tensor_op_\w*cycles_active)\b", query, re.MULTILINE)
        metrics = [f"{n}.avg.pct_of_peak_sustained_active" for n in dict.fromkeys(names)]
    except (OSError, subprocess.SubprocessError):
        pass
    flt = _kernel_filter(help_text, "ncu")
    print(f"NCU filter {' '.join(flt) or 'none'}; tensor metrics {metrics or 'none found'}", flush=True)
    argv = [exe, "--clock-control", "none", *flt, "--launch-skip", "1", "--launch-count", "1",
            "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis",
            "--section", "MemoryWorkloadAnalysis", "--csv", "--page", "details"]
    if metrics:
        argv += ["--metrics", ",".join(metrics)]
    argv += [_python(), str(BENCHMARKS / "gpu_smoke.py"), "--launch", PROFILE_SHAPE, "--repeats", "2"]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode


# ------------------------------------------------------------------------------ main


def default_out() -> pathlib.Path:
    return pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--command", choices=tuple(COMMANDS), default=None,
                   help="which call to run (default: smoke; with --dry-run: all three, in order)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="results dir ($OUT, else benchmarks/results)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the call's wall-clock budget (default: {BUDGETS} by command, else {DEFAULT_BUDGET_S})")
    p.add_argument("--stages", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="run only these stages of the command (comma-separated)")
    p.add_argument("--smoke-jobs", type=int, default=None,
                   help=f"smoke forms run at a time, each in its own process (default {SMOKE_JOBS}; 2 in a rehearsal)")
    p.add_argument("--smoke-kernels", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="smoke only these kernel forms (gpu_smoke.py --list)")
    p.add_argument("--gemm-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GemmConfig as its own smoke form and bench/bisect row (repeatable)")
    p.add_argument("--grouped-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GroupedGemmConfig as its own smoke form and bench row (repeatable)")
    p.add_argument("--quantize-config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a QuantizeConfig benched as its own rows (repeatable)")
    p.add_argument("--gemm-shapes", nargs="+", default=list(GEMM_SHAPES))
    p.add_argument("--grouped-shapes", nargs="+", default=list(GROUPED_SHAPES))
    p.add_argument("--quantize-shapes", nargs="+", default=list(QUANTIZE_SHAPES))
    p.add_argument("--linear-shapes", nargs="+", default=list(LINEAR_SHAPES))
    p.add_argument("--rehearse", action="store_true",
                   help="CPU: the same stages and plumbing, kernels in the interpreter, tiny shapes")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.add_argument("--assume-hopper", action="store_true",
                   help="with --dry-run: plan as on an H100 (to read the GPU commands anywhere)")
    p.add_argument("--worker", choices=("env", "ncu", "sanitizer", "pytest_gpu"), help=argparse.SUPPRESS)
    p.add_argument("--junit-dir", help=argparse.SUPPRESS)
    p.add_argument("--files", help=argparse.SUPPRESS)
    p.add_argument("--tool", help=argparse.SUPPRESS)
    p.add_argument("--kernel", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.worker == "env":
        return worker_env()
    if args.worker == "ncu":
        return worker_ncu()
    if args.worker == "sanitizer":
        return worker_sanitizer(args.tool, args.kernel)
    if args.worker == "pytest_gpu":
        return worker_pytest_gpu(args.junit_dir, args.files)
    if args.assume_hopper and not args.dry_run:
        p.error("--assume-hopper only plans: use it with --dry-run")
    if args.stages:
        known = {s for c in COMMANDS.values() for s in c}
        if set(args.stages) - known:
            p.error(f"unknown stages {sorted(set(args.stages) - known)}; known: {','.join(sorted(known))}")
    args.out = (args.out or default_out()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = Gpu("NVIDIA H100 80GB HBM3 (assumed)", "9.0", None) if args.assume_hopper else detect_gpu()
    if args.command is None and args.dry_run:
        commands = PLAN
        print(f"# the window opens with {window_opening(last_record())}")
    else:
        commands = (args.command or "smoke",)
    if not gpu.hopper and not (args.rehearse or args.dry_run):
        print(f"gpu_session: {gpu.why_not}. On a CPU, --rehearse runs the same plan in the Mosaic GPU "
              f"interpreter and --dry-run prints it.", file=sys.stderr)
    rc = 0
    for i, command in enumerate(commands):
        if args.dry_run and len(commands) > 1:
            print(f"\n# device call {i + 1} of {len(commands)}: "
                  f"bash scripts/gpu_session.sh{'' if command == 'smoke' else ' --command ' + command}")
        rc = max(rc, run_command(command, args, gpu))
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Build the anchors of issue 31 (part 3) for sm_90a without a GPU and read what the compiler made.

Anchors: DeepGEMM's SM90 FP8 GEMM with 1x128 activation scales and 128x128 weight scales
(`sm90_fp8_gemm_1d2d_impl`), its m-grouped contiguous form (the MoE kernel), and CUTLASS's
example 67 (`67_hopper_fp8_warp_specialized_gemm_with_blockwise_scaling`). This repository keeps
only this recipe and the recorded results; their code stays in their checkouts, which this script
takes as paths (`--deepgemm DIR --cutlass DIR`, extracted sources). Nothing here runs a kernel.

    .venv/bin/python benchmarks/hopper/anchors.py \
        --deepgemm /tmp/anchors/deepgemm --cutlass /tmp/anchors/cutlass \
        --deepgemm-cutlass /tmp/anchors/cutlass-dg \
        --ours /tmp/hbfull/dumps/h100_sxm --work /tmp/anchors/build \
        --out benchmarks/results/hopper-build/anchors-h100_sxm.json

Sources (see the JSON's "sources"): `git archive` of deepseek-ai/DeepGEMM and NVIDIA/cutlass;
DeepGEMM pins CUTLASS as its submodule `third-party/cutlass`: pass that commit's `include/` tree as
`--deepgemm-cutlass` (default: `--cutlass`). Pass `--deepgemm-commit/--cutlass-commit/...` or let the
script read `git -C DIR rev-parse HEAD` where DIR is a checkout (an archive has no .git).

Compiler: `$CUDA_HOME/bin/nvcc` (CUDA_HOME defaults to /usr/local/cuda; point it at another CUDA
toolkit, which must have the runtime headers, to compare compilers). SASS: `nvdisasm` from
CUDA_HOME, else from the project's Hopper toolchain (`scripts/hopper_toolchain.sh`), or `--nvdisasm`.

DeepGEMM is compiled the way its JIT compiles it (csrc/jit/compiler.hpp, NVCCCompiler):
    nvcc kernel.cu -cubin -o kernel.cubin -std=c++20 --diag-suppress=39,161,174,177,186,940
         --ptxas-options=--register-usage-level=10 -I<deep_gemm/include> --gpu-architecture=sm_90a
         --compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi -O3
         --expt-relaxed-constexpr --expt-extended-lambda
plus `--ptxas-options=--verbose,--warn-on-local-memory-usage` (what DG_JIT_PTXAS_VERBOSE adds) and
`-I<cutlass>/include` (the wheel copies cute/ and cutlass/ into deep_gemm/include; same headers).
kernel.cu is the instantiation DeepGEMM's `SM90FP8Gemm1D2DRuntime::generate_impl` writes
(csrc/jit_kernels/impls/sm90_fp8_gemm_1d2d.hpp): one `reinterpret_cast<void*>(&kernel<...>)` with
the template arguments chosen below.

Template arguments: `deepgemm_config` re-derives, in Python, what DeepGEMM's host heuristics
(csrc/jit_kernels/heuristics/common.hpp get_best_config + sm90.hpp SM90ArchSpec) choose for a
shape on an H100 SXM (132 SMs): candidates block_m in {64, 128, 256} (MGroupedContiguous: 128, the
contiguous layout's M alignment), block_n in 16..192 step 16 (1D2D caps at 192 "register spills";
block_n > 128 only if block_n % (block_n-128) == 0 or 128 % (block_n-128) == 0; not both block_m
and block_n > 128), clusters 1x1, 1x2, 2x1; block_k = 128; stages = min((232448 - extra SMEM) /
per-stage SMEM, 16), at least 3 (4 when block_m*block_n < 128*192); then the candidate with the
fewest modelled L1/L2 cycles divided by the last wave's efficiency (multicast barred when there is
only one wave), first one kept on ties, float32 where the C++ is float. Compiled dims "nk" (the
default of fp8_gemm_nt and m_grouped_fp8_gemm_nt_contiguous): SHAPE_N and SHAPE_K are constants,
SHAPE_M = 0 (runtime), so the K loop's trip count is known to the compiler. SFB K-major (the
(N/128, K/128) float tensor as given), BF16 output, EpilogueIdentity. The JSON records the chosen
config and the runner-up candidates with their modelled cycles.

CUTLASS's example 67 comes as two host programs, both compiled: "blockwise"
(TileShape 128x128x128, ClusterShape 1x2x1, sm90_trivial_blockwise_scale_config(TileShape): 128x128
scale blocks for A as well as B, FP32 column-major output through a fused
ScaledLinCombPerRowBiasEltActAmaxAux epilogue) and "groupwise" (TileShape 256x128x128, ClusterShape
1x2x1, ScaleGranularity M=1, N=128, K=128: 1x128 activations x 128x128 weights, DeepSeek's recipe,
which makes it the CUTLASS anchor to read beside DeepGEMM and jfp8). Both use
KernelTmaWarpSpecializedCooperativeFP8Blockwise (two consumer warpgroups splitting the tile's M).
Each is compiled with `-c` (an object) with the flags of CUTLASS's CMake (C++17,
--expt-relaxed-constexpr, -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1, -O3 -DNDEBUG) for sm_90a, then the
GEMM kernel's cubin is pulled out with cuobjdump -xelf. The problem shape (M, N, K) is a runtime
argument of these programs (--m --n --k): one compile serves every shape, so their rows are
shape-free (the tile, cluster and schedule are compile-time and fixed in the .cu).

Per-128-K-block numbers: benchmarks/hopper/sass_loops.py (mainloop_census). Our kernels'
rows ("jfp8") come from benchmarks/hopper_build.py --keep-dumps (--ours DIR/h100_sxm), read by the
same census; `--only ours` refreshes them alone. `anchors.py --table FILE.json` prints the
side-by-side markdown table of a recorded result; `anchors.py --recensus FILE.json` re-runs the
main-loop census on the SASS the anchors' builds kept (a newer census without a rebuild).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "hopper"))
from gpu_reports import parse_ptxas, sass_census, sass_functions  # noqa: E402
from sass_loops import mainloop_census  # noqa: E402

NUM_SMS_H100_SXM = 132
SMEM_CAPACITY_SM90 = 232448          # SM90ArchSpec::smem_capacity
MAX_STAGES = 16
BLOCK_K = 128                        # 128 / sizeof(e4m3)
CONTIGUOUS_M_ALIGNMENT = 128         # HeuristicsRuntime::kLegacyMKAlignmentForContiguousLayout (SM90)

# Shapes of the issue: (name, m, n, k, groups, kind); grouped: m = groups * rows per group.
SHAPES = [
    ("gemm_8192x8192x8192", 8192, 8192, 8192, 1, "Normal"),
    ("gemm_4096x7168x7168", 4096, 7168, 7168, 1, "Normal"),
    ("grouped_contiguous_8x4096_n4096_k7168", 8 * 4096, 4096, 7168, 8, "MGroupedContiguous"),
]

DEEPGEMM_FLAGS = ("-std=c++20 --diag-suppress=39,161,174,177,186,940 "
                  "--ptxas-options=--register-usage-level=10 --gpu-architecture=sm_90a "
                  "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi "
                  "-O3 --expt-relaxed-constexpr --expt-extended-lambda "
                  "--ptxas-options=--verbose,--warn-on-local-memory-usage")
CUTLASS_FLAGS = ("-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -ftemplate-backtrace-limit=0 "
                 "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1 -DCUTLASS_TEST_LEVEL=0 -DCUTLASS_DEBUG_TRACE_LEVEL=0 "
                 "-gencode=arch=compute_90a,code=sm_90a -Xptxas -v")
CUTLASS_DIR = "examples/67_hopper_fp8_warp_specialized_gemm_with_blockwise_scaling/"
# blockwise: sm90_trivial_blockwise_scale_config(TileShape) = 128x128 scales for A *and* B (not
# DeepSeek's recipe); groupwise: ScaleGranularityM = 1, N = K = 128, i.e. 1x128 activations x
# 128x128 weights, the recipe DeepGEMM and jfp8 implement. Both are compiled.
CUTLASS_EXAMPLES = {
    "example_67_blockwise": CUTLASS_DIR + "67_hopper_fp8_warp_specialized_gemm_with_blockwise_scaling.cu",
    "example_67_groupwise": CUTLASS_DIR + "67_hopper_fp8_warp_specialized_gemm_with_groupwise_scaling.cu",
}


# ---------------------------------------------------------------- DeepGEMM's SM90 heuristics

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _swizzle_mode(block_bytes: int) -> int:
    return next(mode for mode in (128, 64, 32, 16) if block_bytes % mode == 0)


def _pipeline(m, n, k, block_m, block_n) -> tuple[int, int]:
    """(num_stages, smem_size) as SM90ArchSpec::get_pipeline_config (FP8 A/B, BF16 D, 1D2D)."""
    smem_cd = _align(block_m * block_n * 2, 1024)
    smem_barriers = MAX_STAGES * 8 * 2
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + _align(block_m * 4, 128)
    uniform_sfb = 1 if BLOCK_K % block_n == 0 else 2
    extra = smem_cd + smem_barriers + _align(_ceil_div(k, BLOCK_K) * 4 * uniform_sfb, 8)
    stages = min((SMEM_CAPACITY_SM90 - extra) // per_stage, MAX_STAGES)
    return stages, extra + stages * per_stage


def _layout_cycles(m, n, k, groups, block_m, block_n, cluster_m, cluster_n, num_sms) -> dict:
    """SM90ArchSpec::get_layout_info: modelled L1/L2 cycles over the last wave's efficiency."""
    num_blocks = _ceil_div(m, block_m) * _ceil_div(n, block_n) * groups
    waves = _ceil_div(num_blocks, num_sms)
    l2_bw = int(min(64.0 * num_sms, 8e6 / 1.3e3))
    l1_bw = 128 * num_sms
    l2_ab = k * (block_m // cluster_n + block_n // cluster_m)
    l1_ab = k * (block_m + block_n)
    l1_tc = k * (max(64, block_m) + block_n) + block_m * block_n * 2
    cd = block_m * block_n * 2
    l2_cycles = (l2_ab + cd) * num_blocks // l2_bw
    l1_cycles = (l1_ab + l1_tc + cd) * num_blocks // l1_bw
    efficiency = np.float32(num_blocks) / np.float32(waves * num_sms)
    cycles = int(np.float32(max(l1_cycles, l2_cycles)) / efficiency)
    if cluster_m * cluster_n > 1 and waves <= 1:
        cycles = 2**63 - 1
    return {"num_blocks": num_blocks, "waves": waves, "last_wave_util": num_blocks % num_sms or num_sms,
            "cycles": cycles}


def deepgemm_config(m: int, n: int, k: int, groups: int = 1, gemm_type: str = "Normal",
                    num_sms: int = NUM_SMS_H100_SXM) -> dict:
    """The template arguments DeepGEMM's JIT picks for sm90_fp8_gemm_1d2d_impl at this shape.
    For MGroupedContiguous m is the total rows (groups * rows per group) and the heuristic sees
    expected_m = m, expected_num_groups = 1 (no psum layout), as sm90_m_grouped_..._contiguous_1d2d."""
    if gemm_type == "Normal":
        block_ms = [64, 128] + ([16] if m <= 16 else []) + ([32] if m <= 32 else []) + [256]
        heuristic_groups = groups
    elif gemm_type == "MGroupedContiguous":
        block_ms = [CONTIGUOUS_M_ALIGNMENT]
        heuristic_groups = 1
    else:
        raise ValueError(gemm_type)
    block_ns = list(range(16, 192 + 1, 16))
    candidates = []
    for cluster_m in (1, 2):
        for cluster_n in (1, 2):
            if cluster_m * cluster_n > 2 or num_sms % (cluster_m * cluster_n):
                continue
            for block_m in block_ms:
                for block_n in block_ns:
                    if block_n > BLOCK_K and (block_n % (block_n - BLOCK_K) and BLOCK_K % (block_n - BLOCK_K)):
                        continue
                    if block_m > 128 and block_n > 128:
                        continue
                    stages, smem = _pipeline(m, n, k, block_m, block_n)
                    if stages < 3 or (block_m * block_n < 128 * 192 and stages < 4):
                        continue
                    info = _layout_cycles(m, n, k, heuristic_groups, block_m, block_n, cluster_m, cluster_n, num_sms)
                    candidates.append(dict(block_m=block_m, block_n=block_n, cluster_m=cluster_m,
                                           cluster_n=cluster_n, stages=stages, smem_size=smem, **info))
    best = candidates[0]
    for c in candidates[1:]:
        if c["cycles"] < best["cycles"]:
            best = c
    block_m, block_n = best["block_m"], best["block_n"]
    math_threads = 128 if block_m <= 64 else 256
    template = {
        "kMajorSFB": "cute::UMMA::Major::K", "SHAPE_M": 0, "SHAPE_N": n, "SHAPE_K": k,
        "kNumGroups": groups, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K,
        "kSwizzleAMode": _swizzle_mode(BLOCK_K), "kSwizzleBMode": _swizzle_mode(BLOCK_K),
        "kSwizzleDMode": _swizzle_mode(block_n * 2), "kNumStages": best["stages"],
        "kNumTMAThreads": 128, "kNumMathThreads": math_threads,
        "kNumTMAMulticast": best["cluster_m"] * best["cluster_n"], "kIsTMAMulticastOnA": best["cluster_n"] > 1,
        "kNumSMs": num_sms, "kGemmType": f"GemmType::{gemm_type}", "cd_dtype_t": "cutlass::bfloat16_t",
        "epilogue_type_t": "epilogue::transform::EpilogueIdentity",
    }
    ranked = sorted(candidates, key=lambda c: c["cycles"])[:6]
    return {"template": template, "chosen": best, "smem_size": best["smem_size"],
            "threads": 128 + math_threads, "runner_up_candidates": ranked,
            "num_candidates": len(candidates)}


def deepgemm_instantiation(template: dict) -> str:
    """The kernel.cu DeepGEMM's generate_impl writes for these template arguments."""
    t = template
    args = [t["kMajorSFB"], t["SHAPE_M"], t["SHAPE_N"], t["SHAPE_K"], t["kNumGroups"],
            t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"], t["kSwizzleAMode"], t["kSwizzleBMode"],
            t["kSwizzleDMode"], t["kNumStages"], t["kNumTMAThreads"], t["kNumMathThreads"],
            t["kNumTMAMulticast"], str(t["kIsTMAMulticastOnA"]).lower(), t["kNumSMs"],
            t["kGemmType"], t["cd_dtype_t"], t["epilogue_type_t"]]
    return ("#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>\n\nusing namespace deep_gemm;\n\n"
            "static void __instantiate_kernel() {\n"
            "    auto ptr = reinterpret_cast<void*>(&sm90_fp8_gemm_1d2d_impl<\n        "
            + ",\n        ".join(str(a) for a in args) + "\n    >);\n};\n")


# ---------------------------------------------------------------- tools

def cuda_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def _toolchain_tool(name: str) -> str | None:
    """A tool from the project's Hopper toolchain (scripts/hopper_toolchain.sh), if installed."""
    try:
        tc = subprocess.run(["bash", str(REPO / "scripts" / "hopper_toolchain.sh")], capture_output=True,
                            text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return next((str(p) for p in pathlib.Path(tc).glob(f"nvidia/*/bin/{name}")), None)


def find_tool(name: str, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    candidate = cuda_home() / "bin" / name
    if candidate.exists():
        return str(candidate)
    if found := _toolchain_tool(name):
        return found
    if found := shutil.which(name):
        return found
    raise SystemExit(f"no {name}: set CUDA_HOME or --{name}")


def tool_version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    lines = [l for l in out.splitlines() if "release" in l or l.startswith("Build")]
    return " | ".join(lines) or out.strip().splitlines()[-1]


def run(cmd: list[str], cwd: pathlib.Path, log: pathlib.Path, timeout: int) -> tuple[int, str, float]:
    """Run at the lowest priority (the machine is shared); returns (rc, stdout+stderr, seconds)."""
    start = datetime.datetime.now()
    try:
        proc = subprocess.run(["nice", "-n", "19", *cmd], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    seconds = (datetime.datetime.now() - start).total_seconds()
    log.write_text(out)
    return rc, out, seconds


def git_commit(path: pathlib.Path, given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None


def split_functions(sass: str) -> dict[str, str]:
    """nvdisasm text split per kernel (".text.NAME:" sections)."""
    parts = re.split(r"^//-+ \.text\.([\w$.]+) -+$", sass, flags=re.MULTILINE)
    if len(parts) == 1:
        return {"": sass}
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def smem_from_cubin(cuobjdump: str, cubin: pathlib.Path, function: str) -> int | None:
    """Static SMEM of a function from `cuobjdump -res-usage` (DeepGEMM's is dynamic: see smem_size)."""
    out = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    current = None
    for line in out.splitlines():
        if m := re.search(r"Function (\S+):", line):
            current = m.group(1)
        if current == function and (m := re.search(r"SHARED:(\d+)", line)):
            return int(m.group(1))
    return None


def analyse(ptxas_text: str, sass_text: str, function: str | None, m_waves: int | None = None) -> dict:
    """ptxas report + whole-kernel census + main-loop census of the kernel that issues QGMMA.
    m_waves: 64-row accumulator tiles each consumer warpgroup computes per K block, when known
    from the template (sass_loops infers it otherwise)."""
    ptxas = parse_ptxas(ptxas_text)
    functions = split_functions(sass_text)
    if function is None:   # the function that issues QGMMA
        function = next((f for f, t in functions.items() if "QGMMA" in t), next(iter(functions)))
    text = functions.get(function, sass_text)
    per_fn = ptxas["functions"].get(function, {})
    return {
        "function": function,
        "registers": per_fn.get("registers", ptxas["registers"]),
        "spill_bytes": per_fn.get("spill_stores", 0) + per_fn.get("spill_loads", 0) if per_fn else ptxas["spill_bytes"],
        "stack_bytes": per_fn.get("stack"),
        "barriers": per_fn.get("barriers", ptxas["barriers"]),
        "ptxas_warnings": ptxas["warnings"],
        "sass_census": sass_census(text),
        "mainloop": mainloop_census(text, m_waves=m_waves),
    }


def reassemble(d: pathlib.Path, ptxas: str, flags: list[str], nvdisasm: str, function: str,
               m_waves: int | None, timeout: int) -> dict:
    """The PTX nvcc kept (-keep) through another ptxas, e.g. the 13.5 one Mosaic GPU uses for
    jfp8's kernels, so that a difference between the rows is not just the ptxas version."""
    ptx = sorted(p for p in d.glob("*.ptx") if not p.name.startswith("alt_"))
    if not ptx:
        return {"error": "no PTX kept"}
    cubin = d / "alt_ptxas.cubin"
    cmd = [ptxas, "-arch=sm_90a", *flags, "--verbose", str(ptx[-1]), "-o", str(cubin)]
    rc, out, seconds = run(cmd, d, d / "alt_ptxas.log", timeout)
    row = {"ptxas": f"{ptxas}: {tool_version(ptxas)}", "command": shlex.join(cmd), "built": rc == 0}
    if rc != 0:
        row["error"] = out[-2000:]
        return row
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    a = analyse(out, sass, function, m_waves=m_waves)
    main = a["mainloop"]["main"] or {}
    keep = ("instructions", "qgmma", "ffma", "fmul", "fadd", "loads", "syncs_total", "bar_total", "fences_total")
    row.update(registers=a["registers"], spill_bytes=a["spill_bytes"], barriers=a["barriers"],
               usetmaxreg=a["sass_census"]["usetmaxreg"], sass_instructions=a["sass_census"]["instructions"],
               mainloop_per_k128={k: main.get("per_k128", {}).get(k) for k in keep},
               k_per_iteration=main.get("k_per_iteration"), num_loops=a["mainloop"]["num_loops"])
    return row


# ---------------------------------------------------------------- builds

def build_deepgemm(name, m, n, k, groups, gemm_type, dg: pathlib.Path, cutlass_include: pathlib.Path,
                   work: pathlib.Path, nvcc: str, nvdisasm: str, cuobjdump: str, timeout: int,
                   alt_ptxas: str | None = None) -> dict:
    cfg = deepgemm_config(m, n, k, groups, gemm_type)
    d = work / f"deepgemm_{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cu").write_text(deepgemm_instantiation(cfg["template"]))
    cmd = [nvcc, "kernel.cu", "-cubin", "-o", "kernel.cubin", *shlex.split(DEEPGEMM_FLAGS),
           f"-I{dg / 'deep_gemm' / 'include'}", f"-I{cutlass_include}", "-keep"]   # -keep: the PTX, for --alt-ptxas
    rc, out, seconds = run(cmd, d, d / "nvcc.log", timeout)
    row = {"anchor": "deepgemm_sm90_fp8_gemm_1d2d", "shape": {"m": m, "n": n, "k": k, "groups": groups},
           "gemm_type": gemm_type, "config": cfg, "command": shlex.join(cmd), "cwd": str(d),
           "compile_seconds": round(seconds, 1), "built": rc == 0}
    if rc != 0:
        errors = [l for l in out.splitlines() if "error" in l.lower()]
        row["error"] = "\n".join(errors[:20]) or out[-4000:]
        return row
    sass = subprocess.run([nvdisasm, "-c", "kernel.cubin"], cwd=d, capture_output=True, text=True, check=True).stdout
    (d / "kernel.sass").write_text(sass)
    # Each math warpgroup runs BLOCK_M / WAVE_BLOCK_M waves of one 64-row wgmma per K block
    # (WAVE_BLOCK_M = 2 x 64 when BLOCK_M > 64), all through the same accumulator registers.
    t = cfg["template"]
    waves = t["BLOCK_M"] // (t["BLOCK_M"] if t["BLOCK_M"] <= 64 else 128)
    row.update(analyse(out, sass, None, m_waves=waves))
    if alt_ptxas:
        row["alt_ptxas"] = reassemble(d, alt_ptxas, ["--register-usage-level=10", "--warn-on-local-memory-usage"],
                                      nvdisasm, row["function"], waves, timeout)
    row["smem_bytes"] = {"dynamic_launch": cfg["smem_size"],
                         "static": smem_from_cubin(cuobjdump, d / "kernel.cubin", row["function"])}
    return row


def build_cutlass(name: str, cutlass: pathlib.Path, work: pathlib.Path, nvcc: str, nvdisasm: str,
                  cuobjdump: str, timeout: int, alt_ptxas: str | None = None,
                  extra_includes: list[pathlib.Path] = ()) -> dict:
    d = work / f"cutlass_{name}"
    d.mkdir(parents=True, exist_ok=True)
    src = cutlass / CUTLASS_EXAMPLES[name]
    cmd = [nvcc, str(src), "-c", "-o", "example67.o", *shlex.split(CUTLASS_FLAGS),
           f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}",
           f"-I{cutlass / 'examples' / 'common'}", *(f"-I{i}" for i in extra_includes), "-keep"]
    rc, out, seconds = run(cmd, d, d / "nvcc.log", timeout)
    text = src.read_text()
    config = {key: (m.group(1).strip() if (m := re.search(rf"using\s+{key}\s*=\s*([^;]+);", text)) else None)
              for key in ("TileShape", "ClusterShape", "KernelSchedule", "EpilogueSchedule", "ElementC",
                          "ElementD", "LayoutC", "ScaleConfig")}
    config.update({key: int(m.group(1)) for key in ("ScaleGranularityM", "ScaleGranularityN", "ScaleGranularityK")
                   if (m := re.search(rf"constexpr int {key}\s*=\s*(\d+);", text))})
    row = {"anchor": f"cutlass_{name}", "source": CUTLASS_EXAMPLES[name],
           "shape": "runtime (--m --n --k): one compile serves every shape",
           "config": config, "command": shlex.join(cmd), "cwd": str(d), "compile_seconds": round(seconds, 1),
           "built": rc == 0}
    if rc != 0:
        errors = [l for l in out.splitlines() if "error" in l.lower()]
        row["error"] = "\n".join(errors[:20]) or out[-4000:]
        return row
    for old in d.glob("*.cubin"):
        old.unlink()
    subprocess.run([cuobjdump, "-xelf", "all", "example67.o"], cwd=d, capture_output=True, check=True)
    cubins = sorted(d.glob("*sm_90a*.cubin"))
    sass = "\n".join(subprocess.run([nvdisasm, "-c", str(c)], capture_output=True, text=True, check=True).stdout
                     for c in cubins)
    (d / "example67.sass").write_text(sass)
    # The GEMM is the kernel that issues QGMMA. Cooperative schedule: two consumer warpgroups
    # split the tile's M, each computing TileM / 2 / 64 accumulators of 64 rows per K block.
    tile_m = int(re.search(r"_(\d+)", config["TileShape"] or "_128").group(1))
    waves = max(tile_m // 128, 1)
    row.update(analyse(out, sass, None, m_waves=waves))
    if alt_ptxas:
        row["alt_ptxas"] = reassemble(d, alt_ptxas, [], nvdisasm, row["function"], waves, timeout)
    row["kernels_in_object"] = len(sass_functions(sass))
    row["smem_bytes"] = {"static_or_dynamic_note": "CUTLASS sizes SMEM at launch (SharedStorage)",
                         "static": next((s for c in cubins if (s := smem_from_cubin(cuobjdump, c, row["function"])) is not None), None)}
    return row


def read_ours(dumps: pathlib.Path) -> dict:
    """Our forms' dumps as benchmarks/hopper_build.py --keep-dumps writes them: the three the
    issue compares (absent ones recorded as such) and any other form found there."""
    forms = {}
    others = sorted(d.name for d in dumps.glob("*") if d.is_dir()) if dumps.is_dir() else []
    texts = sorted(dumps.glob("*.txt")) if dumps.is_dir() else []
    if texts:  # hopper_build.py now keeps each form's compiler stdout (ptxas report, SASS) as FORM.txt
        for path in sorted(texts, key=lambda p: (p.stem not in ("gemm_default", "grouped_fprop", "grouped_wgrad"),
                                                 p.stem)):
            text = path.read_text()
            row = {"present": True, "dir": str(path), **analyse(text, text, None)}
            if m := re.search(r"smem_scratch_bytes=(\d+)", text):
                row["smem_bytes"] = {"scratch": int(m.group(1))}
            forms[path.stem] = row
        return forms
    for form in dict.fromkeys(["gemm_default", "grouped_fprop", "grouped_wgrad", *others]):
        d = dumps / form
        sass_files = sorted(d.glob("*.sass_ctrl")) if d.is_dir() else []
        if not sass_files:
            forms[form] = {"present": False, "dir": str(d)}
            continue
        sass = "\n".join(p.read_text() for p in sass_files)
        ptxas = "\n".join(p.read_text() for p in sorted(d.glob("*.ptxas")))
        row = {"present": True, "dir": str(d), **analyse(ptxas, sass, None)}
        res = "\n".join(p.read_text() for p in sorted(d.glob("*.resources.txt")))
        if m := re.search(r"smem_scratch_bytes=(\d+)", res):
            row["smem_bytes"] = {"scratch": int(m.group(1))}
        forms[form] = row
    return forms


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def table(result: dict) -> str:
    """The side-by-side markdown table: one row per kernel, main loop per 128-K block per
    consumer warpgroup (each of its warps issues this much), and total per 64x128x128 of MMA."""
    rows = []
    for form, r in result.get("jfp8", {}).get("forms", {}).items():
        if r.get("present"):
            rows.append((f"jfp8 {form}", r))
    for name, r in result.get("deepgemm", {}).items():
        rows.append((f"DeepGEMM 1d2d {name}" + (f" ({r['config']['template']['BLOCK_M']}x"
                     f"{r['config']['template']['BLOCK_N']}, cluster {r['config']['template']['kNumTMAMulticast']})"
                     if r.get("config") else ""), r))
    for name, r in result.get("cutlass", {}).items():
        rows.append((f"CUTLASS {name} (any shape)", r))
    head = ("| kernel | regs (launch; setmaxnreg) | spills B | QGMMA / K128 | FFMA/FMUL/FADD / K128 | "
            "loads / K128 | SYNCS / BAR / fences per K128 | instr / K128 | fewest-path instr / K128 | "
            "instr per 64x128x128 |")
    lines = [head, "|" + "---|" * 10]
    for label, r in rows:
        if not r.get("built", r.get("present", False)) or not r.get("mainloop", {}).get("main"):
            lines.append(f"| {label} | not built: {str(r.get('error', 'no main loop'))[:120]} |" + " |" * 8)
            continue
        m = r["mainloop"]["main"]
        k = m["per_k128"]
        setmax = r["sass_census"].get("usetmaxreg", {})
        regs = f"{r['registers']}; " + "/".join(f"{kind.lower()} {','.join(map(str, v))}" for kind, v in setmax.items())
        q = ", ".join(f"{shape.split('.')[0]} x{_fmt(n)}" for shape, n in k["qgmma"].items())
        loads = ", ".join(f"{op}{'' if w == '32' else '.' + w} x{_fmt(n)}" for op, ws in k["loads"].items()
                          for w, n in ws.items()) or "0"
        per_unit = m["per_64x128x128"]["instructions"] if m["per_64x128x128"] else "-"
        # the shortest way around the loop (`sass_loops`); "-": not computed (a result written
        # before the census had it) or no path through every QGMMA
        fewest = (m.get("fewest_path_per_k128") or {}).get("instructions", "-")
        lines.append(f"| {label} | {regs} | {r['spill_bytes']} | {q} | {_fmt(k['ffma'])}/{_fmt(k['fmul'])}/"
                     f"{_fmt(k['fadd'])} | {loads} | {_fmt(k['syncs_total'])} / {_fmt(k['bar_total'])} / "
                     f"{_fmt(k['fences_total'])} | {_fmt(k['instructions'])} | {_fmt(fewest)} | {_fmt(per_unit)} |")
    return "\n".join(lines)


def recensus(path: pathlib.Path) -> None:
    """Re-run the main-loop census on the SASS each anchor's build kept (`cwd`/kernel.sass or
    example67.sass, when that folder is still there) with the recorded function and m_waves, so
    that a newer census (e.g. the fewest-instruction path) covers the anchors without a rebuild.
    The static per-128-K counts must come out as recorded: otherwise the SASS is not the one the
    row was built from, and the row is left alone."""
    result = json.loads(path.read_text())
    for group in ("deepgemm", "cutlass"):
        for name, row in result.get(group, {}).items():
            sass_path = next((pathlib.Path(row.get("cwd", "")) / f for f in ("kernel.sass", "example67.sass")
                              if (pathlib.Path(row.get("cwd", "")) / f).exists()), None)
            if not row.get("built") or sass_path is None:
                print(f"{group} {name}: no kept SASS, unchanged")
                continue
            text = split_functions(sass_path.read_text()).get(row["function"])
            census = mainloop_census(text, m_waves=row["mainloop"]["main"]["m_waves"]) if text else None
            if not census or census["main"]["per_k128"] != row["mainloop"]["main"]["per_k128"]:
                print(f"{group} {name}: {sass_path} does not reproduce the recorded counts, unchanged")
                continue
            row["mainloop"] = census
            print(f"{group} {name}: re-read {sass_path}")
    result.setdefault("commands", []).append(
        "python benchmarks/hopper/anchors.py --recensus " + str(path.relative_to(REPO) if path.is_absolute() and
                                                                      path.is_relative_to(REPO) else path))
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepgemm", type=pathlib.Path, required=True, help="DeepGEMM sources (extracted)")
    p.add_argument("--cutlass", type=pathlib.Path, required=True, help="CUTLASS sources (include/, tools/util/include, examples/)")
    p.add_argument("--deepgemm-cutlass", type=pathlib.Path,
                   help="CUTLASS tree for DeepGEMM (its third-party/cutlass pin); default --cutlass")
    p.add_argument("--deepgemm-commit"), p.add_argument("--cutlass-commit"), p.add_argument("--deepgemm-cutlass-commit")
    p.add_argument("--ours", type=pathlib.Path, help="our forms' --keep-dumps folder for one target (…/h100_sxm)")
    p.add_argument("--ours-command", help="the hopper_build.py command that wrote --ours, to record")
    p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/anchors/build"))
    p.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks/results/hopper-build/anchors-h100_sxm.json")
    p.add_argument("--only", nargs="*", help="subset: deepgemm shape names, 'cutlass' (both examples) or "
                   "one example's name, 'ours'")
    p.add_argument("--include", type=pathlib.Path, action="append", default=[],
                   help="extra include folder for the CUTLASS examples: the groupwise one's host code includes "
                        "curand_kernel.h (tools/util's device tensor fills), which a CUDA without cuRAND lacks; "
                        "`pip install --no-deps --target DIR nvidia-curand` gives DIR/nvidia/cu13/include")
    p.add_argument("--nvdisasm"), p.add_argument("--cuobjdump")
    p.add_argument("--alt-ptxas", help="also assemble the anchors' PTX with this ptxas (default: the project's "
                   "Hopper toolchain's, the one jfp8's kernels go through; 'none' to skip)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per compile")
    if argv is None and "--recensus" in sys.argv:   # re-read the anchors' kept SASS (see recensus)
        path = pathlib.Path(sys.argv[sys.argv.index("--recensus") + 1])
        recensus(path)
        print(table(json.loads(path.read_text())))
        return 0
    if argv is None and "--table" in sys.argv:      # print the table of an existing result
        path = pathlib.Path(sys.argv[sys.argv.index("--table") + 1])
        print(table(json.loads(path.read_text())))
        return 0
    args = p.parse_args(argv)

    nvcc = str(cuda_home() / "bin" / "nvcc")
    ptxas = str(cuda_home() / "bin" / "ptxas")
    nvdisasm, cuobjdump = find_tool("nvdisasm", args.nvdisasm), find_tool("cuobjdump", args.cuobjdump)
    dg_cutlass = args.deepgemm_cutlass or args.cutlass
    alt_ptxas = None if args.alt_ptxas == "none" else (args.alt_ptxas or _toolchain_tool("ptxas"))
    args.work.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    want = (lambda key: not args.only or key in args.only)

    result = {
        "what": "issue 31 part 3: the anchors compiled for sm_90a without a GPU, side by side with jfp8's kernels",
        "date": datetime.date.today().isoformat(),
        # every invocation that wrote this file (--only updates part of it, keeping the rest)
        "commands": (previous.get("commands", []) if args.only else []) + [shlex.join(
            [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable,
             *sys.argv])],
        "tools": {"CUDA_HOME": str(cuda_home()), "nvcc": tool_version(nvcc), "ptxas": tool_version(ptxas),
                  "nvdisasm": f"{nvdisasm}: {tool_version(nvdisasm)}", "cuobjdump": f"{cuobjdump}: {tool_version(cuobjdump)}",
                  "alt_ptxas": f"{alt_ptxas}: {tool_version(alt_ptxas)}" if alt_ptxas else None},
        "sources": {
            "deepgemm": {"repo": "deepseek-ai/DeepGEMM", "path": str(args.deepgemm),
                         "commit": git_commit(args.deepgemm, args.deepgemm_commit)},
            "deepgemm_cutlass": {"repo": "NVIDIA/cutlass (DeepGEMM's third-party/cutlass pin)", "path": str(dg_cutlass),
                                 "commit": git_commit(dg_cutlass, args.deepgemm_cutlass_commit)},
            "cutlass": {"repo": "NVIDIA/cutlass", "path": str(args.cutlass),
                        "commit": git_commit(args.cutlass, args.cutlass_commit), "examples": CUTLASS_EXAMPLES},
        },
        "target": "h100_sxm (sm_90a, 132 SMs for DeepGEMM's heuristics)",
        "flags": {"deepgemm": DEEPGEMM_FLAGS, "cutlass": CUTLASS_FLAGS},
        "deepgemm": previous.get("deepgemm", {}),
        "cutlass": previous.get("cutlass", {}),
        "jfp8": previous.get("jfp8", {}),
        "notes": previous.get("notes", {}),
    }
    # A partial rebuild (--only) keeps the recorded sources of the parts it does not rebuild:
    # the rows it keeps were compiled from those, not from the paths given this time.
    rebuilds = {"deepgemm": any(want(s[0]) for s in SHAPES),
                "cutlass": want("cutlass") or any(want(n) for n in CUTLASS_EXAMPLES)}
    rebuilds["deepgemm_cutlass"] = rebuilds["deepgemm"]
    for part, rebuilt in rebuilds.items():
        if args.only and not rebuilt and part in previous.get("sources", {}):
            result["sources"][part] = previous["sources"][part]
    for name, m, n, k, groups, gemm_type in SHAPES:
        if want(name):
            print(f"DeepGEMM {name} ...", flush=True)
            result["deepgemm"][name] = build_deepgemm(name, m, n, k, groups, gemm_type, args.deepgemm,
                                                      dg_cutlass / "include", args.work, nvcc, nvdisasm,
                                                      cuobjdump, args.timeout, alt_ptxas)
            print(f"  built={result['deepgemm'][name]['built']}", flush=True)
    for name in CUTLASS_EXAMPLES:
        if want("cutlass") or want(name):
            print(f"CUTLASS {name} ...", flush=True)
            result["cutlass"][name] = build_cutlass(name, args.cutlass, args.work, nvcc, nvdisasm, cuobjdump,
                                                    args.timeout, alt_ptxas, args.include)
            print(f"  built={result['cutlass'][name]['built']}", flush=True)
    if want("ours") and args.ours:
        git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()
        result["jfp8"] = {"dumps": str(args.ours), "forms": read_ours(args.ours),
                          "commit": git("rev-parse", "HEAD"),
                          "uncommitted_kernel_edits": git("status", "--short", "pallas_kernels", "jfp8").splitlines(),
                          "how": args.ours_command or "benchmarks/hopper_build.py --target h100_sxm --keep-dumps DIR "
                                 "(Mosaic GPU's ptxas/nvdisasm dumps), read by the same census"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

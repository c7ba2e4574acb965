"""A step-time model without a GPU: each preset's FP8 and BF16 train step, compiled deviceless for
an H100, priced op by op at the H100 rates measured so far.

    python benchmarks/step_model.py --presets tiny small              # compile, price, write JSON
    python benchmarks/step_model.py --presets gpu --keep-hlo          # + keep the optimized HLO (gz)
    python benchmarks/step_model.py --from-hlo benchmarks/results/step-model/hlo   # re-price the committed HLO
    python benchmarks/step_model.py --from-hlo D --compile bf16 --keep-hlo D      # compile BF16 anew, re-price FP8
    python benchmarks/step_model.py --table                           # the committed JSONs as markdown
    python benchmarks/step_model.py --presets wide --measured R.json  # fill the measured columns from a
                                                                      # bench_step.py record (--profile)

The step compiles as `hopper_train_build.py` compiles it (same toolchain, same abstract arguments,
one fresh process per precision). The optimized HLO (`compiled.as_text()`) is then walked op by op
from the entry computation (while bodies times their known trip count):

- Mosaic GPU custom calls (`mosaic_gpu_v2`), whose insides XLA's cost analysis cannot see, are
  recognised by their operand and result types: FP8 GEMMs (dense: fprop/dgrad, or Wgrad with an
  FP32 result; grouped, with int32 group operands) count 2·M·N·K FLOPs, K the FP8 operand's last
  dimension (the padded width the kernel runs over); quantizers (float in, E4M3 + scales out; E4M3 in
  and out for the Wgrad retile) count the bytes they read and write.
- XLA's own GEMMs (Triton GEMM fusions, cuBLAS calls, any fusion holding a `dot`) count
  2·(result elements)·(contracted elements) FLOPs.
- Every other fusion, copy, transpose, sort, collective counts operand + result bytes.

Each op is priced max(compute, memory) + a launch overhead with `H100_RATES` (each rate with the row
of docs/gpu.md it was measured in); GEMMs on a wave-quantized tile count (132 SMs, 128×128 tiles),
calibrated at the shape the rate was measured at. The sums per category and the total are
predictions of this model, not measurements: the JSON and table carry a "measured" column that GPU
runs fill. Writes `--out`/<preset>-<target>.json (default benchmarks/results/step-model/).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import gzip
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from provenance import commit_info  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "step-model"
PRECISIONS = ("fp8", "bf16")
MEASURED_NOT = "not measured"

# ------------------------------------------------------------------------------ rates


@dataclasses.dataclass(frozen=True)
class Rate:
    """One measured (or assumed) rate and where it comes from."""

    value: float
    unit: str
    source: str


@dataclasses.dataclass(frozen=True)
class GemmRate:
    """A GEMM's TFLOP/s measured at one (M, N, K): the wave model is calibrated there."""

    tflops: float
    shape: tuple[int, int, int]
    source: str


@dataclasses.dataclass(frozen=True)
class Rates:
    """The device rates the model prices ops with. Every number names its measurement."""

    device: str
    sms: int
    tile: tuple[int, int]  # the GEMM output tile the wave model counts
    fp8_dense: GemmRate
    fp8_grouped: GemmRate
    bf16_gemm: GemmRate
    bf16_grouped: GemmRate  # jax's BF16 ragged dots (not timed yet: the bf16 einsum's rate stands in)
    copy: Rate  # GB/s counting bytes read and written
    # quantizer kind -> ((elements of the measured tensor, GB/s), ...), bytes read + written
    quantizers: tuple[tuple[str, tuple[tuple[int, float], ...]], ...]
    launch: Rate  # seconds per kernel launch, added to every op
    quantizer_source: str
    # cuDNN's fused attention, TFLOP/s of the FLOPs it computes (causal: the half of the T x T
    # products it does not mask). Not measured on our GPU yet.
    attention: Rate = Rate(400.0, "TFLOP/s", "assumed, not measured: cuDNN 9 fused attention forward on an "
                           "H100, bf16, causal (published FlashAttention-3/cuDNN forward rows at head dim 128 "
                           "are 400-650)")
    attention_backward: Rate = Rate(280.0, "TFLOP/s", "assumed, not measured: 0.7x the forward's rate "
                                    "(flash attention's backward runs at about 0.6-0.8x its forward)")

    def quantizer_gbs(self, kind: str, elements: int) -> float:
        """The measured rate of `kind` at the measured tensor size nearest `elements` (log scale)."""
        points = dict(self.quantizers)[kind]
        return min(points, key=lambda p: abs(math.log(max(elements, 1) / p[0])))[1]


_GPU_MD = "docs/gpu.md, Benchmark results, H100 80GB HBM3, 2026-11-26"
_Q_SIZES = (8192 * 8192, 4096 * 7168, 7168 * 2048)  # the quantizer table's three columns
H100_RATES = Rates(
    device="NVIDIA H100 80GB HBM3",
    sms=132,
    tile=(128, 128),
    fp8_dense=GemmRate(1013.0, (8192, 8192, 8192), f"{_GPU_MD}: jfp8 dense GEMM at 8192^3 (call 2)"),
    fp8_grouped=GemmRate(966.0, (8 * 4096, 4096, 7168),
                         f"{_GPU_MD}: jfp8 grouped Fprop, 8 x 4096 rows, N 4096, K 7168"),
    bf16_gemm=GemmRate(691.0, (8192, 8192, 8192), f"{_GPU_MD}: XLA bf16 jnp.dot at 8192^3 (604-714 over the shapes)"),
    bf16_grouped=GemmRate(646.0, (8 * 4096, 4096, 7168),
                          f"{_GPU_MD}: bf16 einsum, 8 x 4096 rows, N 4096, K 7168 (the grouped table's baseline)"),
    copy=Rate(2939.0, "GB/s", f"{_GPU_MD}: copy bandwidth measured beside the quantizers (call 1)"),
    quantizers=(
        ("tile", tuple(zip(_Q_SIZES, (2104.0, 1018.0, 882.0)))),
        ("grad", tuple(zip(_Q_SIZES, (1330.0, 914.0, 1029.0)))),
        ("block-t", tuple(zip(_Q_SIZES, (1527.0, 1203.0, 1049.0)))),
        ("retile", tuple(zip(_Q_SIZES, (1300.0, 838.0, 342.0)))),
    ),
    launch=Rate(3e-6, "s", "assumed, not measured: one kernel launch and its tail on an H100"),
    quantizer_source=f"{_GPU_MD}: quantizer table (call 1), the column nearest the tensor's size",
)

# The H200 (the kind of GPU the device tool lends since 2026-11-28): no jfp8 rate has been measured
# on one. It is the H100 SXM's die (132 SMs, the same clocks and tensor cores) with HBM3e at
# 4.8 TB/s against HBM3's 3.35 TB/s (NVIDIA's data sheets), so its rates are assumed from the
# H100's: GEMMs and attention (compute-bound at these shapes) unchanged; copies and the
# quantizers, which the model prices as bandwidth-bound, scaled by 4.8 / 3.35. Whether the
# quantizers scale is itself open (their H100 rates may be bound by occupancy, not HBM: see
# docs/gpu.md), so the H200 record also prices them at the H100's GB/s (`with_h100_quantizers`).
HBM_RATIO_H200 = 4.8 / 3.35
_H200_ASSUMED = "assumed, not measured (no H200 has run jfp8): the H100's rate"


def _h200_rates(h100: Rates) -> Rates:
    gemm = lambda r: dataclasses.replace(  # noqa: E731
        r, source=f"{_H200_ASSUMED}, unchanged (same SMs, clocks and tensor cores): {r.source}")
    scaled = f"x {HBM_RATIO_H200:.3f} (HBM3e 4.8 TB/s against 3.35)"
    return dataclasses.replace(
        h100, device="NVIDIA H200 141GB HBM3e",
        fp8_dense=gemm(h100.fp8_dense), fp8_grouped=gemm(h100.fp8_grouped),
        bf16_gemm=gemm(h100.bf16_gemm), bf16_grouped=gemm(h100.bf16_grouped),
        copy=Rate(h100.copy.value * HBM_RATIO_H200, h100.copy.unit, f"{_H200_ASSUMED} {scaled}: {h100.copy.source}"),
        quantizers=tuple((kind, tuple((n, gbs * HBM_RATIO_H200) for n, gbs in points))
                         for kind, points in h100.quantizers),
        quantizer_source=f"{_H200_ASSUMED}s {scaled}: {h100.quantizer_source}",
        launch=Rate(h100.launch.value, h100.launch.unit, f"{_H200_ASSUMED}, unchanged: {h100.launch.source}"),
        attention=Rate(h100.attention.value, h100.attention.unit, f"{_H200_ASSUMED}, unchanged: {h100.attention.source}"),
        attention_backward=Rate(h100.attention_backward.value, h100.attention_backward.unit,
                                f"{_H200_ASSUMED}, unchanged: {h100.attention_backward.source}"),
    )


H200_RATES = _h200_rates(H100_RATES)
# The rates each deviceless target is priced at (`--target`).
TARGET_RATES = {"h100_sxm": H100_RATES, "h200": H200_RATES}

# ------------------------------------------------------------------------------ HLO text -> instructions

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e8m0fnu": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.elements * _DTYPE_BYTES.get(self.dtype, 4)


def arrays(shape: str) -> tuple[Array, ...]:
    """The arrays of an HLO shape string ('bf16[2,3]{1,0}' or a tuple of them), in order."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    return tuple(Array(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)
                 if d in _DTYPE_BYTES)


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: its result shape, opcode, operand names and the rest of its line."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    args: str = ""  # the text inside the opcode's parentheses (a parameter's index)
    root: bool = False


def _close(text: str, start: int) -> int:
    """The index just past the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == '"':  # skip strings (they may hold brackets)
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
    raise ValueError(f"unbalanced brackets in {text[start:start + 200]!r}")


_INSTR = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")


def parse_instr(line: str) -> Instr | None:
    """An instruction line of HLO text, or None for any other line."""
    m = _INSTR.match(line)
    if not m:
        return None
    i = m.end()
    if line[i] == "(":
        j = _close(line, i)
    else:
        j = line.index(" ", i)
    shape = line[i:j]
    k = line.index("(", j)
    opcode = line[j:k].strip()
    end = _close(line, k)
    operands = tuple(re.findall(r"%([\w.\-]+)", line[k:end]))
    return Instr(m.group(1), shape, opcode, operands, line[end:], line[k + 1:end - 1], "ROOT " in line[:m.end()])


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    shapes: dict[str, str]  # every instruction's name -> its result shape


def parse_module(text: str) -> Module:
    """The computations of an optimized HLO module's text."""
    computations: dict[str, list[Instr]] = {}
    shapes: dict[str, str] = {}
    entry, current = None, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(" "):
            current = h.group(2)
            computations[current] = []
            if h.group(1):
                entry = current
            continue
        if current is None:
            continue
        instr = parse_instr(line)
        if instr is not None:
            computations[current].append(instr)
            shapes[instr.name] = instr.shape
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry, shapes)


def strip_payloads(text: str) -> str:
    """HLO text without the Mosaic kernels' serialized modules and without metadata: what the model
    reads, a few percent of the size."""
    text = re.sub(r"backend_config=\{kernel_hash = .*$", "backend_config={}", text, flags=re.M)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


# ------------------------------------------------------------------------------ instructions -> ops


@dataclasses.dataclass(frozen=True)
class Op:
    """One kernel of the step as the model sees it."""

    category: str
    name: str
    flops: float = 0.0
    bytes: int = 0
    gemm: tuple | None = None  # (M, N, K) or (groups, M, N, K)
    elements: int = 0  # a quantizer's input elements (picks the measured rate)
    count: float = 1.0  # times it runs (a while body's trip count)
    loop: str = ""  # the outermost while loop it runs in, if any


# The table's rows, in order: (category, what it holds).
CATEGORIES = (
    ("fp8 gemm: dense", "Mosaic FP8 GEMM, Fprop/Dgrad (1x128 x 128x128 scales)"),
    ("fp8 gemm: dense wgrad", "Mosaic FP8 GEMM contracting tokens, FP32 out"),
    ("fp8 gemm: grouped", "Mosaic FP8 grouped (MoE) GEMM, Fprop/Dgrad"),
    ("fp8 gemm: grouped wgrad", "Mosaic FP8 grouped Wgrad, one FP32 result per expert"),
    ("bf16 gemm: grouped", "jax's Mosaic BF16 ragged dots (the BF16 experts on Hopper), Fprop/Dgrad"),
    ("bf16 gemm: grouped wgrad", "jax's Mosaic BF16 transposed ragged dot, one result per expert"),
    ("quantize: 1x128", "activation to E4M3 + 1x128 scales"),
    ("quantize: both orientations", "1x128 and 128x1 (tokens) in one pass: dy, or x for Wgrad"),
    ("quantize: weight 128x128", "FP32 master weight to 128x128 blocks (+ transposed copy)"),
    ("quantize: retile", "cached E4M3 x re-tiled for Wgrad (dequantize, transpose, requantize)"),
    ("mosaic: other", "a Mosaic kernel the classifier does not know"),
    ("xla gemm (bf16)", "XLA dots: Triton GEMM fusions, cuBLAS calls"),
    ("attention: cudnn forward", "cuDNN's fused (flash) attention, forward (jfp8.attention)"),
    ("attention: cudnn backward", "cuDNN's fused attention, backward: dq, dk, dv"),
    ("xla fusion: triton", "XLA's Triton-emitted fusions (softmax-like, normalizations)"),
    ("xla transpose/copy", "copies and transposes, fused or not"),
    ("xla cast", "fusions that only convert dtypes"),
    ("xla reduction", "XLA input (reduction) fusions"),
    ("xla elementwise", "XLA loop fusions and unfused elementwise ops"),
    ("xla sort/gather/scatter", "MoE dispatch: argsort, gathers, scatters, dynamic slices"),
    ("collective", "all-to-all, all-reduce, all-gather, ... (none on one device)"),
    ("other", "custom calls and ops not named above"),
)
CATEGORY_NAMES = tuple(c for c, _ in CATEGORIES)

_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "copy-done", "all-to-all-done", "all-reduce-done",
         "all-gather-done", "collective-permute-done", "async-done", "async-update", "send-done", "recv-done",
         "fusion-done", "domain", "get-dimension-size"}
_COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "ragged-all-to-all", "send", "recv")
_FP8 = ("f8e4m3fn", "f8e5m2", "f8e4m3")


def _io_bytes(instr: Instr, module: Module) -> int:
    ins = sum(a.bytes for o in instr.operands for a in arrays(module.shapes.get(o, "")))
    return ins + sum(a.bytes for a in arrays(instr.shape))


_SLICING = ("dynamic-slice", "slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")


def fusion_bytes(instr: Instr, body: list[Instr], module: Module) -> int:
    """Bytes a fusion reads and writes: an operand only sliced or gathered inside counts the
    slices, a buffer updated in place (dynamic-update-slice, scatter) counts only its update."""
    if not body:
        return _io_bytes(instr, module)
    users = collections.defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)
    by_name = {i.name: i for i in body}
    total = 0
    for p in (i for i in body if i.opcode == "parameter"):
        index = int(p.args.strip())
        full = sum(a.bytes for a in arrays(module.shapes.get(instr.operands[index], ""))) \
            if index < len(instr.operands) else 0
        us = users[p.name]
        if us and all(u.opcode in _SLICING and u.operands[0] == p.name for u in us):
            total += sum(sum(a.bytes for a in arrays(u.shape)) for u in us)
        elif us and all(u.opcode in _IN_PLACE and u.operands[0] == p.name for u in us):
            pass  # the buffer stays where it is; the update is counted as written below
        else:
            total += full
    root = next((i for i in body if i.root), body[-1])
    outs = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    for out in outs:
        if out is None:
            continue
        if out.opcode in _IN_PLACE:
            update = out.operands[1] if out.opcode == "dynamic-update-slice" else out.operands[-1]
            shape = by_name[update].shape if update in by_name else module.shapes.get(update, "")
            total += sum(a.bytes for a in arrays(shape))
        else:
            total += sum(a.bytes for a in arrays(out.shape))
    return total


def _mosaic_operands(instr: Instr, module: Module) -> tuple[Array, ...]:
    """A Mosaic custom call's operand types: its layout constraints, else the symbol table."""
    key = "operand_layout_constraints="
    i = instr.attrs.find(key)
    if i >= 0:
        start = i + len(key)
        return arrays(instr.attrs[start:_close(instr.attrs, start)])
    return tuple(a for o in instr.operands for a in arrays(module.shapes.get(o, "")))


def classify_mosaic(instr: Instr, module: Module) -> Op:
    """A Mosaic GPU kernel from its operand and result types."""
    ins, outs = _mosaic_operands(instr, module), arrays(instr.shape)
    nbytes = sum(a.bytes for a in ins) + sum(a.bytes for a in outs)
    fp8_in = [a for a in ins if a.dtype in _FP8]
    float_in = [a for a in ins if a.dtype in ("bf16", "f16", "f32")]
    fp8_out = [a for a in outs if a.dtype in _FP8]
    grouped = any(a.dtype == "s32" for a in ins)
    if len(fp8_in) >= 2 and not fp8_out:  # a GEMM: A [M, K] (or [M', tokens]) and B
        out = outs[0]
        k = fp8_in[0].dims[-1]
        if grouped and len(out.dims) == 3:  # Wgrad: one [M', N'] per expert, K the routed rows
            g, m, n = out.dims
            return Op("fp8 gemm: grouped wgrad", instr.name, 2.0 * m * n * k, nbytes, (g, m, n, k))
        m, n = math.prod(out.dims[:-1]), out.dims[-1]
        if grouped:
            g = fp8_in[1].dims[0] if len(fp8_in[1].dims) == 3 else 1
            return Op("fp8 gemm: grouped", instr.name, 2.0 * m * n * k, nbytes, (g, m, n, k))
        wgrad = out.dtype == "f32"
        return Op("fp8 gemm: dense wgrad" if wgrad else "fp8 gemm: dense", instr.name, 2.0 * m * n * k, nbytes,
                  (m, n, k))
    if grouped and len(float_in) >= 2 and not fp8_in and not fp8_out:  # jax's BF16 ragged dots
        lhs, rhs, out = float_in[0], float_in[1], outs[0]
        if len(out.dims) == 3:  # transposed: x [T, K], dy [T, N] -> [G, K, N]
            g, m, n = out.dims
            return Op("bf16 gemm: grouped wgrad", instr.name, 2.0 * m * n * lhs.dims[0], nbytes, (g, m, n, lhs.dims[0]))
        m, n, k = out.dims[0], out.dims[-1], lhs.dims[-1]
        return Op("bf16 gemm: grouped", instr.name, 2.0 * m * n * k, nbytes, (rhs.dims[0], m, n, k))
    if fp8_out and fp8_in:  # E4M3 + scales in and out: the cached x re-tiled for Wgrad
        return Op("quantize: retile", instr.name, 0.0, nbytes, elements=fp8_in[0].elements)
    if fp8_out and float_in:  # a quantizer: float in, E4M3 + scales out
        x = float_in[0]
        if x.dtype == "f32" and any(len(a.dims) == 3 for a in fp8_out):
            kind = "quantize: weight 128x128"
        elif len(fp8_out) >= 2:
            kind = "quantize: both orientations"
        else:
            kind = "quantize: 1x128"
        return Op(kind, instr.name, 0.0, nbytes, elements=x.elements)
    return Op("mosaic: other", instr.name, 0.0, nbytes)


def dot_flops(dot: Instr, module: Module) -> tuple[float, tuple]:
    """(2 * result elements * contracted elements, (M, N, K) flattened) of a `dot` instruction."""
    lhs = arrays(module.shapes[dot.operands[0]])[0]
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attrs)
    contracted = [int(d) for d in m.group(1).split(",") if d] if m else [len(lhs.dims) - 1]
    k = math.prod(lhs.dims[d] for d in contracted)
    out = arrays(dot.shape)[0]
    b = re.search(r"lhs_batch_dims=\{([\d,]*)\}", dot.attrs)
    batch = math.prod(lhs.dims[int(d)] for d in b.group(1).split(",") if d) if b else 1
    rest = out.elements // max(batch, 1)
    n = out.dims[-1] if out.dims else 1
    return 2.0 * out.elements * k, (batch, rest // max(n, 1), n, k)


def _cublas_flops(instr: Instr, module: Module) -> tuple[float, tuple]:
    lhs = arrays(module.shapes[instr.operands[0]])[0]
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    dims = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')] if m else [len(lhs.dims) - 1]
    k = math.prod(lhs.dims[d] for d in dims)
    out = arrays(instr.shape)[0]
    return 2.0 * out.elements * k, (1, out.elements // out.dims[-1], out.dims[-1], k)


def cudnn_attention_flops(instr: Instr, target: str) -> float:
    """FLOPs of one cuDNN fused-attention call from its q, k, v operands ([B, T, H, D] in
    `operand_layout_constraints`): the forward's QKᵀ and PV; the backward's QKᵀ again, dP = dO·Vᵀ,
    dV = Pᵀ·dO, dQ = dS·K and dK = dSᵀ·Q. A causal mask halves the T×T products (the blocks
    above the diagonal are skipped)."""
    key = "operand_layout_constraints="
    start = instr.attrs.index(key) + len(key)
    q, _, v = arrays(instr.attrs[start:_close(instr.attrs, start)])[:3]
    b, t, h, dqk = q.dims
    dv = v.dims[-1]
    pairs = b * h * t * t * (0.5 if '"CAUSAL"' in instr.attrs else 1.0)
    per_pair = (3 * dqk + 2 * dv) if "Backward" in target else (dqk + dv)
    return 2.0 * pairs * per_pair


def _fusion_category(instr: Instr, body: list[Instr]) -> str:
    ops = collections.Counter(i.opcode for i in body)
    real = {o for o in ops if o not in ("parameter", "bitcast", "tuple", "get-tuple-element", "constant",
                                        "broadcast", "reshape")}
    if real & {"sort", "gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
        return "xla sort/gather/scatter"
    if '"kind":"__triton"' in instr.attrs:
        return "xla fusion: triton"
    if real <= {"convert"} and real:
        return "xla cast"
    if real <= {"transpose", "copy", "convert", "slice", "concatenate", "pad"} and real & {"transpose", "copy"}:
        return "xla transpose/copy"
    if "kind=kInput" in instr.attrs or "reduce" in real:
        return "xla reduction"
    return "xla elementwise"


def _called(instr: Instr, key: str) -> list[str]:
    m = re.search(key + r"=\{?%?([\w.\-]+(?:, %[\w.\-]+)*)\}?", instr.attrs)
    return [c.lstrip("%") for c in m.group(1).split(", ")] if m else []


def classify(instr: Instr, module: Module) -> Op | None:
    """The op one top-level instruction runs, or None for the free ones (bitcasts, tuples, ...).
    While loops, calls and conditionals are walked by `step_ops`."""
    op = instr.opcode
    if op in _FREE:
        return None
    nbytes = _io_bytes(instr, module)
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
        target = target.group(1) if target else ""
        if target.startswith("mosaic_gpu"):
            return classify_mosaic(instr, module)
        if "gemm" in target or "matmul" in target.lower():
            flops, mnk = _cublas_flops(instr, module)
            return Op("xla gemm (bf16)", instr.name, flops, nbytes, mnk)
        if "sort" in target.lower():
            return Op("xla sort/gather/scatter", instr.name, 0.0, nbytes)
        if target.startswith("__cudnn$fmha"):
            kind = "backward" if "Backward" in target else "forward"
            return Op(f"attention: cudnn {kind}", instr.name, cudnn_attention_flops(instr, target), nbytes)
        return Op("other", instr.name, 0.0, nbytes)
    if op in ("fusion", "fusion-start"):
        body = module.computations.get(_called(instr, "calls")[0], []) if _called(instr, "calls") else []
        nbytes = fusion_bytes(instr, body, module)
        dots = [i for i in body if i.opcode in ("dot", "scaled-dot")]
        if dots:
            flops, mnk = 0.0, None
            for d in dots:
                f, shape = dot_flops(d, module)
                flops, mnk = flops + f, mnk or shape
            return Op("xla gemm (bf16)", instr.name, flops, nbytes, mnk)
        return Op(_fusion_category(instr, body), instr.name, 0.0, nbytes)
    if op in ("dot", "convolution"):
        flops, mnk = dot_flops(instr, module)
        return Op("xla gemm (bf16)", instr.name, flops, nbytes, mnk)
    if op.startswith(_COLLECTIVES):
        return Op("collective", instr.name, 0.0, nbytes)
    if op in ("copy", "copy-start", "transpose"):
        return Op("xla transpose/copy", instr.name, 0.0, nbytes)
    if op == "convert":
        return Op("xla cast", instr.name, 0.0, nbytes)
    if op in ("sort", "gather", "scatter", "dynamic-slice", "dynamic-update-slice"):
        return Op("xla sort/gather/scatter", instr.name, 0.0, nbytes)
    if op in ("reduce", "reduce-window"):
        return Op("xla reduction", instr.name, 0.0, nbytes)
    return Op("xla elementwise", instr.name, 0.0, nbytes)


def trip_count(instr: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else None


def step_ops(module: Module, computation: str | None = None, times: float = 1.0, loop: str = "") -> list[Op]:
    """Every kernel the computation (default: the entry) launches, while bodies repeated by their
    known trip count (once when it is unknown)."""
    ops = []
    for instr in module.computations[computation or module.entry]:
        if instr.opcode == "while":
            n = trip_count(instr) or 1
            for part, mult in (("body", n), ("condition", n + 1)):
                for c in _called(instr, part):
                    ops += step_ops(module, c, times * mult, loop or instr.name)
            continue
        if instr.opcode in ("call", "async-start"):
            for c in _called(instr, "to_apply") + _called(instr, "calls"):
                ops += step_ops(module, c, times, loop)
            continue
        if instr.opcode == "conditional":  # the costliest branch, as an upper bound
            branches = [step_ops(module, c, times, loop) for c in _called(instr, "branch_computations")]
            ops += max(branches, key=lambda b: sum(o.bytes + o.flops for o in b), default=[])
            continue
        op = classify(instr, module)
        if op is not None:
            ops.append(dataclasses.replace(op, count=times, loop=loop))
    return ops


def gemm_loops(ops: list[Op], rates: Rates = H100_RATES) -> dict[str, dict]:
    """The while loops that run GEMMs one tile at a time (BF16's grouped GEMM where jax's ragged
    kernels do not take the shapes: `jfp8.reference.ragged_dot_reference`,
    is a scan over (row tile, expert) work items): per loop, its GEMM FLOPs, launches, seconds."""
    loops = collections.defaultdict(lambda: {"flops": 0.0, "kernels": 0.0, "seconds": 0.0})
    for op in ops:
        if op.loop:
            r = loops[op.loop]
            r["flops"] += op.flops * op.count
            r["kernels"] += op.count
            r["seconds"] += op_seconds(op, rates) * op.count
    return {name: r for name, r in loops.items() if r["flops"]}


# ------------------------------------------------------------------------------ ops -> seconds


def gemm_seconds(gemm: tuple, rate: GemmRate, rates: Rates) -> float:
    """Wave-quantized GEMM time: ceil(tiles / SMs) waves, each as long as one output tile's K loop,
    at the per-wave speed that gives `rate` at the shape it was measured at."""
    def waves_work(groups, m, n, k):  # (waves, the work the machine is busy for, in tile-K units)
        tm, tn = rates.tile
        tiles = groups * math.ceil(m / tm) * math.ceil(n / tn)
        return math.ceil(tiles / rates.sms) * k

    if len(gemm) == 3:
        gemm = (1, *gemm)
    g, m, n, k = gemm
    cm, cn, ck = rate.shape
    calib = waves_work(1, cm, cn, ck)
    seconds_per_unit = 2.0 * cm * cn * ck / (rate.tflops * 1e12) / calib
    return waves_work(g, m, n, k) * seconds_per_unit


def _gemm_compute(op: Op, rates: Rates) -> float:
    """A GEMM op's compute seconds (no launch, no memory bound): wave-quantized at its rate."""
    c = op.category
    rate = rates.bf16_gemm if c == "xla gemm (bf16)" else (
        rates.bf16_grouped if c.startswith("bf16") else rates.fp8_grouped if "grouped" in c else rates.fp8_dense)
    g = op.gemm
    if c.endswith("grouped wgrad"):  # one [M', N'] per expert over its share of the rows
        groups, m, n, k = g
        g = (groups, m, n, max(1, k // groups))
    elif c.endswith("grouped"):  # the rows split into `groups` tiles' worth: half a tile each
        groups, m, n, k = g
        g = (1, m + groups * rates.tile[0] // 2, n, k)
    if g is None and op.name.endswith("as one grouped GEMM"):
        rate = rates.bf16_grouped
    return gemm_seconds(g, rate, rates) if g else op.flops / (rate.tflops * 1e12)


def op_seconds(op: Op, rates: Rates = H100_RATES) -> float:
    """One launch of `op`: max(compute, memory) + a launch."""
    memory = op.bytes / (rates.copy.value * 1e9)
    compute = 0.0
    c = op.category
    if c.startswith(("fp8 gemm", "bf16 gemm")) or c == "xla gemm (bf16)":
        compute = _gemm_compute(op, rates)
    elif c.startswith("attention: cudnn"):
        rate = rates.attention_backward if c.endswith("backward") else rates.attention
        compute = op.flops / (rate.value * 1e12)
    elif c.startswith("quantize"):
        kind = {"quantize: 1x128": "tile", "quantize: both orientations": "grad",
                "quantize: weight 128x128": "block-t", "quantize: retile": "retile"}[c]
        memory = op.bytes / (rates.quantizer_gbs(kind, op.elements) * 1e9)
    return max(compute, memory) + rates.launch.value


def summarize(ops: list[Op], rates: Rates = H100_RATES) -> dict:
    """Per category: kernels launched, FLOPs, bytes and predicted seconds; and the total."""
    rows = {c: {"kernels": 0.0, "flops": 0.0, "bytes": 0.0, "seconds": 0.0} for c in CATEGORY_NAMES}
    for op in ops:
        r = rows[op.category]
        r["kernels"] += op.count
        r["flops"] += op.flops * op.count
        r["bytes"] += op.bytes * op.count
        r["seconds"] += op_seconds(op, rates) * op.count
    total = {k: sum(r[k] for r in rows.values()) for k in ("kernels", "flops", "bytes", "seconds")}
    return {"categories": {c: r for c, r in rows.items() if r["kernels"]}, "total": total}


def quantization_cuts(ops: list[Op], rates: Rates = H100_RATES) -> list[dict]:
    """Every quantizer launch (each place a tensor is cut to E4M3), grouped by (kind, shape):
    the bytes and predicted time a later fusion or removal of that cut would save."""
    by = collections.defaultdict(lambda: {"launches": 0.0, "bytes": 0.0, "seconds": 0.0})
    for op in ops:
        if op.category.startswith("quantize"):
            key = (op.category, op.elements, op.bytes)
            by[key]["launches"] += op.count
            by[key]["bytes"] += op.bytes * op.count
            by[key]["seconds"] += op_seconds(op, rates) * op.count
    return [{"kind": k[0], "input_elements": k[1], "bytes_per_launch": k[2], **v}
            for k, v in sorted(by.items(), key=lambda kv: -kv[1]["seconds"])]


def as_grouped_gemm(ops: list[Op], rates: Rates = H100_RATES) -> list[Op]:
    """What if every GEMM tile loop were one grouped GEMM: each loop's ops replaced by one launch
    with the loop's GEMM FLOPs at the measured BF16 grouped rate (`rates.bf16_grouped`)."""
    loops = gemm_loops(ops, rates)
    kept = [op for op in ops if op.loop not in loops]
    for name, r in loops.items():
        kept.append(Op("xla gemm (bf16)", f"{name} as one grouped GEMM", r["flops"], 0, None))
    return kept


# The goal for the quantizers (issue 43): this fraction of copy bandwidth at the step's shapes.
QUANTIZER_GOAL = 0.7


def quantizers_at(rates: Rates, fraction: float) -> Rates:
    """`rates` with every quantizer at `fraction` of copy bandwidth, at every size (a what-if)."""
    speed = fraction * rates.copy.value
    return dataclasses.replace(rates, quantizers=tuple(
        (kind, tuple((size, speed) for size, _ in points)) for kind, points in rates.quantizers))


def weights_from_the_update(ops: list[Op], rates: Rates = H100_RATES) -> float:
    """What-if, in seconds: the optimizer's update writes the next step's weights as it writes the
    FP32 masters, so that no kernel reads the masters again to make them. FP8: each weight quantizer
    (128×128 blocks of an f32 master, both orientations) costs only its writes, at copy bandwidth,
    with no launch of its own (a fused update + quantize kernel: a 128×128 f32 block is 64 KB, one
    CTA's tile). BF16, the same for its casts: every cast fusion is priced as its writes alone, a
    third of its bytes (an f32 → bf16 cast reads 4 and writes 2 bytes an element), an upper bound
    on BF16's own gain where some casts are not of weights."""
    return priced(ops, rates, update=True)


# The FP8 GEMMs whose config the tuning rule picks: dense Fprop/Dgrad and Wgrad, grouped
# Fprop/Dgrad (`grouped_rule_config`; the grouped Wgrad runs its own default).
RULE_CATEGORIES = ("fp8 gemm: dense", "fp8 gemm: dense wgrad", "fp8 gemm: grouped")


def rule_factor(op: Op, rates: Rates = H100_RATES) -> float:
    """How much faster the tuning rule's config for an FP8 GEMM (`RULE_CATEGORIES`) is than the
    128×128 tile the rates were measured with, by the rule's own cost model
    (`pallas_kernels.tuning.modelled`: MMA cycles, L2 bytes, full waves; not measured): modelled
    cycles of 128×128 over the pick's. Fprop/Dgrad have a bf16 result and a block-scaled b, Wgrad
    an f32 result and a tile-scaled b; a grouped GEMM's rows are all its groups' (the model adds a
    row tile per group boundary)."""
    return _rule_factor(op.category, op.gemm, rates.sms, rates.tile)


@functools.cache
def _rule_factor(category: str, gemm: tuple, sms: int, tile: tuple) -> float:
    import jax.numpy as jnp

    from pallas_kernels import tuning

    groups, (m, n, k) = (gemm[0], gemm[1:]) if len(gemm) == 4 else (1, gemm)
    wgrad = category == "fp8 gemm: dense wgrad"
    out_dtype, scalar_b = (jnp.float32, False) if wgrad else (jnp.bfloat16, True)
    if category == "fp8 gemm: grouped":
        pick = tuning.grouped_rule_config(m, n, k, out_dtype, sms, groups=groups)
    else:
        pick = tuning.rule_config(m, n, k, out_dtype, sms, scalar_b=scalar_b)

    def cycles(c):
        return tuning.modelled(c, m, n, k, sms, out_dtype=out_dtype, scalar_b=scalar_b, groups=groups).cycles
    return cycles(tuning.Layout(*tile)) / max(cycles(pick), 1)


def _tiles(op: Op, rates: Rates) -> int:
    """`rates.tile` output tiles of a rule-picked GEMM, as the rule's model counts them (a grouped
    one's with a row tile more per group boundary)."""
    from pallas_kernels import tuning

    groups, (m, n, k) = (op.gemm[0], op.gemm[1:]) if len(op.gemm) == 4 else (1, op.gemm)
    return tuning.modelled(tuning.Layout(*rates.tile), m, n, k, rates.sms, groups=groups).tiles


def with_rule_picks(ops: list[Op], rates: Rates = H100_RATES, *, few_tiles_only: bool = False) -> float:
    """What-if, in seconds: every FP8 GEMM whose config the rule picks (`RULE_CATEGORIES`: dense
    Fprop, Dgrad, Wgrad and grouped Fprop/Dgrad) `rule_factor` times faster in its compute (its
    bytes at copy bandwidth still bound it, as in `op_seconds`), as the rule's cost model predicts
    for the config the kernels pick when given none; with `few_tiles_only`, only those with fewer
    128×128 tiles than SMs (one partial wave; there the rule picks 128×64 or, since 2026-11-29,
    one-warpgroup 64-row tiles: the Wgrads of narrow layers). A prediction of a prediction: no
    rule pick has been timed on a GPU."""
    return priced(ops, rates, rule="few" if few_tiles_only else "all")


def priced(ops: list[Op], rates: Rates = H100_RATES, *, update: bool = False, rule: str | None = None) -> float:
    """The step's seconds at `rates`, with the what-ifs asked for: `update`, the weights from the
    optimizer's update (`weights_from_the_update`); `rule`, the FP8 GEMMs at the tuning rule's
    picks ("all", or "few": only those with fewer 128×128 tiles than SMs; `with_rule_picks`).
    With neither, the sum of `op_seconds` (the step as compiled)."""
    if rule not in (None, "all", "few"):
        raise ValueError(f"rule must be None, 'all' or 'few', got {rule!r}")
    copy = rates.copy.value * 1e9
    total = 0.0
    for op in ops:
        if update and op.category == "quantize: weight 128x128":
            seconds = (op.bytes - 4 * op.elements) / copy
        elif update and op.category == "xla cast":
            seconds = op.bytes / 3 / copy
        elif (rule and op.category in RULE_CATEGORIES and op.gemm
              and (rule == "all" or _tiles(op, rates) < rates.sms)):
            compute = _gemm_compute(op, rates) / rule_factor(op, rates)
            seconds = max(compute, op.bytes / copy) + rates.launch.value
        else:
            seconds = op_seconds(op, rates)
        total += seconds * op.count
    return total


def model_hlo(text: str, rates: Rates = H100_RATES) -> dict:
    """The model of one compiled step's HLO text: categories, total, quantization cuts, the GEMM
    tile loops, the step with those loops as grouped GEMMs, and the step with the quantizers at
    the issue's goal (`QUANTIZER_GOAL` of copy bandwidth): what-ifs."""
    ops = step_ops(parse_module(text))
    loops = gemm_loops(ops, rates)
    what_if = summarize(as_grouped_gemm(ops, rates), rates) if loops else None
    goal = summarize(ops, quantizers_at(rates, QUANTIZER_GOAL))["total"]["seconds"]
    out = {**summarize(ops, rates), "quantization_cuts": quantization_cuts(ops, rates),
           "gemm_loops": {"loops": len(loops), **{k: sum(r[k] for r in loops.values())
                                                   for k in ("flops", "kernels", "seconds")}},
           "with_grouped_gemm": what_if,
           "with_quantizers_at_goal": {"fraction_of_copy": QUANTIZER_GOAL, "seconds": goal},
           "with_weights_from_the_update": {"seconds": weights_from_the_update(ops, rates)},
           "with_rule_picks": {"seconds": with_rule_picks(ops, rates),
                               "few_tiles_only_seconds": with_rule_picks(ops, rates, few_tiles_only=True)}}
    if rates.quantizers != H100_RATES.quantizers:  # another device's assumed rates: bound them
        h100_q = dataclasses.replace(rates, quantizers=H100_RATES.quantizers)
        out["with_h100_quantizers"] = {"seconds": summarize(ops, h100_q)["total"]["seconds"]}
    return out


def faster_fp8_gemms(rates: Rates, factor: float) -> Rates:
    """`rates` with the FP8 GEMMs (dense and grouped) `factor` times faster (a what-if)."""
    return dataclasses.replace(
        rates, fp8_dense=dataclasses.replace(rates.fp8_dense, tflops=rates.fp8_dense.tflops * factor),
        fp8_grouped=dataclasses.replace(rates.fp8_grouped, tflops=rates.fp8_grouped.tflops * factor))


# The levers of issue 43's 1.2x, each a what-if: FP8 GEMMs this much faster (issue 45's kernels;
# "rule": those the tuning rule picks for at its picks, by its cost model, `with_rule_picks`; 1.5 is
# DeepGEMM's published H800 rate over ours), the quantizers at the goal's share of copy
# bandwidth, and the next step's weights written by the optimizer's update.
LEVER_GEMMS = (1.0, "rule", 1.3, 1.5)


def levers(fp8_ops: list[Op], bf16_ops: list[Op], rates: Rates = H100_RATES) -> list[dict]:
    """FP8's predicted step and speed-up over BF16 for every combination of the levers. Where the
    weights come from the update, BF16's do too (its casts as writes: the fair comparison)."""
    bf16 = priced(bf16_ops, rates)
    bf16_update = priced(bf16_ops, rates, update=True)
    rows = []
    for gemms in LEVER_GEMMS:
        for quantizers in (None, QUANTIZER_GOAL):
            r = faster_fp8_gemms(rates, 1.0 if gemms == "rule" else gemms)
            r = quantizers_at(r, quantizers) if quantizers else r
            for update in (False, True):
                fp8 = priced(fp8_ops, r, update=update, rule="all" if gemms == "rule" else None)
                base = bf16_update if update else bf16
                rows.append({"fp8_gemms_faster": gemms, "quantizers_fraction_of_copy": quantizers,
                             "weights_from_the_update": update, "fp8_s": fp8, "bf16_s": base, "speedup": base / fp8})
    return rows


def levers_table(hlo_dir: pathlib.Path, presets: list[str], target: str) -> str:
    """`levers` for each preset's kept HLO as markdown (predicted, at `target`'s rates)."""
    rates = TARGET_RATES[target]
    out = [f"Predicted FP8 speed-up over BF16 ({target}; each lever a what-if; with the weights from the "
           "update BF16 gets the same):", "",
           "| preset | FP8 GEMMs faster | quantizers | weights from the update | FP8 ms | BF16 ms | speed-up |",
           "|---|---|---|---|---|---|---|"]
    suffix = "" if target == "h100_sxm" else f"-{target}"
    for preset in presets:
        ops = {}
        for precision in PRECISIONS:
            path = hlo_dir / f"{preset}-{precision}-train{suffix}.hlo.gz"
            if not path.exists():
                raise SystemExit(f"{path} is missing: run `python benchmarks/step_model.py --presets {preset} "
                                 f"--keep-hlo {hlo_dir}" + ("" if target == "h100_sxm" else f" --target {target}") + "` first")
            ops[precision] = step_ops(parse_module(gzip.decompress(path.read_bytes()).decode()))
        for row in levers(ops["fp8"], ops["bf16"], rates):
            q = row["quantizers_fraction_of_copy"]
            g = row["fp8_gemms_faster"]
            g = "rule's picks (cost model)" if g == "rule" else f"{g:.1f}×"
            out.append(f"| {preset} | {g} | {'as measured' if q is None else f'{q:.0%} of copy'} "
                       f"| {'yes' if row['weights_from_the_update'] else 'no'} | {row['fp8_s'] * 1e3:.2f} "
                       f"| {row['bf16_s'] * 1e3:.2f} | {row['speedup']:.2f} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------ compiling (subprocess)


def _child(spec: str, target: str, out: str) -> int:
    """Compile one (preset, precision) train step for `target`; write its stripped HLO (gz) and
    XLA's memory analysis."""
    from hopper_train_build import _topology_device, abstract_step, for_target

    from jfp8 import attention

    preset, precision, batch, overrides = spec.split(":", 3)
    model, recipe = json.loads(overrides)
    device = _topology_device(target)
    fn, args = abstract_step(preset, precision, "train", int(batch) or None, device, tuple(model.items()),
                             tuple(recipe.items()))
    with for_target(target):
        lowered = fn.trace(*args).lower()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    memory = {f: getattr(mem, f"{f}_size_in_bytes") for f in ("argument", "output", "alias", "temp")}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    out = pathlib.Path(out)
    text = compiled.as_text()
    (out / "hlo.txt.gz").write_bytes(gzip.compress(strip_payloads(text).encode()))
    tokens = args[-1].shape
    (out / "meta.json").write_text(json.dumps({"batch_size": tokens[0], "seq_len": tokens[1], "memory": memory,
                                               "attention": attention.ran(text),
                                               "compiled_at": commit_info()}))
    return 0


def compile_hlo(preset: str, precision: str, target: str, batch: int = 0, timeout: float = 3600,
                overrides: dict | None = None, recipe: dict | None = None) -> tuple[str, dict]:
    """(stripped optimized HLO text, {batch_size, seq_len, memory, attention}) of a train step (the
    preset's model with `overrides` of its ModelConfig; an FP8 step's recipe with `recipe` overrides
    of its `Fp8Recipe`), compiled in a fresh process with the Hopper
    toolchain and cuDNN beside it (installed on first use), so that the attention is what a Hopper
    runs by default: cuDNN's fused kernel (`jfp8.attention`; `attention=xla` in `overrides` models
    XLA's)."""
    from hopper_build import toolchain
    from hopper_train_build import build_env

    cudnn = (overrides or {}).get("attention", "auto") != "xla"
    with tempfile.TemporaryDirectory(prefix="step-model-") as tmp:
        spec = f"{preset}:{precision}:{batch}:{json.dumps([overrides or {}, recipe or {}])}"
        p = subprocess.run([sys.executable, __file__, "--child", spec, "--target", target,
                            "--result", tmp], env=build_env(toolchain(cudnn), cudnn=cudnn), capture_output=True, text=True,
                           timeout=timeout, cwd=REPO)
        hlo = pathlib.Path(tmp) / "hlo.txt.gz"
        if p.returncode or not hlo.exists():
            raise RuntimeError(f"{preset} {precision}: the compile failed (exit {p.returncode}): {p.stderr[-2000:]}")
        return gzip.decompress(hlo.read_bytes()).decode(), json.loads((pathlib.Path(tmp) / "meta.json").read_text())


# ------------------------------------------------------------------------------ records and the table


def rates_json(rates: Rates) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(rates)))


def record(preset: str, target: str, steps: dict[str, dict], command: str, rates: Rates = H100_RATES) -> dict:
    """The JSON of one preset: per precision the model's categories, total, cuts and memory, with an
    empty measured step time for GPU runs to fill."""
    import jax

    return {"preset": preset, "target": target, "device": rates.device, "step": "train",
            "what": "predicted (model): op-by-op prices of the deviceless compile's HLO at the rates below",
            "rates": rates_json(rates), "jax": jax.__version__, "date": datetime.date.today().isoformat(),
            "command": command,
            # the tree that priced it; each precision's `compiled_at` names the tree that compiled
            # its HLO (the same one, unless re-priced from kept HLO: `priced_from_kept_hlo`)
            "priced_at": commit_info(),
            "precisions": {p: {**s, "measured_step_s": None, "measured": MEASURED_NOT} for p, s in steps.items()}}


def same_gpu(a: str | None, b: str | None) -> bool:
    """Whether two device kinds name the same GPU model: 'NVIDIA H200' (a device's own name, say)
    and 'NVIDIA H200 141GB HBM3e' (the deviceless target's) do; the H100's variants are kept apart
    by their memory ('NVIDIA H100 80GB HBM3' is the SXM board, the PCIe one says 'PCIe')."""
    if not a or not b:
        return False
    a, b = a.split(), b.split()
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def attach_measured(doc: dict, bench: dict, source: str) -> list[str]:
    """Fill `doc`'s measured columns from a `bench_step.py` record (`bench`, read from `source`):
    per precision, the row of the same preset at the model's batch x seq_len on the model's device,
    its median step and, where it ran with --profile, its kernels' ms per category. Returns the
    precisions filled."""
    filled = []
    if not same_gpu(bench.get("device"), doc["device"]):
        return filled
    for precision, s in doc["precisions"].items():
        for r in bench.get("rows", []):
            if (r.get("preset"), r.get("precision"), r.get("batch"), r.get("seq_len")) != (
                    doc["preset"], precision, s["batch_size"], s["seq_len"]):
                continue
            ran = (bench.get("configs", {}).get(r["preset"]) or {}).get("model_overrides") or {}
            if ran != (doc.get("model_overrides") or {}):  # another model than the one predicted
                continue
            prof = r.get("profile") or {}
            s["measured_step_s"] = r["step_ms"] / 1e3
            s["measured"] = {
                "source": source, "device": bench["device"], "date": bench.get("date"),
                "commit": bench.get("commit"), "dirty": bench.get("dirty"), "step_ms": r["step_ms"],
                "timed_steps": r.get("timed_steps"),
                "profile": ({k: prof[k] for k in ("steps", "wall_ms", "kernel_ms", "busy_ms", "unattributed_ms",
                                                  "source") if k in prof}
                            | {"categories": {c: v["ms"] for c, v in prof.get("categories", {}).items()}}
                            if prof and "error" not in prof else prof.get("error", "not profiled"))}
            filled.append(precision)
    return filled


def keep_measured(old: dict, new: dict) -> list[str]:
    """Carry `old`'s measured columns into `new` (a re-pricing or recompile of the same preset)
    per precision of the same batch, sequence length and device. Returns the precisions kept."""
    kept = []
    if old.get("device") != new["device"] or old.get("model_overrides") != new.get("model_overrides"):
        return kept
    for p, s in new["precisions"].items():
        o = old.get("precisions", {}).get(p, {})
        if o.get("measured_step_s") is not None and (o.get("batch_size"), o.get("seq_len")) == (
                s["batch_size"], s["seq_len"]):
            s["measured_step_s"], s["measured"] = o["measured_step_s"], o["measured"]
            kept.append(p)
    return kept


def _measured_ms(s: dict, category: str) -> float | None:
    m = s.get("measured")
    prof = m.get("profile") if isinstance(m, dict) else None
    return prof.get("categories", {}).get(category, 0.0) if isinstance(prof, dict) else None


def _fmt_amount(flops: float, nbytes: float) -> str:
    parts = []
    if flops:
        parts.append(f"{flops / 1e12:.3g} TFLOP")
    if nbytes:
        parts.append(f"{nbytes / 1e9:.3g} GB")
    return " / ".join(parts) or "–"


def _ms(r) -> str:
    return f"{r['seconds'] * 1e3:.3f}" if r else "–"


def markdown_table(doc: dict) -> str:
    """One preset's record as a table: per category FP8 ms, BF16 ms (as compiled, and with its GEMM
    tile loops as grouped GEMMs), TFLOP / GB, kernels, and the measured column."""
    fp8, bf16 = doc["precisions"]["fp8"], doc["precisions"]["bf16"]
    alt = bf16.get("with_grouped_gemm") or bf16
    out = [f"**{doc['preset']}** train step, batch {fp8['batch_size']} × {fp8['seq_len']}, {doc['device']}: "
           "predicted (model)", "",
           "| category | FP8 ms | BF16 ms | BF16 ms, MoE as grouped GEMM (what-if) | FP8 TFLOP / GB "
           "| BF16 TFLOP / GB | FP8 / BF16 kernels | measured |", "|---|---|---|---|---|---|---|---|"]
    for c in CATEGORY_NAMES:
        a, b, w = (s.get("categories", {}).get(c) for s in (fp8, bf16, alt))
        if not (a or b or w):
            continue
        amt = lambda r: _fmt_amount(r["flops"], r["bytes"]) if r else "–"  # noqa: E731
        n = lambda r: f"{r['kernels']:.0f}" if r else "–"  # noqa: E731
        mf, mb = _measured_ms(fp8, c), _measured_ms(bf16, c)
        measured = (MEASURED_NOT if mf is None and mb is None else
                    f"FP8 {'–' if mf is None else f'{mf:.3f}'} / BF16 {'–' if mb is None else f'{mb:.3f}'} ms")
        out.append(f"| {c} | {_ms(a)} | {_ms(b)} | {_ms(w)} | {amt(a)} | {amt(b)} | {n(a)} / {n(b)} | {measured} |")
    ta, tb, tw = fp8["total"], bf16["total"], alt["total"]
    meas = lambda s: (MEASURED_NOT if s.get("measured_step_s") is None  # noqa: E731
                      else f"{s['measured_step_s'] * 1e3:.1f} ms")
    out.append(f"| **step** | **{ta['seconds'] * 1e3:.2f}** | **{tb['seconds'] * 1e3:.2f}** "
               f"| **{tw['seconds'] * 1e3:.2f}** | {_fmt_amount(ta['flops'], ta['bytes'])} "
               f"| {_fmt_amount(tb['flops'], tb['bytes'])} | {ta['kernels']:.0f} / {tb['kernels']:.0f} "
               f"| FP8 {meas(fp8)}, BF16 {meas(bf16)} |")
    loops = bf16.get("gemm_loops", {})
    goal = fp8.get("with_quantizers_at_goal")
    goal = (f" With the quantizers at {goal['fraction_of_copy']:.0%} of copy bandwidth (what-if): FP8 "
            f"{goal['seconds'] * 1e3:.2f} ms, {goal['seconds'] / tw['seconds']:.2f} of BF16." if goal else "")
    picks = fp8.get("with_rule_picks")
    if picks:
        goal += (f" With every FP8 GEMM the tuning rule picks for (dense, grouped Fprop/Dgrad) at its pick, "
                 f"by its cost model (what-if): FP8 "
                 f"{picks['seconds'] * 1e3:.2f} ms ({picks['few_tiles_only_seconds'] * 1e3:.2f} with only the "
                 f"GEMMs whose 128×128 tiles leave SMs idle).")
    h100_q = fp8.get("with_h100_quantizers")
    if h100_q:
        goal += (f" With the quantizers at the H100's measured GB/s instead of scaled with HBM (what-if): FP8 "
                 f"{h100_q['seconds'] * 1e3:.2f} ms, {h100_q['seconds'] / tw['seconds']:.2f} of BF16.")
    out += ["", f"FP8/BF16 predicted: {ta['seconds'] / tb['seconds']:.2f} as compiled, "
            f"{ta['seconds'] / tw['seconds']:.2f} against BF16 with grouped GEMMs.{goal} BF16's GEMM tile loops "
            f"(the reference's scan, where jax's ragged kernels do not take the shapes): "
            f"{loops.get('loops', 0)} loops, {loops.get('kernels', 0):.0f} launches, "
            f"{loops.get('seconds', 0) * 1e3:.1f} ms. Peak memory (XLA): FP8 {fp8['memory']['peak'] / 1e9:.2f} GB, "
            f"BF16 {bf16['memory']['peak'] / 1e9:.2f} GB."]
    return "\n".join(out)


def _split(s: dict) -> tuple[float, float, float]:
    """(GEMM, quantizer, everything else) predicted ms of one precision's step."""
    cats = s["categories"]
    gemm = sum(r["seconds"] for c, r in cats.items() if "gemm" in c) * 1e3
    quant = sum(r["seconds"] for c, r in cats.items() if c.startswith("quantize")) * 1e3
    return gemm, quant, s["total"]["seconds"] * 1e3 - gemm - quant


def summary_table(docs: list[dict]) -> str:
    """One line per preset: predicted FP8 and BF16 steps, their ratio, and where the time goes."""
    out = ["| preset | batch × seq | FP8 ms | BF16 ms | BF16 ms, grouped GEMM (what-if) | FP8/BF16 (what-if) "
           f"| FP8 ms, quantizers at {QUANTIZER_GOAL:.0%} of copy (what-if) "
           "| FP8: GEMMs (FP8 + XLA) / quantize / rest ms | BF16 what-if: GEMMs / rest ms | peak GB FP8 / BF16 | measured |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for doc in docs:
        f, b = doc["precisions"]["fp8"], doc["precisions"]["bf16"]
        w = b.get("with_grouped_gemm") or b
        fg, fq, fr = _split(f)
        wg, _, wr = _split(w)
        tf, tb, tw = (s["total"]["seconds"] * 1e3 for s in (f, b, w))
        goal = f.get("with_quantizers_at_goal")
        goal = f"{goal['seconds'] * 1e3:.2f} ({goal['seconds'] * 1e3 / tw:.2f})" if goal else "–"
        mf, mb = f.get("measured_step_s"), b.get("measured_step_s")
        measured = (MEASURED_NOT if mf is None and mb is None else
                    " / ".join(f"{q} {'–' if v is None else f'{v * 1e3:.1f} ms'}" for q, v in (("FP8", mf), ("BF16", mb)))
                    + (f" ({mf / mb:.2f})" if mf and mb else ""))
        out.append(f"| {doc['preset']} | {f['batch_size']} × {f['seq_len']} | {tf:.2f} | {tb:.2f} | {tw:.2f} "
                   f"| {tf / tb:.2f} ({tf / tw:.2f}) | {goal} | {fg:.2f} / {fq:.2f} / {fr:.2f} | {wg:.2f} / {wr:.2f} "
                   f"| {f['memory']['peak'] / 1e9:.2f} / {b['memory']['peak'] / 1e9:.2f} | {measured} |")
    return "\n".join(out)


def _model_overrides(text: str) -> dict:
    """'d_model=4096,n_layers=4' -> ModelConfig overrides, checked against its fields."""
    from _bench import parse_overrides
    from jfp8.nn import ModelConfig

    try:
        return parse_overrides(text, ModelConfig)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _recipe_overrides_arg(text: str) -> dict:
    from _bench import recipe_overrides_arg

    return recipe_overrides_arg(text)


def variant(batch: int, overrides: dict, recipe: dict | None = None) -> str:
    """The file-name suffix of a model that is not the preset's: '-b<batch>', '-<field><value>'...,
    then '-recipe-<field><value>'... for FP8 recipe overrides."""
    return ((f"-b{batch}" if batch else "") + "".join(f"-{k}{v}" for k, v in overrides.items())
            + ("-recipe" + "".join(f"-{k}{v}" for k, v in recipe.items()) if recipe else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small", "gpu", "wide", "wide4k"])
    p.add_argument("--target", default="h100_sxm", choices=sorted(TARGET_RATES),
                   help="the deviceless target compiled for and priced at: h100_sxm (rates measured on an "
                        "H100), h200 (the H100's rates, bandwidth-bound ones scaled by HBM3e's 4.8 / 3.35: "
                        "assumed)")
    p.add_argument("--batch", type=int, default=0, help="batch size (default: the preset's)")
    p.add_argument("--model", type=_model_overrides, default={}, metavar="FIELD=VALUE,...",
                   help="ModelConfig overrides of the preset (a what-if model: its own file, "
                        "<preset>-<FIELD><VALUE>...-<target>.json, and kept HLO stems)")
    p.add_argument("--recipe", type=_recipe_overrides_arg, default={}, metavar="FIELD=VALUE,...",
                   help="Fp8Recipe overrides of the FP8 step (e.g. quantize_impl=xla: XLA's quantizers beside "
                        "the kernels' GEMMs); the BF16 step is the preset's. Its own file, "
                        "<preset>...-recipe-<FIELD><VALUE>...-<target>.json, and kept FP8 HLO stem")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--keep-hlo", type=pathlib.Path, help="also write each compiled step's stripped HLO here (gz)")
    p.add_argument("--from-hlo", type=pathlib.Path,
                   help="price HLO kept by --keep-hlo (with its meta JSON) instead of compiling")
    p.add_argument("--compile", nargs="+", choices=PRECISIONS, default=None,
                   help="with --from-hlo: compile these precisions anew (the rest are re-priced from the kept HLO)")
    p.add_argument("--table", action="store_true", help="print the committed results as markdown")
    p.add_argument("--levers", type=pathlib.Path, metavar="HLO_DIR",
                   help="print FP8's predicted speed-up over BF16 for every combination of issue 43's levers "
                        "(faster FP8 GEMMs, quantizers at the goal, weights from the update), priced from "
                        "the HLO kept in HLO_DIR; no compile")
    p.add_argument("--measured", type=pathlib.Path, nargs="+", default=(), metavar="BENCH_STEP_JSON",
                   help="fill the committed results' measured columns from bench_step.py records (their "
                        "rows at the model's batch on the model's device; per category where run with "
                        "--profile), rewrite them and print the tables")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.target, args.result)
    if args.measured:
        for pr in args.presets:
            path = args.out / f"{pr}-{args.target}.json"
            if not path.exists():
                continue
            doc = json.loads(path.read_text())
            for m in args.measured:
                filled = attach_measured(doc, json.loads(m.read_text()), str(m.relative_to(REPO) if m.is_absolute()
                                                                             and m.is_relative_to(REPO) else m))
                if filled:
                    print(f"{pr}: measured {', '.join(filled)} from {m}")
            path.write_text(json.dumps(doc, indent=1) + "\n")
        args.table = True
    if args.levers:
        print(levers_table(args.levers, args.presets, args.target))
        return 0
    if args.table:
        docs = [json.loads((args.out / f"{pr}-{args.target}.json").read_text()) for pr in args.presets
                if (args.out / f"{pr}-{args.target}.json").exists()]
        print(summary_table(docs) + "\n")
        for doc in docs:
            print(markdown_table(doc) + "\n")
        return 0
    for preset in args.presets:
        # the command that compiles and prices this preset (--from-hlo re-prices the same HLO)
        command = (f"python benchmarks/step_model.py --presets {preset}" + (f" --batch {args.batch}" if args.batch else "")
                   + (" --model " + ",".join(f"{k}={v}" for k, v in args.model.items()) if args.model else "")
                   + (" --recipe " + ",".join(f"{k}={v}" for k, v in args.recipe.items()) if args.recipe else ""))
        steps = {}
        for precision in PRECISIONS:
            recipe = args.recipe if precision == "fp8" else {}  # BF16 has no FP8 recipe
            stem = (f"{preset}-{precision}-train" + variant(args.batch, args.model, recipe)
                    + ("" if args.target == "h100_sxm" else f"-{args.target}"))
            if args.from_hlo and precision not in (args.compile or ()):
                text = gzip.decompress((args.from_hlo / f"{stem}.hlo.gz").read_bytes()).decode()
                meta = json.loads((args.from_hlo / f"{stem}.json").read_text())
            else:
                text, meta = compile_hlo(preset, precision, args.target, args.batch, overrides=args.model, recipe=recipe)
                if args.keep_hlo:
                    args.keep_hlo.mkdir(parents=True, exist_ok=True)
                    (args.keep_hlo / f"{stem}.hlo.gz").write_bytes(gzip.compress(text.encode()))
                    (args.keep_hlo / f"{stem}.json").write_text(json.dumps(meta))
            steps[precision] = {**meta, **model_hlo(text, TARGET_RATES[args.target])}
            t = steps[precision]["total"]
            print(f"{preset} {precision}: predicted {t['seconds'] * 1e3:.2f} ms, {t['flops'] / 1e12:.3g} TFLOP, "
                  f"{t['bytes'] / 1e9:.3g} GB, {t['kernels']:.0f} kernels, peak {meta['memory']['peak'] / 1e9:.2f} GB",
                  flush=True)
        doc = record(preset, args.target, steps, command + ("" if args.target == "h100_sxm" else f" --target {args.target}"),
                     TARGET_RATES[args.target])
        doc["priced_from_kept_hlo"] = ([p for p in PRECISIONS if p not in (args.compile or ())]
                                       if args.from_hlo else [])
        args.out.mkdir(parents=True, exist_ok=True)
        if args.model:
            doc["model_overrides"] = args.model
        if args.recipe:
            doc["recipe_overrides"] = args.recipe
        # another batch, model or recipe than the preset's (sizing, what-ifs) gets its own file
        path = args.out / f"{preset}{variant(args.batch, args.model, args.recipe)}-{args.target}.json"
        if path.exists():  # a re-pricing keeps what a GPU measured (each measurement names its commit)
            kept = keep_measured(json.loads(path.read_text()), doc)
            if kept:
                print(f"kept the measured columns of {', '.join(kept)} from {path}")
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(markdown_table(doc) + f"\n\nwrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

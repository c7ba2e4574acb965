"""Problem shapes shared by the kernel tests (CUDA lowering) and the benchmarks.

DeepSeek-V3's M=4096 GEMM shapes (N x K of its projections, as DeepGEMM benchmarks them), a square
8192^3, and MoE grouped shapes. Tests lower every kernel at these shapes; `benchmarks/bench_gemm.py`
times them.
"""

from typing import NamedTuple


class GemmShape(NamedTuple):
    m: int
    n: int
    k: int


class GroupedShape(NamedTuple):
    groups: int
    rows_per_group: int  # tokens per expert (equal groups for the benchmark baselines)
    n: int
    k: int


DENSE_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(4096, 2112, 7168),
    GemmShape(4096, 24576, 1536),
    GemmShape(4096, 7168, 16384),
    GemmShape(4096, 4096, 7168),
    GemmShape(4096, 7168, 2048),
    GemmShape(8192, 8192, 8192),
)

# One training layer at M = 8192 tokens (issue 43), as GemmShape(m, n, k) for K -> N: an expert's
# gate and up (7168 -> 4096), its down (2048 -> 7168), a dense FFN's up (7168 -> 18432) and
# attention's output (16384 -> 7168). `benchmarks/bench_linear.py --shapes layer` times them.
LAYER_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(8192, 4096, 7168),
    GemmShape(8192, 7168, 2048),
    GemmShape(8192, 18432, 7168),
    GemmShape(8192, 7168, 16384),
)

# Small M (few tokens: small batches, decoding, a thin expert): memory-bound, every byte of b is
# used for at most M rows; DeepSeek-V3's N x K at M = 64 and 128, as DeepGEMM benchmarks them.
SMALL_M_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(64, 2112, 7168),
    GemmShape(64, 7168, 16384),
    GemmShape(128, 4096, 7168),
    GemmShape(128, 7168, 2048),
)

GROUPED_SHAPES: tuple[GroupedShape, ...] = (
    GroupedShape(8, 4096, 4096, 7168),
    GroupedShape(4, 8192, 4096, 7168),
    GroupedShape(8, 4096, 7168, 2048),
)

# Few token rows per expert (small batches): DeepSeek-V3's expert projections (gate and up fused,
# N = 2 x 2048; down, K = 2048) at 32 rows per expert. The rule counts the fewest row tiles
# there could be (256 rows: 2): with 128-wide column tiles 64 (N = 4096), too few for an H100's
# SMs, so it narrows them, or 112 (N = 7168), where narrower tiles would need a second wave;
# 8 groups really make 8 row tiles, which might fill the GPU without narrowing. Which is faster
# is the tuner's to measure.
SMALL_GROUPED_SHAPES: tuple[GroupedShape, ...] = (
    GroupedShape(8, 32, 4096, 7168),
    GroupedShape(8, 32, 7168, 2048),
)

# Small shapes for CPU runs of the benchmark (XLA paths only) and quick checks.
CPU_DENSE_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(256, 256, 512),
    GemmShape(512, 512, 1024),
    GemmShape(1024, 1024, 1024),
)

# Quantizer problems (rows, columns, input dtype), most important first: the wide preset's step's
# most frequent tensor (16384 tokens x d_model 2048: 46 of its 143 both-orientation quantizations;
# issue 43 wants the quantizers fast at the step's shapes), an activation, a weight (bf16 and an f32
# master).
QUANTIZE_SHAPES: tuple[tuple[int, int, str], ...] = (
    (16384, 2048, "bfloat16"),
    (8192, 8192, "bfloat16"),
    (4096, 7168, "bfloat16"),
    (7168, 2048, "float32"),
)

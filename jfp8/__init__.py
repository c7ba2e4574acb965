"""jfp8: DeepSeek-V3's FP8 training recipe in JAX and Pallas (Mosaic GPU).

Numerics core: `quantize` -> `Fp8Tensor`, the reference GEMM `scaled_matmul_reference` (chunked FP32
accumulation, the numerics every kernel reproduces) and the float64 oracle.
"""

from jfp8.fp8 import AMAX_FLOOR, BLOCKS, E4M3_MAX, FP8_DTYPE, TILE, Fp8Tensor, quantize
from jfp8.reference import (
    dequantize_f64,
    grouped_scaled_matmul_reference,
    grouped_wgrad_reference,
    scaled_matmul_oracle,
    scaled_matmul_reference,
)

__all__ = [
    "AMAX_FLOOR",
    "BLOCKS",
    "E4M3_MAX",
    "FP8_DTYPE",
    "TILE",
    "Fp8Tensor",
    "dequantize_f64",
    "grouped_scaled_matmul_reference",
    "grouped_wgrad_reference",
    "quantize",
    "scaled_matmul_oracle",
    "scaled_matmul_reference",
]

__version__ = "0.1.0"

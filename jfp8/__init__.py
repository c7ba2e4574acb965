"""jfp8: DeepSeek-V3's FP8 training recipe in JAX and Pallas (Mosaic GPU).

Numerics core: `quantize` -> `Fp8Tensor`, the reference GEMM `scaled_matmul_reference` (chunked FP32
accumulation, the numerics every kernel reproduces) and the float64 oracle. GEMMs:
`scaled_matmul`, `grouped_scaled_matmul`, `grouped_wgrad_matmul`, each with `impl="xla" | "mosaic" |
"auto"` chosen in one place, `jfp8.api`. Checkpoints in DeepSeek-V3's FP8 safetensors layout: `save_safetensors`, `load_safetensors`.
"""

from jfp8.api import (
    Impl,
    grouped_scaled_matmul,
    grouped_wgrad_matmul,
    is_hopper,
    ragged_dot,
    quantize,
    quantize_activation,
    quantize_grad,
    quantize_weight,
    quantize_wgrad_operand,
    retile_wgrad_operand,
    scaled_matmul,
)
from jfp8.fp8 import AMAX_FLOOR, BLOCKS, GRAD_AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, TILE, Fp8Tensor
from jfp8.reference import (
    dequantize_f64,
    grouped_scaled_matmul_reference,
    grouped_wgrad_reference,
    scaled_matmul_oracle,
    scaled_matmul_reference,
)
from jfp8.ops import Fp8Weight, fp8_linear, fp8_weight, grouped_fp8_linear
from jfp8.dot_general import fp8_dot_general, make_fp8_dot_general
from jfp8.autocast import DotRecord, autocast, einsum, format_report
from jfp8.recipe import Fp8Recipe
from jfp8.safetensors_io import load_safetensors, save_safetensors

__all__ = [
    "Fp8Recipe",
    "autocast",
    "DotRecord",
    "einsum",
    "format_report",
    "fp8_dot_general",
    "fp8_linear",
    "fp8_weight",
    "Fp8Weight",
    "grouped_fp8_linear",
    "make_fp8_dot_general",
    "Impl",
    "is_hopper",
    "ragged_dot",
    "scaled_matmul",
    "grouped_scaled_matmul",
    "grouped_wgrad_matmul",
    "AMAX_FLOOR",
    "GRAD_AMAX_FLOOR",
    "BLOCKS",
    "E4M3_MAX",
    "FP8_DTYPE",
    "TILE",
    "Fp8Tensor",
    "dequantize_f64",
    "grouped_scaled_matmul_reference",
    "grouped_wgrad_reference",
    "quantize",
    "quantize_activation",
    "quantize_grad",
    "quantize_weight",
    "quantize_wgrad_operand",
    "retile_wgrad_operand",
    "scaled_matmul_oracle",
    "scaled_matmul_reference",
    "load_safetensors",
    "save_safetensors",
]

__version__ = "0.1.0"

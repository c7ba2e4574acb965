"""DeepGEMM's reference FP8 quantizers, re-implemented in numpy as PyTorch executes them.

DeepGEMM (`deep_gemm/utils/math.py`: `per_token_cast_to_fp8`, `per_channel_cast_to_fp8`,
`per_block_cast_to_fp8`, `ceil_to_ue8m0`) writes

    amax = |x|.float().amax(block).clamp(1e-4);  sf = amax / 448.0
    sf = ceil_to_ue8m0(sf) if use_ue8m0 else sf;  data = (x * (1.0 / sf)).to(torch.float8_e4m3fn)

and runs it on CUDA tensors (its tests build every input with `device='cuda'`). There PyTorch
does not perform the IEEE operations the source suggests:

- `tensor / 448.0` (a Python number, a CPU scalar) multiplies by the reciprocal rounded once to
  f32 on the host (`aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu`: "compute a *
  reciprocal(b) ... may lose one bit of precision"), so `sf = fl(amax * fl(1 / 448))`. PyTorch on
  the CPU divides (`cpu/BinaryOpsKernel.cpp`, `div_true_kernel`): `sf = fl(amax / 448)`, which
  differs by one ulp for about half of all amax values (`scale_division="cpu"` below).
- `1.0 / tensor` is `tensor.reciprocal() * 1.0` (`torch/_tensor.py`, `__rdiv__`), and the CUDA
  reciprocal is `1 / a`, an IEEE division: `fl(1 / sf)`.
- `x * that` promotes bf16 `x` to f32 and multiplies once: `fl(x * fl(1 / sf))`.
- `.to(torch.float8_e4m3fn)` is `c10::detail::fp8e4m3fn_from_fp32_value`: round to nearest even,
  no saturation (|v| >= 480 becomes NaN); ported bit for bit in `c10_e4m3fn_bits`.

Independent of jax and of ml_dtypes (the tests check the port against ml_dtypes), so it can
serve as the oracle for jfp8's quantizer. Finite inputs only: DeepGEMM gives an Inf block an Inf
scale and zeros, where jfp8 deliberately gives NaN.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

GRAN = 128  # DeepGEMM's gran_k
FP8_MAX = 448.0  # its literal
AMAX_CLAMP = 1e-4  # its clamp(1e-4)


def c10_e4m3fn_bits(v: np.ndarray) -> np.ndarray:
    """PyTorch's f32 -> float8_e4m3fn conversion (`fp8e4m3fn_from_fp32_value`), as uint8 bits."""
    bits = np.asarray(v, np.float32).view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    mag = bits ^ sign
    fp8_max = np.uint32(1087 << 20)  # 480.0f, the first value past E4M3FN's range
    denorm_mask = np.uint32(141 << 23)  # 2^14: adding it rounds to E4M3FN's subnormal step 2^-9
    with np.errstate(over="ignore"):
        sub = (mag.view(np.float32) + denorm_mask.view(np.float32)).view(np.uint32) - denorm_mask
        mant_odd = (mag >> np.uint32(20)) & np.uint32(1)
        rebias = np.uint32(((7 - 127) << 23) % (1 << 32))  # uint32 wrap-around, as in C
        norm = (mag + rebias + np.uint32(0x7FFFF) + mant_odd) >> np.uint32(20)
    out = np.where(mag >= fp8_max, np.uint32(0x7F), np.where(mag < np.uint32(121 << 23), sub, norm))
    return (out & np.uint32(0xFF)).astype(np.uint8) | (sign >> np.uint32(24)).astype(np.uint8)


def ceil_to_ue8m0(sf: np.ndarray) -> np.ndarray:
    """DeepGEMM's `ceil_to_ue8m0`: |sf| rounded up to a power of two, exponent clamped to [1, 254]."""
    bits = np.abs(np.asarray(sf, np.float32)).view(np.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(np.int32)
    return (np.clip(exp, 1, 254) << 23).astype(np.int32).view(np.float32)


def scale_from_amax(
    amax: np.ndarray, use_ue8m0: bool, scale_division: Literal["cuda", "cpu"] = "cuda"
) -> np.ndarray:
    """`sf` of a block from its f32 amax (before the clamp), as PyTorch on CUDA (or CPU) computes it."""
    amax = np.maximum(np.asarray(amax, np.float32), np.float32(AMAX_CLAMP))
    if scale_division == "cuda":
        sf = amax * (np.float32(1.0) / np.float32(FP8_MAX))
    else:
        sf = amax / np.float32(FP8_MAX)
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def _encode(x: np.ndarray, sf: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return c10_e4m3fn_bits(x * (np.float32(1.0) / sf))


def _pad(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    m, n = x.shape
    out = np.zeros((-(-m // rows) * rows, -(-n // cols) * cols), np.float32)
    out[:m, :n] = x
    return out


def per_token_cast_to_fp8(x, use_ue8m0: bool, scale_division="cuda"):
    """(E4M3 bits [m, n], sf [m, ceil(n / 128)]): one scale per 128 elements of a row."""
    x = np.asarray(x, np.float32)
    m, n = x.shape
    xv = _pad(x, 1, GRAN).reshape(m, -1, GRAN)
    sf = scale_from_amax(np.abs(xv).max(axis=2, initial=0.0), use_ue8m0, scale_division)
    return _encode(xv, sf[:, :, None]).reshape(m, -1)[:, :n], sf


def per_channel_cast_to_fp8(x, use_ue8m0: bool, scale_division="cuda"):
    """(E4M3 bits [m, n], sf [m / 128, n]): one scale per 128 elements of a column; m % 128 == 0."""
    x = np.asarray(x, np.float32)
    m, n = x.shape
    assert m % GRAN == 0
    xv = x.reshape(-1, GRAN, n)
    sf = scale_from_amax(np.abs(xv).max(axis=1), use_ue8m0, scale_division)
    return _encode(xv, sf[:, None, :]).reshape(m, n), sf


def per_block_cast_to_fp8(x, use_ue8m0: bool, scale_division="cuda"):
    """(E4M3 bits [m, n], sf [ceil(m / 128), ceil(n / 128)]): one scale per 128x128 block."""
    x = np.asarray(x, np.float32)
    m, n = x.shape
    xp = _pad(x, GRAN, GRAN)
    xv = xp.reshape(xp.shape[0] // GRAN, GRAN, xp.shape[1] // GRAN, GRAN)
    sf = scale_from_amax(np.abs(xv).max(axis=(1, 3)), use_ue8m0, scale_division)
    return _encode(xv, sf[:, None, :, None]).reshape(xp.shape)[:m, :n], sf

"""`Fp8Recipe`: which GEMMs of a linear layer run in FP8, and how their operands are scaled."""

from __future__ import annotations

import dataclasses

from jfp8.api import IMPLS, Impl
from jfp8.fp8 import AMAX_FLOOR, GRAD_AMAX_FLOOR, TILE, Block, _check_block, check_amax_floor


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 recipe of a linear layer (DeepSeek-V3 §3.3 by default).

    Attributes:
      activation_block: scaling of x in Fprop: `(1, 128)` tiles (default), `(128, 128)` or None.
      weight_block: scaling of W in Fprop and (transposed) Dgrad: `(128, 128)` blocks.
      grad_block: scaling of dy in Dgrad: `(1, 128)` tiles; Appendix B.2 reports that `(128, 128)`
        blocks here made a 16B MoE diverge.
      fprop, dgrad, wgrad: which of the three GEMMs run in FP8; the others run as plain
        `x.dtype` matmuls with an FP32 accumulator.
      promotion_interval: N_C, the K-elements between FP32 promotions; 128 (the scaling tile).
      pow2_scale: round every scale up to a power of two (UE8M0).
      activation_amax_floor, weight_amax_floor, grad_amax_floor: per role, the least amax a scale
        is taken from (an all-zero tile still gets a finite scale). Activations (x in Fprop and
        Wgrad) and weights keep DeepGEMM's 1e-4, bit for bit its quantizers; gradients (dy in
        Dgrad and Wgrad) get `GRAD_AMAX_FLOOR` (448 * 2^-126), which binds only where a scale would
        not be a normal f32, so dy's scales follow it at any magnitude and no loss scale is needed.
      impl: "auto" (Mosaic GPU kernels on Hopper, XLA reference elsewhere), "xla" or "mosaic".
      quantize_impl: the quantizers' own `impl`, or None (default) for `impl`'s. With
        `quantize_impl="xla"` and the kernels for the GEMMs, every quantization is XLA's (the
        reference, so the same bits), which XLA may fuse with the op that produced its input (an
        RMSNorm, SwiGLU) where a kernel must read that input from memory: a switch for timing the
        two kinds of quantizer inside a training step (`benchmarks/bench_quantize.py` times them
        alone).
      interpret: run the kernels in the Mosaic GPU interpreter (tests).
      fuse_quantizers: on the kernels' path, quantize W into both orientations (Fprop, Dgrad) in
        one pass and dy into both forms (Dgrad, Wgrad) in one pass (`quantize_weight`,
        `quantize_grad`); False runs the separate quantizers and an XLA transpose instead. Same
        bits either way: a switch for comparing the two, or for sidestepping a fused kernel.
    """

    activation_block: Block = (1, TILE)
    weight_block: Block = (TILE, TILE)
    grad_block: Block = (1, TILE)
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    promotion_interval: int = TILE
    pow2_scale: bool = False
    activation_amax_floor: float = AMAX_FLOOR
    weight_amax_floor: float = AMAX_FLOOR
    grad_amax_floor: float = GRAD_AMAX_FLOOR
    impl: Impl = "auto"
    quantize_impl: Impl | None = None
    interpret: bool = False
    fuse_quantizers: bool = True

    def __post_init__(self):
        for name in ("activation_block", "weight_block", "grad_block"):
            block = getattr(self, name)
            _check_block(block)
            if block is not None and block[1] != TILE:
                raise ValueError(
                    f"{name}={block}: scaling blocks must span {TILE} contraction elements "
                    f"((1, {TILE}), ({TILE}, {TILE})) or be None (per tensor)"
                )
        if self.promotion_interval != TILE:
            raise NotImplementedError(
                f"promotion_interval={self.promotion_interval}: the GEMMs promote every {TILE} "
                "K-elements (one scaling tile); other intervals exist only in the accumulation "
                "simulator"
            )
        for name in ("activation_amax_floor", "weight_amax_floor", "grad_amax_floor"):
            try:
                object.__setattr__(self, name, check_amax_floor(getattr(self, name)))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.quantize_impl is not None and self.quantize_impl not in IMPLS:
            raise ValueError(f"quantize_impl must be one of {IMPLS} or None (impl's), got {self.quantize_impl!r}")

    @property
    def quantizer_impl(self) -> Impl:
        """The quantizers' `impl`: `quantize_impl`, or `impl` when that is None."""
        return self.impl if self.quantize_impl is None else self.quantize_impl

    @property
    def enabled(self) -> bool:
        """True when any GEMM runs in FP8."""
        return self.fprop or self.dgrad or self.wgrad

    @property
    def wgrad_block(self) -> Block:
        """Scaling of both Wgrad operands along the token axis: 128 tokens per scale, or per tensor
        for the per-tensor baseline."""
        return None if self.activation_block is None else (TILE, 1)

    @classmethod
    def deepseek(cls, **overrides) -> Fp8Recipe:
        """DeepSeek-V3's recipe: 1x128 activation/gradient tiles, 128x128 weight blocks, all
        three GEMMs in FP8."""
        return cls(**overrides)

    @classmethod
    def per_tensor(cls, **overrides) -> Fp8Recipe:
        """The baseline DeepSeek-V3 improves on: one scale per tensor everywhere."""
        return cls(**{"activation_block": None, "weight_block": None, "grad_block": None, **overrides})

    @classmethod
    def off(cls, **overrides) -> Fp8Recipe:
        """No FP8: plain matmuls in the inputs' dtype (the BF16 baseline for bf16 inputs)."""
        return cls(**{"fprop": False, "dgrad": False, "wgrad": False, **overrides})

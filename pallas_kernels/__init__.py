"""Pallas Mosaic GPU (Hopper) kernels for jfp8: FP8 quantization, tile-scaled GEMM, grouped GEMM.

JAX and Pallas only (no flax/optax, no jfp8 import): the kernels take raw arrays; `jfp8` wraps
them behind `Fp8Tensor`s and chooses between them and the XLA reference.
"""

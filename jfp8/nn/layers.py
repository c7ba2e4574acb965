"""Building blocks: `Fp8Linear`, `RMSNorm`, `SwiGLU`, rotary embeddings and Multi-head Latent Attention.

Precision map (DeepSeek-V3 §3.3.2): every projection here is an `Fp8Linear` (FP8 GEMMs under the
recipe, FP32 master weight); the norms, RoPE and the attention core (softmax(QKᵀ)·V) stay in
BF16/FP32.
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jfp8.attention import causal_attention
from jfp8.nn.config import ModelConfig
from jfp8.ops import fp8_linear
from jfp8.recipe import Fp8Recipe


# While `jfp8.nn.using_fp8_weights` is active: {(id(module), weight's attribute): its FP8 copies}.
GIVEN_FP8_WEIGHTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jfp8_given_fp8_weights", default=None)


def given_fp8_weight(module: nnx.Module, name: str):
    """The FP8 copies of `module.<name>` given by `jfp8.nn.using_fp8_weights`, or None."""
    given = GIVEN_FP8_WEIGHTS.get()
    return None if given is None else given.get((id(module), name))


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    """An FP32 master weight drawn from N(0, std²): `std * jax.random.normal(key, shape)`, bit for
    bit, drawn as the first elements of a longer draw (`_flat_normal`).

    jax's threefry draws element i from the key and i alone (`jax_threefry_partitionable`, on by
    default), so a draw of n values is the first n of any longer one. Drawing at power-of-two
    lengths lets a model's weights share a few compiled generators instead of compiling one per
    weight shape (XLA:CPU: about 0.4 s each, 12 shapes in `tiny`). A weight of more than
    `_MAX_DRAW` elements is drawn at its own length (a longer draw would cost memory, not time)."""
    size = math.prod(shape)
    if not jax.config.jax_threefry_partitionable or size == 0:
        return std * jax.random.normal(rngs.params(), shape, jnp.float32)
    n = size if size > _MAX_DRAW else max(1 << (size - 1).bit_length(), _MIN_DRAW)
    return std * _flat_normal(rngs.params(), n)[:size].reshape(shape)


_MIN_DRAW = 1 << 14  # the shortest draw: weights smaller than this share one generator
_MAX_DRAW = 1 << 24  # 64 MiB of f32: longer weights are drawn at their own length


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key: jax.Array, n: int) -> jax.Array:
    return jax.random.normal(key, (n,), jnp.float32)


class Fp8Linear(nnx.Module):
    """`y = x · W (+ b)` through `jfp8.fp8_linear`: FP8 Fprop/Dgrad/Wgrad under `recipe`.

    The weight is an FP32 master copy of shape (in_features, out_features); the output has x's
    dtype (BF16 in the model). With `Fp8Recipe.off()` this is a plain matmul in x's dtype with an
    FP32 accumulator. The optional bias is FP32 and added after the GEMM.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: Fp8Recipe,
        use_bias: bool = False,
        init_std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        self.weight = nnx.Param(normal_init(rngs, (in_features, out_features), init_std))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None
        # A `jfp8.nn.capture` tap while its GEMM operands are being recorded; None otherwise.
        self.tap = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in_features] (bf16 or f32) -> [..., out_features] in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expects x[..., {self.in_features}], got shape {x.shape}")
        if self.tap is not None:
            x = self.tap.input(x)
        y = fp8_linear(x, self.weight[...], self.recipe, w_fp8=given_fp8_weight(self, "weight"))
        if self.tap is not None:
            y = self.tap.output(y)  # records the output gradient dy (the Dgrad/Wgrad operand)
        if self.bias is not None:
            y = (y.astype(jnp.float32) + self.bias[...]).astype(x.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in FP32 with an FP32 scale; returns x's dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * rms * self.scale[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN, `W2 (silu(x W1) ⊙ x W3)`, both GEMMs in FP8.

    W1 and W3 are stored side by side as one (dim, 2·hidden) weight `w13`: one GEMM instead of two.
    Used for the first `n_dense_layers` blocks and, with hidden = N_s × moe_hidden, for the shared
    experts of an MoE layer (N_s experts side by side are one wider SwiGLU).
    """

    def __init__(self, dim: int, hidden: int, *, recipe: Fp8Recipe, init_std: float, rngs: nnx.Rngs):
        kw = dict(recipe=recipe, init_std=init_std, rngs=rngs)
        self.w13 = Fp8Linear(dim, 2 * hidden, **kw)  # [W1 | W3]
        self.w2 = Fp8Linear(hidden, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x's dtype."""
        return self.w2(swiglu(self.w13(x)))


def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) ⊙ up for gate_up = [gate | up] [..., 2h] -> [..., h]; FP32 math, input dtype out."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


# ------------------------------------------------------------------------------ rotary embedding


def rope_angles(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the RoPE angles for `positions` [T] -> two [T, dim // 2] FP32 arrays."""
    inv_freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [dim/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., i], x[..., i + dim/2]) of x [B, T, H, dim] by the angles [T, dim/2].

    Computed in FP32, returned in x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]: broadcast over heads
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


# ------------------------------------------------------------------------------ attention


class MLA(nnx.Module):
    """Multi-head Latent Attention (DeepSeek-V2/V3, V3 report §2.1.1, eq. 1-11).

    Keys and values come from a joint low-rank latent c^KV (width d_c = kv_lora_rank), queries
    from a low-rank latent c^Q (width d'_c = q_lora_rank); each latent is RMS-normalised before
    its up-projection. RoPE is decoupled: a per-head RoPE query q^R and one RoPE key k^R shared by
    all heads, concatenated to the no-RoPE parts. All projections are `Fp8Linear`s.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.n_heads, cfg.d_model
        kw = dict(recipe=cfg.recipe, init_std=cfg.init_std, rngs=rngs)
        self.wq_a = Fp8Linear(d, cfg.q_lora_rank, **kw)  # W^DQ
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = Fp8Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, **kw)  # [W^UQ; W^QR]
        self.wkv_a = Fp8Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, **kw)  # [W^DKV; W^KR]
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        kv_b_out = h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.wkv_b = Fp8Linear(cfg.kv_lora_rank, kv_b_out, **kw)  # [W^UK; W^UV]
        self.wo = Fp8Linear(h * cfg.v_head_dim, d, **kw)  # W^O

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, d] -> [B, T, d] in x's dtype; causal over T."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, nope, rope, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        cos, sin = rope_angles(jnp.arange(t), rope, cfg.rope_theta)  # [T, rope/2]

        c_q = self.q_norm(self.wq_a(x))  # [B, T, d'_c]
        q = self.wq_b(c_q).reshape(b, t, h, nope + rope)  # [B, T, H, nope + rope]
        q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], cos, sin)], axis=-1)

        kv_a = self.wkv_a(x)  # [B, T, d_c + rope]
        c_kv = self.kv_norm(kv_a[..., : cfg.kv_lora_rank])  # [B, T, d_c]
        k_rope = apply_rope(kv_a[..., None, cfg.kv_lora_rank :], cos, sin)  # [B, T, 1, rope]: shared
        kv = self.wkv_b(c_kv).reshape(b, t, h, nope + dv)  # [B, T, H, nope + dv]
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, (b, t, h, rope))], axis=-1)
        v = kv[..., nope:]  # [B, T, H, dv]

        out = causal_attention(q, k, v, scale=cfg.qk_head_dim**-0.5, impl=cfg.attention)  # [B, T, H, dv]
        return self.wo(out.reshape(b, t, h * dv))

"""`ModelConfig`: the shape of a DeepSeek-V3-style model (MLA + DeepSeekMoE + MTP) and its FP8 recipe."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Literal

import jax.numpy as jnp

from jfp8.attention import ATTENTION_IMPLS
from jfp8.recipe import Fp8Recipe

_COMPUTE_DTYPES = ("bfloat16", "float32")

BiasRule = Literal["sign", "clipped"]
BiasSchedule = Literal["constant", "lr", "lr_decay"]
BIAS_RULES: tuple[str, ...] = ("sign", "clipped")
BIAS_SCHEDULES: tuple[str, ...] = ("constant", "lr", "lr_decay")
# DeepSeek-V3 (§4.2): γ = 0.001 at a peak learning rate of 2.2e-4, a ratio of about 4.5.
DEEPSEEK_V3_BIAS_LR_RATIO = 1e-3 / 2.2e-4
# DeepSeek-V3 (§4.2) initialises every learnable parameter with this standard deviation.
DEEPSEEK_V3_INIT_STD = 0.006
# The presets' router-bias update (clipped proportional, γ_t = κ·lr_t), chosen by measurement:
# κ = 15 on tiny (experiments/results/balancing-tiny/summary.md), 50 on small, whose wider gate
# drifts faster per step (experiments/results/balancing-small/summary.md). The field defaults are
# DeepSeek-V3's sign rule.
PRESET_BALANCING = MappingProxyType(dict(bias_rule="clipped", bias_schedule="lr", bias_lr_ratio=15.0))
SMALL_BIAS_LR_RATIO = 50.0


def check_expert_groups(n_experts: int, k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError unless `n_group` groups split `n_experts` and `topk_group` of them hold K."""
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"n_group={n_group} must be a positive divisor of n_routed={n_experts}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
    if k > topk_group * (n_experts // n_group):
        raise ValueError(
            f"top_k={k} exceeds the {topk_group} kept groups x {n_experts // n_group} experts each; "
            "raise topk_group or lower n_group"
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-style decoder (arXiv 2412.19437 §2) at research scale.

    The field defaults follow DeepSeek-V3 where it gives a value; the presets (`tiny`, `small`,
    `gpu`, `wide`) change the router-bias update to the measured `PRESET_BALANCING`.

    Parameters are FP32 master weights; activations run in `dtype`. Every projection except the
    embedding, the output head and the MoE gate goes through the FP8 ops with `recipe`
    (`Fp8Recipe.off()` gives the BF16 baseline).

    Attributes:
      vocab_size: tokens in the vocabulary (256: byte-level).
      d_model: width d of the residual stream.
      n_layers: transformer blocks of the main model.
      n_dense_layers: the first blocks use a dense SwiGLU FFN instead of MoE (DeepSeek-V3: 3).
      n_heads: attention heads n_h.
      q_lora_rank: d'_c, rank of the query compression (MLA, eq. 6-8).
      kv_lora_rank: d_c, rank of the joint key/value compression (MLA, eq. 1-5).
      qk_nope_head_dim: d_h, per-head query/key width without RoPE.
      qk_rope_head_dim: d^R_h, width of the decoupled RoPE query (per head) and key (shared); even.
      v_head_dim: per-head value width.
      n_routed: N_r routed experts per MoE layer.
      n_shared: N_s shared experts per MoE layer (may be 0).
      top_k: K_r routed experts per token.
      moe_hidden: hidden width of one expert (routed and shared alike).
      dense_hidden: hidden width of the dense SwiGLU FFN.
      rope_theta: RoPE base.
      max_seq_len: the longest sequence the model accepts.
      mtp: add the depth-1 Multi-Token Prediction module (§2.2).
      mtp_lambda: λ, weight of the MTP cross-entropy in `model_loss`.
      n_group: group-limited routing (§2.1.2): the routed experts form this many equal groups;
        1 = no group limit.
      topk_group: each token routes within its best `topk_group` groups (group score: the sum of
        its two highest s + b); n_group = topk_group = 1 is plain top-K.
      route_scale: multiplies the normalised routing gates (DeepSeek-V3 671B: 2.5).
      balance_alpha: α of the complementary sequence-wise balance loss (eq. 17).
      bias_rule: auxiliary-loss-free bias update (§2.1.2): "sign", b_i += γ_t sign(mean − load_i)
        as in the report, or "clipped", b_i += γ_t clip((mean − load_i) / mean, ±1).
      bias_gain: the "clipped" rule's gain, b_i += γ_t clip(gain · (mean − load_i) / mean, ±1):
        how far below saturation it responds in full (gain → ∞ is the sign rule).
      bias_schedule: γ_t = `bias_gamma` ("constant"), `bias_lr_ratio` · lr_t ("lr"), or
        `bias_lr_ratio` · lr_max(t, warmup) ("lr_decay": the learning rate's decay without its
        warmup, so γ starts at its peak as in DeepSeek-V3, whose γ = 0.001 held from step 0 while
        the learning rate warmed up; measured worse than "lr" on `small`, see
        experiments/results/balancing-small/summary.md).
      bias_gamma: γ of the "constant" schedule.
      bias_lr_ratio: κ of the "lr" and "lr_decay" schedules; default DeepSeek-V3's γ / peak LR = 1e-3 / 2.2e-4.
      bias_freeze_frac: γ_t = 0 for this final fraction of training (DeepSeek-V3: the last
        500B of 14.8T tokens, 3.4 %).
      norm_eps: RMSNorm epsilon.
      init_std: standard deviation of the normal initialisation of every weight matrix but the gate.
      gate_init_std: standard deviation of the MoE gate's initialisation (DeepSeek-V3 §4.2: 0.006).
      dtype: compute dtype, "bfloat16" or "float32" (a jnp dtype is accepted and normalised).
      recipe: the `Fp8Recipe` of every FP8 projection.
      attention: how MLA's attention core runs (`jfp8.attention`): "auto" (cuDNN's fused kernel
        where the step is traced for a Hopper GPU that takes the heads, XLA's reference elsewhere,
        the same on a CPU bit for bit), "xla" or "cudnn".
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_dense_layers: int = 1
    n_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed: int = 4
    n_shared: int = 1
    top_k: int = 2
    moe_hidden: int = 32
    dense_hidden: int = 128
    rope_theta: float = 10000.0
    max_seq_len: int = 128
    mtp: bool = True
    mtp_lambda: float = 0.3
    n_group: int = 1
    topk_group: int = 1
    route_scale: float = 1.0
    balance_alpha: float = 1e-4
    bias_rule: BiasRule = "sign"
    bias_gain: float = 1.0
    bias_schedule: BiasSchedule = "lr"
    bias_gamma: float = 1e-3
    bias_lr_ratio: float = DEEPSEEK_V3_BIAS_LR_RATIO
    bias_freeze_frac: float = 0.03
    norm_eps: float = 1e-6
    init_std: float = 0.02
    gate_init_std: float = DEEPSEEK_V3_INIT_STD
    dtype: str = "bfloat16"
    recipe: Fp8Recipe = dataclasses.field(default_factory=Fp8Recipe.deepseek)
    attention: str = "auto"

    def __post_init__(self):
        try:
            name = jnp.dtype(self.dtype).name
        except TypeError as e:
            raise ValueError(f"dtype must be one of {_COMPUTE_DTYPES}, got {self.dtype!r}") from e
        if name not in _COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {_COMPUTE_DTYPES}, got {name!r}")
        object.__setattr__(self, "dtype", name)  # frozen: normalise once, here
        positive = (
            "vocab_size", "d_model", "n_layers", "n_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_seq_len", "dense_hidden",
        )
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must lie in [0, n_layers={self.n_layers}]")
        if self.has_moe:
            if self.n_routed <= 0 or self.moe_hidden <= 0 or self.n_shared < 0:
                raise ValueError(
                    f"MoE layers need n_routed > 0, moe_hidden > 0 and n_shared >= 0; got "
                    f"n_routed={self.n_routed}, moe_hidden={self.moe_hidden}, n_shared={self.n_shared}"
                )
            if not 1 <= self.top_k <= self.n_routed:
                raise ValueError(f"top_k={self.top_k} must lie in [1, n_routed={self.n_routed}]")
            check_expert_groups(self.n_routed, self.top_k, self.n_group, self.topk_group)
        if self.bias_rule not in BIAS_RULES:
            raise ValueError(f"bias_rule must be one of {BIAS_RULES}, got {self.bias_rule!r}")
        if self.bias_schedule not in BIAS_SCHEDULES:
            raise ValueError(f"bias_schedule must be one of {BIAS_SCHEDULES}, got {self.bias_schedule!r}")
        if not self.bias_gain > 0:
            raise ValueError(f"bias_gain must be > 0, got {self.bias_gain}")
        for field in ("route_scale", "bias_gamma", "bias_lr_ratio", "gate_init_std", "init_std"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if not 0 <= self.bias_freeze_frac < 1:
            raise ValueError(f"bias_freeze_frac={self.bias_freeze_frac} must lie in [0, 1) (0: never freeze)")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if not isinstance(self.recipe, Fp8Recipe):
            raise TypeError(f"recipe must be an Fp8Recipe (e.g. Fp8Recipe.off()), got {type(self.recipe)}")

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The activation dtype as a jnp dtype."""
        return jnp.dtype(self.dtype)

    @property
    def has_moe(self) -> bool:
        """True when some block (main model or MTP) uses an MoE FFN."""
        return self.n_layers > self.n_dense_layers or self.mtp

    @property
    def n_moe_layers(self) -> int:
        """MoE layers, in the order of `aux.expert_loads`: main-model blocks, then the MTP block."""
        return (self.n_layers - self.n_dense_layers) + int(self.mtp)

    @property
    def moe_layer_names(self) -> tuple[str, ...]:
        """Names of the MoE layers in `aux.expert_loads` row order: "block{i}" (0-based main-model
        block index), then "mtp" for the MTP block."""
        return tuple(f"block{i}" for i in range(self.n_dense_layers, self.n_layers)) + (("mtp",) if self.mtp else ())

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-RoPE part plus the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **overrides) -> ModelConfig:
        """A copy with `overrides` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **overrides)

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """For tests: a fraction of a second per step on a CPU. d_model 64, 2 layers (1 dense),
        4 routed experts (top-2) + 1 shared. Like every preset, balances with `PRESET_BALANCING`."""
        return dataclasses.replace(cls(**PRESET_BALANCING), **overrides)

    @classmethod
    def small(cls, **overrides) -> ModelConfig:
        """Trains on a CPU in tens of minutes: d_model 256, 6 layers (1 dense), 16 routed experts
        (top-2) + 1 shared, ~23M total / ~5M activated parameters. Balances with `PRESET_BALANCING`
        at κ = `SMALL_BIAS_LR_RATIO`."""
        base = cls(
            d_model=256, n_layers=6, n_dense_layers=1, n_heads=4,
            q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, n_routed=16, n_shared=1, top_k=2, moe_hidden=256, dense_hidden=768,
            max_seq_len=256, **{**PRESET_BALANCING, "bias_lr_ratio": SMALL_BIAS_LR_RATIO},
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def gpu(cls, **overrides) -> ModelConfig:
        """One Hopper GPU: d_model 768, 12 layers (1 dense), 32 fine-grained routed experts (top-4)
        + 1 shared, ~270M total / ~65M activated parameters; every GEMM dimension a multiple of 128
        except the RoPE slices."""
        base = cls(
            d_model=768, n_layers=12, n_dense_layers=1, n_heads=8,
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=128, n_routed=32, n_shared=1, top_k=4, moe_hidden=256, dense_hidden=2048,
            max_seq_len=1024, **PRESET_BALANCING,
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def wide(cls, **overrides) -> ModelConfig:
        """One H100 filled at a realistic width: d_model 2048, 8 layers (1 dense), 16 heads, 64
        fine-grained routed experts (top-6) + 1 shared of width 512, MLA ranks 768 (query) and 512
        (key/value) with DeepSeek-V3's head widths (128 + 64 RoPE, value 128). Every GEMM dimension
        is a multiple of 128 except the key/value down-projection's 512 + 64 RoPE outputs. Sized
        with the deviceless memory analysis at batch 8 x 2048 tokens (docs/gpu.md)."""
        base = cls(
            d_model=2048, n_layers=8, n_dense_layers=1, n_heads=16,
            q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed=64, n_shared=1, top_k=6, moe_hidden=512, dense_hidden=5376,
            max_seq_len=2048, **PRESET_BALANCING,
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def wide4k(cls, **overrides) -> ModelConfig:
        """One H100 filled at the top of the width range FP8 is benchmarked at: `wide` at d_model
        4096, 4 layers (1 dense, SwiGLU 10752), 32 heads, 32 routed experts (top-6) + 1 shared of width
        1024 (a quarter of d_model; DeepSeek-V3 has 2048 at 7168), MLA ranks 1536 (query) and 512
        (key/value) with DeepSeek-V3's head widths. As wide, every GEMM dimension is a multiple of
        128 but the key/value down-projection's 512 + 64 RoPE outputs. Sized with the deviceless
        memory analysis at batch 8 x 2048 tokens: 56.8 GB FP8, 59.4 GB BF16 (docs/gpu.md). Twice
        wide's width and half its depth: each layer's GEMMs grow as d_model² and its quantized bytes
        as d_model, so FP8's GEMM savings outweigh its quantizations (the step model: FP8 0.92 of
        BF16's step time here, 1.05 at wide; predicted, not measured)."""
        base = cls.wide(d_model=4096, n_layers=4, n_heads=32, q_lora_rank=1536, n_routed=32, moe_hidden=1024,
                        dense_hidden=10752)
        return dataclasses.replace(base, **overrides)

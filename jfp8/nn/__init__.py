"""jfp8.nn: a DeepSeek-V3-style model (MLA, DeepSeekMoE, MTP) in Flax NNX on jfp8's FP8 ops.

    from flax import nnx
    from jfp8.nn import ModelConfig, Transformer, model_loss, update_router_biases

    model = Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    logits, aux = model(tokens)            # tokens: int32 [B, T]
    loss, parts = model_loss(model, tokens)
    update_router_biases(model, parts["expert_loads"])   # after each optimizer step

`ModelConfig(recipe=Fp8Recipe.off())` is the BF16 baseline of the same model.
"""

from jfp8.nn.config import ModelConfig
from jfp8.nn.counts import ParamCounts, param_counts, state_size
from jfp8.nn.fp8_weights import fp8_weights, using_fp8_weights
from jfp8.nn.layers import MLA, Fp8Linear, RMSNorm, SwiGLU, apply_rope, causal_attention, rope_angles
from jfp8.nn.model import (
    MTP,
    Block,
    ModelAux,
    Transformer,
    cross_entropy,
    loss_from_outputs,
    model_loss,
    router_biases,
    shifted_targets,
    update_router_biases,
)
from jfp8.nn.moe import (
    MoE,
    MoEStats,
    RouterBias,
    balance_statistics,
    bias_freeze_step,
    bias_update_speed,
    combine,
    dispatch,
    expert_loads,
    route,
    router_scores,
    select_experts,
    sequence_balance_loss,
    top_k_routing,
    update_bias,
)

__all__ = [
    "fp8_weights",
    "using_fp8_weights",
    "ModelConfig",
    "Transformer",
    "ModelAux",
    "model_loss",
    "loss_from_outputs",
    "cross_entropy",
    "shifted_targets",
    "update_router_biases",
    "router_biases",
    "param_counts",
    "ParamCounts",
    "state_size",
    "Block",
    "MTP",
    "MLA",
    "MoE",
    "MoEStats",
    "RouterBias",
    "Fp8Linear",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "causal_attention",
    "rope_angles",
    "router_scores",
    "select_experts",
    "top_k_routing",
    "route",
    "dispatch",
    "combine",
    "expert_loads",
    "sequence_balance_loss",
    "update_bias",
    "bias_update_speed",
    "bias_freeze_step",
    "balance_statistics",
]

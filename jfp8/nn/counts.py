"""Parameter counts from the config's formulas, checked against a model's actual `nnx.state`."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jfp8.nn.config import ModelConfig
from jfp8.nn.moe import RouterBias


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Trainable parameter counts (`nnx.Param` elements) of a `ModelConfig`.

    Per-layer fields count one block's component; `total`, `main`, `activated` are whole-model.

    Attributes:
      embedding, head: V·d each (untied; the MTP module shares both).
      attention: one MLA (five projections + the two latent RMSNorms).
      dense_ffn: one dense SwiGLU (3·d·dense_hidden).
      moe_routed: all N_r routed experts of one MoE layer (N_r·3·d·moe_hidden).
      moe_shared: the N_s shared experts of one MoE layer.
      gate: one router (d·N_r).
      mtp: the whole MTP module (norms, projection M, block, final norm).
      main: the main model (everything but MTP).
      total: main + mtp.
      activated: main-model parameters one token uses: everything except the N_r − K routed
        experts it is not sent to, in every MoE layer (DeepSeek's "activated parameters").
      router_bias: non-trainable `RouterBias` elements (N_r per MoE layer), not in `total`.
    """

    embedding: int
    head: int
    attention: int
    dense_ffn: int
    moe_routed: int
    moe_shared: int
    gate: int
    mtp: int
    main: int
    total: int
    activated: int
    router_bias: int


def _formulas(cfg: ModelConfig) -> ParamCounts:
    d, h, v = cfg.d_model, cfg.n_heads, cfg.vocab_size
    q, kv, nope, rope, vd = (
        cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
    )
    attention = (
        d * q + q  # W^DQ, q_norm
        + q * h * (nope + rope)  # W^UQ, W^QR
        + d * (kv + rope) + kv  # W^DKV, W^KR, kv_norm
        + kv * h * (nope + vd)  # W^UK, W^UV
        + h * vd * d  # W^O
    )
    expert = 3 * d * cfg.moe_hidden
    dense_ffn = 3 * d * cfg.dense_hidden
    moe_routed, moe_shared, gate = cfg.n_routed * expert, cfg.n_shared * expert, d * cfg.n_routed
    norms = 2 * d  # attn_norm, ffn_norm
    dense_block = attention + norms + dense_ffn
    moe_block = attention + norms + moe_routed + moe_shared + gate
    n_moe_main = cfg.n_layers - cfg.n_dense_layers
    main = 2 * v * d + d + cfg.n_dense_layers * dense_block + n_moe_main * moe_block
    mtp = (2 * d + 2 * d * d + moe_block + d) if cfg.mtp else 0  # norms, M, block, final norm
    inactive = n_moe_main * (cfg.n_routed - cfg.top_k) * expert
    return ParamCounts(
        embedding=v * d, head=d * v, attention=attention, dense_ffn=dense_ffn,
        moe_routed=moe_routed, moe_shared=moe_shared, gate=gate, mtp=mtp, main=main,
        total=main + mtp, activated=main - inactive, router_bias=cfg.n_moe_layers * cfg.n_routed,
    )


def state_size(module: nnx.Module, kind: type = nnx.Param) -> int:
    """Elements of the variables of type `kind` in `module`'s `nnx.state`."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, kind)))


def param_counts(config_or_model) -> ParamCounts:
    """Total and activated parameter counts of a `ModelConfig` (formulas), or of a `Transformer`.

    Given a model, the formulas for its config are checked against the sizes in its `nnx.state`
    (Params and RouterBias) and a mismatch raises `RuntimeError`.
    """
    if isinstance(config_or_model, ModelConfig):
        return _formulas(config_or_model)
    config = getattr(config_or_model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"expected a ModelConfig or a Transformer, got {type(config_or_model).__name__}")
    counts = _formulas(config)
    actual = state_size(config_or_model, nnx.Param)
    actual_bias = state_size(config_or_model, RouterBias)
    if (actual, actual_bias) != (counts.total, counts.router_bias):
        raise RuntimeError(
            f"parameter formulas disagree with the model's state: Params {counts.total} (formula) vs "
            f"{actual} (state), RouterBias {counts.router_bias} vs {actual_bias}; "
            "update jfp8/nn/counts.py along with the modules"
        )
    return counts

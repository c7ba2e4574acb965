"""The DeepSeek-V3-style decoder: blocks, Multi-Token Prediction, `Transformer`, and its loss.

    tokens [B, T] ─ Embed ─ Block × n_layers ─ RMSNorm ─ Head ─ logits [B, T, V]     (predicts t+1)
                                         │ h_t
          Emb(token_{t+1}) ─ RMSNorm ─┐  └ RMSNorm ─┐
                                      concat ─ M (2d→d) ─ Block ─ RMSNorm ─ Head ─ mtp_logits  (t+2)

Blocks are pre-norm: x += MLA(norm(x)); x += FFN(norm(x)), FFN = dense SwiGLU for the first
`n_dense_layers` blocks and DeepSeekMoE after. Embedding and head are FP32 weights used in BF16
with FP32 logits (not FP8); the MTP module shares both with the main model (§2.2).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jfp8.nn.config import ModelConfig
from jfp8.nn.layers import MLA, Fp8Linear, RMSNorm, SwiGLU, normal_init
from jfp8.nn.moe import MoE, MoEStats, update_bias


class Block(nnx.Module):
    """Pre-norm transformer block: MLA then a dense SwiGLU or an MoE FFN."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = MLA(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = (
            MoE(cfg, rngs=rngs)
            if moe
            else SwiGLU(cfg.d_model, cfg.dense_hidden, recipe=cfg.recipe, init_std=cfg.init_std, rngs=rngs)
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats | None]:
        """x [B, T, d] -> (x [B, T, d], MoEStats or None for a dense block)."""
        x = x + self.attn(self.attn_norm(x))
        if isinstance(self.ffn, MoE):
            y, stats = self.ffn(self.ffn_norm(x))
            return x + y, stats
        return x + self.ffn(self.ffn_norm(x)), None


class MTP(nnx.Module):
    """Depth-1 Multi-Token Prediction module (§2.2, eq. 21-23).

    h'_t = M [RMSNorm(h_t); RMSNorm(Emb(token_{t+1}))], then one block (causal over t), then a
    final RMSNorm; the caller applies the shared output head to predict token t+2.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.hidden_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.embed_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.proj = Fp8Linear(2 * d, d, recipe=cfg.recipe, init_std=cfg.init_std, rngs=rngs)  # M
        self.block = Block(cfg, moe=True, rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.norm_eps)

    def __call__(self, h: jax.Array, next_emb: jax.Array) -> tuple[jax.Array, MoEStats]:
        """h [B, T, d] main-model hidden states, next_emb [B, T, d] embeddings of token t+1
        (zeros past the end) -> (normalised hidden [B, T, d], the block's MoEStats)."""
        x = self.proj(jnp.concatenate([self.hidden_norm(h), self.embed_norm(next_emb)], axis=-1))
        x, stats = self.block(x)
        return self.norm(x), stats


class ModelAux(NamedTuple):
    """Everything `Transformer.__call__` returns besides the logits (a pytree).

    Attributes:
      mtp_logits: [B, T, V] FP32 predictions of token t+2 at position t, or None (MTP off).
        Positions T-2 and T-1 have no target.
      expert_loads: [n_moe_layers, E] int32 tokens per routed expert, one row per MoE layer in
        `Transformer.moe_layers()` order (main blocks, then the MTP block; no MTP row when called
        with `with_mtp=False`). Feed it to `update_router_biases` after the step.
      balance_loss: () FP32, the α-weighted sequence-wise balance loss summed over MoE layers.
    """

    mtp_logits: jax.Array | None
    expert_loads: jax.Array
    balance_loss: jax.Array


class Transformer(nnx.Module):
    """DeepSeek-V3-style decoder with MLA, DeepSeekMoE and optional depth-1 MTP, FP8 projections.

    `Transformer(config, rngs=nnx.Rngs(0))(tokens)` with int tokens [B, T] returns
    `(logits [B, T, V] FP32, ModelAux)`; logits[:, t] predicts token t+1.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg = config
        self.embed = nnx.Param(normal_init(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std))  # [V, d]
        self.blocks = nnx.List(
            [Block(cfg, moe=i >= cfg.n_dense_layers, rngs=rngs) for i in range(cfg.n_layers)]
        )
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nnx.Param(normal_init(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std))  # [d, V]
        self.mtp = MTP(cfg, rngs=rngs) if cfg.mtp else None

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in `aux.expert_loads` row order: main blocks, then the MTP block."""
        blocks = list(self.blocks) + ([self.mtp.block] if self.mtp is not None else [])
        return [b.ffn for b in blocks if isinstance(b.ffn, MoE)]

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.config.compute_dtype)

    def _head(self, h: jax.Array) -> jax.Array:
        """Output head in the compute dtype with FP32 accumulation -> FP32 logits."""
        w = self.head[...].astype(h.dtype)
        return jnp.dot(h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, *, with_mtp: bool = True) -> tuple[jax.Array, ModelAux]:
        """Run the model.

        Args:
          tokens: [B, T] integer token ids in [0, vocab_size), T <= max_seq_len.
          with_mtp: run the MTP module when the config has one; False drops it (inference).

        Returns:
          logits [B, T, V] FP32 and a `ModelAux` (MTP logits, per-layer expert loads, balance loss).
        """
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer [B, T] array, got {tokens.dtype} {tokens.shape}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={cfg.max_seq_len}; "
                "shorten the input or raise ModelConfig.max_seq_len"
            )
        x = self._embed(tokens)  # [B, T, d]
        stats = []
        for block in self.blocks:
            x, s = block(x)
            if s is not None:
                stats.append(s)
        logits = self._head(self.norm(x))  # [B, T, V]

        mtp_logits = None
        if self.mtp is not None and with_mtp:
            next_emb = jnp.pad(self._embed(tokens[:, 1:]), ((0, 0), (0, 1), (0, 0)))  # [B, T, d]
            h_mtp, s = self.mtp(x, next_emb)
            stats.append(s)
            mtp_logits = self._head(h_mtp)  # [B, T, V]: position t predicts token t+2

        if stats:
            loads = jnp.stack([s.loads for s in stats])  # [L_moe, E]
            balance = sum(s.balance_loss for s in stats)
        else:
            loads = jnp.zeros((0, cfg.n_routed), jnp.int32)
            balance = jnp.zeros((), jnp.float32)
        return logits, ModelAux(mtp_logits=mtp_logits, expert_loads=loads, balance_loss=balance)


# ------------------------------------------------------------------------------ loss, balancing


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in FP32 over positions where `mask` is true.

    logits [..., V], targets [...] int, mask [...] bool (all true when None) -> () FP32.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def shifted_targets(tokens: jax.Array, shift: int) -> tuple[jax.Array, jax.Array]:
    """Targets token_{t+shift} for every position t of tokens [B, T], and the mask of positions
    that have one (t < T - shift). Returns (targets [B, T] int32, mask [B, T] bool)."""
    b, t = tokens.shape
    targets = jnp.pad(tokens[:, shift:], ((0, 0), (0, min(shift, t)))).astype(jnp.int32)
    mask = jnp.broadcast_to(jnp.arange(t) < t - shift, (b, t))
    return targets, mask


def model_loss(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training loss: next-token CE + λ · MTP CE (targets two ahead) + sequence-wise balance loss.

    Args:
      model: a `Transformer`.
      tokens: [B, T] int tokens; the last position (last two for MTP) has no target and is masked.

    Returns:
      (total, parts) with parts = {"ce", "mtp_ce" (0 without MTP), "balance", "expert_loads"
      ([n_moe_layers, E], for `update_router_biases`)}.
    """
    logits, aux = model(tokens)
    return loss_from_outputs(model.config, tokens, logits, aux)


def loss_from_outputs(
    config: ModelConfig, tokens: jax.Array, logits: jax.Array, aux: ModelAux
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`model_loss` from an existing forward pass `(logits, aux) = model(tokens)`."""
    targets, mask = shifted_targets(tokens, 1)
    ce = cross_entropy(logits, targets, mask)
    total = ce + aux.balance_loss
    mtp_ce = jnp.zeros((), jnp.float32)
    if aux.mtp_logits is not None:
        targets2, mask2 = shifted_targets(tokens, 2)
        mtp_ce = cross_entropy(aux.mtp_logits, targets2, mask2)
        total = total + config.mtp_lambda * mtp_ce
    parts = {"ce": ce, "mtp_ce": mtp_ce, "balance": aux.balance_loss, "expert_loads": aux.expert_loads}
    return total, parts


def update_router_biases(
    model: Transformer, expert_loads: jax.Array | ModelAux, gamma: float | jax.Array | None = None
) -> None:
    """Auxiliary-loss-free balancing after a step: `update_bias` with the config's `bias_rule` on
    every MoE layer (sign rule: b_i += γ·sign(mean load − load_i)).

    Updates the `RouterBias` variables in place (eagerly or inside `nnx.jit`); they are not
    `nnx.Param`s, so gradients and `nnx.Optimizer(..., wrt=nnx.Param)` never touch them. With
    gradient accumulation or data parallelism, sum the loads of the whole step first.

    Args:
      model: the `Transformer` whose `RouterBias` variables are updated in place.
      expert_loads: [n_moe_layers, E] loads from `aux.expert_loads` / `parts["expert_loads"]`,
        or the `ModelAux` itself.
      gamma: this step's γ_t, e.g. `bias_update_speed(config, step, lr, total_steps)`; None means
        `config.bias_gamma` and needs `bias_schedule="constant"`.
    """
    if isinstance(expert_loads, ModelAux):
        expert_loads = expert_loads.expert_loads
    cfg = model.config
    layers = model.moe_layers()
    if expert_loads.shape != (len(layers), cfg.n_routed):
        raise ValueError(
            f"expert_loads has shape {expert_loads.shape}, expected ({len(layers)}, "
            f"{cfg.n_routed}): one row per MoE layer (did the forward pass skip MTP?)"
        )
    if gamma is None:
        if cfg.bias_schedule != "constant":
            raise ValueError(
                f"bias_schedule={cfg.bias_schedule!r} ties γ to the learning rate: pass "
                "gamma=bias_update_speed(config, step, lr, total_steps), or use bias_schedule='constant'"
            )
        gamma = cfg.bias_gamma
    for moe, loads in zip(layers, expert_loads):
        moe.router_bias[...] = update_bias(moe.router_bias[...], loads, gamma, cfg.bias_rule, cfg.bias_gain)


def router_biases(model: Transformer) -> jax.Array:
    """The router biases of every MoE layer, [n_moe_layers, E] FP32 in `moe_layers()` order."""
    layers = model.moe_layers()
    if not layers:
        return jnp.zeros((0, model.config.n_routed), jnp.float32)
    return jnp.stack([moe.router_bias[...] for moe in layers])

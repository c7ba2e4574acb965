"""The Transformer: outputs and aux, Multi-Token Prediction, the loss, FP8 vs BF16, parameter counts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfp8.nn import (
    MoE,
    ModelAux,
    ModelConfig,
    RouterBias,
    SwiGLU,
    Transformer,
    cross_entropy,
    loss_from_outputs,
    model_loss,
    param_counts,
    shifted_targets,
    state_size,
    update_router_biases,
)
from jfp8.recipe import Fp8Recipe
from helpers import fresh_rng as _rng, rel_error as _rel

QUANT_BOUND = 0.06  # as tests/test_ops.py: two E4M3 operands per GEMM, ~3.7 % rms expected


def _tokens(rng, b, t, vocab=256):
    return jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)


def test_shifted_targets():
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    targets, mask = shifted_targets(tokens, 2)
    np.testing.assert_array_equal(targets[:, :4], tokens[:, 2:])
    np.testing.assert_array_equal(mask, [[True] * 4 + [False] * 2] * 2)
    targets, mask = shifted_targets(tokens, 1)
    np.testing.assert_array_equal(targets[:, :5], tokens[:, 1:])
    assert not mask[:, 5].any() and mask[:, :5].all()


# One dense block + the MTP block (MoE): a small compile that still runs every module.
MTP_CFG = ModelConfig.tiny(recipe=Fp8Recipe.off(), n_layers=1, n_dense_layers=1)


@pytest.fixture(scope="module")
def mtp_model():
    model = Transformer(MTP_CFG, rngs=nnx.Rngs(0))
    both = jax.jit(lambda m, t: (m(t), model_loss(m, t)))
    return model, both


def test_forward_outputs_and_aux(mtp_model):
    model, both = mtp_model
    rng, _ = _rng()
    b, t, cfg = 2, 16, MTP_CFG
    (logits, aux), (loss, parts) = both(model, _tokens(rng, b, t))
    assert isinstance(aux, ModelAux)
    chex.assert_shape((logits, aux.mtp_logits), (b, t, cfg.vocab_size))
    assert logits.dtype == aux.mtp_logits.dtype == jnp.float32
    chex.assert_shape(aux.expert_loads, (cfg.n_moe_layers, cfg.n_routed))  # the MTP block's MoE
    np.testing.assert_array_equal(aux.expert_loads.sum(-1), b * t * cfg.top_k)  # dropless
    assert aux.balance_loss.shape == () and float(aux.balance_loss) > 0
    assert isinstance(model.blocks[0].ffn, SwiGLU) and isinstance(model.mtp.block.ffn, MoE)


def test_mtp_predicts_two_ahead_and_loss_parts(mtp_model):
    model, both = mtp_model
    rng, seed = _rng()
    tokens = _tokens(rng, 2, 16)
    (logits, aux), (loss, parts) = both(model, tokens)
    ce = cross_entropy(logits[:, :-1], tokens[:, 1:])
    mtp_ce = cross_entropy(aux.mtp_logits[:, :-2], tokens[:, 2:])  # position t predicts t+2
    np.testing.assert_allclose(parts["ce"], ce, rtol=1e-5)
    np.testing.assert_allclose(parts["mtp_ce"], mtp_ce, rtol=1e-5)
    np.testing.assert_allclose(parts["balance"], aux.balance_loss, rtol=1e-6)
    np.testing.assert_allclose(loss, ce + MTP_CFG.mtp_lambda * mtp_ce + aux.balance_loss, rtol=1e-5)
    np.testing.assert_array_equal(parts["expert_loads"], aux.expert_loads)


def test_main_and_mtp_logits_are_causal(mtp_model):
    """Changing token t0 leaves main logits before t0 and MTP logits before t0 - 1 unchanged (MTP
    position t sees tokens <= t + 1), and does change MTP position t0 - 1."""
    model, both = mtp_model
    rng, seed = _rng()
    t, t0 = 16, int(rng.integers(2, 15))
    tokens = _tokens(rng, 2, t)
    changed = tokens.at[:, t0].set((tokens[:, t0] + 1 + int(rng.integers(254))) % 256)
    (logits, aux), _ = both(model, tokens)
    (logits2, aux2), _ = both(model, changed)
    tol = dict(rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}, t0 {t0}")
    np.testing.assert_allclose(logits2[:, :t0], logits[:, :t0], **tol)
    np.testing.assert_allclose(aux2.mtp_logits[:, : t0 - 1], aux.mtp_logits[:, : t0 - 1], **tol)
    assert _rel(aux2.mtp_logits[:, t0 - 1], aux.mtp_logits[:, t0 - 1]) > 1e-4


def test_mtp_can_be_dropped_or_disabled(mtp_model):
    model, both = mtp_model
    rng, _ = _rng()
    tokens = _tokens(rng, 2, 16)
    (logits, _), _ = both(model, tokens)
    # dropped at inference: same main logits, no MTP logits, one MoE layer fewer in the loads
    logits_inf, aux_inf = jax.jit(lambda m, t: m(t, with_mtp=False))(model, tokens)
    np.testing.assert_allclose(logits_inf, logits, rtol=1e-6, atol=1e-6)
    assert aux_inf.mtp_logits is None and aux_inf.expert_loads.shape == (0, MTP_CFG.n_routed)

    # disabled in the config: no module, no parameters, no MTP term in the loss
    cfg = MTP_CFG.replace(mtp=False, n_layers=2)  # one dense + one MoE block
    plain = Transformer(cfg, rngs=nnx.Rngs(1))
    assert plain.mtp is None and param_counts(plain).mtp == 0
    loss, parts = jax.jit(model_loss)(plain, tokens)
    assert float(parts["mtp_ce"]) == 0.0
    np.testing.assert_allclose(loss, parts["ce"] + parts["balance"], rtol=1e-6)
    assert parts["expert_loads"].shape == (1, cfg.n_routed)


def test_bad_inputs_raise_actionable_errors(mtp_model):
    model, _ = mtp_model
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, MTP_CFG.max_seq_len + 1), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.tiny(top_k=5)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.tiny(dtype="float16")


def test_router_bias_is_state_not_param_and_updates(mtp_model):
    model = nnx.clone(mtp_model[0])
    layers = model.moe_layers()
    assert len(layers) == MTP_CFG.n_moe_layers == 1  # the MTP block's MoE
    assert isinstance(layers[0].router_bias, RouterBias) and not isinstance(layers[0].router_bias, nnx.Param)
    assert state_size(model, RouterBias) == MTP_CFG.n_routed  # present as state ...
    param_paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert not any("router_bias" in p for p in param_paths)  # ... but invisible to grads/optimizers

    model.config = MTP_CFG.replace(bias_rule="sign")  # the config's rule: ±γ
    update_router_biases(model, jnp.array([[9, 1, 5, 5]], jnp.int32), gamma=0.5)
    np.testing.assert_allclose(layers[0].router_bias[...], [-0.5, 0.5, 0.0, 0.0])
    assert MTP_CFG.bias_schedule == "lr"  # γ comes from the step's learning rate: no default
    with pytest.raises(ValueError, match="ties γ to the learning rate"):
        update_router_biases(model, jnp.array([[5, 5, 1, 9]], jnp.int32))
    model.config = MTP_CFG.replace(bias_rule="sign", bias_schedule="constant")  # γ = config.bias_gamma
    update_router_biases(model, ModelAux(None, jnp.array([[5, 5, 1, 9]], jnp.int32), jnp.zeros(())))
    g = MTP_CFG.bias_gamma
    np.testing.assert_allclose(layers[0].router_bias[...], [-0.5, 0.5, g, -g], rtol=1e-6)
    model.config = MTP_CFG.replace(bias_rule="clipped")  # the config's rule: γ·clip((5 − load)/5, ±1)
    update_router_biases(model, jnp.array([[10, 5, 0, 5]], jnp.int32), gamma=0.5)
    np.testing.assert_allclose(layers[0].router_bias[...], [-1.0, 0.5, g + 0.5, -g], rtol=1e-6)
    model.config = MTP_CFG.replace(bias_rule="clipped", bias_gain=4.0)  # γ·clip(4·(5 − load)/5, ±1)
    update_router_biases(model, jnp.array([[6, 5, 4, 5]], jnp.int32), gamma=0.5)
    np.testing.assert_allclose(layers[0].router_bias[...], [-1.4, 0.5, g + 0.9, -g], rtol=1e-6)
    with pytest.raises(ValueError, match="one row per MoE layer"):
        update_router_biases(model, jnp.ones((2, MTP_CFG.n_routed), jnp.int32))


@pytest.mark.slow
def test_fp8_vs_bf16_same_weights():
    """FP8 (DeepSeek recipe) and BF16 logits and losses of the same weights agree within the E4M3
    bound, and the FP8 gradients of every parameter are finite and non-zero. (Gradient accuracy of
    the FP8 ops themselves is tested against f32 autodiff in tests/test_ops.py.)"""
    rng, seed = _rng()
    cfg = ModelConfig.tiny(n_layers=1, n_dense_layers=0, mtp=False)  # MLA + MoE: every FP8 op kind
    fp8 = Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    abstract_bf16 = nnx.eval_shape(lambda: Transformer(cfg.replace(recipe=Fp8Recipe.off()), rngs=nnx.Rngs(0)))
    bf16 = nnx.merge(nnx.graphdef(abstract_bf16), nnx.state(fp8))  # same weights, BF16 recipe
    tokens = _tokens(rng, 2, 32)

    graphdef, params, rest = nnx.split(fp8, nnx.Param, ...)

    def loss(p, model=None):
        logits, aux = (model or nnx.merge(graphdef, p, rest))(tokens)
        return loss_from_outputs(cfg, tokens, logits, aux)[0], logits

    (loss8, logits8), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    loss16, logits16 = jax.jit(lambda m: loss(None, m))(bf16)
    assert _rel(logits8, logits16) < QUANT_BOUND, f"seed {seed}: {_rel(logits8, logits16)}"
    assert abs(float(loss8) - float(loss16)) < 1e-2 * float(loss16), f"seed {seed}"
    for path, g in nnx.to_flat_state(grads):
        assert bool(jnp.isfinite(g[...]).all()), f"seed {seed}: non-finite gradient at {path}"
        assert bool((g[...] != 0).any()), f"seed {seed}: zero gradient at {path}"


@pytest.mark.parametrize("preset", ["tiny", "small", "gpu", "wide", "wide4k"])
@pytest.mark.parametrize("mtp", [True, False])
def test_param_counts_match_state(preset, mtp):
    cfg = getattr(ModelConfig, preset)(mtp=mtp)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # shapes only, no memory
    counts = param_counts(model)  # raises if the formulas disagree with the state
    assert counts == param_counts(cfg)

    # component by component against the module states
    moe_blocks = [b for b in model.blocks if isinstance(b.ffn, MoE)]
    dense_blocks = [b for b in model.blocks if isinstance(b.ffn, SwiGLU)]
    assert len(dense_blocks) == cfg.n_dense_layers
    assert counts.embedding == model.embed.size and counts.head == model.head.size
    assert counts.attention == state_size(model.blocks[0].attn)
    if dense_blocks:
        assert counts.dense_ffn == state_size(dense_blocks[0].ffn)
    routed = moe_blocks[0].ffn.w13.size + moe_blocks[0].ffn.w2.size
    assert counts.moe_routed == routed
    assert counts.moe_shared == state_size(moe_blocks[0].ffn.shared)
    assert counts.gate == moe_blocks[0].ffn.gate.size
    assert counts.mtp == (state_size(model.mtp) if mtp else 0)
    assert counts.router_bias == state_size(model, RouterBias) == cfg.n_moe_layers * cfg.n_routed
    # activated: one token uses top_k of the n_routed experts of each main-model MoE layer
    inactive = len(moe_blocks) * routed * (cfg.n_routed - cfg.top_k) // cfg.n_routed
    assert counts.activated == counts.total - counts.mtp - inactive
    print(f"{preset} mtp={mtp}: total {counts.total / 1e6:.2f}M, main {counts.main / 1e6:.2f}M, "
          f"activated {counts.activated / 1e6:.2f}M")


def test_preset_sizes():
    assert 10e6 <= param_counts(ModelConfig.small()).total <= 30e6
    assert 100e6 <= param_counts(ModelConfig.gpu()).total <= 300e6
    for wide in (ModelConfig.wide(), ModelConfig.wide4k()):
        assert 1e9 <= param_counts(wide).total <= 2.5e9 and 2048 <= wide.d_model <= 4096
        # every GEMM dimension a multiple of 128, but the key/value down-projection's RoPE part
        dims = (wide.d_model, wide.q_lora_rank, wide.kv_lora_rank, wide.n_heads * wide.qk_head_dim,
                wide.n_heads * (wide.qk_nope_head_dim + wide.v_head_dim), wide.n_heads * wide.v_head_dim,
                wide.moe_hidden, wide.dense_hidden)
        assert all(d % 128 == 0 for d in dims), dims
    small = ModelConfig.small(n_routed=8, top_k=3)  # presets take overrides
    assert (small.n_routed, small.top_k, small.d_model) == (8, 3, 256)


def test_presets_balance_with_the_measured_rule():
    """Every preset uses the clipped, lr-tied bias update; κ is the one measured for its size
    (tiny, gpu, wide and wide4k 15, small 50), and an override still wins."""
    from jfp8.nn.config import PRESET_BALANCING, SMALL_BIAS_LR_RATIO

    kappas = {"tiny": 15.0, "small": SMALL_BIAS_LR_RATIO, "gpu": 15.0, "wide": 15.0, "wide4k": 15.0}
    assert SMALL_BIAS_LR_RATIO == 50.0
    for name, kappa in kappas.items():
        cfg = getattr(ModelConfig, name)()
        assert (cfg.bias_rule, cfg.bias_schedule) == (PRESET_BALANCING["bias_rule"], PRESET_BALANCING["bias_schedule"])
        assert cfg.bias_lr_ratio == kappa, name
    assert ModelConfig.small(bias_lr_ratio=15.0).bias_lr_ratio == 15.0

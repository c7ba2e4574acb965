"""`fp8_weight`: a weight's FP8 copies quantized once and handed to the ops (`w_fp8=`), with the
bits of the ops quantizing it themselves, no gradient through the copies, and clear errors for
copies that are not the weight's under the op's recipe."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfp8
from jfp8 import TILE, Fp8Recipe, fp8_linear, fp8_weight, grouped_fp8_linear
from jfp8.ops import gathered_grouped_fp8_linear
from helpers import assert_bitwise_equal, fresh_rng

XLA = Fp8Recipe(impl="xla")
RECIPES = [XLA, Fp8Recipe.per_tensor(impl="xla"), Fp8Recipe(dgrad=False, impl="xla"),
           Fp8Recipe(fprop=False, impl="xla"), Fp8Recipe(pow2_scale=True, impl="xla"), Fp8Recipe.off(impl="xla")]
IDS = ["deepseek", "per-tensor", "no-dgrad", "no-fprop", "pow2", "off"]
KERNELS = Fp8Recipe(interpret=True)  # the Mosaic GPU interpreter: the kernels' quantizers make the copies


@functools.partial(jax.jit, static_argnames=("recipe", "prequantized"))
def _linear_vjp(x, w, dy, recipe, prequantized):
    w_fp8 = fp8_weight(w, recipe) if prequantized else None
    y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe, w_fp8=w_fp8), x, w)
    return (y, *vjp(dy))


@pytest.mark.parametrize(
    "recipe,m,k,n,w_dtype",
    [(r, *shape) for r in RECIPES for shape in [(37, 300, 70, jnp.float32), (130, 256, 128, jnp.bfloat16)]]
    + [(KERNELS, 37, 300, 70, jnp.float32)],
    ids=[f"{i}-{s}" for i in IDS for s in ("tails", "bf16-master")] + ["kernels-tails"],
)
def test_linear_with_its_fp8_weight_gives_the_same_bits(recipe, m, k, n, w_dtype):
    """y, dx and dW with the copies given equal those of the op quantizing W itself, at shapes
    with tails in every dimension and for a bf16 master (whose dW comes back in bf16)."""
    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), w_dtype)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    for got, want in zip(_linear_vjp(x, w, dy, recipe, True), _linear_vjp(x, w, dy, recipe, False)):
        assert_bitwise_equal(got, want, seed)


def test_a_weight_quantized_once_serves_many_calls_and_its_gradient_goes_to_the_master():
    """Quantized outside `grad` and closed over (frozen copies, as in an eval loop or across the
    micro-batches of one update), the copies give each batch the op's own bits, and the gradient
    reaches `w` through the op alone: computed inside `grad`, `fp8_weight` adds nothing to it."""
    rng, seed = fresh_rng()
    w = jnp.asarray(rng.standard_normal((256, 192)) / 16, jnp.float32)
    w_fp8 = jax.jit(fp8_weight, static_argnums=1)(w, XLA)
    loss = lambda w, x, w_fp8=None: jnp.sum(fp8_linear(x, w, XLA, w_fp8=w_fp8).astype(jnp.float32) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
        assert_bitwise_equal(grad(w, x, w_fp8), grad(w, x), seed)
        inside = jax.jit(jax.grad(lambda w, x: loss(w, x, fp8_weight(w, XLA))))(w, x)
        assert_bitwise_equal(inside, grad(w, x), seed)
    # The op computes with the copies it is given: a stale copy gives the stale weight's outputs.
    w_old = w * 0.5
    stale = fp8_linear(x, w, XLA, w_fp8=fp8_weight(w_old, XLA))
    assert_bitwise_equal(stale, fp8_linear(x, w_old, XLA), seed)


def test_the_copies_replace_the_weight_quantizer_on_the_kernels_path():
    """Lowered for CUDA, a layer's forward and backward with the copies given run 5 Mosaic calls,
    not 6: the weight's quantizer is gone (x's, dy's and the three GEMMs stay)."""
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 384), jnp.float32)
    recipe = Fp8Recipe()

    def calls(prequantized):
        def f(x, w, w_fp8):
            y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe, w_fp8=w_fp8), x, w)
            return y, *vjp(jnp.ones_like(y))
        w_fp8 = jax.eval_shape(lambda w: fp8_weight(w, recipe), w) if prequantized else None
        lowered = jax.jit(f).trace(x, w, w_fp8).lower(lowering_platforms=("cuda",))
        return lowered.as_text().count("custom_call @mosaic_gpu")

    assert calls(False) == 6
    assert calls(True) == 5


def _routed(rng):
    sizes = (100, 0, 150, 20)
    tokens = jnp.asarray(rng.standard_normal((90, 256)), jnp.bfloat16)
    rows = jnp.asarray(np.sort(rng.integers(0, 90, sum(sizes) + 10)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((len(sizes), 256, 136)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((len(rows), 136)), jnp.bfloat16)
    return tokens, rows, w, jnp.asarray(sizes, jnp.int32), dy


@functools.partial(jax.jit, static_argnames=("recipe", "prequantized", "gathered"))
def _grouped_vjp(tokens, rows, w, sizes, dy, recipe, prequantized, gathered):
    w_fp8 = fp8_weight(w, recipe) if prequantized else None

    def f(t, w):
        if gathered:
            return gathered_grouped_fp8_linear(t, rows, w, sizes, recipe, w_fp8=w_fp8)
        return grouped_fp8_linear(jnp.take(t, rows, axis=0), w, sizes, recipe, w_fp8=w_fp8)

    y, vjp = jax.vjp(f, tokens, w)
    return (y, *vjp(dy))


@pytest.mark.parametrize("gathered", [False, True], ids=["grouped", "gathered"])
@pytest.mark.parametrize("recipe", [XLA, Fp8Recipe(dgrad=False, impl="xla"), Fp8Recipe.off(impl="xla")],
                         ids=["deepseek", "no-dgrad", "off"])
def test_grouped_ops_with_their_fp8_weights_give_the_same_bits(recipe, gathered):
    """The experts' ops (an empty group and rows past the groups included): y, d tokens, dW."""
    rng, seed = fresh_rng()
    args = _routed(rng)
    got = _grouped_vjp(*args, recipe=recipe, prequantized=True, gathered=gathered)
    want = _grouped_vjp(*args, recipe=recipe, prequantized=False, gathered=gathered)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w, seed)


def test_fp8_weight_holds_both_orientations_in_the_recipes_blocks():
    """Dgrad's copy is W in 128x128 blocks, Fprop's its transpose, the same bits as `quantize`;
    only the orientations the recipe's FP8 GEMMs read are made."""
    rng, _ = fresh_rng()
    w = jnp.asarray(rng.standard_normal((3, 300, 136)), jnp.float32)
    q = fp8_weight(w, XLA)
    ref = jfp8.quantize(w, (TILE, TILE))
    assert q.shape == (3, 300, 136) and q.dgrad.shape == (3, 300, 136) and q.fprop.shape == (3, 136, 300)
    np.testing.assert_array_equal(np.asarray(q.dgrad.data).view(np.uint8), np.asarray(ref.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.fprop.scale), np.asarray(ref.mT.scale))
    assert fp8_weight(w, Fp8Recipe(fprop=False)).fprop is None
    assert fp8_weight(w, Fp8Recipe(dgrad=False)).dgrad is None
    assert fp8_weight(w, Fp8Recipe.off()).dgrad is None
    assert len(jax.tree.leaves(q)) == 4  # a pytree: jit, device_put and checkpoints take it


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda w: fp8_weight(w[:, :64], XLA), r"copies of a \(256, 64\) weight, but w is \(256, 128\)"),
        (lambda w: fp8_weight(w, Fp8Recipe(pow2_scale=True, impl="xla")), r"pow2_scale=True \(op's False\)"),
        (lambda w: fp8_weight(w, Fp8Recipe(weight_amax_floor=1e-2, impl="xla")), "weight_amax_floor"),
        (lambda w: fp8_weight(w, Fp8Recipe(dgrad=False, impl="xla")), r"dgrad=False \(op's True\)"),
        (lambda w: jfp8.quantize(w, (TILE, TILE)), "must be an Fp8Weight made by jfp8.fp8_weight"),
    ],
    ids=["shape", "pow2", "floor", "gemms", "type"],
)
def test_copies_that_are_not_the_weights_under_the_ops_recipe_are_refused(make, match):
    w = jnp.ones((256, 128), jnp.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        fp8_linear(jnp.ones((4, 256), jnp.bfloat16), w, XLA, w_fp8=make(w))


def test_grouped_ops_refuse_another_weights_copies():
    w = jnp.ones((2, 256, 128), jnp.float32)
    tokens, sizes = jnp.ones((4, 256), jnp.bfloat16), jnp.array([1, 3])
    stale = fp8_weight(w[:, :, :64], XLA)
    with pytest.raises(ValueError, match=r"copies of a \(2, 256, 64\) weight"):
        grouped_fp8_linear(tokens, w, sizes, XLA, w_fp8=stale)
    with pytest.raises(ValueError, match=r"copies of a \(2, 256, 64\) weight"):
        gathered_grouped_fp8_linear(tokens, jnp.arange(4), w, sizes, XLA, w_fp8=stale)
    with pytest.raises(ValueError, match="another recipe"):
        grouped_fp8_linear(tokens, w, sizes, XLA, w_fp8=fp8_weight(w, Fp8Recipe(pow2_scale=True)))


def test_fp8_weight_bad_input():
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        fp8_weight(jnp.ones((128, 128), jnp.int32))
    with pytest.raises(ValueError, match=r"\(K, N\) matrix or \(G, K, N\)"):
        fp8_weight(jnp.ones((128,), jnp.float32))


def test_shard_map_with_replicated_copies():
    """Inside `shard_map`, replicated copies beside sharded activations: dW (psum'd by autodiff)
    equals the op quantizing the replicated W itself."""
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("conftest sets 8 host devices; this process was started with fewer")
    mesh = jax.sharding.Mesh(np.array(devices[:4]), ("data",))
    P = jax.sharding.PartitionSpec
    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((4 * 32, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.float32)

    def grad(prequantized):
        def local(x, w, w_fp8):
            return jax.lax.psum(jnp.sum(fp8_linear(x, w, XLA, w_fp8=w_fp8) ** 2), "data")
        w_fp8 = fp8_weight(w, XLA) if prequantized else None
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P())
        return jax.jit(jax.grad(sharded, argnums=1))(x, w, w_fp8)

    assert_bitwise_equal(grad(True), grad(False), seed)


# ---------------------------------------------------------------------------- a model's copies


def _tiny_model(seed=0, **overrides):
    from flax import nnx

    from jfp8.nn import ModelConfig, Transformer

    model = Transformer(ModelConfig.tiny(**overrides), rngs=nnx.Rngs(seed))
    return (model, *nnx.split(model, nnx.Param, ...))


def test_a_model_with_its_fp8_weights_gives_the_same_loss_and_gradients():
    """`jfp8.nn.fp8_weights` then `using_fp8_weights` inside jit: the loss and every gradient of
    the tiny model (MLA, dense and MoE blocks, MTP) bit for bit those of the model quantizing its
    weights; and the copies are what the layers use: another model's copies of the experts' weights,
    or of one projection's, change the loss."""
    from flax import nnx

    from jfp8.nn import fp8_weights, model_loss, using_fp8_weights

    model, graphdef, params, rest = _tiny_model()
    rng, seed = fresh_rng()
    tokens = jnp.asarray(rng.integers(0, 256, (4, 64)), jnp.int32)

    def loss(params, rest, tokens, weights):
        m = nnx.merge(graphdef, params, rest)
        if weights is None:
            return model_loss(m, tokens)[0]
        with using_fp8_weights(m, weights):
            return model_loss(m, tokens)[0]

    weights = jax.jit(lambda p, r: fp8_weights(nnx.merge(graphdef, p, r)))(params, rest)
    assert any(k.endswith(".w13") for k in weights) and "blocks.0.attn.wq_a.weight" in weights
    step = jax.jit(jax.value_and_grad(loss))
    got, want = step(params, rest, tokens, weights), step(params, rest, tokens, None)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_bitwise_equal(g, w, seed)
    other = fp8_weights(_tiny_model(seed=1)[0])
    for swapped in ([k for k in weights if k.endswith((".w13", ".w2")) and ".ffn." in k and ".shared." not in k],
                    ["blocks.0.attn.wq_a.weight"]):
        assert swapped
        mixed = {k: other[k] if k in swapped else v for k, v in weights.items()}
        assert float(step(params, rest, tokens, mixed)[0]) != float(want[0]), swapped


def test_fp8_weights_of_a_bf16_model_and_bad_copies():
    from jfp8.nn import fp8_weights, using_fp8_weights

    assert fp8_weights(_tiny_model(recipe=Fp8Recipe.off())[0]) == {}
    model = _tiny_model()[0]
    weights = fp8_weights(model)
    with pytest.raises(ValueError, match="missing \\['blocks.0.attn.wkv_a.weight'"):
        with using_fp8_weights(model, {k: v for k, v in weights.items() if k != "blocks.0.attn.wkv_a.weight"}):
            pass
    with pytest.raises(ValueError, match="not in the model \\['extra'\\]"):
        with using_fp8_weights(model, {**weights, "extra": weights["blocks.0.attn.wq_a.weight"]}):
            pass

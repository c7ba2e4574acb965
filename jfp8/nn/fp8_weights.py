"""A model's FP8 weight copies, quantized once and used by many calls (`fp8_weights`,
`using_fp8_weights`): frozen weights, an evaluation over many batches.

    copies = fp8_weights(model)                      # {path: jfp8.Fp8Weight}, a pytree
    with using_fp8_weights(model, copies):
        loss, parts = model_loss(model, tokens)      # the weights' quantizers do not run

Inside `jax.jit`, pass the copies as an argument (`nnx.merge` the model there, then enter the
context): the same results as the model quantizing its weights, bit for bit on the CPU. The copies
must be of the weights the model holds: after an update, make them again.
"""

from __future__ import annotations

import contextlib

from flax import nnx

from jfp8.nn.layers import GIVEN_FP8_WEIGHTS, Fp8Linear
from jfp8.nn.moe import MoE
from jfp8.ops import Fp8Weight, fp8_weight


def _fp8_weights_of(model: nnx.Module):
    """(path, module, attribute, recipe) of each weight whose copies the model's layers take: every
    `Fp8Linear`'s weight and a one-device `MoE`'s expert weights (an expert-parallel MoE quantizes
    its own shards), where the recipe runs Fprop or Dgrad in FP8."""
    for path, node in nnx.iter_graph(model):
        prefix = ".".join(str(p) for p in path)
        if isinstance(node, Fp8Linear):
            names, recipe = ("weight",), node.recipe
        elif isinstance(node, MoE) and getattr(node, "ep_axis", None) is None:
            names, recipe = ("w13", "w2"), node.cfg.recipe
        else:
            continue
        if recipe.fprop or recipe.dgrad:
            for name in names:
                yield f"{prefix}.{name}" if prefix else name, node, name, recipe


def fp8_weights(model: nnx.Module) -> dict[str, Fp8Weight]:
    """Every FP8 weight of `model` quantized under its layer's recipe (`jfp8.fp8_weight`), by its
    dotted path ("blocks.0.attn.wq_a.weight", "blocks.3.ffn.w13"); empty for a BF16 model."""
    return {key: fp8_weight(getattr(node, name)[...], recipe) for key, node, name, recipe in _fp8_weights_of(model)}


@contextlib.contextmanager
def using_fp8_weights(model: nnx.Module, weights: dict[str, Fp8Weight]):
    """Within: `model`'s layers take their weights' FP8 copies from `weights` (`fp8_weights`)
    instead of quantizing the weights. Every FP8 weight of the model must have its copies there,
    and nothing else (a clear error otherwise); each op checks shape and recipe."""
    found = {key: (id(node), name) for key, node, name, _ in _fp8_weights_of(model)}
    missing, extra = sorted(set(found) - set(weights)), sorted(set(weights) - set(found))
    if missing or extra:
        raise ValueError(f"weights must hold the copies of exactly this model's FP8 weights (make them with "
                         f"jfp8.nn.fp8_weights(model)): missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                         f"not in the model {extra[:3]}{'...' if len(extra) > 3 else ''}")
    token = GIVEN_FP8_WEIGHTS.set({found[key]: weights[key] for key in found})
    try:
        yield
    finally:
        GIVEN_FP8_WEIGHTS.reset(token)

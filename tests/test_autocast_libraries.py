"""jfp8.autocast on models written elsewhere, unedited: an equinox MLP, penzai's Llama-like LM and
nano-moe-jax's MoE LM.

Both packages come with the `test` extra; a missing one skips its own test only."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfp8
from jfp8 import Fp8Recipe, fp8_linear
from helpers import fresh_rng as _rng, rel_error as _rel

XLA = Fp8Recipe(impl="xla")


def test_equinox_mlp_module_as_argument():
    eqx = pytest.importorskip("equinox")
    rng, seed = _rng()
    mlp = eqx.nn.MLP(128, 64, width_size=256, depth=1, key=jax.random.key(int(rng.integers(1 << 30))))
    xs = jnp.asarray(rng.standard_normal((12, 128)), jnp.float32)

    def loss(model, xs):
        return jnp.sum(jnp.sin(jax.vmap(model)(xs)))  # eqx.nn.Linear: weight [out, in] @ x

    g8 = eqx.filter_jit(eqx.filter_grad(jfp8.autocast(loss, XLA)))(mlp, xs)  # as equinox users do
    (l1, l2) = mlp.layers

    def by_hand(w1, w2):
        h = jax.nn.relu(fp8_linear(xs, w1.T, XLA) + l1.bias)
        return jnp.sum(jnp.sin(fp8_linear(h, w2.T, XLA) + l2.bias))

    want = jax.jit(jax.grad(by_hand, (0, 1)))(l1.weight, l2.weight)
    assert _rel(g8.layers[0].weight, want[0]) <= 1e-5, f"seed {seed}"
    assert _rel(g8.layers[1].weight, want[1]) <= 1e-5, f"seed {seed}"
    records = jfp8.autocast(loss, XLA).report(mlp, xs)
    assert [(r.fp8, r.weight) for r in records] == [(True, "lhs"), (True, "lhs")]


def test_penzai_llama_trains_in_fp8_like_bf16():
    """The smallest penzai Llama-like LM (1 block, d=128) on the Shakespeare corpus: the FP8 and
    BF16 arms start from the same init and batches; after 12 steps the losses agree within 2 %
    (experiments/results/autocast-penzai has the longer run)."""
    pytest.importorskip("penzai")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    import autocast_libraries as al

    cfg = al.Config(blocks=1, mlp_hidden_dim=128, batch=4, seq_len=32, steps=12, eval_batches=0)
    result = al.run(cfg, XLA)
    records = result["records"]
    # q, k, v, output projection, the SwiGLU's three; the logits head is kept (keep=)
    assert sum(r.fp8 for r in records) == 7, jfp8.format_report(records)
    assert [r.rhs_shape for r in records if r.note == "kept by keep="] == [(128, 256)]
    assert all(r.kind == "activation x activation" for r in records
               if not r.fp8 and r.note == "kept in input precision")
    bf16, fp8 = (np.array([v for _, v in result["arms"][a]["train"]]) for a in ("bf16", "fp8"))
    assert fp8[-1] < 0.7 * fp8[0], fp8  # it learns
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.02, (bf16, fp8)


def test_nano_moe_trains_in_fp8_like_bf16():
    """nano-moe-jax (linen, a router and dense experts per block), smallest size: its expert FFNs,
    QKV and output projections go FP8, the router and head stay BF16 (keep=), and 12 steps of
    FP8 and BF16 agree within 2 %."""
    pytest.importorskip("nano_moe")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    import autocast_libraries as al

    cfg = al.Config(library="nano_moe", blocks=1, experts=2, top_k=1, mlp_hidden_dim=128, batch=4,
                    seq_len=32, steps=12, eval_batches=0)
    result = al.run(cfg, XLA)
    records = result["records"]
    # qkv, output projection, two experts x two Dense; router and head kept
    assert sum(r.fp8 for r in records) == 6, jfp8.format_report(records)
    assert sorted(r.rhs_shape for r in records if r.note == "kept by keep=") == [(128, 2), (128, 256)]
    assert sorted(r.weight_path for r in records if r.note == "kept by keep=") == [
        "params/Dense_0/kernel", "params/block_0/MoELayer_0/Router_0/Dense_0/kernel"]
    assert "params/block_0/MoELayer_0/expert_1/Dense_1/kernel" in jfp8.format_report(records)
    bf16, fp8 = (np.array([v for _, v in result["arms"][a]["train"]]) for a in ("bf16", "fp8"))
    assert fp8[-1] < 0.7 * fp8[0], fp8
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.02, (bf16, fp8)

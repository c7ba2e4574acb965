"""The numerics lab's training-side tools: recipe overrides in a run's configuration, capturing
GEMM operands from a model, gradient-error probes at a run's checkpoint, and the experiment
scripts built on them (capture_tensors.py, recipe_ablation.py)."""

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jfp8
from jfp8.nn import ModelConfig, Transformer
from jfp8.nn.capture import capture_linear_operands, linear_layers
from jfp8.recipe import Fp8Recipe
from jfp8.train.loop import TrainConfig, scaled_value_and_grad, train
from jfp8.train.optim import OptimizerConfig
from jfp8.train.probes import gradient_errors, load_run
from helpers import ONE_MOE_LAYER

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import capture_tensors  # noqa: E402
import recipe_ablation  # noqa: E402
import scaling_granularity  # noqa: E402
from train_moe import parse_recipe_overrides  # noqa: E402

# One small configuration for every run here (the one `recipe_ablation.py` builds from the
# arguments below), so that the jitted train steps and gradients compile once for all tests.
RUN = dict(preset="tiny", steps=4, batch_size=2, seq_len=32, eval_every=2, eval_batches=1, log_every=1,
           ckpt_every=2, progress=False, optimizer=OptimizerConfig(peak_lr=3e-3, warmup_steps=20))


def test_recipe_overrides_reach_the_model_and_survive_config_json():
    cfg = TrainConfig(recipe_overrides=(("grad_block", (128, 128)), ("pow2_scale", True)))
    recipe = cfg.model_config().recipe
    assert recipe.grad_block == (128, 128) and recipe.pow2_scale and recipe.activation_block == (1, 128)
    back = TrainConfig.from_json(json.loads(json.dumps(cfg.to_json())))
    assert back == cfg
    # A config.json written before recipe_overrides existed reads as the default recipe.
    old = {k: v for k, v in TrainConfig().to_json().items() if k != "recipe_overrides"}
    assert TrainConfig.from_json(old) == TrainConfig()


def test_recipe_overrides_bad_input():
    with pytest.raises(ValueError, match="need precision='fp8'"):
        TrainConfig(precision="bf16", recipe_overrides=(("pow2_scale", True),))
    with pytest.raises(ValueError, match="unknown recipe_overrides"):
        TrainConfig(recipe_overrides=(("grad_blocks", (128, 128)),))


def test_recipe_flag_parses_and_rejects():
    assert parse_recipe_overrides("grad_block=128x128, pow2_scale=true") == (
        ("grad_block", (128, 128)), ("pow2_scale", True))
    assert parse_recipe_overrides("activation_block=none") == (("activation_block", None),)
    assert parse_recipe_overrides("") == ()
    for bad in ("grad_block", "gradblock=1x128", "pow2_scale=maybe", "grad_block=128", "grad_block=1x64"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_recipe_overrides(bad)


def test_loss_scale_round_trip_is_exact_without_fp8():
    """A power-of-two loss scale multiplies every cotangent by 2^k and divides it back: the FP32
    gradient and the reported (unscaled) loss are bit-identical to plain autodiff."""
    k = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 30))), 2)
    w, x = jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (16, 64))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2), {"n": x.shape[0]}

    (l1, aux1), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, x)  # both jitted: same fusions
    (l2, aux2), g2 = jax.jit(scaled_value_and_grad(loss, 2.0**14))(w, x)
    assert float(l1) == float(l2) and aux1 == aux2
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="loss_scale"):
            TrainConfig(loss_scale=bad)


def test_gradient_tiles_follow_tiny_gradients_without_a_loss_scale():
    """Activation gradients of a mean loss lie far under 1e-4. With the recipe's gradient floor
    their 1x128 tiles get their own scales at any loss scale: tiles and 128x128 blocks differ, and a
    power-of-two loss scale changes no bit. With DeepGEMM's 1e-4 floor on dy (the default before
    the floors were split by role) every tile got the floor's scale, tiles and blocks were the same
    quantization, the smallest rows sank into E4M3's subnormals, and only a loss scale helped."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 256)) / 16, jnp.float32)
    # dy rows of 1e-9 .. 1e-6, like a mean-reduced loss's activation gradients (amax << 1e-4)
    r = jnp.asarray(rng.standard_normal((256, 256)) * 10.0 ** rng.uniform(-9, -6, (256, 1)), jnp.float32)
    assert float(jnp.max(jnp.abs(r))) < jfp8.AMAX_FLOOR
    exact = jax.grad(lambda x: jnp.sum((x @ w) * r))(x)

    def dx(recipe, loss_scale):
        loss = lambda x: (jnp.sum(jfp8.fp8_linear(x, w, recipe) * r), None)  # noqa: E731
        g = jax.jit(scaled_value_and_grad(loss, loss_scale))(x)[1]
        return np.asarray(jnp.linalg.norm(g - exact, axis=1) / jnp.linalg.norm(exact, axis=1))  # per row

    tiles, blocks = Fp8Recipe(), Fp8Recipe(grad_block=(128, 128))
    unscaled = dx(tiles, 1.0)
    np.testing.assert_array_equal(unscaled, dx(tiles, 2.0**24))  # the loss scale changes no bit
    assert not np.array_equal(unscaled, dx(blocks, 1.0))
    # E4M3 with per-row scales: ~3.7 % per row (measured max 4.2 %); floored rows reach ~12 %.
    assert unscaled.max() < 0.05

    old_tiles = Fp8Recipe(grad_amax_floor=jfp8.AMAX_FLOOR)
    old_blocks = Fp8Recipe(grad_amax_floor=jfp8.AMAX_FLOOR, grad_block=(128, 128))
    floored = dx(old_tiles, 1.0)
    np.testing.assert_array_equal(floored, dx(old_blocks, 1.0))  # one floored scale for all
    assert dx(old_tiles, 2.0**24).max() < 0.05 < floored.max()


def test_granularity_study_quantizes_captured_gradients_with_the_gradient_floor():
    """`scaling_granularity.py --activations`: arrays named "*:dy" take the recipe's gradient floor
    (per-tile scales that follow tiny gradients), the rest the activations' 1e-4; `--dy-floor 1e-4`
    reproduces the old study, where one floored scale served every tile of such a gradient."""
    rng = np.random.default_rng()
    dy = (rng.standard_normal((256, 512)) * 10.0 ** rng.uniform(-9, -6, (256, 1))).astype(np.float32)
    rows, scales = scaling_granularity.activation_rows("blocks.0.w:dy", dy, scaling_granularity.Config(), rng)
    by = {r.granularity: r for r in rows}
    assert {r.amax_floor for r in rows} == {jfp8.GRAD_AMAX_FLOOR}
    assert np.unique(scales["tile 1x128"]).size > 100  # the tiles follow the rows
    # Rows spanning 3 decades: one scale per tensor flushes the small rows' values, tiles do not.
    assert by["tile 1x128"].flushed_to_zero < by["block 128x128"].flushed_to_zero
    assert by["tile 1x128"].flushed_to_zero < by["tensor"].flushed_to_zero
    old_rows, old_scales = scaling_granularity.activation_rows(
        "blocks.0.w:dy", dy, scaling_granularity.Config(dy_floor=jfp8.AMAX_FLOOR), rng)
    assert np.unique(old_scales["tile 1x128"]).size == 1  # every tile floored
    assert len({r.quant_error for r in old_rows}) == 1  # the three granularities coincide
    x_rows, _ = scaling_granularity.activation_rows("blocks.0.w:x", dy, scaling_granularity.Config(), rng)
    assert {r.amax_floor for r in x_rows} == {jfp8.AMAX_FLOOR}


def test_captured_operands_are_the_layers_x_and_dy():
    """With FP8 off and FP32 activations, each weight's gradient is exactly x^T dy of its layer, so
    the captured x and dy are the right tensors (a wrong or shifted capture breaks the identity)."""
    cfg = ModelConfig.tiny(recipe=Fp8Recipe.off(), dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 32), 0, cfg.vocab_size)
    captured = capture_linear_operands(model, tokens)
    layers = linear_layers(model)
    assert set(captured) == set(layers) and len(layers) > 10
    assert all(layer.tap is None for layer in layers.values())  # the model is left as it was

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    from jfp8.nn import model_loss

    grads = jax.grad(lambda p: model_loss(nnx.merge(graphdef, p, rest), tokens)[0])(params)
    grad_model = nnx.merge(graphdef, grads, rest)
    for name, t in captured.items():
        assert t["x"].shape == (64, layers[name].in_features) and t["dy"].shape == (64, layers[name].out_features)
        expected = np.asarray(linear_layers(grad_model)[name].weight[...], np.float64)
        got = t["x"].astype(np.float64).T @ t["dy"].astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max(), err_msg=name)
    # With a loss scale, dy is the scaled cotangent the quantizers see (exact: a power of two, FP32).
    scaled = capture_linear_operands(model, tokens, loss_scale=1024.0)
    for name, t in captured.items():
        np.testing.assert_array_equal(scaled[name]["x"], t["x"])
        np.testing.assert_array_equal(scaled[name]["dy"], 1024.0 * t["dy"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    config = TrainConfig(**RUN, out=str(out))
    train(config)
    return config, out


def test_load_run_restores_the_newest_or_a_given_checkpoint(tiny_run):
    config, out = tiny_run
    cfg, params, rest = load_run(out)
    assert cfg == config
    _, params2, _ = load_run(out, step=2)
    leaves, leaves2 = jax.tree.leaves(params), jax.tree.leaves(params2)
    assert len(leaves) == len(leaves2) and any(not np.array_equal(a, b) for a, b in zip(leaves, leaves2))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_run(out / "checkpoints")


def test_gradient_errors_zero_for_the_reference_and_ordered_for_fp8(tiny_run):
    config, out = tiny_run
    _, params, rest = load_run(out)
    tokens = [np.asarray(jax.random.randint(jax.random.key(3), (2, 32), 0, 256))]
    # The FP32 reference configuration measured against itself: exactly zero.
    f32 = dataclasses.replace(config.model_config(), dtype="float32")
    e = gradient_errors(f32, params, rest, tokens, {"ref": Fp8Recipe.off()}, bf16_floor=False)
    assert e["ref"]["rel_error"] == 0.0 and e["ref"]["cosine"] == pytest.approx(1.0)
    e = gradient_errors(config.model_config(), params, rest, tokens, {"fp8": Fp8Recipe()})
    # FP8 GEMMs (E4M3: 3 mantissa bits) lose more than BF16 ones (8 bits), and both are small.
    assert 0 < e["bf16"]["rel_error"] < e["fp8"]["rel_error"] < 0.3
    assert {"attention", "routed experts", "router", "shared expert", "dense ffn"} <= set(e["fp8"]["groups"])


def test_capture_tensors_script_writes_the_selected_layers(tiny_run, tmp_path, monkeypatch):
    _, out = tiny_run
    # The same run as if trained with a loss scale: the capture must differentiate the scaled loss.
    run = tmp_path / "run"
    shutil.copytree(out, run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(config | {"loss_scale": 1024.0}))
    seen = []

    def spy(model, tokens, loss_scale=1.0):
        seen.append(loss_scale)
        return capture_linear_operands(model, tokens, loss_scale)

    monkeypatch.setattr(capture_tensors, "capture_linear_operands", spy)
    path = tmp_path / "t.npz"
    tensors = capture_tensors.main(["--run", str(run), "--layers", "blocks.0.*", "--out", str(path)])
    assert seen == [1024.0]
    with np.load(path) as saved:
        assert set(saved.files) == set(tensors)
        assert "blocks.0.attn.wq_a:x" in saved.files and "blocks.0.ffn.w2:dy" in saved.files
        assert not any(name.startswith("blocks.1") for name in saved.files)
        assert all(np.isfinite(saved[k]).all() for k in saved.files)
    with pytest.raises(SystemExit, match="no layer matches"):
        capture_tensors.main(["--run", str(run), "--layers", "nothing.*", "--out", str(path)])


def test_recipe_ablation_runs_arms_and_probes(tmp_path, monkeypatch):
    args = ["--preset", "tiny", "--model", ONE_MOE_LAYER, "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--eval-every", "2", "--log-every", "1", "--probe-every", "2", "--probe-batches", "1", "--no-progress",
            "--arms", "deepseek,dgrad-128x128", "--out", str(tmp_path)]
    stale = {arm: {"step": 4, "val_ce": -1.0} for arm in ("deepseek", "dgrad-128x128")}
    (tmp_path / "whole_split.json").write_text(json.dumps(stale))  # an earlier experiment's, not reused
    summary = recipe_ablation.main(args)
    assert set(summary["arms"]) == {"deepseek", "dgrad-128x128"}
    assert summary["arms"]["deepseek"]["gap_vs_deepseek"] == 0.0
    for arm in summary["arms"].values():
        assert arm["finite"] and set(arm["gradient_rel_error"]) == {0, 2, 4}
        assert all(0 < e < 0.3 for e in arm["gradient_rel_error"].values())
    # The load column is the balancing protocol's: the worst layer's mean over the last quarter.
    for name, arm in summary["arms"].items():
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        tail = np.array([r["load_max_over_mean"] for r in rows if r["step"] > 3])
        assert arm["last_quarter_steps_logged"] == len(tail) == 1
        assert arm["last_quarter_max_over_mean_load"] == pytest.approx(tail.mean(0).max()) and tail.min() >= 1
        dead = np.array([r["dead_experts"] for r in rows if r["step"] > 3])
        assert arm["last_quarter_dead_experts_max"] == dead.max()
    # Both arms start from the same parameters; the recipes differ only in dy's blocks.
    assert json.loads((tmp_path / "dgrad-128x128" / "config.json").read_text())["recipe_overrides"] == {
        "grad_block": [128, 128]}
    for name in ("probes.csv", "summary.json", "summary.md", "ablation.png"):
        assert (tmp_path / name).stat().st_size > 0
    # Val CE is the final checkpoint's on the whole split, cached: a resumed experiment reuses it.
    whole = json.loads((tmp_path / "whole_split.json").read_text())
    assert {a: w["val_ce"] for a, w in whole.items()} == {a: s["final_val_ce"] for a, s in summary["arms"].items()}
    assert all(w["step"] == 4 and 0 < w["val_ce"] < 10 for w in whole.values())

    def no_evaluation(*a, **k):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(recipe_ablation, "evaluate_checkpoints", no_evaluation)
    assert recipe_ablation.main([*args, "--resume"])["arms"] == summary["arms"]
    with pytest.raises(SystemExit, match="must divide"):
        recipe_ablation.main([*args[:-2], "--probe-every", "3", "--out", str(tmp_path / "x")])


def _ablation_dir(root, name, seed, gaps, loss_scale=16384.0):
    """A finished recipe_ablation.py directory as --combine reads it: summary.json and the
    deepseek arm's config.json."""
    d = root / name
    (d / "deepseek").mkdir(parents=True)
    (d / "deepseek" / "config.json").write_text(json.dumps(
        {"preset": "small", "steps": 300, "seed": seed, "loss_scale": loss_scale, "out": str(d / "deepseek")}))
    arms = {"deepseek": {"gap_vs_deepseek": 0.0, "final_val_ce": 1.9, "last_quarter_max_over_mean_load": 1.2}}
    arms |= {arm: {"gap_vs_deepseek": g, "final_val_ce": 1.9 * (1 + g), "last_quarter_max_over_mean_load": 1.25}
             for arm, g in gaps.items()}
    (d / "summary.json").write_text(json.dumps({"preset": "small", "steps": 300, "loss_scale": loss_scale,
                                                "arms": arms}))
    return str(d)


def test_recipe_ablation_combines_seed_replicates(tmp_path):
    from scipy import stats

    gaps = np.random.default_rng().normal(0.01, 0.01, size=(4, 2))
    dirs = [_ablation_dir(tmp_path, f"s{i}", i, {"dgrad-128x128": g[0], "pow2": g[1]}) for i, g in enumerate(gaps)]
    out = tmp_path / "seeds"
    result = recipe_ablation.main(["--combine", *dirs, "--out", str(out)])
    assert result["seeds"] == [0, 1, 2, 3]
    for j, arm in enumerate(("dgrad-128x128", "pow2")):
        a, g = result["arms"][arm], gaps[:, j]
        assert a["gaps"] == pytest.approx(g) and a["mean_gap"] == pytest.approx(g.mean())
        half = stats.t.ppf(0.975, 3) * g.std(ddof=1) / 2
        assert a["ci95"] == pytest.approx([g.mean() - half, g.mean() + half])
        assert a["positive"] == int((g > 0).sum())
    assert json.loads((out / "seeds.json").read_text())["arms"] == result["arms"]
    assert "(../s0/summary.md)" in (out / "seeds.md").read_text()
    # Only seed replicates of one protocol combine.
    other = _ablation_dir(tmp_path, "unscaled", 9, {"dgrad-128x128": 0.0}, loss_scale=1.0)
    with pytest.raises(SystemExit, match="differ beyond the seed"):
        recipe_ablation.main(["--combine", dirs[0], other, "--out", str(out)])
    with pytest.raises(SystemExit, match="repeat"):
        recipe_ablation.main(["--combine", dirs[0], dirs[0], "--out", str(out)])
    with pytest.raises(SystemExit, match="not found"):
        recipe_ablation.main(["--combine", dirs[0], str(tmp_path / "nothing"), "--out", str(out)])

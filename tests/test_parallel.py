"""Data- and expert-parallel training on 8 simulated CPU devices (`jfp8.parallel`).

Equivalence with the single-device step, and what is exact:
  * 1x1 mesh: bit for bit (same code path, FP8 recipe).
  * any mesh, forward: every FP8 quantization in the forward pass is row-local (1x128 activation
    tiles) or of a replicated weight, and the FP8 dispatch hands the expert GEMM the very FP8
    operand the single-device step would quantize, so the loss differs only by the order of the
    cross-device mean (~1e-7 relative).
  * any mesh, gradients with the FP8 recipe: Wgrad scales dy and x per 128 *tokens*; the experts'
    rows sit together differently (per device, per local expert, with zero padding), so the
    expert weight gradients differ at the FP8 quantization level: grad-norm bound 1e-3.
  * FP32 compute with the FP8 recipe off: gradients differ only by summation order (1e-5).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfp8 import mesh as meshes
from jfp8.nn import expert_parallel
from jfp8.train import sharded
from jfp8.nn import model_loss
from jfp8.train.loop import TrainConfig, build
from jfp8.train.optim import OptimizerConfig
from helpers import (ONE_MOE_LAYER_OVERRIDES, assert_bitwise_equal, float_scatter_adds, fresh_rng, hard_row_gradients,
                     nan_as_quiet)

# One MoE layer, 8 experts (so a 1x8 mesh holds one expert per device), no MTP: small compiles.
OVERRIDES = ONE_MOE_LAYER_OVERRIDES + (("n_routed", 8),)
BATCH, SEQ = 8, 32


def _config(precision="fp8", overrides=()) -> TrainConfig:
    return TrainConfig(
        preset="tiny", precision=precision, batch_size=BATCH, seq_len=SEQ, steps=10,
        model_overrides=OVERRIDES + overrides, optimizer=OptimizerConfig(warmup_steps=0),
    )


def _tokens(seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (BATCH, SEQ)).astype(np.int32)


# functools.cache keys on the arguments as passed: `f(2, 4)` and `f(2, 4, "fp8", ())` are two
# entries, i.e. two builds whose jitted steps compile separately (a minute each on the CPU). The
# public helpers pass every argument to the cached ones.


def _single(precision="fp8", overrides=()):
    return _single_cached(precision, overrides)


@functools.cache
def _single_cached(precision, overrides):
    _, _, params, rest, tx, _, step, _ = build(_config(precision, overrides))
    return step(params, rest, tx.init(params), jnp.asarray(_tokens()))


def _sharded_run(data, expert, precision="fp8", overrides=()):
    return _sharded_run_cached(data, expert, precision, overrides)


@functools.cache
def _sharded_run_cached(data, expert, precision, overrides):
    mesh = meshes.make_mesh(data, expert)
    run = sharded.build_sharded(_config(precision, overrides), mesh)
    return mesh, run


def _sharded_opt_state(tx, params, mesh):
    """`tx.init(params)` placed as the sharded step returns it (moments sharded like their
    params). The step's first call then compiles the program every later step reuses; an unplaced
    state compiles a second one at step 2 (a minute of CPU time per mesh). The values are the
    same zeros either way."""
    return meshes.shard_params(tx.init(params), mesh)


def _copies(tree):
    """Copies of a cached run's arrays, placed as they are: the step donates (deletes) its state,
    and the cached run's is shared by several tests."""
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), tree)


def _sharded_step(data, expert, precision="fp8", overrides=()):
    mesh, (_, _, params, rest, tx, _, step, _) = _sharded_run(data, expert, precision, overrides)
    params, rest = _copies((params, rest))
    return step(params, rest, _sharded_opt_state(tx, params, mesh), meshes.shard_batch(_tokens(), mesh))


def _max_rel(a_tree, b_tree) -> float:
    diffs = [
        float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-12))
        for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree))
    ]
    return max(diffs)


# ------------------------------------------------------------------------------ mesh, plans


def test_parse_and_make_mesh():
    assert meshes.parse_mesh("data=2,expert=4") == meshes.MeshShape(2, 4)
    assert meshes.parse_mesh("expert=8") == meshes.MeshShape(1, 8)
    with pytest.raises(ValueError, match="data=D,expert=E"):
        meshes.parse_mesh("dp=2")
    mesh = meshes.make_mesh(2, 4)
    assert dict(mesh.shape) == {"data": 2, "expert": 4}
    with pytest.raises(ValueError, match="needs 16 devices"):
        meshes.make_mesh(4, 4)


def test_plans_uneven_loads_are_dropless():
    """Every assignment to one expert (the worst case) fits the default C = N*K buffer."""
    n, k, e, ep = 16, 2, 8, 4
    experts = jnp.stack([jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32) % e], 1)  # [N, K]
    experts = experts.at[:, 1].set(jnp.where(experts[:, 1] == 0, 1, experts[:, 1]))  # distinct per token
    cap = expert_parallel.capacity_for(n, k, ep, None)
    sp = expert_parallel.send_plan(experts, e, ep, cap)
    assert int(sp.dropped) == 0 and int(sp.counts.sum()) == n * k
    sent = np.asarray(sp.send_rows).reshape(ep, cap)
    # destination 0 (experts 0, 1) receives every token once for expert 0 plus the expert-1 ones
    assert (sent[0] < n).sum() == int(sp.counts[0].sum())
    # A receiver that gets everything from 4 identical sources groups rows by local expert.
    rp = expert_parallel.recv_plan(jnp.stack([sp.counts[0]] * ep), cap)
    assert rp.group_sizes.tolist() == [4 * n, 4 * int(sp.counts[0, 1])]
    # A smaller capacity reports (never hides) what it cannot send.
    small = expert_parallel.send_plan(experts, e, ep, expert_parallel.capacity_for(n, k, ep, 1.0))
    assert int(small.dropped) == n * k - int(small.counts.sum()) > 0
    with pytest.raises(RuntimeError, match="dropped"):
        sharded.check_no_drops({"dropped_assignments": small.dropped})


def _routing(rng, n=37, k=4, e=8):
    """[N, K] distinct experts per token, drawn afresh: K = 4 so that a token's copies are summed
    in an order that shows (two bf16 additions commute)."""
    return jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_plans_list_each_tokens_slots_in_order(capacity_factor):
    """`SendPlan.token_slots`: each token's send slots, ascending, padded with E_p*C where an
    assignment was dropped."""
    rng, seed = fresh_rng()
    experts, ep, e = _routing(rng), 4, 8
    n, k = experts.shape
    sp = expert_parallel.send_plan(experts, e, ep, expert_parallel.capacity_for(n, k, ep, capacity_factor))
    send_rows = np.asarray(sp.send_rows)
    want = np.full((n, k), len(send_rows))
    for t in range(n):
        slots = np.flatnonzero(send_rows == t)
        want[t, : len(slots)] = slots
    np.testing.assert_array_equal(sp.token_slots, want, err_msg=f"seed {seed}")
    assert (int(sp.dropped) > 0) == (capacity_factor is not None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_token_gradients_through_the_send_buffer_are_the_scatter_add_bit_for_bit(dtype, capacity_factor):
    """The tokens' gradient from their send slots, summed by a gather in slot order (FP8
    dispatch's `_sum_slots`, BF16 dispatch's `_send_buffer`), against the scatter-add autodiff and
    the code before ran, on values where order and rounding show, with empty and dropped slots."""
    rng, seed = fresh_rng()
    experts, ep, e, d = _routing(rng), 4, 8, 24
    n, k = experts.shape
    sp = expert_parallel.send_plan(experts, e, ep, expert_parallel.capacity_for(n, k, ep, capacity_factor))
    g = jnp.asarray(hard_row_gradients(rng, np.asarray(sp.send_rows), d, dtype), dtype)  # [E_p*C, d]
    scatter = jax.jit(lambda g: jnp.zeros((n + 1, d), dtype).at[sp.send_rows].add(g)[:n])
    got = jax.jit(expert_parallel._sum_slots, static_argnums=2)(g, sp, n)
    assert_bitwise_equal(nan_as_quiet(got), nan_as_quiet(scatter(g)), seed)

    x = jnp.asarray(rng.standard_normal((n, d)), dtype)
    send = lambda x: expert_parallel._send_buffer(x, sp, ep)  # noqa: E731
    take = lambda x: jnp.take(jnp.concatenate([x, jnp.zeros((1, d), dtype)]), sp.send_rows, axis=0).reshape(ep, -1, d)  # noqa: E731
    np.testing.assert_array_equal(send(x), take(x), err_msg=f"seed {seed}")
    vjp = lambda f: jax.jit(lambda g: jax.vjp(f, x)[1](g.reshape(ep, -1, d))[0])  # noqa: E731
    assert_bitwise_equal(nan_as_quiet(vjp(send)(g)), nan_as_quiet(vjp(take)(g)), seed)


@pytest.mark.parametrize("dispatch", ["fp8", "bf16"])
def test_expert_parallel_backward_has_no_token_scatter(dispatch, monkeypatch):
    """In the sharded step's gradient the tokens' gradients from their dispatched copies are
    gathers: no scatter-add into the tokens' rows, whose repeated indices a GPU adds atomically,
    in an order that changes from run to run."""
    mesh, (cfg, graphdef, params, rest, *_) = _sharded_run(2, 4)
    tokens = meshes.shard_batch(_tokens(), mesh)
    n = BATCH * SEQ // (2 * 4)  # tokens per device

    def token_scatters():
        loss_fn = sharded.sharded_loss_fn(graphdef, mesh, params, rest, expert_parallel.ParallelOptions(dispatch))
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, rest, tokens)[0]))(params).jaxpr
        return [e for e in float_scatter_adds(jaxpr)
                if e.outvars[0].aval.shape in ((n, cfg.d_model), (n + 1, cfg.d_model))]

    assert not token_scatters()
    monkeypatch.setattr(expert_parallel, "_sum_slots",
                        lambda flat, sp, n: jnp.zeros((n + 1, flat.shape[-1]), flat.dtype).at[sp.send_rows].add(flat)[:n])
    monkeypatch.setattr(expert_parallel, "_send_buffer", lambda rows, sp, ep: jnp.take(
        jnp.concatenate([rows, jnp.zeros((1, *rows.shape[1:]), rows.dtype)]), sp.send_rows, axis=0).reshape(ep, -1, *rows.shape[1:]))
    assert token_scatters()  # the check sees the scatter-add


# ------------------------------------------------------------------------------ equivalence


def test_one_device_mesh_is_bit_exact():
    ref, got = _single(), _sharded_step(1, 1)
    assert float(got[3]["loss"]) == float(ref[3]["loss"])
    assert float(got[3]["grad_norm"]) == float(ref[3]["grad_norm"])
    assert _max_rel(ref[0], got[0]) == 0.0


def test_sharded_step_donates_its_state():
    """Like the single-device step (`test_train_parts`): every parameter, router bias and moment
    is written over in place (read from the lowering; nothing compiled)."""
    mesh, (_, _, params, rest, tx, _, step, _) = _sharded_run(1, 1)
    state = (params, rest, _sharded_opt_state(tx, params, mesh))
    text = step.lower(*state, meshes.shard_batch(_tokens(), mesh)).as_text()
    assert text.count("tf.aliasing_output") == len(jax.tree.leaves(state))


@pytest.mark.slow
@pytest.mark.parametrize("data,expert", [(8, 1), (2, 4), (1, 8)])
def test_sharded_fp8_step_matches_single_device(data, expert):
    ref, got = _single(), _sharded_step(data, expert)
    assert int(got[3]["dropped_assignments"]) == 0
    np.testing.assert_allclose(float(got[3]["loss"]), float(ref[3]["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(got[3]["grad_norm"]), float(ref[3]["grad_norm"]), rtol=1e-3)
    # Adam's first step is ~lr*sign(g): a gradient near zero whose sign differs at the FP8 level
    # moves its weight by up to 2*lr the other way. Measured: 3.0-3.7 % of the weights (tiles of
    # 32 local tokens instead of 128 global ones put near-zero Wgrad entries on either side of 0).
    lr = _config().optimizer.peak_lr
    diffs = [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(got[0]))]
    assert max(float(d.max()) for d in diffs) <= 2.01 * lr
    assert sum(int((d > 1e-6).sum()) for d in diffs) / sum(d.size for d in diffs) < 0.05
    for a, b in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(got[1])):  # router biases: global loads
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_sharded_f32_gradients_match_single_device_tightly():
    """FP32 compute, FP8 off: the sharded loss and its gradient differ from one device's only by
    summation order. Compared before the optimizer: Adam's first step divides by |g| + eps, which
    turns an ulp-level change of a gradient near eps (routed experts that see few tokens) into
    a few % of the learning rate, and says nothing about the gradient itself."""
    cfg = _config("bf16", (("dtype", "float32"),))
    _, graphdef, params, rest, *_ = build(cfg)
    tokens = _tokens()

    def single(params):
        return model_loss(nnx.merge(graphdef, params, rest), jnp.asarray(tokens))[0]

    mesh = meshes.make_mesh(2, 4)
    loss_on_mesh = sharded.sharded_loss_fn(graphdef, mesh, params, rest)
    p_mesh, r_mesh = meshes.shard_params(params, mesh), meshes.shard_params(rest, mesh)
    t_mesh = meshes.shard_batch(tokens, mesh)
    ref_loss, ref = jax.jit(jax.value_and_grad(single))(params)
    got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss_on_mesh(p, r_mesh, t_mesh)[0]))(p_mesh)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    assert _max_rel(ref, got) < 1e-5


# ------------------------------------------------------------------------------ FP8 on the wire


def test_dispatch_sends_fp8_and_half_the_bytes():
    """The HLO handed to XLA moves FP8 data + FP32 scales; about half a BF16 dispatch.

    (XLA:CPU widens f8/bf16 collectives to f16/f32 after optimisation, so we read the HLO before
    backend passes; GPUs keep the types.)"""
    mesh, (_, graphdef, params, rest, _, _, _, _) = _sharded_run(2, 4)
    tokens = meshes.shard_batch(_tokens(), mesh)
    moved = {}
    for dispatch in ("fp8", "bf16"):
        loss = sharded.sharded_loss_fn(graphdef, mesh, params, rest, expert_parallel.ParallelOptions(dispatch=dispatch))
        moved[dispatch] = expert_parallel.all_to_all_bytes(jax.jit(loss).lower(params, rest, tokens).as_text(dialect="hlo"))
    fp8, bf16 = moved["fp8"], moved["bf16"]
    combine = fp8["bf16"]  # the forward's only BF16 all-to-all is the combine
    fp8_dispatch = fp8["f8e4m3fn"] + fp8["f32"]
    bf16_dispatch = bf16["bf16"] - combine
    assert fp8["f8e4m3fn"] > 0 and "f32" in fp8
    assert bf16_dispatch == 2 * fp8["f8e4m3fn"]
    assert 0.5 < fp8_dispatch / bf16_dispatch < 0.55  # (d + 4 d/128) / (2 d) = 0.516 for d = 128k


def test_uneven_expert_loads_do_not_drop_tokens():
    """Bias every token towards expert 0 (top-2: experts 0 and 1 on device 0 of each row)."""
    mesh, (_, graphdef, params, rest, _, _, _, _) = _sharded_run(2, 4)
    model = nnx.merge(graphdef, params, rest, copy=True)  # the shared run's router biases stay
    for moe in model.moe_layers():
        moe.router_bias[...] = jnp.zeros_like(moe.router_bias[...]).at[0].set(10.0).at[1].set(5.0)
    _, _, rest = nnx.split(model, nnx.Param, ...)
    rest = meshes.shard_params(rest, mesh)
    loss_fn = jax.jit(sharded.sharded_loss_fn(graphdef, mesh, params, rest))
    loss, parts = loss_fn(params, rest, meshes.shard_batch(_tokens(), mesh))
    loads = np.asarray(parts["expert_loads"])[0]
    assert loads[0] == loads[1] == BATCH * SEQ and loads.sum() == BATCH * SEQ * 2
    assert int(parts["dropped_assignments"]) == 0
    from jfp8.nn import model_loss

    ref, _ = jax.jit(lambda p, r, t: model_loss(nnx.merge(graphdef, p, r), t))(
        jax.device_get(params), jax.device_get(rest), jnp.asarray(_tokens())
    )
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)


def test_group_limited_routing_matches_single_device():
    """The expert-parallel MoE routes like `MoE.__call__`: with group-limited routing, route_scale
    and a bias, the sharded loss and the global loads equal the single-device ones."""
    routing = (("n_group", 4), ("topk_group", 1), ("route_scale", 2.5))
    _, graphdef, params, rest, *_ = build(_config("fp8", routing))
    model = nnx.merge(graphdef, params, rest, copy=True)
    for moe in model.moe_layers():
        moe.router_bias[...] = jnp.linspace(-0.2, 0.2, 8, dtype=jnp.float32)
    _, _, rest = nnx.split(model, nnx.Param, ...)
    ref, ref_parts = jax.jit(lambda p, r, t: model_loss(nnx.merge(graphdef, p, r), t))(params, rest, jnp.asarray(_tokens()))
    loads = np.asarray(ref_parts["expert_loads"])[0]
    # groups of 2 experts, one kept, K = 2: every token takes both experts of its group
    assert loads.sum() == BATCH * SEQ * 2 and (loads[0::2] == loads[1::2]).all(), loads
    mesh = meshes.make_mesh(2, 4)
    loss, parts = jax.jit(sharded.sharded_loss_fn(graphdef, mesh, params, rest))(
        meshes.shard_params(params, mesh), meshes.shard_params(rest, mesh), meshes.shard_batch(_tokens(), mesh)
    )
    np.testing.assert_array_equal(parts["expert_loads"], ref_parts["expert_loads"])
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)


@pytest.mark.slow
def test_few_steps_on_2x4_mesh_decrease_loss():
    mesh, (_, _, params, rest, tx, _, step, _) = _sharded_run(2, 4)
    # Placed like test_sharded_fp8_step_matches_single_device[2-4]'s state: all three steps run
    # the program that test compiled.
    params, rest = _copies((params, rest))
    opt_state, tokens, losses = _sharded_opt_state(tx, params, mesh), meshes.shard_batch(_tokens(1), mesh), []
    for _ in range(3):
        params, rest, opt_state, m = step(params, rest, opt_state, tokens)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses

"""jfp8.autocast: the same numbers as fp8 ops called by hand, through jit/grad/vmap/remat/scan/
cond/while/shard_map, weight tracking, and the Flax (linen, NNX) entry points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax.sharding import Mesh, PartitionSpec as P

import jfp8
from jfp8 import Fp8Recipe, fp8_linear
from helpers import fresh_rng as _rng, rel_error as _rel

XLA = Fp8Recipe(impl="xla")
QUANT_BOUND = 0.06  # as in test_ops


def _params(rng, d=160, layers=2):
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)

    return {"w1": w(128, d), "ws": w(layers, d, d), "w2": w(128, d)}


def _model(p, x, linear):
    """Dense, a scanned rematerialised stack, cond, and an attention-like x·xᵀ."""
    h = jax.nn.gelu(linear(x, p["w1"]))

    def layer(h, w):
        return jax.checkpoint(lambda h, w: jnp.tanh(linear(h, w)))(h, w), None

    h, _ = jax.lax.scan(layer, h, p["ws"])
    h = jax.lax.cond(h.sum() > 0, lambda h: linear(h, p["w2"].T), lambda h: -linear(h, p["w2"].T), h)
    scores = jax.nn.softmax(h @ h.T)  # activation x activation: stays as it is
    return jnp.sum((scores @ h) ** 2)


def _plain(p, x):
    return _model(p, x, lambda a, b: a @ b)


def _by_hand(p, x):
    return _model(p, x, lambda a, b: fp8_linear(a, b, XLA))


def test_equals_fp8_ops_by_hand_through_scan_remat_cond_and_grad():
    rng, seed = _rng()
    p, x = _params(rng), jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    got = jax.jit(jax.value_and_grad(jfp8.autocast(_plain, XLA), (0, 1)))(p, x)
    want = jax.jit(jax.value_and_grad(_by_hand, (0, 1)))(p, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(g, w) <= 1e-5, f"seed {seed}"


def test_while_loop_body_runs_in_fp8():
    rng, seed = _rng()
    w = jnp.asarray(rng.standard_normal((128, 128)) / 11, jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)

    def loop(w, x, linear):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(linear(c[1], w))), (0, x))[1]

    got = jax.jit(jfp8.autocast(lambda w, x: loop(w, x, jnp.dot), XLA))(w, x)
    want = jax.jit(lambda w, x: loop(w, x, lambda a, b: fp8_linear(a, b, XLA)))(w, x)
    assert _rel(got, want) <= 1e-6, f"seed {seed}"


def test_report_names_every_matmul():
    rng, _ = _rng()
    p, x = _params(rng), jnp.ones((24, 128), jnp.float32)
    records = jfp8.autocast(_plain, XLA).report(p, jax.ShapeDtypeStruct(x.shape, x.dtype))
    fp8 = [r for r in records if r.fp8]
    assert [r.weight for r in fp8] == ["rhs", "rhs", "rhs", "rhs"]  # w1, scan body, two branches
    assert any("scan(length=2)" in s for r in fp8 for s in r.scope)
    assert any("checkpoint" in r.scope for r in fp8)
    kept = [r for r in records if not r.fp8]
    assert [r.kind for r in kept] == ["activation x activation"] * 2
    assert "test_autocast.py" in fp8[0].where
    assert jfp8.format_report(records).startswith("4 of 6 matmuls in FP8")


def test_vmap_and_jit_outside_equal_a_loop():
    rng, seed = _rng()
    w = jnp.asarray(rng.standard_normal((256, 72)) / 16, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 10, 256)), jnp.bfloat16)
    f = jfp8.autocast(lambda w, x: jnp.einsum("tk,kn->tn", x, w.astype(x.dtype)), XLA)
    got = jax.jit(jax.vmap(f, (None, 0)))(w, x)
    want = jnp.stack([fp8_linear(x[i], w.astype(jnp.bfloat16), XLA) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  err_msg=f"seed {seed}")


def test_weight_tracking_is_layout_only():
    """w.T.reshape stays a weight; w * 2, an embedding lookup and w1 @ w2 are not."""
    w = jnp.ones((128, 64), jnp.float32)
    table = jnp.ones((50, 128), jnp.float32)

    def fn(params, x, ids):
        w, table = params
        a = x @ w.T.reshape(64, 128).T  # weight
        b = x @ (w * 2)  # arithmetic on a weight: activation x activation
        e = table[ids] @ w  # gathered rows are activations; w is a weight
        ww = w.T @ w  # weight x weight
        return a, b, e, ww

    records = jfp8.autocast(fn, XLA).report((w, table), jnp.ones((4, 128)), jnp.arange(3))
    assert [(r.kind, r.fp8) for r in records] == [
        ("weight x activation", True), ("activation x activation", False),
        ("weight x activation", True), ("weight x weight", False)]


def test_between_activations_recipe_puts_attention_in_fp8():
    rng, seed = _rng()
    q = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    f = jfp8.autocast(lambda _, q, k: q @ k.T, XLA, between_activations=XLA)
    (r,) = f.report((), q, k)
    assert r.fp8 and r.kind == "activation x activation"
    assert _rel(f((), q, k), q @ k.T) < QUANT_BOUND, f"seed {seed}"
    np.testing.assert_array_equal(jfp8.autocast(lambda _, q, k: q @ k.T, XLA)((), q, k), q @ k.T)


def test_keep_leaves_chosen_matmuls_alone():
    rng, _ = _rng()
    w1, head = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((128, 128), (128, 256)))
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)

    def fn(p, x):
        return jnp.tanh(x @ p[0]) @ p[1]

    f = jfp8.autocast(fn, XLA, keep=lambda r: r.rhs_shape[-1] == 256)
    assert [(r.fp8, r.note) for r in f.report((w1, head), x)] == [(True, ""), (False, "kept by keep=")]
    np.testing.assert_array_equal(f((w1, head), x), jnp.tanh(fp8_linear(x, w1, XLA)) @ head)


def test_custom_vjp_with_a_weight_is_inlined_and_others_untouched():
    @jax.custom_vjp
    def proj(x, w):
        return x @ w

    proj.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def fn(w, x):
        return jax.nn.relu(proj(x, w))  # relu is a custom_jvp function with no weight: untouched

    w, x = jnp.ones((128, 32)) / 128, jnp.ones((8, 128))
    (r,) = jfp8.autocast(fn, XLA).report(w, x)
    assert r.fp8 and "custom rule is dropped" in r.scope[0]
    g = jax.jit(jax.grad(lambda w: jfp8.autocast(fn, XLA)(w, x).sum()))(w)
    assert _rel(g, jax.grad(lambda w: fn(w, x).sum())(w)) < QUANT_BOUND


def test_inside_shard_map():
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices), ("data",))
    rng, seed = _rng()
    w = jnp.asarray(rng.standard_normal((128, 64)) / 11, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4 * 8, 128)), jnp.float32)
    f = jfp8.autocast(lambda w, x: jnp.tanh(x @ w), XLA)

    def loss(w, x):
        return jax.lax.psum(jnp.sum(f(w, x)), "data")

    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    g = jax.jit(jax.grad(sharded))(w, x)
    # Each device's GEMMs see its 8 rows only (Wgrad tiles do not span devices): a sum of shards.
    shard_grad = jax.jit(jax.grad(lambda w, xs: jnp.sum(jnp.tanh(fp8_linear(xs, w, XLA)))))
    want = sum(shard_grad(w, x[i * 8:(i + 1) * 8]) for i in range(4))
    assert _rel(g, want) <= 1e-5, f"seed {seed}"


def test_linen_apply_and_nnx_split_merge_and_module_argument():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((4, 9, 128)), jnp.float32)

    mlp = linen.Sequential([linen.Dense(256), linen.relu, linen.Dense(128)])
    params = mlp.init(jax.random.key(0), x)
    y8 = jax.jit(jfp8.autocast(mlp.apply, XLA))(params, x)  # params at argnum 0
    dense8 = linen.Sequential([linen.Dense(256, dot_general=jfp8.make_fp8_dot_general(XLA)),
                               linen.relu, linen.Dense(128, dot_general=jfp8.make_fp8_dot_general(XLA))])
    np.testing.assert_allclose(y8, jax.jit(dense8.apply)(params, x), rtol=1e-6, atol=1e-6)

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(128, 256, rngs=rngs), nnx.Linear(256, 128, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    model = Mlp(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    from_state = jax.jit(jfp8.autocast(lambda state, x: nnx.merge(graphdef, state)(x), XLA))
    from_module = jax.jit(jfp8.autocast(lambda m, x: m(x), XLA))  # NNX modules are pytrees
    want = jax.jit(lambda m: fp8_linear(jax.nn.relu(fp8_linear(x, m.up.kernel[...], XLA) + m.up.bias[...]),
                                        m.down.kernel[...], XLA) + m.down.bias[...])(model)
    for got in (from_state(state, x), from_module(model, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
    grads = jax.jit(jax.grad(lambda s: jnp.sum(from_state(s, x) ** 2)))(state)
    m = model
    by_hand = jax.jit(jax.grad(lambda k: jnp.sum((fp8_linear(jax.nn.relu(fp8_linear(x, k, XLA) + m.up.bias[...]),
                                                     m.down.kernel[...], XLA) + m.down.bias[...]) ** 2)))
    assert _rel(grads["up"]["kernel"][...], by_hand(m.up.kernel[...])) <= 1e-5, f"seed {seed}"


def test_off_recipe_is_the_function_itself_and_bad_argnums_say_so():
    rng, _ = _rng()
    p, x = _params(rng), jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    np.testing.assert_array_equal(jfp8.autocast(_plain, Fp8Recipe.off())(p, x), _plain(p, x))
    with pytest.raises(ValueError, match="weight_argnums"):
        jfp8.autocast(_plain, XLA, weight_argnums=(3,))(p, x)


# ------------------------------------------------------------------------------ weight paths


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.wq, self.up = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.up(x + self.wq(x)))


class _Lm(nnx.Module):
    """Two blocks, a router and a head, every weight (d, d): shapes cannot tell them apart."""

    def __init__(self, d, rngs):
        self.layers = nnx.List([_Block(d, rngs), _Block(d, rngs)])
        self.router, self.head = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        for block in self.layers:
            x = x * jax.nn.sigmoid(self.router(x)) + block(x)
        return self.head(x)


def _by_hand_lm(m, x, keep):
    """_Lm with fp8_linear except the projections named in `keep`."""
    def lin(name, layer, x):
        k, b = layer.kernel[...], layer.bias[...]
        return (x @ k if name in keep else fp8_linear(x, k, XLA)) + b

    for i, block in enumerate(m.layers):
        y = lin(f"layers/{i}/up", block.up, x + lin(f"layers/{i}/wq", block.wq, x))
        x = x * jax.nn.sigmoid(lin("router", m.router, x)) + jax.nn.relu(y)
    return lin("head", m.head, x)


def test_nnx_report_names_weights_by_path_and_keep_takes_patterns():
    rng, seed = _rng()
    d = 128
    model = _Lm(d, nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((2, 16, d)), jnp.float32)
    graphdef, state = nnx.split(model)
    from_state = jfp8.autocast(lambda s, x: nnx.merge(graphdef, s)(x), XLA, keep=(r"router", r"^head/"))
    order = ["router", "layers/0/wq", "layers/0/up", "router", "layers/1/wq", "layers/1/up", "head"]
    for f, args in ((from_state, (state, x)),
                    (jfp8.autocast(lambda m, x: m(x), XLA, keep=r"router|^head/"), (model, x))):
        records = f.report(*args)
        assert [r.weight_path for r in records] == [f"{n}/kernel" for n in order]
        assert [r.fp8 for r in records] == [n not in ("router", "head") for n in order]
        assert "flax/nnx/nn/linear.py" in records[0].where and "site-packages" not in records[0].where
        table = jfp8.format_report(records)
        assert table.startswith("4 of 7 matmuls in FP8")
        assert "rhs: layers/1/wq/kernel" in table and "rhs: head/kernel" in table
    want = jax.jit(lambda m, x: _by_hand_lm(m, x, {"router", "head"}))(model, x)
    got = jax.jit(from_state)(state, x)
    assert _rel(got, want) <= 1e-6, f"seed {seed}"
    # The kept matmuls really are the plain ones: all-FP8 differs from it.
    assert _rel(jax.jit(lambda m, x: _by_hand_lm(m, x, set()))(model, x), want) > 1e-4, f"seed {seed}"


def test_linen_report_names_params_paths_and_keep_pattern():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.float32)

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            h = linen.Dense(128, name="up")(x)
            h = jax.nn.relu(linen.Dense(128, name="gate")(x)) * h
            return linen.Dense(128, name="lm_head")(h)

    net = Net()
    params = net.init(jax.random.key(int(rng.integers(1 << 30))), x)
    f = jfp8.autocast(net.apply, XLA, keep=r"/(gate|lm_head)/kernel$")
    records = f.report(params, x)
    assert [(r.weight_path, r.fp8) for r in records] == [
        ("params/up/kernel", True), ("params/gate/kernel", False), ("params/lm_head/kernel", False)]
    assert all(r.weight == "rhs" for r in records)
    p = params["params"]
    up = fp8_linear(x, p["up"]["kernel"], XLA) + p["up"]["bias"]
    h = jax.nn.relu(x @ p["gate"]["kernel"] + p["gate"]["bias"]) * up
    want = h @ p["lm_head"]["kernel"] + p["lm_head"]["bias"]
    assert _rel(jax.jit(f)(params, x), want) <= 1e-6, f"seed {seed}"


def test_report_shows_the_operand_taken_as_the_weight():
    """`autocast(lambda x, w: x @ w)` takes x (argument 0) as the weight: the report says so."""
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)) / 16, jnp.float32)
    (wrong,) = jfp8.autocast(lambda x, w: x @ w, XLA).report(x, w)
    assert (wrong.weight, wrong.weight_path) == ("lhs", "arg0")
    assert "lhs: arg0" in jfp8.format_report([wrong]) and "set weight_argnums" in jfp8.format_report([wrong])
    right = jfp8.autocast(lambda x, w: x @ w, XLA, weight_argnums=1)
    (r,) = right.report(x, w)
    assert (r.weight, r.weight_path) == ("rhs", "arg1")
    assert "weight_argnums" not in jfp8.format_report([r])
    np.testing.assert_array_equal(right(x, w), fp8_linear(x, w, XLA), err_msg=f"seed {seed}")
    # Several weight arguments: each path names its argument.
    (r,) = jfp8.autocast(lambda a, b: a["k"] @ b, XLA, weight_argnums=(0, 1)).report({"k": x}, w)
    assert r.kind == "weight x weight" and r.weight_path is None
    fused = jfp8.autocast(lambda p, h: h @ jnp.concatenate([p["q"], p["k"]], axis=1), XLA)
    (r,) = fused.report({"q": w, "k": w}, x)
    assert r.fp8 and r.weight_path == "q + k"


def test_keep_patterns_must_be_regular_expressions():
    with pytest.raises(ValueError, match="not a regular expression"):
        jfp8.autocast(_plain, XLA, keep="head(")
    with pytest.raises(TypeError, match="weight paths"):
        jfp8.autocast(_plain, XLA, keep=[3])

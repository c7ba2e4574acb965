"""FP8 training ops: gradients against the reference numerics and f32 autodiff, composability."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from jax.sharding import Mesh, PartitionSpec as P

import jfp8
from jfp8 import GRAD_AMAX_FLOOR as GRAD_FLOOR, TILE, Fp8Recipe, fp8_linear, grouped_fp8_linear, quantize, scaled_matmul_reference
from jfp8.reference import grouped_scaled_matmul_reference, grouped_wgrad_reference
from helpers import assert_bitwise_equal, float_scatter_adds, fresh_rng as _rng, hard_row_gradients, nan_as_quiet, rel_error as _rel

XLA = Fp8Recipe(impl="xla")
QUANT_BOUND = 0.06  # two operands at ~2.6 % rms E4M3 error each: ~3.7 % expected

# The op under test and the hand-built references run jitted, each as its own program (as in
# training): eagerly, every primitive compiles on its own at every new shape, about three times
# the compile time here. Separate programs keep XLA from sharing work between the two sides.


@functools.partial(jax.jit, static_argnames="recipe")
def _linear_vjp(x, w, dy, recipe=XLA):
    """y, dx, dW of fp8_linear."""
    y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe), x, w)
    return (y, *vjp(dy))


@functools.partial(jax.jit, static_argnames="recipe")
def _grouped_vjp(x, w, group_sizes, dy, recipe=XLA):
    """y, dx, dW of grouped_fp8_linear."""
    y, vjp = jax.vjp(lambda x, w: grouped_fp8_linear(x, w, group_sizes, recipe), x, w)
    return (y, *vjp(dy))


@jax.jit
def _reference_linear_vjp(x, w, dy):
    """y, dx, dW of fp8_linear built by hand from the reference functions (§3.3 / §3.5.2)."""
    qx, qw = quantize(x, (1, TILE)), quantize(w, (TILE, TILE))
    y = scaled_matmul_reference(qx, qw.mT, x.dtype)
    dx = scaled_matmul_reference(quantize(dy, (1, TILE), amax_floor=GRAD_FLOOR), qw, x.dtype)
    x_t = quantize(qx.dequantize(jnp.float32), (TILE, 1)).mT  # re-tiled from the FP8 copy
    dw = scaled_matmul_reference(x_t, quantize(dy, (TILE, 1), amax_floor=GRAD_FLOOR).mT, jnp.float32)
    return y, dx, dw


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(64, 256, 128), (37, 300, 70), (1, 128, 8)])
def test_linear_vjp_equals_the_reference_numerics(dtype, m, k, n):
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
    y, dx, dw = _linear_vjp(x, w, dy)
    y_ref, dx_ref, dw_ref = _reference_linear_vjp(x, w, dy)
    chex.assert_trees_all_equal_dtypes((y, dx, dw), (x, x, w))
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert _rel(got, want) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_grads_within_quantization_bound_of_f32_autodiff(dtype):
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((2, 96, 384)), dtype)
    w = jnp.asarray(rng.standard_normal((384, 200)) / 20, jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))  # noqa: E731
    f8 = jax.jit(jax.value_and_grad(loss(lambda x, w: fp8_linear(x, w, XLA)), (0, 1)))
    f32 = jax.value_and_grad(loss(lambda x, w: x.astype(jnp.float32) @ w), (0, 1))
    (_, (dx, dw)), (_, (dx32, dw32)) = f8(x, w), f32(x, w)
    assert _rel(dx, dx32) < QUANT_BOUND and _rel(dw, dw32) < QUANT_BOUND, f"seed {seed}"


def test_off_recipe_is_plain_autodiff():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((5, 7, 130)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((130, 33)), jnp.float32)
    plain = lambda x, w: jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    got = jax.grad(loss(lambda x, w: fp8_linear(x, w, Fp8Recipe.off())), (0, 1))(x, w)
    want = jax.grad(loss(plain), (0, 1))(x, w)
    chex.assert_trees_all_equal(got, want)


def test_partial_recipes_mix_fp8_and_plain_gemms():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    _, dx_ref, dw_ref = _reference_linear_vjp(x, w, dy)
    recipe = Fp8Recipe(impl="xla", wgrad=False)
    vjp = jax.jit(lambda x, w, dy: jax.vjp(lambda x, w: fp8_linear(x, w, recipe), x, w)[1](dy))
    dx, dw = vjp(x, w, dy)
    assert _rel(dx, dx_ref) <= 1e-6
    np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-5, atol=1e-4, err_msg=f"seed {seed}")


def test_per_tensor_recipe_runs_and_is_close():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.float32)
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(fp8_linear(x, w, Fp8Recipe.per_tensor(impl="xla")) ** 2), (0, 1)))(x, w)
    g32 = jax.jit(jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), (0, 1)))(x, w)
    assert _rel(g[0], g32[0]) < 2 * QUANT_BOUND and _rel(g[1], g32[1]) < 2 * QUANT_BOUND, f"seed {seed}"


def test_residuals_are_fp8_about_half_of_bf16():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1024, 1024)) / 32, jnp.float32)
    _, residuals = jax.vjp(lambda x, w: fp8_linear(x, w, XLA), x, w)
    leaves = jax.tree.leaves(residuals)
    saved = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    bf16_equivalent = (x.size + w.size) * 2
    assert any(leaf.dtype == jnp.float8_e4m3fn for leaf in leaves)
    assert 0.45 <= saved / bf16_equivalent <= 0.56, (saved, bf16_equivalent)
    print(f"residual bytes: FP8 {saved} vs bf16 {bf16_equivalent} ({saved / bf16_equivalent:.3f})")


def test_composes_with_vmap_remat_scan_and_batch_shapes():
    rng, seed = _rng()
    layers, d = 3, 160
    ws = jnp.asarray(rng.standard_normal((layers, d, d)) / np.sqrt(d), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 10, d)), jnp.bfloat16)  # extra vmapped axis + batch

    def stack(x, ws):
        def layer(h, w):
            return jax.nn.gelu(jax.checkpoint(lambda h, w: fp8_linear(h, w, XLA))(h, w)), None

        return jax.lax.scan(layer, x, ws)[0]

    loss = lambda ws, x: jnp.sum(jax.vmap(stack, (0, None))(x, ws).astype(jnp.float32) ** 2)  # noqa: E731
    val, g = jax.jit(jax.value_and_grad(loss))(ws, x)
    chex.assert_shape(g, ws.shape)
    chex.assert_tree_all_finite((val, g))
    # The vmapped, scanned, rematerialised model equals unrolled loops of the plain op. (Per vmapped
    # item: Wgrad scales cover 128 tokens of that item only, so the items cannot be merged.)
    def unrolled(ws, x):
        h = x
        for i in range(layers):
            h = jax.nn.gelu(fp8_linear(h, ws[i], XLA))
        return jnp.sum(h.astype(jnp.float32) ** 2)

    grad_unrolled = jax.jit(jax.grad(unrolled))  # one compile serves both items (eager: 3x slower)
    g2 = sum(grad_unrolled(ws, x[i]) for i in range(x.shape[0]))
    assert _rel(g, g2) < 1e-3, f"seed {seed}"  # bf16 activations: fusion may round differently


def test_zero_size_batch_and_odd_sizes():
    w = jnp.ones((130, 70), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, XLA), jnp.zeros((0, 130), jnp.float32), w)
    chex.assert_shape(y, (0, 70))
    dx, dw = vjp(jnp.zeros((0, 70), jnp.float32))
    chex.assert_shape(dx, (0, 130))
    np.testing.assert_array_equal(dw, 0.0)


def test_shard_map_over_a_simulated_mesh():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("conftest sets 8 host devices; this process was started with fewer")
    mesh = Mesh(np.array(devices[:4]), ("data",))
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((4 * 32, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.float32)

    def local_loss(x, w):
        return jax.lax.psum(jnp.sum(fp8_linear(x, w, XLA) ** 2), "data")

    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    g = jax.jit(jax.grad(sharded, argnums=1))(x, w)
    # per-shard tiles: the same as summing the per-shard gradients computed separately
    shard_grad = jax.jit(jax.grad(lambda w, xs: jnp.sum(fp8_linear(xs, w, XLA) ** 2)))  # one compile, 4 shards
    g_ref = sum(shard_grad(w, x[i * 32 : (i + 1) * 32]) for i in range(4))
    assert _rel(g, g_ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize(
    "x_shape,w_shape,x_dtype,exc,match",
    [
        ((4, 128), (128, 8), jnp.int32, TypeError, "bfloat16 or float32"),
        ((4, 128), (64, 8), jnp.float32, ValueError, "contraction sizes differ"),
        ((4, 128), (2, 128, 8), jnp.float32, ValueError, r"\(K, N\) matrix"),
    ],
)
def test_linear_bad_input(x_shape, w_shape, x_dtype, exc, match):
    with pytest.raises(exc, match=match):
        fp8_linear(jnp.ones(x_shape, x_dtype), jnp.ones(w_shape))


# ---------------------------------------------------------------------------- dot_general / Flax


def test_dot_general_drop_in_for_nnx_and_linen():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((4, 9, 256)), jnp.float32)
    layer = nnx.Linear(256, 72, rngs=nnx.Rngs(0), dot_general=jfp8.make_fp8_dot_general(XLA))
    plain = nnx.Linear(256, 72, rngs=nnx.Rngs(0))
    y, y32 = layer(x), plain(x)
    assert _rel(y, y32) < QUANT_BOUND, f"seed {seed}"
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    grads32 = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(plain)
    assert _rel(grads.kernel[...], grads32.kernel[...]) < QUANT_BOUND

    dense = linen.Dense(72, dot_general=jfp8.fp8_dot_general)
    params = dense.init(jax.random.key(0), x)
    y_linen = dense.apply(params, x)
    y_linen32 = linen.Dense(72).apply(params, x)
    assert _rel(y_linen, y_linen32) < QUANT_BOUND


def test_dot_general_drop_in_patterns():
    """Flax's two layouts; any other dimension numbers are tests/test_dot_general.py's."""
    y = jfp8.fp8_dot_general(jnp.ones((3, 128)), jnp.ones((8, 128)), (((1,), (1,)), ((), ())))
    chex.assert_shape(y, (3, 8))  # rhs contracted on axis 1 is x @ w.T
    y = jfp8.fp8_dot_general(jnp.ones((2, 4, 128)), jnp.ones((2, 128, 8)), (((2,), (1,)), ((0,), (0,))))
    chex.assert_shape(y, (2, 4, 8))
    with pytest.raises(NotImplementedError, match="contracting"):
        jfp8.fp8_dot_general(jnp.ones((128, 4)), jnp.ones((128, 8)), (((), ()), ((), ())))


def test_tiny_mlp_trains_like_f32():
    """Same data, init and optimizer: on a fixed noisy regression problem (optimum near the label
    noise, 0.01), FP8 and f32 reach the same training loss within 3 % after 200 Adam steps
    (measured gap on the CPU machine: about 1 %)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048, 128)), jnp.float32)
    teacher = rng.standard_normal((128, 64)) / np.sqrt(128)
    y = jnp.asarray(np.tanh(np.asarray(x) @ teacher) + 0.1 * rng.standard_normal((2048, 64)), jnp.float32)
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (128, 128)) / np.sqrt(128),
              "w2": jax.random.normal(k2, (128, 64)) / np.sqrt(128)}

    def run(linear):
        def loss(p, x, y):
            return jnp.mean((linear(jax.nn.relu(linear(x, p["w1"])), p["w2"]) - y) ** 2)

        opt = optax.adam(3e-3)

        @jax.jit
        def step(p, s, x, y):
            val, g = jax.value_and_grad(loss)(p, x, y)
            upd, s = opt.update(g, s)
            return optax.apply_updates(p, upd), s, val

        p, state, losses = params, opt.init(params), []
        for _ in range(200):
            p, state, val = step(p, state, x, y)
            losses.append(float(val))
        return losses

    l8 = run(lambda a, w: fp8_linear(a, w, XLA))
    l32 = run(lambda a, w: a @ w)
    assert l32[-1] < l32[0] / 10 and l8[-1] < l8[0] / 10, (l8[-1], l32[-1])
    assert abs(l8[-1] - l32[-1]) / l32[-1] < 0.03, (l8[-1], l32[-1])


# ---------------------------------------------------------------------------- grouped (MoE)


def _grouped_problem(rng, t=300, k=256, n=130, sizes=(100, 0, 150, 20), dtype=jnp.float32):
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32)


def test_grouped_vjp_equals_the_reference_numerics():
    rng, seed = _rng()
    x, w, gs = _grouped_problem(rng)
    dy = jnp.asarray(rng.standard_normal((300, 130)), jnp.float32)

    @jax.jit
    def reference(x, w, gs, dy):
        qx, qw = quantize(x), quantize(w, (TILE, TILE))
        y_ref = grouped_scaled_matmul_reference(qx, qw.mT, gs, jnp.float32)
        dx_ref = grouped_scaled_matmul_reference(quantize(dy, amax_floor=GRAD_FLOOR), qw, gs, jnp.float32)
        x_t = quantize(qx.dequantize(), (TILE, 1)).mT
        dw_ref = grouped_wgrad_reference(x_t, quantize(dy, (TILE, 1), amax_floor=GRAD_FLOOR).mT, gs)
        return y_ref, dx_ref, dw_ref

    y, dx, dw = _grouped_vjp(x, w, gs, dy)
    y_ref, dx_ref, dw_ref = reference(x, w, gs, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert _rel(got, want) <= 1e-5, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(y[270:]), 0.0)  # rows past the groups


def test_grouped_grads_within_bound_of_ragged_dot_autodiff():
    rng, seed = _rng()
    x, w, gs = _grouped_problem(rng, sizes=(64, 128, 0, 100))
    loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(f(x, w)))  # noqa: E731
    g8 = jax.jit(jax.grad(loss(lambda x, w: grouped_fp8_linear(x, w, gs, XLA)), (0, 1)))(x, w)
    g32 = jax.jit(jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, gs)), (0, 1)))(x, w)
    assert _rel(g8[0], g32[0]) < QUANT_BOUND and _rel(g8[1], g32[1]) < QUANT_BOUND, f"seed {seed}"
    g_off = jax.jit(jax.grad(loss(lambda x, w: grouped_fp8_linear(x, w, gs, Fp8Recipe.off())), (0, 1)))(x, w)
    # Off: the same f32 math as ragged_dot, summed per (row tile, group) item: only the order of
    # the f32 additions differs, so the gradients agree to f32 rounding (not bit for bit).
    assert _rel(g_off[0], g32[0]) < 1e-5 and _rel(g_off[1], g32[1]) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize(
    "sizes,exc,match",
    [((10, 10), ValueError, r"shape \(3,\)"), ((200, 200, 0), ValueError, "more than the 300 rows")],
)
def test_grouped_bad_group_sizes(sizes, exc, match):
    rng, _ = _rng()
    x, w, _ = _grouped_problem(rng, sizes=(1, 1, 1))
    with pytest.raises(exc, match=match):
        grouped_fp8_linear(x, w, jnp.asarray(sizes, jnp.int32), XLA)


def _assert_within_one_bf16_ulp(got, want, msg: str, max_flips: float = 1e-3) -> None:
    """Every element of bf16 `got` is `want`'s or one of its two bf16 neighbours, and at most a
    `max_flips` fraction of them differ: f32 sums that differ in their last bits rarely lie on
    either side of a bf16 rounding boundary, so many one-ulp differences mean another bug."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(w).all() and np.isfinite(g).all(), msg
    # bf16 keeps 8 significant bits: the spacing at |w| is 2^(floor(log2|w|) - 7) (normals)
    exponent = np.floor(np.log2(np.maximum(np.abs(w), np.finfo(np.float32).tiny)))
    ulp = np.exp2(exponent - 7)
    worst = float(np.max(np.abs(g - w) / ulp))
    assert worst <= 1.0, f"{msg}: an element differs by {worst:.2f} bf16 ulps"
    flips = int(np.count_nonzero(g != w))
    assert flips <= max_flips * g.size, f"{msg}: {flips} of {g.size} elements differ by one ulp"


def test_bf16_ulp_check_takes_a_rounding_flip_and_refuses_more():
    w = jnp.asarray([1.0, -3.0, 0.15625, 1e-3], jnp.bfloat16)
    up = jnp.nextafter(w, jnp.asarray(jnp.inf, jnp.bfloat16))
    _assert_within_one_bf16_ulp(up, w, "one ulp", max_flips=1)
    two = jnp.nextafter(up, jnp.asarray(jnp.inf, jnp.bfloat16))
    with pytest.raises(AssertionError, match="ulps"):
        _assert_within_one_bf16_ulp(two, w, "two ulps", max_flips=1)
    ones = jnp.ones(2000, jnp.bfloat16)
    _assert_within_one_bf16_ulp(ones.at[:2].set(up[0]), ones, "two flips in 2000")
    with pytest.raises(AssertionError, match="differ by one ulp"):  # every element one ulp off
        _assert_within_one_bf16_ulp(jnp.full_like(ones, up[0]), ones, "all")


def test_ops_through_the_kernels_in_the_interpreter():
    """fp8_linear and grouped_fp8_linear with every GEMM and quantization in the Mosaic GPU
    kernels (interpreted) against the XLA reference path: same numerics, <= 1e-5."""
    rng, seed = _rng()
    kernels = Fp8Recipe(interpret=True)
    x = jnp.asarray(rng.standard_normal((150, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 136)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((150, 136)), jnp.bfloat16)
    # Jitted like the other tests here: the interpreter runs inside the program; eager dispatch
    # would compile every small op of both paths on its own (about twice the time).
    outs = [_linear_vjp(x, w, dy, recipe=recipe) for recipe in (kernels, XLA)]
    for got, want in zip(*outs):
        if got.dtype == jnp.bfloat16:
            # The same f32 values up to the order of the additions inside a 128-wide chunk, then
            # rounded to bf16: an element whose f32 value lies by a rounding boundary may round
            # the other way (one ulp; seed 1369756683 put one such flip at 1.36e-5 norm-wise),
            # and no element may differ by more.
            _assert_within_one_bf16_ulp(got, want, f"seed {seed}")
        else:
            assert _rel(got, want) <= 1e-5, f"seed {seed}"

    xg, wg, gs = _grouped_problem(rng, t=200, k=256, n=128, sizes=(70, 0, 100))
    dyg = jnp.asarray(rng.standard_normal((200, 128)), jnp.float32)
    outs = [_grouped_vjp(xg, wg, gs, dyg, recipe=recipe) for recipe in (kernels, XLA)]
    for got, want in zip(*outs):
        assert _rel(got, want) <= 1e-5, f"seed {seed}"


def test_fused_and_separate_quantizers_give_the_same_bits():
    """`fuse_quantizers=False` (separate kernels for W, Wᵀ, dy's two forms) against the default
    fused ones, through every kernel in the interpreter: y, dx and dW bit for bit, dense (f32
    master, bf16 x) and grouped (bf16 master, f32 x)."""
    rng, seed = _rng()
    fused, separate = Fp8Recipe(interpret=True), Fp8Recipe(interpret=True, fuse_quantizers=False)
    x = jnp.asarray(rng.standard_normal((136, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 200)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((136, 200)), jnp.bfloat16)
    for got, want in zip(*[_linear_vjp(x, w, dy, recipe=r) for r in (fused, separate)]):
        assert_bitwise_equal(got, want, seed)
    xg, wg, gs = _grouped_problem(rng, t=150, k=256, n=128, sizes=(60, 90))
    xg, wg = xg.astype(jnp.float32), wg.astype(jnp.bfloat16)
    dyg = jnp.asarray(rng.standard_normal((150, 128)), jnp.float32)
    for got, want in zip(*[_grouped_vjp(xg, wg, gs, dyg, recipe=r) for r in (fused, separate)]):
        assert_bitwise_equal(got, want, seed)


# ------------------------------------------------------------------------------ gathered rows (MoE dispatch)


@functools.partial(jax.jit, static_argnames=("recipe", "gather_first"))
def _gathered_vjp(tokens, rows, w, group_sizes, dy, recipe=XLA, gather_first=False):
    """y, d tokens, dW of the fused gather + grouped GEMM, or of gathering first."""
    def f(t, w):
        if gather_first:
            return grouped_fp8_linear(jnp.take(t, rows, axis=0), w, group_sizes, recipe)
        return jfp8.ops.gathered_grouped_fp8_linear(t, rows, w, group_sizes, recipe)

    y, vjp = jax.vjp(f, tokens, w)
    return (y, *vjp(dy))


def _routed_problem(rng, n=90, k=256, out=136, sizes=(100, 0, 150, 20), top_k=3):
    """Tokens copied top_k times and sorted by a random expert choice, as `MoE` dispatches them
    (rows past the groups' sum included); a zero row and a -0.0 among the tokens."""
    tokens = rng.standard_normal((n, k)) * np.exp(rng.normal(size=(n, 1)))
    tokens[5], tokens[7, 3] = 0.0, -0.0
    experts = rng.integers(0, len(sizes), (n, top_k))
    rows = (np.argsort(experts.reshape(-1), kind="stable") // top_k)[: sum(sizes) + 10]
    w = rng.standard_normal((len(sizes), k, out)) / np.sqrt(k)
    dy = rng.standard_normal((len(rows), out))
    return (jnp.asarray(tokens, jnp.bfloat16), jnp.asarray(rows, jnp.int32), jnp.asarray(w, jnp.float32),
            jnp.asarray(sizes, jnp.int32), jnp.asarray(dy, jnp.bfloat16))


@pytest.mark.parametrize(
    "recipe",
    [XLA, Fp8Recipe(interpret=True), Fp8Recipe.off(impl="xla"), Fp8Recipe(activation_block=(TILE, TILE), impl="xla")],
    ids=["xla", "kernels", "off", "blocks"],
)
def test_gathered_rows_give_the_bits_of_gathering_first(recipe):
    """Quantizing each token once and gathering its FP8 rows (1x128 tiles never mix tokens) is
    bit for bit quantizing the gathered rows: y, the tokens' gradient (each token's copies summed
    as the gather's autodiff sums them) and dW, on the reference and through the kernels; recipes
    without 1x128 activation tiles gather first."""
    rng, seed = _rng()
    args = _routed_problem(rng)
    got = _gathered_vjp(*args, recipe=recipe)
    want = _gathered_vjp(*args, recipe=recipe, gather_first=True)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w, seed)
    assert np.all(np.asarray(got[0][270:]) == 0)  # rows past the groups


def _token_rows(rows, n: int) -> jnp.ndarray:
    """Each token's rows in ascending order, padded with R: `take_rows`'s `token_rows`."""
    rows = np.asarray(rows)
    per = [np.flatnonzero(rows == t) for t in range(n)]
    table = np.full((n, max(1, max(map(len, per)))), len(rows), np.int32)
    for t, r in enumerate(per):
        table[t, : len(r)] = r
    return jnp.asarray(table)


@pytest.mark.parametrize("recipe", [XLA, Fp8Recipe.off(impl="xla")], ids=["xla", "off"])
def test_gathered_rows_with_token_rows_give_the_same_bits(recipe):
    """With each token's rows given, d tokens is a gather of each token's row gradients summed in
    row order: bit for bit autodiff's scatter-add (tokens with fewer copies than others, and with
    none, padded), and no floating-point scatter is left in the gradient's program."""
    rng, seed = _rng()
    tokens, rows, w, sizes, dy = _routed_problem(rng)
    rows = jnp.where(rows == 5, 6, jnp.where(rows == 9, 10, rows))  # tokens 5, 9: no copies; 6, 10: six
    table = _token_rows(rows, tokens.shape[0])
    assert len(set(np.sum(np.asarray(table) < len(rows), axis=1))) == 3  # 0, 3 or 6 copies: padding used

    @jax.jit
    def with_table(t, w, dy):
        y, vjp = jax.vjp(lambda t, w: jfp8.ops.gathered_grouped_fp8_linear(t, rows, w, sizes, recipe, token_rows=table),
                         t, w)
        return (y, *vjp(dy))

    got, want = with_table(tokens, w, dy), _gathered_vjp(tokens, rows, w, sizes, dy, recipe=recipe)
    for g, v in zip(got, want):
        assert_bitwise_equal(g, v, seed)
    assert not float_scatter_adds(jax.make_jaxpr(with_table)(tokens, w, dy).jaxpr)
    assert float_scatter_adds(jax.make_jaxpr(functools.partial(_gathered_vjp, recipe=recipe))(
        tokens, rows, w, sizes, dy).jaxpr)  # the check sees autodiff's


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_take_rows_gradient_is_the_scatter_add_bit_for_bit(dtype):
    """`take_rows`'s gradient (each token's rows gathered and added in row order, each partial sum
    rounded to the dtype) against autodiff's scatter-add of `jnp.take`, on values where the order
    and the rounding show: cancellations, overflow to ±Inf, NaN, -0 alone and in pairs,
    subnormals, magnitudes 2^-30 to 2^30; rows in random order, tokens with 0 to 7 copies."""
    rng, seed = _rng()
    n, d = 40, 24
    copies = rng.integers(0, 8, n)
    rows = rng.permutation(np.repeat(np.arange(n), copies)).astype(np.int32)
    g = jnp.asarray(hard_row_gradients(rng, rows, d, dtype), dtype)
    x = jnp.zeros((n, d), dtype)
    table = _token_rows(rows, n)
    take = lambda x: jnp.take(x, rows, axis=0)  # noqa: E731
    for run in (lambda f: f, jax.jit):
        got = run(lambda g: jax.vjp(lambda x: jfp8.ops.take_rows(x, rows, table), x)[1](g)[0])(g)
        want = run(lambda g: jax.vjp(take, x)[1](g)[0])(g)
        assert np.isnan(np.asarray(want, np.float32)).any() and np.isinf(np.asarray(want, np.float32)).any()
        assert_bitwise_equal(nan_as_quiet(got), nan_as_quiet(want), seed)
    with pytest.raises(ValueError, match="token_rows must be"):
        jfp8.ops.take_rows(x, rows, table[:5])
    with pytest.raises(ValueError, match="token_rows must be"):
        jfp8.ops.take_rows(x, rows, table.astype(jnp.float32))
    with pytest.raises(ValueError, match="fewer than"):
        jfp8.ops.take_rows(x, rows, table[:, :0])
    with pytest.raises(ValueError, match="rows must be"):
        jfp8.ops.take_rows(x, rows[:, None], table)


def test_gathered_rows_quantize_each_token_once(monkeypatch):
    """The tokens [N, K] are quantized (x's two forms, one kernel on Hopper), not the [R, K]
    gathered copies; the call is the one a shared expert on the same tokens makes (XLA merges
    the two)."""
    seen = []
    real = jfp8.ops.quantize_activation
    monkeypatch.setattr(jfp8.ops, "quantize_activation", lambda x, **kw: seen.append(x.shape) or real(x, **kw))
    rng, _ = _rng()
    tokens, rows, w, sizes, dy = _routed_problem(rng)
    loss = lambda t, w: jfp8.ops.gathered_grouped_fp8_linear(t, rows, w, sizes, XLA).astype(jnp.float32).sum()  # noqa: E731
    jax.eval_shape(jax.grad(loss, (0, 1)), tokens, w)  # training: x's two forms, of the N tokens
    assert seen == [tokens.shape]


def test_gathered_rows_bad_input():
    rng, _ = _rng()
    tokens, rows, w, sizes, _ = _routed_problem(rng)
    with pytest.raises(ValueError, match="rows"):
        jfp8.ops.gathered_grouped_fp8_linear(tokens, rows.astype(jnp.float32), w, sizes, XLA)
    with pytest.raises(ValueError, match="more than the"):
        jfp8.ops.gathered_grouped_fp8_linear(tokens, rows[:50], w, sizes, XLA)

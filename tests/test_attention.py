"""MLA's attention core (`jfp8.attention`): "auto" is the reference on a CPU, bit for bit; "cudnn"
says why it cannot run where it cannot; the first check that guards cuDNN on a GPU falls back on a
failure or a wrong answer, also while a step is being traced; the deviceless H100 build lowers
MLA's heads to cuDNN's fused attention; and, on a Hopper, cuDNN's kernel against the reference."""

import json
import pathlib
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfp8 import attention
from jfp8.api import is_hopper
from jfp8.nn import MLA, ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
# (query/key, value) head widths of the presets: tiny (24/16), small (96/64), gpu (128/128), wide and
# wide4k (192/128)
PRESET_HEADS = ((24, 16), (96, 64), (128, 128), (192, 128))
# On a Hopper "auto" is cuDNN: the CPU-path tests below would test something else there.
ON_HOPPER = is_hopper()
cpu_only = pytest.mark.skipif(ON_HOPPER, reason="the CPU path's tests ('auto' is cuDNN on a Hopper)")


def _qkv(seed, b, t, h, dqk, dv, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, h, dqk), jnp.float32).astype(dtype),
            jax.random.normal(kk, (b, t, h, dqk), jnp.float32).astype(dtype),
            jax.random.normal(kv, (b, t, h, dv), jnp.float32).astype(dtype))


def _oracle(q, k, v, scale):
    """softmax(q kᵀ scale + causal) v in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = q.shape[1]
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_the_reference_is_causal_softmax_attention():
    seed = np.random.default_rng().integers(1 << 30)
    q, k, v = _qkv(seed, 2, 37, 3, 24, 16, jnp.float32)
    got = attention.xla_causal_attention(q, k, v, 0.2)
    np.testing.assert_allclose(np.asarray(got), _oracle(q, k, v, 0.2), rtol=1e-5, atol=1e-5)


@cpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_auto_is_the_reference_on_a_cpu_bit_for_bit(dtype):
    """Forward and all three gradients, and the lowered program: no cuDNN call on a CPU."""
    seed = np.random.default_rng().integers(1 << 30)
    q, k, v = _qkv(seed, 2, 40, 2, 96, 64, dtype)

    def loss(impl):
        return lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, 0.125, impl).astype(jnp.float32) ** 2)

    auto = jax.jit(jax.value_and_grad(loss("auto"), argnums=(0, 1, 2)))
    xla = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))
    for a, b in zip(jax.tree.leaves(auto(q, k, v)), jax.tree.leaves(xla(q, k, v))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = auto.lower(q, k, v).as_text()
    assert "cudnn" not in text and text == xla.lower(q, k, v).as_text() and attention.ran(text) == "xla"


@cpu_only
def test_the_model_config_picks_the_attention_and_checks_it():
    assert ModelConfig.tiny().attention == "auto"
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelConfig.tiny(attention="flash")
    cfg = ModelConfig.tiny()
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model), jnp.bfloat16)
    outs = [MLA(ModelConfig.tiny(attention=impl), rngs=nnx.Rngs(0))(x) for impl in ("auto", "xla")]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    with pytest.raises(ValueError, match="not traced for a Hopper GPU.*impl='auto'"):
        MLA(ModelConfig.tiny(attention="cudnn"), rngs=nnx.Rngs(0))(x)


def test_cudnn_names_what_it_does_not_take():
    q, k, v = _qkv(0, 1, 8, 1, 96, 64, jnp.float32)
    assert "bf16 or f16" in attention.cudnn_unsupported(q, k, v)
    q, k, v = _qkv(0, 1, 8, 1, 264, 64)
    assert "query/key head width 264" in attention.cudnn_unsupported(q, k, v)
    q, k, v = _qkv(0, 1, 8, 1, 96, 60)
    assert "value head width 60" in attention.cudnn_unsupported(q, k, v)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        attention.causal_attention(q, k, v, 1.0, "flash")


def _wrong(q, k, v):
    return attention.xla_causal_attention(q, k, v, 0.125) * 1.1


def _broken(q, k, v):
    raise RuntimeError("no engine config")


@pytest.mark.parametrize("candidate, said", [(_wrong, "its out is 0.1"), (_broken, "it failed: RuntimeError: no engine")])
def test_the_first_check_catches_a_wrong_or_failing_kernel_while_a_step_is_traced(candidate, said):
    reference = lambda q, k, v: attention.xla_causal_attention(q, k, v, 0.125)  # noqa: E731
    seen = []

    @jax.jit
    def step(x):  # the check runs eagerly inside a trace, as `resolve` does inside a train step
        seen.append(attention._probe(candidate, reference, (1, 64, 2, 32), (1, 64, 2, 16), jnp.bfloat16))
        seen.append(attention._probe(reference, reference, (1, 64, 2, 32), (1, 64, 2, 16), jnp.bfloat16))
        return x + 1

    step(jnp.zeros(3))
    assert said in seen[0] and seen[1] is None


def test_auto_takes_cudnn_only_where_it_passed_its_check(monkeypatch):
    q, k, v = _qkv(0, 1, 8, 2, 96, 64)
    monkeypatch.setattr(attention, "cudnn_unsupported", lambda *a: None)
    monkeypatch.setattr(attention, "_has_gpu", lambda: True)
    monkeypatch.setattr(attention, "_cudnn_agrees", lambda *a: "its dq is 0.5 off the reference")
    assert attention.resolve("auto", q, k, v) == "xla"
    monkeypatch.setattr(attention, "_cudnn_agrees", lambda *a: None)
    assert attention.resolve("auto", q, k, v) == "cudnn"
    monkeypatch.setattr(attention, "_has_gpu", lambda: False)  # deviceless: nothing to run a check on
    monkeypatch.setattr(attention, "_cudnn_agrees", lambda *a: pytest.fail("checked without a GPU"))
    assert attention.resolve("auto", q, k, v) == "cudnn"
    assert attention.resolve("xla", q, k, v) == "xla"


def test_the_failed_check_warns_once_per_shape_and_an_undecided_one_is_not_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_VERDICTS", {})
    monkeypatch.setattr(attention, "_probe", lambda *a: calls.append(a) or "it failed: X")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            assert attention._cudnn_agrees(192, 128, "bfloat16", 256, 2) == "it failed: X"
    assert len(calls) == 1 and len(w) == 1 and "runs in XLA" in str(w[0].message)
    assert calls[0][2:4] == ((1, 256, 2, 192), (1, 256, 2, 128))  # one sequence at the step's length and heads

    def cannot(*a):
        calls.append(a)
        raise attention._CannotCheckHere("the check's inputs are traced here")

    monkeypatch.setattr(attention, "_probe", cannot)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            assert attention._cudnn_agrees(96, 64, "bfloat16", 128, 4).startswith("not checked")
    assert len(calls) == 3 and not w and (96, 64, "bfloat16", 128, 4) not in attention._VERDICTS


def test_the_first_check_gives_no_verdict_where_values_stay_abstract():
    """An eager shard_map traces its body with abstract values: the check cannot run there."""
    from jax.sharding import PartitionSpec as P

    reference = lambda q, k, v: attention.xla_causal_attention(q, k, v, 0.125)  # noqa: E731
    said = []

    def body(x):
        try:
            said.append(attention._probe(reference, reference, (1, 64, 2, 32), (1, 64, 2, 16), jnp.bfloat16))
        except attention._CannotCheckHere as e:
            said.append(f"cannot: {e}")
        return x

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])
    jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(jnp.zeros(2))
    assert said == ["cannot: the check's inputs are traced here"]


def test_the_choice_goes_by_a_cpu_mesh_over_the_default_device(monkeypatch):
    """Traced inside a mesh of CPU devices (shard_map on a host), "auto" is XLA's even where the
    process's first device is a Hopper."""
    from jfp8 import api

    monkeypatch.setattr(api, "is_hopper", lambda device=None: True)  # pretend the first device is one
    assert api.traced_for_hopper()
    with jax.set_mesh(jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])):
        assert not api.traced_for_hopper()


DEVICELESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "benchmarks")
    import jax, jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from hopper_train_build import _topology_device, for_target
    from jfp8 import attention
    from pallas_kernels import _mgpu
    saved = fa.check_compute_capability
    fa.check_cudnn_version = lambda: 92801  # what jax[cuda13] 0.11.2 installs; CI has no cuDNN to ask
    s = jax.sharding.SingleDeviceSharding(_topology_device("h100_sxm"))
    out = {}
    for dqk, dv in json.loads(sys.argv[1]):
        q = jax.ShapeDtypeStruct((2, 200, 4, dqk), jnp.bfloat16, sharding=s)
        v = jax.ShapeDtypeStruct((2, 200, 4, dv), jnp.bfloat16, sharding=s)
        loss = lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, 0.1, "auto").astype(jnp.float32))
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        with for_target("h100_sxm"):
            text = f.trace(q, q, v).lower().as_text()
        outside = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, v).lower().as_text()
        # the build target alone: jax would hold the heads to a pre-Hopper GPU's limits, so "auto"
        # keeps XLA's (and says why); the capability answer is jax's own again after for_target
        with _mgpu.build_target("NVIDIA H100 80GB HBM3", 132):
            target_only = attention.cudnn_unsupported(q, q, v)
        restored = fa.check_compute_capability is saved
        out[f"{dqk}/{dv}"] = {"fwd": text.count("@__cudnn$fmhaSoftmax("), "bwd": text.count("@__cudnn$fmhaSoftmaxBackward("),
                              "causal": "CAUSAL" in text, "outside": outside.count("cudnn"),
                              "ran": [attention.ran(text), attention.ran(outside)],
                              "target_only": target_only, "restored": restored}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_deviceless_h100_build_lowers_mla_heads_to_cudnn(toolchain):
    """Under the deviceless H100 build's context, "auto" lowers each preset's heads to one cuDNN
    forward and one backward, causal, at a sequence length with a tail; outside it, to XLA."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hopper_build import child_env

    p = subprocess.run([sys.executable, "-c", DEVICELESS, json.dumps(PRESET_HEADS)], env=child_env(toolchain),
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for dqk, dv in PRESET_HEADS:
        row = got[f"{dqk}/{dv}"]
        assert "jax sees no Hopper GPU" in row.pop("target_only") and row.pop("restored") is True, row
        assert row == {"fwd": 1, "bwd": 1, "causal": True, "outside": 0, "ran": ["cudnn", "xla"]}, got


# ------------------------------------------------------------------------------ on a Hopper GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dqk, dv", PRESET_HEADS)
def test_cudnn_against_the_reference_and_the_oracle_on_hopper(dqk, dv):
    """cuDNN's forward and gradients against the reference's on the same GPU, at a sequence length
    that is not a multiple of cuDNN's tiles; the forward also against the float64 oracle."""
    from jfp8.api import is_hopper

    if not is_hopper():
        pytest.skip("needs a Hopper GPU")
    seed = int(np.random.default_rng().integers(1 << 30))
    q, k, v = _qkv(seed, 2, 333, 4, dqk, dv)
    g = jax.random.normal(jax.random.key(seed + 1), v.shape, jnp.float32).astype(jnp.bfloat16)
    scale = dqk**-0.5
    assert attention.resolve("auto", q, k, v) == "cudnn"

    def fwd_bwd(impl):
        out, vjp = jax.vjp(lambda q, k, v: attention.causal_attention(q, k, v, scale, impl), q, k, v)
        return (out, *vjp(g))

    got = jax.jit(lambda: fwd_bwd("cudnn"))()
    want = jax.jit(lambda: fwd_bwd("xla"))()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert attention._max_rel(a, b) <= attention.PROBE_TOLERANCE, (name, seed, attention._max_rel(a, b))
    oracle = _oracle(q, k, v, scale)
    err = lambda out: np.max(np.abs(np.asarray(out, np.float64) - oracle))  # noqa: E731
    # cuDNN's bf16 output no further from the float64 oracle than XLA's bf16 output is (both round
    # the probabilities and the output to bf16), twice that with a margin of 1e-3 of the largest
    assert err(got[0]) <= 2 * err(want[0]) + 1e-3 * np.max(np.abs(oracle)), (seed, err(got[0]), err(want[0]))

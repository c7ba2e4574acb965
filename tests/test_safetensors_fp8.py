"""FP8 checkpoints in DeepSeek-V3's safetensors layout: round trips, files written the way DeepSeek's
tools write them, the cast CLI, atomic writes and bad inputs."""

import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_numpy

import jfp8
from jfp8 import safetensors_io
from jfp8.checkpoint_cast import CastPolicy, cast_to_fp8, cast_to_high_precision

REPO = pathlib.Path(__file__).resolve().parents[1]
BLOCK = jfp8.TILE  # DeepSeek-V3's weight_block_size
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
# Jitted: one compile per shape instead of one per op (keeps this file fast).
_quantize = jax.jit(jfp8.quantize, static_argnums=1, static_argnames="pow2_scale")
_dequantize = jax.jit(lambda t: t.dequantize(jnp.float32))


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype != bool else x


def _assert_same_fp8(got: jfp8.Fp8Tensor, want: jfp8.Fp8Tensor):
    assert isinstance(got, jfp8.Fp8Tensor)
    assert (got.block, got.logical) == (want.block, want.logical)
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
    np.testing.assert_array_equal(_bits(got.data), _bits(want.data))
    np.testing.assert_array_equal(_bits(got.scale), _bits(want.scale))


def _stored(path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (safetensors dtype, shape, raw bytes), read with the safetensors package alone."""
    return {n: (v["dtype"], v["shape"], bytes(v["data"])) for n, v in safetensors.deserialize(pathlib.Path(path).read_bytes())}


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("shape,pow2", [((300, 200), False), ((300, 200), True), ((1, 130), False),
                                        ((128, 256), False), ((1, 1), False), ((257, 128), False),
                                        ((2, 130, 140), False)])
def test_fp8_tensor_round_trip_is_bit_exact(tmp_path, shape, pow2):
    rng = np.random.default_rng()
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))
    t = _quantize(jnp.asarray(x, jnp.float32), (BLOCK, BLOCK), pow2_scale=pow2)
    jfp8.save_safetensors(tmp_path / "w.safetensors", {"layer.weight": t})
    got = jfp8.load_safetensors(tmp_path / "w.safetensors")
    assert list(got) == ["layer.weight"]
    _assert_same_fp8(got["layer.weight"], t)  # padding included: zeros, as quantize writes them
    np.testing.assert_array_equal(_dequantize(got["layer.weight"]), _dequantize(t))


def test_block_scaling_commutes_with_transpose():
    """Why the cast's choice of weights needs no layout: [out, in] and Flax's (in, out) give the
    same 128x128 blocks, transposed."""
    w = jnp.asarray(np.random.default_rng().standard_normal((300, 200)), jnp.float32)
    _assert_same_fp8(_quantize(w.T, (BLOCK, BLOCK)), _quantize(w, (BLOCK, BLOCK)).mT)


def test_plain_arrays_round_trip(tmp_path):
    rng = np.random.default_rng()
    tensors = {
        "bf16": jnp.asarray(rng.standard_normal((3, 129)), jnp.bfloat16),
        "f32": rng.standard_normal((7,)).astype(np.float32),
        "f16": jnp.asarray(rng.standard_normal((2, 2, 3)), jnp.float16),
        "f64": rng.standard_normal((4,)),
        "i32": rng.integers(-9, 9, (5, 2), dtype=np.int32),
        "i64": rng.integers(-9, 9, (3,), dtype=np.int64),
        "u8": rng.integers(0, 255, (6,), dtype=np.uint8),
        "mask": rng.random((4, 4)) > 0.5,
        "scalar": np.asarray(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
        # an E4M3 array without a scale is plain data, not an FP8 weight
        "raw_fp8": rng.standard_normal((2, 5)).astype(E4M3),
    }
    jfp8.save_safetensors(tmp_path / "p.safetensors", tensors)
    got = jfp8.load_safetensors(tmp_path / "p.safetensors")
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        want = np.asarray(want)
        assert isinstance(got[name], np.ndarray)  # numpy: F64/I64 kept exactly
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(_bits(got[name]), _bits(want), err_msg=name)


def test_sharded_save_writes_index_and_loads_back(tmp_path):
    rng = np.random.default_rng()
    q = lambda shape: _quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), (BLOCK, BLOCK))
    tensors = {
        "a.weight": q((300, 200)),
        "b.weight": q((130, 128)),
        "embed.weight": jnp.asarray(rng.standard_normal((64, 40)), jnp.bfloat16),
        "c.weight": q((128, 384)),
        "norm.weight": jnp.asarray(rng.standard_normal((40,)), jnp.bfloat16),
    }
    d = tmp_path / "ckpt"
    jfp8.save_safetensors(d, tensors, max_shard_bytes=40_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.iterdir())
    n = len(files) - 1
    assert n >= 3 and files == sorted([*(f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)),
                                       "model.safetensors.index.json"])
    modes = {(d / f).stat().st_mode & 0o777 for f in files}
    assert modes == {(d / "model.safetensors.index.json").stat().st_mode & 0o777}  # the umask's
    weight_map = index["weight_map"]
    stored = {name: v for f in set(weight_map.values()) for name, v in _stored(d / f).items()}
    assert set(weight_map) == set(stored)
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in stored.values())
    for name, v in tensors.items():
        if isinstance(v, jfp8.Fp8Tensor):  # a weight and its scale share a file
            assert weight_map[name] == weight_map[name + "_scale_inv"]
    for src in (d, d / "model.safetensors.index.json"):
        got = jfp8.load_safetensors(src)
        assert set(got) == set(tensors)
        for name, want in tensors.items():
            if isinstance(want, jfp8.Fp8Tensor):
                _assert_same_fp8(got[name], want)
            else:
                np.testing.assert_array_equal(_bits(got[name]), _bits(want))
    # One shard when no limit is given.
    jfp8.save_safetensors(tmp_path / "one", tensors)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "model-00001-of-00001.safetensors", "model.safetensors.index.json"]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's own layout, built without jfp8's writer


def _deepseek_block_quant(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An independent 128x128 block quantizer in numpy: amax / 448 per block, blocks at the edges
    cut short (what zero-padding, quantizing and removing the padding gives)."""
    m, k = w.shape
    fmax = float(ml_dtypes.finfo(E4M3).max)
    q = np.empty((m, k), E4M3)
    s = np.empty((-(-m // BLOCK), -(-k // BLOCK)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].astype(np.float32)
            s[i, j] = max(np.abs(blk).max(), 1e-4) / fmax
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = np.clip(blk / s[i, j], -fmax, fmax).astype(E4M3)
    return q, s


def _weight_dequant(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """DeepSeek-V3 `inference/kernel.py::weight_dequant`, block by block: x[block] * s[i, j] in FP32."""
    y = np.empty(x.shape, np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            y[rows, cols] = x[rows, cols].astype(np.float32) * s[i, j]
    return y


def test_loads_a_checkpoint_written_like_deepseeks(tmp_path):
    rng = np.random.default_rng()
    fp8_shapes = {  # DeepSeek-V3's names, small sizes with tails ([out, in])
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (192, 256),
        "model.layers.0.self_attn.o_proj.weight": (256, 300),
        "model.layers.3.mlp.experts.7.down_proj.weight": (130, 1),
    }
    quantized = {n: _deepseek_block_quant(rng.standard_normal(s).astype(BF16)) for n, s in fp8_shapes.items()}
    plain = {
        "model.embed_tokens.weight": rng.standard_normal((50, 256)).astype(BF16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal((256,)).astype(BF16),
        "model.layers.3.mlp.gate.e_score_correction_bias": rng.standard_normal((8,)).astype(np.float32),
    }
    # Two shards, one weight's scale_inv in the other file (DeepSeek's fp8_cast_bf16.py allows it).
    (o_name, (o_w, o_s)), *rest = quantized.items()
    shard1 = {o_name: o_w, **{k: v for k, v in plain.items() if "embed" in k}}
    shard2 = {o_name + "_scale_inv": o_s, **{k: v for k, v in plain.items() if "embed" not in k}}
    for name, (w, s) in rest:
        shard2[name], shard2[name + "_scale_inv"] = w, s
    files = {"model-00001-of-00002.safetensors": shard1, "model-00002-of-00002.safetensors": shard2}
    for file, shard in files.items():
        st_numpy.save_file(shard, tmp_path / file, metadata={"format": "pt"})
    weight_map = {name: file for file, shard in files.items() for name in shard}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    got = jfp8.load_safetensors(tmp_path)
    assert set(got) == set(quantized) | set(plain)
    for name, (w, s) in quantized.items():
        t = got[name]
        assert isinstance(t, jfp8.Fp8Tensor) and t.block == (BLOCK, BLOCK) and t.logical == w.shape
        np.testing.assert_array_equal(_bits(np.asarray(t.data)[: w.shape[0], : w.shape[1]]), _bits(w))
        np.testing.assert_array_equal(np.asarray(t.scale), s)
        np.testing.assert_array_equal(np.asarray(_dequantize(t)), _weight_dequant(w, s))
    for name, v in plain.items():
        np.testing.assert_array_equal(_bits(got[name]), _bits(v))

    # Back to BF16 the way DeepSeek's fp8_cast_bf16.py does it, the cross-file scale included.
    names = cast_to_high_precision(tmp_path, tmp_path / "bf16")
    assert sorted(names) == sorted(quantized)
    bf16_map = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]
    assert bf16_map == {n: f for n, f in weight_map.items() if not n.endswith("_scale_inv")}
    back = jfp8.load_safetensors(tmp_path / "bf16")
    for name, (w, s) in quantized.items():
        assert back[name].dtype == BF16
        np.testing.assert_array_equal(_bits(back[name]), _bits(_weight_dequant(w, s).astype(BF16)))

    # [out, in] is scaled_matmul's NT operand b: y = x @ W.T.
    w, s = quantized["model.layers.0.self_attn.o_proj.weight"]
    x = rng.standard_normal((5, 300)).astype(np.float32)
    qx = _quantize(jnp.asarray(x), (1, BLOCK))
    matmul = jax.jit(lambda a, b: jfp8.scaled_matmul(a, b, out_dtype=jnp.float32, impl="xla"))
    y = matmul(qx, got["model.layers.0.self_attn.o_proj.weight"])
    want = np.asarray(_dequantize(qx), np.float64) @ _weight_dequant(w, s).astype(np.float64).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_writer_output_matches_deepseeks_names_dtypes_and_shapes(tmp_path):
    rng = np.random.default_rng()
    w = rng.standard_normal((300, 200)).astype(np.float32)
    t = _quantize(jnp.asarray(w), (BLOCK, BLOCK))
    embed = rng.standard_normal((10, 200)).astype(BF16)
    jfp8.save_safetensors(tmp_path / "m.safetensors", {"model.layers.0.mlp.down_proj.weight": t, "model.embed_tokens.weight": embed})
    with safetensors.safe_open(tmp_path / "m.safetensors", framework="np") as f:
        layout = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert layout == {
        "model.layers.0.mlp.down_proj.weight": ("F8_E4M3", [300, 200]),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", [3, 2]),
        "model.embed_tokens.weight": ("BF16", [10, 200]),
    }
    raw = _stored(tmp_path / "m.safetensors")
    data = np.frombuffer(raw["model.layers.0.mlp.down_proj.weight"][2], E4M3).reshape(300, 200)
    scale = np.frombuffer(raw["model.layers.0.mlp.down_proj.weight_scale_inv"][2], np.float32).reshape(3, 2)
    np.testing.assert_array_equal(_bits(data), _bits(np.asarray(t.data)[:300, :200]))
    np.testing.assert_array_equal(scale, np.asarray(t.scale))
    np.testing.assert_array_equal(_weight_dequant(data, scale), np.asarray(_dequantize(t)))


# ---------------------------------------------------------------------------------------------
# The cast CLI


def _load_cli():
    spec = importlib.util.spec_from_file_location("fp8_cast_cli", REPO / "scripts" / "fp8_cast.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_bf16_checkpoint(d: pathlib.Path, rng) -> dict[str, np.ndarray]:
    shapes = {
        "model.embed_tokens.weight": (384, 256),  # (shapes repeat: fewer compiles)
        "model.layers.0.input_layernorm.weight": (256,),
        "model.layers.0.self_attn.q_proj.weight": (384, 256),
        "model.layers.0.self_attn.o_proj.weight": (256, 300),
        "model.layers.0.mlp.gate.weight": (130, 256),  # the MoE router: stays BF16
        "model.layers.0.mlp.gate.e_score_correction_bias": (128,),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (130, 256),
        "model.layers.0.mlp.experts.0.down_proj.weight": (256, 64),  # a side < 128: stays BF16
        "model.norm.weight": (256,),
        "lm_head.weight": (384, 256),
    }
    ckpt = {n: rng.standard_normal(s).astype(np.float32 if "bias" in n else BF16) for n, s in shapes.items()}
    names = list(ckpt)
    files = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    d.mkdir()
    for file, ns in files.items():
        st_numpy.save_file({n: ckpt[n] for n in ns}, d / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, ns in files.items() for n in ns}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 256}))
    (d / "tokenizer.json").write_text("{}")
    return ckpt


def test_cli_casts_to_fp8_and_back(tmp_path):
    rng = np.random.default_rng()
    cli = _load_cli()
    ckpt = _tiny_bf16_checkpoint(tmp_path / "bf16", rng)
    fp8_names = {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
    }
    assert cli.main(["to-fp8", str(tmp_path / "bf16"), str(tmp_path / "fp8")]) == 0

    out = tmp_path / "fp8"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "bf16").iterdir())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert config["model_type"] == "deepseek_v3"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(ckpt) | {n + "_scale_inv" for n in fp8_names}
    got = jfp8.load_safetensors(out)
    for name, w in ckpt.items():
        if name in fp8_names:
            _assert_same_fp8(got[name], _quantize(jnp.asarray(w), (BLOCK, BLOCK)))
        else:
            np.testing.assert_array_equal(_bits(got[name]), _bits(w), err_msg=name)

    # Back to BF16, re-sharded on the way.
    assert cli.main(["to-bf16", str(out), str(tmp_path / "back"), "--max-shard-size", "200KB"]) == 0
    back_dir = tmp_path / "back"
    assert "quantization_config" not in json.loads((back_dir / "config.json").read_text())
    assert len(list(back_dir.glob("model-*.safetensors"))) >= 2
    back = jfp8.load_safetensors(back_dir)
    assert set(back) == set(ckpt)
    for name, w in ckpt.items():
        want = np.asarray(_dequantize(got[name])).astype(BF16) if name in fp8_names else w
        np.testing.assert_array_equal(_bits(back[name]), _bits(want), err_msg=name)

    # The keep patterns are configurable: keeping only norms quantizes the embedding, head and router too.
    assert cli.main(["to-fp8", str(tmp_path / "bf16"), str(tmp_path / "all.safetensors"), "--keep", "norm"]) == 0
    all_fp8 = {n for n, v in jfp8.load_safetensors(tmp_path / "all.safetensors").items() if isinstance(v, jfp8.Fp8Tensor)}
    assert all_fp8 == fp8_names | {"model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight"}


def test_cast_refuses_fp8_input_and_in_place_writes(tmp_path):
    t = _quantize(jnp.ones((128, 128)), (BLOCK, BLOCK))
    jfp8.save_safetensors(tmp_path / "f.safetensors", {"w.weight": t})
    with pytest.raises(ValueError, match="already holds the FP8 scale"):
        cast_to_fp8(tmp_path / "f.safetensors", tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match="new path"):
        cast_to_fp8(tmp_path / "f.safetensors", tmp_path / "f.safetensors")
    with pytest.raises(ValueError, match="regular expression"):
        CastPolicy(keep=("(",))


# ---------------------------------------------------------------------------------------------
# Atomic writes


def _leftovers(d: pathlib.Path) -> list[str]:
    return [p.name for p in d.iterdir() if ".tmp-" in p.name]


def test_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    old = _quantize(jnp.full((130, 130), 3.0), (BLOCK, BLOCK))
    jfp8.save_safetensors(path, {"w": old})

    def crash(arrays, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io.st_numpy, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        jfp8.save_safetensors(path, {"w": _quantize(jnp.ones((130, 130)), (BLOCK, BLOCK))})
    monkeypatch.undo()
    _assert_same_fp8(jfp8.load_safetensors(path)["w"], old)
    assert _leftovers(tmp_path) == []


def test_failed_sharded_write_never_mixes_checkpoints(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    old = {f"l{i}.weight": _quantize(jnp.full((128, 128), i + 1.0), (BLOCK, BLOCK)) for i in range(3)}
    new = {k: _quantize(-_dequantize(t), (BLOCK, BLOCK)) for k, t in old.items()}
    jfp8.save_safetensors(d, old, max_shard_bytes=1)  # one weight per shard
    real_save, real_replace = safetensors_io.st_numpy.save_file, os.replace

    calls = []
    def save_then_crash(arrays, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("killed while writing shard 2")
        real_save(arrays, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_io.st_numpy, "save_file", save_then_crash)
    with pytest.raises(OSError, match="shard 2"):
        jfp8.save_safetensors(d, new, max_shard_bytes=1)
    monkeypatch.undo()
    got = jfp8.load_safetensors(d)  # still the old checkpoint, whole
    for k, t in old.items():
        _assert_same_fp8(got[k], t)
    assert _leftovers(d) == []

    # A crash while renaming shards into place leaves no index: loading refuses, never mixes.
    renames = []
    def replace_then_crash(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise OSError("killed while renaming")
        real_replace(src, dst)

    monkeypatch.setattr(safetensors_io.os, "replace", replace_then_crash)
    with pytest.raises(OSError, match="renaming"):
        jfp8.save_safetensors(d, new, max_shard_bytes=1)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="index"):
        jfp8.load_safetensors(d)
    # Saving again completes it, and a smaller checkpoint removes the shards it no longer uses.
    jfp8.save_safetensors(d, {"l0.weight": new["l0.weight"]})
    assert sorted(p.name for p in d.iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    _assert_same_fp8(jfp8.load_safetensors(d)["l0.weight"], new["l0.weight"])


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_save_rejects_what_the_format_cannot_hold(tmp_path):
    x = jnp.ones((130, 256))
    f = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match=r"block \(1, 128\).*jfp8.quantize\(t.dequantize\(\), \(128, 128\)\)"):
        jfp8.save_safetensors(f, {"w": _quantize(x, (1, BLOCK))})
    with pytest.raises(ValueError, match="block None"):
        jfp8.save_safetensors(f, {"w": _quantize(x, None)})
    with pytest.raises(ValueError, match="reserves.*Fp8Tensor named 'w'"):
        jfp8.save_safetensors(f, {"w_scale_inv": np.ones((2, 2), np.float32)})
    with pytest.raises(TypeError, match="np.asarray"):
        jfp8.save_safetensors(f, {"w": 1.0})
    with pytest.raises(ValueError, match="directory"):
        jfp8.save_safetensors(f, {"w": x}, max_shard_bytes=10)
    with pytest.raises(TypeError, match="str to str"):
        jfp8.save_safetensors(f, {"w": x}, metadata={"step": 3})
    assert not f.exists()


def _write_raw(path, tensors):
    st_numpy.save_file(tensors, path)
    return path


def test_load_rejects_inconsistent_pairs(tmp_path):
    w = np.ones((300, 200), E4M3)
    cases = {
        "wrong scale shape": ({"w": w, "w_scale_inv": np.ones((2, 2), np.float32)}, r"has shape \(2, 2\).*needs \(3, 2\)"),
        "scale without data": ({"v": w, "w_scale_inv": np.ones((3, 2), np.float32)}, "without its data tensor 'w'"),
        "data not E4M3": ({"w": np.ones((300, 200), BF16), "w_scale_inv": np.ones((3, 2), np.float32)}, "not float8_e4m3fn"),
        "scale not F32": ({"w": w, "w_scale_inv": np.ones((3, 2), BF16)}, "float32"),
        "1-D data": ({"w": np.ones((5,), E4M3), "w_scale_inv": np.ones((1,), np.float32)}, "at least 2 axes"),
    }
    for i, (case, (tensors, match)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=match):
            jfp8.load_safetensors(_write_raw(tmp_path / f"{i}.safetensors", tensors))


def test_load_rejects_broken_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        jfp8.load_safetensors(tmp_path)
    _write_raw(tmp_path / "a.safetensors", {"x": np.ones(3, np.float32)})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"disagree.*\['y'\]"):
        jfp8.load_safetensors(tmp_path)
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        jfp8.load_safetensors(index)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        jfp8.load_safetensors(tmp_path)


def test_load_names_a_cut_short_or_broken_file(tmp_path):
    """A truncated file (an interrupted copy) raises ValueError naming the file and what it lacks,
    not the safetensors library's raw 'incomplete metadata'."""
    rng = np.random.default_rng()
    whole = tmp_path / "whole.safetensors"
    jfp8.save_safetensors(whole, {"w": rng.standard_normal((int(rng.integers(2, 50)), 7)).astype(np.float32),
                                  "b": np.arange(int(rng.integers(1, 9)), dtype=np.int32)})
    raw = whole.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    cases = {
        "no header length": (int(rng.integers(0, 8)), "starts with an 8-byte header length"),
        "header cut": (int(rng.integers(9, header_end)), "header alone takes"),
        "data cut": (int(rng.integers(header_end, len(raw))), "bytes missing"),
    }
    for case, (keep, match) in cases.items():
        cut = tmp_path / f"{case.replace(' ', '_')}.safetensors"
        cut.write_bytes(raw[:keep])
        with pytest.raises(ValueError, match=match) as e:
            jfp8.load_safetensors(cut)
        assert str(cut) in str(e.value) and "copy" in str(e.value), case
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ValueError, match="not safetensors' JSON"):
        jfp8.load_safetensors(garbled)
    # Whole, but inconsistent: the library's own error, wrapped with the file's name.
    header = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match=r"bad\.safetensors is not a valid safetensors file"):
        jfp8.load_safetensors(bad)
    assert set(jfp8.load_safetensors(whole)) == {"w", "b"}


def test_cli_failure_says_what_in_one_line_and_leaves_nothing(tmp_path, capsys):
    rng = np.random.default_rng()
    cli = _load_cli()
    assert cli.main(["to-fp8", str(tmp_path / "no_such_dir"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_dir" in err and "to-fp8" in err, err
    assert not (tmp_path / "out").exists()
    # A failure halfway (the second shard is cut short): the new output directory goes too.
    _tiny_bf16_checkpoint(tmp_path / "bf16", rng)
    second = tmp_path / "bf16" / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[: -int(rng.integers(1, 1000))])
    for dst in ("out", "out.safetensors"):
        assert cli.main(["to-fp8", str(tmp_path / "bf16"), str(tmp_path / dst)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "model-00002-of-00002.safetensors" in err and "bytes missing" in err
        assert not (tmp_path / dst).exists(), dst
    # An existing output directory is not removed by a failed cast into it.
    (tmp_path / "kept").mkdir()
    assert cli.main(["to-bf16", str(tmp_path / "bf16"), str(tmp_path / "kept")]) == 1
    assert (tmp_path / "kept").is_dir()

"""The end-to-end benchmarks (issue 43) on CPU at tiny shapes: the routed-expert block
(`bench_moe_block.py`) and the training step (`bench_step.py`).

Each `main(argv)` must write a well-formed record, and its check before timing must be real: a
wrong FP8 side is reported as failed (and not timed), with exit status 1. The step's MFU rests on
its FLOP count, checked here against a count by hand.
"""

import argparse
import json
import pathlib
import re
import sys

import pytest

import jfp8.nn.moe
import jfp8.train.step
from helpers import BENCHMARKS, ONE_MOE_LAYER, load_benchmark

sys.path.insert(0, str(BENCHMARKS))

FAST = ["--warmup", "0", "--repeats", "1", "--max-seconds", "0.5"]
BLOCK = "64x128x128x2"  # 64 tokens, d_model 128, expert width 128, 2 experts (top-2: 128 rows)
PARTS = {"y", "dx", "d_gate", "d_w13", "d_w2"}
# The tiny preset cut to one MoE block without MTP: the step's plumbing at a third of the compile.
STEP = ["--presets", "tiny", "--batch", "2", "--seq-len", "32", "--steps", "4", "--timed-from", "2",
        "--model", ONE_MOE_LAYER]


def _record(out: pathlib.Path, name: str) -> dict:
    (path,) = out.glob(f"{name}-*.json")
    record = json.loads(path.read_text())
    for key in ("device", "jax_version", "date", "commit", "dirty", "rows", "failed", "skipped"):
        assert key in record, key
    return record


@pytest.fixture(scope="module")
def block_bench():
    return load_benchmark("bench_moe_block")


@pytest.fixture(scope="module")
def step_bench():
    return load_benchmark("bench_step")


@pytest.fixture
def fresh_steps():
    """`build`'s step functions are cached per model; a test that changes what they trace must
    not get (or leave behind) a cached one."""
    jfp8.train.step._step_functions.cache_clear()
    yield
    jfp8.train.step._step_functions.cache_clear()


def test_moe_block_record(tmp_path, block_bench):
    assert block_bench.main(["--shapes", BLOCK, "--out", str(tmp_path), *FAST]) == 0
    record = _record(tmp_path, "bench_moe_block")
    rows = {r["impl"]: r for r in record["rows"]}
    assert set(rows) == {"bf16-einsum", "bf16-xla", "fp8-dispatch-xla", "fp8-xla"} and not record["failed"]
    assert record["shapes"] == [dict(tokens=64, d_model=128, hidden=128, experts=2, label=BLOCK)]
    assert record["configs"][BLOCK]["group_sizes"] == [64, 64]  # equal groups: the einsum is exact
    assert record["skipped"] == []
    # The library's own BF16 layer (here the reference's scan) is held to the f32 block like the einsum.
    assert 0 < max(rows["bf16-xla"]["err_vs_f32"].values()) < 2e-2
    for r in rows.values():
        assert r["tflops"] > 0 and r["problem"] == BLOCK and set(r["err_vs_f32"]) == PARTS
    assert rows["bf16-einsum"]["ratio_vs_bf16"] == 1.0 and max(rows["bf16-einsum"]["err_vs_f32"].values()) < 2e-2
    for name in ("fp8-dispatch-xla", "fp8-xla"):
        # FP8 dispatch quantizes each token once and the 1x128 tiles are row-local: the same bits
        # as the layer that quantizes the dispatched rows, i.e. the XLA reference.
        assert set(rows[name]["err_vs_reference"].values()) == {0.0}
        assert 1e-3 < max(rows[name]["err_vs_f32"].values()) < 0.15
        assert rows[name]["ratio_vs"]["bf16-einsum"] == rows[name]["ratio_vs_bf16"]


def test_wrong_moe_block_fails_its_check(tmp_path, monkeypatch, block_bench):
    """Off by 10 %: inside the f32 bound, caught by the same-numerics one (the XLA reference
    layer is built apart from the measured block). The issue's row; fp8-xla shares its check."""
    name = "fp8-dispatch-xla"
    right = block_bench._fp8_block

    def wrong(*args):
        block = right(*args)
        return lambda x, params: block(x, params) * 1.1

    monkeypatch.setattr(block_bench, "_fp8_block", wrong)
    argv = ["--shapes", BLOCK, "--only", name, "--out", str(tmp_path), *FAST]
    assert block_bench.main(argv) == 1
    record = _record(tmp_path, "bench_moe_block")
    (failure,) = record["failed"]
    assert failure["impl"] == name and "check failed" in failure["error"] and record["rows"] == []
    # Each part's error, on both sides (the H100's layer rows of 2026-11-28 said only the worst).
    parts = r"y \S+, dx \S+, d_gate \S+, d_w13 \S+, d_w2 \S+"
    assert re.search(rf"run here \({parts}\); against the f32 block: this path {parts}, the reference path {parts}$",
                     failure["error"]), failure["error"]


def test_step_record(tmp_path, monkeypatch, step_bench, fresh_steps):
    # The CPU has no datasheet peak; an H100's BF16 one stands in, so that MFU is computed.
    monkeypatch.setattr(step_bench, "peak_tflops", lambda kind, dtype: {"bf16": 989.0}[dtype])
    assert step_bench.main([*STEP, "--profile", "1", "--out", str(tmp_path)]) == 0
    record = _record(tmp_path, "bench_step")
    rows = {r["precision"]: r for r in record["rows"]}
    assert set(rows) == {"bf16", "fp8"} and not record["failed"]
    for r in rows.values():  # one more step under the profiler: XLA:CPU's thunks, by the model's categories
        prof = r["profile"]
        assert "error" not in prof and prof["steps"] == 1 and prof["module"] == "jit_train_step"
        assert prof["source"].startswith("host threads") and "busy_ms" not in prof
        assert prof["kernel_ms"] > 0 and prof["unattributed_ms"] < 0.05 * prof["kernel_ms"]
        assert prof["categories"]["xla gemm (bf16)"]["kernels"] > 0
        assert r["steps_run"] == 4  # the profiled step is not one of the timed ones
    assert "ragged_dot" in record["bf16_experts"] and "6 x" in record["flops_formula"]
    assert record["configs"]["tiny"]["flops_per_token"] > 0 and record["timed_from"] == 2
    for r in rows.values():
        assert r["steps_run"] == 4 and r["timed_steps"] == [2, 4] and len(r["losses"]) == 4
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(64 / (r["step_ms"] / 1e3))
        assert set(r["first_jit_s"]) == {"trace", "lower", "compile", "total"}
        assert r["peak_bytes_in_use"] == "not measured" and not r["peak_is_own"]  # CPU: no allocator stats
        flops = record["configs"]["tiny"]["flops_per_token"]
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / 989e12)  # both precisions: BF16's peak
        assert r["xla_memory"]["peak_bytes"] > 0 and r["all_finite"]
    # The front door's summary: FP8 against BF16 from the two rows.
    c = record["fp8_vs_bf16"]["tiny"]
    assert c["speedup"] == pytest.approx(rows["bf16"]["step_ms"] / rows["fp8"]["step_ms"])
    assert c["loss_window"] == [4, 4]  # the last fifth of 4 steps: the last one
    assert c["loss_gap"] == pytest.approx((rows["fp8"]["losses"][-1] - rows["bf16"]["losses"][-1]) / rows["bf16"]["losses"][-1])
    assert c["xla_peak_bytes"]["fp8"] == rows["fp8"]["xla_memory"]["peak_bytes"]
    assert c["device_peak_bytes"] == {"fp8": None, "bf16": None}  # CPU: no allocator statistics
    fp8 = rows["fp8"]
    assert fp8["impl"] == "fp8-xla" and fp8["same_init"] and fp8["ratio_vs_bf16"] > 0
    assert fp8["check"]["against"] == "bf16 step 1" and fp8["check"]["loss_rel"] < 1e-3
    assert fp8["losses"] != rows["bf16"]["losses"]  # the same batches, different numerics


def test_a_failed_profile_keeps_the_timed_steps(tmp_path, monkeypatch, step_bench, fresh_steps):
    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(step_bench, "profile_steps", broken)
    argv = [*STEP, "--precisions", "bf16", "--profile", "2", "--out", str(tmp_path)]
    assert step_bench.main(argv) == 0
    record = _record(tmp_path, "bench_step")
    (row,) = record["rows"]
    assert row["step_ms"] > 0 and row["steps_run"] == 4 and not record["failed"]
    assert row["profile"] == {"error": "RuntimeError: no profiler here", "steps": 2}


def test_wrong_step_fails_its_check(tmp_path, monkeypatch, step_bench, fresh_steps):
    """The FP8 side's routed experts doubled: its first step's gradient norm leaves BF16's by
    a few percent (the loss at initialisation barely moves), and FP8 is not timed."""
    right, right_gathered = jfp8.nn.moe.grouped_fp8_linear, jfp8.nn.moe.gathered_grouped_fp8_linear

    def wrong(x, w, sizes, recipe, **kw):  # the second (down); kw: w_fp8
        return right(x, w, sizes, recipe, **kw) * (2.0 if recipe.enabled else 1.0)

    def wrong_gathered(tokens, rows, w, sizes, recipe, **kw):  # the first expert GEMM (gate/up)
        return right_gathered(tokens, rows, w, sizes, recipe, **kw) * (2.0 if recipe.enabled else 1.0)

    monkeypatch.setattr(jfp8.nn.moe, "grouped_fp8_linear", wrong)
    monkeypatch.setattr(jfp8.nn.moe, "gathered_grouped_fp8_linear", wrong_gathered)
    assert step_bench.main([*STEP, "--out", str(tmp_path)]) == 1
    record = _record(tmp_path, "bench_step")
    (failure,) = record["failed"]
    assert failure["impl"] == "fp8-xla" and "check failed" in failure["error"]
    assert failure["check"]["grad_norm_rel"] > step_bench.GRAD_NORM_RTOL
    assert [r["precision"] for r in record["rows"]] == ["bf16"]


def test_model_flops_by_hand(step_bench):
    """tiny (d 64, vocab 256, 2 layers of which 1 dense, 4 heads, 4 experts top-2 + 1 shared of
    width 32, dense FFN 128, MTP), seq 128. Per attention: W^DQ 64·32 + W^UQ,W^QR 32·4·24 +
    W^DKV,W^KR 64·40 + W^UK,W^UV 32·4·32 + W^O 4·16·64 = 15872; dense block 15872 + 3·64·128 =
    40448; MoE block 15872 + shared 6144 + gate 256 + 2 · 6144 = 34560; head 64·256 = 16384.
    Main 40448 + 34560 + 16384 = 91392; MTP 2·64·64 + 34560 + 16384 = 59136. Attention core:
    6 · 3 layers · 128 · 4 heads · (24 + 16)."""
    from jfp8.nn import ModelConfig

    flops = step_bench.model_flops(ModelConfig.tiny(), 128)
    assert flops["matmul_params"] == 91392 + 59136
    assert flops["attention_flops"] == 6 * 3 * 128 * 4 * 40
    assert flops["flops_per_token"] == 6 * (91392 + 59136) + 6 * 3 * 128 * 4 * 40
    no_mtp = step_bench.model_flops(ModelConfig.tiny(mtp=False), 128)
    assert no_mtp["flops_per_token"] == 6 * 91392 + 6 * 2 * 128 * 4 * 40



def test_cpu_pace_ratios_are_medians_over_processes():
    """benchmarks/cpu_pace.py's reading: FP8/BF16 of each metric's median over the fresh
    processes of a preset (other presets' processes do not count)."""
    pace = load_benchmark("cpu_pace")
    rows = [{"preset": "tiny", "precision": p, **{m: v for m in pace.METRICS}}
            for p, v in (("fp8", 3.0), ("fp8", 9.0), ("fp8", 4.0), ("bf16", 2.0), ("bf16", 2.0), ("bf16", 1.0))]
    rows.append({"preset": "small", "precision": "fp8", **{m: 100.0 for m in pace.METRICS}})
    got = pace._ratios(rows, "tiny")
    assert got["fp8"]["train_step_s"] == 4.0 and got["bf16"]["eval_compile_s"] == 2.0
    assert got["fp8_over_bf16"] == {m: 2.0 for m in pace.METRICS}


def test_a_cudnn_failure_in_the_step_retries_with_xla_attention(tmp_path, monkeypatch, step_bench, fresh_steps):
    """cuDNN's attention failing at the step's own compile (its first check passed at one
    sequence): the precision runs again with attention=xla and its row says why; another error is
    the precision's failure, with no second try."""
    real = step_bench.run_precision
    tried = []

    def cudnn_fails(config, *args, **kwargs):
        tried.append(config.model_config().attention)
        if config.model_config().attention != "xla":
            raise RuntimeError("INTERNAL: cuDNN graph: CUDNN_STATUS_NOT_SUPPORTED (no valid engine)")
        return real(config, *args, **kwargs)

    monkeypatch.setattr(step_bench, "run_precision", cudnn_fails)
    assert step_bench.main([*STEP, "--precisions", "bf16", "--out", str(tmp_path)]) == 0
    (row,) = _record(tmp_path, "bench_step")["rows"]
    assert tried == ["auto", "xla"] and "CUDNN_STATUS_NOT_SUPPORTED" in row["attention_fallback"]
    assert row["attention"] == "xla" and row["step_ms"] > 0

    def other_error(config, *args, **kwargs):
        tried.append(config.model_config().attention)
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(step_bench, "run_precision", other_error)
    out = tmp_path / "second"
    assert step_bench.main([*STEP, "--precisions", "bf16", "--out", str(out)]) == 1
    record = _record(out, "bench_step")
    assert tried[2:] == ["auto"] and not record["rows"] and "out of memory" in record["failed"][0]["error"]


def test_step_recipe_overrides_reach_the_fp8_step_only(step_bench):
    """`--recipe quantize_impl=xla`: parsed against Fp8Recipe (a bad value is an argparse error), in
    the FP8 run's recipe, and not in BF16's (which has none)."""
    overrides = step_bench.parse_recipe_overrides("quantize_impl=xla")
    assert overrides == (("quantize_impl", "xla"),)
    fp8 = step_bench._config("tiny", "fp8", 2, 32, 4, 0, (), overrides)
    assert fp8.model_config().recipe.quantizer_impl == "xla"
    assert fp8.model_config().recipe.impl == "auto"
    assert step_bench._config("tiny", "bf16", 2, 32, 4, 0, (), overrides).recipe_overrides == ()
    with pytest.raises(argparse.ArgumentTypeError, match="quantize_impl must be one of"):
        step_bench.parse_recipe_overrides("quantize_impl=cuda")
    with pytest.raises(argparse.ArgumentTypeError, match="no field"):
        step_bench.parse_recipe_overrides("quantise_impl=xla")


def test_cpu_compile_split_stand_ins_and_summary():
    """benchmarks/cpu_compile_split.py: its XLA-cast stand-in gives `cast_e4m3`'s bytes (so the
    variant keeps the bits, as its record says), its one-dot stand-in is the chunked GEMM where K
    is one chunk (and only there), and the summary is the median over rounds with the loss bits
    compared to the FP8 step's."""
    import jax.numpy as jnp
    import numpy as np

    import jfp8.reference as reference
    import pallas_kernels.fp8_math as fp8_math

    split = load_benchmark("cpu_compile_split")
    swaps = dict(((m.__name__, n), f) for m, n, f in split.stand_ins("fp8-both"))
    assert set(swaps) == {("pallas_kernels.fp8_math", "cast_e4m3"), ("jfp8.reference", "chunked_matmul")}
    assert split.stand_ins("fp8") == [] and split.stand_ins("bf16") == []
    with pytest.raises(ValueError, match="unknown variant 'fp16'"):
        split.stand_ins("fp16")

    rng = np.random.default_rng()
    q = rng.standard_normal(4096).astype(np.float32) * rng.choice([1e-4, 1e-2, 1.0, 100.0], 4096).astype(np.float32)
    q = np.clip(np.concatenate([q, [0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10]]).astype(np.float32), -448, 448)
    got = np.asarray(swaps["pallas_kernels.fp8_math", "cast_e4m3"](jnp.asarray(q))).view(np.uint8)
    want = np.asarray(fp8_math.cast_e4m3(jnp.asarray(q))).view(np.uint8)
    np.testing.assert_array_equal(got, want)

    one_dot = swaps["jfp8.reference", "chunked_matmul"]
    for kp in (128, 384):
        a = jnp.asarray(rng.standard_normal((16, kp)) * 30, jnp.float32).astype(jnp.float8_e4m3fn)
        b = jnp.asarray(rng.standard_normal((24, kp)) * 30, jnp.float32).astype(jnp.float8_e4m3fn)
        sa = jnp.asarray(rng.uniform(0.5, 2, (16, kp // 128)), jnp.float32)
        sb = jnp.asarray(rng.uniform(0.5, 2, (24, kp // 128)), jnp.float32)
        same = np.array_equal(np.asarray(one_dot(a, sa, b, sb)), np.asarray(reference.chunked_matmul(a, sa, b, sb)))
        assert same == (kp == 128), kp

    def row(variant, compile_s, bits, preset="small"):
        return {"preset": preset, "variant": variant, "step": "eval", "trace_s": 1.0, "lower_s": 0.5,
                "compile_s": compile_s, "instructions": 10, "fusions": 2, "loss_bits": bits}

    rows = [row("fp8", 6.0, "a"), row("fp8", 8.0, "a"), row("fp8", 7.0, "a"), row("bf16", 3.0, "b"),
            row("bf16", 4.0, "b"), row("fp8-one-dot", 5.0, "c"), row("fp8-xla-cast", 5.5, "a"),
            row("fp8", 100.0, "z", preset="tiny")]
    got = split.summarize(rows)["small"]["eval"]
    assert got["fp8"]["compile_s"] == 7.0 and got["bf16"]["compile_s"] == 3.5
    assert got["fp8"]["compile_over_bf16"] == 2.0
    assert got["fp8-xla-cast"]["same_loss_bits_as_fp8"] and not got["fp8-one-dot"]["same_loss_bits_as_fp8"]
    assert "same_loss_bits_as_fp8" not in got["bf16"]


def test_bits_snapshot_compares_bytes(tmp_path):
    """benchmarks/bits_snapshot.py's comparison: arrays kept as their bytes whatever the dtype
    (bf16 and E4M3 included, which np.savez cannot store as such), saved and loaded back equal,
    and every kind of difference named: one element's bits (also -0 against +0, which == hides),
    a dtype, a shape, an array missing on either side."""
    import jax.numpy as jnp
    import numpy as np

    snap = load_benchmark("bits_snapshot")
    rng = np.random.default_rng()
    arrays = {
        "y": np.asarray(jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16)),
        "q": np.asarray(jnp.asarray(rng.standard_normal(9) * 50, jnp.float32).astype(jnp.float8_e4m3fn)),
        "loss": np.float32(rng.standard_normal()),
        "finite": np.array([True, False]),
        "zero": np.array([0.0, 1.0], np.float32),
    }
    bits = snap._as_bits(arrays)
    assert set(bits) == {"y|bfloat16", "q|float8_e4m3fn", "loss|float32", "finite|bool", "zero|float32"}
    with open(tmp_path / "s.npz", "wb") as f:
        np.savez(f, **bits)
    with np.load(tmp_path / "s.npz") as saved:
        loaded = {k: saved[k] for k in saved.files}
    assert snap.compare(bits, loaded) == []

    changed = dict(arrays, zero=np.array([-0.0, 1.0], np.float32), finite=np.array([True, True]))
    changed["y"] = arrays["y"].copy()
    changed["y"].view(np.uint16)[2, 3] ^= 1  # one ulp
    changed["loss"] = np.float64(arrays["loss"])
    del changed["q"]
    changed["extra"] = np.zeros(3, np.float32)
    diff = "\n".join(snap.compare(snap._as_bits(changed), loaded))
    assert "zero|float32: 1 of 2 elements differ" in diff and "finite|bool: 1 of 2 elements differ" in diff
    assert "y|bfloat16: 1 of 35 elements differ" in diff
    assert "loss|float32: only in the saved snapshot" in diff and "loss|float64: not in the saved snapshot" in diff
    assert "q|float8_e4m3fn: only in the saved snapshot" in diff and "extra|float32: not in" in diff
    reshaped = dict(bits, **{"y|bfloat16": bits["y|bfloat16"].reshape(7, 5)})
    assert snap.compare(reshaped, loaded) == ["y|bfloat16: (7, 5) uint16 against the saved (5, 7) uint16"]

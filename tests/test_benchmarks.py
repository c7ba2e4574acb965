"""Smoke tests of the benchmark scripts and the GPU-session orchestrator, on CPU at tiny shapes.

Each benchmark's `main(argv)` must write a well-formed record, and its check before timing must be
real: a wrong implementation is reported as failed (and not timed), with exit status 1.
"""

import dataclasses
import json
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

import jfp8

from helpers import BENCHMARKS, load_benchmark as _load

sys.path.insert(0, str(BENCHMARKS))  # the scripts' shared module, _bench, lives there
from _bench import parse_config  # noqa: E402

FAST = ["--warmup", "0", "--repeats", "1", "--max-seconds", "0.5"]
GEMM_KEYS = {"impl", "m", "n", "k", "ms", "tflops", "ratio_vs_bf16", "rel_error"}


# The grouped kernel's simple form as a --config row (it cannot run here: recorded as skipped).
GROUPED_SIMPLE = "warp_specialized=false,persistent=false,tile_m=64,max_concurrent_steps=2"


def _record(out: pathlib.Path, name: str) -> dict:
    (path,) = out.glob(f"{name}-*.json")
    record = json.loads(path.read_text())
    for key in ("device", "jax_version", "date", "rows", "failed", "skipped"):
        assert key in record, key
    return record


@pytest.fixture(scope="module")
def benches():
    """The benchmark modules, loaded once: their jitted references compile once for all tests."""
    names = ("bench_gemm", "bench_grouped", "bench_quantize", "bench_linear")
    return {name: _load(name) for name in names}


@pytest.fixture(scope="module")
def records(tmp_path_factory, benches):
    """One tiny run of each benchmark into one directory (shared by the tests below)."""
    out = tmp_path_factory.mktemp("bench")
    rc = benches["bench_gemm"].main(["--shapes", "128x128x256", "--config", "max_concurrent_steps=2", "--out", str(out), *FAST])
    assert rc == 0
    rc = benches["bench_grouped"].main(["--shapes", "2x128x128x256", "--config", GROUPED_SIMPLE, "--out", str(out), *FAST])
    assert rc == 0
    rc = benches["bench_grouped"].main(
        ["--op", "wgrad", "--shapes", "2x128x128x256", "--config", GROUPED_SIMPLE, "--out", str(out), *FAST])
    assert rc == 0
    rc = benches["bench_quantize"].main(
        ["--shapes", "128x256:bfloat16", "--config", "swizzle=false", "--device-time", "2", "--out", str(out), *FAST]
    )
    assert rc == 0
    assert benches["bench_linear"].main(["--shapes", "128x256x256", "--prequantized", "--out", str(out), *FAST]) == 0
    return out


def test_gemm_record(records):
    record = _record(records, "bench_gemm")
    rows = {r["impl"]: r for r in record["rows"]}
    assert {"xla-bf16", "xla-fp8-per-tensor", "jfp8-xla"} <= set(rows)
    for r in rows.values():
        assert GEMM_KEYS <= set(r) and r["tflops"] > 0 and (r["m"], r["n"], r["k"]) == (128, 128, 256)
    assert rows["xla-bf16"]["ratio_vs_bf16"] == 1.0
    assert "xla-bf16" in rows["jfp8-xla"]["ratio_vs"]
    skipped = {s["impl"]: s["reason"] for s in record["skipped"]}
    assert "torch-fp8-blockwise" in skipped and "jfp8-mosaic[max_concurrent_steps=2]" in skipped  # no GPU here
    assert skipped["jfp8-mosaic-kernel"] == "needs a Hopper GPU"  # the wrapper-free row, with --config


def test_grouped_record(records):
    record = _record(records, "bench_grouped")
    rows = {r["impl"]: r for r in record["rows"]}
    assert {"xla-bf16-einsum", "xla-ragged-dot-bf16", "jfp8-xla"} <= set(rows)
    for r in rows.values():
        assert GEMM_KEYS <= set(r) and r["groups"] == 2 and r["m"] == 256
    skipped = {s["impl"]: s["reason"] for s in record["skipped"]}
    assert f"jfp8-mosaic[{GROUPED_SIMPLE}]" in skipped and record["configs"] == [GROUPED_SIMPLE]  # no GPU here


def test_grouped_wgrad_record(records):
    """--op wgrad: dW_g = dy_g^T x_g per group; every row passed its check (bf16 rows against the
    f32 einsum, jfp8's against the FP8 reference) before it was timed."""
    record = _record(records, "bench_grouped_wgrad")
    assert record["op"] == "wgrad" and record["failed"] == []
    rows = {r["impl"]: r for r in record["rows"]}
    assert set(rows) == {"xla-bf16-einsum", "xla-ragged-dot-bf16", "jfp8-xla"}
    for r in rows.values():
        assert GEMM_KEYS <= set(r) and (r["groups"], r["m"], r["n"], r["k"]) == (2, 256, 128, 256)
    assert rows["jfp8-xla"]["rel_error"] == 0.0  # the XLA path is the reference
    assert 0 < rows["xla-ragged-dot-bf16"]["rel_error"] < 1e-2 and 0 < rows["xla-bf16-einsum"]["rel_error"] < 1e-2
    skipped = {s["impl"] for s in record["skipped"]}
    assert skipped == {"mgpu-transposed-ragged-dot-bf16", f"jfp8-mosaic[{GROUPED_SIMPLE}]"}  # no GPU here


def test_quantize_record(records):
    record = _record(records, "bench_quantize")
    kernels = {r["kernel"]: r for r in record["rows"]}
    assert {"copy", "tile", "block", "block-t", "block+mT", "column-t", "grad", "grad-2",
            "retile"} <= set(kernels)
    assert record["copy_gbps"] > 0
    for r in kernels.values():
        assert r["gbps"] > 0 and r["mismatches"] == 0 and r["frac_of_copy"] > 0
        # under the profiler: XLA:CPU's thunks of the jitted call (the copy is one add)
        d = r["device"]
        assert d["calls"] == 2 and d["kernel_ms"] > 0 and d["gbps"] > 0 and d["frac_of_copy"] > 0
        assert d["kernels_per_call"] == 1 if r["kernel"] == "copy" else d["kernels_per_call"] >= 1
    skipped = {s["impl"]: s["reason"] for s in record["skipped"]}
    assert "jfp8-mosaic-retile[swizzle=false]" in skipped and record["configs"] == ["swizzle=false"]


def test_linear_record(records):
    record = _record(records, "bench_linear")
    rows = {r["impl"]: r for r in record["rows"]}
    assert set(rows) == {"bf16", "fp8-xla", "fp8-xla-prequantized"} and not record["failed"]
    for r in rows.values():
        assert GEMM_KEYS <= set(r) and r["tflops"] > 0 and (r["m"], r["n"], r["k"]) == (128, 256, 256)
    assert rows["bf16"]["ratio_vs_bf16"] == 1.0 and rows["bf16"]["rel_error"] < 2e-2
    # The FP8 row is checked against the XLA reference (itself here: 0) and its E4M3 error
    # against f32 autodiff recorded: a few percent, not zero.
    assert rows["fp8-xla"]["rel_error"] == 0 and 1e-3 < rows["fp8-xla"]["err_vs_f32"] < 0.1
    # W's copies made before the timer (`jfp8.fp8_weight`): the same bits as the op quantizing W.
    assert rows["fp8-xla-prequantized"]["rel_error"] == 0
    assert rows["fp8-xla-prequantized"]["err_vs_f32"] == rows["fp8-xla"]["err_vs_f32"]


def test_a_wrong_prequantized_linear_fails_its_check(tmp_path, monkeypatch, benches):
    """The prequantized row is checked as the fp8 row is: copies of another weight fail it."""
    bench = benches["bench_linear"]
    make, step = bench._fp8_linear_prequantized("xla")
    monkeypatch.setattr(bench, "_fp8_linear_prequantized", lambda impl: (lambda w: make(w * 1.1), step))
    argv = ["--shapes", "128x256x256", "--only", "fp8", "--prequantized", "--out", str(tmp_path), *FAST]
    assert bench.main(argv) == 1
    (failure,) = _record(tmp_path, "bench_linear")["failed"]
    assert failure["impl"] == "fp8-xla-prequantized" and "check failed" in failure["error"]


def _wrong_forward_only(linear):
    """`linear` with a zero forward output and the right backward."""
    @jax.custom_vjp
    def f(x, w):
        return linear(x, w) * 0

    f.defvjp(lambda x, w: (f(x, w), jax.vjp(linear, x, w)[1]), lambda vjp, g: vjp(g))
    return f


@pytest.mark.parametrize(
    "wrong",
    [lambda f: lambda x, w: f(x, w) * 1.1,  # every output off by 10 %
     _wrong_forward_only],  # y wrong, dx and dw right
    ids=["scaled", "forward-only"],
)
def test_wrong_linear_fails_its_check(tmp_path, monkeypatch, benches, wrong):
    """Also where the measured FP8 path is the reference path itself (impl "xla", here): the
    bound against f32 autodiff catches it."""
    bench = benches["bench_linear"]
    right = bench._fp8_linear
    monkeypatch.setattr(bench, "_fp8_linear", lambda *args: wrong(right(*args)))
    argv = ["--shapes", "128x256x256", "--only", "fp8", "--out", str(tmp_path), *FAST]
    assert bench.main(argv) == 1
    (failure,) = _record(tmp_path, "bench_linear")["failed"]
    assert failure["impl"] == "fp8-xla" and "check failed" in failure["error"]


def test_a_linear_off_its_reference_says_which_output(tmp_path, monkeypatch, benches):
    """3 % off in every output: inside the bound against f32 autodiff, outside the one against the
    reference path run on the CPU; the failure gives each output's error on both sides (the H100's
    1.29e-2 of 2026-11-28 could not be told apart)."""
    bench = benches["bench_linear"]
    right = bench._fp8_linear
    monkeypatch.setattr(bench, "_fp8_linear", lambda *args: (lambda f: lambda x, w: f(x, w) * 1.03)(right(*args)))
    argv = ["--shapes", "128x256x256", "--only", "fp8", "--out", str(tmp_path), *FAST]
    assert bench.main(argv) == 1
    (failure,) = _record(tmp_path, "bench_linear")["failed"]
    error = failure["error"]
    found = re.search(r"against the reference path run on the CPU \(y (\S+), dx (\S+), dw (\S+);", error)
    assert found and all(0.02 < float(v) < 0.04 for v in found.groups()), error
    assert re.search(r"this path y \S+, dx \S+, dw \S+, the reference path y \S+, dx \S+, dw \S+$", error), error


@pytest.mark.parametrize("shape", [(300, 384, 200), (256, 640, 384), (128, 256, 130)])
def test_the_linear_checks_cpu_slices_are_the_whole_layers(benches, shape):
    """The CPU reference that gates the FP8 layer rows computes slices of the layer from slices of
    its operands (at M = 8192 the whole layer would take minutes there): bit for bit the whole
    reference layer's slices, with tails in M and K. (Where N has a tail, dw's slice differs from
    the whole layer's in the last f32 bit at some elements: XLA:CPU's dot sums N = 128 and N = 260
    columns in another order.)"""
    bench = benches["bench_linear"]
    seed = np.random.SeedSequence().entropy % 2**31
    x, w, g = bench._operands(seed, shape)
    whole = bench._slices(bench._fwd_bwd(bench._reference_fp8_linear)(x, w, g))
    part = bench.reference_slices(x, w, g)
    for name, a, b in zip(bench.OUTPUTS, part, whole):
        assert a.shape == b.shape and np.array_equal(a, b), (name, seed)
    with pytest.raises(ValueError, match="whole 128-wide tiles"):
        bench.reference_slices(x, w, g, rows=64)


@pytest.mark.parametrize(
    "kernel", ["tile", "block", "block-t", "block+mT", "column-t", "grad", "grad-2", "retile"]
)
def test_quantize_config_rows_match_the_reference(benches, kernel):
    """What a --config row runs on a GPU (the kernel called with a QuantizeConfig), here in the
    interpreter: the same arrays, bit for bit, as the reference it is checked against there."""
    from pallas_kernels import _mgpu
    from pallas_kernels.quantize import QuantizeConfig

    bench = benches["bench_quantize"]
    x = bench._input(bench.QShape(136, 320, "bfloat16"), seed=3)
    arg = bench._retile_input(x) if kernel == "retile" else x
    for config in (QuantizeConfig(), QuantizeConfig.simple()):
        with _mgpu.interpret_mode(True):
            out = bench._configured(kernel, config)(arg)
        assert bench._mismatches(out, bench.REFERENCE[kernel](arg)) == 0, config


def test_wrong_gemm_fails_its_check(tmp_path, monkeypatch, benches, records):
    right = jfp8.scaled_matmul
    monkeypatch.setattr(jfp8, "scaled_matmul", lambda a, b, **kw: right(a, b, **kw) * 1.1)
    argv = ["--shapes", "128x128x256", "--only", "jfp8", "--out", str(tmp_path), *FAST]
    assert benches["bench_gemm"].main(argv) == 1
    record = _record(tmp_path, "bench_gemm")
    assert "jfp8-xla" not in {r["impl"] for r in record["rows"]}
    (failure,) = record["failed"]
    assert failure["impl"] == "jfp8-xla" and "check failed" in failure["error"]


def test_wrong_quantizer_fails_its_check(tmp_path, monkeypatch, benches, records):
    bench = benches["bench_quantize"]
    right = bench.MEASURED["block"]
    monkeypatch.setitem(bench.MEASURED, "block", lambda x, impl: dataclasses.replace(
        right(x, impl), scale=right(x, impl).scale * 2))
    argv = ["--shapes", "128x256:bfloat16", "--only", "jfp8-xla-block", "--out", str(tmp_path), *FAST]
    assert bench.main(argv) == 1
    (failure,) = _record(tmp_path, "bench_quantize")["failed"]
    assert failure["impl"] == "jfp8-xla-block" and "check failed" in failure["error"]


def test_unknown_config_field_is_a_clear_error(capsys, benches):
    with pytest.raises(SystemExit):
        benches["bench_gemm"].main(["--config", "tile_m=128,no_such_field=1"])
    assert "no field 'no_such_field'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benches["bench_grouped"].main(["--config", "persistent=true,warp_specialized=false"])
    assert "needs warp_specialized" in capsys.readouterr().err


def test_parse_config_converts_like_the_defaults():
    @dataclasses.dataclass(frozen=True)
    class Config:
        tile_m: int = 64
        fast: bool = False
        cluster: tuple = (1, 1)

    assert parse_config("tile_m=128, fast=1,cluster=2x1", Config) == Config(128, True, (2, 1))
    with pytest.raises(ValueError, match="fields are tile_m, fast, cluster"):
        parse_config("tile_n=3", Config)
    with pytest.raises(ValueError, match="fast='maybe'"):
        parse_config("fast=maybe", Config)


def test_session_tables_read_the_records(records):
    """The GPU session's tables over the records the benchmarks write (tiny CPU runs)."""
    tables = _load("gpu_tables")
    table = tables.gemm_table(json.loads(next(records.glob("bench_gemm-*.json")).read_text()))
    assert any("jfp8-xla" in line for line in table)
    assert tables.grouped_table(json.loads(next(records.glob("bench_grouped-*.json")).read_text()))[0]
    wgrad = tables.grouped_table(json.loads(next(records.glob("bench_grouped_wgrad-*.json")).read_text()))
    assert wgrad[0].startswith("grouped Wgrad") and wgrad[1].startswith("2x128x128x256")
    assert tables.quantize_table(json.loads(next(records.glob("bench_quantize-*.json")).read_text()))[1:]
    assert tables.linear_table(json.loads(next(records.glob("bench_linear-*.json")).read_text()))[1:]


def _row(impl, m, n, k, **kw):
    return dict(impl=impl, m=m, n=n, k=k, **kw)


def test_targets_are_judged_from_the_records():
    """The speed targets, from records as the benchmarks write them: pass, FAIL, and "not
    measured" where the kernels did not run (CPU records) or a baseline is missing."""
    tables = _load("gpu_tables")
    gemm = {"rows": [
        _row("jfp8-mosaic", 8192, 8192, 8192, ratio_vs={"xla-bf16": 1.7, "torch-fp8-blockwise": 0.9}),
        _row("jfp8-mosaic", 4096, 4096, 7168, ratio_vs={"xla-bf16": 1.5}),
        _row("jfp8-mosaic[tile_m=64]", 4096, 2112, 7168, ratio_vs={"xla-bf16": 9.0}),  # not the default
    ]}
    grouped = {"rows": [_row("jfp8-mosaic", 32768, 4096, 7168, groups=8,
                             ratio_vs={"xla-bf16-einsum": 1.41})]}
    quantize = {"rows": [
        dict(impl="jfp8-mosaic-tile", kernel="tile", m=8192, k=8192, dtype="bfloat16", frac_of_copy=0.8),
        dict(impl="jfp8-mosaic-grad[swizzle=false]", kernel="grad", m=8192, k=8192,
             dtype="bfloat16", frac_of_copy=0.1),
    ]}
    verdicts = tables.target_verdicts(
        {"bench_gemm": gemm, "bench_grouped": grouped, "bench_quantize": quantize})
    got = {(v["benchmark"], v["problem"], v["target"]): v["verdict"] for v in verdicts}
    assert got[("bench_gemm", "8192x8192x8192", "x XLA bf16")] == "pass"
    assert got[("bench_gemm", "8192x8192x8192", "x torch blockwise FP8")] == "FAIL"
    assert got[("bench_gemm", "4096x4096x7168", "x XLA bf16")] == "FAIL"
    assert got[("bench_gemm", "4096x2112x7168", "x XLA bf16")] == "not measured"
    assert got[("bench_grouped", "8x4096x4096x7168", "x bf16 einsum")] == "pass"
    assert got[("bench_grouped", "8x4096x4096x7168", "x bf16 ragged_dot_mgpu")] == "not measured"
    assert got[("bench_quantize", "tile 8192x8192:bfloat16", "of copy bandwidth")] == "pass"
    assert not any("grad" in problem for _, problem, _ in got)  # config rows are not the target
    # CPU records: the kernels never ran, so nothing is judged.
    cpu = tables.target_verdicts({"bench_gemm": {"rows": [_row("jfp8-xla", 8192, 8192, 8192)]}})
    assert {v["verdict"] for v in cpu} == {"not measured"}
    assert tables.targets_table(verdicts)[1:]


def test_tune_table_reads_a_tune_record():
    """The session's table prints the winners tune_gemm puts in its record (`best_entries`)."""
    rows = [dict(m=64, n=7168, k=2048, kp=2048, out_dtype="bfloat16", impl=name, ms=ms, tflops=t,
                 config={}, roles=roles)
            for name, ms, t, roles in [("wsp-128x128-s4-g8", 2.0, 1.0, ["default"]),
                                       ("1wg-64x64-s8-g1", 1.0, 2.0, ["rule"]),
                                       ("1wg-64x64-s6-g1", 0.5, 4.0, [])]]
    record = dict(out_dtype="bfloat16", entries=_load("tune_gemm").best_entries(rows))
    (header, line) = _load("gpu_tables").tune_table(record)
    assert "1wg-64x64-s6-g1" in line and line.split()[-2:] == ["4.00", "2.00"]
    grouped = [dict(r, groups=8, m=256) for r in rows]
    record = dict(kind="grouped", out_dtype="bfloat16", entries=_load("tune_gemm").best_entries(grouped))
    (header, line) = _load("gpu_tables").tune_table(record)
    assert header.startswith("grouped tuning") and line.startswith("8x32x7168x2048")


def test_a_spent_budget_skips_the_remaining_shapes(tmp_path, benches):
    """--budget-s 0: spent before the first shape; every shape is recorded as skipped, with the
    reason, and nothing is timed."""
    argv = ["--shapes", "128x128x256", "128x128x384", "--only", "xla-bf16", "--budget-s", "0",
            "--out", str(tmp_path), *FAST]
    assert benches["bench_gemm"].main(argv) == 0
    record = _record(tmp_path, "bench_gemm")
    assert record["rows"] == []
    assert record["skipped"] == [dict(problem=p, reason="time budget 0 s spent")
                                 for p in ("128x128x256", "128x128x384")]


def test_xla_quantizer_rows_check_against_the_cpu_reference(monkeypatch, benches):
    """On a Hopper, bench_quantize also times XLA's own quantizers (jfp8-xla-* rows, the kinds a step
    runs) at the first --xla-rows shapes, each checked against the reference computed on the CPU.
    Here (no GPU) the rows' checks pass bit for bit, and a wrong quantizer fails its row."""
    bench = benches["bench_quantize"]
    shapes = [bench.QShape(128, 256, "bfloat16"), bench.QShape(256, 384, "float32")]
    assert bench.xla_row_shapes(shapes, "mosaic", None) == shapes
    assert bench.xla_row_shapes(shapes, "mosaic", 1) == shapes[:1]
    assert bench.xla_row_shapes(shapes, "mosaic", 0) == []
    assert bench.xla_row_shapes(shapes, "xla", None) == []  # every row is XLA's already
    cases = bench._xla_cases(bench.QShape(136, 320, "bfloat16"), seed=5)
    assert [c.case.name for c in cases] == [f"jfp8-xla-{k}" for k in bench.XLA_ROW_KERNELS]
    for c in cases:
        assert c.case.check(c.case.fn()) == 0, c.case.name
        assert c.bytes > 0
    right = bench.MEASURED["tile"]
    monkeypatch.setitem(bench.MEASURED, "tile", lambda x, impl: dataclasses.replace(
        right(x, impl), scale=right(x, impl).scale * 2))
    (tile,) = [c for c in bench._xla_cases(bench.QShape(136, 320, "bfloat16"), seed=5) if c.kernel == "tile"]
    assert tile.case.check(tile.case.fn()) > 0
    with pytest.raises(SystemExit):
        bench.main(["--xla-rows", "-1"])

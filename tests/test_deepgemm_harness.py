"""DeepGEMM's harness (benchmarks/hopper/deepgemm_harness.py) on the CPU: the operand layouts it
writes, the instantiation table it generates, and its plumbing into bench_gemm's rows with a
stand-in program that computes the product the way the harness documents its files (the real
program needs DeepGEMM's sources to build and a Hopper GPU to run)."""

import json
import pathlib
import stat
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import jfp8
from helpers import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "hopper"))
import anchors  # noqa: E402
import deepgemm_harness as dh  # noqa: E402


def _operands(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32)
    return jfp8.quantize(x, (1, 128)), jfp8.quantize(w, (128, 128))


def test_layouts_are_deepgemms():
    """a's scales K-chunk-major with rows padded to 4 floats (16 bytes, TMA), zero past M; the fp8
    data as bytes; b's block scales as stored."""
    seed = int(np.random.default_rng().integers(2**31))
    a, b = _operands(seed, 37, 200, 384)
    got = dh.layouts(a, b, 200)
    assert got["sfa"].shape == (3, 40) and got["sfa"].dtype == np.float32
    np.testing.assert_array_equal(got["sfa"][:, :37], np.asarray(a.scale).T)
    assert not got["sfa"][:, 37:].any()
    assert got["a"].dtype == np.uint8 and got["a"].shape == (37, 384)
    np.testing.assert_array_equal(got["a"], np.asarray(a.data).view(np.uint8))
    np.testing.assert_array_equal(got["sfb"], np.asarray(b.scale))
    assert "layout" not in got


def test_grouped_layout_marks_each_rows_group():
    """The m-grouped contiguous layout: each row's group, -1 past the groups; groups must come
    in whole 128-row blocks (DeepGEMM's alignment), else a ValueError that says so."""
    rng = np.random.default_rng()
    a = jfp8.quantize(jnp.asarray(rng.standard_normal((640, 128)), jnp.float32), (1, 128))
    b = jfp8.quantize(jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32), (128, 128))
    got = dh.layouts(a, b, 64, [256, 0, 128])
    want = np.r_[np.zeros(256), np.full(128, 2), np.full(256, -1)].astype(np.int32)
    np.testing.assert_array_equal(got["layout"], want)
    assert got["b"].shape == (3, 64, 128) and got["sfb"].shape == (3, 1, 1)
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        dh.layouts(a, b, 64, [200, 56, 0])


def test_instantiation_table_follows_deepgemms_argument_order():
    """One entry per problem, each pointing at `sm90_fp8_gemm_1d2d_impl` with the template
    arguments in the order DeepGEMM's own generate_impl writes them (`anchors`), and the launch
    numbers the host needs."""
    insts = [dh.instantiation(4096, 2112, 7168), dh.instantiation(8192, 8192, 8192),
             dh.instantiation(8 * 4096, 4096, 7168, 8)]
    text = dh.kernels_inc(insts)
    assert text.count("reinterpret_cast<const void*>(&sm90_fp8_gemm_1d2d_impl<") == 3
    for inst in insts:
        generated = anchors.deepgemm_instantiation(inst["template"])
        args = generated.split("sm90_fp8_gemm_1d2d_impl<", 1)[1].split(">);", 1)[0]
        args = ", ".join(a.strip() for a in args.replace("\n", " ").split(","))
        assert f"sm90_fp8_gemm_1d2d_impl<{args}>" in text
        t = inst["template"]
        assert (f"{{{inst['m']}, {inst['n']}, {inst['k']}, {inst['groups']}, {t['BLOCK_M']}, {t['BLOCK_N']}, "
                f"{t['kNumStages']}, "
                f"{inst['threads']}, {t['kNumTMAMulticast']}, {t['kSwizzleDMode']}, {inst['smem_bytes']}, 132,") in text
    # DeepGEMM's own choices at these shapes (its heuristics, re-derived)
    assert (insts[0]["template"]["BLOCK_M"], insts[0]["template"]["BLOCK_N"]) == (128, 192)
    assert (insts[1]["template"]["BLOCK_M"], insts[1]["template"]["kNumTMAMulticast"]) == (256, 2)
    assert insts[2]["template"]["kGemmType"] == "GemmType::MGroupedContiguous"
    assert insts[2]["template"]["kNumGroups"] == 8


def _stand_in(tmp_path, *, scale=1.0, fail=None, sms=132):
    """An executable that reads the harness's files and writes the dequantized product (times
    `scale`), as the real program would on a GPU; or prints `fail` as its error."""
    path = tmp_path / "stand_in"
    body = f"""\
        #!{sys.executable}
        import json, sys
        import ml_dtypes, numpy as np
        if {fail!r} is not None:
            print(json.dumps({{"ok": False, "error": {fail!r}}})); sys.exit(3)
        if sys.argv[1] == "--check":
            print(json.dumps({{"ok": True, "device": "stand-in", "sms": {sms}}})); sys.exit(0)
        m, n, k, g = (int(v) for v in sys.argv[1:5]); d = sys.argv[5]; reps = int(sys.argv[7]); inner = int(sys.argv[8])
        e4m3 = ml_dtypes.float8_e4m3fn
        a = np.fromfile(d + "/a.bin", np.uint8).view(e4m3).reshape(m, k).astype(np.float32)
        b = np.fromfile(d + "/b.bin", np.uint8).view(e4m3).reshape(g, n, k).astype(np.float32)
        sfa = np.fromfile(d + "/sfa.bin", np.float32).reshape(k // 128, -1)[:, :m].T
        sfb = np.fromfile(d + "/sfb.bin", np.float32).reshape(g, -(-n // 128), k // 128)
        sa = np.repeat(sfa, 128, axis=1); sb = np.repeat(np.repeat(sfb, 128, axis=1)[:, :n], 128, axis=2)
        rows = np.fromfile(d + "/layout.bin", np.int32) if g > 1 else np.zeros(m, np.int32)
        out = np.zeros((m, n), np.float32)
        for i in range(g):
            sel = rows == i
            out[sel] = (a[sel] * sa[sel]) @ (b[i] * sb[i]).T * {scale}
        out = out.astype(ml_dtypes.bfloat16)
        out.view(np.uint16).tofile(d + "/d.bin")
        print(json.dumps({{"ok": True, "m": m, "n": n, "k": k, "inner": inner, "ms": [0.5 + i for i in range(reps)]}}))
    """
    path.write_text(textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_run_hands_the_operands_over_and_reads_the_product_back(tmp_path):
    seed = int(np.random.default_rng().integers(2**31))
    a, b = _operands(seed, 40, 136, 256)
    got = dh.run(a, b, 136, warmup=1, repeats=3, binary=_stand_in(tmp_path))
    want = np.asarray(jfp8.scaled_matmul_reference(a, b, jnp.float32))
    assert got["out"].shape == (40, 136) and got["ms"] == [0.5, 1.5, 2.5]
    err = np.linalg.norm(got["out"].astype(np.float32) - want) / np.linalg.norm(want)
    assert err < 2**-8, f"seed={seed}: {err}"
    assert dh.check(_stand_in(tmp_path))["ok"]


def test_a_failing_or_missing_program_says_why(tmp_path):
    assert "build it with" in dh.check(tmp_path / "none")["error"]
    broken = _stand_in(tmp_path, fail="no CUDA driver")
    assert dh.check(broken) == {"ok": False, "error": "no CUDA driver"}
    a, b = _operands(0, 8, 128, 128)
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        dh.run(a, b, 128, warmup=0, repeats=1, binary=broken)


def test_grouped_run_hands_over_the_groups(tmp_path):
    """The m-grouped problem: the groups' weights stacked, each row's group in layout.bin; rows
    past the groups come back as the stand-in leaves them (zeros)."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((384, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 136, 256)) / 16, jnp.float32)
    a, b = jfp8.quantize(x, (1, 128)), jfp8.quantize(w, (128, 128))
    sizes = jnp.asarray([128, 128], jnp.int32)
    got = dh.run(a, b, 136, warmup=0, repeats=2, sizes=np.asarray(sizes), binary=_stand_in(tmp_path))
    want = np.asarray(jfp8.grouped_scaled_matmul_reference(a, b, sizes, jnp.float32))
    err = np.linalg.norm(got["out"].astype(np.float32) - want) / np.linalg.norm(want)
    assert got["out"].shape == (384, 136) and err < 2**-8, f"seed={seed}: {err}"
    assert not got["out"][256:].astype(np.float32).any()


def test_bench_rows_for_the_harness(tmp_path):
    """bench_gemm's row for a harnessed implementation: the median of its launches, its check
    against the same reference (a wrong product fails and leaves no row), DeepGEMM's config."""
    bench = load_benchmark("bench_gemm")
    from _bench import Timing, run_harnessed

    m, n, k = 40, 136, 256
    a, b = _operands(1, m, n, k)
    ref = lambda: jfp8.scaled_matmul_reference(a, b, jnp.float32)  # noqa: E731
    timing = Timing(warmup=1, repeats=2, inner=2)
    row_fn = lambda case, meas: bench.gemm_row(case, meas, device_kind="cpu", flops=2.0 * m * n * k,  # noqa: E731
                                                m=m, n=n, k=k)
    for scale, ok in ((1.0, True), (1.5, False)):
        harness = _stand_in(tmp_path, scale=scale)
        run = lambda t, harness=harness: dh.run(a, b, n, warmup=t.warmup, repeats=t.repeats,  # noqa: E731
                                                inner=t.inner, binary=harness)
        check = lambda got: bench.device_rel_error(jnp.asarray(got["out"]), ref())  # noqa: E731
        rows, failed = [], []
        run_harnessed([(bench.DEEPGEMM, run, check, dh.row_info(m, n, k))], "x", timing, row_fn, rows, failed,
                      bench.TOL_FP8_OUTPUT)
        if ok:
            assert not failed and len(rows) == 1
            row = rows[0]
            assert row["impl"] == bench.DEEPGEMM and row["ms"] == 1.0 and (row["repeats"], row["inner"]) == (2, 2)
            assert row["config"]["BLOCK_K"] == 128 and "CUDA events" in row["timer"]
            json.dumps(row)
        else:
            assert not rows and len(failed) == 1 and "tolerance" in failed[0]["error"], failed


def test_off_a_hopper_the_harness_is_skipped_with_its_reason(tmp_path):
    assert dh.usable(None, hopper=False) == (None, {"ok": False, "error": "needs a Hopper GPU"})
    assert dh.usable(_stand_in(tmp_path, fail="no CUDA driver"), hopper=True) == (
        None, {"ok": False, "error": "no CUDA driver"})
    harness, why = dh.usable(_stand_in(tmp_path), hopper=True)
    assert harness is not None and why["ok"] and why["binary"] == str(harness)
    assert dh.built_for(harness) == set()  # no build record beside it: no shape is run
    (tmp_path / "other").mkdir()
    other = dh.usable(_stand_in(tmp_path / "other", sms=114), hopper=True)
    assert other[0] is None and "this GPU has 114" in other[1]["error"]


def test_bench_runs_the_harness_only_on_the_shapes_it_was_built_for(tmp_path):
    """bench_gemm's and bench_grouped's cases: a harnessed DeepGEMM entry where the program's
    build record lists the problem, a skip that says so where it does not."""
    from pallas_kernels.shapes import GemmShape, GroupedShape

    gemm, grouped = load_benchmark("bench_gemm"), load_benchmark("bench_grouped")
    harness = _stand_in(tmp_path)
    harness.with_suffix(".json").write_text(json.dumps({"instantiations": [
        {"m": 64, "n": 128, "k": 256, "groups": 1}, {"m": 256, "n": 128, "k": 256, "groups": 2}]}))
    *_, skips, _info, harnessed = gemm._cases(GemmShape(64, 128, 256), False, 0, [], False, harness)
    assert [h[0] for h in harnessed] == [gemm.DEEPGEMM] and gemm.DEEPGEMM not in [s.impl for s in skips]
    *_, skips, _info, harnessed = gemm._cases(GemmShape(128, 128, 256), False, 0, [], False, harness)
    assert not harnessed and any(s.impl == gemm.DEEPGEMM and "not built" in s.reason for s in skips)
    _cases, skips, harnessed = grouped._cases(GroupedShape(2, 128, 128, 256), False, 0, {}, [], harness)
    assert [h[0] for h in harnessed] == [grouped.DEEPGEMM]
    _cases, skips, harnessed = grouped._cases(GroupedShape(2, 64, 128, 256), False, 0, {}, [], harness)
    assert not harnessed and any(s.impl == grouped.DEEPGEMM and "not built" in s.reason for s in skips)

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
    got = dh.layouts(a, b)
    assert got["sfa"].shape == (3, 40) and got["sfa"].dtype == np.float32
    np.testing.assert_array_equal(got["sfa"][:, :37], np.asarray(a.scale).T)
    assert not got["sfa"][:, 37:].any()
    assert got["a"].dtype == np.uint8 and got["a"].shape == (37, 384)
    np.testing.assert_array_equal(got["a"], np.asarray(a.data).view(np.uint8))
    np.testing.assert_array_equal(got["sfb"], np.asarray(b.scale))


def test_instantiation_table_follows_deepgemms_argument_order():
    """One entry per problem, each pointing at `sm90_fp8_gemm_1d2d_impl` with the template
    arguments in the order DeepGEMM's own generate_impl writes them (`anchors`), and the launch
    numbers the host needs."""
    insts = [dh.instantiation(4096, 2112, 7168), dh.instantiation(8192, 8192, 8192)]
    text = dh.kernels_inc(insts)
    assert text.count("reinterpret_cast<const void*>(&sm90_fp8_gemm_1d2d_impl<") == 2
    for inst in insts:
        generated = anchors.deepgemm_instantiation(inst["template"])
        args = generated.split("sm90_fp8_gemm_1d2d_impl<", 1)[1].split(">);", 1)[0]
        args = ", ".join(a.strip() for a in args.replace("\n", " ").split(","))
        assert f"sm90_fp8_gemm_1d2d_impl<{args}>" in text
        t = inst["template"]
        assert (f"{{{inst['m']}, {inst['n']}, {inst['k']}, {t['BLOCK_M']}, {t['BLOCK_N']}, {t['kNumStages']}, "
                f"{inst['threads']}, {t['kNumTMAMulticast']}, {t['kSwizzleDMode']}, {inst['smem_bytes']}, 132,") in text
    # DeepGEMM's own choices at these shapes (its heuristics, re-derived)
    assert (insts[0]["template"]["BLOCK_M"], insts[0]["template"]["BLOCK_N"]) == (128, 192)
    assert (insts[1]["template"]["BLOCK_M"], insts[1]["template"]["kNumTMAMulticast"]) == (256, 2)


def _stand_in(tmp_path, *, scale=1.0, fail=None):
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
            print(json.dumps({{"ok": True, "device": "stand-in", "sms": 132}})); sys.exit(0)
        m, n, k = (int(v) for v in sys.argv[1:4]); d = sys.argv[4]; reps = int(sys.argv[6])
        e4m3 = ml_dtypes.float8_e4m3fn
        a = np.fromfile(d + "/a.bin", np.uint8).view(e4m3).reshape(m, k).astype(np.float32)
        b = np.fromfile(d + "/b.bin", np.uint8).view(e4m3).reshape(n, k).astype(np.float32)
        sfa = np.fromfile(d + "/sfa.bin", np.float32).reshape(k // 128, -1)[:, :m].T
        sfb = np.fromfile(d + "/sfb.bin", np.float32).reshape(-(-n // 128), k // 128)
        sa = np.repeat(sfa, 128, axis=1); sb = np.repeat(np.repeat(sfb, 128, axis=0)[:n], 128, axis=1)
        out = ((a * sa) @ (b * sb).T * {scale}).astype(ml_dtypes.bfloat16)
        out.view(np.uint16).tofile(d + "/d.bin")
        print(json.dumps({{"ok": True, "m": m, "n": n, "k": k, "ms": [0.5 + i for i in range(reps)]}}))
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


def test_bench_rows_for_the_harness(tmp_path):
    """bench_gemm's row for a harnessed implementation: the median of its launches, its check
    against the same reference (a wrong product fails and leaves no row), DeepGEMM's config."""
    bench = load_benchmark("bench_gemm")
    from _bench import Timing

    m, n, k = 40, 136, 256
    a, b = _operands(1, m, n, k)
    ref = lambda: jfp8.scaled_matmul_reference(a, b, jnp.float32)  # noqa: E731
    timing = Timing(warmup=1, repeats=2, inner=2)
    row_fn = lambda case, meas: bench.gemm_row(case, meas, device_kind="cpu", flops=2.0 * m * n * k,  # noqa: E731
                                                m=m, n=n, k=k)
    for scale, ok in ((1.0, True), (1.5, False)):
        harness = _stand_in(tmp_path, scale=scale)
        run = lambda t, harness=harness: dh.run(a, b, n, warmup=t.warmup, repeats=t.repeats * t.inner,  # noqa: E731
                                                binary=harness)
        check = lambda got: bench.device_rel_error(jnp.asarray(got["out"]), ref())  # noqa: E731
        rows, failed = [], []
        bench._run_harnessed([(bench.DEEPGEMM, run, check)], "x", timing, row_fn, rows, failed, m, n, k)
        if ok:
            assert not failed and len(rows) == 1
            row = rows[0]
            assert row["impl"] == bench.DEEPGEMM and row["ms"] == 2.0 and row["repeats"] == 4
            assert row["config"]["BLOCK_K"] == 128 and "CUDA events" in row["timer"]
            json.dumps(row)
        else:
            assert not rows and len(failed) == 1 and "tolerance" in failed[0]["error"], failed


def test_off_a_hopper_the_harness_is_skipped_with_its_reason():
    bench = load_benchmark("bench_gemm")
    harness, why = bench._deepgemm_harness(None, hopper=False)
    assert harness is None and why == {"ok": False, "error": "needs a Hopper GPU"}

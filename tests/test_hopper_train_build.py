"""The training step compiled for Hopper from this CPU host (benchmarks/hopper_train_build.py): the
committed table's claims, and on every CI run the `tiny` FP8 train step compiled deviceless for an
H100 within a time budget: the strongest check that the whole program, not only each kernel,
compiles for CUDA."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import hopper_build as hb  # noqa: E402
import hopper_train_build as htb  # noqa: E402

# Lower + compile seconds of the tiny FP8 train step in CI. Measured 41 s on the 2-core machine
# with nothing beside it (docs/gpu.md); CI runs it beside another test worker, which can double
# it. Far above this is a regression (before one kernel per call site: 552 s).
CI_BUDGET_S = 150


def _doc():
    return json.loads((hb.OUT / "train-h100_sxm.json").read_text())


def test_committed_table_covers_every_preset_step_and_precision():
    doc = _doc()
    assert doc["jax"] == "0.11.2" and doc["device_kind"] == hb.TARGETS["h100_sxm"]
    rows = {(r["preset"], r["step"], r["precision"]): r for r in doc["rows"] if not r.get("variant")}
    assert set(rows) == {(p, s, q) for p in htb.PRESETS for s in htb.STEPS for q in htb.PRECISIONS}
    for (preset, step, precision), r in rows.items():
        assert r["ok"], r
        if precision == "bf16":
            # No FP8 kernel: BF16's Mosaic calls, where there are any, are its experts' ragged
            # dots (jax's kernels, issue 43), far fewer kernels than the FP8 step builds.
            assert r["distinct_mosaic_kernels"] < rows[(preset, step, "fp8")]["distinct_mosaic_kernels"]
            assert r["mosaic_custom_calls"] == 0 or r["precompile"]["failed"] == 0
            continue
        # One kernel per (op, shapes, static arguments), never one per call site.
        assert r["distinct_mosaic_kernels"] <= r["distinct_op_shape_config"] < r["mosaic_custom_calls"]
        assert r["precompile"]["failed"] == 0 and r["precompile"]["submitted"] == r["distinct_mosaic_kernels"]
        if step == "train":  # the issue's bar: FP8 lower + compile within 2x BF16's, one run
            assert r["fp8_over_bf16"] <= 2.0, (preset, r["fp8_over_bf16"])
            assert r["memory"]["peak"] < rows[(preset, step, "bf16")]["memory"]["peak"]


def test_committed_cache_and_batch_results():
    doc = _doc()
    for c in doc["cache"]:
        # A hit makes the second process faster. Deviceless, jax 0.11.2 writes the entry but cannot
        # read it back (no client to load an executable into): then the row records jax's error.
        assert c["ok"] and c["cache_bytes"] > 0
        assert c["second"]["total_s"] < c["first"]["total_s"] or "PjRtCompiler" in c["cache_read_error"]
        if c["precision"] == "fp8":
            # jfp8's lowered kernels (pallas_kernels.kernel_cache) are read back: no kernel is
            # lowered again, and the lowering takes less than half the first process's. (Each
            # kernel read from disk is reused; since 2026-11-29 a kernel two call sites share is read
            # once and then reused from memory, so reuses may outnumber reads.)
            lowerings, loaded = c["second"]["kernel_lowerings"], c["second"]["kernel_cache"]["loaded"]
            assert "lowered" not in lowerings and lowerings["reused"] >= loaded > 0, c
            assert c["second"]["lower_s"] < c["first"]["lower_s"] / 2, c
    found = {b["precision"]: b for b in doc["largest_batch"]}
    assert set(found) == set(htb.PRECISIONS)
    for b in found.values():
        assert b["peak_bytes"] <= b["budget_bytes"] < b["next_peak_bytes"]
        assert b["next_batch"] - b["largest_batch"] <= 4
    assert found["fp8"]["largest_batch"] > found["bf16"]["largest_batch"]


@pytest.mark.slow
def test_tiny_fp8_train_step_compiles_for_h100(toolchain):
    """A user's first jit of the tiny FP8 train step, for an H100, in a fresh process: it compiles,
    runs one Mosaic kernel per (op, shapes, static arguments), every kernel precompiled in the
    background without a failure, within the budget."""
    row = htb.run_child("tiny", "fp8", "train", "h100_sxm", toolchain, timeout=600)
    assert row["ok"], row.get("error")
    assert 0 < row["distinct_mosaic_kernels"] <= row["distinct_op_shape_config"] < row["mosaic_custom_calls"]
    pre = row["precompile"]
    assert pre["enabled"] and pre["failed"] == 0 and pre["submitted"] == row["distinct_mosaic_kernels"], pre
    assert row["hlo"]["custom_calls"].get("mosaic_gpu_v2", 0) > 0  # the kernels survive XLA
    assert row["total_s"] <= CI_BUDGET_S, f"lower + compile {row['total_s']} s > {CI_BUDGET_S} s: {row}"


def test_committed_shared_process_rows():
    """`--shared-process`: the FP8 eval step compiled after the train step in one process reuses
    its kernels, so it costs less than the same eval step compiled alone (the `rows`), at every
    preset; and `--table` prints these rows."""
    doc = _doc()
    alone = {(r["preset"], r["precision"]): r for r in doc["rows"] if r["step"] == "eval" and not r.get("variant")}
    shared = {(r["preset"], r["precision"]): r for r in doc["shared_process"]}
    assert set(shared) == {(p, q) for p in htb.PRESETS for q in htb.PRECISIONS}
    for (preset, precision), r in shared.items():
        assert r["ok"] and r["step"] == htb.SHARED and r["target"] == "h100_sxm", r
        if precision == "fp8":
            assert r["eval_total_s"] < alone[(preset, "fp8")]["total_s"], (preset, r["eval_total_s"])
    table = htb.markdown_tables(doc)
    assert "then eval s (lower, compile)" in table and f"| {shared[('tiny', 'fp8')]['eval_total_s']} (" in table

"""The step profile (benchmarks/step_profile.py) and the model's measured columns
(`step_model.attach_measured`): kernel events charged to the model's categories.

A GPU trace is written here by hand in the layout jax's profiler exports (CUPTI kernels on the
device's "Stream #..." lines with `hlo_op` / `hlo_module`, the derived "XLA Ops" line repeating
them, host threads with thunk annotations): the GPU path is checked without a GPU, and every
event a wrong filter would count is planted beside the ones it must count. The CPU path runs for
real in tests/test_e2e_benchmarks.py (`bench_step --profile`).
"""

import copy
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import step_model as sm  # noqa: E402
import step_profile as sp  # noqa: E402
from test_step_model import HAND  # noqa: E402

GPU, HOST = 1, 701
STREAM, XLA_OPS, PYTHON = 11, 12, 13


def _meta(pid, tid=None, name=""):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _kernel(pid, tid, op, ts, dur, module="hand"):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": f"kernel_{op}",
            "args": {"hlo_op": op, "hlo_module": module}}


def _gpu_trace(steps=2):
    events = [_meta(GPU, name="/device:GPU:0"), _meta(HOST, name="/host:CPU"),
              _meta(GPU, STREAM, "Stream #13(Compute)"), _meta(GPU, XLA_OPS, "XLA Ops"),
              _meta(HOST, PYTHON, "python")]
    t = 0.0
    for _ in range(steps):
        # (op, µs): a quantizer, a dense FP8 GEMM, the Triton GEMM, the loop body's fusion 3 times,
        # an instruction the HLO does not have
        for op, dur in (("quant", 10.0), ("dense", 40.0), ("attn", 20.0), ("f", 1.0), ("f", 1.0), ("f", 1.0),
                        ("mystery", 5.0)):
            events.append(_kernel(GPU, STREAM, op, t, dur))
            events.append(_kernel(GPU, XLA_OPS, op, t, dur))  # derived: the same kernel again
            events.append(_kernel(HOST, PYTHON, op, t, 0.5))  # the host's launch of it
            t += dur + 2.0  # 2 µs gaps between kernels
        events.append(_kernel(GPU, STREAM, "loop", t, 3.0))  # control flow is never charged
        events.append(_kernel(GPU, STREAM, "quant", t, 99.0, module="jit_other"))  # another program
        t += 100.0
    return {"traceEvents": events}


def test_gpu_trace_charged_to_the_models_categories():
    module, ops, control, runs = sp.instruction_ops(HAND)
    assert module == "hand" and "loop" in control and "f" in ops  # the while body's fusion is known
    assert runs["f"] == 3 and runs["dense"] == 1  # the body runs 3 times a step
    events, where = sp.kernel_events(_gpu_trace(), module)
    assert where["on_device"] and where["source"] == "device stream lines"
    assert where["lines"] == ["Stream #13(Compute)"]
    s = sp.summarize(events, ops, control, steps=2, runs=runs)
    cats = s["categories"]
    assert cats["quantize: 1x128"]["ms"] == pytest.approx(0.010)
    assert cats["fp8 gemm: dense"]["ms"] == pytest.approx(0.040)
    assert cats["xla gemm (bf16)"]["ms"] == pytest.approx(0.020)
    assert cats["xla elementwise"] == pytest.approx(
        {"ms": 0.003, "kernels": 3, "runs": 3, "bytes": 3 * 8192, "flops": 0, "gbps": 8192 / 1e-6 / 1e9})
    dense = ops["dense"]
    assert cats["fp8 gemm: dense"]["tflops"] == pytest.approx(dense.flops / 40e-6 / 1e12)
    assert s["unattributed"] == [{"hlo_op": "mystery", "ms": 0.005}]
    # per step: 10 + 40 + 20 + 3 + 5 µs of kernels; the gaps are not busy time
    assert s["kernel_ms"] == pytest.approx(0.078) and s["busy_ms"] == pytest.approx(0.078)
    (q,) = s["quantizers"]
    assert q["kind"] == "quantize: 1x128" and q["us_per_run"] == pytest.approx(10.0)
    assert q["gbps"] == pytest.approx(ops["quant"].bytes / 10e-6 / 1e9) and q["bytes_per_run"] == ops["quant"].bytes


def test_an_instruction_of_several_kernels_moves_its_bytes_once():
    """A sort or a reduction after a memset: two events of one instruction, one run of its bytes."""
    module, ops, control, runs = sp.instruction_ops(HAND)
    events = [_kernel(GPU, STREAM, "quant", 0.0, 4.0), _kernel(GPU, STREAM, "quant", 5.0, 6.0)]
    s = sp.summarize(events, ops, control, steps=1, runs=runs)
    c = s["categories"]["quantize: 1x128"]
    assert (c["kernels"], c["runs"], c["bytes"]) == (2, 1, ops["quant"].bytes)
    assert c["gbps"] == pytest.approx(ops["quant"].bytes / 10e-6 / 1e9)
    assert s["quantizers"][0]["us_per_run"] == pytest.approx(10.0)


def test_cpu_thunks_nested_in_control_flow_count_once():
    """XLA:CPU's loop thunk spans its body's thunks on the same thread: only the innermost count,
    whatever the enclosing one is named (jax names a conditional `cond.N`)."""
    body = [_kernel(HOST, PYTHON, "f", 10.0 + 3 * i, 2.0) for i in range(3)]
    outer = _kernel(HOST, PYTHON, "cond.7", 9.0, 12.0)
    other = _kernel(HOST, PYTHON + 1, "dense", 10.0, 5.0)  # overlaps, on another thread: kept
    kept = sp.innermost([outer, *body, other])
    assert [e["args"]["hlo_op"] for e in kept] == ["f", "f", "f", "dense"]
    trace = {"traceEvents": [_meta(HOST, name="/host:CPU"), outer, *body, other]}
    events, where = sp.kernel_events(trace, "hand")
    assert not where["on_device"] and len(events) == 4


def test_overlapping_streams_count_once_as_busy():
    events = [_kernel(GPU, STREAM, "dense", 0.0, 40.0), _kernel(GPU, STREAM, "attn", 30.0, 20.0)]
    module, ops, control, runs = sp.instruction_ops(HAND)
    s = sp.summarize(events, ops, control, steps=1, runs=runs)
    assert s["kernel_ms"] == pytest.approx(0.060) and s["busy_ms"] == pytest.approx(0.050)


def test_without_stream_lines_the_derived_ones_are_still_left_out():
    trace = _gpu_trace(steps=1)
    for e in trace["traceEvents"]:
        if e.get("name") == "thread_name" and e["tid"] == STREAM:
            e["args"]["name"] = "GPU kernels"
    events, where = sp.kernel_events(trace, "hand")
    assert where["source"] == "device lines other than the derived ones"
    assert {e["tid"] for e in events} == {STREAM}


def test_cpu_trace_reads_the_host_threads():
    trace = _gpu_trace(steps=1)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["pid"] == HOST]
    events, where = sp.kernel_events(trace, "hand")
    assert not where["on_device"] and len(events) == 7 and {e["tid"] for e in events} == {PYTHON}
    # a GPU run whose trace has no device process reads nothing, not the host's launches
    events, where = sp.kernel_events(trace, "hand", device=True)
    assert events == [] and where["source"].startswith("no device process")


def test_printed_lines_and_a_profile_that_found_nothing():
    assert sp.profile_lines({"error": "no trace read"}) == ["    profile: no trace read"]
    module, ops, control, runs = sp.instruction_ops(HAND)
    s = sp.summarize(sp.kernel_events(_gpu_trace(), module)[0], ops, control, steps=2, runs=runs)
    lines = sp.profile_lines({"steps": 2, "source": "device stream lines", "wall_ms": 1.0, **s})
    assert "device busy 0.08 ms" in lines[0] and any("fp8 gemm: dense" in x and "TFLOP/s" in x for x in lines)


def _bench_record(device="NVIDIA H100 80GB HBM3", batch=8):
    prof = {"steps": 3, "wall_ms": 190.0, "kernel_ms": 180.0, "busy_ms": 178.0, "unattributed_ms": 0.5,
            "source": "device stream lines",
            "categories": {"quantize: both orientations": {"ms": 12.0, "kernels": 143}}}
    rows = [dict(preset="wide", precision=p, batch=batch, seq_len=2048, step_ms=ms, timed_steps=[6, 25],
                 profile=copy.deepcopy(prof) if p == "fp8" else {"error": "not profiled: budget"})
            for p, ms in (("bf16", 170.0), ("fp8", 150.0))]
    return {"device": device, "date": "2026-12-01", "commit": "abc", "dirty": False, "rows": rows}


def test_measured_columns_filled_from_a_bench_step_record():
    doc = json.loads((REPO / "benchmarks/results/step-model/wide-h100_sxm.json").read_text())
    assert sm.attach_measured(copy.deepcopy(doc), _bench_record(device="cpu"), "x") == []  # another device
    assert sm.attach_measured(copy.deepcopy(doc), _bench_record(batch=4), "x") == []  # another batch
    filled = sm.attach_measured(doc, _bench_record(), "bench_step.json")
    assert sorted(filled) == ["bf16", "fp8"]
    fp8, bf16 = doc["precisions"]["fp8"], doc["precisions"]["bf16"]
    assert fp8["measured_step_s"] == pytest.approx(0.150) and bf16["measured_step_s"] == pytest.approx(0.170)
    assert fp8["measured"]["profile"]["categories"] == {"quantize: both orientations": 12.0}
    assert bf16["measured"]["profile"] == "not profiled: budget" and fp8["measured"]["commit"] == "abc"
    other = _bench_record()
    other["configs"] = {"wide": {"model_overrides": {"n_layers": 2}}}  # another model than predicted
    assert sm.attach_measured(copy.deepcopy(doc), other, "x") == []
    # a re-pricing of the same preset keeps what was measured; another batch does not
    fresh = copy.deepcopy(doc)
    for s in fresh["precisions"].values():
        s["measured_step_s"], s["measured"] = None, sm.MEASURED_NOT
    assert sorted(sm.keep_measured(doc, fresh)) == ["bf16", "fp8"] and fresh["precisions"]["fp8"]["measured"]["step_ms"] == 150.0
    fresh["precisions"]["fp8"]["batch_size"] = 4
    fresh["precisions"]["fp8"]["measured_step_s"] = None
    assert sm.keep_measured(doc, fresh) == ["bf16"] and fresh["precisions"]["fp8"]["measured_step_s"] is None
    table = sm.markdown_table(doc)
    row = next(x for x in table.splitlines() if x.startswith("| quantize: both orientations"))
    assert row.endswith("| FP8 12.000 / BF16 – ms |")
    assert "FP8 150.0 ms, BF16 170.0 ms" in table
    assert sm.summary_table([doc]).splitlines()[-1].endswith("| FP8 150.0 ms / BF16 170.0 ms (0.88) |")


def test_step_table_prints_the_profile_under_its_row():
    import gpu_tables

    row = dict(preset="wide", batch=8, seq_len=2048, precision="fp8", step_ms=150.0, tokens_per_s=1e5,
               mfu=0.3, ratio_vs_bf16=1.1, peak_bytes_in_use=5e10,
               profile={"steps": 3, "source": "device stream lines", "wall_ms": 151.0, "kernel_ms": 140.0,
                        "busy_ms": 139.0, "unattributed_ms": 0.0,
                        "categories": {"fp8 gemm: dense": {"ms": 20.0, "kernels": 128, "tflops": 900.0}}})
    lines = gpu_tables.step_table({"rows": [row]})
    assert lines[2].startswith("    profile (3 steps") and "900 TFLOP/s" in lines[3]


def test_what_if_models_get_files_of_their_own():
    assert sm.variant(0, {}) == "" and sm.variant(4, {}) == "-b4"
    assert sm.variant(0, {"d_model": 4096, "n_layers": 4}) == "-d_model4096-n_layers4"
    assert sm._model_overrides("d_model=4096,mtp=false") == {"d_model": 4096, "mtp": False}
    with pytest.raises(Exception, match="no field 'width'"):
        sm._model_overrides("width=4096")


def test_a_thunk_that_starts_as_another_ends_is_not_its_child():
    a = _kernel(HOST, PYTHON, "dense", 0.0, 5.0)
    b = _kernel(HOST, PYTHON, "f", 5.0, 0.0)  # zero-length, at a's end: after a, not inside it
    assert [e["args"]["hlo_op"] for e in sp.innermost([a, b])] == ["dense", "f"]


def test_an_h200_run_fills_the_h200_prediction_not_the_h100s():
    """A GPU names itself 'NVIDIA H200' (say) where the deviceless target says 'NVIDIA H200 141GB
    HBM3e': the same GPU; an H100's record is another."""
    h200 = json.loads((REPO / "benchmarks/results/step-model/wide-h200.json").read_text())
    h100 = json.loads((REPO / "benchmarks/results/step-model/wide-h100_sxm.json").read_text())
    run = _bench_record(device="NVIDIA H200")
    assert sorted(sm.attach_measured(h200, run, "bench_step.json")) == ["bf16", "fp8"]
    assert h200["precisions"]["fp8"]["measured"]["device"] == "NVIDIA H200"
    assert sm.attach_measured(h100, run, "bench_step.json") == []

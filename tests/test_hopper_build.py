"""The deviceless Hopper build (benchmarks/hopper_build.py): the SASS census on a committed dump
and on random synthetic text, the row checks, the committed results, and, when the toolchain
installs (scripts/test.sh installs it; `scripts/hopper_toolchain.sh`), the default kernel forms
compiled for sm_90a through ptxas on every CI run."""

import json
import pathlib
import random
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import hopper_build as hb  # noqa: E402
from gpu_reports import parse_ptxas, sass_census  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "gpu" / "hopper_build"


def test_census_of_a_committed_dump():
    """grouped_fprop at 8 x 4096 x 4096 x 7168 as compiled for h100_sxm on 2026-11-26 (ptxas 13.5):
    four 64x128x32 E4M3 QGMMAs per 128-K chunk, setmaxnreg 40 / 232, and the spills that make it a
    known defect (`hb.KNOWN_DEFECTS`)."""
    sass = sass_census((FIXTURES / "grouped_fprop.sass_ctrl").read_text())
    assert sass["qgmma"] == {"64x128x32.F32.E4M3.E4M3": 4} and sass["hgmma"] == {}
    assert sass["usetmaxreg"] == {"DEALLOC": [40], "ALLOC": [232]}
    assert (sass["ldl"], sass["stl"]) == (12, 8) and sass["utmaldg_multicast"] == 0
    assert sass["ffma"] == sass["fmul"] == 64 and sass["instructions"] == 1472
    ptxas = parse_ptxas((FIXTURES / "grouped_fprop.ptxas").read_text())
    assert (ptxas["registers"], ptxas["barriers"]) == (168, 16)
    assert ptxas["functions"]["anonymous_mosaic_gpu_kernel"]["spill_stores"] == 32


def test_census_counts_random_sass():
    """Random instruction streams in nvdisasm's format, with and without control codes and
    predicates: every count comes back."""
    rng = random.Random()
    ops = {"QGMMA.64x128x32.F32.E4M3.E4M3": "R24, gdesc[UR8], R24", "HGMMA.64x64x16.F32.BF16": "R0, gdesc[UR4], R0",
           "FFMA": "R1, R2, R3, R4", "FMUL.FTZ": "R1, R2, R3", "FADD": "R1, R2, R3", "LDL": "R2, [R1+0xc]",
           "STL": "[R1], R7", "UTMALDG.4D.MULTICAST": "[UR8], [UR4], UR6", "UTMALDG.2D": "[UR8], [UR4]",
           "UTMASTG.4D": "[UR4], [UR6]", "SYNCS.ARRIVE.TRANS64": "RZ, [UR4], RZ", "BAR.SYNC.DEFER_BLOCKING": "0x0",
           "IMAD.MOV.U32": "R4, RZ, RZ, RZ"}
    want = {op: rng.randrange(0, 20) for op in ops}
    lines = [op for op, n in want.items() for _ in range(n)]
    rng.shuffle(lines)
    lines = ["USETMAXREG.DEALLOC.CTAPOOL 0x28", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", *lines]
    text = "\n".join(
        (f"   -:-:1:Y:0{rng.randrange(10)}        " if rng.random() < 0.5 else "        ")
        + f"/*{16 * i:04x}*/   " + ("@P0 " if rng.random() < 0.2 else "") + f"{op} {ops.get(op, '')} ;"
        for i, op in enumerate(lines))
    c = sass_census(text)
    assert c["instructions"] == len(lines)
    assert c["qgmma"] == ({"64x128x32.F32.E4M3.E4M3": want["QGMMA.64x128x32.F32.E4M3.E4M3"]}
                          if want["QGMMA.64x128x32.F32.E4M3.E4M3"] else {})
    assert (c["ffma"], c["fmul"], c["fadd"]) == (want["FFMA"], want["FMUL.FTZ"], want["FADD"])
    assert (c["ldl"], c["stl"], c["utmastg"]) == (want["LDL"], want["STL"], want["UTMASTG.4D"])
    assert c["utmaldg_multicast"] == want["UTMALDG.4D.MULTICAST"]
    assert (c["syncs"], c["bar"]) == (want["SYNCS.ARRIVE.TRANS64"], want["BAR.SYNC.DEFER_BLOCKING"])
    assert c["usetmaxreg"] == {"DEALLOC": [40], "ALLOC": [232]}


def _row(**over):
    sass = {"qgmma": {"64x128x32.F32.E4M3.E4M3": 4}, "hgmma": {}, "usetmaxreg": {"DEALLOC": [40], "ALLOC": [232]},
            "utmaldg": {"4D": 8}, "utmaldg_multicast": 0}
    row = {"ok": True, "kernels": 1, "registers": 168, "spill_stores": 0, "spill_loads": 0,
           "wgmma_serialized": False, "setmaxnreg_ignored": False, "sass": sass}
    for k, v in over.items():
        (sass if k in sass else row)[k] = v
    return row


def test_row_checks_name_each_defect():
    ws = hb.Form("gemm_x", "", lambda: None, 3)
    cluster = hb.Form("gemm_c", "", lambda: None, 3, cluster=True)
    quant = hb.Form("quantize_x", "", lambda: None, 1)
    assert hb.check_row(_row(), ws) == []
    assert hb.check_row(_row(utmaldg_multicast=2), cluster) == []
    assert any("spills" in p for p in hb.check_row(_row(spill_stores=4), ws))
    assert any("serialized" in p for p in hb.check_row(_row(wgmma_serialized=True), ws))
    assert any("C7508" in p for p in hb.check_row(_row(setmaxnreg_ignored=True), ws))
    assert any("QGMMA" in p for p in hb.check_row(_row(qgmma={}, hgmma={"64x64x16.F32.BF16": 4}), ws))
    assert any("USETMAXREG" in p for p in hb.check_row(_row(usetmaxreg={}), ws))
    assert any("exceeds the SM" in p for p in hb.check_row(_row(usetmaxreg={"DEALLOC": [40], "ALLOC": [256]}), ws))
    assert any("multicast" in p for p in hb.check_row(_row(), cluster))
    assert hb.check_row(_row(qgmma={}, usetmaxreg={}), quant) == []  # a quantizer: no wgmma, one warpgroup
    two = hb.Form("quantize_y", "", lambda: None, 1, ctas_per_sm=2)
    assert hb.check_row(_row(qgmma={}, usetmaxreg={}, smem_bytes=115712, registers=72), two) == []
    assert any("2 CTAs per SM do not fit" in p and "at most 115712" in p
               for p in hb.check_row(_row(qgmma={}, usetmaxreg={}, smem_bytes=116736, registers=72), two))
    assert any("cannot be checked" in p for p in hb.check_row(_row(qgmma={}, usetmaxreg={}, registers=72), two))
    two_ws = hb.Form("gemm_y", "", lambda: None, 3, ctas_per_sm=2)
    assert any("2 CTAs per SM do not fit" in p and "registers" in p
               for p in hb.check_row(_row(smem_bytes=1024, registers=168, usetmaxreg={"DEALLOC": [40], "ALLOC": [168]}), two_ws))
    assert hb.check_row({"ok": False, "error": "LLVM ERROR: x"}, ws) == ["did not compile: LLVM ERROR: x"]


@pytest.mark.parametrize("target", list(hb.TARGETS))
def test_committed_results_cover_every_form(target):
    doc = json.loads((hb.OUT / f"kernels-{target}.json").read_text())
    assert doc["jax"] == "0.11.2" and doc["ptxas"] and doc["device_kind"] == hb.TARGETS[target]
    assert [r["form"] for r in doc["rows"]] == list(hb.forms())
    for r in doc["rows"]:
        assert r["ptxas_version"] == doc["ptxas"]
        # Compiled, with exactly the problems the docs name (none for a default form).
        assert r["ok"] and sorted(r["problems"]) == sorted(hb.KNOWN_DEFECTS.get(r["form"], ())), r
    assert not set(hb.KNOWN_DEFECTS) & set(hb.CI_FORMS)
    # the rows' problems are what check_row says of them today (a check added later covers them)
    forms = hb.forms()
    assert set(hb.TWO_CTA_FORMS) <= set(forms)
    for r in doc["rows"]:
        assert hb.check_row(r, forms[r["form"]]) == r["problems"], r["form"]


def test_the_tuning_rule_picks_only_layouts_that_compile_cleanly():
    """Every layout `tuning.rule_config` / `grouped_rule_config` may pick has a form whose
    committed H100 row compiled with no problems (0 spills), with that tile's QGMMA and
    multicast loads exactly when it runs in clusters."""
    import dataclasses

    from pallas_kernels import tuning

    want = {("dense", dataclasses.astuple(lay)) for lay in tuning.DENSE_LAYOUTS}
    want |= {("grouped", dataclasses.astuple(lay)) for lay in tuning.GROUPED_LAYOUTS}
    want |= {("dense", dataclasses.astuple(lay)) for lay in tuning.ONE_WARPGROUP_LAYOUTS}
    assert set(hb.RULE_FORMS) == want
    rows = {r["form"]: r for r in json.loads((hb.OUT / "kernels-h100_sxm.json").read_text())["rows"]}
    for (kind, (tile_m, tile_n, cluster_m, cluster_n)), form in hb.RULE_FORMS.items():
        row = rows[form]
        assert row["ok"] and row["problems"] == [] and form not in hb.KNOWN_DEFECTS, form
        assert row["spill_stores"] == row["spill_loads"] == 0, form
        assert list(row["sass"]["qgmma"]) == [f"64x{tile_n}x32.F32.E4M3.E4M3"], form
        assert (row["sass"]["utmaldg_multicast"] > 0) == (cluster_m * cluster_n > 1), form
        assert form.startswith("gemm") == (kind == "dense"), form


def test_mainloop_targets_name_each_unmet_one():
    """`mainloop_problems` against issue 45's targets, on rows as `read_dump` makes them; the
    CI forms' unmet targets are listed exactly, and the committed rows show the same."""
    loop = {"instructions_per_k128": 96, "instructions_per_64x128x128": 96, "fewest_path_per_k128": 96,
            "membar_per_k128": 0, "ldl_stl_per_k128": 0}
    assert hb.mainloop_problems({"mainloop": loop}, "gemm") == []
    assert hb.mainloop_problems({"mainloop": dict(loop, instructions_per_64x128x128=101)}, "gemm") == [
        "main loop over 100 instructions per 64x128x128"]
    assert hb.mainloop_problems({"mainloop": dict(loop, instructions_per_k128=213)}, "grouped_wgrad") == [
        "main loop over 212 static instructions per 128-K block"]
    assert hb.mainloop_problems({"mainloop": dict(loop, membar_per_k128=1, ldl_stl_per_k128=2)}, "gemm") == [
        "MEMBAR in the main loop", "local memory in the main loop"]
    assert hb.mainloop_problems({"mainloop": None}, "gemm") == ["no main loop found in the SASS"]
    # a chain of QGMMAs accumulating onto registers it did not zero (a 64-row wave whose
    # accumulator kept the last wave's partial sum) is a wrong promotion, whatever its count
    assert hb.mainloop_problems({"mainloop": dict(loop, carried_accumulators=["R24"])}, "gemm") == [
        "a QGMMA chain in the main loop does not start from a zeroed accumulator"]
    assert set(hb.MAINLOOP_UNMET) <= set(hb.MAINLOOP_FORMS) <= set(hb.CI_FORMS)
    assert {f for f in hb.CI_FORMS if not f.startswith("quantize")} == set(hb.MAINLOOP_FORMS)
    for target in hb.TARGETS:
        rows = {r["form"]: r for r in json.loads((hb.OUT / f"kernels-{target}.json").read_text())["rows"]}
        for form, kind in hb.MAINLOOP_FORMS.items():
            assert sorted(hb.mainloop_problems(rows[form], kind)) == sorted(hb.MAINLOOP_UNMET.get(form, ())), form


@pytest.mark.slow
@pytest.mark.parametrize("form", hb.CI_FORMS)
def test_default_forms_compile_for_sm90a(toolchain, form):
    """Compiled deviceless for an H100 through ptxas: no spills, no serialized wgmma, setmaxnreg
    honoured and within the register file, E4M3 QGMMA in the GEMMs, multicast TMA in the cluster
    forms. A form in `KNOWN_DEFECTS` must show exactly its recorded problems (so a regression, or a
    fix that the table has not caught up with, fails here)."""
    (row,) = hb.build([form], "h100_sxm", toolchain, timeout=300, log=lambda s: None)
    assert row["ok"], row.get("error")
    assert sorted(row["problems"]) == sorted(hb.KNOWN_DEFECTS.get(form, ())), row
    if form in hb.MAINLOOP_FORMS:  # issue 45's main-loop targets: the met ones held
        unmet = hb.mainloop_problems(row, hb.MAINLOOP_FORMS[form])
        assert sorted(unmet) == sorted(hb.MAINLOOP_UNMET.get(form, ())), row["mainloop"]


def test_a_gpu_session_smoke_row_is_read_against_the_deviceless_build():
    """gpu_session's smoke stage puts each kernel's ptxas facts beside the committed deviceless
    row of the same form; a difference (another ptxas on the GPU machine) is reported."""
    from gpu_reports import compare_to_deviceless
    from gpu_tables import smoke_table

    committed = {"ok": True, "registers": 168, "spill_stores": 0, "spill_loads": 0, "ptxas_version": "13.5",
                 "sass": {"qgmma": {"64x128x32.F32.E4M3.E4M3": 4}}}
    same = {"registers": 168, "spill_bytes": 0, "sass": {"QGMMA": 4, "HGMMA": 0, "USETMAXREG": 2, "LDL": 0, "STL": 0}}
    assert compare_to_deviceless(same, committed)["same"] is True
    other = compare_to_deviceless({**same, "registers": 154, "sass": {**same["sass"], "QGMMA": 8}}, committed)
    assert other["same"] is False and other["differences"] == [
        "registers: 154 here, 168 deviceless", "QGMMA: 8 here, 4 deviceless"]
    assert compare_to_deviceless(same, None)["same"] is None
    rows = [{"kernel": "gemm_default", "status": "ok", "deviceless": other, **same}]
    text = "\n".join(smoke_table(rows))
    assert "DIFFERS" in text and "gemm_default: registers: 154 here, 168 deviceless" in text


def test_the_session_finds_the_committed_rows_for_its_gpu():
    import gpu_session

    h100, h200 = gpu_session.deviceless_rows("NVIDIA H100 80GB HBM3"), gpu_session.deviceless_rows("NVIDIA H200")
    assert set(h100) == set(h200) == set(hb.forms())
    assert h100["gemm_default"]["target"] == "h100_sxm" and h200["gemm_default"]["target"] == "h200"


def _float_rounding():
    sys.path.insert(0, str(REPO / "benchmarks" / "hopper"))
    import float_rounding

    return float_rounding


def test_the_references_rounding_is_identified_for_each_expression():
    """XLA:CPU's results (the reference's) for each expression an optimizer kernel would need match
    exactly one candidate rounding bit for bit (`benchmarks/hopper/float_rounding.py`): a change in
    how XLA rounds them (a contraction, a division rewritten) fails here."""
    rows = _float_rounding().cpu_rows()
    committed = json.loads((hb.OUT / "float-rounding-h100_sxm.json").read_text())["xla_cpu_mismatches"]
    assert set(rows) == set(committed)
    for name, row in rows.items():
        exact = [cand for cand, n in row.items() if cand != "inputs" and n == 0]
        assert len(exact) == 1, (name, row)
        assert committed[name][exact[0]] == 0, (name, row, committed[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mul_add", "divide", "sqrt"])
def test_mosaic_gpu_rounds_as_recorded(toolchain, name):
    """Mosaic GPU's PTX for a*b+c (one fma), a/b (div.full, approximate) and sqrt (sqrt.approx), as
    the committed record says: the IEEE operations a kernel must ask for by hand (as
    `ieee_reciprocal` does) where it must match the reference."""
    row = _float_rounding().mosaic_row(name, toolchain)
    assert row["ok"], row.get("error")
    committed = json.loads((hb.OUT / "float-rounding-h100_sxm.json").read_text())["mosaic_h100_sxm"][name]
    assert row["ptx"] == committed["ptx"] and row["sass"] == committed["sass"], (row, committed)

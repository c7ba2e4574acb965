"""benchmarks/hopper/sass_loops.py on synthetic SASS: no GPU, no compiler.

Each test writes a small kernel in nvdisasm's text form (labels, backquoted branch targets, with
or without control codes) whose main loop's contents are known, so the counts and the K per
iteration can be checked exactly."""

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hopper"))
from sass_loops import mainloop_census, parse_instructions  # noqa: E402


class Kernel:
    """Emits SASS lines with increasing addresses; `ctrl` adds nvdisasm's control-code prefix."""

    def __init__(self, ctrl=False):
        self.lines, self.addr, self.ctrl = [".text.k:"], 0, ctrl

    def i(self, text):
        prefix = "   -:-:-:Y:01        " if self.ctrl else "        "
        self.lines.append(f"{prefix}/*{self.addr:04x}*/                   {text} ;")
        self.addr += 0x10

    def label(self, name):
        self.lines.append(f"{name}:")

    def text(self):
        return "\n".join(self.lines) + "\n"


def promotion_block(k, n=128, acc="R24", waves=1, ffma=None, scale_loads=2, arrive=True, fence=False):
    """One 128-K block the way a promotion kernel issues it: wait, per wave 4 chained QGMMA
    (first zero-initialising), wait for them, FMUL the scales, FFMA into the final accumulators."""
    k.i("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR38+0x34d00], R3")
    k.i("@!P1 BRA `(.L_x_90)")
    for _ in range(waves):
        for _ in range(scale_loads):
            k.i("LDS R4, [R5+UR4]")
        k.i("WARPGROUP.ARRIVE")
        k.i(f"QGMMA.64x{n}x32.F32.E4M3.E4M3 {acc}, gdesc[UR28], RZ, !UPT")
        k.i(f"QGMMA.64x{n}x32.F32.E4M3.E4M3 {acc}, gdesc[UR24], {acc}")
        k.i(f"QGMMA.64x{n}x32.F32.E4M3.E4M3 {acc}, gdesc[UR20], {acc}")
        k.i(f"QGMMA.64x{n}x32.F32.E4M3.E4M3 {acc}, gdesc[UR16], {acc}, gsb0")
        k.i("WARPGROUP.DEPBAR.LE gsb0, 0x0")
        k.i("FMUL R6, R4, R7")
        for j in range(n // 2 if ffma is None else ffma):
            k.i(f"FFMA R{100 + j}, R6, R{24 + j % 64}, R{100 + j}")
    if fence:                                   # a warpgroup barrier per K block
        k.i("MEMBAR.ALL.CTA")
        k.i("FENCE.VIEW.ASYNC.S")
        k.i("BAR.SYNC.DEFER_BLOCKING R6, 0x80")
    if arrive:
        k.i("@!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R25+URZ], RZ")


def kernel_with_loop(unroll=1, waves=1, n=128, ctrl=False, stub=True, outer=True, masked=0,
                     skip_all=False, **kw):
    """prologue; [outer persistent loop:] header; [a branch over `masked` instructions, as a
    group's first/last K block's masking;] `unroll` K blocks [all branched over with
    `skip_all`]; backward branch; epilogue; EXIT; then an out-of-line mbarrier retry stub that
    jumps back into the loop body."""
    k = Kernel(ctrl)
    k.i("S2R R0, SR_TID.X")
    k.i("ISETP.NE.AND P0, PT, R0, RZ, PT")
    if outer:
        k.label(".L_x_1")
        k.i("IADD3 R9, R9, 0x1, RZ")
    k.label(".L_x_5")
    if masked:
        k.i("@!P4 BRA `(.L_x_60)")
        for j in range(masked):
            k.i(f"PRMT R{40 + j % 8}, R{40 + j % 8}, 0x7610, RZ")
        k.label(".L_x_60")
    if skip_all:
        k.i("@P5 BRA `(.L_x_61)")
    for _ in range(unroll):
        promotion_block(k, n=n, waves=waves, **kw)
    if skip_all:
        k.label(".L_x_61")
    k.label(".L_x_91")
    k.i("IADD3 R2, R2, 0x1, RZ")
    k.i("ISETP.GE.AND P2, PT, R2, 0x40, PT")
    k.i("@!P2 BRA `(.L_x_5)")
    k.i("STS [R10], R100")
    k.i("BAR.SYNC.DEFER_BLOCKING 0x1, 0x100")
    if outer:
        k.i("ISETP.GE.AND P3, PT, R9, R11, PT")
        k.i("@!P3 BRA `(.L_x_1)")
    k.i("EXIT")
    if stub:
        k.label(".L_x_90")
        k.i("SYNCS.PHASECHK.TRANS64 P1, [UR38+0x34d00], R3")
        k.i("@!P1 BRA `(.L_x_90)")
        k.i("BRA `(.L_x_91)")
    return k.text()


def test_parse_reads_labels_and_both_line_forms():
    for ctrl in (False, True):
        insns, labels = parse_instructions(kernel_with_loop(ctrl=ctrl))
        assert insns[0]["op"] == "S2R"
        assert insns[labels[".L_x_5"]]["op"].startswith("SYNCS.PHASECHK")
        assert insns[labels[".L_x_5"] + 1]["pred"] == "@!P1"


@pytest.mark.parametrize("ctrl", [False, True])
def test_one_kblock_per_iteration(ctrl):
    r = mainloop_census(kernel_with_loop(ctrl=ctrl))
    assert r["num_loops"] == 1
    loop = r["main"]
    assert loop["header"] == ".L_x_5"
    it = loop["per_iteration"]
    assert it["qgmma"] == {"64x128x32.F32.E4M3.E4M3": 4}
    assert it["ffma"] == 64 and it["fmul"] == 1 and it["fadd"] == 0
    assert it["loads"] == {"LDS": {"32": 2}}
    assert it["syncs"] == {"PHASECHK.TRANS64.TRYWAIT": 1, "ARRIVE.TRANS64.RED.A1T0": 1}
    assert it["bar_total"] == 0            # the epilogue's BAR.SYNC is after the back edge
    assert it["warpgroup"] == {"ARRIVE": 1, "DEPBAR.LE": 1}
    # wait+bra, 2 LDS, arrive, 4 QGMMA, depbar, FMUL, 64 FFMA, arrive, 3 loop-control
    assert it["instructions"] == 2 + 2 + 1 + 4 + 1 + 1 + 64 + 1 + 3
    assert loop["k_per_iteration"] == 128
    assert loop["per_k128"]["ffma"] == 64
    # the retry stub belongs to the loop but not to its straight-line body
    assert loop["outlined"]["instructions"] == 3
    assert loop["outlined"]["syncs"] == {"PHASECHK.TRANS64": 1}


def test_unrolled_waves_are_normalised_to_128_k():
    rng = random.Random(31)
    for _ in range(5):
        unroll, waves = rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
        n = rng.choice([64, 128, 192])
        loop = mainloop_census(kernel_with_loop(unroll=unroll, waves=waves, n=n))["main"]
        assert loop["chains"]["lengths"] == [4] * (unroll * waves)
        assert loop["inline_mbarrier_waits"] == unroll
        assert loop["m_waves"] == waves
        assert loop["k_per_iteration"] == 128 * unroll
        k128 = loop["per_k128"]
        assert k128["qgmma_total"] == 4 * waves
        assert k128["ffma"] == waves * n // 2
        assert k128["fmul"] == waves
        # per 64x128x128 of MMA work: FFMA per element of a 64x128 tile is 64 per thread
        assert loop["per_64x128x128"]["ffma"] == 64
        assert loop["per_64x128x128"]["qgmma_total"] == pytest.approx(4 * 128 / n, abs=1e-3)


def test_barriers_and_fences_inside_the_loop():
    loop = mainloop_census(kernel_with_loop(unroll=2, fence=True, scale_loads=3))["main"]
    assert loop["per_k128"]["bar"] == {"SYNC.DEFER_BLOCKING": 1}
    assert loop["per_k128"]["fences"] == {"MEMBAR.ALL.CTA": 1, "FENCE.VIEW.ASYNC.S": 1}
    assert loop["per_k128"]["loads"] == {"LDS": {"32": 3}}
    plain = mainloop_census(kernel_with_loop(unroll=2))["main"]["per_k128"]
    assert plain["bar_total"] == 0 and plain["fences_total"] == 0


def test_m_waves_given_overrides_the_inference():
    text = kernel_with_loop(unroll=2, waves=2)
    assert mainloop_census(text)["main"]["k_per_iteration"] == 256
    assert mainloop_census(text, m_waves=1)["main"]["k_per_iteration"] == 512


def test_backward_jump_from_a_stub_is_not_a_loop():
    """The stub's `BRA .L_x_91` goes backward into the loop (a naive backward-branch scan would
    call [.L_x_91, stub] a loop); only the real loop is found, with the stub outlined."""
    r = mainloop_census(kernel_with_loop(unroll=3))
    assert r["num_loops"] == 1 and r["main"]["header"] == ".L_x_5"
    assert r["main"]["k_per_iteration"] == 384


def test_carried_accumulators_count_32_k_per_qgmma():
    k = Kernel()
    k.i("MOV R2, RZ")
    k.label(".L_x_3")
    for acc in ("R24", "R88"):                 # two accumulators (two N halves), carried
        for desc in ("UR8", "UR12"):
            k.i(f"QGMMA.64x64x32.F32.E4M3.E4M3 {acc}, gdesc[{desc}], {acc}")
    k.i("IADD3 R2, R2, 0x1, RZ")
    k.i("ISETP.NE.AND P0, PT, R2, 0x10, PT")
    k.i("@P0 BRA `(.L_x_3)")
    k.i("EXIT")
    loop = mainloop_census(k.text())["main"]
    assert loop["chains"]["lengths"] == [] and loop["chains"]["carried"] == {"R24": 2, "R88": 2}
    assert loop["k_per_iteration"] == 64
    assert loop["per_k128"]["qgmma_total"] == 8


def test_innermost_of_nested_qgmma_loops_and_address_targets():
    """cuobjdump's form (targets as addresses, no labels); an outer loop that also holds a QGMMA
    (a peeled first block) is not innermost."""
    lines = [
        "        /*0000*/                   MOV R2, RZ ;",
        "        /*0010*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;",
        "        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;",
        "        /*0030*/                   FFMA R100, R6, R24, R100 ;",
        "        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*0050*/                   ISETP.NE.AND P0, PT, R2, 0x10, PT ;",
        "        /*0060*/               @P0 BRA 0x10 ;",
        "        /*0070*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;",
        "        /*0080*/                   ISETP.NE.AND P1, PT, R3, 0x10, PT ;",
        "        /*0090*/               @P1 BRA 0x0 ;",
        "        /*00a0*/                   EXIT ;",
    ]
    r = mainloop_census("\n".join(lines))
    assert r["num_loops"] == 1
    loop = r["main"]
    assert loop["header_addr"] == "0x10" and loop["latch_addr"] == "0x60"
    assert loop["per_iteration"]["qgmma_total"] == 2 and loop["k_per_iteration"] == 64
    assert loop["per_k128"]["ffma"] == 2


def test_no_qgmma_no_loops():
    k = Kernel()
    k.label(".L_x_0")
    k.i("FFMA R1, R2, R3, R1")
    k.i("@P0 BRA `(.L_x_0)")
    k.i("EXIT")
    assert mainloop_census(k.text()) == {"loops": [], "main": None, "num_loops": 0}
    assert mainloop_census("") == {"loops": [], "main": None, "num_loops": 0}


def test_fewest_path_skips_conditional_blocks():
    """A block a branch jumps over (a group's first/last K block masking) counts in the static
    body, not in the fewest path; without one the two agree; a path around the QGMMAs is none."""
    plain = mainloop_census(kernel_with_loop())["main"]
    assert plain["fewest_path_per_k128"] == plain["per_k128"]
    masked = mainloop_census(kernel_with_loop(masked=50))["main"]
    static, fewest = masked["per_k128"], masked["fewest_path_per_k128"]
    assert static["instructions"] == plain["per_k128"]["instructions"] + 1 + 50  # the BRA and the block
    assert fewest["instructions"] == plain["per_k128"]["instructions"] + 1       # the BRA only
    assert fewest["ffma"] == static["ffma"] == 64 and fewest["qgmma_total"] == 4
    skipped = mainloop_census(kernel_with_loop(skip_all=True))["main"]
    assert skipped["per_k128"]["qgmma_total"] == 4 and skipped["fewest_path_per_k128"] is None

"""The GPU session's tables: one per benchmark record, the speed targets judged from the records,
and the smoke stage's per-kernel rows. Pure functions of the JSON the scripts write."""

from __future__ import annotations

import math

from step_profile import profile_lines


def grouped_label(groups: int, rows: int, n: int, k: int) -> str:
    """GxRxNxK (R rows per group) for a grouped problem recorded with all groups' rows."""
    return f"{groups}x{rows // groups}x{n}x{k}"


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def gemm_table(record: dict) -> list[str]:
    rows = record.get("rows", [])
    base = {"xla-bf16": "bf16", "xla-fp8-per-tensor": "fp8/t", "torch-fp8-blockwise": "torch-bw"}
    lines = [f"dense GEMM, TFLOP/s      {'bf16':>7} {'fp8/t':>7} {'torch-bw':>8} | "
             f"{'jfp8 impl':28s} {'TFLOP/s':>7} {'x bf16':>6} {'x t-bw':>6} {'%fp8pk':>6}"]
    shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows))
    for shape in shapes:
        at = {r["impl"]: r for r in rows if (r["m"], r["n"], r["k"]) == shape}
        b = {v: at.get(k, {}).get("tflops") for k, v in base.items()}
        left = f"{'x'.join(map(str, shape)):24s} {fmt(b['bf16'], '.4g'):>7} {fmt(b['fp8/t'], '.4g'):>7} {fmt(b['torch-bw'], '.4g'):>8}"
        mine = [r for name, r in at.items() if name.startswith("jfp8")]
        for i, r in enumerate(mine or [None]):
            if r is None:
                lines.append(f"{left} | (no jfp8 row)")
                continue
            ratios = r.get("ratio_vs", {})
            lines.append(f"{left if i == 0 else ' ' * len(left)} | {r['impl']:28s} {fmt(r['tflops'], '.4g'):>7} "
                         f"{fmt(r.get('ratio_vs_bf16'), '.2f'):>6} {fmt(ratios.get('torch-fp8-blockwise'), '.2f'):>6} "
                         f"{fmt(r.get('frac_fp8_peak') and 100 * r['frac_fp8_peak']):>6}")
    return lines


MGPU_ROW = {"fprop": "mgpu-ragged-dot-bf16", "wgrad": "mgpu-transposed-ragged-dot-bf16"}


def grouped_table(record: dict) -> list[str]:
    """bench_grouped's record, Fprop (`op` absent or "fprop") or the grouped Wgrad ("wgrad")."""
    rows = record.get("rows", [])
    op = record.get("op", "fprop")
    mgpu = MGPU_ROW[op]
    title = "grouped GEMM" if op == "fprop" else "grouped Wgrad"
    lines = [f"{title + ', TFLOP/s':24s} {'einsum':>7} {'ragged':>7} {'mgpu':>7} | {'jfp8':>7} "
             f"{'x einsum':>8} {'x ragged':>8} {'x mgpu':>6} {'%fp8pk':>6}"]
    for key in dict.fromkeys((r["groups"], r["m"], r["n"], r["k"]) for r in rows):
        at = {r["impl"]: r for r in rows if (r["groups"], r["m"], r["n"], r["k"]) == key}
        g, m, n, k = key
        t = lambda name: at.get(name, {}).get("tflops")  # noqa: E731
        for name, r in at.items():
            if not name.startswith("jfp8"):
                continue
            rv = r.get("ratio_vs", {})
            lines.append(
                f"{grouped_label(g, m, n, k):24s} {fmt(t('xla-bf16-einsum'), '.4g'):>7} {fmt(t('xla-ragged-dot-bf16'), '.4g'):>7} "
                f"{fmt(t(mgpu), '.4g'):>7} | {fmt(r['tflops'], '.4g'):>7} "
                f"{fmt(rv.get('xla-bf16-einsum'), '.2f'):>8} {fmt(rv.get('xla-ragged-dot-bf16'), '.2f'):>8} "
                f"{fmt(rv.get(mgpu), '.2f'):>6} {fmt(r.get('frac_fp8_peak') and 100 * r['frac_fp8_peak']):>6}")
    return lines


def linear_table(record: dict) -> list[str]:
    """fp8_linear forward + backward against the bf16 layer, per shape."""
    rows = record.get("rows", [])
    lines = [f"linear fwd+bwd, ms       {'bf16':>8} | {'fp8 impl':14s} {'ms':>8} {'x bf16':>6} "
             f"{'err/f32':>8}"]
    for key in dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows):
        at = {r["impl"]: r for r in rows if (r["m"], r["n"], r["k"]) == key}
        base = at.get("bf16", {}).get("ms")
        for name, r in at.items():
            if name == "bf16":
                continue
            lines.append(f"{'x'.join(map(str, key)):24s} {fmt(base, '.3f'):>8} | {name:14s} "
                         f"{fmt(r['ms'], '.3f'):>8} {fmt(r.get('ratio_vs_bf16'), '.2f'):>6} "
                         f"{fmt(r.get('err_vs_f32'), '.1e'):>8}")
    return lines


def block_table(record: dict) -> list[str]:
    """The routed-expert block forward + backward, each row against the bf16 einsum block."""
    lines = [f"MoE block fwd+bwd, ms    {'impl':22s} {'ms':>8} {'x bf16':>6} {'rel err':>8}"]
    for r in record.get("rows", []):
        lines.append(f"{r['problem']:24s} {r['impl']:22s} {fmt(r.get('ms'), '.3f'):>8} "
                     f"{fmt(r.get('ratio_vs_bf16'), '.2f'):>6} {fmt(r.get('rel_error'), '.1e'):>8}")
    return lines


def step_table(record: dict) -> list[str]:
    """The training step per preset and precision: time, throughput, MFU, memory; where it was
    profiled, its kernels' time per category."""
    lines = [f"train step                {'precision':9s} {'ms':>9} {'tokens/s':>10} {'MFU':>6} {'x bf16':>6} {'peak GB':>8}"]
    for r in record.get("rows", []):
        peak = r.get("peak_bytes_in_use")
        peak = peak / 1e9 if isinstance(peak, (int, float)) else None
        mfu = r.get("mfu")
        lines.append(f"{r['preset'] + ' ' + str(r['batch']) + 'x' + str(r['seq_len']):25s} {r['precision']:9s} "
                     f"{fmt(r.get('step_ms'), '.2f'):>9} {fmt(r.get('tokens_per_s'), '.0f'):>10} "
                     f"{fmt(mfu and 100 * mfu, '.1f'):>5}% {fmt(r.get('ratio_vs_bf16'), '.2f'):>6} {fmt(peak, '.1f'):>8}")
        if r.get("profile"):
            lines += profile_lines(r["profile"])
    return lines


# Issue 43's loss goal: FP8's mean loss over steps 81-100 of a 100-step run within 1.5 % of
# BF16's, same seed, same batches.
LOSS_GOAL_WINDOW = (81, 100)
LOSS_GOAL_GAP = 0.015
LOSS_GOAL = f"|gap| <= {100 * LOSS_GOAL_GAP:g} % over steps {LOSS_GOAL_WINDOW[0]}-{LOSS_GOAL_WINDOW[1]}"


def loss_verdicts(record: dict) -> list[dict]:
    """Per preset of a `bench_step.py --steps 100` record: FP8's and BF16's mean loss over the last
    fifth of the steps, the gap, and the goal's verdict: "met"; "NOT met" (also for a NaN or
    infinite loss in the window: a run that blew up); "not measured" where fewer than 100 steps
    ran for either precision (the window is then not steps 81-100). A record without an FP8/BF16
    pair (a precision skipped for the budget, failed or killed) gives one "not measured" entry
    that says what it holds."""
    pairs = record.get("fp8_vs_bf16") or {}
    if not pairs:
        ran = sorted({f"{r.get('preset')} {r.get('precision')}" for r in record.get("rows", [])})
        why = "no FP8/BF16 pair in the record: rows " + (", ".join(ran) or "none")
        for key in ("failed", "skipped"):
            if record.get(key):
                why += f"; {key}: {record[key]}"
        return [dict(preset=None, window=[], mean_loss=None, gap=None, verdict="not measured", why=why,
                     goal=LOSS_GOAL, seed=record.get("seed"))]
    out = []
    for preset, c in pairs.items():
        window = tuple(c.get("loss_window") or ())
        gap = c.get("loss_gap")
        if window != LOSS_GOAL_WINDOW or gap is None:
            verdict = "not measured"
        elif not math.isfinite(gap):
            verdict = "NOT met (non-finite loss)"
        else:
            verdict = "met" if abs(gap) <= LOSS_GOAL_GAP else "NOT met"
        out.append(dict(preset=preset, window=list(window), mean_loss=c.get("mean_loss"), gap=gap,
                        goal=LOSS_GOAL, verdict=verdict, seed=record.get("seed")))
    return out


def losses_table(record: dict) -> list[str]:
    """The 100-step FP8-vs-BF16 loss comparison (issue 43), one line per preset."""
    lines = [f"loss, FP8 vs BF16 (seed {record.get('seed')}; one seed is an anecdote, not a noise band)"]
    for v in loss_verdicts(record):
        if v["preset"] is None:
            lines.append(f"{v['verdict']}: {v['why']}")
            continue
        first, last = (v["window"] + [None, None])[:2]
        mean = v["mean_loss"] or {}
        lines.append(f"{v['preset']:8s} steps {first}-{last}: FP8 {fmt(mean.get('fp8'), '.4f')}, BF16 "
                     f"{fmt(mean.get('bf16'), '.4f')}, gap {fmt(v['gap'] and 100 * v['gap'], '+.2f')} %  "
                     f"goal {v['goal']}: {v['verdict']}")
    return lines


def quantize_table(record: dict) -> list[str]:
    """GB/s by the wall clock and, where profiled, by the kernels' device time (with the kernels a
    call launches)."""
    lines = [f"quantize, GB/s (copy {fmt(record.get('copy_gbps'), '.4g')} GB/s)   {'GB/s':>7} {'of copy':>7} "
             f"{'dev GB/s':>8} {'of copy':>7} {'kernels':>7}"]
    rows = record.get("rows", [])
    # XLA's rows beside the kernels' (a Hopper's record) are marked; a record of XLA's alone is not.
    beside = any(r["impl"].startswith("jfp8-mosaic-") for r in rows)
    for r in rows:
        if r["kernel"] == "copy":
            continue
        frac = r.get("frac_of_copy")
        d = r.get("device") or {}
        dfrac = d.get("frac_of_copy")
        config = r["impl"][r["impl"].index("["):] if "[" in r["impl"] else ""
        config += " (xla)" if beside and r["impl"].startswith("jfp8-xla-") else ""
        lines.append(f"{r['kernel'] + config:24s} {'%dx%d:%s' % (r['m'], r['k'], r['dtype']):25s} {fmt(r['gbps'], '.4g'):>7} "
                     f"{fmt(frac and 100 * frac, '.1f'):>6}% {fmt(d.get('gbps'), '.4g'):>8} "
                     f"{fmt(dfrac and 100 * dfrac, '.1f'):>6}% {fmt(d.get('kernels_per_call'), '.3g'):>7}")
    return lines


def tune_table(record: dict) -> list[str]:
    """Per problem: the fastest config tune_gemm measured (its record's `entries`), and its
    speed-up over the default config and over the rule's pick."""
    kind = "grouped" if record.get("kind") == "grouped" else "GEMM"
    lines = [f"{kind} tuning ({record.get('out_dtype')} out)  {'best config':>40s} {'TFLOP/s':>7} "
             f"{'x dflt':>6} {'x rule':>6}"]
    for e in record.get("entries", []):
        problem = (grouped_label(e["groups"], e["m"], e["n"], e["kp"]) if "groups" in e
                   else f"{e['m']}x{e['n']}x{e['kp']}")
        lines.append(f"{problem:24s} {e['impl']:>40s} {fmt(e['tflops'], '.4g'):>7} "
                     f"{fmt(e['speedup_vs_default'], '.2f'):>6} {fmt(e['speedup_vs_rule'], '.2f'):>6}")
    return lines


# The speed targets: (benchmark, what, baseline impl or None, bound). Dense: 8192^3 and
# DeepSeek-V3's M=4096 shapes with K >= 7168; grouped: every MoE shape; quantizers: every
# kernel's default row against the copy bandwidth.
DENSE_TARGET_SHAPES = ((8192, 8192, 8192), (4096, 2112, 7168), (4096, 7168, 16384),
                       (4096, 4096, 7168))
# The speed targets, written once: the benchmarks record them, the session judges them.
TARGET_DENSE_VS_BF16 = 1.6
TARGET_DENSE_VS_TORCH_BLOCKWISE = 1.0
TARGET_GROUPED_VS_BF16 = 1.4
TARGET_QUANTIZE_FRAC_OF_COPY = 0.7
TARGET_LINEAR_VS_BF16 = 1.3
TARGETS = (
    ("bench_gemm", "x XLA bf16", "xla-bf16", TARGET_DENSE_VS_BF16),
    ("bench_gemm", "x torch blockwise FP8", "torch-fp8-blockwise", TARGET_DENSE_VS_TORCH_BLOCKWISE),
    ("bench_grouped", "x bf16 einsum", "xla-bf16-einsum", TARGET_GROUPED_VS_BF16),
    ("bench_grouped", "x bf16 ragged_dot_mgpu", "mgpu-ragged-dot-bf16", TARGET_GROUPED_VS_BF16),
    ("bench_quantize", "of copy bandwidth", None, TARGET_QUANTIZE_FRAC_OF_COPY),
)


def target_verdicts(records: dict[str, dict]) -> list[dict]:
    """Each speed target at each problem, from the benchmark records (name -> record):
    the measured value, the bound, and "pass", "FAIL" or "not measured" (no jfp8 row on the
    Mosaic kernels, or no baseline row)."""
    verdicts = []
    for bench, what, baseline, bound in TARGETS:
        rows = records.get(bench, {}).get("rows", [])
        if bench == "bench_quantize":
            mine = [r for r in rows if r["impl"].startswith("jfp8-mosaic-") and "[" not in r["impl"]]
            wanted = [(f"{r['kernel']} {r['m']}x{r['k']}:{r['dtype']}", r.get("frac_of_copy"))
                      for r in mine]
        else:
            if bench == "bench_gemm":
                keys = DENSE_TARGET_SHAPES
                key_of = lambda r: (r["m"], r["n"], r["k"])  # noqa: E731
            else:
                keys = list(dict.fromkeys((r["groups"], r["m"], r["n"], r["k"]) for r in rows))
                key_of = lambda r: (r["groups"], r["m"], r["n"], r["k"])  # noqa: E731
            mine = {key_of(r): r for r in rows if r["impl"] == "jfp8-mosaic"}
            wanted = []
            for key in keys:
                label = "x".join(map(str, key)) if bench == "bench_gemm" else grouped_label(*key)
                wanted.append((label, mine.get(key, {}).get("ratio_vs", {}).get(baseline)))
        if not wanted:
            wanted = [("(no jfp8-mosaic row)", None)]
        for problem, value in wanted:
            verdict = "not measured" if value is None else ("pass" if value >= bound else "FAIL")
            verdicts.append(dict(benchmark=bench, problem=problem, target=what, bound=bound,
                                 value=value, verdict=verdict))
    return verdicts


def targets_table(verdicts: list[dict]) -> list[str]:
    lines = [f"speed targets             {'problem':28s} {'target':24s} {'value':>6} {'bound':>5}"]
    for v in verdicts:
        lines.append(f"{v['benchmark']:25s} {v['problem']:28s} {v['target']:24s} "
                     f"{fmt(v['value'], '.2f'):>6} {v['bound']:5.2f}  {v['verdict']}")
    return lines


def _vs_deviceless(row: dict) -> str:
    d = row.get("deviceless") or {}
    return {True: "same", False: "DIFFERS", None: "-"}[d.get("same")]


def smoke_table(rows: list[dict]) -> list[str]:
    """One line per smoke kernel: verdict, error against its bound, and what ptxas and the SASS
    say (registers, spill bytes, fp8/bf16 wgmma, setmaxnreg, local-memory loads/stores, the
    comparison with the committed deviceless build, the ptxas warning codes); the differences
    from the deviceless build follow the table."""
    lines = [f"smoke kernel              {'status':8s} {'error':>9} {'bound':>9} {'regs':>4} {'spill':>5} "
             f"{'QGMMA':>5} {'HGMMA':>5} {'SETMAX':>6} {'LDL/STL':>7} {'deviceless':>10}  warnings"]
    for r in rows:
        sass = r.get("sass") or {}  # None: no SASS (interpreter, or no disassembler)
        ldl_stl = f"{sass['LDL']}/{sass['STL']}" if sass else "-"
        codes = sorted({w.split(":")[0] for w in r.get("ptxas_warnings") or []})
        lines.append(
            f"{r['kernel']:25s} {r['status']:8s} {fmt(r.get('error'), '.2e'):>9} {fmt(r.get('bound'), '.2e'):>9} "
            f"{fmt(r.get('registers'), 'd'):>4} {fmt(r.get('spill_bytes'), 'd'):>5} "
            f"{fmt(sass.get('QGMMA'), 'd'):>5} {fmt(sass.get('HGMMA'), 'd'):>5} "
            f"{fmt(sass.get('USETMAXREG'), 'd'):>6} {ldl_stl:>7} {_vs_deviceless(r):>10}  {' '.join(codes)}"
            + (f"  {r['failure'][:120]}" if r.get("failure") else ""))
    differ = [r for r in rows if (r.get("deviceless") or {}).get("same") is False]
    if differ:
        lines.append("compiled otherwise than the deviceless build (this machine's ptxas or LLVM differs; "
                     "benchmarks/results/hopper-build/):")
        lines += [f"  {r['kernel']}: {'; '.join(r['deviceless']['differences'])}" for r in differ]
    return lines

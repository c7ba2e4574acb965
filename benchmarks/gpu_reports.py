"""Readers for what the GPU tools print, as plain dicts: the ptxas report, SASS and PTX dumped by
Mosaic GPU, compute-sanitizer's summaries, pytest's JUnit XML and Nsight Compute's CSV.

Pure text in, dict out, so that each is tested on the CPU against committed sample texts
(tests/fixtures/gpu/) before a GPU ever produces the real thing. Formats, as the tools print them:
- ptxas (`MOSAIC_GPU_DUMP_PTXAS=1`, the `-v` report): per function "Compiling entry function
  'NAME'", "N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers";
  warnings as "ptxas warning : (CNNNN) ...", e.g. C7508 when `setmaxnreg` is ignored (the
  consumers then keep the launch's register count) and "wgmma.mma_async instructions are
  serialized" (wgmma waits after every instruction).
- SASS (`MOSAIC_GPU_DUMP_SASS=1`, nvdisasm): one instruction per line, "/*0a50*/  OPCODE.mods
  operands ;", functions as ".text.NAME:" (cuobjdump: "Function : NAME").
"""

from __future__ import annotations

import csv
import io
import json
import re

# Opcodes counted in SASS: fp8 / bf16 wgmma, older MMAs, setmaxnreg, local-memory traffic.
SASS_OPS = ("QGMMA", "HGMMA", "HMMA", "IMMA", "USETMAXREG", "LDL", "STL")
C_SETMAXNREG_IGNORED = "C7508"

_FUNCTION = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_WARNING = re.compile(r"ptxas\s+(warning|info|error)\s*:\s*(?:\((C\d+)\)\s*)?(.*)")


def parse_ptxas(text: str) -> dict:
    """Registers, stack and spills per function, and the warnings that cost speed.

    Returns {"functions": {name: {registers, stack, spill_stores, spill_loads}}, "registers"
    (max over functions, None without a report), "spill_bytes" (stores + loads, all functions),
    "warnings": ["CNNNN: message", ...] (every coded or 'warning' line), "setmaxnreg_ignored",
    "wgmma_serialized"}."""
    functions: dict[str, dict] = {}
    current = None
    warnings = []
    for line in text.splitlines():
        if m := _FUNCTION.search(line):
            current = functions.setdefault(m.group(1), {})
        elif m := _PROPERTIES.search(line):
            current = functions.setdefault(m.group(1), {})
        if (m := _FRAME.search(line)) and current is not None:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        if (m := _REGISTERS.search(line)) and current is not None:
            current["registers"] = int(m.group(1))
        if (m := _BARRIERS.search(line)) and current is not None:
            current["barriers"] = int(m.group(1))
        if (m := _WARNING.search(line)) and (m.group(1) in ("warning", "error") or m.group(2)):
            code = m.group(2) or m.group(1)
            warnings.append(f"{code}: {m.group(3).strip()}")
    regs = [f["registers"] for f in functions.values() if "registers" in f]
    barriers = [f["barriers"] for f in functions.values() if "barriers" in f]
    spills = [f.get("spill_stores", 0) + f.get("spill_loads", 0) for f in functions.values()]
    return {
        "functions": functions,
        "registers": max(regs) if regs else None,
        "barriers": max(barriers) if barriers else None,
        "spill_bytes": sum(spills) if functions else None,
        "warnings": warnings,
        "setmaxnreg_ignored": any(w.startswith(C_SETMAXNREG_IGNORED) or "setmaxnreg ignored" in w
                                  for w in warnings),
        "wgmma_serialized": any("wgmma.mma_async instructions are serialized" in w for w in warnings),
    }


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.IGNORECASE)
_SASS_FUNCTION = re.compile(r"^\s*\.text\.([\w$.]+):|Function : ([\w$.]+)", re.MULTILINE)


def count_sass(text: str) -> dict[str, int]:
    """Instructions of each opcode in `SASS_OPS` (the opcode before its first '.')."""
    counts = dict.fromkeys(SASS_OPS, 0)
    for m in _SASS_LINE.finditer(text):
        op = m.group(1)
        if op in counts:
            counts[op] += 1
    return counts


_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;\n]*)")


def sass_census(text: str) -> dict:
    """The instruction mix of a SASS dump (nvdisasm, with or without control codes), as the
    deviceless build records it: total instructions; QGMMA / HGMMA by shape and types (the
    opcode after the first '.'); FFMA, FMUL, FADD (each with its modifiers; the GEMMs' promotion
    is FFMA/FMUL work); LDL / STL (local memory: spills); USETMAXREG values by kind
    ({"DEALLOC": [40], "ALLOC": [232]}); UTMALDG by form and how many are multicast; UTMASTG;
    SYNCS (mbarrier operations) and BAR (CTA barriers)."""
    counts: dict[str, int] = {}
    setmaxnreg: dict[str, list[int]] = {}
    for m in _SASS_INSTRUCTION.finditer(text):
        op, operands = m.group(1), m.group(2)
        counts[op] = counts.get(op, 0) + 1
        if op.startswith("USETMAXREG"):
            kind = "DEALLOC" if ".DEALLOC" in op else "ALLOC"
            value = re.findall(r"0x[0-9a-f]+|\b\d+\b", operands)
            if value:
                setmaxnreg.setdefault(kind, []).append(int(value[-1], 0))

    def by_base(base: str) -> dict[str, int]:
        return {op[len(base) + 1:]: n for op, n in sorted(counts.items()) if op.startswith(base + ".")}

    def total(base: str) -> int:
        return sum(n for op, n in counts.items() if op == base or op.startswith(base + "."))

    tma_loads = by_base("UTMALDG")
    return {
        "instructions": sum(counts.values()),
        "qgmma": by_base("QGMMA"), "hgmma": by_base("HGMMA"),
        "ffma": total("FFMA"), "fmul": total("FMUL"), "fadd": total("FADD"),
        "ldl": total("LDL"), "stl": total("STL"),
        "usetmaxreg": {k: sorted(set(v)) for k, v in setmaxnreg.items()},
        "utmaldg": tma_loads, "utmaldg_multicast": sum(n for form, n in tma_loads.items() if "MULTICAST" in form),
        "utmastg": total("UTMASTG"), "syncs": total("SYNCS"), "bar": total("BAR"),
    }


def sass_functions(text: str) -> list[str]:
    """Kernel names in the disassembly, in order, without repeats."""
    names = (a or b for a, b in _SASS_FUNCTION.findall(text))
    return list(dict.fromkeys(names))


def count_ptx(text: str) -> dict[str, int]:
    """wgmma instructions in the PTX modules of `text` (all, and the e4m3 ones) and setmaxnreg."""
    text = "".join(ptx_modules(text))
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", text)),
            "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async[^\n;]*e4m3", text)),
            "setmaxnreg": len(re.findall(r"setmaxnreg", text))}


_PTX_BLOCK = re.compile(r"(//\n// Generated by LLVM NVPTX Back-End.*?\n\}\n)", re.DOTALL)


def ptx_modules(text: str) -> list[str]:
    """The PTX modules in a dump that mixes PTX, ptxas reports and SASS (each module starts at
    LLVM's banner and ends at its last closing brace before whatever follows)."""
    out = []
    for block in re.split(r"(?=//\n// Generated by LLVM NVPTX Back-End)", text):
        if block.startswith("//\n// Generated by LLVM NVPTX Back-End"):
            end = block.rfind("\n}\n")
            out.append(block[: end + 3] if end >= 0 else block)
    return out


def summarize_dump(text: str) -> dict:
    """Everything the smoke stage reads off one kernel's compiler dump (stdout of gpu_smoke.py)."""
    ptxas = parse_ptxas(text)
    return {
        "ptxas_report": bool(ptxas["functions"]),
        "registers": ptxas["registers"],
        "spill_bytes": ptxas["spill_bytes"],
        "ptxas_warnings": ptxas["warnings"],
        "setmaxnreg_ignored": ptxas["setmaxnreg_ignored"],
        "wgmma_serialized": ptxas["wgmma_serialized"],
        "sass": count_sass(text) if _SASS_LINE.search(text) else None,
        "sass_functions": sass_functions(text),
        "ptx": count_ptx(text),
    }


def parse_sanitizer(text: str) -> dict:
    """compute-sanitizer's closing summary: {"errors": N} (memcheck and racecheck both print an
    ERROR SUMMARY) and, for racecheck, {"hazards": N}; missing keys when it printed none."""
    out = {}
    for key, pattern in (("errors", r"ERROR SUMMARY:\s*(\d+)"),
                         ("hazards", r"RACECHECK SUMMARY:\s*(\d+)")):
        found = re.findall(pattern, text)
        if found:
            out[key] = int(found[-1])
    # racecheck on the H100 (2026-11-28) printed no ERROR SUMMARY, only "RACECHECK SUMMARY: 0
    # hazards displayed (0 errors, 0 warnings)": its errors are in that line.
    found = re.findall(r"RACECHECK SUMMARY:\s*\d+ hazards? displayed \((\d+) errors?", text)
    if found and "errors" not in out:
        out["errors"] = int(found[-1])
    return out


# A report compute-sanitizer prints for one finding (memcheck's "Invalid __global__ read",
# racecheck's hazards, synccheck's "Barrier error"): the line that opens it. Racecheck's analysis
# reports read "Error: Race reported ...", its per-hazard ones "ERROR: Potential RAW hazard ...",
# at `--racecheck-detect-level info` some are "Info"/"INFO", and a race at a cluster's entry or
# exit "Potential invalid __shared__ read"; the closing "ERROR SUMMARY" is not one, nor are the
# tool's notes about itself (`_SANITIZER_STATUS`). One line each: the prefix never crosses a newline.
_SANITIZER_REPORT = re.compile(
    r"^=+[ \t]+(?:(?i:(?:error|warning|info)\b(?!\s+summary))|Invalid|Potential invalid|Program hit|Barrier error)\b.*",
    re.MULTILINE)
# What compute-sanitizer says about the run rather than the kernel: a process that did not end
# well, more mbarriers than it tracks (then it may miss or invent hazards).
_SANITIZER_STATUS = re.compile(r"process didn't terminate successfully|Detected overflow of tracked", re.IGNORECASE)
# A line that starts the next process's output in one stage's log: a form's section ends there.
_PROCESS_HEADER = re.compile(r"^(?:SANITIZER |SANITIZER_MUTANTS |RACECHECK_CONTROLS )", re.MULTILINE)
_SMOKE_START = re.compile(r"^SMOKE start (\S+)", re.MULTILINE)


def sanitizer_by_form(text: str) -> dict[str, dict]:
    """{form: {"reports": N, "first": the first report's line or None, "ok": its smoke verdict}}
    for a sanitizer run over several smoke forms in one process, each report charged to the form
    whose `SMOKE start` line came last before it (the forms run one after another)."""
    starts = list(_SMOKE_START.finditer(text))
    headers = [h.start() for h in _PROCESS_HEADER.finditer(text)]
    forms = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        end = min([end, *(h for h in headers if m.end() <= h < end)])  # nor past its process's output
        segment = text[m.end(): end]
        found = [r.group(0).strip() for r in _SANITIZER_REPORT.finditer(segment)]
        reports = [r for r in found if not _SANITIZER_STATUS.search(r)]
        result = next((line for line in segment.splitlines() if line.startswith("SMOKE result ")), None)
        ok = None
        if result is not None:
            try:
                ok = json.loads(result[len("SMOKE result "):]).get("ok")
            except ValueError:
                pass
        forms[m.group(1)] = {"reports": len(reports), "first": reports[0] if reports else None, "ok": ok,
                             "status": [r for r in found if _SANITIZER_STATUS.search(r)]}
    return forms


def last_process(text: str) -> str:
    """The part of a stage's log that the last `SANITIZER ` process wrote (the real kernels'; the
    racecheck stage runs its controls and planted races first): the whole text if none says so."""
    starts = [m.start() for m in re.finditer(r"^SANITIZER ", text, re.MULTILINE)]
    return text[starts[-1]:] if starts else text


# Forms that are racecheck's probes, racy on purpose or their twins, never a kernel it vouches for.
PROBE_PREFIXES = ("control_", "mutant_")


def racecheck_verdict(forms: dict[str, dict], mutant: str, twin: str) -> dict:
    """Whether racecheck saw the planted race (more reports on the mutant than on its clean twin),
    and, only then, whether the real kernels were clean."""
    m, t = forms.get(mutant), forms.get(twin)
    real = {k: v["reports"] for k, v in forms.items() if k not in (mutant, twin) and not k.startswith(PROBE_PREFIXES)}
    sees = bool(m and t and m["reports"] > t["reports"])
    if not sees:
        verdict = "racecheck did not flag the planted race: its silence on the kernels proves nothing"
    elif any(real.values()):
        verdict = f"racecheck sees (mutant {m['reports']}, twin {t['reports']}); reports on {sorted(k for k, v in real.items() if v)}"
    else:
        verdict = f"racecheck sees (mutant {m['reports']}, twin {t['reports']}); the kernels are clean"
    return {"mutant_flagged": sees, "kernels_clean": sees and not any(real.values()), "verdict": verdict}


def racecheck_blindness(forms: dict[str, dict]) -> dict:
    """Why racecheck saw or missed the planted race, from its probes (`sanitizer_by_form`'s forms):
    the plain-CUDA hazards of `hopper/racecheck_controls.cu` (`control_*`), each against its clean
    twin, and the three Mosaic mutants. Each finding is True / False, or None where its forms did
    not run or did not finish (a probe whose own result is not ok tells nothing); `reading` says
    what follows, from what did run."""
    def ran(name: str) -> dict | None:
        f = forms.get(name)
        return f if f is not None and f.get("ok") is True else None

    def flagged(racy: str, clean: str) -> bool | None:
        r, c = ran(racy), ran(clean)
        return None if r is None or c is None else r["reports"] > c["reports"]

    mosaic = [ran(k) for k in ("mutant_unsynchronized", "mutant_early_release", "mutant_clean_release")]
    clean_twin = ran("control_clean_release")
    out = {"plain_race_seen": flagged("control_unsynced", "control_synced"),
           "mbarrier_race_seen": flagged("control_early_release", "control_clean_release"),
           "mbarrier_twin_flagged": None if clean_twin is None else clean_twin["reports"] > 0,
           # any report on a Mosaic probe shows that racecheck instruments Mosaic kernels
           "mosaic_instrumented": None if all(f is None for f in mosaic) else any(f and f["reports"] for f in mosaic),
           "mosaic_mutant_seen": flagged("mutant_early_release", "mutant_clean_release")}
    p, b, twin, i, m = (out[k] for k in ("plain_race_seen", "mbarrier_race_seen", "mbarrier_twin_flagged",
                                         "mosaic_instrumented", "mosaic_mutant_seen"))
    if p is False and (i or m):
        reading = ("racecheck flagged the Mosaic probes but not the plain-CUDA race with no barrier: a "
                   "contradiction; read the controls' output before trusting either")
    elif p is False:
        reading = ("racecheck flagged not even a shared-memory race with no barrier in plain CUDA: it is blind "
                   "on this machine (tool, driver or options), and nothing it says about any kernel counts")
    elif m:
        reading = "racecheck sees the planted Mosaic race: its verdict on the kernels counts" + (
            "; but it also flags the clean mbarrier pipeline in plain CUDA (false alarms possible)" if twin else "")
    elif i is False:
        reading = ("racecheck reported nothing on any Mosaic probe, the race with no barrier included: it does "
                   "not instrument Mosaic GPU's kernels, and its silence on jfp8's kernels means nothing" + (
                       "" if p else " (the plain-CUDA controls did not run: it may be blind altogether)"))
    elif twin:
        reading = ("racecheck flags the clean mbarrier pipeline in plain CUDA: it does not count mbarrier phases "
                   "as synchronization, so its reports on mbarrier-ordered kernels are not findings")
    elif b is False:
        reading = ("racecheck " + ("sees a race with no barrier in plain CUDA but " if p else "") +
                   "misses a stage released early between mbarrier phases in plain CUDA: it cannot judge the "
                   "lean release, whose question is exactly that; the interpreter's race detector stays the check")
    elif b and m is False:
        reading = ("racecheck sees the mbarrier race in plain CUDA but not in the Mosaic mutant: read the two "
                   "reports side by side before trusting its silence on the kernels")
    else:
        ran_names = sorted(k for k in forms if k.startswith(PROBE_PREFIXES) and ran(k))
        reading = ("too few probes ran to tell why racecheck is silent" +
                   (f" (ran: {', '.join(ran_names)})" if ran_names else " (none ran)"))
    return {**out, "reading": reading}


# The first line that names a CUDA failure, as the driver, the runtime, XLA or jax print it.
_CUDA_ERROR = re.compile(r".*(CUDA_ERROR_\w+|cuda(?:Error)?\w*: |an illegal (?:memory access|instruction)|"
                         r"misaligned address|unspecified launch failure|Xid\b).*")


def first_cuda_error(text: str) -> str | None:
    """The first line of `text` that reports a CUDA error, stripped and cut to 300 characters."""
    m = _CUDA_ERROR.search(text)
    return m.group(0).strip()[:300] if m else None


def parse_junit(xml_text: str) -> dict:
    """pytest's JUnit XML: {"tests", "failures", "errors", "skipped", "failed": [test ids]}."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{case.get('classname')}::{case.get('name')}"
                     for s in suites for case in s.iter("testcase")
                     if case.find("failure") is not None or case.find("error") is not None]
    return out


def parse_ncu_csv(text: str) -> list[dict]:
    """Nsight Compute `--csv --page details` output: one dict per kernel launch with its
    "Kernel Name" and {metric name (unit): value}. Lines before the CSV header (ncu's own
    ==PROF== messages, the program's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") is None:
            continue
        launch = launches.setdefault(row["ID"], {"kernel": row.get("Kernel Name"), "metrics": {}})
        unit = row.get("Metric Unit") or ""
        name = f"{row['Metric Name']} ({unit})" if unit else row["Metric Name"]
        value = row.get("Metric Value", "").replace(",", "")
        try:
            launch["metrics"][name] = float(value)
        except ValueError:
            launch["metrics"][name] = value
    return list(launches.values())


def summarize_profile(trace: dict) -> dict:
    """A Mosaic GPU profiler trace (jax's mosaic/gpu/profiler.py: Perfetto JSON, "traceEvents"
    with "B"/"E" pairs per named region, `ts` in microseconds, one `tid` per warpgroup of each
    CTA) -> {region: {"total_us", "count", "warpgroups", "per_warpgroup_us"}}: e.g. how long
    each warpgroup spent in the main loop's `wgmma` and `promote` regions."""
    open_at: dict[tuple, list[float]] = {}
    totals: dict[str, dict] = {}
    tids: dict[str, set] = {}
    for ev in trace.get("traceEvents", []):
        key = (ev.get("pid"), ev.get("tid"), ev.get("name"))
        if ev.get("ph") == "B":
            open_at.setdefault(key, []).append(float(ev["ts"]))
        elif ev.get("ph") == "E" and open_at.get(key):
            t = totals.setdefault(ev["name"], {"total_us": 0.0, "count": 0})
            t["total_us"] += float(ev["ts"]) - open_at[key].pop()
            t["count"] += 1
            tids.setdefault(ev["name"], set()).add((ev.get("pid"), ev.get("tid")))
    for name, t in totals.items():
        t["warpgroups"] = len(tids[name])
        t["per_warpgroup_us"] = t["total_us"] / t["warpgroups"]
    return totals


def compare_to_deviceless(row: dict, committed: dict | None) -> dict:
    """A smoke row's compiler facts (`summarize_dump`) against the committed deviceless build's
    row of the same form (benchmarks/results/hopper-build/kernels-<target>.json): registers, spill
    bytes and QGMMA instructions. {"same": bool | None, "differences": [...], "ptxas": the
    build's ptxas}. A difference means this machine's ptxas (or jaxlib's LLVM) compiled the kernel
    otherwise than the deviceless build's did (the smoke shapes are smaller, but the forms' configs
    are fixed, so the code should be too): worth reading before trusting a timing."""
    if committed is None or not committed.get("ok"):
        return {"same": None, "differences": ["no deviceless row for this form"]}
    if row.get("registers") is None:
        return {"same": None, "differences": ["no ptxas report from this run"]}
    sass = row.get("sass") or {}
    here = {"registers": row.get("registers"), "spill bytes": row.get("spill_bytes"), "QGMMA": sass.get("QGMMA")}
    there = {"registers": committed.get("registers"),
             "spill bytes": (committed.get("spill_stores") or 0) + (committed.get("spill_loads") or 0),
             "QGMMA": sum((committed.get("sass") or {}).get("qgmma", {}).values())}
    diffs = [f"{k}: {here[k]} here, {there[k]} deviceless" for k in here
             if here[k] is not None and here[k] != there[k]]
    return {"same": not diffs, "differences": diffs, "ptxas": committed.get("ptxas_version")}

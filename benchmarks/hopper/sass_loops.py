"""What a Hopper FP8 GEMM's main loop spends per 128-K block, read from its SASS.

`mainloop_census(sass_text)` finds the innermost loop(s) whose body issues QGMMA and counts, per
loop iteration and per 128 K: QGMMA by shape, FFMA / FMUL / FADD (the promotion), loads by kind and
width (scale loads: LDS / LDG / LD / LDSM / LDC), SYNCS (mbarrier) and BAR forms, WARPGROUP
(wgmma arrive / wait), MEMBAR and FENCE, and all instructions. Input: nvdisasm text (`.L_x_N:`
labels, "BRA `(.L_x_N)"), with or without control-code prefixes, or cuobjdump text (branch
targets as addresses).

How loops are found: basic blocks from labels and branches, dominators over the control-flow
graph, a loop per back edge u -> h with h dominating u (the natural loop: h plus every block that
reaches u without passing h), back edges to one header merged. A plain "backward BRA" is not
enough: the out-of-line retry stubs of mbarrier waits jump back into the middle of the main loop
from after it, which looks like a backward branch but is not a loop of its own. Such stubs belong
to the loop's body but lie outside its address range [header, last back edge]; they are counted
apart ("outlined") since they only run when a wait has to retry. Everything is a static count:
each instruction once, whatever its predicate; a nested loop without QGMMA (a retry spin) once.

K per iteration (k_per_iteration), the derivation: an e4m3 QGMMA is 64 x N x 32 (the shape's last
number, 32 for FP8). Each QGMMA reads an accumulator and writes it; a chain of QGMMAs into one
accumulator register that begins with a zero-initialising one (C operand RZ or the !UPT
scale-d predicate: wgmma with scale-d = 0) is one accumulation of chain-length x 32 K, and a
promotion kernel (DeepGEMM's 1D2D, CUTLASS's blockwise, ours) starts one such chain per scale
block: chain depth = 128 K. One iteration then covers (chains per iteration / accumulator tiles
per K block) x depth of K. The number of tiles a warpgroup computes per K block (m_waves:
DeepGEMM's BLOCK_M=256 runs two 64-row waves through the same registers) is taken from
`m_waves=` when given, else from the in-line mbarrier phase waits (one SYNCS.PHASECHK per stage,
i.e. per K block, so tiles = chains / waits when that divides), else the distinct destination
registers. Without zero-initialising QGMMAs (accumulators carried across iterations) each
accumulator advances 32 K per QGMMA: K per iteration = 32 x QGMMAs / distinct accumulators.
`per_k128` divides the counts by k_per_iteration / 128: what each warp of a consumer warpgroup
issues per 128-K block (the body is per-thread code; every consumer warpgroup runs it).
`per_64x128x128` divides that again by the warpgroup's MMA tile per K block in units of 64 x 128
(m_waves x QGMMA N / 128), so tiles of different N compare per FLOP.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter

_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):\s*$")
_INSN = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(@!?U?P(?:T|\d+)\s+)?([A-Z][A-Za-z0-9_.]*)([^;\n]*)")
_TARGET_LABEL = re.compile(r"`\((\.L_\w+)\)")
_TARGET_ADDR = re.compile(r"^\s*(?:0x)?([0-9a-fA-F]+)\b")
_QGMMA_SHAPE = re.compile(r"^[QH]GMMA\.(\d+)x(\d+)x(\d+)")

LOAD_OPS = ("LDS", "LDG", "LD", "LDSM", "LDC", "ULDC", "LDL")


def parse_instructions(text: str) -> tuple[list[dict], dict[str, int]]:
    """[{addr, pred, op, operands}] in order, and label -> index of the instruction it names."""
    insns: list[dict] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
            continue
        if m := _INSN.search(line):
            for name in pending:
                labels[name] = len(insns)
            pending = []
            pred = (m.group(2) or "").strip()
            insns.append({"addr": int(m.group(1), 16), "pred": pred, "op": m.group(3),
                          "operands": m.group(4).strip().rstrip(";").strip()})
    for name in pending:
        labels[name] = len(insns)
    return insns, labels


def _base(op: str) -> str:
    return op.split(".", 1)[0]


def _always(pred: str) -> bool:
    return pred in ("", "@PT", "@UPT")


def _branch_target(insn: dict, labels: dict[str, int], by_addr: dict[int, int]) -> int | None:
    if m := _TARGET_LABEL.search(insn["operands"]):
        return labels.get(m.group(1))
    if m := _TARGET_ADDR.match(insn["operands"]):
        return by_addr.get(int(m.group(1), 16))
    return None


def control_flow(insns: list[dict], labels: dict[str, int]):
    """Basic blocks as (start, end) index ranges [start, end) and their successors."""
    by_addr = {ins["addr"]: i for i, ins in enumerate(insns)}
    n = len(insns)
    leaders = {0} | {i for i in labels.values() if i < n}
    targets: dict[int, int | None] = {}
    for i, ins in enumerate(insns):
        b = _base(ins["op"])
        if b in ("BRA", "JMP", "BRX", "JMX", "EXIT", "RET", "KILL"):
            if i + 1 < n:
                leaders.add(i + 1)
            if b in ("BRA", "JMP"):
                t = _branch_target(ins, labels, by_addr)
                targets[i] = t
                if t is not None:
                    leaders.add(t)
    starts = sorted(leaders)
    blocks = [(s, starts[k + 1] if k + 1 < len(starts) else n) for k, s in enumerate(starts)]
    block_of = {}
    for k, (s, e) in enumerate(blocks):
        for i in range(s, e):
            block_of[i] = k
    succ: list[list[int]] = []
    for k, (s, e) in enumerate(blocks):
        last = insns[e - 1]
        b = _base(last["op"])
        out = []
        falls = True
        if b in ("BRA", "JMP"):
            t = targets.get(e - 1)
            if t is not None and t < n:
                out.append(block_of[t])
            falls = not _always(last["pred"])
        elif b in ("EXIT", "RET", "KILL", "BRX", "JMX"):
            falls = not _always(last["pred"])
        if falls and e < n:
            out.append(block_of[e])
        succ.append(list(dict.fromkeys(out)))
    return blocks, succ


def dominators(succ: list[list[int]]) -> list[int | None]:
    """Immediate dominators (Cooper, Harvey, Kennedy) from block 0; None if unreachable."""
    n = len(succ)
    order, seen, stack = [], [False] * n, [(0, iter(succ[0]))] if n else []
    if n:
        seen[0] = True
    while stack:
        node, it = stack[-1]
        for s in it:
            if not seen[s]:
                seen[s] = True
                stack.append((s, iter(succ[s])))
                break
        else:
            order.append(node)
            stack.pop()
    rpo = order[::-1]
    index = {b: i for i, b in enumerate(rpo)}
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, outs in enumerate(succ):
        for v in outs:
            preds[v].append(u)
    idom: list[int | None] = [None] * n
    if not n:
        return idom
    idom[0] = 0

    def intersect(a, b):
        while a != b:
            while index[a] > index[b]:
                a = idom[a]
            while index[b] > index[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            done = [p for p in preds[b] if idom[p] is not None and p in index]
            if not done:
                continue
            new = done[0]
            for p in done[1:]:
                new = intersect(p, new)
            if idom[b] != new:
                idom[b] = new
                changed = True
    return idom


def _dominates(idom, a: int, b: int) -> bool:
    while True:
        if a == b:
            return True
        if idom[b] is None or idom[b] == b:
            return False
        b = idom[b]


def natural_loops(succ, idom) -> dict[int, set[int]]:
    """Header block -> body blocks, back edges to one header merged."""
    preds: list[list[int]] = [[] for _ in succ]
    for u, outs in enumerate(succ):
        for v in outs:
            preds[v].append(u)
    loops: dict[int, set[int]] = {}
    for u, outs in enumerate(succ):
        if idom[u] is None:
            continue
        for h in outs:
            if _dominates(idom, h, u):
                body = loops.setdefault(h, {h})
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in body:
                        body.add(x)
                        stack.extend(preds[x])
    return loops


def _width(op: str) -> str:
    mods = op.split(".")[1:]
    for m in mods:
        if m in ("64", "128", "U8", "S8", "U16", "S16", "8", "16"):
            return {"8": "U8", "16": "U16"}.get(m, m)
    if op.startswith("LDSM"):
        return ".".join(mods)
    return "32"


def count_body(insns: list[dict]) -> dict:
    ops = Counter(ins["op"] for ins in insns)

    def total(base):
        return sum(n for op, n in ops.items() if _base(op) == base)

    def forms(base):
        return {op[len(base) + 1:] or base: n for op, n in sorted(ops.items()) if _base(op) == base}

    loads: dict[str, dict[str, int]] = {}
    for ins in insns:
        b = _base(ins["op"])
        if b in LOAD_OPS:
            w = _width(ins["op"])
            loads.setdefault(b, {})
            loads[b][w] = loads[b].get(w, 0) + 1
    qgmma = {}
    for op, n in sorted(ops.items()):
        if _base(op) in ("QGMMA", "HGMMA"):
            qgmma[op.split(".", 1)[1]] = n
    return {
        "instructions": len(insns),
        "qgmma": qgmma, "qgmma_total": sum(qgmma.values()),
        "ffma": total("FFMA"), "fmul": total("FMUL"), "fadd": total("FADD"),
        "loads": loads, "loads_total": sum(sum(v.values()) for v in loads.values()),
        "syncs": forms("SYNCS"), "syncs_total": total("SYNCS"),
        "bar": forms("BAR"), "bar_total": total("BAR"),
        "warpgroup": forms("WARPGROUP"), "warpgroup_total": total("WARPGROUP"),
        "fences": {**{f"MEMBAR.{k}": v for k, v in forms("MEMBAR").items()},
                   **{f"FENCE.{k}": v for k, v in forms("FENCE").items()}},
        "fences_total": total("MEMBAR") + total("FENCE"),
        "ldl_stl": total("LDL") + total("STL"),
    }


def _scale(d, f: float):
    if isinstance(d, dict):
        return {k: _scale(v, f) for k, v in d.items()}
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return round(d * f, 3)
    return d


def _chains(qg: list[dict]) -> dict:
    """Zero-initialised QGMMA chains per destination register, in program order."""
    chains: list[int] = []
    open_chain: dict[str, int] = {}
    carried = Counter()
    dests = []
    for ins in qg:
        parts = [p.strip() for p in ins["operands"].split(",")]
        dest = parts[0]
        dests.append(dest)
        zero = "RZ" in parts[1:] or "!UPT" in parts[1:]
        if zero:
            chains.append(1)
            open_chain[dest] = len(chains) - 1
        elif dest in open_chain:
            chains[open_chain[dest]] += 1
        else:
            carried[dest] += 1
    return {"lengths": chains, "carried": dict(carried), "destinations": sorted(set(dests))}


def _fewest_path(h, body, blocks, succ, start, latch_end) -> list[int] | None:
    """The in-line body blocks (within [start, latch_end)) of the cycle through header `h` with
    the fewest instructions (Dijkstra, a block weighing its instruction count), as a list."""
    inline = {b for b in body if start <= blocks[b][0] < latch_end}
    size = {b: blocks[b][1] - blocks[b][0] for b in inline}
    best, prev = {h: size[h]}, {}
    heap = [(size[h], h)]
    done = set()
    end, end_cost = None, None
    while heap:
        cost, u = heapq.heappop(heap)
        if u in done:
            continue
        done.add(u)
        if h in succ[u] and (end_cost is None or cost < end_cost):
            end, end_cost = u, cost
        for v in succ[u]:
            if v in inline and v != h and cost + size[v] < best.get(v, float("inf")):
                best[v], prev[v] = cost + size[v], u
                heapq.heappush(heap, (best[v], v))
    if end is None:
        return None
    path = [end]
    while path[-1] != h:
        path.append(prev[path[-1]])
    return path[::-1]


def mainloop_census(sass_text: str, m_waves: int | None = None) -> dict:
    """Innermost QGMMA loops of one kernel's SASS, counted per iteration and per 128 K.

    Returns {"loops": [per loop: header label/address, latch address, counts per iteration
    ("per_iteration"), "outlined" (out-of-line body blocks), QGMMA chains, k_per_iteration,
    m_waves, "per_k128", "per_64x128x128"], "main": the loop with the most QGMMA (the steady
    state; DeepGEMM's unrolled copy), "num_loops"}. m_waves: accumulator tiles per warpgroup
    per K block when the caller knows them (see the module's derivation)."""
    insns, labels = parse_instructions(sass_text)
    if not insns:
        return {"loops": [], "main": None, "num_loops": 0}
    blocks, succ = control_flow(insns, labels)
    idom = dominators(succ)
    loops = natural_loops(succ, idom)
    name_of = {}
    for name, i in labels.items():
        name_of.setdefault(i, name)

    def has_q(body):
        return any(_base(insns[i]["op"]) == "QGMMA" for b in body for i in range(*blocks[b]))

    q_loops = {h: body for h, body in loops.items() if has_q(body)}
    innermost = {h: body for h, body in q_loops.items()
                 if not any(o != h and o in body and ob < body for o, ob in q_loops.items())}
    out = []
    for h, body in sorted(innermost.items(), key=lambda kv: blocks[kv[0]][0]):
        start = blocks[h][0]
        latch_end = max(blocks[b][1] for b in body if h in succ[b] and _dominates(idom, h, b))
        main_idx = [i for b in sorted(body) for i in range(*blocks[b]) if start <= i < latch_end]
        outl_idx = [i for b in sorted(body) for i in range(*blocks[b]) if not start <= i < latch_end]
        main_insns = [insns[i] for i in sorted(main_idx)]
        per_it = count_body(main_insns)
        qg = [ins for ins in main_insns if _base(ins["op"]) in ("QGMMA", "HGMMA")]
        shapes = [tuple(int(x) for x in m.groups()) for ins in qg if (m := _QGMMA_SHAPE.match(ins["op"]))]
        k_insn = shapes[0][2] if shapes else 32
        n_insn = max((s[1] for s in shapes), default=0)
        ch = _chains(qg)
        waits = sum(1 for ins in main_insns if ins["op"].startswith("SYNCS.PHASECHK"))
        how = ""
        if ch["lengths"]:
            depth = Counter(ch["lengths"]).most_common(1)[0][0] * k_insn
            n_chains = len(ch["lengths"])
            if m_waves:
                waves, how = m_waves, "m_waves given"
            elif waits and n_chains % waits == 0:
                waves, how = n_chains // waits, "chains per in-line mbarrier wait"
            else:
                waves, how = len(ch["destinations"]), "distinct accumulator registers"
            k_it = depth * n_chains / waves
        else:
            depth = None
            waves = m_waves or max(len(ch["destinations"]), 1)
            how = "carried accumulators: 32 K per QGMMA per accumulator"
            k_it = k_insn * len(qg) / waves
        f = 128 / k_it if k_it else 0
        per_k128 = _scale(per_it, f)
        path = _fewest_path(h, body, blocks, succ, start, latch_end)
        path_insns = [insns[i] for b in path for i in range(*blocks[b])] if path else []
        path_counts = count_body(path_insns) if path else None
        if path_counts and path_counts["qgmma_total"] != per_it["qgmma_total"]:
            path_counts = None  # a path around a QGMMA is not an iteration's work
        tile_units = waves * n_insn / 128 if n_insn else 0
        out.append({
            "header": name_of.get(start, hex(insns[start]["addr"])),
            "header_addr": hex(insns[start]["addr"]), "latch_addr": hex(insns[latch_end - 1]["addr"]),
            "per_iteration": per_it,
            "outlined": count_body([insns[i] for i in sorted(outl_idx)]),
            "chains": {"lengths": ch["lengths"], "carried": ch["carried"], "accumulators": ch["destinations"],
                       "depth_k": depth},
            "inline_mbarrier_waits": waits,
            "m_waves": waves, "m_waves_from": how,
            "qgmma_k": k_insn, "qgmma_n": n_insn,
            "k_per_iteration": k_it,
            "per_k128": per_k128,
            "per_64x128x128": _scale(per_k128, 1 / tile_units) if tile_units else None,
            # The fewest instructions one iteration can issue: the shortest way around the loop
            # through the same QGMMAs, skipping the blocks a branch jumps over (e.g. work done on
            # a group's first and last K block only); None when no such path exists.
            "fewest_path_per_k128": _scale(path_counts, f) if path_counts else None,
        })
    main = max(out, key=lambda l: (l["per_iteration"]["qgmma_total"], l["k_per_iteration"]), default=None)
    return {"loops": out, "main": main, "num_loops": len(out)}

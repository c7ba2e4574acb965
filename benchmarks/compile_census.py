"""Every XLA compile a command runs, counted and charged to what ran it (issue #44, CI's time).

    python benchmarks/compile_census.py -- bash scripts/test.sh            # the suite: per test
    python benchmarks/compile_census.py --log /tmp/c.jsonl -- python experiments/train_moe.py --preset tiny
    python benchmarks/compile_census.py --summarize /tmp/c.jsonl --top 40  # read a log again

The command runs with a `sitecustomize` of this script's on `PYTHONPATH` (in a temporary folder),
so every Python process it starts, subprocesses and notebook kernels included, wraps jax's
`compiler.compile_or_get_cached` and appends one JSON line per compile to the log: the pytest test
running (`PYTEST_CURRENT_TEST`, which subprocesses inherit), the process, the program's name,
the wall seconds of the call (an XLA compile, or a load from jax's persistent cache), whether the
persistent cache had it, and the end of its cache key. The command's own output is left alone; the
summary follows it: the seconds by size of compile (jax's persistent cache keeps only those
over its minimum, 0.2 s in jfp8's scripts and tests), by test or process, by program, and the
programs compiled again with the same key (work a cache could have saved).

The seconds are wall time inside the call, measured beside whatever else ran (a suite's other
worker): a census of where compiles are, not a benchmark. Another `sitecustomize` on the path is
shadowed while the command runs (this script says so).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile

LOG_ENV = "JFP8_COMPILE_CENSUS_LOG"
BUCKETS = ((0.0, 0.2), (0.2, 1.0), (1.0, 3.0), (3.0, float("inf")))

# Written as sitecustomize.py into a temporary folder put first on PYTHONPATH. It patches jax's
# compiler module as it is imported (an import hook: importing jax here would read jax's
# environment before the command sets it).
SITECUSTOMIZE = '''
import os, sys
if os.environ.get("%(env)s"):
    import importlib.abc, importlib.util, json, time

    def _patch(compiler):
        inner, seen = compiler.compile_or_get_cached, {}
        hit0, miss0 = compiler.log_persistent_cache_hit, compiler.log_persistent_cache_miss

        def hit(name, key):
            seen.update(hit=True, key=key)
            return hit0(name, key)

        def miss(name, key):
            seen.update(hit=False, key=key)
            return miss0(name, key)

        def census(backend, computation, *args, **kwargs):
            seen.clear()
            t0 = time.perf_counter()
            out = inner(backend, computation, *args, **kwargs)
            seconds = time.perf_counter() - t0
            try:
                name = str(computation.operation.attributes["sym_name"]).strip('"')
            except Exception:  # noqa: BLE001 - a name is a label, not worth failing a compile
                name = "?"
            row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                   "process": " ".join(sys.argv[:2])[-160:], "pid": os.getpid(), "name": name,
                   "s": round(seconds, 4), "hit": seen.get("hit"), "key": (seen.get("key") or "")[-16:]}
            with open(os.environ["%(env)s"], "a") as f:
                f.write(json.dumps(row) + "\\n")
            return out

        compiler.log_persistent_cache_hit, compiler.log_persistent_cache_miss = hit, miss
        compiler.compile_or_get_cached = census

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "jax._src.compiler":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
''' % {"env": LOG_ENV}


def read(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def owner(row: dict) -> str:
    """What a compile is charged to: its test, else its process's command line."""
    return row.get("test") or f"(process) {row.get('process', '?')}"


def summarize(rows: list[dict], top: int = 25) -> dict:
    """The census as numbers: totals, size buckets, the top owners and programs, and the seconds
    spent compiling a key already compiled (in another process, or under the cache's minimum)."""
    total = sum(r["s"] for r in rows)
    buckets = []
    for lo, hi in BUCKETS:
        sel = [r for r in rows if lo <= r["s"] < hi]
        buckets.append({"from_s": lo, "to_s": hi, "compiles": len(sel), "seconds": round(sum(r["s"] for r in sel), 1)})
    by_owner: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, set()])
    again: dict[str, list] = collections.defaultdict(list)
    for r in rows:
        o = by_owner[owner(r)]
        o[0] += 1
        o[1] += r["s"]
        if r["s"] >= 0.2:
            o[2] += r["s"]
        if r.get("hit"):
            continue
        n = by_name[r["name"]]
        n[0] += 1
        n[1] += r["s"]
        n[2].add(r["key"])
        if r["key"]:
            again[r["key"]].append(r)
    repeated = sorted((rs for rs in again.values() if len(rs) > 1), key=lambda rs: -sum(r["s"] for r in rs[1:]))
    return {
        "compiles": len(rows), "seconds": round(total, 1), "processes": len({r["pid"] for r in rows}),
        "cache_hits": sum(1 for r in rows if r.get("hit")), "buckets": buckets,
        "owners": [{"owner": k, "compiles": v[0], "seconds": round(v[1], 1), "seconds_over_0.2": round(v[2], 1)}
                   for k, v in sorted(by_owner.items(), key=lambda kv: -kv[1][1])[:top]],
        "programs": [{"name": k, "compiles": v[0], "keys": len(v[2]), "seconds": round(v[1], 1)}
                     for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
        "compiled_again": {
            "keys": len(repeated), "seconds": round(sum(r["s"] for rs in repeated for r in rs[1:]), 1),
            "top": [{"name": rs[0]["name"], "times": len(rs), "seconds_again": round(sum(r["s"] for r in rs[1:]), 3),
                     "owners": sorted({owner(r) for r in rs})[:4]} for rs in repeated[:top]]},
    }


def report(s: dict) -> str:
    lines = [f"{s['compiles']} compiles in {s['processes']} processes, {s['seconds']} s "
             f"({s['cache_hits']} loaded from jax's persistent cache)", "", "| compile s | compiles | seconds |",
             "|---|---|---|"]
    lines += [f"| {b['from_s']}–{b['to_s']} | {b['compiles']} | {b['seconds']} |" for b in s["buckets"]]
    lines += ["", "| seconds | of which ≥ 0.2 s | compiles | test or process |", "|---|---|---|---|"]
    lines += [f"| {o['seconds']} | {o['seconds_over_0.2']} | {o['compiles']} | {o['owner']} |" for o in s["owners"]]
    lines += ["", "| seconds | compiles | distinct keys | program |", "|---|---|---|---|"]
    lines += [f"| {p['seconds']} | {p['compiles']} | {p['keys']} | {p['name']} |" for p in s["programs"]]
    again = s["compiled_again"]
    lines += ["", f"compiled again with a key already compiled: {again['keys']} keys, {again['seconds']} s"]
    lines += [f"  {a['seconds_again']:7.1f} s  {a['name']} x{a['times']}: {'; '.join(a['owners'])}"
              for a in again["top"]]
    return "\n".join(lines)


def run(command: list[str], log: pathlib.Path) -> int:
    """`command` with the census's sitecustomize first on PYTHONPATH, logging to `log`."""
    with tempfile.TemporaryDirectory(prefix="jfp8-census-") as site:
        (pathlib.Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ, **{LOG_ENV: str(log)})
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
        try:
            import sitecustomize  # noqa: F401 - only to say that the command's one is shadowed
            print(f"compile_census: {sitecustomize.__file__} is shadowed while the command runs", file=sys.stderr)
        except ImportError:
            pass
        return subprocess.call(command, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", type=pathlib.Path, help="the JSON-lines log (default: a new file in the temp folder)")
    p.add_argument("--summarize", type=pathlib.Path, help="only summarize this log (no command)")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--json", type=pathlib.Path, help="also write the summary here")
    args = p.parse_args(own)
    if args.summarize and command:
        p.error("give a command after -- or --summarize LOG, not both")
    if not args.summarize and not command:
        p.error("give the command to census after --, e.g. -- bash scripts/test.sh")
    rc = 0
    if args.summarize:
        log = args.summarize
        if not log.exists():
            p.error(f"{log} does not exist: pass a log a census wrote (--log)")
    else:
        log = args.log or pathlib.Path(tempfile.mkstemp(prefix="compile-census-", suffix=".jsonl")[1])
        log.write_text("")
        rc = run(command, log)
        print(f"\ncompile_census: the command exited {rc}; its compiles are in {log}")
    summary = summarize(read(log), args.top)
    print(report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())

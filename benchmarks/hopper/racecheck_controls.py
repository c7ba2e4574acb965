"""Plain-CUDA positive controls for compute-sanitizer's racecheck (issue 42, item 3).

    # on a machine with nvcc 12 or later (no GPU needed): an x86-64 executable, CUDA runtime linked statically
    python benchmarks/hopper/racecheck_controls.py --build
    python benchmarks/hopper/racecheck_controls.py --check        # on the GPU machine: device and driver

`racecheck_controls.cu` holds four one-block kernels (its header says what each tells): a
shared-memory hazard with no barrier (`unsynced`) and its twin with `__syncthreads` (`synced`),
and the Mosaic mutant's pipeline written in CUDA with mbarriers, released before the read
(`early_release`) and after it (`clean_release`). The GPU session's racecheck stage runs each
under racecheck in a process of its own before jfp8's kernels (`gpu_session.worker_sanitizer`), so
that a silent racecheck can be told apart: blind on this machine, blind to mbarrier ordering, or
blind to Mosaic GPU's kernels (`gpu_reports.racecheck_blindness`). Built with CUDA 13's nvcc, the
binary needs a driver of the R580 series or later (the H100 of 2026-11-28 had 580.159).

The binary lands in `benchmarks/hopper/bin/` (ignored by git, like DeepGEMM's harness): the
session carries it to the GPU machine (run's carry: ["benchmarks/hopper/bin"]).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import anchors  # noqa: E402  (the Hopper build's tool lookup: CUDA_HOME, the toolchain, PATH)
SOURCE = HERE / "racecheck_controls.cu"
BINARY = HERE / "bin" / "racecheck_controls"
# (kernel, racy): the racy ones must be flagged, their twins must not.
KERNELS = (("unsynced", True), ("synced", False), ("early_release", True), ("clean_release", False))
FLAGS = ("-O2", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a", "-cudart", "static")
LINE = "RACECHECK_CONTROL "


def build(out: pathlib.Path = BINARY, nvcc: str | None = None, timeout: int = 300) -> dict:
    """Compile the controls into `out`; returns the command and nvcc's version, also written next
    to the binary as JSON."""
    nvcc = anchors.find_tool("nvcc", nvcc)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, str(SOURCE), "-o", str(out), *FLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise SystemExit(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
    info = {"binary": str(out), "command": shlex.join(cmd), "nvcc": anchors.tool_version(nvcc)}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def parse(text: str) -> dict | None:
    """The last `RACECHECK_CONTROL {...}` line of a run's output, or None."""
    found = None
    for line in text.splitlines():
        if line.startswith(LINE):
            try:
                found = json.loads(line[len(LINE):])
            except ValueError:
                pass
    return found


def check(binary: pathlib.Path = BINARY, timeout: float = 60) -> dict:
    """The program's `--check`: {"ok": True, device, sm, driver, runtime} or {"ok": False, "error"}."""
    if not binary.is_file():
        return {"ok": False, "error": f"no controls at {binary}: build them with benchmarks/hopper/racecheck_controls.py --build"}
    r = subprocess.run([str(binary), "--check"], capture_output=True, text=True, timeout=timeout)
    return parse(r.stdout) or {"ok": False, "error": f"exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true", help="compile the controls (needs nvcc, no GPU)")
    p.add_argument("--check", action="store_true", help="run the binary's device check (needs the GPU)")
    p.add_argument("--nvcc", help="nvcc to use (default: $CUDA_HOME/bin, the Hopper toolchain, PATH)")
    p.add_argument("--out", type=pathlib.Path, default=BINARY)
    args = p.parse_args(argv)
    if not (args.build or args.check):
        p.error("say --build or --check")
    if args.build:
        print(json.dumps(build(args.out, args.nvcc), indent=1))
    if args.check:
        result = check(args.out)
        print(json.dumps(result, indent=1))
        return 0 if result.get("ok") else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

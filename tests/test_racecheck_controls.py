"""racecheck's plain-CUDA controls (benchmarks/hopper/racecheck_controls.{cu,py}) on the CPU: the
program builds for sm_90a, says plainly that it has no GPU here, and its kernels keep the order of
accesses and barriers each control is about (read off the SASS: a control whose race the compiler
had removed, or whose clean twin it had made racy, would prove nothing on the GPU)."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "hopper"))
import racecheck_controls as rc  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    try:
        nvcc = rc.anchors.find_tool("nvcc")
    except SystemExit as e:
        pytest.skip(f"needs nvcc to build the controls: {e}")
    out = tmp_path_factory.mktemp("controls") / "racecheck_controls"
    info = rc.build(out, nvcc)
    return out, info, nvcc


def _sass(binary: pathlib.Path, toolchain: pathlib.Path) -> dict[str, list[str]]:
    """{kernel name: its SASS opcodes in order}, by the Hopper toolchain's cuobjdump."""
    cuobjdump = next(iter(sorted(pathlib.Path(toolchain).glob("nvidia/*/bin/cuobjdump"))), None)
    assert cuobjdump is not None, f"the toolchain at {toolchain} has no cuobjdump"
    text = subprocess.run([str(cuobjdump), "-sass", str(binary)], check=True, capture_output=True,
                          text=True, timeout=120).stdout
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m and current is not None:
            current.append(((m.group(1) or "").strip(), m.group(2)))
    return kernels


def test_the_controls_build_and_say_they_need_a_gpu(built):
    binary, info, _ = built
    assert binary.is_file() and "sm_90a" in info["command"] and "-cudart static" in info["command"]
    assert (binary.with_suffix(".json")).is_file()
    r = subprocess.run([str(binary), "--check"], capture_output=True, text=True, timeout=60)
    found = rc.parse(r.stdout)
    if found and found.get("ok"):
        pytest.skip("a Hopper GPU is here: the no-GPU answer cannot be checked")
    assert r.returncode == 1 and found == rc.check(binary) and not found["ok"] and found["error"]
    r = subprocess.run([str(binary), "synced"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and rc.parse(r.stdout)["kernel"] == "synced"
    r = subprocess.run([str(binary), "nonsense"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown kernel" in r.stderr
    assert rc.check(binary.parent / "absent")["error"].endswith("--build")


def test_the_kernels_keep_the_orders_the_controls_are_about(built, toolchain):
    """The barrier-free kernel stores, then loads another warp's element, a BAR.SYNC between them
    only on its synced path; the pipeline's consumer arrives before its shared load on one path
    and after it on the other (the mutant and its twin share one kernel, a branch apart)."""
    binary, _, _ = built
    sass = _sass(binary, toolchain)
    unsynced = next(ops for name, ops in sass.items() if "unsynced_kernel" in name)
    names = [op for _, op in unsynced]
    sts, lds = names.index("STS"), names.index("LDS")
    bars = [(pred, op) for pred, op in unsynced[sts:lds] if op.startswith("BAR")]
    # between the store and the load, the one barrier is predicated (the synced path only): an
    # unconditional one would make the racy control clean
    assert sts < lds and bars and all(pred for pred, _ in bars), unsynced
    release = [op for _, op in next(ops for name, ops in sass.items() if "release_kernel" in name)]
    # Between two phase checks (the consumer's waits on "produced"): an arrive, the shared load,
    # another arrive: the early path's arrive before the load and the clean path's after it.
    # Without the early path only load-then-arrive would be left.
    windows, current = [], []
    for op in release:
        if op.startswith("SYNCS.PHASECHK"):
            windows.append(current)
            current = []
        elif op.startswith("SYNCS.ARRIVE") or op == "LDS":
            current.append("arrive" if op.startswith("SYNCS") else "load")
    windows.append(current)
    both = [w for w in windows if "load" in w and "arrive" in w[:w.index("load")] and "arrive" in w[w.index("load"):]]
    assert both, windows
    assert "STS" in release  # the producer writes the stage with ordinary shared stores

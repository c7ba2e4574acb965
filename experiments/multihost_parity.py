"""The same training run in one process and as a multi-process job: how far the losses drift.

    python experiments/multihost_parity.py --out experiments/results/multihost-parity --steps 20 -- --preset tiny
    python experiments/multihost_parity.py --out experiments/results/multihost-parity-ci-model --steps 30 -- \\
        --preset tiny --batch-size 8 --seq-len 32 --eval-every 3 --model n_layers=1,n_dense_layers=0,mtp=false,n_routed=8

Runs `experiments/train_moe.py --mesh data=D,expert=E` with the arguments after `--` twice on this
machine's CPU: once as 1 process with D*E devices, once through `scripts/launch_local.py` as
`--processes` processes with D*E/processes devices each (gloo collectives), and compares the
losses step by step (`--log-every 1`) and the validation losses. The two differ only in how
cross-device sums are reduced, so the difference is reduction-order noise; the CI test
(tests/test_multiprocess.py) bounds it with a tolerance read from this.

Writes OUT/summary.json (the commands, per-step losses of both runs, max abs/rel differences) and
OUT/{single,multi}/ (the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mesh", default="data=2,expert=4")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then more train_moe.py arguments")
    return p


def losses(run: pathlib.Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {"loss": r["loss"], "val_loss": r.get("val_loss")} for r in rows}


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Max abs and rel differences of loss and val_loss over the steps both runs logged."""
    out = {}
    for key in ("loss", "val_loss"):
        pairs = [(a[s][key], b[s][key]) for s in sorted(set(a) & set(b)) if a[s][key] is not None]
        diffs = [abs(x - y) for x, y in pairs]
        out[key] = {"steps": len(pairs), "max_abs": max(diffs),
                    "max_rel": max(d / abs(x) for d, (x, _) in zip(diffs, pairs)),
                    "equal_steps": sum(d == 0 for d in diffs)}
    return out


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    mesh = dict(part.split("=") for part in args.mesh.split(","))
    devices = int(mesh.get("data", 1)) * int(mesh.get("expert", 1))
    if devices % args.processes:
        raise SystemExit(f"--mesh {args.mesh} has {devices} devices: not a multiple of --processes {args.processes}")
    out = args.out.absolute()
    train = ["experiments/train_moe.py", "--steps", str(args.steps), "--log-every", "1", "--no-progress",
             "--mesh", args.mesh, *extra]
    count = f"--xla_force_host_platform_device_count={devices}"
    single = [*train, "--out", str(args.out / "single")]
    multi = ["scripts/launch_local.py", "--processes", str(args.processes), "--devices-per-process",
             str(devices // args.processes), "--logs", str(args.out / "multi" / "logs"), "--",
             *train, "--out", str(args.out / "multi")]
    prefix = str(args.out) + "/"
    absolute = lambda cmd: [str(out / c[len(prefix):]) if c.startswith(prefix) else c for c in cmd]  # noqa: E731
    subprocess.run([sys.executable, *absolute(single)], cwd=ROOT, env=dict(os.environ, XLA_FLAGS=count), check=True,
                   timeout=3600)
    subprocess.run([sys.executable, *absolute(multi)], cwd=ROOT, check=True, timeout=3600)
    a, b = losses(out / "single"), losses(out / "multi")
    summary = {
        "command": shlex.join(["python", "experiments/multihost_parity.py", *(sys.argv[1:] if argv is None else argv)]),
        "single": shlex.join([f"XLA_FLAGS={count}", "python", *single]),
        "multi": shlex.join(["python", *multi]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "difference": compare(a, b),
        "losses": {s: {"single": a[s], "multi": b.get(s)} for s in sorted(a)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["difference"], indent=1))
    return summary


if __name__ == "__main__":
    main()

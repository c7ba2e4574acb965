"""Run one command as an N-process jax job on this machine (what N hosts would run, one each).

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        experiments/train_moe.py --preset tiny --steps 100 --mesh data=2,expert=4 --out runs/mp

Every process gets JFP8_COORDINATOR (127.0.0.1 and a free port), JFP8_NUM_PROCESSES and
JFP8_PROCESS_ID (`jfp8.mesh.DistributedConfig.from_env`); `--devices-per-process` splits the CPU
into that many jax devices per process (XLA_FLAGS). Process 0 writes to this terminal, the others
to LOGS/process-<i>.log. When a process fails, the others end by themselves once jax's
coordination service misses its heartbeats (`--heartbeat-timeout`); whoever is still running
`--grace` seconds later is killed, with its process group. Exits 0 when every process did.
Processes run with PYTHONFAULTHANDLER=1 unless it is set: one that jax aborts (a missed heartbeat,
a failed shutdown barrier) writes where each of its Python threads was, after jax's own message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, process_id: int, processes: int, port: int, devices_per_process: int | None,
                heartbeat_timeout_s: int | None) -> dict:
    """`base` plus what process `process_id` of the job needs."""
    env = dict(base, JFP8_COORDINATOR=f"127.0.0.1:{port}", JFP8_NUM_PROCESSES=str(processes),
               JFP8_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if heartbeat_timeout_s is not None:
        env["JFP8_HEARTBEAT_TIMEOUT_S"] = str(heartbeat_timeout_s)
    if devices_per_process is not None:
        flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    return env


@dataclasses.dataclass
class Job:
    """The processes of a job (each the leader of its own process group) and their log files."""

    procs: list[subprocess.Popen]
    logs: list[pathlib.Path | None]  # None: the process writes to this terminal
    started: float


def start(cmd: list[str], processes: int, logs: pathlib.Path, *, devices_per_process: int | None = None,
          heartbeat_timeout_s: int | None = None, port: int | None = None, main_to_terminal: bool = True,
          cwd: str | None = None) -> Job:
    """Starts `cmd` `processes` times as one job; a command starting with a .py file runs with
    this Python."""
    if cmd and cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    port = free_port() if port is None else port
    logs.mkdir(parents=True, exist_ok=True)
    job = Job([], [], time.monotonic())
    try:
        for i in range(processes):
            env = process_env(os.environ, i, processes, port, devices_per_process, heartbeat_timeout_s)
            log = None if (i == 0 and main_to_terminal) else logs / f"process-{i}.log"
            out = None if log is None else log.open("w")
            try:
                job.procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out,
                                                  stderr=subprocess.STDOUT if out else None, start_new_session=True))
            finally:
                if out is not None:
                    out.close()
            job.logs.append(log)
    except BaseException:
        stop(job)
        raise
    return job


def stop(job: Job, term_wait_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the process group of every process still running."""
    alive = [p for p in job.procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + term_wait_s
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            break
    for p in job.procs:
        try:  # what a process left behind in its group
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@dataclasses.dataclass(frozen=True)
class Outcome:
    process_id: int
    returncode: int  # negative: ended by that signal
    ended_s: float  # seconds after the job started
    killed: bool  # by the launcher, after --grace or --timeout


def wait(job: Job, grace_s: float, timeout_s: float | None = None, poll_s: float = 0.1) -> list[Outcome]:
    """Waits until every process has ended: by itself, or killed `grace_s` after the first one
    failed, or when the job has run `timeout_s`."""
    ended: dict[int, float] = {}
    failed_at = None
    while len(ended) < len(job.procs):
        now = time.monotonic()
        for i, p in enumerate(job.procs):
            if i not in ended and p.poll() is not None:
                ended[i] = now - job.started
                if p.returncode != 0 and failed_at is None:
                    failed_at = now
        late = failed_at is not None and now - failed_at > grace_s
        if len(ended) < len(job.procs) and (late or (timeout_s is not None and now - job.started > timeout_s)):
            stop(job)
            break
        time.sleep(poll_s)
    end = time.monotonic() - job.started
    return [Outcome(i, p.returncode, ended.get(i, end), i not in ended) for i, p in enumerate(job.procs)]


def describe(outcome: Outcome) -> str:
    rc = outcome.returncode
    how = "exited 0" if rc == 0 else (f"ended by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}")
    return f"process {outcome.process_id}: {how} after {outcome.ended_s:.1f} s" + (
        " (killed by the launcher)" if outcome.killed else "")


# The frames of a native stack trace (absl's, printed when jax aborts a process): addresses that
# would fill a log's tail and push out what the process was doing.
_NATIVE_FRAME = re.compile(r"^\s*(@\s+0x[0-9a-f]+|PC: @ )")


def tail(path: pathlib.Path | None, lines: int = 15) -> str:
    """The last `lines` lines of a process's log, native stack frames left out (counted instead)."""
    if path is None or not path.exists():
        return ""
    kept, frames = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if _NATIVE_FRAME.match(line):
            frames += 1
            continue
        if frames:
            kept.append(f"[{frames} native stack frames left out]")
            frames = 0
        kept.append(line)
    if frames:
        kept.append(f"[{frames} native stack frames left out]")
    return "\n".join(kept[-lines:])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", "-n", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="CPU devices per process (XLA_FLAGS); leave out on GPU hosts")
    p.add_argument("--heartbeat-timeout", type=int, default=60, metavar="S",
                   help="seconds without heartbeats before jax declares a process dead (JFP8_HEARTBEAT_TIMEOUT_S)")
    p.add_argument("--grace", type=float, default=None, metavar="S",
                   help="after a process fails, kill the others still running this much later "
                        "(default: heartbeat timeout + 30 s)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill the whole job after this long")
    p.add_argument("--logs", type=pathlib.Path, default=None,
                   help="folder for process-<i>.log of processes 1..N-1 (default: a new temporary folder)")
    p.add_argument("--port", type=int, default=None, help="the coordinator's port (default: a free one)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (a .py file runs with this Python)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd or args.processes < 1:
        raise SystemExit("usage: launch_local.py --processes N [options] -- COMMAND ...")
    logs = args.logs or pathlib.Path(tempfile.mkdtemp(prefix="jfp8-launch-"))
    if args.grace is None:
        args.grace = args.heartbeat_timeout + 30
    job = start(cmd, args.processes, logs, devices_per_process=args.devices_per_process,
                heartbeat_timeout_s=args.heartbeat_timeout, port=args.port)
    print(f"launch_local: {args.processes} processes, logs of processes 1..{args.processes - 1} in {logs}",
          file=sys.stderr)
    try:
        outcomes = wait(job, args.grace, args.timeout)
    finally:
        stop(job)
    if all(o.returncode == 0 for o in outcomes):
        return 0
    for o in sorted(outcomes, key=lambda o: o.ended_s):
        print(f"launch_local: {describe(o)}", file=sys.stderr)
        if o.returncode != 0 and (text := tail(job.logs[o.process_id])):
            print(f"--- the end of {job.logs[o.process_id]}:\n{text}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

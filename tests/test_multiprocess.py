"""Training as a multi-process jax job on one machine: 2 processes x 4 CPU devices (gloo
collectives) against 1 process x 8 devices, the same (data=2, expert=4) mesh and FP8 dispatch.

The jobs run `experiments/train_moe.py` through `scripts/launch_local.py`, as users do. Every
subprocess has a deadline and is killed with its process group when a test ends. The jobs share
one persistent compilation cache, so only the first job of each kind compiles.

Tolerance of the loss comparison: the two layouts run the same per-device programs and differ
only in how the cross-device sums are reduced (XLA's in-process all-reduce vs gloo over TCP).
Measured on this model over 30 steps: losses equal or one f32 ulp apart (max rel 9.7e-8;
experiments/results/multihost-parity-ci-model, docs/multihost.md). RTOL = 1e-5 leaves 100x room
for that and still fails a process that builds another process's rows of the batch (tried: the
step-1 loss moved by 2.9e-4 relative).
"""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ONE_MOE_LAYER

ROOT = pathlib.Path(__file__).resolve().parents[1]
RTOL = 1e-5
TAIL_LINES = 60  # of each process's log in a failure's message
HEARTBEAT_S = 10  # jax declares a silent process dead after this long
DEADLINE_S = 600  # any one job, compile included, on a busy 2-core machine
STEPS, CKPT_EVERY = 6, 2
TRAIN = ["experiments/train_moe.py", "--preset", "tiny", "--steps", str(STEPS), "--batch-size", "8",
         "--seq-len", "32", "--log-every", "1", "--eval-every", "3", "--ckpt-every", str(CKPT_EVERY),
         "--keep-checkpoints", "3", "--no-progress", "--mesh", "data=2,expert=4",
         "--model", ONE_MOE_LAYER + ",n_routed=8"]
HELD_IN_SAVE = "tests/fixtures/train_held_in_save.py"  # TRAIN, one process held inside one save
SLOW_COMPILE_S = 35  # past gloo's 30 s for a process to join a collective's first use


def _load_launcher():
    spec = importlib.util.spec_from_file_location("launch_local", ROOT / "scripts" / "launch_local.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


launch = _load_launcher()


@pytest.fixture(scope="module")
def env(tmp_path_factory, monkeypatch_module):
    cache = tmp_path_factory.mktemp("jax-cache")
    for k, v in dict(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0").items():
        monkeypatch_module.setenv(k, v)
    return os.environ


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _losses(run: pathlib.Path) -> dict[int, tuple[float, float | None]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"{run}/metrics.jsonl: steps {steps} (one writer, one line per step)"
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in rows}


def _story(job) -> str:
    """What each process of `job` wrote last (native stack frames left out; with the launcher's
    PYTHONFAULTHANDLER, a process jax aborts shows where each of its threads was)."""
    return "\n".join(f"--- process {i}:\n{launch.tail(p, TAIL_LINES)}" for i, p in enumerate(job.logs))


def _run_job(out: pathlib.Path, *extra: str, logs: str = "logs", script: str = TRAIN[0]) -> list:
    """The 2-process job; returns its outcomes (asserting every process exited 0)."""
    job = launch.start([script, *TRAIN[1:], "--out", str(out), *extra], 2, out / logs, devices_per_process=4,
                       heartbeat_timeout_s=HEARTBEAT_S, main_to_terminal=False, cwd=str(ROOT))
    try:
        outcomes = launch.wait(job, grace_s=HEARTBEAT_S + 30, timeout_s=DEADLINE_S)
    finally:
        launch.stop(job)
    assert all(o.returncode == 0 for o in outcomes), "\n".join(map(launch.describe, outcomes)) + "\n" + _story(job)
    return job


@pytest.fixture(scope="module")
def single(env, tmp_path_factory) -> dict:
    """The reference: the same command in one process with 8 CPU devices."""
    out = tmp_path_factory.mktemp("single")
    env1 = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for k in ("JFP8_COORDINATOR", "JFP8_NUM_PROCESSES", "JFP8_PROCESS_ID"):
        env1.pop(k, None)
    p = subprocess.Popen([sys.executable, *TRAIN, "--out", str(out)], cwd=ROOT, env=env1, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=DEADLINE_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, log[-3000:]
    return _losses(out)


@pytest.fixture(scope="module")
def two(env, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("two")
    _run_job(out)
    return out


def _assert_close(got: dict, ref: dict, steps) -> None:
    for s in steps:
        (loss, val), (ref_loss, ref_val) = got[s], ref[s]
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, err_msg=f"loss at step {s}")
        assert (val is None) == (ref_val is None), s
        if val is not None:
            np.testing.assert_allclose(val, ref_val, rtol=RTOL, err_msg=f"val_loss at step {s}")


# ------------------------------------------------------------------------------ one process's share


def test_distributed_config_from_env():
    from jfp8.mesh import DistributedConfig

    assert DistributedConfig.from_env({}) is None
    env = {"JFP8_COORDINATOR": "10.0.0.1:1234", "JFP8_NUM_PROCESSES": "4", "JFP8_PROCESS_ID": "3",
           "JFP8_HEARTBEAT_TIMEOUT_S": "15"}
    assert DistributedConfig.from_env(env) == DistributedConfig("10.0.0.1:1234", 4, 3, heartbeat_timeout_s=15)
    with pytest.raises(ValueError, match="JFP8_PROCESS_ID"):
        DistributedConfig.from_env({"JFP8_COORDINATOR": "h:1", "JFP8_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match=r"must lie in \[0, JFP8_NUM_PROCESSES=2\)"):
        DistributedConfig.from_env(dict(env, JFP8_NUM_PROCESSES="2", JFP8_PROCESS_ID="2"))
    with pytest.raises(ValueError, match="JFP8_HEARTBEAT_TIMEOUT_S='soon' must be an integer"):
        DistributedConfig.from_env(dict(env, JFP8_HEARTBEAT_TIMEOUT_S="soon"))


def test_each_device_builds_only_its_rows():
    """`shard_rows` asks for each local device's rows, never the whole batch; the windows are the
    whole batch's rows."""
    from jfp8 import mesh as meshes
    from jfp8.train import data

    corpus = np.arange(10_000, dtype=np.uint8)
    whole = data.train_batch(corpus, 16, 32, seed=1, step=5)
    asked = []

    def rows(r):
        asked.append((r.start, r.stop))
        return data.train_batch(corpus, 16, 32, seed=1, step=5, rows=r)

    placed = meshes.shard_rows(rows, whole.shape, meshes.make_mesh(2, 4))
    assert sorted(asked) == [(i, i + 2) for i in range(0, 16, 2)]
    np.testing.assert_array_equal(np.asarray(placed), whole)
    val = data.eval_batches(corpus, 8, 32, 3)
    np.testing.assert_array_equal(data.eval_batch(corpus, 8, 32, 3, 2, rows=slice(4, 6)), val[2][4:6])


# ------------------------------------------------------------------------------ the launcher


def test_process_env_sets_the_job_and_replaces_the_device_count():
    env = launch.process_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}, 1, 2,
                             1234, 4, 10)
    assert env["JFP8_COORDINATOR"] == "127.0.0.1:1234" and env["JFP8_NUM_PROCESSES"] == "2"
    assert env["JFP8_PROCESS_ID"] == "1" and env["JFP8_HEARTBEAT_TIMEOUT_S"] == "10"
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert env["PYTHONFAULTHANDLER"] == "1"
    assert launch.process_env({"PYTHONFAULTHANDLER": ""}, 0, 2, 1234, None, None)["PYTHONFAULTHANDLER"] == ""


def test_a_process_jax_aborts_shows_its_python_threads(tmp_path, monkeypatch):
    """Process 1 holds its exit in a thread, so process 0 waits alone at jax's shutdown barrier
    until both are aborted (the signature of CI's one failure of the resumed job, whose cause its
    30-line tails of native frames hid): the log's tail names the thread's function, and leaves
    out jax's native stack frames."""
    code = ("import os, threading, time, jax\n"
            "from jfp8 import mesh\n"
            "mesh.initialize_distributed()\n"
            "if jax.process_index() == 1:\n"
            "    def holds_the_exit(): time.sleep(120)\n"
            "    threading.Thread(target=holds_the_exit).start()\n")
    monkeypatch.setenv("JFP8_SHUTDOWN_TIMEOUT_S", "3")
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    job = launch.start([sys.executable, "-c", code], 2, tmp_path / "logs", devices_per_process=1,
                       heartbeat_timeout_s=HEARTBEAT_S, main_to_terminal=False, cwd=str(ROOT))
    try:
        outcomes = launch.wait(job, grace_s=60, timeout_s=120)
    finally:
        launch.stop(job)
    assert all(o.returncode == -signal.SIGABRT for o in outcomes), [launch.describe(o) for o in outcomes]
    text = launch.tail(job.logs[1], TAIL_LINES)
    assert "in holds_the_exit" in text and "Shutdown barrier" in text, text
    assert "native stack frames left out" in text and not re.search(r"^\s*@\s+0x", text, re.M), text


def test_launcher_kills_the_survivors_after_the_grace(tmp_path):
    """One process fails at once, one would run for a minute: the launcher ends it `grace` later,
    with the child it started in its process group."""
    marker = tmp_path / "grandchild.pid"
    code = ("import os, subprocess, sys, time\n"
            "if os.environ['JFP8_PROCESS_ID'] == '0': sys.exit(3)\n"
            f"c = subprocess.Popen(['sleep', '60']); open({str(marker)!r}, 'w').write(str(c.pid)); time.sleep(60)\n")
    job = launch.start([sys.executable, "-c", code], 2, tmp_path / "logs", main_to_terminal=False)
    try:
        t0 = time.monotonic()
        while not marker.exists() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        outcomes = launch.wait(job, grace_s=1.0, timeout_s=60)
    finally:
        launch.stop(job)
    assert outcomes[0].returncode == 3 and not outcomes[0].killed
    assert outcomes[1].killed and outcomes[1].returncode == -signal.SIGTERM and outcomes[1].ended_s < 30
    stat = pathlib.Path(f"/proc/{int(marker.read_text())}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the grandchild still runs"


# ------------------------------------------------------------------------------ training


def test_two_processes_train_like_one(single, two):
    """2 processes x 4 devices: the 1 x 8 run's losses and validation losses, step for step;
    one metrics file (process 0's), checkpoints written together."""
    got = _losses(two)
    assert sorted(got) == sorted(single) == list(range(1, STEPS + 1))
    _assert_close(got, single, range(1, STEPS + 1))
    assert sorted(int(d.name) for d in (two / "checkpoints").iterdir() if d.name.isdigit()) == [2, 4, 6]
    other = (two / "logs" / "process-1.log").read_text()
    assert "final_loss" not in (other.split("[Gloo]")[-1]), "only process 0 prints the summary"


def test_killed_process_stops_the_job_and_the_run_resumes(two, tmp_path, monkeypatch):
    """Kill process 1 inside its step-4 save: process 0 ends by itself within the heartbeat
    timeout with jax's error, the half-written step is not taken for a checkpoint, and
    `--resume` with two processes continues from the last complete one to the uninterrupted
    job's losses, bit for bit, although its process 1 compiles its train step 35 s longer.

    Process 1 runs `tests/fixtures/train_held_in_save.py`, which starts the save, writes a marker
    and sleeps there; the kill waits for the marker. (Watching for orbax's temporary folder instead
    raced the save: the tiny model's can start and commit between two 10 ms polls, and once did.)"""
    out = tmp_path / "killed"
    marker = out / "held-in-save"
    for k, v in dict(JFP8_HOLD_PROCESS="1", JFP8_HOLD_SAVE_AT=str(2 * CKPT_EVERY), JFP8_HOLD_MARKER=str(marker)).items():
        monkeypatch.setenv(k, v)
    job = launch.start([HELD_IN_SAVE, *TRAIN[1:], "--out", str(out)], 2, out / "logs", devices_per_process=4,
                       heartbeat_timeout_s=HEARTBEAT_S, main_to_terminal=False, cwd=str(ROOT))
    ckpts, killed_at = out / "checkpoints", None
    try:
        while job.procs[1].poll() is None and time.monotonic() - job.started < DEADLINE_S:
            if marker.exists():
                job.procs[1].send_signal(signal.SIGKILL)
                killed_at = time.monotonic() - job.started
                break
            time.sleep(0.05)
        outcomes = launch.wait(job, grace_s=HEARTBEAT_S + 60, timeout_s=DEADLINE_S)
    finally:
        launch.stop(job)
    log0 = (out / "logs" / "process-0.log").read_text(errors="replace")
    logs = _story(job)
    assert killed_at is not None, "process 1 never reached its step-4 save:\n" + logs
    for k in ("JFP8_HOLD_PROCESS", "JFP8_HOLD_SAVE_AT", "JFP8_HOLD_MARKER"):
        monkeypatch.delenv(k)
    survivor = outcomes[0]
    assert not survivor.killed and survivor.returncode != 0, launch.describe(survivor)
    # Detected by the missed heartbeats: HEARTBEAT_S, plus slack for a loaded machine.
    assert survivor.ended_s - killed_at < HEARTBEAT_S + 30, (survivor, killed_at)
    assert "JAX distributed service detected fatal errors" in log0 and "heartbeat" in log0

    from jfp8.train.checkpoint import Checkpointer

    ckpt = Checkpointer(ckpts)
    try:
        complete = ckpt.all_steps()
    finally:
        ckpt.close()
    left = sorted(ckpts.glob("*.orbax-checkpoint-tmp*"))
    # The save in progress either never completed (its temporary folder is left, and ignored) or
    # had all its parts written before the kill.
    assert complete in ([2], [2, 4]), complete
    assert (complete == [2]) == bool(left), (complete, left)
    print(f"killed process 1 {killed_at:.1f} s into the job; process 0 ended {survivor.ended_s - killed_at:.1f} s "
          f"later ({launch.describe(survivor)}); complete checkpoints {complete}, partial {[p.name for p in left]}")

    # The resumed job's process 1 compiles its train step 35 s longer than process 0 takes to load
    # it from the cache (as its compile did in CI once, on a loaded machine): more than gloo's 30 s
    # for a collective's first use, which the loop's compile barrier absorbs.
    monkeypatch.setenv("JFP8_SLOW_COMPILE_PROCESS", "1")
    monkeypatch.setenv("JFP8_SLOW_COMPILE_S", str(SLOW_COMPILE_S))
    _run_job(out, "--resume", logs="logs-resumed", script=HELD_IN_SAVE)  # the killed job's logs kept
    held = (out / "logs-resumed" / "process-1.log").read_text()
    assert f"held the first compile of jit_step for {SLOW_COMPILE_S} s" in held
    assert not sorted(ckpts.glob("*.orbax-checkpoint-tmp*")), "the resumed run removes the partial save"
    resumed, ref = _losses(out), _losses(two)
    assert resumed == ref

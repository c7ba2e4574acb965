"""benchmarks/compile_census.py: every compile of a command's processes logged and charged."""

import json
import sys

import pytest

from helpers import load_benchmark

census = load_benchmark("compile_census")

# Two processes: the parent jits a program at one shape twice (one compile, then jax's in-memory
# cache) and at a second shape, then starts a child that compiles the first shape again.
CHILD = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))"
PARENT = f"""
import subprocess, sys
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x) * 2)
f(jnp.ones(3)); f(jnp.ones(3)); f(jnp.ones(5))
subprocess.check_call([sys.executable, "-c", {CHILD!r}])
"""


def test_census_logs_every_process_and_finds_a_compile_done_again(tmp_path, capsys, request):
    this_test = request.node
    log = tmp_path / "c.jsonl"
    assert census.main(["--log", str(log), "--json", str(tmp_path / "s.json"), "--",
                        sys.executable, "-c", PARENT]) == 0
    rows = census.read(log)
    lambdas = [r for r in rows if r["name"] == "jit__lambda"]
    assert len({r["pid"] for r in lambdas}) == 2 and len(lambdas) == 3  # shapes 3 and 5, then 3 in the child
    # charged to this test: pytest's PYTEST_CURRENT_TEST reaches the command and its child
    assert all(r["s"] > 0 and r["key"] and r["test"].endswith("::" + this_test.name) for r in lambdas)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["compiles"] == len(rows) and summary["processes"] == 2
    assert sum(b["compiles"] for b in summary["buckets"]) == len(rows)
    (again,) = [a for a in summary["compiled_again"]["top"] if a["name"] == "jit__lambda"]
    assert again["times"] == 2 and again["seconds_again"] > 0
    out = capsys.readouterr().out
    assert "compiles in 2 processes" in out and "| seconds | compiles | distinct keys | program |" in out


def test_summary_charges_tests_and_skips_cache_hits():
    rows = [
        {"test": "tests/a.py::t1", "process": "p", "pid": 1, "name": "jit_step", "s": 5.0, "hit": False, "key": "k1"},
        {"test": "tests/a.py::t2", "process": "p", "pid": 2, "name": "jit_step", "s": 4.0, "hit": False, "key": "k1"},
        {"test": "tests/a.py::t3", "process": "p", "pid": 2, "name": "jit_step", "s": 0.1, "hit": True, "key": "k1"},
        {"test": "", "process": "train_moe.py", "pid": 3, "name": "jit_add", "s": 0.05, "hit": False, "key": "k2"},
    ]
    s = census.summarize(rows)
    assert s["cache_hits"] == 1 and s["seconds"] == 9.2
    assert [o["owner"] for o in s["owners"]] == ["tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3",
                                                  "(process) train_moe.py"]
    assert s["owners"][0]["seconds_over_0.2"] == 5.0 and s["owners"][-1]["seconds_over_0.2"] == 0
    assert s["programs"][0] == {"name": "jit_step", "compiles": 2, "keys": 1, "seconds": 9.0}  # the hit is no compile
    assert s["compiled_again"]["seconds"] == 4.0
    assert [b["compiles"] for b in s["buckets"]] == [2, 0, 0, 2]


def test_bad_arguments_say_what_to_give(tmp_path):
    with pytest.raises(SystemExit):
        census.main([])  # neither a command nor a log
    with pytest.raises(SystemExit):
        census.main(["--summarize", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit):
        census.main(["--summarize", str(tmp_path / "x"), "--", "true"])

"""Test session setup: 8 simulated CPU devices (for shard_map/mesh tests) and the `gpu` marker."""

import os

# Must happen before jax initialises its backends. Only the host platform is split; a real GPU
# machine keeps its devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The training scripts switch on jax's persistent compilation cache in ~/.cache (jfp8.train.
# compile_cache); the suite runs them in-process and as subprocesses, and keeps out of ~/.cache
# (tests/test_compile_cache.py turns that on where it is the subject).
os.environ["JFP8_COMPILE_CACHE"] = "0"
# Instead, one cache for this test session: a fresh folder that the pytest-xdist workers and every
# subprocess they start share (they inherit the environment), removed when the session ends. Many
# tests compile the same programs (the tiny model's train and eval steps, in notebooks, scripts and
# in-process), and a cached executable is the one XLA compiled for the same program, options and
# XLA_FLAGS (jax's key), so the bits are those of a fresh compile. Nothing from a developer's
# own cache is read. `JFP8_TEST_COMPILE_CACHE=0` runs the suite without it.
_SESSION_CACHE = "JFP8_TEST_SESSION_CACHE"
_MIN_COMPILE_S = "0.2"  # as jfp8.train.compile_cache (not imported here: it imports jax)
if os.environ.get("JFP8_TEST_COMPILE_CACHE", "1") != "0":
    if _SESSION_CACHE not in os.environ:  # the session's first process (xdist's controller)
        import atexit
        import shutil
        import tempfile

        os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="jfp8-test-compile-cache-")
        atexit.register(shutil.rmtree, os.environ[_SESSION_CACHE], ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_SESSION_CACHE]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = _MIN_COMPILE_S
else:
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# Likewise jfp8's folder of lowered Mosaic GPU kernels (pallas_kernels.kernel_cache): off, also
# where a developer's shell sets it (tests/test_kernel_cache.py turns it on).
os.environ["JFP8_KERNEL_CACHE_DIR"] = ""

import jax  # noqa: E402
import pytest  # noqa: E402

if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # in case a plugin imported jax before this file
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(_MIN_COMPILE_S))


def pytest_collection_modifyitems(config, items):
    from jfp8.api import is_hopper

    if is_hopper():
        return
    skip = pytest.mark.skip(reason="needs a Hopper GPU (H100/H200); runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_interpreter_after_failure():
    """The Mosaic GPU interpreter must be reset after an exception inside a kernel."""
    yield
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state,
        )
    except ImportError:  # pragma: no cover - the private path moved
        return
    reset_gpu_interpret_mode_state()


def cpu_devices() -> list:
    return jax.devices("cpu")


@pytest.fixture(scope="module")
def toolchain():
    """The deviceless Hopper build's toolchain directory (`scripts/hopper_toolchain.sh`, which
    scripts/test.sh installs), or a skip that says why it could not be installed."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import hopper_build

    try:
        return hopper_build.toolchain()
    except SystemExit as e:  # no package index: say why instead of pretending to have checked
        pytest.skip(f"the Hopper build toolchain could not be installed: {e}")

"""Test session setup: 8 simulated CPU devices (for shard_map/mesh tests) and the `gpu` marker."""

import os

# Must happen before jax initialises its backends. Only the host platform is split; a real GPU
# machine keeps its devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The training scripts switch on jax's persistent compilation cache in ~/.cache (jfp8.train.
# compile_cache); the suite runs them in-process and as subprocesses, and stays hermetic without it
# (tests/test_compile_cache.py turns it on where it is the subject).
os.environ["JFP8_COMPILE_CACHE"] = "0"
# Likewise jfp8's folder of lowered Mosaic GPU kernels (pallas_kernels.kernel_cache): off, also
# where a developer's shell sets it (tests/test_kernel_cache.py turns it on).
os.environ["JFP8_KERNEL_CACHE_DIR"] = ""

import jax  # noqa: E402
import pytest  # noqa: E402


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

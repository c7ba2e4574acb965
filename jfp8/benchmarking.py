"""Shared pieces of the benchmark scripts: timing, error checks, result records."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time
from typing import Callable

import jax
import numpy as np

from pallas_kernels.shapes import GemmShape

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def time_median(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall seconds of `fn()` with the device synchronised, warm-up calls excluded."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def rel_error(x, ref) -> float:
    """||x - ref||_F / ||ref||_F in float64 (NaN if x has NaN)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def parse_shape(s: str) -> GemmShape:
    """'MxNxK' -> GemmShape, for argparse."""
    try:
        m, n, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like MxNxK (e.g. 4096x7168x2048), got {s!r}")
    return GemmShape(m, n, k)


def write_record(name: str, rows: list[dict], out: pathlib.Path, **extra) -> pathlib.Path:
    """benchmarks/results/<name>-<device>-<date>.json with device, jax version, date and rows."""
    device = jax.devices()[0]
    today = datetime.date.today().isoformat()
    record = dict(benchmark=name, device=device.device_kind, platform=device.platform,
                  jax_version=jax.__version__, date=today, host=platform.node(), **extra, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{device.device_kind.lower().replace(' ', '-')}-{today}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path

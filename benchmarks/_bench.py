"""Shared pieces of the benchmark scripts: timing, error checks, device peaks, result records."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import platform
import sys
import statistics
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.reference import rel_error
from pallas_kernels.shapes import GemmShape, GroupedShape
from provenance import commit_info

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"

# Dense (no structured sparsity) tensor-core peaks in TFLOP/s, from NVIDIA's H100 SXM datasheet:
# 1979 FP8, 989 BF16 (3958 / 1979 are the "with sparsity" figures). The H200 SXM, which
# nvidia-smi names plainly "NVIDIA H200", has the H100's arithmetic rates. Measured ceilings on the
# project's GPU machines (see the shared pallas notes): bf16 cuBLAS ~790-800 TFLOP/s at 8192^3;
# device copy ~3.0 TB/s (H100), ~4.3 TB/s (H200).
_HOPPER_SXM_PEAKS = {"fp8": 1979.0, "bf16": 989.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM_PEAKS,
    "NVIDIA H200": _HOPPER_SXM_PEAKS,
}
PEAK_SOURCE = "NVIDIA H100 SXM datasheet, dense (no sparsity): 1979 FP8, 989 BF16 TFLOP/s"


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense datasheet peak of `device_kind` for `dtype` ("fp8" or "bf16"); None if unknown."""
    return PEAK_TFLOPS.get(device_kind, {}).get(dtype)


def time_samples(
    fn: Callable[[], object],
    warmup: int,
    repeats: int,
    *,
    inner: int = 1,
    sync: Callable[[object], object] = jax.block_until_ready,
) -> list[float]:
    """Seconds per call of `fn()`, one sample per repeat, warm-up calls excluded.

    Each sample times `inner` back-to-back calls followed by one device synchronisation (`sync`
    of the last result) and divides by `inner`: with `inner > 1` the host's dispatch of call i+1
    overlaps the device's work on call i, so short kernels are not timed as launch latency.
    """
    for _ in range(warmup):
        sync(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner - 1):
            fn()
        sync(fn())
        samples.append((time.perf_counter() - t0) / inner)
    return samples


def time_median(
    fn: Callable[[], object],
    warmup: int,
    repeats: int,
    *,
    inner: int = 1,
    sync: Callable[[object], object] = jax.block_until_ready,
) -> float:
    """Median wall seconds of `fn()` with the device synchronised, warm-up calls excluded."""
    return statistics.median(time_samples(fn, warmup, repeats, inner=inner, sync=sync))


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timing policy of one benchmark run (see `measure`)."""

    warmup: int
    repeats: int
    inner: int = 1
    max_seconds: float | None = None  # cap on the timed calls of one implementation


@dataclasses.dataclass(frozen=True)
class Measurement:
    seconds: float  # median per call
    seconds_min: float
    seconds_max: float
    repeats: int
    inner: int
    check: float  # the checked error (relative error, or count of mismatches)


class CheckFailed(AssertionError):
    """An implementation's output disagreed with its reference: it is not timed."""


def measure(
    fn: Callable[[], object],
    check: Callable[[object], float],
    tol: float,
    timing: Timing,
    *,
    sync: Callable[[object], object] = jax.block_until_ready,
) -> Measurement:
    """Check `fn()` against its reference, then time it.

    `check(out)` returns an error (NaN counts as failure); above `tol` this raises `CheckFailed`
    and nothing is timed. The first call (compilation included) is the checked one; a second,
    timed call sizes the loop so that the timed calls stay under `timing.max_seconds`.
    """
    out = sync(fn())
    err = float(check(out))
    del out
    if not err <= tol:  # also catches NaN
        raise CheckFailed(f"error {err:.3e} > tolerance {tol:.1e} against its reference")
    warmup, repeats, inner = timing.warmup, timing.repeats, timing.inner
    if timing.max_seconds is not None:
        t0 = time.perf_counter()
        sync(fn())
        once = max(time.perf_counter() - t0, 1e-6)
        calls = max(1, int(timing.max_seconds / once))
        inner = max(1, min(inner, calls // max(repeats, 1)))
        repeats = max(1, min(repeats, calls // inner))
        warmup = min(warmup, max(calls // 10, 1))
    samples = time_samples(fn, warmup, repeats, inner=inner, sync=sync)
    return Measurement(statistics.median(samples), min(samples), max(samples), repeats, inner, err)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def random_normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Standard-normal f32 data on the default device.

    jax.random on an accelerator; numpy on CPU, where compiling XLA's generator costs seconds,
    more than a tiny benchmark run (tests, --quick) spends on anything else.
    """
    if jax.default_backend() == "cpu":
        return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))
    return _jax_normal(seed, tuple(shape))


@jax.jit
def _device_rel_error(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30)


def device_rel_error(x: jax.Array, ref: jax.Array) -> float:
    """`rel_error` computed on the arrays' device in float32: no host copy of large outputs."""
    return float(_device_rel_error(x, ref))


def on_cpu(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` computed on the CPU, whose XLA defines the reference's bits (a
    reference run on a GPU sums its FP8 dots on the tensor cores): jax arrays among `args` are
    copied there first."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*jax.tree.map(lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x, args),
                  **kwargs)


def format_errors(errs: dict[str, float]) -> str:
    """{"y": 0.01, ...} -> "y 1.00e-02, ...": each output's error, for a failed check's message."""
    return ", ".join(f"{k} {e:.2e}" for k, e in errs.items())


def parse_shape(s: str) -> GemmShape:
    """'MxNxK' -> GemmShape, for argparse."""
    try:
        m, n, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like MxNxK (e.g. 4096x7168x2048), got {s!r}")
    return GemmShape(m, n, k)


def parse_grouped_shape(s: str) -> GroupedShape:
    """'GxRxNxK' (G groups of R rows) -> GroupedShape, for argparse."""
    try:
        g, r, n, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must look like GxRxNxK (e.g. 8x4096x4096x7168), got {s!r}")
    return GroupedShape(g, r, n, k)


def _parse_value(text: str, default: Any, name: str) -> Any:
    """`text` converted like the field's default (bool, int, float, tuple of ints 'AxB', str)."""
    text = text.strip()
    try:
        if isinstance(default, bool):
            lowered = text.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return lowered in ("1", "true", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a value like the default {default!r}") from None
    if default is None:  # an optional field: best effort
        if text.lower() in ("true", "false", "yes", "no"):  # e.g. scalar_b_scale: bool | None
            return text.lower() in ("true", "yes")
        for convert in (int, float):
            try:
                return convert(text)
            except ValueError:
                pass
    return text


def parse_config(text: str, cls: type) -> Any:
    """'tile_m=128,max_concurrent_steps=4' -> `cls(tile_m=128, max_concurrent_steps=4)`.

    `cls` is a dataclass (e.g. `GemmConfig`); values are converted like each field's default
    (bools from 1/0/true/false, tuples from '2x1'). An unknown field name raises a ValueError
    that lists the known ones; `cls`'s own validation errors pass through.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"config item {item!r} must look like name=value")
        if name not in fields:
            raise ValueError(
                f"{cls.__name__} has no field {name!r}; its fields are {', '.join(fields)}"
            )
        field = fields[name]
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        kwargs[name] = _parse_value(value, None if default is dataclasses.MISSING else default, name)
    return cls(**kwargs)


def budget_spent(budget_s: float | None, start: float) -> str | None:
    """Why a benchmark starts nothing more: `budget_s` seconds have passed since `start` (a
    `time.perf_counter()` reading). None while time is left, or without a budget."""
    if budget_s is not None and time.perf_counter() - start > budget_s:
        return f"time budget {budget_s:.0f} s spent"
    return None


def within_budget(problems, label: Callable[[Any], str], budget_s: float | None, start: float,
                  skipped: list[dict]):
    """Yields (problem, label(problem)) while the budget lasts; once it is spent, the problems
    left go to `skipped` with the reason."""
    for i, problem in enumerate(problems):
        if why := budget_spent(budget_s, start):
            skipped.extend(dict(problem=label(p), reason=why) for p in problems[i:])
            return
        yield problem, label(problem)


def shape_label(shape) -> str:
    """(4096, 7168, 2048) -> '4096x7168x2048', how records name a problem."""
    return "x".join(map(str, shape))


def error_entry(impl: str, problem: str, e: BaseException) -> dict:
    """A `failed` entry for an exception (its message cut to 800 characters)."""
    return dict(impl=impl, problem=problem, error=f"{type(e).__name__}: {str(e)[:800]}")


def report_end(path, skipped: list[dict], failed: list[dict]) -> int:
    """Prints what was skipped, what failed and where the record went; the script's exit code
    (1 when any row failed its check or its run)."""
    for s in skipped:
        print(f"skipped: {s}")
    for f in failed:
        print(f"FAILED: {f}")
    print(f"wrote {path}")
    return 1 if failed else 0


def check_configs(parser, texts: list[str], cls: type) -> None:
    """Every `--config` text parses into `cls` before anything runs, or `parser.error` says which
    does not and why (an unknown field, a value the config rejects)."""
    for text in texts:
        try:
            parse_config(text, cls)
        except (ValueError, TypeError) as e:
            parser.error(f"--config {text!r}: {e}")


def config_label(text: str) -> str:
    """A config string normalised for an implementation name: 'tile_m=128,tile_n=256'."""
    return ",".join(p.strip().replace(" ", "") for p in text.split(",") if p.strip())


def device_slug(device_kind: str) -> str:
    return device_kind.lower().replace(" ", "-")


def record_path(name: str, out: pathlib.Path) -> pathlib.Path:
    device = jax.devices()[0]
    today = datetime.date.today().isoformat()
    return out / f"{name}-{device_slug(device.device_kind)}-{today}.json"


def write_record(name: str, rows: list[dict], out: pathlib.Path, **extra) -> pathlib.Path:
    """benchmarks/results/<name>-<device>-<date>.json with device, jax version, date, the commit
    and dirty flag of the tree (`provenance.commit_info`) and rows."""
    device = jax.devices()[0]
    today = datetime.date.today().isoformat()
    record = dict(benchmark=name, device=device.device_kind, platform=device.platform,
                  jax_version=jax.__version__, date=today, host=platform.node(), **commit_info(), **extra,
                  rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    path = record_path(name, out)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def torch_cuda():
    """(torch module, None) when torch with a CUDA device is importable, else (None, reason)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, f"torch not importable: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch, None


# ------------------------------------------------------------------ running cases (the scripts)


class Case(NamedTuple):
    """One implementation at one problem: `fn()` runs it, `check(out)` measures its error."""

    name: str
    fn: Callable[[], object]  # one call, operands bound
    check: Callable[[object], float]  # output -> error against its reference
    tol: float
    dtype: str  # operand dtype, for the peak: "fp8" or "bf16" (or "" when not a GEMM)
    sync: Callable[[object], object] = jax.block_until_ready
    info: dict | None = None  # recorded on the row as is: a kernel's config (`kernel_info`)


class Skip(NamedTuple):
    impl: str
    reason: str


def run_cases(cases, label: str, timing: Timing, row_fn, rows: list, failed: list,
              only: tuple[str, ...] = ()) -> None:
    """Check and time each case, appending `row_fn(case, measurement)` to `rows`; a case that
    fails its check or raises goes to `failed` (with the reason) and the others still run.
    With `only`, just the cases whose names start with one of its prefixes run."""
    for case in cases:
        if only and not case.name.startswith(tuple(only)):
            continue
        try:
            meas = measure(case.fn, case.check, case.tol, timing, sync=case.sync)
        except CheckFailed as e:
            failed.append(dict(impl=case.name, problem=label, error=f"check failed: {e}"))
            print(f"  {case.name} at {label}: CHECK FAILED: {e}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - one implementation's failure must not stop the run
            failed.append(error_entry(case.name, label, e))
            print(f"  {case.name} at {label}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = row_fn(case, meas)
        rows.append(row)
        rate = f"{row['tflops']:8.4g} TFLOP/s" if "tflops" in row else f"{row['gbps']:8.4g} GB/s"
        print(f"  {case.name:34s} {label:>20s} {meas.seconds * 1e3:9.3f} ms {rate}  "
              f"err {meas.check:.1e}", flush=True)


def harness_module():
    """`benchmarks/hopper/deepgemm_harness.py`: DeepGEMM's kernels in a program of their own."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "hopper"))
    import deepgemm_harness

    return deepgemm_harness


def run_harnessed(harnessed, label: str, timing: Timing, row_fn, rows: list, failed: list, tol: float) -> None:
    """Implementations timed in a process of their own (DeepGEMM's harness), each
    (name, run(timing) -> {"ms": [each sample's time per call], "inner", ...}, check(result) ->
    error, info): run it (its own warm-up, then `repeats` samples of `inner` back-to-back calls,
    timed on the device by CUDA events where `measure` times the host's wall clock around the
    calls and one synchronisation), check its output as `measure` checks a case's (over `tol`: a
    failure and no row), then `row_fn` on the median sample."""
    for name, run, check, info in harnessed:
        try:
            got = run(timing)
            err = float(check(got))
            if not err <= tol:  # also catches NaN
                raise CheckFailed(f"error {err:.3e} > tolerance {tol:.1e} against its reference")
        except Exception as e:  # noqa: BLE001 - the harness's failure is its row's, not the run's
            failed.append(error_entry(name, label, e))
            print(f"  {name} at {label}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        ms = got["ms"]
        meas = Measurement(statistics.median(ms) / 1e3, min(ms) / 1e3, max(ms) / 1e3, len(ms), got.get("inner", 1), err)
        row = row_fn(Case(name, None, None, tol, "fp8", info=info), meas)
        rows.append(row)
        print(f"  {name:34s} {label:>20s} {meas.seconds * 1e3:9.3f} ms {row['tflops']:8.4g} TFLOP/s  "
              f"err {err:.1e}", flush=True)


def gemm_row(case: Case, meas: Measurement, device_kind: str, flops: float, **problem) -> dict:
    """A result row of a GEMM-like measurement: time, TFLOP/s and the fractions of peak."""
    tflops = flops / meas.seconds / 1e12
    fp8_peak, own_peak = peak_tflops(device_kind, "fp8"), peak_tflops(device_kind, case.dtype)
    return dict(
        impl=case.name, **problem, **(case.info or {}), operand_dtype=case.dtype,
        ms=meas.seconds * 1e3, ms_min=meas.seconds_min * 1e3, ms_max=meas.seconds_max * 1e3,
        tflops=tflops, ratio_vs_bf16=None, rel_error=meas.check, repeats=meas.repeats,
        inner=meas.inner,
        frac_fp8_peak=None if fp8_peak is None else tflops / fp8_peak,
        frac_dtype_peak=None if own_peak is None else tflops / own_peak,
    )


def kernel_info(config, m: int, n: int, kp: int, *, source: str, out_dtype, scalar_b: bool = True,
                groups: int = 1) -> dict:
    """What a kernel's row records beside its time: the config that ran, where it came from
    ("table", "rule" or "given"), and the cost model's numbers for it on this GPU's SMs
    (`pallas_kernels.tuning.modelled`: L2 bytes per FLOP, waves, wave efficiency, cycles; a
    grouped problem's `groups` counted as the grouped rule counts them)."""
    from pallas_kernels import _mgpu, tuning

    got = tuning.modelled(config, m, n, kp, _mgpu.num_sms(), out_dtype=out_dtype, scalar_b=scalar_b, groups=groups)
    return {"config": dataclasses.asdict(config), "config_source": source, "modelled": got.as_dict()}


def add_ratios(rows: list[dict], primary: str, baselines: tuple[str, ...],
               key=lambda r: (r["m"], r["n"], r["k"])) -> None:
    """Per problem (`key`): `ratio_vs_bf16` = time of `primary` / own time on every row, and
    `ratio_vs` = {baseline: its time / own time} on the rows that are not baselines."""
    times: dict[tuple, dict[str, float]] = {}
    for r in rows:
        times.setdefault(key(r), {})[r["impl"]] = r["ms"]
    for r in rows:
        t = times[key(r)]
        if primary in t:
            r["ratio_vs_bf16"] = t[primary] / r["ms"]
        if r["impl"] not in baselines:
            r["ratio_vs"] = {b: t[b] / r["ms"] for b in baselines if b in t}


TIMING_METHOD = ("median over repeats of (inner back-to-back calls + one device sync) / inner, "
                 "warm-up excluded, each implementation checked against its reference first")


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark script shares (timing, budget, seed, output directory)."""
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (GPU 3, CPU 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples (GPU 15, CPU 3)")
    p.add_argument("--inner", type=int, default=None, help="calls per sample (GPU 5, CPU 1)")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="cap on one implementation's timed calls at one problem")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new problem after this many seconds (the rest are listed as skipped)")
    p.add_argument("--only", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                   metavar="PREFIX,...", help="run only the implementations whose names start so")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for the JSON record")


def timing_from_args(args: argparse.Namespace, on_gpu: bool) -> Timing:
    return Timing(
        warmup=args.warmup if args.warmup is not None else (3 if on_gpu else 1),
        repeats=args.repeats if args.repeats is not None else (15 if on_gpu else 3),
        inner=args.inner if args.inner is not None else (5 if on_gpu else 1),
        max_seconds=args.max_seconds,
    )


def torch_sync(torch):
    """A `sync` for torch outputs: waits for the device, returns its argument."""
    def sync(out):
        torch.cuda.synchronize()
        return out
    return sync


def to_torch(torch, x):
    """A jax/numpy array as a CUDA torch tensor (e4m3 and bf16 through integer views)."""
    arr = np.asarray(x)
    if arr.dtype == np.dtype(jnp.float8_e4m3fn):
        return torch.from_numpy(arr.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    if arr.dtype == np.dtype(jnp.bfloat16):
        return torch.from_numpy(arr.view(np.uint16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr)).cuda()


def torch_rel_error(out, ref) -> float:
    """`rel_error` of a torch output against a jax reference, in float32 on the host."""
    return rel_error(out.float().cpu().numpy(), np.asarray(ref, np.float32))


def parse_overrides(text: str, cls: type) -> dict:
    """'n_layers=1,mtp=false' -> {"n_layers": 1, "mtp": False}: overrides of dataclass `cls`'s
    fields, each converted like the field's default (as `parse_config`, without building a `cls`).
    An unknown field or a malformed item raises a ValueError that says which."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like name=value")
        if name not in fields:
            raise ValueError(f"{cls.__name__} has no field {name!r}; its fields are {', '.join(fields)}")
        default = fields[name].default
        out[name] = _parse_value(value, None if default is dataclasses.MISSING else default, name)
    return out


def recipe_overrides_arg(text: str) -> dict:
    """'quantize_impl=xla' -> overrides of `Fp8Recipe` (`TrainConfig.recipe_overrides`), for
    argparse: an unknown field, a malformed item or a recipe that refuses the values (a bad
    `quantize_impl`, say) is an argparse error that says which, before anything compiles."""
    from jfp8 import Fp8Recipe

    try:
        overrides = parse_overrides(text, Fp8Recipe)
        Fp8Recipe(**overrides)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise argparse.ArgumentTypeError(str(e))
    return overrides

"""Measures candidate configs per problem on this GPU and writes the tables that
`pallas_kernels.tuning` reads (the dense and grouped GEMMs' configs when the caller gives none).

    python benchmarks/tune_gemm.py                      # Hopper: small-M shapes, then DENSE_SHAPES
    python benchmarks/tune_gemm.py --shapes 64x7168x2048 256x7168x2048 --out-dtype float32
    python benchmarks/tune_gemm.py --grouped            # the grouped GEMM at GROUPED_TUNE_SHAPES
    python benchmarks/tune_gemm.py --grouped --shapes 8x128x4096x7168   # GxRxNxK
    python benchmarks/tune_gemm.py --dry-run            # anywhere: the candidates, nothing run

Dense, per problem MxNxK (a (M, K) in 1x128 tiles times b (N, K) in 128x128 blocks): the rule's
pick (`tuning.rule_config`), `GemmConfig()`, and a grid of both forms (one warpgroup on 64-row
tiles, one CTA per tile; warp-specialized persistent 128-row tiles) over tile_n and pipeline
depth, every one that fits the SMEM budget. Grouped (`--grouped`), per problem GxRxNxK (G equal
groups of R token rows against G weights (N, K)): the rule's pick (`tuning.grouped_rule_config`),
`GroupedGemmConfig()`, `GroupedGemmConfig.simple()` and the warp-specialized form over tile_n,
pipeline depth and tile order. Each is checked against the reference (`scaled_matmul_reference`,
`grouped_scaled_matmul_reference`) before it is timed (median of repeats after warm-up, device
synchronised); the fastest that passed becomes the problem's table entry, with its speed-up over
the default and over the rule.

Writes `<out>/tune_gemm-<device>-<date>.json` (`tune_grouped-...` with `--grouped`; every
measurement, with device, jax version and date) and merges the winners into the table (`--table`, default `<out>/gemm-<device>.json`, or
`<out>/grouped-<device>.json` with `--grouped`), written atomically; commit it under
`pallas_kernels/tuned/` to make it the library's default for that GPU model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.api import is_hopper
from _bench import (
    TIMING_METHOD,
    Case,
    add_common_args,
    budget_spent,
    device_rel_error,
    error_entry,
    gemm_row,
    parse_grouped_shape,
    parse_shape,
    random_normal,
    report_end,
    run_cases,
    shape_label,
    timing_from_args,
    within_budget,
    write_record,
)
from jfp8.reference import chunk_operand
from pallas_kernels import tuning
from pallas_kernels._mgpu import H100_NUM_SMS
from pallas_kernels.configs import SMEM_BYTES, GemmConfig, smem_bytes
from pallas_kernels.shapes import (
    DENSE_SHAPES,
    GROUPED_SHAPES,
    SMALL_GROUPED_SHAPES,
    SMALL_M_SHAPES,
    GemmShape,
    GroupedShape,
)

# Relative Frobenius error against the f32 reference: bf16 output rounding (2^-9) with margin;
# an f32 output differs only in the order of additions inside a chunk product.
TOL = {"bfloat16": 1e-2, "float32": 1e-5}
_OUT_DTYPES = tuple(TOL)
# The grouped problems tuned by default: few token rows per expert first (narrow tiles may win),
# then the MoE benchmark shapes.
GROUPED_TUNE_SHAPES: tuple[GroupedShape, ...] = (*SMALL_GROUPED_SHAPES, *GROUPED_SHAPES)


def candidates(m: int, n: int, kp: int, out_dtype, num_sms: int) -> list[GemmConfig]:
    """The configs tried at one problem, the rule's pick and the default first, without repeats
    and without any over the SMEM budget."""
    chunks = kp // jfp8.TILE
    found = [tuning.rule_config(m, n, kp, out_dtype, num_sms), GemmConfig()]
    one_wg = dataclasses.replace(GemmConfig.simple(), tile_m=64)
    for tile_n in (32, 64, 128) if m <= 64 else (64, 128):
        for stages in (2, 4, 5, 6, 8):
            found.append(dataclasses.replace(one_wg, tile_n=tile_n, max_concurrent_steps=stages))
            if m > 64:
                found.append(GemmConfig(tile_n=tile_n, max_concurrent_steps=stages))
            if m > 128 and stages in (4, 6):  # 2-CTA clusters need two row tiles to share b
                found.append(GemmConfig(tile_n=tile_n, max_concurrent_steps=stages, cluster_m=2))
            if m > 64 and n > tile_n and stages in (4, 6):  # ... or two column tiles to share a
                found.append(GemmConfig(tile_n=tile_n, max_concurrent_steps=stages, cluster_n=2))
    # b's block scale as the per-column vector instead of the default scalar (the tuner's b is
    # 128 x 128-block-scaled, as in Fprop/Dgrad)
    found += [dataclasses.replace(c, scalar_b_scale=False) for c in found
              if c.max_concurrent_steps in (4, 6) and jfp8.TILE % c.tile_n == 0]
    if m > 64:  # scale loads issued before the wgmma, on the default form with either b scale
        found += [GemmConfig(early_scale_loads=True), GemmConfig(early_scale_loads=True, scalar_b_scale=False)]
        # one pipeline over each CTA's tiles, alone and with the promotion switches
        found += [GemmConfig(run_ahead=True), GemmConfig(run_ahead=True, scalar_b_scale=True, early_scale_loads=True)]
    if m > 64 and n > 128:  # 128 x 192 / 256 tiles, which the scalar b scale makes fit in registers
        found += [GemmConfig(tile_n=192, scalar_b_scale=True, max_concurrent_steps=stages) for stages in (3, 4)]
        found += [GemmConfig(tile_n=256, scalar_b_scale=True, max_concurrent_steps=3),
                  GemmConfig(tile_n=192, scalar_b_scale=True, early_scale_loads=True, run_ahead=True)]
    if m > 128:  # 256-row tiles (64-row waves per consumer), alone and in clusters (issue 45)
        found += [GemmConfig(tile_m=256, max_concurrent_steps=3, **cluster)
                  for cluster in ({}, {"cluster_m": 2}, {"cluster_n": 2})]
    unique = list(dict.fromkeys(found))
    return [c for c in unique if smem_bytes(c, out_dtype, chunks) <= SMEM_BYTES]


def grouped_candidates(rows: int, n: int, kp: int, out_dtype, num_sms: int) -> list:
    """The `GroupedGemmConfig`s tried at one grouped problem (`rows` token rows in all), the
    rule's pick and the default first, without repeats and without any over the SMEM budget."""
    from pallas_kernels.configs import GroupedGemmConfig

    chunks = kp // jfp8.TILE
    found = [tuning.grouped_rule_config(rows, n, kp, out_dtype, num_sms), GroupedGemmConfig(),
             GroupedGemmConfig.simple()]
    # 128-wide tiles do not fit 6 stages (the SMEM filter below would drop them anyway).
    for tile_n, depths in ((64, (2, 4, 6)), (128, (2, 4))):
        for stages in depths:
            for group in (1, 8):
                found.append(GroupedGemmConfig(tile_n=tile_n, max_concurrent_steps=stages,
                                               grid_tile_group=group))
    # Issue 19's switches on the 4-stage forms: clusters along N (where there are two column
    # tiles to share a), the per-column weight-scale vector (the scalar is the default), early
    # scale loads, and all three.
    for base in [c for c in found if c.warp_specialized and c.max_concurrent_steps == 4]:
        found.append(dataclasses.replace(base, scalar_b_scale=False))
        found.append(dataclasses.replace(base, early_scale_loads=True))
        if n > base.tile_n:
            found.append(dataclasses.replace(base, cluster_n=2))
            found.append(dataclasses.replace(base, cluster_n=2, scalar_b_scale=True, early_scale_loads=True))
    if rows > 256:  # 256-row tiles (64-row waves per consumer), alone and along N (issue 45)
        found += [GroupedGemmConfig(tile_m=256, max_concurrent_steps=3, cluster_n=c) for c in (1, 2)]
    # By name: the rule's pick can be a clustered base whose switches repeat another base's with
    # scalar_b_scale=None instead of True, the same kernel (the tile's one weight block).
    named: dict[str, object] = {}
    for c in found:
        named.setdefault(config_name(c), c)
    unique = list(named.values())
    # The simple form's few SMEM slots always fit; the warp-specialized one is the dense budget.
    return [c for c in unique
            if not c.warp_specialized or smem_bytes(c, out_dtype, chunks) <= SMEM_BYTES]


def config_name(config) -> str:
    """A short name for a `GemmConfig` or `GroupedGemmConfig` (the same fields)."""
    form = "ws" if config.warp_specialized else "1wg"
    persistent = "p" if config.persistent else ""
    cluster = f"-c{config.cluster_m}" if getattr(config, "cluster_m", 1) > 1 else ""
    cluster += f"-n{config.cluster_n}" if config.cluster_n > 1 else ""
    scalar = "" if getattr(config, "scalar_b", True) else "-vb"  # the per-column b-scale vector
    early = "-es" if getattr(config, "early_scale_loads", False) else ""
    early += "-ra" if getattr(config, "run_ahead", False) else ""
    return (f"{form}{persistent}-{config.tile_m}x{config.tile_n}-s{config.max_concurrent_steps}"
            f"-g{config.grid_tile_group}{cluster}{scalar}{early}")


def best_entries(rows: list[dict]) -> list[dict]:
    """One table entry per problem (m, n, kp, out_dtype and, for the grouped kernel, groups):
    its fastest measured config."""
    by_problem: dict[tuple, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(tuning.entry_key(r), []).append(r)
    entries = []
    for (m, n, kp, out_dtype, groups), rs in by_problem.items():
        best = min(rs, key=lambda r: r["ms"])
        ms = {role: r["ms"] for r in rs for role in r.get("roles", ())}
        entries.append(dict(
            m=m, n=n, kp=kp, out_dtype=out_dtype, **({"groups": groups} if groups else {}),
            config=best["config"], impl=best["impl"],
            tflops=best["tflops"], ms=best["ms"], candidates=len(rs),
            speedup_vs_default=ms["default"] / best["ms"] if "default" in ms else None,
            speedup_vs_rule=ms["rule"] / best["ms"] if "rule" in ms else None,
        ))
    return entries


def _problem_name(entry: dict) -> str:
    """MxNxKp, or GxRxNxKp (R rows per group) for a grouped entry."""
    n, kp = entry["n"], entry["kp"]
    if "groups" in entry:
        return f"{entry['groups']}x{entry['m'] // entry['groups']}x{n}x{kp}"
    return f"{entry['m']}x{n}x{kp}"


def merge_table(path: pathlib.Path, entries: list[dict], device_kind: str,
                kind: str = "gemm") -> pathlib.Path:
    """Writes `entries` into the `kind` table at `path`, replacing those for the same problems
    and keeping the others; via a temporary file and an atomic rename (a crash leaves the old
    one). A table of the other kind at `path` is an error (its entries would be taken for this
    kernel's)."""
    old = json.loads(path.read_text()) if path.is_file() else dict(kind=kind, entries=[])
    if tuning.table_kind(old) != kind:
        raise ValueError(f"{path} is a {tuning.table_kind(old)!r} table; the {kind!r} winners "
                         "go to a table of their own (--table)")
    key = tuning.entry_key
    new_keys = {key(e) for e in entries}
    merged = sorted([e for e in old["entries"] if key(e) not in new_keys] + entries, key=key)
    table = dict(kind=kind, device=device_kind, jax_version=jax.__version__,
                 date=datetime.date.today().isoformat(), source="benchmarks/tune_gemm.py",
                 entries=merged)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    return path


@functools.partial(jax.jit, static_argnums=2)
def _operands(x, w, kp):
    a, b = jfp8.quantize(x, (1, jfp8.TILE)), jfp8.quantize(w, (jfp8.TILE, jfp8.TILE))
    a_data, a_scale = chunk_operand(a, kp)
    return a, b, a_data, a_scale


_reference = jax.jit(lambda a, b: jfp8.scaled_matmul_reference(a, b, jnp.float32))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _grouped_operands(x, w, rows_per_group, kp):
    a, b = jfp8.quantize(x, (1, jfp8.TILE)), jfp8.quantize(w, (jfp8.TILE, jfp8.TILE))
    a_data, a_scale = chunk_operand(a, kp)
    sizes = jnp.full((w.shape[0],), rows_per_group, jnp.int32)
    return a, b, a_data, a_scale, sizes


_grouped_reference = jax.jit(
    lambda a, b, sizes: jfp8.grouped_scaled_matmul_reference(a, b, sizes, jnp.float32)
)


class Problem(NamedTuple):
    """One problem to tune: its table key (m, n, kp), FLOPs, fields for its rows, and
    (config, roles, Case) per candidate."""

    m: int
    n: int
    k: int
    kp: int
    flops: float
    fields: dict
    cases: list


def _roles(config, rule, default) -> list[str]:
    # The rule's pick comes first; it may be the default too.
    return [role for role, c in (("rule", rule), ("default", default)) if c == config]


def _grouped_problem(shape: GroupedShape, out_dtype: str, seed: int, num_sms: int) -> Problem:
    from pallas_kernels import grouped_gemm

    g, r, n, k = shape
    kp = -(-k // jfp8.TILE) * jfp8.TILE
    x = random_normal(seed, (g * r, k))
    w = random_normal(seed + 1, (g, n, k)) / np.sqrt(k)
    a, b, a_data, a_scale, sizes = _grouped_operands(x, w, r, kp)
    ref = functools.cache(lambda: _grouped_reference(a, b, sizes))
    configs = grouped_candidates(g * r, n, kp, jnp.dtype(out_dtype), num_sms)
    cases = []
    for config in configs:
        kernel = jax.jit(lambda ad, sa, bd, sb, s, config=config: grouped_gemm.grouped_scaled_matmul(
            ad, sa, bd, sb, s, n=n, out_dtype=out_dtype, config=config))
        cases.append((config, _roles(config, configs[0], grouped_gemm.GroupedGemmConfig()), Case(
            config_name(config),
            lambda kernel=kernel: kernel(a_data, a_scale, b.data, b.scale, sizes),
            lambda out: device_rel_error(out, ref()), TOL[out_dtype], "fp8")))
    return Problem(g * r, n, k, kp, 2.0 * g * r * n * k, dict(groups=g), cases)


def _dense_problem(shape: GemmShape, out_dtype: str, seed: int, num_sms: int) -> Problem:
    from pallas_kernels import gemm

    m, n, k = shape
    kp = -(-k // jfp8.TILE) * jfp8.TILE
    x = random_normal(seed, (m, k))
    w = random_normal(seed + 1, (n, k)) / np.sqrt(k)
    a, b, a_data, a_scale = _operands(x, w, kp)
    ref = functools.cache(lambda: _reference(a, b))
    configs = candidates(m, n, kp, jnp.dtype(out_dtype), num_sms)
    cases = []
    for config in configs:
        roles = _roles(config, configs[0], GemmConfig())
        kernel = jax.jit(lambda ad, sa, bd, sb, config=config: gemm.scaled_matmul(
            ad, sa, bd, sb, n=n, b_block_rows=jfp8.TILE, out_dtype=out_dtype, config=config))
        cases.append((config, roles, Case(
            config_name(config), lambda kernel=kernel: kernel(a_data, a_scale, b.data, b.scale),
            lambda out: device_rel_error(out, ref()), TOL[out_dtype], "fp8")))
    return Problem(m, n, k, kp, 2.0 * m * n * k, {}, cases)


def _parse_any_shape(s: str):
    """MxNxK (dense) or GxRxNxK (grouped); main checks that it matches --grouped."""
    parts = s.lower().count("x") + 1
    if parts not in (3, 4):
        raise argparse.ArgumentTypeError(
            f"a shape is MxNxK (dense) or GxRxNxK (with --grouped), got {s!r}")
    return parse_grouped_shape(s) if parts == 4 else parse_shape(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_parse_any_shape, nargs="+", default=None,
                   metavar="MxNxK | GxRxNxK")
    p.add_argument("--grouped", action="store_true",
                   help="tune the grouped (MoE) GEMM: shapes are GxRxNxK, table grouped-<device>.json")
    p.add_argument("--out-dtype", choices=_OUT_DTYPES, default="bfloat16")
    p.add_argument("--table", type=pathlib.Path, default=None,
                   help="the table to merge the winners into (default <out>/gemm-<device>.json, "
                        "or <out>/grouped-<device>.json with --grouped)")
    p.add_argument("--dry-run", action="store_true", help="list the candidates; run nothing")
    add_common_args(p)
    args = p.parse_args(argv)
    shape_type = GroupedShape if args.grouped else GemmShape
    if args.shapes and not all(isinstance(s, shape_type) for s in args.shapes):
        p.error("with --grouped every shape is GxRxNxK; without it, MxNxK")

    device = jax.devices()[0]
    if args.grouped:
        shapes = args.shapes or GROUPED_TUNE_SHAPES
        kind, make_problem = "grouped", _grouped_problem
        find = lambda s, kp, dt, sms: grouped_candidates(s.groups * s.rows_per_group, s.n, kp, dt, sms)  # noqa: E731
    else:
        shapes = args.shapes or (*SMALL_M_SHAPES, *DENSE_SHAPES)
        kind, make_problem = "gemm", _dense_problem
        find = lambda s, kp, dt, sms: candidates(s.m, s.n, kp, dt, sms)  # noqa: E731
    num_sms = device.core_count if device.platform == "gpu" else H100_NUM_SMS
    out_dtype = jnp.dtype(args.out_dtype)
    if args.dry_run:
        for shape in shapes:
            kp = -(-shape.k // jfp8.TILE) * jfp8.TILE
            names = [config_name(c) for c in find(shape, kp, out_dtype, num_sms)]
            print(f"{shape_label(shape)}: {len(names)} candidates (rule first): {', '.join(names)}")
        return 0
    if not is_hopper(device):
        print(f"tune_gemm times the Mosaic GPU kernels and needs a Hopper GPU; this is "
              f"{device.device_kind!r} ({device.platform}). --dry-run lists the candidates anywhere.",
              file=sys.stderr)
        return 2

    timing = timing_from_args(args, True)
    print(f"device: {device.device_kind}; jax {jax.__version__}; {num_sms} SMs; out {args.out_dtype}; "
          f"{kind}")
    table = args.table or args.out / tuning.table_name(device.device_kind, kind)
    start = time.perf_counter()
    rows, failed, skipped = [], [], []

    def save():
        return write_record("tune_grouped" if args.grouped else "tune_gemm", rows, args.out,
                            timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
                            kind=kind, out_dtype=args.out_dtype, table=str(table),
                            entries=best_entries(rows), failed=failed, skipped=skipped)

    for shape, label in within_budget(shapes, shape_label, args.budget_s, start, skipped):
        try:
            problem = make_problem(shape, args.out_dtype, args.seed, num_sms)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", label, e))
            continue
        for j, (config, roles, case) in enumerate(problem.cases):
            if why := budget_spent(args.budget_s, start):
                # Checked per candidate (each is a compile and a timing), so that a problem that
                # starts late cannot run far past the budget; its rows so far still count.
                skipped += [dict(impl=c.name, problem=label, reason=why) for _, _, c in problem.cases[j:]]
                break
            row = functools.partial(gemm_row, device_kind=device.device_kind, flops=problem.flops,
                                    m=problem.m, n=problem.n, k=problem.k, kp=problem.kp,
                                    out_dtype=args.out_dtype, **problem.fields,
                                    config=dataclasses.asdict(config), roles=roles)
            run_cases([case], label, timing, row, rows, failed, args.only)
        save()
        if rows:  # after every problem, so that a run cut short keeps its winners
            merge_table(table, best_entries(rows), device.device_kind, kind)
    path = save()
    entries = best_entries(rows)
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\n{'MxNxKp|GxRxNxKp':>22s} {'best':>22s} {'TFLOP/s':>8} {'x default':>9} {'x rule':>7}")
    for e in entries:
        problem = _problem_name(e)
        print(f"{problem:>22s} {e['impl']:>22s} {e['tflops']:8.4g} "
              f"{fmt(e['speedup_vs_default']):>9} {fmt(e['speedup_vs_rule']):>7}")
    if entries:
        print(f"table: {table}")
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())

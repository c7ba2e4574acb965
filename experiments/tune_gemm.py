"""Measures candidate `GemmConfig`s per problem on this GPU and writes the table that
`pallas_kernels.tuning` reads (the dense GEMM's config when the caller gives none).

    python experiments/tune_gemm.py                      # Hopper: small-M shapes, then DENSE_SHAPES
    python experiments/tune_gemm.py --shapes 64x7168x2048 256x7168x2048 --out-dtype float32
    python experiments/tune_gemm.py --dry-run            # anywhere: the candidates, nothing run

Per problem MxNxK (a (M, K) in 1x128 tiles times b (N, K) in 128x128 blocks): the rule's pick
(`tuning.rule_config`), `GemmConfig()`, and a grid of both forms (one warpgroup on 64-row tiles,
one CTA per tile; warp-specialized persistent 128-row tiles) over tile_n and pipeline depth, every
one that fits the SMEM budget. Each is checked against `scaled_matmul_reference` before it is
timed (median of repeats after warm-up, device synchronised); the fastest that passed becomes the
problem's table entry, with its speed-up over `GemmConfig()` and over the rule.

Writes `<out>/tune_gemm-<device>-<date>.json` (every measurement, with device, jax version and
date) and merges the winners into the table (`--table`, default `<out>/gemm-<device>.json`),
written atomically; commit it as `pallas_kernels/tuned/gemm-<device>.json` to make it the
library's default for that GPU model.
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

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.backend import is_hopper
from jfp8.benchmarking import (
    TIMING_METHOD,
    Case,
    add_common_args,
    budget_spent,
    device_rel_error,
    error_entry,
    gemm_row,
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
from pallas_kernels.gemm import SMEM_BYTES, GemmConfig, smem_bytes
from pallas_kernels.shapes import DENSE_SHAPES, SMALL_M_SHAPES, GemmShape

# Relative Frobenius error against the f32 reference: bf16 output rounding (2^-9) with margin;
# an f32 output differs only in the order of additions inside a chunk product.
TOL = {"bfloat16": 1e-2, "float32": 1e-5}
_OUT_DTYPES = tuple(TOL)


def candidates(m: int, n: int, kp: int, out_dtype, num_sms: int) -> list[GemmConfig]:
    """The configs tried at one problem, the rule's pick and the default first, without repeats
    and without any over the SMEM budget."""
    chunks = kp // jfp8.TILE
    found = [tuning.rule_config(m, n, kp, out_dtype, num_sms), GemmConfig()]
    one_wg = dataclasses.replace(GemmConfig.simple(), tile_m=64)
    for tile_n in (32, 64, 128) if m <= 64 else (64, 128):
        for stages in (2, 4, 6, 8):
            found.append(dataclasses.replace(one_wg, tile_n=tile_n, max_concurrent_steps=stages))
            if m > 64:
                found.append(GemmConfig(tile_n=tile_n, max_concurrent_steps=stages))
    unique = list(dict.fromkeys(found))
    return [c for c in unique if smem_bytes(c, out_dtype, chunks) <= SMEM_BYTES]


def config_name(config: GemmConfig) -> str:
    form = "ws" if config.warp_specialized else "1wg"
    persistent = "p" if config.persistent else ""
    return (f"{form}{persistent}-{config.tile_m}x{config.tile_n}-s{config.max_concurrent_steps}"
            f"-g{config.grid_tile_group}")


def best_entries(rows: list[dict]) -> list[dict]:
    """One table entry per problem (m, n, kp, out_dtype): its fastest measured config."""
    by_problem: dict[tuple, list[dict]] = {}
    for r in rows:
        by_problem.setdefault((r["m"], r["n"], r["kp"], r["out_dtype"]), []).append(r)
    entries = []
    for (m, n, kp, out_dtype), rs in by_problem.items():
        best = min(rs, key=lambda r: r["ms"])
        ms = {role: r["ms"] for r in rs for role in r.get("roles", ())}
        entries.append(dict(
            m=m, n=n, kp=kp, out_dtype=out_dtype, config=best["config"], impl=best["impl"],
            tflops=best["tflops"], ms=best["ms"], candidates=len(rs),
            speedup_vs_default=ms["default"] / best["ms"] if "default" in ms else None,
            speedup_vs_rule=ms["rule"] / best["ms"] if "rule" in ms else None,
        ))
    return entries


def merge_table(path: pathlib.Path, entries: list[dict], device_kind: str) -> pathlib.Path:
    """Writes `entries` into the table at `path`, replacing those for the same problems and
    keeping the others; via a temporary file and an atomic rename (a crash leaves the old one)."""
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    key = lambda e: (e["m"], e["n"], e["kp"], e["out_dtype"])  # noqa: E731
    new_keys = {key(e) for e in entries}
    merged = sorted([e for e in old if key(e) not in new_keys] + entries, key=key)
    table = dict(device=device_kind, jax_version=jax.__version__,
                 date=datetime.date.today().isoformat(), source="experiments/tune_gemm.py",
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


def _cases(shape: GemmShape, out_dtype: str, seed: int, num_sms: int):
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
        # The rule's pick comes first; it may be the default too.
        roles = [role for role, c in (("rule", configs[0]), ("default", GemmConfig())) if c == config]
        kernel = jax.jit(lambda ad, sa, bd, sb, config=config: gemm.scaled_matmul(
            ad, sa, bd, sb, n=n, b_block_rows=jfp8.TILE, out_dtype=out_dtype, config=config))
        cases.append((config, roles, Case(
            config_name(config), lambda kernel=kernel: kernel(a_data, a_scale, b.data, b.scale),
            lambda out: device_rel_error(out, ref()), TOL[out_dtype], "fp8")))
    return kp, cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="MxNxK")
    p.add_argument("--out-dtype", choices=_OUT_DTYPES, default="bfloat16")
    p.add_argument("--table", type=pathlib.Path, default=None,
                   help="the table to merge the winners into (default <out>/gemm-<device>.json)")
    p.add_argument("--dry-run", action="store_true", help="list the candidates; run nothing")
    add_common_args(p)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    shapes = args.shapes or (*SMALL_M_SHAPES, *DENSE_SHAPES)
    num_sms = device.core_count if device.platform == "gpu" else H100_NUM_SMS
    out_dtype = jnp.dtype(args.out_dtype)
    if args.dry_run:
        for m, n, k in shapes:
            kp = -(-k // jfp8.TILE) * jfp8.TILE
            names = [config_name(c) for c in candidates(m, n, kp, out_dtype, num_sms)]
            print(f"{m}x{n}x{k}: {len(names)} candidates (rule first): {', '.join(names)}")
        return 0
    if not is_hopper(device):
        print(f"tune_gemm times the Mosaic GPU kernels and needs a Hopper GPU; this is "
              f"{device.device_kind!r} ({device.platform}). --dry-run lists the candidates anywhere.",
              file=sys.stderr)
        return 2

    timing = timing_from_args(args, True)
    print(f"device: {device.device_kind}; jax {jax.__version__}; {num_sms} SMs; out {args.out_dtype}")
    table = args.table or args.out / tuning.table_name(device.device_kind)
    start = time.perf_counter()
    rows, failed, skipped = [], [], []

    def save():
        return write_record("tune_gemm", rows, args.out,
                            timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
                            out_dtype=args.out_dtype, table=str(table), entries=best_entries(rows),
                            failed=failed, skipped=skipped)

    for shape, label in within_budget(shapes, shape_label, args.budget_s, start, skipped):
        m, n, k = shape
        try:
            kp, cases = _cases(shape, args.out_dtype, args.seed, num_sms)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", label, e))
            continue
        for j, (config, roles, case) in enumerate(cases):
            if why := budget_spent(args.budget_s, start):
                # Checked per candidate (each is a compile and a timing), so that a problem that
                # starts late cannot run far past the budget; its rows so far still count.
                skipped += [dict(impl=c.name, problem=label, reason=why) for _, _, c in cases[j:]]
                break
            row = functools.partial(gemm_row, device_kind=device.device_kind, flops=2.0 * m * n * k,
                                    m=m, n=n, k=k, kp=kp, out_dtype=args.out_dtype,
                                    config=dataclasses.asdict(config), roles=roles)
            run_cases([case], label, timing, row, rows, failed, args.only)
        save()
        if rows:  # after every problem, so that a run cut short keeps its winners
            merge_table(table, best_entries(rows), device.device_kind)
    path = save()
    entries = best_entries(rows)
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\n{'MxNxKp':>18s} {'best':>22s} {'TFLOP/s':>8} {'x default':>9} {'x rule':>7}")
    for e in entries:
        problem = f"{e['m']}x{e['n']}x{e['kp']}"
        print(f"{problem:>18s} {config_name(GemmConfig(**e['config'])):>22s} {e['tflops']:8.4g} "
              f"{fmt(e['speedup_vs_default']):>9} {fmt(e['speedup_vs_rule']):>7}")
    if entries:
        print(f"table: {table}")
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())

"""Which config the dense and grouped GEMMs run for a problem when the caller gives none.

Two sources, in order:
1. A table measured on this GPU model by `benchmarks/tune_gemm.py` (`tuned/gemm-<device>.json`
   for the dense kernel, `tuned/grouped-<device>.json` for the grouped one, next to this file,
   or the files named by `$JFP8_GEMM_TABLE` / `$JFP8_GROUPED_TABLE`): for the problem's (N, Kp,
   output dtype) — and for the grouped kernel its number of groups G — the fastest config found
   at the measured M nearest to this one in log2 M, if that M is within a factor
   `TABLE_M_REACH` of it. Layers have fixed N, K (and G) and vary M (tokens; for the grouped
   kernel all groups' token rows together, measured with equal groups), so that is the axis to
   interpolate along; further away the best form may differ (memory- vs compute-bound), and the
   rule decides. Each table records its kind, and a table of the other kind is an error.
2. Else a rule predicted from the kernel's structure (not measured): `rule_config`,
   `grouped_rule_config`.

Every config computes the same bits (the promotion order does not depend on the tiling), so the
choice only moves speed. Tests check the rules' invariants (valid, within SMEM, grid filled) on
random problems, lower their picks at the small-M shapes and run them in the interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib

import jax.numpy as jnp

from pallas_kernels import _mgpu
from pallas_kernels._hopper import SMEM_BYTES, TILE_K, WGMMA_M
from pallas_kernels.configs import GemmConfig, GroupedGemmConfig, smem_bytes

TABLE_DIR = pathlib.Path(__file__).resolve().parent / "tuned"
TABLE_ENV = "JFP8_GEMM_TABLE"
GROUPED_TABLE_ENV = "JFP8_GROUPED_TABLE"
# The two tables: kind -> the environment variable that can name its file.
TABLE_KINDS = {"gemm": TABLE_ENV, "grouped": GROUPED_TABLE_ENV}
# Deepest pipeline the rule asks for; small tiles leave SMEM for more.
MAX_STAGES = 8
# Narrowest tiles the rule uses, in both forms. Narrower tiles fill more SMs but re-read a more
# often: every column tile streams the whole [tile_m, K] panel of a from L2, so at 64 x 32 tiles
# the L2 would deliver a twice for each byte of b it delivers from HBM.
MIN_TILE_N = 64
# A measured table entry stands for Ms within this factor of its own.
TABLE_M_REACH = 2.0


def rule_config(m: int, n: int, kp: int, out_dtype, num_sms: int) -> GemmConfig:
    """The config predicted to be fastest for `a [m, kp] @ b [n, kp].T` (not measured).

    - Compute-bound problems (enough 128 x 128 tiles to fill the SMs): `GemmConfig()`, the
      warp-specialized, persistent 128 x 128 form.
    - M <= 64, memory-bound (every byte of b is used for at most 64 rows): one warpgroup on 64-row
      tiles (two consumers would multiply 64 rows of zero padding), one CTA per tile so that
      several CTAs share an SM and keep more loads in flight.
    - Too few tiles to give every SM some of b to stream: narrower tiles (halving tile_n, not
      below `MIN_TILE_N`) while that adds tiles, until the grid covers the SMs.
    - Smaller tiles get deeper pipelines (more stages, up to `MAX_STAGES`, as SMEM allows): at
      short per-chunk compute, latency is hidden only by more copies in flight.

    What no config here can do: fill the GPU when even 64-wide tiles are fewer than the SMs
    (e.g. M = 64, N = 2112: 33 tiles). Splitting K across CTAs would, but it sums the promoted
    chunks in another order than the reference (one running FP32 sum, chunk after chunk), so
    the bits would change; jfp8 keeps them.
    """
    small_m = m <= WGMMA_M
    base = GemmConfig.simple() if small_m else GemmConfig()  # simple(): 64-row tiles, 1 CTA/tile
    return _narrowed(base, -(-m // base.tile_m), n, kp, out_dtype, num_sms, deepen=small_m)


def _narrowed(base, row_tiles: int, n: int, kp: int, out_dtype, num_sms: int, *, deepen: bool):
    """`base` (a GemmConfig or GroupedGemmConfig) with tile_n halved, not below `MIN_TILE_N`,
    while `row_tiles` x column tiles leave SMs idle and halving adds tiles; deeper pipelines
    (`MAX_STAGES`) for narrowed tiles or with `deepen`; then stages cut to fit SMEM."""
    tile_n = base.tile_n
    while (tile_n > MIN_TILE_N and row_tiles * -(-n // tile_n) < num_sms
           and -(-n // (tile_n // 2)) > -(-n // tile_n)):
        tile_n //= 2
    stages = MAX_STAGES if deepen or tile_n != base.tile_n else base.max_concurrent_steps
    config = dataclasses.replace(base, tile_n=tile_n, max_concurrent_steps=stages)
    chunks = max(kp // TILE_K, 1)
    # Sized for the vector b scale (a tile-scaled b, Wgrad): the larger of the two layouts.
    while (config.max_concurrent_steps > 2
           and smem_bytes(config, out_dtype, chunks, scalar_b=False) > SMEM_BYTES):
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def grouped_rule_config(rows: int, n: int, kp: int, out_dtype, num_sms: int):
    """The `GroupedGemmConfig` predicted to be fastest for `rows` token rows (all groups) against
    weights of `n` x `kp` (not measured): the dense rule's narrowing. Group boundaries only add
    row tiles, so cdiv(rows, tile_m) is the fewest there can be: `GroupedGemmConfig()` wherever
    that many fill the SMs (the MoE benchmark shapes), narrower column tiles below."""

    base = GroupedGemmConfig()
    return _narrowed(base, -(-rows // base.tile_m), n, kp, out_dtype, num_sms, deepen=False)


def grouped_config(rows: int, n: int, kp: int, out_dtype, *, groups: int,
                   device_kind: str | None = None, num_sms: int | None = None):
    """The config `grouped_gemm.grouped_scaled_matmul` runs when given none: measured table
    (`grouped-<device>.json`, entries for `groups` groups only), else `grouped_rule_config`."""
    device_kind = _mgpu.device_kind() if device_kind is None else device_kind
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    tuned = table_config(rows, n, kp, out_dtype, device_kind, kind="grouped", groups=groups)
    return tuned if tuned is not None else grouped_rule_config(rows, n, kp, out_dtype, num_sms)


def _check_kind(kind: str) -> None:
    if kind not in TABLE_KINDS:
        raise ValueError(f"table kind must be one of {sorted(TABLE_KINDS)}, got {kind!r}")


def table_name(device_kind: str, kind: str = "gemm") -> str:
    """The table's file name for a GPU model, e.g. 'gemm-nvidia-h100-80gb-hbm3.json'."""
    _check_kind(kind)
    return f"{kind}-{device_kind.lower().replace(' ', '-')}.json"


def table_path(device_kind: str, kind: str = "gemm") -> pathlib.Path:
    """Where the measured table for `device_kind` lives (its environment variable overrides)."""
    _check_kind(kind)
    if os.environ.get(TABLE_KINDS[kind]):
        return pathlib.Path(os.environ[TABLE_KINDS[kind]])
    return TABLE_DIR / table_name(device_kind, kind)


def _config_class(kind: str):
    if kind == "grouped":

        return GroupedGemmConfig
    return GemmConfig


def table_kind(table: dict) -> str:
    """The kind a table says it is ("gemm" for tables that predate the field)."""
    return table.get("kind", "gemm")


def entry_key(entry: dict) -> tuple:
    """A table entry's problem: (m, n, kp, out_dtype, groups); groups 0 in the dense table."""
    return (int(entry["m"]), int(entry["n"]), int(entry["kp"]),
            jnp.dtype(entry["out_dtype"]).name, int(entry.get("groups", 0)))


@functools.cache
def _load_table(path: pathlib.Path, version: tuple, kind: str) -> tuple[tuple[tuple, object], ...]:
    """(`entry_key`, config) per entry of a `tune_gemm.py` table; cached per version (the file's
    mtime, size and inode: a rewritten table is read again). A function already traced under jit
    keeps the config it was traced with."""
    del version  # part of the cache key only
    config_class = _config_class(kind)
    try:
        table = json.loads(path.read_text())
        if table_kind(table) != kind:
            raise ValueError(f"it is a {table_kind(table)!r} table, not a {kind!r} one")
        return tuple((entry_key(e), config_class(**e["config"])) for e in table["entries"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{kind} tuning table {path} is unreadable ({type(e).__name__}: {e}); regenerate it "
            f"with benchmarks/tune_gemm.py, delete it, or point ${TABLE_KINDS[kind]} elsewhere"
        ) from e


def table_config(m: int, n: int, kp: int, out_dtype, device_kind: str, kind: str = "gemm",
                 groups: int = 0):
    """The measured config for (n, kp, out_dtype, groups) at the M nearest to `m` (log2), or None
    when there is none within a factor `TABLE_M_REACH` of `m`. `kind`: "gemm" (a `GemmConfig`;
    groups 0) or "grouped" (a `GroupedGemmConfig`; M counts all `groups` groups' rows)."""
    path = table_path(device_kind, kind)
    if not path.is_file():
        return None
    stat = path.stat()
    problem = (n, kp, jnp.dtype(out_dtype).name, groups)
    same = [
        (abs(math.log2(em) - math.log2(max(m, 1))), em, config)
        for (em, *rest), config in _load_table(
            path, (stat.st_mtime_ns, stat.st_size, stat.st_ino), kind
        )
        if tuple(rest) == problem and em > 0
    ]
    near = [t for t in same if t[0] <= math.log2(TABLE_M_REACH)]
    return min(near, key=lambda t: t[:2])[2] if near else None


def dense_config(m: int, n: int, kp: int, out_dtype, *, device_kind: str | None = None,
                 num_sms: int | None = None) -> GemmConfig:
    """The config `gemm.scaled_matmul` runs when given none: measured table, else the rule."""
    device_kind = _mgpu.device_kind() if device_kind is None else device_kind
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    tuned = table_config(m, n, kp, out_dtype, device_kind)
    return tuned if tuned is not None else rule_config(m, n, kp, out_dtype, num_sms)

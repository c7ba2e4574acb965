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
   `grouped_rule_config`, which score tile shapes and 2-CTA clusters with a cost model
   (`modelled`: MMA time, L2 -> SMEM bytes, waves on the SMs), as DeepGEMM's heuristics do.

Every config computes the same bits (the promotion order does not depend on the tiling), so the
choice only moves speed. Tests check the rules' invariants (valid, within SMEM, fastest in the
model among layouts that compile without spills) on random problems, their picks at the
benchmark shapes, the model's arithmetic by hand, lower the picks and run them in the
interpreter.
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
from pallas_kernels._hopper import SCALE_BOX, SMEM_BYTES, TILE_K, WGMMA_M
from pallas_kernels.configs import GemmConfig, GroupedGemmConfig, smem_bytes
from pallas_kernels.fp8_math import TILE

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


# Hopper's throughput as the model sees it (per SM per clock), not measured here:
# - FP8 wgmma, dense: 1979 TFLOP/s over 132 SMs at 1.83 GHz = 8192 FLOP per SM per cycle, so a
#   64 x 128 x 128 unit of MMA work takes 256 cycles (docs/gpu.md, the census).
# - L2 -> SMEM: about 6 KB per cycle for the whole GPU (DeepGEMM's SM90 heuristic models
#   min(64 B x SMs, 8e6 / 1.3e3) B/cycle), at most 64 B per cycle into one SM.
TENSOR_FLOP_PER_SM_CYCLE = 8192
# The model's resolution: layouts whose modelled cycles are within this fraction of the fewest
# count as equally fast, and the one with the fewest L2 bytes is picked (the model's L2 figure
# is a rough constant, and L2 traffic is what the measured kernel was short of). Set with two
# cases in view, not measured: at 8192^3 256 x 128 along N (DeepGEMM's choice) models 1.6 %
# slower than 128 x 192 along M with 15 % fewer bytes; on the grouped N 7168, K 2048 shape the
# pick models 1.8 % slower than DeepGEMM's layout (which the grouped kernels cannot run).
MODEL_RESOLUTION = 0.02
L2_BYTES_PER_CYCLE = 6144
L2_BYTES_PER_SM_CYCLE = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config's shape as the model sees it: the CTA tile and the 2-CTA cluster, if any."""

    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1

    @classmethod
    def of(cls, config) -> Layout:
        return cls(config.tile_m, config.tile_n, getattr(config, "cluster_m", 1), config.cluster_n)


# The layouts the rule picks among (warp-specialized forms, M > 64): each compiled for sm_90a
# with no spills (`benchmarks/hopper_build.py` RULE_FORMS, held by tests/test_hopper_build.py);
# 256-row tiles promote in 64-row waves (`_mainloop._promote_waves`) and fit SMEM beside a bf16
# output tile only (`_fits`). Not here: 256-wide tiles, which spill (hopper_build.KNOWN_DEFECTS),
# and 192-wide tiles with a per-column b scale (a tile-scaled b), whose three 64 x 192 f32
# register tiles would not fit a consumer's 232 registers; the grouped kernels have no clusters
# along M and no scalar b scale over two weight blocks, so no 192-wide tiles either.
DENSE_LAYOUTS = (
    Layout(128, 128), Layout(128, 128, cluster_m=2), Layout(128, 128, cluster_n=2),
    Layout(128, 192), Layout(128, 192, cluster_m=2), Layout(128, 192, cluster_n=2),
    Layout(128, 64),
    Layout(256, 128), Layout(256, 128, cluster_m=2), Layout(256, 128, cluster_n=2),
)
GROUPED_LAYOUTS = (Layout(128, 128), Layout(128, 128, cluster_n=2), Layout(128, 64),
                   Layout(256, 128), Layout(256, 128, cluster_n=2))
# The one-warpgroup form's layouts (`GemmConfig.simple()` narrowed, `_narrowed`): the rule's picks
# at M <= 64 and for few-tile problems at M > 64 (`_few_tiles`); held to clean rows as above.
ONE_WARPGROUP_LAYOUTS = (Layout(64, 128), Layout(64, 64))


@dataclasses.dataclass(frozen=True)
class Modelled:
    """What the cost model predicts for one config on one problem (not measured).

    Attributes:
      tiles: output tiles with work in them.
      waves: tiles / SMs, e.g. 544 tiles on 132 SMs: 4.12.
      wave_efficiency: waves / ceil(waves) (in clusters: over the cluster slots), 4.12 -> 0.82:
        the share of the SMs' time in which they hold a tile.
      l2_bytes: L2 -> SMEM bytes of the operands and their scales, plus the output stored, for
        the whole problem; a 2-CTA cluster fetches its shared operand once (multicast).
      flops: 2 M N K.
      cycles: modelled SM cycles: full waves x per-tile cycles, a tile taking, per K step, the
        longer of its MMA and its share of the L2 bandwidth.
    """

    tiles: int
    waves: float
    wave_efficiency: float
    l2_bytes: int
    flops: int
    cycles: int

    @property
    def l2_bytes_per_flop(self) -> float:
        return self.l2_bytes / self.flops

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "l2_bytes_per_flop": self.l2_bytes_per_flop}


def rule_config(m: int, n: int, kp: int, out_dtype, num_sms: int, *,
                scalar_b: bool = True, few_tiles: bool = True) -> GemmConfig:
    """The config predicted to be fastest for `a [m, kp] @ b [n, kp].T` (not measured).

    `scalar_b`: b is block-scaled (Fprop, Dgrad; False: tile-scaled, Wgrad), which wider tiles
    need (`DENSE_LAYOUTS`). `few_tiles=False`: at M > 64, the warp-specialized pick even where
    the one-warpgroup form models faster (a bisect's other side).

    - M > 64: the `DENSE_LAYOUTS` entry with the fewest modelled cycles (`modelled`: per K
      step the longer of the tile's MMA and its share of the L2 bandwidth, times the full waves
      on `num_sms` SMs), as DeepGEMM's SM90 heuristic scores its block shapes; 2-CTA clusters
      only where the tiles make more than one wave (there, as in DeepGEMM, there is no later
      wave for the halved L2 traffic to speed up); only layouts that fit SMEM. Cycles within
      `MODEL_RESOLUTION` of the fewest are a tie, which goes to fewer L2 bytes, then to no
      cluster, then to the earlier layout (128 x 128 first). 64-wide tiles get deeper pipelines
      (`MAX_STAGES`, as SMEM allows): at short per-chunk compute, latency is hidden only by
      more copies in flight.
    - M <= 64, memory-bound (every byte of b is used for at most 64 rows): one warpgroup on 64-row
      tiles (two consumers would multiply 64 rows of zero padding), one CTA per tile so that
      several CTAs share an SM and keep more loads in flight; column tiles halved (not below
      `MIN_TILE_N`) until the grid covers the SMs, and deep pipelines.
    - M > 64 with few tiles (`_few_tiles`): where the pick above leaves SMs idle, the same
      one-warpgroup form on 64-row tiles, narrowed as at M <= 64, when the model says it is
      faster by more than its resolution: twice the row tiles keep more SMs loading. The Wgrads
      of narrow layers are such problems (d_model 768: 6 row tiles of 128, K = the step's
      tokens), and so is any layer whose output is small beside its contraction.

    What no config here can do: fill the GPU when even 64 x 64 tiles are fewer than the SMs
    (e.g. M = 64, N = 2112: 33 tiles). Splitting K across CTAs would, but it sums the promoted
    chunks in another order than the reference (one running FP32 sum, chunk after chunk), so
    the bits would change; jfp8 keeps them.
    """
    if m <= WGMMA_M:  # simple(): 64-row tiles, 1 CTA/tile
        return _narrowed(GemmConfig.simple(), -(-m // WGMMA_M), n, kp, out_dtype, num_sms,
                         deepen=True)
    layouts = [lay for lay in DENSE_LAYOUTS if scalar_b or lay.tile_n <= TILE]
    best = _best_layout(layouts, m, n, kp, out_dtype, num_sms, scalar_b=scalar_b)
    config = _staged(GemmConfig(tile_m=best.tile_m, tile_n=best.tile_n, cluster_m=best.cluster_m,
                                cluster_n=best.cluster_n), kp, out_dtype)
    return _few_tiles(config, m, n, kp, out_dtype, num_sms, scalar_b=scalar_b) if few_tiles else config


def _few_tiles(config: GemmConfig, m: int, n: int, kp: int, out_dtype, num_sms: int, *,
               scalar_b: bool) -> GemmConfig:
    """`config`, or where its tiles leave SMs idle the one-warpgroup form on 64-row tiles
    (`GemmConfig.simple()` narrowed as `_narrowed` narrows it for M <= 64: column tiles halved
    while the grid does not cover the SMs), if the model gives it fewer cycles than `config` by
    more than `MODEL_RESOLUTION`. Not measured: the model sees tile shapes, not that one
    warpgroup both loads and computes (with `MAX_STAGES` of loads in flight)."""
    def model(c):
        return modelled(c, m, n, kp, num_sms, out_dtype=out_dtype, scalar_b=scalar_b)

    current = model(config)
    if current.tiles >= num_sms:
        return config
    narrow = _narrowed(GemmConfig.simple(), -(-m // WGMMA_M), n, kp, out_dtype, num_sms, deepen=True)
    return narrow if model(narrow).cycles < current.cycles * (1 - MODEL_RESOLUTION) else config


def grouped_rule_config(rows: int, n: int, kp: int, out_dtype, num_sms: int, *, groups: int = 1):
    """The `GroupedGemmConfig` predicted to be fastest for `rows` token rows in `groups` groups
    against weights of `n` x `kp` (not measured): the dense rule's scoring over
    `GROUPED_LAYOUTS`. A group boundary inside a row tile splits it into two work items, each
    with the whole K loop, so the model counts cdiv(rows, tile_m) + groups - 1 row tiles: what
    groups of token counts not known when the kernel is built (an MoE step's) make at most,
    and about as many as they make (a boundary falls on a tile edge once in tile_m). Taller
    tiles lose more to the split ones, which is why many small groups keep 128-row tiles. A tile
    taller than 128 rows is a candidate only where the groups average at least its height: the
    model prices a tile's MMA whatever its rows, and cannot see that a short group's tile is
    mostly other groups' rows computed for nothing."""
    layouts = [lay for lay in GROUPED_LAYOUTS if lay.tile_m <= TILE or rows >= groups * lay.tile_m]
    best = _best_layout(layouts, rows, n, kp, out_dtype, num_sms, scalar_b=True,
                        config_class=GroupedGemmConfig, groups=groups)
    return _staged(GroupedGemmConfig(tile_m=best.tile_m, tile_n=best.tile_n,
                                     cluster_n=best.cluster_n), kp, out_dtype)


def modelled(config, m: int, n: int, kp: int, num_sms: int, *, out_dtype=jnp.bfloat16,
             scalar_b: bool = True, groups: int = 1) -> Modelled:
    """The cost model's numbers for `config` (a GemmConfig, GroupedGemmConfig or `Layout`) on
    an M x N x Kp problem (grouped: M = all `groups` groups' rows, counted as cdiv(M, tile_m) +
    groups - 1 row tiles, `grouped_rule_config`) on `num_sms` SMs; pure Python.
    `scalar_b`: b's scale arrives as one 128-byte box per K step (else a tile_n-wide vector)."""
    lay = config if isinstance(config, Layout) else Layout.of(config)
    rows, cols = -(-m // lay.tile_m), -(-n // lay.tile_n)
    if rows:
        rows += groups - 1
    cluster = lay.cluster_m * lay.cluster_n
    slots = max(num_sms // cluster, 1)  # clusters resident at once, one CTA per SM
    launched = -(-rows // lay.cluster_m) * -(-cols // lay.cluster_n)  # cluster tiles
    full_waves = -(-launched // slots)
    tiles = rows * cols
    if tiles == 0:  # an empty problem: no tile, no wave, nothing to wait for
        return Modelled(tiles=0, waves=0.0, wave_efficiency=1.0, l2_bytes=0, flops=0, cycles=0)
    f32 = jnp.dtype(jnp.float32).itemsize
    steps = max(-(-kp // TILE_K), 1)
    a_step = lay.tile_m * TILE_K + lay.tile_m * f32  # fp8 chunk + its row scales
    b_step = lay.tile_n * TILE_K + (SCALE_BOX if scalar_b else lay.tile_n) * f32
    step_bytes = a_step / lay.cluster_n + b_step / lay.cluster_m  # the shared operand: half each
    out_bytes = lay.tile_m * lay.tile_n * jnp.dtype(out_dtype).itemsize
    # Each SM's share of the L2 bandwidth, as if all were loading: an idle SM's share is lost
    # (DeepGEMM's assumption), which is what the partial last wave costs.
    bandwidth = min(L2_BYTES_PER_SM_CYCLE, L2_BYTES_PER_CYCLE / num_sms)
    mma = lay.tile_m * lay.tile_n * TILE_K * 2 / TENSOR_FLOP_PER_SM_CYCLE
    tile_cycles = steps * max(mma, step_bytes / bandwidth) + out_bytes / bandwidth
    return Modelled(
        tiles=tiles,
        waves=tiles / num_sms,
        wave_efficiency=tiles / (full_waves * slots * cluster),
        l2_bytes=round(launched * cluster * (steps * step_bytes + out_bytes)),
        flops=2 * m * n * kp,
        cycles=round(full_waves * tile_cycles),
    )


def _best_layout(layouts, m, n, kp, out_dtype, num_sms, *, scalar_b: bool, config_class=GemmConfig,
                 groups: int = 1) -> Layout:
    """The layout with the fewest modelled cycles, where cycles within `MODEL_RESOLUTION` of the
    fewest count as a tie, which goes to fewer L2 bytes, then to no cluster, then to the earlier
    layout; clusters only over more than one wave; only layouts whose staged config fits SMEM."""
    got = {lay: modelled(lay, m, n, kp, num_sms, out_dtype=out_dtype, scalar_b=scalar_b, groups=groups)
           for lay in layouts}
    allowed = [(i, lay) for i, lay in enumerate(layouts)
               if (lay.cluster_m * lay.cluster_n == 1 or got[lay].tiles > num_sms)  # the tiles the model counts
               and _fits(lay, kp, out_dtype, config_class)]
    fewest = min(got[lay].cycles for _, lay in allowed)
    ties = [(i, lay) for i, lay in allowed if got[lay].cycles <= fewest * (1 + MODEL_RESOLUTION)]
    return min(ties, key=lambda item: (got[item[1]].l2_bytes, item[1].cluster_m * item[1].cluster_n, item[0]))[1]


def _fits(lay: Layout, kp: int, out_dtype, config_class) -> bool:
    """Whether `lay`'s config, staged as the rule stages it, fits a block's SMEM (a 256 x 128
    tile beside an f32 output tile does not, even at 2 stages)."""
    fields = {"cluster_m": lay.cluster_m} if config_class is GemmConfig else {}
    config = _staged(config_class(tile_m=lay.tile_m, tile_n=lay.tile_n, cluster_n=lay.cluster_n, **fields),
                     kp, out_dtype)
    return smem_bytes(config, out_dtype, max(kp // TILE_K, 1), scalar_b=False) <= SMEM_BYTES


def _staged(config, kp: int, out_dtype):
    """`config` with `MAX_STAGES` for tiles narrower than `TILE` (short per-chunk compute), its
    own stages otherwise, cut to fit SMEM."""
    if config.tile_n < TILE:
        config = dataclasses.replace(config, max_concurrent_steps=MAX_STAGES)
    return _fit_smem(config, kp, out_dtype)


def _fit_smem(config, kp: int, out_dtype):
    chunks = max(kp // TILE_K, 1)
    # Sized for the vector b scale (a tile-scaled b, Wgrad): the larger of the two layouts.
    while (config.max_concurrent_steps > 2
           and smem_bytes(config, out_dtype, chunks, scalar_b=False) > SMEM_BYTES):
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def _narrowed(base, row_tiles: int, n: int, kp: int, out_dtype, num_sms: int, *, deepen: bool):
    """`base` with tile_n halved, not below `MIN_TILE_N`, while `row_tiles` x column tiles leave
    SMs idle and halving adds tiles; deeper pipelines (`MAX_STAGES`) for narrowed tiles or with
    `deepen`; then stages cut to fit SMEM."""
    tile_n = base.tile_n
    while (tile_n > MIN_TILE_N and row_tiles * -(-n // tile_n) < num_sms
           and -(-n // (tile_n // 2)) > -(-n // tile_n)):
        tile_n //= 2
    stages = MAX_STAGES if deepen or tile_n != base.tile_n else base.max_concurrent_steps
    return _fit_smem(dataclasses.replace(base, tile_n=tile_n, max_concurrent_steps=stages), kp,
                     out_dtype)


def grouped_config(rows: int, n: int, kp: int, out_dtype, *, groups: int,
                   device_kind: str | None = None, num_sms: int | None = None):
    """The config `grouped_gemm.grouped_scaled_matmul` runs when given none: measured table
    (`grouped-<device>.json`, entries for `groups` groups only), else `grouped_rule_config`."""
    device_kind = _mgpu.device_kind() if device_kind is None else device_kind
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    tuned = table_config(rows, n, kp, out_dtype, device_kind, kind="grouped", groups=groups)
    return tuned if tuned is not None else grouped_rule_config(rows, n, kp, out_dtype, num_sms, groups=groups)


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
                 num_sms: int | None = None, scalar_b: bool = True) -> GemmConfig:
    """The config `gemm.scaled_matmul` runs when given none: measured table, else the rule
    (`scalar_b`: b is block-scaled, as `rule_config`)."""
    device_kind = _mgpu.device_kind() if device_kind is None else device_kind
    num_sms = _mgpu.num_sms() if num_sms is None else num_sms
    tuned = table_config(m, n, kp, out_dtype, device_kind)
    if tuned is not None:
        return tuned
    return rule_config(m, n, kp, out_dtype, num_sms, scalar_b=scalar_b)

"""Small helpers shared by the Mosaic GPU kernels: interpret mode and CUDA lowering off-GPU."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import io
import itertools
import os
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax._src.interpreters import batching
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jax_core
from jax.interpreters import mlir
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import fp8_math, kernel_cache

# The machine the kernels are written for; used to lower (and to size persistent grids) on a
# machine without a GPU.
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
H100_NUM_SMS = 132


def h100_abstract_mesh() -> AbstractMesh:
    """A one-device abstract mesh that looks like an H100 (132 SMs), for lowering without a GPU."""
    device = AbstractDevice(device_kind=H100_DEVICE_KIND, num_cores=H100_NUM_SMS, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=device)


def interpret_params(*, detect_races: bool = False) -> plgpu.InterpretGPUParams:
    """GPU-interpreter settings for tests: every buffer the kernel allocates, its outputs included,
    starts as NaN (so a tile the kernel forgets to write shows up), and out-of-bounds reads raise."""
    return plgpu.InterpretGPUParams(
        uninitialized_memory="nan", out_of_bounds_reads="raise", detect_races=detect_races
    )


@contextlib.contextmanager
def interpret_mode(interpret: bool, *, detect_races: bool = False):
    """Run the Mosaic GPU kernels in the enclosed calls in the GPU interpreter when `interpret`."""
    if not interpret:
        yield
        return
    with plgpu.force_gpu_interpret_mode(interpret_params(detect_races=detect_races)):
        yield


# The Mosaic GPU interpreter runs every warpgroup of a cluster's CTAs at once, each as an XLA:CPU
# program of its own. With fewer CPU devices than this, XLA:CPU did not run them all, and a 2-CTA
# cluster whose 4 stages were refilled deadlocked for good (2026-11-28, 2-core machine: 1 and 2
# devices hung, 4 and 8 finished; CPU affinity and synchronous dispatch changed nothing).
INTERPRET_CLUSTER_CPU_DEVICES = 4


def warn_if_interpreted_cluster_may_hang(cluster_size: int) -> None:
    """A warning, when a kernel of `cluster_size` > 1 CTAs is interpreted with too few CPU devices
    (`INTERPRET_CLUSTER_CPU_DEVICES`), that says how to get more."""
    if cluster_size > 1 and interpreting() and len(jax.devices("cpu")) < INTERPRET_CLUSTER_CPU_DEVICES:
        warnings.warn(
            f"interpreting a {cluster_size}-CTA cluster kernel with {len(jax.devices('cpu'))} CPU device(s): the "
            f"Mosaic GPU interpreter can deadlock with fewer than {INTERPRET_CLUSTER_CPU_DEVICES} (its warpgroups "
            "never all run). Set XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax, or "
            "interpret a config without clusters (cluster_m = cluster_n = 1).",
            RuntimeWarning, stacklevel=3)


def interpreting() -> bool:
    """True inside `interpret_mode(True)` (or jax's `force_gpu_interpret_mode`): kernels traced
    here run in the interpreter, whatever platform the computation is lowered for."""
    from jax._src import config  # the flag force_gpu_interpret_mode sets (no public getter)

    return config.pallas_tpu_interpret_mode_context_manager.value is not None


def _abstract_gpu():
    """The abstract mesh's device when it is a GPU with a known SM count (lowering off-GPU, e.g.
    `h100_abstract_mesh`), else None (a CPU mesh, e.g. inside shard_map on this machine)."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is None or abstract.platform not in ("gpu", "cuda") or abstract.num_cores is None:
        return None
    return abstract


# Set by `build_target`: (device kind, SM count) of the GPU a deviceless compile targets.
_TARGET: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("jfp8_build_target", default=None)


@contextlib.contextmanager
def build_target(device_kind: str, num_sms: int):
    """Kernels traced inside this block are built for this GPU (its SM count sizes persistent
    grids, its kind picks tuned configs): for compiling deviceless, for a GPU described by an XLA
    target config rather than present (`benchmarks/hopper_build.py`)."""
    token = _TARGET.set((device_kind, num_sms))
    try:
        yield
    finally:
        _TARGET.reset(token)


def num_sms() -> int:
    """SM count for persistent grids: the build target's (`build_target`), the abstract device's
    when lowering off-GPU, the real GPU's when there is one, else an H100's (interpreter runs on
    CPU)."""
    if (target := _TARGET.get()) is not None:
        return target[1]
    abstract = _abstract_gpu()
    if abstract is not None:
        return abstract.num_cores
    device = jax.devices()[0]
    if device.platform == "gpu":
        return device.core_count
    return H100_NUM_SMS


def deviceless_gpu_kind() -> str | None:
    """The GPU a computation traced now is built for without one present: the build target's
    kind (`build_target`), the abstract GPU mesh's, or None (no such target: a real device decides)."""
    if (target := _TARGET.get()) is not None:
        return target[0]
    abstract = _abstract_gpu()
    return abstract.device_kind if abstract is not None else None


def device_kind() -> str:
    """The GPU model the kernels are built for, the same way as `num_sms`."""
    if (target := _TARGET.get()) is not None:
        return target[0]
    abstract = _abstract_gpu()
    if abstract is not None:
        return abstract.device_kind
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else H100_DEVICE_KIND


_PTXAS_ISA_VERSION: list[int] = []  # the process's ptxas PTX ISA version, once asked


def _asked_once(ask) -> int:
    """ptxas's PTX ISA version from `ask()`, asked at most once per process."""
    if not _PTXAS_ISA_VERSION:
        version = ask()  # (may itself be the asked-once wrapper, which keeps it)
        if not _PTXAS_ISA_VERSION:
            _PTXAS_ISA_VERSION.append(version)
    return _PTXAS_ISA_VERSION[0]


def _ptxas_isa_version():
    """The PTX ISA version Mosaic GPU lowers FP8 conversions for (asked once per process), or None
    without the plugin or ptxas: part of a kept kernel's key (`kernel_cache`)."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        return _asked_once(mosaic_gpu_lib._mosaic_gpu_ext._get_ptxas_isa_version)
    except Exception:  # noqa: BLE001 - no plugin, no ptxas: nothing to key on
        return None


@contextlib.contextmanager
def ptxas_version_asked_once():
    """Inside this block, Mosaic GPU asks ptxas its PTX ISA version once per process.

    jax 0.11.2 asks at every FP8 conversion it lowers (`FragmentedArray.astype` calls the CUDA
    plugin's `_get_ptxas_isa_version`, which runs `ptxas` in a subprocess, ~12 ms): ~7 times per
    FP8 kernel, 357 runs and 4.4 s of the tiny FP8 training step's lowering on the 2-core machine
    (measured with a timing wrapper around ptxas; `benchmarks/hopper_train_build.py`). The
    answer cannot change within a process. Nothing changes where the plugin is not installed
    (lowering on a host without it fails earlier, or runs the interpreter)."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ask = ext._get_ptxas_isa_version
    except (ImportError, AttributeError):
        yield
        return

    def once():
        return _asked_once(ask)

    ext._get_ptxas_isa_version = once
    try:
        yield
    finally:
        ext._get_ptxas_isa_version = ask


_DUMP_BASENAME = "mosaic_gpu.dump_basename"
_REUSE_LOCK = threading.Lock()  # guards the one-time installs and the lowered-kernel table


@contextlib.contextmanager
def stable_kernel_payloads():
    """Inside this block, a Mosaic GPU kernel lowered twice gives the same custom-call payload.

    jax 0.11.2 serializes two things into a kernel's payload, whose hash keys the process's
    compiled kernels, that differ from one lowering of the same kernel to the next: a
    `mosaic_gpu.dump_basename` attribute from a process-wide counter (`anonymous_0`,
    `anonymous_1`, ...: the name its debug dumps would take), and source locations, some of which
    depend on what jax's tracing caches held (a second lowering located some index arithmetic at
    `jfp8/api.py` instead of the kernel's own lines). So every kernel of the eval step was compiled
    again after the train step's in the same process, and a program's persistent-cache key
    depended on what the process had lowered before it (issue 44). Both are dropped before the
    module is serialized: the attribute names dump files only (the compiler sets it again when
    dumping is on) and locations are debug information. `JFP8_KERNEL_LOCATIONS=1` keeps both
    (for a profiler's or sanitizer's source lines), at the price of the sharing (and turns off
    `reuse_lowered_kernels`, which would give a kernel another program's locations). Nothing
    changes where the plugin is not installed.
    """
    if _keeps_locations() or not _install_stable():
        yield
        return
    token = _STABLE.set(True)
    try:
        yield
    finally:
        _STABLE.reset(token)


# Set by `stable_kernel_payloads`; read by one wrapper of jax's serializer, installed once (no module
# global swapped per op: threads and nested ops each see their own).
_STABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("jfp8_stable_payloads", default=False)


def _install_stable() -> bool:
    """Wrap Mosaic GPU's serializer once per process; False without the plugin."""
    return _install_once("stable_kernel_payloads", _wrap_serializer)


def _wrap_serializer() -> None:
    from jax._src.lib.mlir import passmanager
    from jax.experimental.mosaic.gpu import core as mgpu_core

    serde = mgpu_core._run_serde_pass

    def stable(module, *args, **kwargs):
        if _STABLE.get():
            attributes = module.operation.attributes
            if _DUMP_BASENAME in attributes:
                del attributes[_DUMP_BASENAME]
            with module.context:
                passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
        return serde(module, *args, **kwargs)

    mgpu_core._run_serde_pass = stable


_INSTALLED: dict[str, bool] = {}


def _install_once(name: str, install) -> bool:
    """Run `install()`, which wraps a jax function, once per process; whether it could (False
    where jax lacks what it wraps: no Mosaic GPU plugin, another jax)."""
    with _REUSE_LOCK:
        if name not in _INSTALLED:
            try:
                install()
                _INSTALLED[name] = True
            except (ImportError, AttributeError):
                _INSTALLED[name] = False
        return _INSTALLED[name]


# Kernels lowered in this process: (kernel function key, ordinal, GPU, compiler params, launch shape,
# module name, operand types, jax mesh, digest of the traced body) -> the Mosaic module as bytecode
# and the rest of its lowering result (`reuse_lowered_kernels`).
_LOWERED: collections.OrderedDict = collections.OrderedDict()
_MAX_LOWERED = 1024
LOWERING_STATS = collections.Counter()  # "lowered", "reused"
# Set by `reuse_lowered_kernels`: its key and a counter of the kernels lowered under it so far.
_REUSE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jfp8_reuse_lowered", default=None)


def _keeps_locations() -> bool:
    return os.environ.get("JFP8_KERNEL_LOCATIONS", "0") not in ("", "0")


@contextlib.contextmanager
def reuse_lowered_kernels(key):
    """Inside this block, the Mosaic GPU kernels an op lowers are lowered once per process.

    jfp8 lowers one op at one shape and static arguments once per program (`jfp8.api._Choice`'s
    `key`), but a second program (the eval step after the train step) lowered every kernel again:
    ~0.25 s of Python each, 3.7-4.5 s of the tiny eval step's first jit for Hopper after the train
    step (issue 44). Here the Pallas lowering of each kernel is kept, keyed by `key` (the kernel
    function with its static arguments: `jfp8.api` passes its choice key's first part), the
    kernel's ordinal among those the function lowers, the GPU it is built for (`device_kind`,
    `num_sms`), the kernel's compiler parameters (a profiled kernel is another kernel), its launch
    shape (every field of jax's Mosaic GPU mesh: the lowering takes the grid from it) and module
    name, the operand types, jax's mesh under shard_map and a digest of the kernel's traced body,
    as the module's bytecode beside the rest of the lowering result, and a later lowering under
    the same key parses it back into the new program instead of lowering the kernel again: the
    same payload (`stable_kernel_payloads`; tests/test_kernel_dedupe.py checks it against a fresh
    lowering). Not in the key: the operands' tree and the reference, so that two call sites of one
    kernel function whose operands differ only outside the kernel (a GEMM reached through two
    Fp8Tensors cut to two logical N after it) share one lowering (issue 44: 8 of the 45 lowerings
    of the tiny FP8 train step for an H100). The body's text does not carry everything a lowering
    reads (jax prints a barrier without its arrival count, a copy without its out-of-bounds mode,
    a callable parameter by its name), so it only tells apart kernels of one function and
    ordinal, as a config chosen while tracing (a measured table's) would make them; the function
    and the ordinal keep other kernels apart. A body that closes over constants is lowered as
    usual.
    With a kernel cache directory (`pallas_kernels.kernel_cache`: `JFP8_KERNEL_CACHE_DIR`, or the
    training scripts' `~/.cache/jfp8/mosaic-kernels`) the table is also kept on disk, so a later
    process parses back what an earlier one lowered.
    The key and a counter of the kernels lowered under it live in a context variable read by one
    wrapper of jax's lowering function, installed once: no module global is swapped per op, so
    threads and nested ops each see their own. `key=None` (an op without one),
    `JFP8_KERNEL_LOCATIONS=1` (each lowering keeps its own source locations) or a missing plugin:
    lowered as usual.
    """
    if key is None or _keeps_locations() or not _install_reuse():
        yield
        return
    token = _REUSE.set((key, itertools.count()))
    try:
        yield
    finally:
        _REUSE.reset(token)


def _install_reuse() -> bool:
    """Wrap jax's Pallas Mosaic GPU lowering function once per process; False without the plugin."""
    return _install_once("reuse_lowered_kernels", _wrap_lowering)


def _wrap_lowering() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu import lowering as pallas_lowering

    lower = pallas_lowering.lower_unpipelined_jaxpr_to_module

    def reused(mesh, jax_mesh, jaxpr, in_avals, out_avals, params, *args, **kwargs):
        op = _REUSE.get()
        if op is None or jaxpr.constvars:  # constvars: values the body's text names, not spells out
            return lower(mesh, jax_mesh, jaxpr, in_avals, out_avals, params, *args, **kwargs)
        key, ordinal = op
        # jax's mesh (under shard_map) decides a kernel's peers and how axis names resolve.
        mesh_key = None if jax_mesh is None else (tuple(jax_mesh.shape.items()), type(jax_mesh).__name__)
        # The kernel's traced body, as a digest of its text (~5 ms a kernel): whatever the kernel
        # function chose while it was traced (a config from a measured table rewritten since, say).
        # Printed whole: numpy abbreviates a long array's text ("[0 1 ... 99]"), and two bodies
        # differing only there would share a key.
        with np.printoptions(threshold=sys.maxsize):
            body = hashlib.sha256(str(jaxpr).encode()).hexdigest()
        # The module's name: jax names it after the kernel body's function.
        name = getattr(getattr(jaxpr, "debug_info", None), "func_name", None)
        entry = (key, next(ordinal), device_kind(), num_sms(), params, _gpu_mesh_key(mesh), name, tuple(in_avals),
                 tuple(out_avals), mesh_key, body)
        try:
            hash(entry)
        except TypeError:
            return lower(mesh, jax_mesh, jaxpr, in_avals, out_avals, params, *args, **kwargs)
        with _REUSE_LOCK:
            cached = _LOWERED.get(entry)
        if cached is not None:
            bytecode, rest = cached
            LOWERING_STATS["reused"] += 1
            return pallas_lowering.LoweringResult(ir.Module.parse(bytecode), *rest)
        kept = kernel_cache.load(entry, _ptxas_isa_version)  # on disk from an earlier process
        if kept is not None:
            try:
                module = ir.Module.parse(kept[0])
            except Exception:  # noqa: BLE001 - damaged bytes under a good key: lower it again
                kernel_cache.count("unreadable")
            else:
                _remember(entry, *kept)
                LOWERING_STATS["reused"] += 1
                return pallas_lowering.LoweringResult(module, *kept[1])
        result = lower(mesh, jax_mesh, jaxpr, in_avals, out_avals, params, *args, **kwargs)
        LOWERING_STATS["lowered"] += 1
        if result.profiler_spec is None:
            buffer = io.BytesIO()
            result.module.operation.write_bytecode(buffer)
            rest = (result.grid, result.block, result.new_out_shapes, result.profiler_spec, result.gmem_scratch_shapes)
            _remember(entry, buffer.getvalue(), rest)
            kernel_cache.store(entry, _ptxas_isa_version, buffer.getvalue(), rest)
        return result

    pallas_lowering.lower_unpipelined_jaxpr_to_module = reused


def _gpu_mesh_key(mesh) -> tuple:
    """The kernel's launch shape as jax's Mosaic GPU mesh gives it, every field of it (grid,
    cluster, warpgroups, their names, the kernel's name). The lowering takes the grid from the
    mesh, and a body's text need not name it (one that reads `lax.axis_size` does not), so one
    body text launched on two grids may be two kernels."""
    if not dataclasses.is_dataclass(mesh):
        return (repr(mesh),)
    frozen = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
    return (type(mesh).__name__, *((f.name, frozen(getattr(mesh, f.name))) for f in dataclasses.fields(mesh)))


def _remember(entry: tuple, bytecode: bytes, rest: tuple) -> None:
    with _REUSE_LOCK:
        _LOWERED[entry] = (bytecode, rest)
        while len(_LOWERED) > _MAX_LOWERED:
            _LOWERED.popitem(last=False)


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """StableHLO text of `jax.jit(fn)(*args, **kwargs)` lowered for CUDA, on any machine.

    Lowering is where Mosaic GPU checks real Hopper limits (wgmma layouts, TMA sizes and
    alignment, shared-memory budgets) that the interpreter does not.
    """
    with jax.sharding.use_abstract_mesh(h100_abstract_mesh()):
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


# Set by `profile`: (trace directory, events per warpgroup) for the kernels traced inside it.
_PROFILE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "jfp8_mosaic_profile", default=None
)


@contextlib.contextmanager
def profile(directory: str, events: int = 1024):
    """Kernels *traced* inside this block record Mosaic GPU profiler events: each `jax.named_scope`
    region of a kernel body (the GEMM main loop's "wgmma" and "promote"), per warpgroup, into a
    Perfetto trace per launch in `directory`. Decided at trace time: a function jitted earlier
    keeps the kernel it compiled. `events` bounds the events one warpgroup records: the buffer
    lives in shared memory (16 bytes an event and warpgroup, next to the kernel's own stages),
    and events past it are dropped, so a long launch is traced over its first tiles only."""
    token = _PROFILE.set((str(directory), events))
    try:
        yield
    finally:
        _PROFILE.reset(token)


def compiler_params() -> dict:
    """`plgpu.kernel` keyword arguments for the current `profile` block ({} outside one)."""
    spec = _PROFILE.get()
    if spec is None:
        return {}
    return {"compiler_params": plgpu.CompilerParams(
        profile_space=spec[1], profile_dir=spec[0], profile_bounds_check=True)}


# ---------------------------------------------------------------------------------------------
# The IEEE reciprocal inside a kernel.
#
# Mosaic GPU hands its kernels to LLVM with `-nvptx-prec-divf32=1` (a fixed option of jaxlib's
# CUDA plugin), so an f32 `1 / x` in a kernel becomes `rcp.approx.f32`: up to one ulp off the
# correctly rounded reciprocal that XLA, PyTorch's `reciprocal()` and DeepGEMM's quantizers use.
# One ulp in a scale's reciprocal flips an encoded E4M3 value only where `x * (1 / scale)` lands
# on a rounding tie, which structured data hits often: an amax that is a power of two (bf16
# inputs), or a dequantized E4M3 tile (`retile`) whose ratios are short binary fractions. Seen on
# an H100 (2026-11-26): `retile` differed from the reference in 6 bytes at the smoke shape while
# the interpreter, whose division is exact, matched bit for bit, and matched on the H100 too once
# this was fixed. `ieee_reciprocal` emits PTX `rcp.rn.f32` (round to nearest even, subnormals
# kept) instead.


ieee_reciprocal_p = jax_core.Primitive("jfp8_ieee_reciprocal")
ieee_reciprocal_p.def_impl(functools.partial(dispatch.apply_primitive, ieee_reciprocal_p))
ieee_reciprocal_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
# In XLA (and so in the interpreter): the reference's own rule.
mlir.register_lowering(ieee_reciprocal_p, mlir.lower_fun(fp8_math.reciprocal, multiple_results=False))
batching.defvectorized(ieee_reciprocal_p)


def ieee_reciprocal(x: jax.Array) -> jax.Array:
    """`1 / x` for f32 `x`, correctly rounded in a Mosaic GPU kernel too (see above); in XLA and
    in the interpreter it is the plain division, which is correctly rounded there already."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"ieee_reciprocal takes float32, got {x.dtype}")
    return ieee_reciprocal_p.bind(x)


def _rcp_rn(value):
    """PTX `rcp.rn.f32` of one f32 MLIR value."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    return llvm.inline_asm(ir.F32Type.get(), [value], "rcp.rn.f32 $0, $1;", "=f,f")


def _ieee_reciprocal_mosaic(ctx, x):
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
    from jax.experimental import mosaic

    [aval] = ctx.avals_in
    if isinstance(x, mosaic.gpu.FragmentedArray):
        return x._pointwise(x._lift_fast_instr(_rcp_rn))
    return _rcp_rn(mgpu_lowering._ensure_ir_value(x, aval.dtype))


def _register_mosaic_rule() -> None:
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
    from jax.experimental import mosaic

    mgpu_lowering.register_lowering_rule(ieee_reciprocal_p, mosaic.gpu.LoweringSemantics.Lane)(
        _ieee_reciprocal_mosaic)


_register_mosaic_rule()


# ---------------------------------------------------------------------------------------------
# Zeros in the registers of a dead value: the next wgmma wave's accumulator.


def zeros_in_registers_of(x: jax.Array) -> jax.Array:
    """f32 zeros shaped like `x`, a WGMMA-layout register array whose value is dead after this
    call, held in `x`'s own registers: each is overwritten by an inline `mov.b32 r, 0` whose
    output is tied to its input (PTX register `r` of `x`).

    For a wgmma accumulator (`acc_ref[...] = zeros_in_registers_of(partial)`): the PTX then
    writes the next wgmma's accumulator into the registers that hold `x`, after the reads of
    `x`, and ptxas 13.5 keeps that order and those registers instead of issuing the wgmma
    early into registers of its own (`_mainloop._promote_waves`; observed, not promised: CI's
    deviceless build holds it through the 256-row forms' spills and accumulator chains); it
    still sees the zeros and issues the wgmma without reading its accumulator (`RZ, !UPT`).
    Lowering only (the GPU interpreter has no registers to reuse). Uses Mosaic GPU's
    `FragmentedArray._pointwise` and `_lift_fast_instr`, as `ieee_reciprocal` does."""
    if x.dtype != jnp.float32:
        raise TypeError(f"zeros_in_registers_of takes float32, got {x.dtype}")
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout))
    def tied_zeros(ctx, value):
        del ctx
        return value._pointwise(value._lift_fast_instr(_tied_zero))

    return tied_zeros(x)


def _tied_zero(value):
    """PTX `mov.b32 r, 0` into the register of one f32 MLIR value (output tied to input)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    return llvm.inline_asm(ir.F32Type.get(), [value], "mov.b32 $0, 0;", "=f,0", has_side_effects=True)

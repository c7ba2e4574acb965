"""The one door between jfp8 and its Mosaic GPU kernels: every quantizer and GEMM chooses here.

Each function takes `impl` and `interpret`, with one default, `impl="auto"`:

- `"xla"`: the reference (`jfp8.fp8`, `jfp8.reference`), on any device.
- `"mosaic"`: the Pallas Mosaic GPU kernels (`pallas_kernels`), bit-identical to the reference in
  the interpreter. They lower for CUDA on any host, a CPU login node included (an ahead-of-time
  build, `jax.export`); a computation that runs them on a device that cannot (a CPU, a GPU that is
  not a Hopper) raises an error saying so, when it is lowered or run there.
- `"auto"`: decided when the computation is lowered, per platform (a primitive with one lowering
  for CUDA and one for everything else, so that the kernels are traced only when lowered for
  CUDA): the kernels where it is lowered for CUDA, the reference anywhere else; on a machine whose
  GPU is not a Hopper, the reference. Called eagerly, it goes by the device the inputs are on.

`interpret=True` runs the kernels in the Mosaic GPU interpreter on any machine (tests, slow).
Inputs the kernels do not take (a scaling block or dtype they have no kernel for) run the
reference under "auto", which has the same numerics, and raise NotImplementedError naming what is
missing under "mosaic". Nothing falls back silently from an explicit choice.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from typing import Callable, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
import jax.extend
from jax.interpreters import batching, mlir

from jfp8 import fp8, precompile, reference
from jfp8.fp8 import AMAX_FLOOR, GRAD_AMAX_FLOOR, TILE, Block, Fp8Tensor, _check_block
from jfp8.reference import check_nt_operands, chunk_operand
from pallas_kernels import _mgpu, gemm, grouped_gemm, grouped_wgrad, kernel_cache, ragged
from pallas_kernels import quantize as qk

Impl: TypeAlias = Literal["xla", "mosaic", "auto"]
IMPLS = ("xla", "mosaic", "auto")
_BLOCK = (TILE, TILE)


def is_hopper(device: jax.Device | None = None) -> bool:
    """True for an NVIDIA GPU of compute capability 9.x (H100, H200, H800)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def traced_for_hopper() -> bool:
    """True when what is traced now will run on a Hopper GPU, as far as tracing can tell: a
    deviceless build for one (`pallas_kernels._mgpu.build_target`, an abstract H100 mesh), else
    the abstract mesh's devices (a CPU mesh: False), else `jax.default_device`'s, else this
    process's default device. For choices made when tracing (`jfp8.attention`); the kernels here
    choose later, when the computation is lowered. A jit placed elsewhere by its arguments or by
    `jax.jit(..., device=...)` is not seen: pass impl="xla" there."""
    kind = _mgpu.deviceless_gpu_kind()
    if kind is not None:
        return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200"))
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.platform not in ("gpu", "cuda"):
        return False  # a mesh of CPU devices (shard_map on a host), whatever the default device is
    default = jax.config.jax_default_device  # `jax.default_device(...)`: where an unplaced jit runs
    if default is not None:
        if isinstance(default, str):
            return default in ("gpu", "cuda") and is_hopper(jax.devices(default)[0])
        return is_hopper(default)
    return is_hopper(jax.devices()[0])


def _local_non_hopper_gpu() -> jax.Device | None:
    """A GPU of this machine that cannot run the kernels, or None (Hopper GPUs, or none at all)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend: a CPU host, which may still lower for CUDA
        return None
    return next((d for d in gpus if not is_hopper(d)), None)


def _mosaic_unavailable(where: str) -> str:
    return (f"impl='mosaic' runs the Mosaic GPU kernels, which need a Hopper GPU (sm_90), but {where}; "
            "use impl='auto' (the kernels where they can run, the reference elsewhere), impl='xla' "
            "(the reference, same numerics) or interpret=True (the kernels in the interpreter)")


# Under a trace, the choice is one primitive whose lowering depends on the platform: the
# reference's jaxpr (traced now, it also gives the result types) lowers anywhere, and the kernels
# are traced only when the computation is lowered for CUDA. A CPU host that never lowers for CUDA
# never traces a kernel (`jax.lax.platform_dependent` would trace both branches up front).
_choice_p = Primitive("jfp8_kernel_or_reference")
_choice_p.multiple_results = True


class _Choice(NamedTuple):
    """The primitive's parameters. Two choices are equal when they have the same `key` (see
    `_choice_key`), else only when they are the same object. jax caches a primitive's lowering per
    module by its parameters and operand types, so every call of one op at one shape, static
    arguments and build target is lowered once, whatever layer or call site it comes from: one
    Mosaic kernel (one payload, compiled once) instead of one per call site."""

    reference: jax.extend.core.ClosedJaxpr  # flat args -> flat results
    kernel: Callable  # flat args -> flat results, traced only when lowered for CUDA
    mosaic: bool  # impl="mosaic": lowering for anything but CUDA raises
    key: tuple | None = None

    def __eq__(self, other):
        if self is other:
            return True
        return isinstance(other, _Choice) and self.key is not None and self.key == other.key

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self.key) if self.key is not None else id(self)


def keep_lowered_kernels(path: str | os.PathLike | None) -> pathlib.Path | None:
    """Keep the Mosaic GPU kernels' Pallas lowerings in the folder `path` from now on in this
    process (None: not on disk unless `JFP8_KERNEL_CACHE_DIR` says so), so that a later process
    parses them back instead of lowering them again (`pallas_kernels.kernel_cache`; the training
    scripts call it through `jfp8.train.compile_cache.enable()`). Returns the folder in use."""
    return kernel_cache.set_directory(path)


def _callable_key(fn: Callable) -> tuple | None:
    """What `fn` computes, as a hashable value, when that is knowable from the function itself:
    a module-level function, or a `functools.partial` of one with hashable arguments (static
    Python values: blocks, dtypes, floors, flags). None for anything else (a closure may hold
    anything): such a choice stays equal only to itself."""
    args, keywords = (), {}
    while isinstance(fn, functools.partial):
        args, keywords = fn.args + args, {**fn.keywords, **keywords}
        fn = fn.func
    if getattr(fn, "__qualname__", "").count("<") or not hasattr(fn, "__module__"):
        return None  # a lambda or a function defined inside another: it may close over anything
    key = (fn.__module__, fn.__qualname__, args, tuple(sorted(keywords.items())))
    try:
        hash(key)
    except TypeError:  # a traced or mutable argument
        return None
    return key


def _choice_key(kernel: Callable, xla: Callable, in_tree, flat: list, mosaic: bool) -> tuple | None:
    """The key of a choice between `kernel` and `xla` on these operands: both functions' keys,
    the operands' tree (static metadata such as an Fp8Tensor's block and logical shape) and
    types, or None when either function has no key. The build target (`_mgpu.build_target`),
    the GPU and a `_mgpu.profile` block are read when the kernel is traced, which is while the
    module is lowered: one value for the whole module, so they need not be in it."""
    kernel_key, xla_key = _callable_key(kernel), _callable_key(xla)
    if kernel_key is None or xla_key is None:
        return None
    avals = tuple((tuple(x.shape), jnp.dtype(x.dtype), getattr(jax.typeof(x), "weak_type", False)) for x in flat)
    return (kernel_key, xla_key, in_tree, avals, mosaic)


def _flat(fn: Callable, in_tree, out_tree_box: list) -> Callable:
    def run(*flat):
        outs, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, flat)))
        if out_tree_box and out_tree_box[0] != tree:
            raise TypeError(f"the kernels' results {tree} differ in structure from the reference's {out_tree_box[0]}")
        out_tree_box[:] = [tree]
        return outs

    return run


# The reference's jaxpr of each keyed choice, traced once per process instead of once per call
# site (a model's layers call each op at a handful of shapes): choice key + the operands' full
# types (sharding and varying mesh axes included) + the trace context -> (ClosedJaxpr, out tree).
_REFERENCE_JAXPRS: dict = {}
_MAX_REFERENCE_JAXPRS = 4096


def _trace_context() -> tuple:
    """What else a reference's jaxpr may depend on: the mesh being traced under and the config
    that changes what jax's numerics functions emit."""
    return (jax.sharding.get_abstract_mesh(), jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
            jax.config.jax_numpy_rank_promotion, jax.config.jax_numpy_dtype_promotion)


def _bind_choice(kernel_flat: Callable, reference_flat: Callable, flat: list, mosaic: bool,
                 key: tuple | None = None, out_tree_box: list | None = None) -> list:
    cache_key = None
    if key is not None and out_tree_box is not None:
        try:
            cache_key = (key, tuple(jax.typeof(x) for x in flat), _trace_context())
            hash(cache_key)
        except TypeError:  # something in it is not hashable: trace as usual
            cache_key = None
    if cache_key is not None and cache_key in _REFERENCE_JAXPRS:
        reference, tree = _REFERENCE_JAXPRS[cache_key]
        out_tree_box[:] = [tree]
        return _choice_p.bind(*flat, choice=_Choice(reference, kernel_flat, mosaic, key))
    reference = jax.make_jaxpr(reference_flat)(*flat)
    closes_over_tracers = any(isinstance(c, jax.core.Tracer) for c in reference.consts)
    if cache_key is not None and not closes_over_tracers:
        if len(_REFERENCE_JAXPRS) >= _MAX_REFERENCE_JAXPRS:
            _REFERENCE_JAXPRS.clear()
        _REFERENCE_JAXPRS[cache_key] = (reference, out_tree_box[0])
    if closes_over_tracers:
        # The reference closed over traced values, which cannot live in a parameter: they become
        # leading operands (the kernel ignores them).
        consts, jaxpr, n = list(reference.consts), reference.jaxpr, len(reference.consts)
        reference = jax.make_jaxpr(
            lambda *c_and_args: jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, c_and_args[:n]))(
                *c_and_args[n:]))(*consts, *flat)
        kernel_flat = functools.partial(_drop_leading, n, kernel_flat)
        flat = [*consts, *flat]
        key = None  # traced values the key does not describe
    return _choice_p.bind(*flat, choice=_Choice(reference, kernel_flat, mosaic, key))


def _drop_leading(n: int, fn: Callable, *args):
    return fn(*args[n:])


def _choose_when_lowered(impl: Impl, kernel: Callable, xla: Callable, args: tuple):
    flat, in_tree = jax.tree.flatten(args)
    out_tree: list = []
    reference_flat = _flat(xla, in_tree, out_tree)
    kernel_flat = _flat(kernel, in_tree, out_tree)
    mosaic = impl == "mosaic"
    outs = _bind_choice(kernel_flat, reference_flat, flat, mosaic, _choice_key(kernel, xla, in_tree, flat, mosaic),
                        out_tree)
    return jax.tree.unflatten(out_tree[0], outs)


def _choice_abstract_eval(*avals, choice: _Choice):
    return choice.reference.out_avals


def _choice_impl(*args, choice: _Choice):
    return jax.jit(lambda *a: _choice_p.bind(*a, choice=choice))(*args)


def _lower_reference(ctx, *args, choice: _Choice):
    if choice.mosaic:
        raise RuntimeError(_mosaic_unavailable(
            f"this computation is being lowered for {', '.join(ctx.module_context.platforms)}"))
    return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(choice.reference), multiple_results=True)(ctx, *args)


def _lower_kernel(ctx, *args, choice: _Choice):
    block = mlir.ir.InsertionPoint.current.block
    before = len(block.operations)
    # Lowerings are shared by the choices whose kernel function and static arguments are the same
    # (`choice.key[0]`), whatever their operands' tree (an Fp8Tensor's logical shape) or reference.
    kernel_key = choice.key[0] if choice.key is not None else None
    with _mgpu.ptxas_version_asked_once(), _mgpu.stable_kernel_payloads(), _mgpu.reuse_lowered_kernels(kernel_key):
        outs = mlir.lower_fun(choice.kernel, multiple_results=True)(ctx, *args)
    # The new ops' kernels are compiled in the background while the rest lowers (jfp8.precompile).
    precompile.submit(ctx, list(block.operations)[before:])
    return outs


def _choice_batch(args, dims, *, choice: _Choice):
    """vmap: both sides vmapped, batch axes first in the results."""
    n_out = len(choice.reference.out_avals)
    in_axes = [d if isinstance(d, int) else None for d in dims]  # None: not mapped
    batched = lambda fn: jax.vmap(fn, in_axes=in_axes, out_axes=[0] * n_out)  # noqa: E731
    outs = _bind_choice(batched(choice.kernel), batched(jax.extend.core.jaxpr_as_fun(choice.reference)),
                        list(args), choice.mosaic)
    return outs, [0] * n_out


_choice_p.def_abstract_eval(_choice_abstract_eval)
_choice_p.def_impl(_choice_impl)
mlir.register_lowering(_choice_p, _lower_reference)
mlir.register_lowering(_choice_p, _lower_kernel, platform="cuda")
batching.primitive_batchers[_choice_p] = _choice_batch


def _device_of(args) -> jax.Device:
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.devices()))
    return jax.devices()[0]


def _dispatch(impl: Impl, interpret: bool, kernel: Callable, xla: Callable, args: tuple,
              unsupported: str | None = None):
    """`kernel(*args)` or `xla(*args)` (same results), as `impl` and `interpret` say (module
    docstring). `unsupported`: why the kernels cannot take these inputs, or None."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        if interpret:
            raise ValueError("interpret=True runs the Mosaic GPU kernels: use impl='mosaic' or 'auto'")
        return xla(*args)
    if unsupported is not None:
        if impl == "mosaic":
            raise NotImplementedError(f"the Mosaic GPU kernels do not handle {unsupported}; use impl='xla' "
                                      "or 'auto' (the reference, same numerics)")
        return xla(*args)
    if _mgpu.interpreting():  # inside an interpreter context (with its settings): kernels run there
        return kernel(*args)
    if interpret:
        with _mgpu.interpret_mode(True):
            return kernel(*args)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
        device = _device_of(args)  # eager: where it runs is known now
        if is_hopper(device):
            return kernel(*args)
        if impl == "auto":
            return xla(*args)
        raise RuntimeError(_mosaic_unavailable(f"the inputs are on {device.device_kind!r} ({device.platform})"))
    gpu = _local_non_hopper_gpu()
    if gpu is not None:  # this machine's GPU cannot run them, whatever is lowered
        if impl == "auto":
            return xla(*args)
        raise RuntimeError(_mosaic_unavailable(f"this machine's GPU is {gpu.device_kind!r}"))
    return _choose_when_lowered(impl, kernel, xla, args)


# ------------------------------------------------------------------------------ quantizers

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_KERNEL_BLOCKS = ((1, TILE), (TILE, 1), (TILE, TILE))


def _quantize_unsupported(x: jax.Array, block: Block) -> str | None:
    """Why the quantization kernels cannot take this input, or None when they can."""
    if block not in _KERNEL_BLOCKS:
        return f"block {block} (the kernels do {_KERNEL_BLOCKS})"
    if jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take bf16, f16, f32)"
    if x.ndim > 2 and block != (1, TILE) and x.shape[-2] % TILE:
        return f"batched input whose rows ({x.shape[-2]}) are not a multiple of {TILE}"
    return None


def _check_quantize_input(x: jax.Array, block: Block) -> jax.Array:
    """The checks of `fp8.quantize`, done before choosing, so both paths fail the same way."""
    _check_block(block)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 2:
        fp8.quantize(x, block)  # raises its clear error
    return x


def _scale_rule(pow2_scale: bool, amax_floor: float) -> dict:
    """The keyword arguments every quantizer takes for its scales, the floor checked."""
    return {"pow2_scale": pow2_scale, "amax_floor": fp8.check_amax_floor(amax_floor)}


def _quantize_kernel(x: jax.Array, block: Block, pow2_scale: bool, amax_floor: float) -> Fp8Tensor:
    """`fp8.quantize` through the fused kernels (2-D; batch axes folded into rows)."""
    *batch, m, k = x.shape
    # Rows of different batch items never share a block (`_quantize_unsupported`). Not
    # reshape(-1, k): that cannot infer the rows when k is 0.
    x2 = x.reshape(math.prod(batch) * m, k)
    fn = {(1, TILE): qk.quantize_tile, (TILE, 1): qk.quantize_column, (TILE, TILE): qk.quantize_block}[block]
    data, scale = fn(x2, pow2_scale=pow2_scale, amax_floor=amax_floor)
    rows = -(-m // block[0]) * block[0]
    data = data.reshape(*batch, rows, data.shape[-1])
    scale = scale.reshape(*batch, rows // block[0], scale.shape[-1])
    return Fp8Tensor(data, scale, block, (m, k))


def quantize(
    x: jax.Array,
    block: Block = (1, TILE),
    *,
    pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR,
    impl: Impl = "auto",
    interpret: bool = False,
) -> Fp8Tensor:
    """Online E4M3 quantization of the last two axes of `x`, one FP32 scale per block.

    Args:
      x: floating array of shape `(..., M, K)` (bf16, f16, f32 or f64); leading axes are batch.
      block: `(1, 128)` tile-wise (activations), `(128, 1)` (the Wgrad layout, 128 rows per
        scale), `(128, 128)` block-wise (weights), any other `(bm, bk)`, or None for one scale
        per matrix (per tensor, the baseline).
      pow2_scale: round every scale up to a power of two (UE8M0-compatible).
      amax_floor: the least amax a scale is taken from: `AMAX_FLOOR` (1e-4, DeepGEMM's) for
        activations and weights, `GRAD_AMAX_FLOOR` for gradients (`jfp8.fp8.quantize`).
      impl, interpret: the kernels or the reference (module docstring); bit-identical.

    Returns:
      An `Fp8Tensor` whose `data` is padded with zeros up to whole blocks and whose `logical`
      holds `(M, K)`. A block that contains NaN or ±Inf gets a NaN scale and NaN data.
    """
    x = _check_quantize_input(x, block)
    rule = _scale_rule(pow2_scale, amax_floor)
    return _dispatch(impl, interpret, functools.partial(_quantize_kernel, block=block, **rule),
                     functools.partial(fp8.quantize, block=block, **rule), (x,),
                     _quantize_unsupported(x, block))


def quantize_weight(
    w: jax.Array,
    block: Block = (TILE, TILE),
    *,
    pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR,
    impl: Impl = "auto",
    interpret: bool = False,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """`(q, q.mT)` for `q = quantize(w, block)`: a weight in both orientations it is used in.

    Fprop contracts W [K, N] over K and Dgrad over N, and FP8 wgmma needs the contracted axis
    contiguous. On the kernels, one fused pass reads W once and writes both E4M3 copies
    (`quantize_block_and_transpose`: 2-D weights and stacks of experts `(G, K, N)`); otherwise
    `quantize` and `.mT`. Bit-identical either way.
    """
    w = _check_quantize_input(w, block)
    rule = _scale_rule(pow2_scale, amax_floor)
    fused = block == _BLOCK and w.ndim in (2, 3) and _quantize_unsupported(w, block) is None

    if not fused:  # the two passes, each through its own door
        q = quantize(w, block, **rule, impl=impl, interpret=interpret)
        return q, q.mT
    xla = functools.partial(fp8.quantize_weight, block=block, **rule)
    return _dispatch(impl, interpret, functools.partial(_quantize_weight_kernel, block=block, **rule), xla, (w,))


def _quantize_weight_kernel(w: jax.Array, *, block: Block, pow2_scale: bool, amax_floor: float):
    data, scale, data_t = qk.quantize_block_and_transpose(w, pow2_scale=pow2_scale, amax_floor=amax_floor)
    m, k = w.shape[-2:]
    return Fp8Tensor(data, scale, block, (m, k)), Fp8Tensor(data_t, jnp.swapaxes(scale, -1, -2), block, (k, m))


def quantize_wgrad_operand(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, impl: Impl = "auto",
    interpret: bool = False,
) -> Fp8Tensor:
    """x (T, C) -> its transpose (C, T) scaled per 128 tokens: `quantize(x, (128, 1)).mT`, which
    the kernel writes transposed in the same pass (2-D inputs)."""
    x = _check_quantize_input(x, (TILE, 1))
    rule = _scale_rule(pow2_scale, amax_floor)

    unsupported = _quantize_unsupported(x, (TILE, 1)) or (None if x.ndim == 2 else f"{x.ndim}-D input")
    return _dispatch(impl, interpret, functools.partial(_quantize_wgrad_operand_kernel, **rule),
                     functools.partial(fp8.quantize_wgrad_operand, **rule), (x,), unsupported)


def _quantize_wgrad_operand_kernel(x: jax.Array, *, pow2_scale: bool, amax_floor: float) -> Fp8Tensor:
    data, scale = qk.quantize_column(x, pow2_scale=pow2_scale, amax_floor=amax_floor, transpose=True)
    return Fp8Tensor(data, scale, (1, TILE), (x.shape[1], x.shape[0]))


def quantize_grad(
    dy: jax.Array, *, pow2_scale: bool = False, amax_floor: float = GRAD_AMAX_FLOOR, impl: Impl = "auto",
    interpret: bool = False,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """dy (T, N) -> `(quantize(dy, (1, 128)), quantize_wgrad_operand(dy))`: its Dgrad operand in
    1x128 tiles and its Wgrad operand (dyᵀ scaled per 128 tokens); on the kernels, one fused pass
    reads dy once and writes both (2-D inputs). Bit-identical either way."""
    dy = _check_quantize_input(dy, (1, TILE))
    rule = _scale_rule(pow2_scale, amax_floor)

    unsupported = _quantize_unsupported(dy, (TILE, 1)) or (None if dy.ndim == 2 else f"{dy.ndim}-D input")
    return _dispatch(impl, interpret, functools.partial(_quantize_grad_kernel, **rule),
                     functools.partial(fp8.quantize_grad, **rule), (dy,), unsupported)


def _quantize_grad_kernel(dy: jax.Array, *, pow2_scale: bool, amax_floor: float):
    t, n = dy.shape
    data, scale, data_t, scale_t = qk.quantize_tile_and_column_t(dy, pow2_scale=pow2_scale, amax_floor=amax_floor)
    return Fp8Tensor(data, scale, (1, TILE), (t, n)), Fp8Tensor(data_t, scale_t, (1, TILE), (n, t))


def quantize_activation(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, impl: Impl = "auto",
    interpret: bool = False,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """x (T, C) -> `(q, retile_wgrad_operand(q))` for `q = quantize(x, (1, 128))`: its Fprop operand
    and its Wgrad operand (the §3.5.2 re-tiling of q), computed together in the forward pass; on
    the kernels, one fused pass reads x once and writes both (2-D inputs). Bit-identical either
    way to quantizing in the forward and re-tiling in the backward."""
    x = _check_quantize_input(x, (1, TILE))
    rule = _scale_rule(pow2_scale, amax_floor)

    unsupported = _quantize_unsupported(x, (TILE, 1)) or (None if x.ndim == 2 else f"{x.ndim}-D input")
    return _dispatch(impl, interpret, functools.partial(_quantize_activation_kernel, **rule),
                     functools.partial(fp8.quantize_activation, **rule), (x,), unsupported)


def _quantize_activation_kernel(x: jax.Array, *, pow2_scale: bool, amax_floor: float):
    t, n = x.shape
    data, scale, data_t, scale_t = qk.quantize_tile_and_retile_t(x, pow2_scale=pow2_scale, amax_floor=amax_floor)
    return Fp8Tensor(data, scale, (1, TILE), (t, n)), Fp8Tensor(data_t, scale_t, (1, TILE), (n, t))


def retile_wgrad_operand(
    t: Fp8Tensor, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, impl: Impl = "auto",
    interpret: bool = False,
) -> Fp8Tensor:
    """The FP8 x saved by Fprop, (T, C) in (1, 128) tiles -> (C, T) scaled per 128 tokens:
    `quantize(t.dequantize(jnp.float32), (128, 1)).mT` (DeepSeek-V3 §3.5.2), one fused pass on
    the kernels."""
    rule = _scale_rule(pow2_scale, amax_floor)

    unsupported = None if (t.ndim == 2 and t.block == (1, TILE)) else f"a {t.ndim}-D tensor in blocks {t.block}"
    return _dispatch(impl, interpret, functools.partial(_retile_kernel, **rule),
                     functools.partial(fp8.retile_wgrad_operand, **rule), (t,), unsupported)


def _retile_kernel(t: Fp8Tensor, *, pow2_scale: bool, amax_floor: float) -> Fp8Tensor:
    m, k = t.logical
    data, scale = qk.retile_tile_to_column_t(t.data, t.scale, m=m, k=k, pow2_scale=pow2_scale, amax_floor=amax_floor)
    return Fp8Tensor(data, scale, (1, TILE), (k, m))


# ------------------------------------------------------------------------------ GEMMs


def _padded_k(t: Fp8Tensor) -> int:
    return -(-t.logical[1] // TILE) * TILE


def _k_padded_data(t: Fp8Tensor, kp: int) -> jax.Array:
    """`t.data` with exactly `kp` columns (per-tensor operands are stored unpadded)."""
    if t.data.shape[-1] == kp:
        return t.data
    return fp8.move_bytes(lambda d: reference.zero_past_k(d, t.logical[1], kp), t.data)


def scaled_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """`a @ b.T` for FP8 operands with DeepSeek-V3's per-128-K promotion to FP32.

    Args:
      a: (M, K) `Fp8Tensor`, tile-scaled `(1, 128)` (also accepted: `(bm, 128)` blocks, per tensor).
      b: (N, K) `Fp8Tensor`: `(128, 128)` blocks (Fprop/Dgrad), `(1, 128)` tiles (Wgrad) or per
        tensor.
      out_dtype: bfloat16 or float32.
      impl, interpret: the kernels or the reference (module docstring).

    Returns:
      (M, N) in `out_dtype`: `scaled_matmul_reference(a, b, out_dtype)`, bit for bit in the
      interpreter and within `jfp8.accumulation.hardware_error_bound` on a Hopper GPU.
    """
    check_nt_operands(a, b, out_dtype)
    xla = functools.partial(reference.scaled_matmul_reference, out_dtype=out_dtype)
    return _dispatch(impl, interpret, functools.partial(_scaled_matmul_kernel, out_dtype=out_dtype), xla, (a, b))


def _scaled_matmul_kernel(a: Fp8Tensor, b: Fp8Tensor, *, out_dtype) -> jax.Array:
    kp = _padded_k(a)
    a_data, a_scale = chunk_operand(a, kp)
    if b.block == _BLOCK:
        b_data, b_scale, b_rows = _k_padded_data(b, kp), b.scale, TILE
    else:  # per-row scales serve every other layout (tiles, per tensor, other block heights)
        b_data, b_scale = chunk_operand(b, kp)
        b_rows = 1
    return gemm.scaled_matmul(a_data, a_scale, b_data, b_scale, n=b.logical[0], b_block_rows=b_rows,
                              out_dtype=out_dtype)


def _check_grouped_rhs(b: Fp8Tensor) -> None:
    if not isinstance(b, Fp8Tensor) or b.ndim != 3:
        raise ValueError(f"b must be a (G, N, K) Fp8Tensor, one weight per group; got {getattr(b, 'shape', b)}")


def grouped_scaled_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """MoE grouped GEMM mirroring `jax.lax.ragged_dot(a, b, group_sizes)` with B stored K-major.

    Args:
      a: (T, K) tile-scaled `Fp8Tensor`, rows sorted by group.
      b: (G, N, K) `Fp8Tensor`, `(128, 128)`-block scaled, one weight per group.
      group_sizes: (G,) int32, any sizes (0 too); rows past their sum come out as zeros.

    Returns:
      (T, N) in `out_dtype`, equal to `grouped_scaled_matmul_reference`.
    """
    _check_grouped_rhs(b)
    check_nt_operands(a, Fp8Tensor(b.data[0], b.scale[0], b.block, b.logical), out_dtype)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)

    xla = functools.partial(reference.grouped_scaled_matmul_reference, out_dtype=out_dtype)
    unsupported = None if b.block == _BLOCK else f"block {b.block} weights (the grouped kernel takes {_BLOCK})"
    return _dispatch(impl, interpret, functools.partial(_grouped_scaled_matmul_kernel, out_dtype=out_dtype), xla,
                     (a, b, group_sizes), unsupported)


def _grouped_scaled_matmul_kernel(a: Fp8Tensor, b: Fp8Tensor, group_sizes: jax.Array, *, out_dtype) -> jax.Array:
    kp = _padded_k(a)
    a_data, a_scale = chunk_operand(a, kp)
    return grouped_gemm.grouped_scaled_matmul(a_data, a_scale, _k_padded_data(b, kp), b.scale, group_sizes,
                                              n=b.logical[0], out_dtype=out_dtype)


def grouped_wgrad_matmul(
    a_t: Fp8Tensor,
    b_t: Fp8Tensor,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.float32,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Per group g, `a_g^T @ b_g` contracted over the (token) rows: the MoE Wgrad -> (G, K, N).

    Args:
      a_t: (K, T) `Fp8Tensor` of x^T scaled per 128 tokens: `quantize(x, (128, 1)).mT`.
      b_t: (N, T) `Fp8Tensor` of dy^T, likewise.
      group_sizes: (G,) int32 token counts per group (tokens sorted by group).

    Returns:
      (G, K, N) in `out_dtype` (float32 by default), equal to `grouped_wgrad_reference`.
    """
    check_nt_operands(a_t, b_t, out_dtype)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)

    xla = functools.partial(reference.grouped_wgrad_reference, out_dtype=out_dtype)
    return _dispatch(impl, interpret, functools.partial(_grouped_wgrad_kernel, out_dtype=out_dtype), xla,
                     (a_t, b_t, group_sizes))


def _grouped_wgrad_kernel(a_t: Fp8Tensor, b_t: Fp8Tensor, group_sizes: jax.Array, *, out_dtype) -> jax.Array:
    tp = _padded_k(a_t)
    a_data, a_scale = chunk_operand(a_t, tp)
    b_data, b_scale = chunk_operand(b_t, tp)
    return grouped_wgrad.grouped_wgrad(a_data, a_scale, b_data, b_scale, group_sizes,
                                       t=a_t.logical[1], out_dtype=out_dtype)


# ------------------------------------------------------------------------------ no FP8: the BF16 baseline


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: Impl = "auto",
               interpret: bool = False) -> jax.Array:
    """The BF16 (or F16, F32) grouped GEMM of the baseline's experts: `jax.lax.ragged_dot(x, w,
    group_sizes)` with an FP32 accumulator, in x's dtype; rows past sum(group_sizes) are zeros.

    The reference is `reference.ragged_dot_reference` (a scan over work items); on Hopper the
    kernels are jax's own Mosaic GPU ragged dots (`pallas_kernels.ragged`), where the shapes fit
    them. Unlike the FP8 kernels they do not give the reference's bits: the tensor core sums in its
    own order (tests/test_ragged.py bounds the difference).

    Args:
      x: (T, K) tokens sorted by group. w: (G, K, N), cast to x's dtype. group_sizes: (G,) int32.
    """
    return _dispatch(impl, interpret, _ragged_dot_kernel, reference.ragged_dot_reference, (x, w, group_sizes),
                     ragged.unsupported(x, w))


def ragged_dot_grads(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array, *,
                     impl: Impl = "auto", interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of `ragged_dot(x, w, group_sizes)` for the cotangent dy [T, N]: dx [T, K] in x's
    dtype, dw [G, K, N] in w's (computed in x's dtype with FP32 accumulation, as the reference's
    autodiff does). The kernels: a ragged dot against each wᵀ, and jax's transposed ragged dot."""
    return _dispatch(impl, interpret, _ragged_dot_grads_kernel, reference.ragged_dot_grads_reference,
                     (x, w, group_sizes, dy), ragged.unsupported(x, w))


def _ragged_dot_kernel(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return ragged.ragged_matmul(x, w, group_sizes)


def _ragged_dot_grads_kernel(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array):
    dx = ragged.ragged_matmul_nt(dy.astype(x.dtype), w, group_sizes)
    dw = ragged.ragged_wgrad(x, dy, group_sizes).astype(w.dtype)
    return dx, dw

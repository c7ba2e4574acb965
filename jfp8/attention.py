"""Causal attention for MLA: XLA's softmax(QKᵀ)·V anywhere, cuDNN's fused attention on a Hopper GPU.

DeepSeek-V3 keeps attention out of FP8 (§3.3.2), so both precisions run the same attention. XLA's
form (`xla_causal_attention`, the reference) materializes the FP32 scores and probabilities
[B, H, T, T] and autodiff saves the probabilities for the backward: 27.9 GB of the `gpu` preset's
step on an H100, and most of the bytes its non-GEMM kernels move. cuDNN's fused (flash) attention
keeps one FP32 logsumexp per query row instead and recomputes the probabilities in its backward.
It takes MLA's heads as they are (query/key 192 wide, values 128) on Hopper with cuDNN ≥ 9.10,
through jax's cuDNN attention (`jax._src.cudnn.fused_attention_stablehlo`: the public
`jax.nn.dot_product_attention` wants the value heads as wide as the keys').

Numerics: both compute the scores and the softmax in FP32, round the probabilities to the inputs'
dtype for the product with V and accumulate it in FP32; they sum in different orders (cuDNN
blockwise, with an online softmax), so they agree to the inputs' precision, not to the bit.

`impl`:
- "xla": the reference, on any device.
- "cudnn": cuDNN's kernel; an error saying why where it cannot run (not traced for a Hopper GPU,
  no cuDNN, a dtype or head width cuDNN does not take).
- "auto": chosen when the attention is traced: cuDNN where the computation is traced for a Hopper
  GPU whose cuDNN takes the heads and, on a real GPU, passes a first check against the reference
  (`_cudnn_agrees`: one sequence of the step's length and heads, forward and backward, once per
  process and shape; a failure warns and keeps XLA); XLA elsewhere. On a CPU host nothing
  changes: "auto" is "xla", bit for bit. The check runs the kernel by itself, not inside the
  step's program: a cuDNN failure that only the step's compile meets (another batch size, say)
  is not caught by it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from jfp8 import api

AttentionImpl: TypeAlias = Literal["auto", "xla", "cudnn"]
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# cuDNN's flash attention on Hopper (jax 0.11.2's checks): head widths up to 256, multiples of 8;
# query/key heads wider than the value heads (MLA) from cuDNN 9.10.
CUDNN_MAX_HEAD_DIM = 256
CUDNN_MLA_VERSION = 91000


def check_impl(impl: str) -> None:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")


def xla_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """softmax(q kᵀ · scale + causal mask) v: the reference.

    q [B, T, H, Dqk], k [B, T, H, Dqk], v [B, T, H, Dv] -> [B, T, H, Dv] in v's dtype. Scores and
    softmax in FP32; the probabilities multiply v in v's dtype with an FP32 accumulator.
    """
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [Tq, Tk]: query t sees keys <= t
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # [B, H, Tq, Tk]
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype)


def _jax_cudnn():
    """jax's cuDNN attention module, or None where this jax has none."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:
        return None
    return fused_attention_stablehlo


def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """The same attention through cuDNN's fused kernel (forward and backward); shapes as
    `xla_causal_attention`'s. Raises ValueError, saying why, where it cannot run."""
    if (why := cudnn_unsupported(q, k, v)) is not None:
        raise ValueError(f"attention impl='cudnn' cannot run here: {why}. Use impl='auto' (cuDNN where it "
                         "runs, XLA elsewhere) or impl='xla' (the reference)")
    fa = _jax_cudnn()
    return fa.dot_product_attention(q, k, v, scale=scale, mask_type=fa.MaskType.CAUSAL, qkv_layout="BTNH")


def cudnn_unsupported(q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    """Why cuDNN's fused attention cannot take these inputs where they are traced, or None."""
    fa = _jax_cudnn()
    if fa is None:
        return f"jax {jax.__version__} has no cuDNN attention module"
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN takes bf16 or f16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[:3] != v.shape[:3] or k.shape != (*v.shape[:3], k.shape[-1]):
        return f"shapes q {q.shape}, k {k.shape}, v {v.shape} are not [B, T, H, D] with one T and H"
    for name, width in (("query/key", q.shape[-1]), ("value", v.shape[-1])):
        if width > CUDNN_MAX_HEAD_DIM or width % 8:
            return f"{name} head width {width} (cuDNN takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM})"
    if not api.traced_for_hopper():
        return "the computation is not traced for a Hopper GPU"
    try:
        version = fa.check_cudnn_version()
    except RuntimeError as e:  # jax's CUDA plugin without cuDNN, or no CUDA plugin
        return f"no cuDNN ({e})"
    if q.shape[-1] != v.shape[-1] and version < CUDNN_MLA_VERSION:
        return f"query/key heads wider than the value heads need cuDNN >= 9.10, this is {version}"
    if not fa.check_compute_capability("9.0"):
        return ("jax sees no Hopper GPU to hold the heads to (deviceless: trace inside "
                "jfp8.attention.deviceless_hopper())")
    return None


@contextlib.contextmanager
def deviceless_hopper():
    """Inside this block jax's cuDNN attention checks the heads against a Hopper GPU's limits.

    jax asks the local GPU's compute capability when it checks an attention pattern; compiling
    for a Hopper without one (`benchmarks/hopper_train_build.py`) there is none, and jax would
    hold the heads to a pre-Hopper GPU's (width <= 128, no MLA). For deviceless builds only:
    where a GPU is present, jax's own answer stands."""
    fa = _jax_cudnn()
    if fa is None or _has_gpu():
        yield
        return
    capability = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
    saved = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_compute_capability = lambda c: capability(c) <= (9, 0)
    fa.is_cuda_compute_capability_equal = lambda c: capability(c) == (9, 0)
    try:
        yield
    finally:
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


# The tolerance of `_cudnn_agrees`: the largest difference against the reference, over the largest
# magnitude of the reference's output or gradient. A guard against a kernel that fails or computes
# something else (a wrong mask, scale or block), not a precision test: bf16 inputs round at 2^-8
# relative, both sides round the probabilities to bf16 and sum in different orders.
# `tests/test_attention.py` holds cuDNN to the float64 oracle on a GPU.
PROBE_TOLERANCE = 3e-2


def _max_rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class _CannotCheckHere(Exception):
    """The check could not run eagerly where it was asked (inside a trace that keeps its values
    abstract, e.g. an eager `shard_map`): no verdict."""


def _probe(run, reference, q_shape: tuple, v_shape: tuple, dtype) -> str | None:
    """Run `run` and `reference` (each (q, k, v) -> out) forward and backward on random inputs of
    these shapes, eagerly (also while a caller is being jitted); None when they agree, else why not.
    Raises `_CannotCheckHere` where the values stay abstract."""
    with jax.ensure_compile_time_eval():
        kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(kq, q_shape, jnp.float32).astype(dtype)
        k = jax.random.normal(kk, q_shape, jnp.float32).astype(dtype)
        v = jax.random.normal(kv, v_shape, jnp.float32).astype(dtype)
        g = jax.random.normal(kg, v_shape, jnp.float32).astype(dtype)
        if any(isinstance(x, jax.core.Tracer) for x in (q, k, v, g)):
            raise _CannotCheckHere("the check's inputs are traced here")

        def fwd_bwd(fn):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(g))

        try:
            want = jax.block_until_ready(jax.jit(lambda: fwd_bwd(reference))())
        except Exception as e:  # noqa: BLE001 - the reference failing says nothing about the candidate
            raise _CannotCheckHere(f"the reference failed: {type(e).__name__}: {str(e)[:300]}") from e
        try:
            got = jax.block_until_ready(jax.jit(lambda: fwd_bwd(run))())
        except Exception as e:  # noqa: BLE001 - any failure of the candidate is the answer
            return f"it failed: {type(e).__name__}: {str(e)[:300]}"
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = _max_rel(a, b)
            if not err <= PROBE_TOLERANCE:
                return f"its {name} is {err:.3g} off the reference (relative to the largest, tolerance {PROBE_TOLERANCE})"
    return None


_VERDICTS: dict[tuple, str | None] = {}


def _cudnn_agrees(dqk: int, dv: int, dtype_name: str, seq_len: int, heads: int) -> str | None:
    """cuDNN's attention against the reference at one sequence of the step's length and heads,
    once per process and shape: None when it runs and agrees, else why not (and a warning). Where
    the check cannot run (`_CannotCheckHere`) the answer is "not checked", not kept, and XLA runs."""
    key = (dqk, dv, dtype_name, seq_len, heads)
    if key in _VERDICTS:
        return _VERDICTS[key]
    scale = dqk**-0.5
    try:
        why = _probe(lambda q, k, v: cudnn_causal_attention(q, k, v, scale),
                     lambda q, k, v: xla_causal_attention(q, k, v, scale),
                     (1, seq_len, heads, dqk), (1, seq_len, heads, dv), jnp.dtype(dtype_name))
    except _CannotCheckHere as e:
        return f"not checked: {e}"
    _VERDICTS[key] = why
    if why is not None:
        warnings.warn(f"cuDNN's fused attention at head widths {dqk}/{dv} ({dtype_name}, {seq_len} tokens, {heads} "
                      f"heads) did not pass its first check, so attention runs in XLA (impl='auto'): {why}",
                      RuntimeWarning, stacklevel=4)
    return why


def resolve(impl: AttentionImpl, q: jax.Array, k: jax.Array, v: jax.Array) -> Literal["xla", "cudnn"]:
    """The implementation `impl` runs for these inputs, traced here."""
    check_impl(impl)
    if impl != "auto":
        return impl
    if cudnn_unsupported(q, k, v) is not None:
        return "xla"
    # Supported with a GPU present means a real Hopper (`deviceless_hopper` answers only without
    # one): check cuDNN there once; a deviceless build has nothing to run a check on.
    if _has_gpu() and _cudnn_agrees(q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).name, q.shape[1], q.shape[2]):
        return "xla"
    return "cudnn"


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def cudnn_failure(error: BaseException) -> bool:
    """Whether `error` (from compiling or running a step) names cuDNN: what a caller may retry
    with attention="xla" (`benchmarks/bench_step.py`, `gpu_train_check.py`)."""
    return "cudnn" in f"{type(error).__name__}: {error}".lower()


def ran(program_text: str) -> Literal["xla", "cudnn"]:
    """Which attention a lowered (StableHLO) or compiled (HLO) program's text runs: "cudnn" where it
    calls cuDNN's fused attention, else "xla". For records of what a step ran."""
    return "cudnn" if "__cudnn$fmha" in program_text else "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                     impl: AttentionImpl = "xla") -> jax.Array:
    """Causal softmax attention by `impl` (module docstring); shapes as `xla_causal_attention`'s."""
    if resolve(impl, q, k, v) == "cudnn":
        return cudnn_causal_attention(q, k, v, scale)
    return xla_causal_attention(q, k, v, scale)

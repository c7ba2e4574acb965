"""One kernel per (op, shapes, static arguments) in a lowered program, whatever the call site
(`jfp8.api._Choice`'s key): the same op at the same shape lowers once and shares one Mosaic payload;
anything that changes what is computed (a shape, a block, a floor, an output dtype, an Fp8Tensor's
logical shape) keeps its own lowering, and its own kernel wherever the kernel differs (two lowerings
of one kernel, e.g. a GEMM cut to two logical N outside it, share one payload). Checked on the
CUDA lowering (payload hashes) and, on this CPU, on the results of the reference path, which
shares the same lowering cache."""

import collections
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfp8
from jfp8 import api
from jfp8.fp8 import GRAD_AMAX_FLOOR
from pallas_kernels import _mgpu


def _kernels(fn, *args) -> tuple[int, int]:
    """(Mosaic custom calls, distinct payloads) of `fn` lowered for CUDA."""
    text = _mgpu.lower_for_cuda(fn, *args)
    hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
    return len(hashes), len(set(hashes))


def _bf16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def test_the_same_op_at_the_same_shape_is_one_kernel():
    """Four layers' worth of the same quantizer, GEMM and their call sites: one payload each."""

    def layers(x, w):
        # `lower_for_cuda` lowers under an abstract mesh, whose sharding the function's arguments
        # do not carry (jax keys a lowering by it): start from values computed inside.
        x, w = x * 1, w * 1
        for _ in range(4):
            qx = jfp8.quantize(x, impl="mosaic")
            qw = jfp8.quantize(w, (128, 128), impl="mosaic")
            x = jfp8.scaled_matmul(qx, qw, impl="mosaic")
        return x

    calls, kernels = _kernels(layers, _bf16(256, 256), jax.ShapeDtypeStruct((256, 256), jnp.float32))
    assert (calls, kernels) == (12, 3)


def _hashes(fn, *args) -> list[str]:
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', _mgpu.lower_for_cuda(fn, *args))


def test_two_programs_share_their_kernels(monkeypatch):
    """The same kernels lowered in two programs (a train step, then an eval step) have the same
    payloads, so the second program's are the first's compiled kernels: jax's dump-name counter
    and its cache-dependent source locations are kept out of the payload
    (`_mgpu.stable_kernel_payloads`); and the second program parses the first's lowered modules
    back instead of lowering them again (`_mgpu.reuse_lowered_kernels`), giving the payloads a
    fresh lowering gives. Without either, every lowering is another payload (jax 0.11.2 numbers
    the kernel modules it lowers): checked too."""

    def layer(scale):
        def fn(x, w):
            x, w = x * scale, w * 1  # two different programs around the same kernels
            qx = jfp8.quantize(x, impl="mosaic")
            qw = jfp8.quantize(w, (128, 128), impl="mosaic")
            return jfp8.scaled_matmul(qx, qw, impl="mosaic")
        return fn

    args = (_bf16(256, 256), jax.ShapeDtypeStruct((256, 256), jnp.float32))
    monkeypatch.setattr(_mgpu, "_LOWERED", collections.OrderedDict())
    before = dict(_mgpu.LOWERING_STATS)
    first, second = _hashes(layer(2.0), *args), _hashes(layer(3.0), *args)
    assert len(first) == 3 and first == second
    assert _mgpu.LOWERING_STATS["reused"] - before.get("reused", 0) == 3  # the second program's three
    _mgpu._LOWERED.clear()
    assert _hashes(layer(6.0), *args) == first  # lowered afresh: the reused modules' payloads

    monkeypatch.setattr(_mgpu, "stable_kernel_payloads", contextlib.nullcontext)
    monkeypatch.setattr(_mgpu, "reuse_lowered_kernels", lambda key: contextlib.nullcontext())
    third, fourth = _hashes(layer(4.0), *args), _hashes(layer(5.0), *args)
    assert len(third) == 3 and set(third).isdisjoint(fourth), "without them: another payload per lowering"


@pytest.mark.parametrize("other", ["shape", "block", "floor", "pow2", "dtype"])
def test_what_changes_the_kernel_keeps_its_own(other):
    """Two calls that differ in one thing the kernel depends on are two kernels."""
    first = lambda x: jfp8.quantize(x, impl="mosaic").data  # noqa: E731
    second = {
        "shape": lambda x: jfp8.quantize(x[:128], impl="mosaic").data,
        "block": lambda x: jfp8.quantize(x, (128, 128), impl="mosaic").data,
        "floor": lambda x: jfp8.quantize(x, amax_floor=GRAD_AMAX_FLOOR, impl="mosaic").data,
        "pow2": lambda x: jfp8.quantize(x, pow2_scale=True, impl="mosaic").data,
        "dtype": lambda x: jfp8.quantize(x.astype(jnp.float32), impl="mosaic").data,
    }[other]
    calls, kernels = _kernels(lambda x: (first(x * 1), second(x * 1), first(x * 1)), _bf16(256, 256))
    assert (calls, kernels) == (3, 2)


def test_the_logical_shape_is_part_of_the_key():
    """Same padded data and scales, different logical N: different outputs, so two choices of the
    op (four calls). The two GEMMs run the same Mosaic kernel on the same padded operands (the cut
    to N is outside it), and since their payloads carry no lowering counter
    (`_mgpu.stable_kernel_payloads`) they are one payload: three kernels (one Pallas lowering of
    the GEMM, read back for the second: the next test)."""
    a = jax.eval_shape(lambda x: jfp8.quantize(x, impl="xla"), _bf16(256, 256))

    def fn(a, wa, wb):
        a = jax.tree.map(lambda v: v * 1, a)
        qa = jfp8.quantize(wa, (128, 128), impl="mosaic")  # logical (96, 256): padded to 128 rows
        qb = jfp8.quantize(wb, (128, 128), impl="mosaic")  # logical (128, 256)
        return jfp8.scaled_matmul(a, qa, impl="mosaic"), jfp8.scaled_matmul(a, qb, impl="mosaic")

    text = _mgpu.lower_for_cuda(fn, a, _bf16(96, 256), _bf16(128, 256))
    hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
    # four calls (the two GEMMs are two lowerings, cut to N 96 and 128 outside the kernel), three
    # kernels: two weight quantizers (two shapes), one GEMM
    assert len(hashes) == 4 and len(set(hashes)) == 3


def test_ops_that_trace_one_kernel_share_its_lowering(monkeypatch):
    """Two GEMMs cut to different logical N outside one Mosaic kernel are two ops (two choice keys)
    but one kernel function with the same static arguments and one kernel: its lowering is kept
    under the function, not the op's operand tree, so the second parses the first's module back
    (issue 44: 8 of the tiny FP8 train step's 45 lowerings for an H100, all GEMMs). The payloads
    are those of a fresh lowering per call: the same list, call by call, with the sharing off."""
    a = jax.eval_shape(lambda x: jfp8.quantize(x, impl="xla"), _bf16(256, 256))

    def program(scale):
        def fn(a, wa, wb):
            a = jax.tree.map(lambda v: v * scale, a)
            qa = jfp8.quantize(wa, (128, 128), impl="mosaic")  # logical (96, 256): padded to 128 rows
            qb = jfp8.quantize(wb, (128, 128), impl="mosaic")  # logical (128, 256)
            return jfp8.scaled_matmul(a, qa, impl="mosaic"), jfp8.scaled_matmul(a, qb, impl="mosaic")
        return fn

    args = (a, _bf16(96, 256), _bf16(128, 256))
    monkeypatch.setattr(_mgpu, "_LOWERED", collections.OrderedDict())
    monkeypatch.setattr(_mgpu, "LOWERING_STATS", collections.Counter())
    shared = _hashes(program(1.0), *args)
    assert _mgpu.LOWERING_STATS == {"lowered": 3, "reused": 1}  # two quantizers, one GEMM lowered once
    monkeypatch.setattr(_mgpu, "reuse_lowered_kernels", lambda key: contextlib.nullcontext())
    assert _hashes(program(2.0), *args) == shared
    assert _mgpu.LOWERING_STATS == {"lowered": 3, "reused": 1}  # nothing through the table: all fresh


def _lowerings_of(grids: list[int]) -> list:
    """The payload hashes of one Pallas body lowered on each grid, each in a reuse block of its own
    under one key (so the same ordinal): what tells the lowerings apart is the entry's launch shape."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    hashes = []
    for grid in grids:
        kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), jnp.float32), grid=(grid,),
                              grid_names=("x",))
        with _mgpu.stable_kernel_payloads(), _mgpu.reuse_lowered_kernels(("test_kernel_dedupe", "one body")):
            hashes += _hashes(lambda x: kernel(x * 1), jax.ShapeDtypeStruct((128, 128), jnp.float32))
    return hashes


def test_the_launch_shape_is_part_of_the_lowerings_key(monkeypatch):
    """The lowering takes the grid from jax's Mosaic GPU mesh, and a body's text need not name it:
    one body on two grids is two lowerings, on one grid twice one lowering read back."""
    monkeypatch.setattr(_mgpu, "_LOWERED", collections.OrderedDict())
    monkeypatch.setattr(_mgpu, "LOWERING_STATS", collections.Counter())
    two = _lowerings_of([2, 4])
    assert _mgpu.LOWERING_STATS == {"lowered": 2} and two[0] != two[1]
    monkeypatch.setattr(_mgpu, "LOWERING_STATS", collections.Counter())
    again = _lowerings_of([2, 2])
    assert _mgpu.LOWERING_STATS == {"reused": 2} and again == [two[0], two[0]]


def test_every_field_of_the_launch_shape_is_in_the_key():
    """The grid, the cluster, the warpgroups and the kernel's name each make another key, and the
    key's text is stable (no object address): the on-disk kernel cache keeps it as text."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core

    def mesh(**kw):
        return gpu_core.Mesh(**{"grid": (16,), "grid_names": ("sm",), "num_threads": 3, "thread_name": "wg", **kw})

    keys = {_mgpu._gpu_mesh_key(m) for m in (mesh(), mesh(grid=(32,)), mesh(cluster=(2,), cluster_names=("c",)),
                                             mesh(num_threads=2), mesh(kernel_name="other"))}
    assert len(keys) == 5 and _mgpu._gpu_mesh_key(mesh()) == _mgpu._gpu_mesh_key(mesh())
    assert "0x" not in repr(_mgpu._gpu_mesh_key(mesh()))


def test_shared_lowerings_give_each_call_its_own_result():
    """On this CPU the reference path goes through the same primitive and lowering cache: calls
    that share a lowering are the same computation, and those that must not share do not (each
    jitted result equals the call run alone)."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((256, 384)) * 1e-6, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 384)), jnp.bfloat16)

    def calls(x, w):
        return (jfp8.quantize(x).scale, jfp8.quantize(x, amax_floor=GRAD_AMAX_FLOOR).scale,
                jfp8.quantize(x * 2).scale, jfp8.quantize(x, pow2_scale=True).scale,
                jfp8.scaled_matmul(jfp8.quantize(x), jfp8.quantize(w, (128, 128))),
                jfp8.scaled_matmul(jfp8.quantize(x), jfp8.quantize(w[:64], (128, 128))))

    jitted = jax.jit(calls)(x, w)
    for got, want in zip(jitted, calls(x, w), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(jitted[0], jitted[1])  # the floors bind here: the test can fail


def test_choices_without_a_key_stay_distinct():
    """A kernel given as a closure has no key: its choice equals only itself."""
    assert api._callable_key(lambda x: x) is None
    assert api._callable_key(api._quantize_grad_kernel) is not None
    assert api._callable_key(jfp8.api.functools.partial(api._quantize_grad_kernel, pow2_scale=[1])) is None
    keyed = api._callable_key(jfp8.api.functools.partial(api._quantize_grad_kernel, pow2_scale=False,
                                                         amax_floor=1e-4))
    assert keyed == api._callable_key(jfp8.api.functools.partial(api._quantize_grad_kernel, amax_floor=1e-4,
                                                                 pow2_scale=False))
    ref = jax.make_jaxpr(lambda x: x)(1.0)
    a, b = api._Choice(ref, print, False), api._Choice(ref, print, False)
    assert a == a and a != b and hash(a) != hash(b)
    c, d = api._Choice(ref, print, False, ("k",)), api._Choice(ref, len, True, ("k",))
    assert c == d and hash(c) == hash(d) and c != a


def test_background_compiles_only_for_a_gpu_backend():
    """Lowered for CUDA on this CPU host (no GPU backend to compile for), nothing is submitted;
    the CI check of the tiny train step (tests/test_hopper_train_build.py) sees every kernel
    submitted and compiled for a deviceless H100."""
    from jfp8 import precompile

    before = precompile.stats()["submitted"]
    _kernels(lambda x: jfp8.quantize(x * 1, impl="mosaic").data, _bf16(256, 384))
    assert precompile.stats()["submitted"] == before


def test_background_compile_threads_setting(monkeypatch):
    from jfp8 import precompile

    monkeypatch.setenv("JFP8_PRECOMPILE_THREADS", "3")
    assert precompile._threads() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("JFP8_PRECOMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="JFP8_PRECOMPILE"):
            precompile._threads()
    monkeypatch.delenv("JFP8_PRECOMPILE_THREADS")
    assert precompile._threads() >= 1


def test_exit_does_not_wait_for_queued_background_compiles():
    """A process that lowers and exits (an export, a dry run) does not sit through the compiles
    still queued: those not started are dropped at exit (the one running finishes)."""
    import os
    import subprocess
    import sys
    import time

    code = ("import time\nfrom jfp8 import precompile\n"
            "for _ in range(6):\n    precompile._get_pool().submit(time.sleep, 1.0)\n"
            "print(time.time(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "JFP8_PRECOMPILE_THREADS": "1"}).stdout
    exit_s = time.time() - float(out.split()[-1])
    assert exit_s < 3.0, exit_s  # 6 s if the queue were drained

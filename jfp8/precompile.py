"""Mosaic GPU kernels compiled in background threads while the rest of a program is lowered.

When a jitted program that runs jfp8's kernels is lowered for a GPU, each distinct kernel is lowered
once (`jfp8.api._Choice`) and, as soon as it is, handed here: a worker thread compiles a program of
that one kernel (the same custom call, the same payload) for the same backend. The Mosaic GPU custom
call keeps the kernels it compiled in a process-wide cache keyed by the payload's hash, so when XLA
later compiles the whole program, it finds them there instead of compiling them one after another.

What this buys is overlap: the kernels' LLVM and ptxas run on other cores while Python lowers the
rest of the program and while XLA compiles its own fusions (the whole-program compile runs the
custom calls' compiles one by one). It changes no result: the program XLA compiles is the same,
and a kernel the workers have not finished is compiled by XLA as before. Measured by
`benchmarks/hopper_train_build.py` (docs/gpu.md, "The training step compiled for Hopper").

- On by default when lowering for a GPU backend (a Hopper, or a deviceless topology); nothing is
  done for any other backend, or when the CUDA plugin is not installed.
- `JFP8_PRECOMPILE=0` in the environment, or `set_enabled(False)`, turns it off.
- `JFP8_PRECOMPILE_THREADS` sets the number of worker threads (default: the CPU count less one,
  at least one).
- At exit, kernels not yet started are dropped; one being compiled finishes first (a second or two).
- A worker's failure is recorded (`stats()`), never raised: XLA's compile of the whole program
  reports any real error.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_enabled = os.environ.get("JFP8_PRECOMPILE", "1") != "0"
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_submitted: dict[bytes, concurrent.futures.Future] = {}  # kernel hash -> its compile
_errors: list[str] = []


def set_enabled(enabled: bool) -> None:
    """Turn background kernel compiles on or off for programs lowered from now on."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def stats() -> dict:
    """What the workers did in this process: kernels submitted, compiled, failed, still pending,
    and the first failures' messages. (`_compile` returns False on a failure, never raises.)"""
    with _lock:
        futures = list(_submitted.values())
        errors = list(_errors)
    results = [f.result() for f in futures if f.done() and not f.cancelled()]
    return {"submitted": len(futures), "compiled": results.count(True), "failed": results.count(False),
            "pending": sum(not f.done() for f in futures), "errors": errors}


def _threads() -> int:
    value = os.environ.get("JFP8_PRECOMPILE_THREADS")
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"JFP8_PRECOMPILE_THREADS must be a whole number, got {value!r}") from None
        if n < 1:
            raise ValueError(f"JFP8_PRECOMPILE_THREADS must be at least 1, got {n} (JFP8_PRECOMPILE=0 turns it off)")
        return n
    return max(1, (os.cpu_count() or 2) - 1)


def _get_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(_threads(), thread_name_prefix="jfp8-precompile")
        # Drop the kernels not started when the interpreter exits. `atexit` would run too late:
        # the executor's own exit hook (threading's, which runs first) waits for every queued
        # compile. Hooks registered there run last-in first-out, so this one runs before it.
        register = getattr(threading, "_register_atexit", atexit.register)
        register(_pool.shutdown, wait=False, cancel_futures=True)
    return _pool


def _is_gpu_backend(backend) -> bool:
    return backend is not None and getattr(backend, "platform", None) in ("cuda", "gpu")


def _mosaic_calls(ops, symbol_table) -> list:
    """The Mosaic GPU custom-call ops among `ops`, in their regions and in the private functions
    they call (a kernel's wrapper may be lowered as a function of its own)."""
    from jax._src.lib.mlir import ir

    found, seen, stack = [], set(), list(ops)
    while stack:
        op = stack.pop().operation
        if op in seen:
            continue
        seen.add(op)
        if op.name == "stablehlo.custom_call":
            if "mosaic_gpu" in str(op.attributes["call_target_name"]):
                found.append(op)
            continue
        if op.name == "func.call":
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            try:
                stack.append(symbol_table[callee])
            except KeyError:
                pass
            continue
        for region in op.regions:
            for block in region:
                stack.extend(block.operations)
    return found


def _kernel_hash(op) -> bytes | None:
    """The payload hash a Mosaic custom call carries in its backend config, or None."""
    from jax._src.lib.mlir import ir

    if "mhlo.backend_config" not in op.attributes:
        return None
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    return ir.StringAttr(config["kernel_hash"]).value_bytes if "kernel_hash" in config else None


def _standalone(op) -> bytes:
    """MLIR bytecode of a module whose main runs just this custom call."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func

    with op.context, ir.Location.unknown():
        module = ir.Module.create()
        module.operation.attributes["sym_name"] = ir.StringAttr.get("jfp8_precompile")
        in_types = [v.type for v in op.operands]
        out_types = [r.type for r in op.results]
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", (in_types, out_types))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                attrs = {name: op.attributes[name] for name in op.attributes}
                call = ir.Operation.create("stablehlo.custom_call", results=out_types,
                                           operands=list(block.arguments), attributes=attrs)
                func.ReturnOp(call.results)
        return mlir.module_to_bytecode(module)


def _compile(backend, bytecode: bytes) -> bool:
    """Compile the one-kernel program (in a worker thread, in an MLIR context of its own)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    try:
        with mlir.make_ir_context():
            module = ir.Module.parse(bytecode)
            devices = (getattr(backend, "local_devices", list)() or backend.devices())[:1]
            options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
            compiler.backend_compile_and_load(backend, module, xc.DeviceList(tuple(devices)), options, [])
        return True
    except Exception as e:  # noqa: BLE001 - XLA's whole-program compile reports real errors
        _record(f"{type(e).__name__}: {e}")
        log.debug("background compile of a Mosaic kernel failed", exc_info=True)
        return False


def submit(ctx, ops) -> int:
    """Hand the Mosaic kernels among `ops`, just lowered in `ctx` (a lowering rule's context),
    to the workers, if the module is lowered for a GPU backend. Returns how many were new."""
    if not _enabled or not _is_gpu_backend(getattr(ctx.module_context, "backend", None)):
        return 0
    backend = ctx.module_context.backend
    new = 0
    try:
        calls = []
        for op in _mosaic_calls(ops, ctx.module_context.symbol_table):
            kernel_hash = _kernel_hash(op)
            with _lock:
                known = kernel_hash is None or kernel_hash in _submitted
            if not known:  # the one-kernel module is built only for a kernel not seen before
                calls.append((kernel_hash, _standalone(op)))
    except Exception as e:  # noqa: BLE001 - an IR this code does not know: no precompile, same program
        _record(f"reading the lowered kernel: {type(e).__name__}: {e}")
        return 0
    for kernel_hash, bytecode in calls:
        with _lock:
            if kernel_hash in _submitted:
                continue
            _submitted[kernel_hash] = _get_pool().submit(_compile, backend, bytecode)
        new += 1
    return new


def _record(error: str) -> None:
    """Keep the first few failures' messages for `stats()`."""
    with _lock:
        if len(_errors) < 5:
            _errors.append(error[:500])

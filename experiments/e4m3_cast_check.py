"""`fp8_math.e4m3_bits` against XLA's own f32 -> E4M3 cast on every one of the 2^32 f32 bit patterns.

    python experiments/e4m3_cast_check.py            # about 15 s on 2 CPUs
    python experiments/e4m3_cast_check.py --chunk-log2 22 --chunks 4    # a quick partial run

The XLA quantizer casts to E4M3 with integer arithmetic on the CPU (`fp8_math.cast_e4m3`, issue 44)
because XLA:CPU's cast is slow there; this says whether the two give the same byte for every f32:
normals, subnormals, both zeros, every rounding tie, the values past 448 that become NaN, ±Inf and
every NaN payload. Prints the mismatch count (0 is the claim) and the first few mismatches, and
exits 1 on any. The tests check the rounding boundaries only (every E4M3 value, every midpoint and
their f32 neighbours), which is where an error would live.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_math import FP8_DTYPE, e4m3_bits


def _checker(size: int):
    @jax.jit
    def mismatches(start):
        bits = start + jnp.arange(size, dtype=jnp.uint32)
        q = jax.lax.bitcast_convert_type(bits, jnp.float32)
        native = jax.lax.bitcast_convert_type(q.astype(FP8_DTYPE), jnp.uint8)
        bad = native != e4m3_bits(q)
        # The first mismatching pattern in the chunk (or the chunk's end) to report.
        first = jnp.min(jnp.where(bad, bits, jnp.uint32(0xFFFFFFFF)))
        return jnp.sum(bad, dtype=jnp.int32), first

    return mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-log2", type=int, default=24, help="f32 patterns per jitted call, log2")
    parser.add_argument("--chunks", type=int, default=None, help="stop after this many chunks (default: all)")
    args = parser.parse_args(argv)
    if not 10 <= args.chunk_log2 <= 32:
        parser.error(f"--chunk-log2 must be in 10..32, got {args.chunk_log2}")
    size = 1 << args.chunk_log2
    total_chunks = 1 << (32 - args.chunk_log2)
    chunks = total_chunks if args.chunks is None else min(args.chunks, total_chunks)
    check = _checker(size)
    t0 = time.perf_counter()
    bad_total, firsts = 0, []
    for c in range(chunks):
        bad, first = check(jnp.uint32(c * size))
        bad = int(bad)
        if bad:
            bad_total += bad
            firsts.append(int(first))
    checked = chunks * size
    print(f"{checked} f32 bit patterns ({checked / 2**32:.1%} of all) in {time.perf_counter() - t0:.1f} s: "
          f"{bad_total} mismatches between e4m3_bits and XLA's cast (jax {jax.__version__}, "
          f"{jax.default_backend()})")
    for b in firsts[:8]:
        q = np.uint32(b).view(np.float32)
        native = np.asarray(jax.lax.bitcast_convert_type(jnp.float32(q).astype(FP8_DTYPE), jnp.uint8))
        print(f"  0x{b:08x} ({q!r}): cast 0x{int(native):02x}, e4m3_bits 0x{int(e4m3_bits(jnp.float32(q))):02x}")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())

"""How each compiler rounds jfp8's f32 arithmetic: Mosaic GPU for an H100 (deviceless: the PTX and
SASS it emits) and XLA:CPU (its results against each candidate rounding).

    python benchmarks/hopper/float_rounding.py        # writes benchmarks/results/hopper-build/float-rounding-h100_sxm.json

A kernel reproduces the CPU reference bit for bit only where both round every operation the same
way. The quantizers are built so that they do (products and an IEEE reciprocal, no sums:
`pallas_kernels.fp8_math`); an optimizer kernel (issue 43's AdamW update writing the next step's
E4M3 weights) has sums, divisions and square roots, and needs to know, per expression:

- Mosaic GPU: whether `a * b + c` becomes one `fma.rn.f32` (contracted) or `mul` + `add`, whether
  `a / b` is `div.rn.f32` (IEEE) or `div.full.f32` / `div.approx.f32`, whether `jnp.sqrt` is
  `sqrt.rn.f32` or `sqrt.approx.f32`;
- not XLA:GPU (what the training step's optimizer runs on a GPU today): a deviceless compile
  writes no PTX to `--xla_dump_to` (with `--xla_gpu_dump_llvmir` either), so its rounding is for a
  GPU run to say;
- XLA:CPU (the reference): which rounding its results match, over random inputs: each product
  rounded then added, or one product fused into the add (and which one); `t / s` for a scalar s
  as a division or as `t * (1 / s)`.

The interpreter cannot tell these apart: it runs a kernel's body through XLA:CPU, which rounds the
kernel's expression as it rounds the reference's. Needs the Hopper toolchain
(`scripts/hopper_toolchain.sh`) for the Mosaic GPU rows; each GPU compile runs in a process of its own.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

# name -> (what, jnp expression over f32 arrays a, b, c and a scalar s); b1 = 0.9 as optax's Adam.
EXPRESSIONS = {
    "mul_add": ("a * b + c", lambda a, b, c, s: a * b + c),
    "two_products": ("0.9 * a + (1 - 0.9) * b (Adam's first moment)", lambda a, b, c, s: 0.9 * a + (1 - 0.9) * b),
    "divide": ("a / b", lambda a, b, c, s: a / b),
    "divide_by_scalar": ("a / s, s a traced scalar (optax's global-norm clip)", lambda a, b, c, s: a / s),
    "sqrt": ("sqrt(a) (Adam's denominator)", lambda a, b, c, s: __import__("jax").numpy.sqrt(a)),
}
PTX_OPS = re.compile(r"\b((?:fma|mul|add|sub|div|sqrt|rcp|rsqrt)(?:\.[a-z0-9]+)*\.f32)\b")
SASS_OPS = re.compile(r"\b(FFMA|FMUL|FADD|MUFU\.[A-Z0-9]+)\b")
ROWS, COLS = 64, 128


def _census(text: str, pattern: re.Pattern) -> dict[str, int]:
    return dict(sorted(collections.Counter(pattern.findall(text)).items()))


def _topology_sharding():
    import jax
    from jax.experimental import topologies

    import hopper_build

    text = (hopper_build.TARGETS_DIR / "h100_sxm.txtpb").read_text()
    topo = topologies.get_topology_desc("", "cuda", target_config=text, topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def _mosaic_kernel(expr):
    """A one-CTA Mosaic GPU kernel: a, b, c [64, 128] f32 and s [32] f32 through SMEM, out = expr."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(a_g, b_g, c_g, s_g, o_g, a_s, b_s, c_s, s_s, o_s, bar):
        for src, dst in ((a_g, a_s), (b_g, b_s), (c_g, c_s), (s_g, s_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
        o_s[...] = expr(a_s[...], b_s[...], c_s[...], s_s[0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g)
        plgpu.wait_smem_to_gmem(0)

    tile = lambda: plgpu.SMEM((ROWS, COLS), jnp.float32)  # noqa: E731
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
        scratch_types=[tile(), tile(), tile(), plgpu.SMEM((32,), jnp.float32), tile(), plgpu.Barrier(num_barriers=1)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )


def _abstract_args(sharding):
    import jax
    import jax.numpy as jnp

    tile = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=sharding)
    return tile, tile, tile, jax.ShapeDtypeStruct((32,), jnp.float32, sharding=sharding)


def worker(name: str) -> None:
    """In a process with the toolchain's environment: compile `name`'s kernel for an H100; Mosaic
    GPU dumps its PTX and SASS on stdout (`MOSAIC_GPU_DUMP_PTX`, `MOSAIC_GPU_DUMP_SASS`)."""
    import jax

    import hopper_build
    from pallas_kernels import _mgpu

    args = _abstract_args(_topology_sharding())
    with _mgpu.build_target(hopper_build.TARGETS["h100_sxm"], hopper_build.HOPPER_SMS):
        jax.jit(_mosaic_kernel(EXPRESSIONS[name][1])).trace(*args).lower().compile()


def mosaic_row(name: str, tools: pathlib.Path) -> dict:
    """`name`'s kernel compiled in a process of its own: its f32 PTX and SASS instructions."""
    import hopper_build

    env = dict(hopper_build.child_env(tools), MOSAIC_GPU_DUMP_PTX="1")
    r = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True, env=env,
                       timeout=600, cwd=REPO)
    if r.returncode:
        return {"ok": False, "error": (r.stderr or r.stdout)[-2000:]}
    return {"ok": True, "ptx": _census(r.stdout, PTX_OPS), "sass": _census(r.stdout, SASS_OPS)}


def cpu_rows() -> dict:
    """XLA:CPU's results for each expression against the candidate roundings, over 65,536 random
    inputs (a fused multiply-add emulated in numpy by `_fma32`, correctly rounded)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    n = 1 << 16
    f32 = np.float32
    a, b, c = (rng.standard_normal(n).astype(f32) for _ in range(3))
    pos = np.abs(a) + f32(1e-3)
    s = f32(3.7)
    run = lambda name, *args: np.asarray(jax.jit(EXPRESSIONS[name][1])(*args))  # noqa: E731
    fma = _fma32
    b1, c1 = f32(0.9), f32(1 - 0.9)
    candidates = {
        "mul_add": (run("mul_add", a, b, c, s), {"rounded product, then add": a * b + c, "fused (fma)": fma(a, b, c)}),
        "two_products": (run("two_products", a, b, c, s), {
            "both products rounded, then add": b1 * a + c1 * b,
            "fma(0.9, a, round(0.1 * b))": fma(b1, a, c1 * b),
            "fma(0.1, b, round(0.9 * a))": fma(c1, b, b1 * a),
        }),
        "divide": (run("divide", a, pos, c, s), {"IEEE division": a / pos}),
        "divide_by_scalar": (run("divide_by_scalar", a, b, c, jnp.float32(s)),
                             {"IEEE division": a / s, "a * (1 / s)": a * (f32(1) / s)}),
        "sqrt": (run("sqrt", pos, b, c, s), {"IEEE sqrt": np.sqrt(pos)}),
    }
    return {name: {cand: int(np.sum(got.view(np.uint32) != want.view(np.uint32))) for cand, want in cands.items()}
            | {"inputs": n} for name, (got, cands) in candidates.items()}


def _fma32(a, b, c):
    """The f32 fused multiply-add of f32 arrays, correctly rounded, in numpy: the product is exact
    in f64; TwoSum keeps the f64 sum's rounding error, which breaks an f32 tie the f64 sum hides."""
    import numpy as np

    f32, f64 = np.float32, np.float64
    a, b, c = (np.asarray(t, f32).astype(f64) for t in (a, b, c))
    p = a * b
    s = p + c
    bp = s - p
    e = (p - (s - bp)) + (c - bp)
    r = s.astype(f32)
    for toward, sign in ((f32(np.inf), 1), (f32(-np.inf), -1)):
        n = np.nextafter(r, toward)
        tie = (s == (r.astype(f64) + n.astype(f64)) / 2) & (np.sign(e) == sign)
        r = np.where(tie, n, r)
    return r


def adamw_rows(steps: int = 12) -> dict:
    """jfp8's optimizer (`make_optimizer`, clip + Adam with bf16 moments + decay + learning rate) as
    XLA:CPU runs it, jitted alone on a [256, 384] and a [3, 128, 200] weight over `steps` updates
    (every third with its gradient clipped), against element formulas with one fused multiply-add
    per sum (first moment fma(b1, m, round((1 - b1) g)), as measured alone) or none, the clip an
    IEEE division (in this program its own fusion; `t * (1 / s)` gives 7 first moments of 1,050,624
    wrong over 6 steps, the division none): mismatching elements of the new weight and of each
    moment (compared in bf16, as stored), over all steps. XLA splits the update into fusions that
    each recompute the moments (the new weight's, each bf16 moment's); whether they round them alike
    is not checked."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jfp8.train.optim import OptimizerConfig, learning_rate_schedule, make_optimizer

    f32 = np.float32
    cfg, total = OptimizerConfig(), 200
    tx, sched = make_optimizer(cfg, total), learning_rate_schedule(cfg, total)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((256, 384)) * 0.02, jnp.float32),
              "experts": jnp.asarray(rng.standard_normal((3, 128, 200)) * 0.02, jnp.float32)}
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    bias = jax.jit(lambda c: (1 / (1 - cfg.b1 ** c), 1 / (1 - cfg.b2 ** c)))
    b1, c1, b2, c2, wd = f32(cfg.b1), f32(1 - cfg.b1), f32(cfg.b2), f32(1 - cfg.b2), f32(cfg.weight_decay)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    counts = collections.Counter()
    elements = 0
    for i in range(steps):
        scale = 1.0 if i % 3 == 0 else 1e-3  # a global norm above clip_norm on every third step
        grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * scale, jnp.float32), params)
        adam, lr_state = state[1], state[3]
        g_norm = f32(optax.tree.norm(grads))
        mu_hat, nu_hat = (f32(x) for x in bias(jnp.float32(int(adam.count) + 1)))
        step = f32(-sched(lr_state.count))
        new_params, new_state = update(grads, state, params)
        for k in params:
            p, g = np.asarray(params[k]), np.asarray(grads[k])
            m, v = np.asarray(adam.mu[k]).astype(f32), np.asarray(adam.nu[k]).astype(f32)
            if not g_norm < f32(cfg.clip_norm):
                g = (g / g_norm) * f32(cfg.clip_norm)  # an IEEE division here (a * (1 / s) alone: cpu_rows)
                counts["clipped elements"] += p.size
            mu = _fma32(b1, m, c1 * g)
            nus = {"fma(b2, v, round((1 - b2) g^2))": _fma32(b2, v, c2 * (g * g)), "rounded": b2 * v + c2 * (g * g)}
            got_p = np.asarray(new_params[k])
            got_mu, got_nu = (np.asarray(t[k]).astype(f32) for t in (new_state[1].mu, new_state[1].nu))
            counts["mu: fma(b1, m, round((1 - b1) g))"] += int(np.sum(got_mu != bf16(mu)))
            for name, nu in nus.items():
                counts[f"nu: {name}"] += int(np.sum(got_nu != bf16(nu)))
                out = (mu * mu_hat) / (np.sqrt(nu * nu_hat) + f32(cfg.eps))
                for decay_name, u in (("fma(wd, p, out)", _fma32(wd, p, out)), ("rounded", out + wd * p)):
                    for apply_name, new in (("fma(-lr, u, p)", _fma32(step, u, p)), ("rounded", p + step * u)):
                        key = f"weight: nu {name}, decay {decay_name}, apply {apply_name}"
                        counts[key] += int(np.sum(got_p.view(np.uint32) != new.view(np.uint32)))
            elements += p.size
        params, state = new_params, new_state
    return {"elements": elements, "steps": steps, **dict(sorted(counts.items()))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    p.add_argument("--out", type=pathlib.Path,
                   default=REPO / "benchmarks" / "results" / "hopper-build" / "float-rounding-h100_sxm.json")
    p.add_argument("--cpu-only", action="store_true", help="only XLA:CPU's rows (no toolchain needed)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    import jax

    import hopper_build
    from provenance import commit_info

    doc = {"what": __doc__.split("\n\n")[0], "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           **commit_info(), "expressions": {k: v[0] for k, v in EXPRESSIONS.items()},
           "xla_cpu_mismatches": cpu_rows(), "xla_cpu_adamw_mismatches": adamw_rows(), "cpu": _cpu_name()}
    if not args.cpu_only:
        tools = hopper_build.toolchain()
        doc["ptxas"] = hopper_build.ptxas_version(tools)
        doc["mosaic_h100_sxm"] = {name: mosaic_row(name, tools) for name in EXPRESSIONS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("xla_cpu_mismatches", "xla_cpu_adamw_mismatches") + (("mosaic_h100_sxm",) if "mosaic_h100_sxm" in doc else ())},
                     indent=1))
    print(f"wrote {args.out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


if __name__ == "__main__":
    sys.exit(main())

"""Bytes moved by the expert-parallel all-to-alls per train step, FP8 vs BF16 dispatch, and the
step time on a simulated CPU mesh (or real devices). Writes benchmarks/results/dispatch-<device>-<date>.json.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python benchmarks/bench_dispatch.py

Bytes come from the HLO handed to XLA (`lower().as_text("hlo")`): XLA:CPU widens f8/bf16
collectives to f16/f32 after optimisation, GPUs keep the types.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import time

import jax
import numpy as np

from jfp8 import mesh as meshes
from jfp8.nn import expert_parallel
from jfp8.train import sharded
from jfp8.train.loop import TrainConfig

MESH = "data=2,expert=4"
CONFIG = TrainConfig(preset="tiny", batch_size=16, seq_len=64, steps=10, model_overrides=(("n_routed", 8),))
TIMED_STEPS = 3


def measure(dispatch: str, mesh) -> dict:
    _, _, params, rest, tx, _, step, _ = sharded.build_sharded(CONFIG, mesh, expert_parallel.ParallelOptions(dispatch=dispatch))
    opt_state = tx.init(params)
    tokens = meshes.shard_batch(np.random.default_rng(0).integers(0, 256, (CONFIG.batch_size, CONFIG.seq_len)).astype(np.int32), mesh)
    lowered = step.lower(params, rest, opt_state, tokens)
    moved = expert_parallel.all_to_all_bytes(lowered.as_text(dialect="hlo"))
    compiled = lowered.compile()
    # The step donates its state (`jfp8.train.step.TrainSetup`): each call takes the last one's.
    params, rest, opt_state, _ = jax.block_until_ready(compiled(params, rest, opt_state, tokens))
    times = []
    for _ in range(TIMED_STEPS):
        t0 = time.perf_counter()
        params, rest, opt_state, _ = jax.block_until_ready(compiled(params, rest, opt_state, tokens))
        times.append(time.perf_counter() - t0)
    return {"dispatch": dispatch, "all_to_all_bytes_per_device": moved,
            "all_to_all_total_bytes_per_device": sum(moved.values()), "step_s_median": float(np.median(times))}


def main() -> None:
    shape = meshes.parse_mesh(MESH)
    mesh = meshes.make_mesh(shape.data, shape.expert)
    rows = [measure(d, mesh) for d in ("fp8", "bf16")]
    fp8, bf16 = (r["all_to_all_bytes_per_device"] for r in rows)
    dispatch_fp8 = fp8.get("f8e4m3fn", 0) + fp8.get("f32", 0)
    dispatch_bf16 = bf16["bf16"] - fp8["bf16"]  # the BF16 combine/backward all-to-alls are shared
    date = datetime.date.today().isoformat()
    result = {
        "device": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "n_devices": shape.size, "mesh": MESH, "jax_version": jax.__version__, "date": date,
        "config": CONFIG.to_json(), "rows": rows,
        "forward_dispatch_bytes": {"fp8": dispatch_fp8, "bf16": dispatch_bf16, "ratio": dispatch_fp8 / dispatch_bf16},
    }
    out = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"dispatch-{result['device']}-{date}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("mesh", "forward_dispatch_bytes")}), [(r["dispatch"], r["step_s_median"]) for r in rows])
    print("wrote", out)


if __name__ == "__main__":
    main()

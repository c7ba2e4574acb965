"""The device mesh: `data` x `expert` axes, placing batches and parameters, several hosts.

Every device holds B / (D·E_p) sequences of the batch (tokens are spread over all devices), a
replica of the dense parameters and N_r / E_p routed experts of every MoE layer (`w13`, `w2`
sharded on their expert axis over `expert`, replicated over `data`). A 1x1 mesh is the
single-device case. The MoE layers' all-to-all is `jfp8.nn.expert_parallel`; the sharded training
step, `jfp8.train.sharded`.

Several hosts (one process per host, every host sees its local GPUs; D·E_p = all GPUs): call
`initialize_distributed()` before anything else touches jax; it calls `jax.distributed.initialize`
from JFP8_COORDINATOR, JFP8_NUM_PROCESSES and JFP8_PROCESS_ID, and does nothing when they are
unset:

    # host 0 (10.0.0.1)                               # host 1
    JFP8_COORDINATOR=10.0.0.1:1234 JFP8_NUM_PROCESSES=2 JFP8_PROCESS_ID=0 \\
        python experiments/train_moe.py --preset gpu --mesh data=2,expert=8
    JFP8_COORDINATOR=10.0.0.1:1234 JFP8_NUM_PROCESSES=2 JFP8_PROCESS_ID=1 \\
        python experiments/train_moe.py --preset gpu --mesh data=2,expert=8

Put the expert axis inside a host (fast NVLink all-to-all): `make_mesh` orders devices so that
the `expert` axis is the fastest-varying one, which with jax's device order keeps an expert group
on one host when E_p divides the GPUs per host. Every process must feed the same global batch
(`shard_batch` places each process's addressable shards; the batches of `jfp8.train.data` are a
pure function of (seed, step), so every host computes them identically).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"

EXPERT_AXIS = "expert"

BATCH_AXES = (DATA_AXIS, EXPERT_AXIS)  # the batch is sharded over every device

@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the two mesh axes: `data` (data parallel) and `expert` (expert parallel)."""

    data: int = 1
    expert: int = 1

    def __post_init__(self):
        for name in ("data", "expert"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"mesh axis {name} must be a positive int, got {getattr(self, name)!r}")

    @property
    def size(self) -> int:
        return self.data * self.expert

def parse_mesh(spec: str) -> MeshShape:
    """"data=D,expert=E" (either may be omitted, default 1; order free) -> MeshShape."""
    sizes = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(data|expert)\s*=\s*(\d+)", part)
        if m is None or m.group(1) in sizes:
            raise ValueError(f"bad mesh spec {spec!r}: expected 'data=D,expert=E' with positive ints, e.g. 'data=2,expert=4'")
        sizes[m.group(1)] = int(m.group(2))
    return MeshShape(**sizes)

def make_mesh(data: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A (data, expert) `Mesh` over the first data·expert devices (`jax.devices()` by default).

    The expert axis varies fastest, so an expert group is a run of consecutive devices (one host's
    GPUs when `expert` divides them).
    """
    shape = MeshShape(data, expert)
    devices = list(jax.devices() if devices is None else devices)
    if shape.size > len(devices):
        raise ValueError(
            f"mesh data={data},expert={expert} needs {shape.size} devices, {len(devices)} are visible; "
            "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax"
        )
    grid = np.array(devices[: shape.size], dtype=object).reshape(data, expert)
    return Mesh(grid, (DATA_AXIS, EXPERT_AXIS))

def initialize_distributed() -> bool:
    """`jax.distributed.initialize` from JFP8_COORDINATOR / JFP8_NUM_PROCESSES / JFP8_PROCESS_ID.

    Returns True when it initialised, False when the variables are unset (single process).
    """
    addr = os.environ.get("JFP8_COORDINATOR")
    if not addr:
        return False
    try:
        n, pid = int(os.environ["JFP8_NUM_PROCESSES"]), int(os.environ["JFP8_PROCESS_ID"])
    except (KeyError, ValueError) as e:
        raise ValueError("JFP8_COORDINATOR is set: also set JFP8_NUM_PROCESSES and JFP8_PROCESS_ID to ints") from e
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid)
    return True

def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sequences [B, T] sharded over every device (data-major, expert-minor)."""
    return NamedSharding(mesh, P(BATCH_AXES))

def shard_batch(tokens, mesh: Mesh) -> jax.Array:
    """Place a global [B, T] batch on the mesh; B must be a multiple of the device count."""
    n = mesh.devices.size
    if tokens.shape[0] % n:
        raise ValueError(f"batch size {tokens.shape[0]} must be a multiple of the {n} mesh devices (data x expert)")
    return jax.make_array_from_callback(tokens.shape, batch_sharding(mesh), lambda idx: np.asarray(tokens)[idx])

def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

def _is_expert_weight(path, leaf) -> bool:
    """Routed-expert weights: `<...>.ffn.w13` / `.ffn.w2` of an MoE, [N_r, ., .] (the dense and
    shared SwiGLUs keep theirs in `Fp8Linear.weight`)."""
    names = [_key_name(k) for k in path]
    return len(names) >= 3 and names[-3] == "ffn" and names[-2] in ("w13", "w2") and jnp.ndim(leaf) == 3

def param_specs(params) -> object:
    """PartitionSpecs of a params (or any nnx state) tree: experts on `expert`, the rest replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: P(EXPERT_AXIS) if _is_expert_weight(path, leaf) else P(), params
    )

def shard_params(params, mesh: Mesh):
    """Place params (or any nnx state) on the mesh following `param_specs`."""
    specs = param_specs(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)

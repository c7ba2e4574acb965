"""The device mesh: `data` x `expert` axes, placing batches and parameters, several hosts.

Every device holds B / (D·E_p) sequences of the batch (tokens are spread over all devices), a
replica of the dense parameters and N_r / E_p routed experts of every MoE layer (`w13`, `w2`
sharded on their expert axis over `expert`, replicated over `data`). A 1x1 mesh is the
single-device case. The MoE layers' all-to-all is `jfp8.nn.expert_parallel`; the sharded training
step, `jfp8.train.sharded`.

Several processes (one per host, each seeing its local devices; D·E_p = all devices): call
`initialize_distributed()` first; it joins the job described by JFP8_COORDINATOR,
JFP8_NUM_PROCESSES and JFP8_PROCESS_ID (`DistributedConfig.from_env`) and does nothing when they
are unset:

    # host 0 (10.0.0.1)                               # host 1
    JFP8_COORDINATOR=10.0.0.1:1234 JFP8_NUM_PROCESSES=2 JFP8_PROCESS_ID=0 \\
        python experiments/train_moe.py --preset gpu --mesh data=2,expert=8
    JFP8_COORDINATOR=10.0.0.1:1234 JFP8_NUM_PROCESSES=2 JFP8_PROCESS_ID=1 \\
        python experiments/train_moe.py --preset gpu --mesh data=2,expert=8

`scripts/launch_local.py` starts N such processes on one machine. Put the expert axis inside a
host (fast NVLink all-to-all): `make_mesh` orders devices so that the `expert` axis is the
fastest-varying one, which with jax's device order (process by process) keeps an expert group on
one host when E_p divides the devices per host. Each process builds only the rows of a batch that
its devices hold (`shard_rows`); the batches of `jfp8.train.data` are a pure function of
(seed, step), so every process knows its rows without talking to the others.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.extend.backend
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

@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process's place in a multi-process job, and how long it waits for the others.

    A process that stops sending heartbeats for `heartbeat_timeout_s` is declared dead and every
    other process then ends with an error (XLA's coordination service aborts it) instead of
    waiting in a collective forever; `init_timeout_s` bounds the wait for all processes to join.
    """

    coordinator: str  # "host:port" of process 0's coordination service
    num_processes: int
    process_id: int
    heartbeat_timeout_s: int = 60
    init_timeout_s: int = 300
    shutdown_timeout_s: int = 60

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"JFP8_PROCESS_ID={self.process_id} must lie in [0, JFP8_NUM_PROCESSES={self.num_processes})"
            )
        for name in ("heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 second, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ=None) -> DistributedConfig | None:
        """From JFP8_COORDINATOR, JFP8_NUM_PROCESSES, JFP8_PROCESS_ID and optionally
        JFP8_HEARTBEAT_TIMEOUT_S, JFP8_INIT_TIMEOUT_S, JFP8_SHUTDOWN_TIMEOUT_S (seconds); None when
        JFP8_COORDINATOR is unset (a single process)."""
        env = os.environ if environ is None else environ
        if not env.get("JFP8_COORDINATOR"):
            return None
        ints = {"num_processes": "JFP8_NUM_PROCESSES", "process_id": "JFP8_PROCESS_ID",
                "heartbeat_timeout_s": "JFP8_HEARTBEAT_TIMEOUT_S", "init_timeout_s": "JFP8_INIT_TIMEOUT_S",
                "shutdown_timeout_s": "JFP8_SHUTDOWN_TIMEOUT_S"}
        kw = {}
        for field, var in ints.items():
            if var in env:
                try:
                    kw[field] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} must be an integer") from None
            elif field in ("num_processes", "process_id"):
                raise ValueError(f"JFP8_COORDINATOR is set: also set {var} (an integer)")
        return cls(coordinator=env["JFP8_COORDINATOR"], **kw)

def initialize_distributed(config: DistributedConfig | None = None) -> bool:
    """Joins the multi-process job `config` (default: `DistributedConfig.from_env()`) through
    `jax.distributed.initialize`, with gloo collectives for CPU devices. Returns True when it
    joined, False when there is no job (single process).

    jax must not hold arrays yet. Importing jfp8 does not start jax's backend; if something else
    did (with no array alive), that backend is dropped and started again as part of the job.
    """
    config = DistributedConfig.from_env() if config is None else config
    if config is None:
        return False
    if alive := jax.live_arrays():
        raise RuntimeError(
            f"initialize_distributed() must run before jax holds arrays ({len(alive)} alive, e.g. "
            f"{alive[0].shape} {alive[0].dtype}): call it at the start of the program"
        )
    jax.extend.backend.clear_backends()  # a backend started before the job, if any
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator, num_processes=config.num_processes,
        process_id=config.process_id, initialization_timeout=config.init_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s, shutdown_timeout_seconds=config.shutdown_timeout_s,
        # Everything is given: no detection, which under SLURM or Open MPI would also restrict a
        # process to one GPU (its local rank's), not the whole host's.
        cluster_detection_method="deactivate",
    )
    return True

def is_main_process() -> bool:
    """True in the process that writes files and logs (process 0; the only one without a job)."""
    return jax.process_index() == 0

def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sequences [B, T] sharded over every device (data-major, expert-minor)."""
    return NamedSharding(mesh, P(BATCH_AXES))

def shard_rows(make_rows, shape: tuple[int, ...], mesh: Mesh) -> jax.Array:
    """A global batch of `shape` [B, T] on the mesh, of which this process builds only the rows
    its own devices hold: `make_rows(rows)` -> [len(rows), T] for a `slice` of the B rows, called
    once per local device. B must be a multiple of the device count."""
    n = mesh.devices.size
    if shape[0] % n:
        raise ValueError(f"batch size {shape[0]} must be a multiple of the {n} mesh devices (data x expert)")
    return jax.make_array_from_callback(
        shape, batch_sharding(mesh), lambda idx: np.asarray(make_rows(idx[0]))[(slice(None),) + idx[1:]]
    )

def shard_batch(tokens, mesh: Mesh) -> jax.Array:
    """Place a global [B, T] batch, held whole by every process, on the mesh; B must be a multiple
    of the device count."""
    return shard_rows(lambda rows: np.asarray(tokens)[rows], np.shape(tokens), mesh)

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
    """Place params (or any nnx state) on the mesh following `param_specs`. In a multi-process
    job every process must hold the same values (the same seeded initialisation)."""
    specs = param_specs(params)
    return jax.tree.map(lambda x, s: _place(x, NamedSharding(mesh, s)), params, specs)

def _place(x, sharding: NamedSharding) -> jax.Array:
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process, or already spread over the job: a reshard
    # A value every process holds: each places its own devices' part. (`device_put` would first
    # check that the processes agree, a collective per array.)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_place(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

def barrier(name: str, timeout_s: float = 600) -> None:
    """Waits until every process of the job reaches `barrier(name)`; nothing in a single process.

    gloo gives the processes 30 s to meet at a collective they run for the first time (not
    configurable from jax); a barrier of the coordination service after the local start-up work
    (imports, data, initialisation: slower in some processes on a loaded machine) absorbs a
    longer lead of one process."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the job's coordination client (orbax reaches it the same way)

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))

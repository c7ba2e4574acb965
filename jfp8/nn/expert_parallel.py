"""Expert-parallel MoE: the routed experts spread over the mesh's `expert` axis (call under
`jax.shard_map`).

Expert parallelism (DeepSeek-V3 §3.2.2, §3.3.4): inside each MoE layer, the E_p devices of one
`data` row exchange tokens with `jax.lax.all_to_all` over the `expert` axis.

  dispatch (forward)   tokens quantized ONCE to E4M3 in (1, 128) tiles (`jfp8.quantize`), the rows
                       gathered into a per-destination buffer, and the FP8 data [E_p, C, d] and the
                       FP32 scales [E_p, C, d/128] all-to-all'ed. The receiver feeds the received
                       `Fp8Tensor` straight into the grouped FP8 GEMM of its local experts: no
                       dequantize/requantize, so Fprop sees bit for bit the FP8 operand of the
                       single-device step (quantization is row-local: 1x128 tiles never mix tokens).
  combine (forward)    the experts' BF16 outputs go back through the inverse all-to-all (BF16) and
                       are summed per token with the gating weights (`jfp8.nn.moe.combine`).
  backward             the gradient of the combine is the all-to-all of BF16 gradients (autodiff's
                       transpose of an all-to-all is the reverse all-to-all). The FP8 dispatch is
                       a custom_vjp fused with the first expert GEMM: its Dgrad output (BF16) goes
                       back through the reverse all-to-all in BF16 and each token's copies are
                       summed onto it, i.e. the dispatch quantization is straight-through
                       (d tokens = the BF16 gradient of the dequantized dispatched tokens). Wgrad
                       reuses the received FP8 copy (§3.5.2 re-tiling), like `grouped_fp8_linear`.
                       The sum is a gather of each token's slots in slot order, in both dispatch
                       precisions (`_sum_slots`; BF16 dispatch: `_send_buffer`'s gradient): the
                       bits of autodiff's scatter-add, without the atomic additions that make a
                       GPU's result change from run to run (bf16 and f32 gradients; other dtypes
                       keep the scatter). Being custom VJPs, both are reverse-mode only.

Buffers (static shapes, dropless): a device with N tokens and top-K routing sends, to each of the
E_p destinations, a buffer of C = N·K rows (the worst case: all its assignments land on one device),
so nothing is ever dropped. Cost per MoE layer and device: the send and receive buffers hold
E_p·N·K rows each, E_p times the N·K rows actually routed: (d + 4·d/128) bytes per row in FP8
dispatch (vs 2·d in BF16), plus 2·d bytes per row for the BF16 combine, and the grouped GEMMs run
over E_p·N·K rows (zero padding past the group sizes). `capacity_factor` shrinks C to
ceil(factor·N·K/E_p) rows: assignments past C are NOT silently lost — each step reports
`dropped_assignments` (global count) and `check_no_drops` raises when it is nonzero.

`ExpertParallelMoE` is an `MoE` that overrides one step, `routed_experts` (sort, the two grouped
GEMMs, combine), with the all-to-all version; routing, the shared experts and the balance
statistics are `MoE`'s own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jfp8.fp8 import TILE, Fp8Tensor
from jfp8.mesh import EXPERT_AXIS
from jfp8.nn.layers import swiglu
from jfp8.nn.model import Transformer
from jfp8.nn.moe import MoE, combine, expert_loads, inverse_order
from jfp8.ops import _gmm, _grouped_bwd, _q, _take_rows, _take_rows_transpose, _vary_like, grouped_fp8_linear
from jfp8.recipe import Fp8Recipe

DispatchDtype = Literal["auto", "fp8", "bf16"]

class SendPlan(NamedTuple):
    """Where each of a device's N·K assignments goes (built from its routing alone).

    send_rows [E_p·C] int32: token index of each send slot (N: an empty slot, a zero row).
    back_slots [N·K] int32: for the assignments in expert-sorted order, the flat slot (dest·C + c)
      of their output in the returned buffer; E_p·C for a dropped assignment (reads a zero row).
    order [N·K] int32: expert-sorted assignment order (as `jfp8.nn.moe.dispatch`).
    counts [E_p, E_l] int32: assignments per (destination, local expert) actually sent.
    dropped () int32: assignments past the capacity (0 when dropless).
    token_slots [N, K] int32: each token's send slots in ascending order, E_p·C for a dropped
      assignment: the table the tokens' gradient is gathered and summed with, in the order
      `send_rows`' scatter-add would add it (`_sum_slots`, `_send_buffer`; as
      `jfp8.ops.take_rows`' `token_rows`).
    """

    send_rows: jax.Array
    back_slots: jax.Array
    order: jax.Array
    counts: jax.Array
    dropped: jax.Array
    token_slots: jax.Array

class RecvPlan(NamedTuple):
    """How the received [E_p, C] slots become rows grouped by local expert.

    perm [E_p·C] int32: grouped row r is received slot perm[r] (valid rows first, by local expert
      then source then slot; empty slots last). inverse [E_p·C]: its inverse permutation.
    group_sizes [E_l] int32: received rows per local expert.
    """

    perm: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array

def send_plan(experts: jax.Array, n_experts: int, ep: int, capacity: int) -> SendPlan:
    """Per-destination send slots for routing `experts` [N, K] (global ids) over `ep` devices.

    Experts are sharded contiguously: device j holds experts [j·E_l, (j+1)·E_l), E_l = n_experts/ep.
    Within a destination the rows are sorted by expert (then token), so the receiver sees each
    source's rows grouped by local expert.
    """
    n, k = experts.shape
    el = n_experts // ep
    flat = experts.reshape(-1)  # [N*K]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [N*K]
    dest = flat[order] // el  # [N*K], non-decreasing
    loads = expert_loads(experts, n_experts).reshape(ep, el)  # [E_p, E_l]
    per_dest = loads.sum(axis=1)  # [E_p]
    start = jnp.cumsum(per_dest) - per_dest  # [E_p] exclusive prefix sum
    slot = jnp.arange(n * k, dtype=jnp.int32) - start[dest]  # position inside the destination buffer
    kept = slot < capacity
    flat_slot = jnp.where(kept, dest * capacity + slot, ep * capacity).astype(jnp.int32)
    send_rows = jnp.full((ep * capacity,), n, jnp.int32).at[flat_slot].set(order // k, mode="drop")
    # Per (dest, local expert), what survives the capacity: rows are expert-sorted inside a dest.
    cum = jnp.cumsum(loads, axis=1)  # [E_p, E_l]
    sent_cum = jnp.minimum(cum, capacity)
    counts = jnp.diff(sent_cum, axis=1, prepend=jnp.zeros((ep, 1), sent_cum.dtype)).astype(jnp.int32)
    dropped = jnp.sum(~kept).astype(jnp.int32)
    token_slots = jnp.sort(flat_slot[inverse_order(order)].reshape(n, k), axis=1)  # [N, K]
    return SendPlan(send_rows, flat_slot, order, counts, dropped, token_slots)

def recv_plan(recv_counts: jax.Array, capacity: int) -> RecvPlan:
    """Group the received slots by local expert. recv_counts [E_p, E_l]: rows from each source per
    local expert (each source's rows arrive expert-sorted at the front of its C slots)."""
    ep, el = recv_counts.shape
    cum = jnp.cumsum(recv_counts, axis=1)  # [E_p, E_l]
    c = jnp.arange(capacity, dtype=cum.dtype)
    local = jnp.sum(c[None, :, None] >= cum[:, None, :], axis=-1)  # [E_p, C]: local expert, E_l = empty
    perm = jnp.argsort(local.reshape(-1), stable=True).astype(jnp.int32)  # [E_p*C]
    inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32))
    return RecvPlan(perm, inverse, recv_counts.sum(axis=0).astype(jnp.int32))

def _exchange(x: jax.Array, axis: str) -> jax.Array:
    """[E_p, C, ...] -> [E_p, C, ...]: block j goes to device j; block i of the result came from i."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)

def _to_grouped(buf: jax.Array, rp: RecvPlan) -> jax.Array:
    """Received [E_p, C, ...] -> rows grouped by local expert [E_p*C, ...]."""
    return jnp.take(buf.reshape(-1, *buf.shape[2:]), rp.perm, axis=0)

def _from_grouped(rows: jax.Array, rp: RecvPlan, ep: int) -> jax.Array:
    """Inverse of `_to_grouped`: [E_p*C, ...] -> [E_p, C, ...]."""
    return jnp.take(rows, rp.inverse, axis=0).reshape(ep, -1, *rows.shape[1:])

def _send_buffer(rows: jax.Array, sp: SendPlan, ep: int) -> jax.Array:
    """rows [N, ...] -> [E_p, C, ...] with zero rows in empty slots. Its gradient sums each row's
    slots with a gather in slot order (`jfp8.ops._take_rows`' transpose, as `_sum_slots`), not a
    scatter-add."""
    padded = jnp.concatenate([rows, jnp.zeros((1, *rows.shape[1:]), rows.dtype)])  # row N = zeros
    # The zero row's table row lists no slot: its gradient (which the concatenation drops) is 0.
    table = jnp.concatenate([sp.token_slots, jnp.full((1, sp.token_slots.shape[1]), sp.send_rows.shape[0], jnp.int32)])
    return _take_rows(padded, sp.send_rows, table).reshape(ep, -1, *rows.shape[1:])

def _sum_slots(flat: jax.Array, sp: SendPlan, n: int) -> jax.Array:
    """[E_p·C, ...] gradients of the send slots -> [N, ...]: each token's slots summed in slot
    order, as `zeros.at[send_rows].add(flat)` sums them on the CPU (the same bits), with a gather
    instead of the scatter-add whose atomic additions on a GPU change the result from run to run
    (`jfp8.ops.take_rows`)."""
    return _take_rows_transpose(flat, sp.send_rows, sp.token_slots, n)

def _fp8_rows(q: Fp8Tensor) -> tuple[jax.Array, jax.Array]:
    """An (1, 128)-tiled Fp8Tensor's per-row payload: data [M, K] e4m3 (the zero padding to whole
    tiles is not sent) and scales [M, Kp/128]."""
    m, k = q.logical
    return q.data[:m, :k], q.scale[:m]

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dispatch_fp8_linear(tokens, w, sp: SendPlan, rp: RecvPlan, axis: str, recipe: Fp8Recipe):
    return _dispatch_fp8_linear_fwd(tokens, w, sp, rp, axis, recipe)[0]

def _dispatch_fp8_linear_fwd(tokens, w, sp, rp, axis, recipe):
    """tokens [N, d] -> grouped first expert GEMM [E_p*C, n] in tokens' dtype (FP8 all-to-all)."""
    ep = sp.counts.shape[0]
    # Once per token, not once per assignment.
    q = _q(tokens, recipe.activation_block, recipe, recipe.activation_amax_floor)
    data, scale = _fp8_rows(q)  # [N, dp] e4m3, [N, dp/128] f32
    recv_data = _to_grouped(_exchange(_send_buffer(data, sp, ep), axis), rp)  # [E_p*C, dp] e4m3
    recv_scale = _to_grouped(_exchange(_send_buffer(scale, sp, ep), axis), rp)  # [E_p*C, dp/128]
    recv_data = jnp.pad(recv_data, ((0, 0), (0, q.data.shape[1] - q.logical[1])))  # back to whole tiles
    qx = Fp8Tensor(recv_data, recv_scale, q.block, (recv_data.shape[0], q.logical[1]))
    qw = _q(w, recipe.weight_block, recipe, recipe.weight_amax_floor)  # [E_l, d, n] in 128x128 blocks
    y = _gmm(qx, qw.mT, rp.group_sizes, tokens.dtype, recipe)  # [E_p*C, n]
    w_res = qw if recipe.dgrad else w
    probe = jnp.zeros((tokens.shape[0], 0), tokens.dtype)  # carries N and the dtype of d tokens
    return y, (qx, w_res, sp, rp, probe)

def _dispatch_fp8_linear_bwd(axis, recipe, res, dy):
    qx, w_res, sp, rp, probe = res
    ep, n = sp.counts.shape[0], probe.shape[0]
    dx_grouped, dw, _ = _grouped_bwd(recipe, (qx, w_res, rp.group_sizes), dy)  # BF16 Dgrad, FP32 Wgrad
    back = _exchange(_from_grouped(dx_grouped.astype(probe.dtype), rp, ep), axis)  # [E_p, C, d]
    flat = back.reshape(-1, back.shape[-1])  # [E_p*C, d]
    # Straight-through: each token receives the BF16 gradients of its dispatched copies.
    dtok = _sum_slots(flat, sp, n)
    return dtok, dw, None, None

_dispatch_fp8_linear.defvjp(_dispatch_fp8_linear_fwd, _dispatch_fp8_linear_bwd)


def _resolve_dispatch(dispatch: DispatchDtype, recipe: Fp8Recipe) -> Literal["fp8", "bf16"]:
    """"auto": FP8 dispatch whenever the recipe quantizes Fprop activations in 1x128 tiles."""
    if dispatch not in ("auto", "fp8", "bf16"):
        raise ValueError(f"dispatch must be 'auto', 'fp8' or 'bf16', got {dispatch!r}")
    fp8_ok = recipe.fprop and recipe.wgrad and recipe.activation_block == (1, TILE)
    if dispatch == "auto":
        return "fp8" if fp8_ok else "bf16"
    if dispatch == "fp8" and not fp8_ok:
        raise NotImplementedError(
            f"FP8 dispatch needs a recipe with FP8 Fprop and Wgrad and (1, {TILE}) activation tiles "
            f"(got {recipe}); use dispatch='bf16'"
        )
    return dispatch

def capacity_for(n_tokens: int, top_k: int, ep: int, capacity_factor: float | None) -> int:
    """Send-buffer rows per destination: N·K (dropless worst case) or ceil(f·N·K/E_p), at most N·K."""
    worst = n_tokens * top_k
    if capacity_factor is None:
        return worst
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive or None (dropless), got {capacity_factor}")
    return min(worst, max(1, math.ceil(capacity_factor * worst / ep)))

class DropCounter:
    """Collects the dropped-assignment counts of the MoE layers during one traced forward pass."""

    def __init__(self):
        self.counts: list[jax.Array] = []

    def total(self) -> jax.Array:
        return sum(self.counts, jnp.zeros((), jnp.int32))


class ExpertParallelMoE(MoE):
    """An `MoE` (same variables) whose routed experts are spread over mesh axis `axis`: it
    overrides `routed_experts` with the all-to-all version (see `install_expert_parallel`).

    Holds this device's shard of the experts: w13 [E_l, d, 2h], w2 [E_l, h, d] with E_l = N_r / E_p;
    gate, router bias and shared experts are replicas."""

    def __init__(self, moe: MoE, *, axis: str, dispatch: DispatchDtype, capacity_factor, drops: DropCounter):
        self.cfg, self.gate, self.router_bias = moe.cfg, moe.gate, moe.router_bias
        self.w13, self.w2, self.shared = moe.w13, moe.w2, moe.shared
        self.ep_axis, self.dispatch, self.capacity_factor, self.drops = axis, dispatch, capacity_factor, drops

    def routed_experts(self, tokens, experts, weights):
        """tokens [N, d] (this device's), experts/weights [N, K] -> (y [N, d], loads [N_r]): each
        token's assignments sent to the device holding the expert, computed there, sent back and
        combined. Reports the assignments dropped by a finite capacity to `self.drops`."""
        cfg = self.cfg
        ep = jax.lax.axis_size(self.ep_axis)
        if cfg.n_routed % ep:
            raise ValueError(f"n_routed={cfg.n_routed} experts do not split over expert axis of size {ep}; pick a divisor")
        n, d = tokens.shape
        cap = capacity_for(n, cfg.top_k, ep, self.capacity_factor)
        sp = send_plan(experts, cfg.n_routed, ep, cap)
        rp = recv_plan(_exchange(sp.counts, self.ep_axis), cap)  # [E_l] rows per local expert
        w13, w2 = self.w13[...], self.w2[...]
        if _resolve_dispatch(self.dispatch, cfg.recipe) == "fp8":
            w32 = w13.astype(jnp.float32)
            gate_up = _dispatch_fp8_linear(tokens, _vary_like(w32, tokens), sp, rp, self.ep_axis, cfg.recipe)
        else:  # BF16 dispatch: plain all-to-all, differentiated by autodiff
            x_recv = _to_grouped(_exchange(_send_buffer(tokens, sp, ep), self.ep_axis), rp)  # [E_p*C, d]
            gate_up = grouped_fp8_linear(x_recv, w13, rp.group_sizes, cfg.recipe)  # [E_p*C, 2h]
        y_grouped = grouped_fp8_linear(swiglu(gate_up), w2, rp.group_sizes, cfg.recipe)  # [E_p*C, d]
        back = _exchange(_from_grouped(y_grouped, rp, ep), self.ep_axis)  # [E_p, C, d] BF16 combine
        back = jnp.concatenate([back.reshape(-1, d), jnp.zeros((1, d), back.dtype)])  # + a zero row
        y_sorted = jnp.take(back, sp.back_slots, axis=0)  # [N*K, d] in expert-sorted order
        self.drops.counts.append(sp.dropped)
        return combine(y_sorted, sp.order, weights), expert_loads(experts, cfg.n_routed)


def install_expert_parallel(
    model: Transformer, *, dispatch: DispatchDtype = "auto", capacity_factor: float | None = None
) -> DropCounter:
    """Swap every MoE FFN of `model` (a merged copy, inside shard_map) for an `ExpertParallelMoE`
    sharing its variables. Returns the counter the layers report dropped assignments to."""
    drops = DropCounter()
    blocks = list(model.blocks) + ([model.mtp.block] if model.mtp is not None else [])
    for block in blocks:
        if isinstance(block.ffn, MoE):
            block.ffn = ExpertParallelMoE(
                block.ffn, axis=EXPERT_AXIS, dispatch=dispatch, capacity_factor=capacity_factor, drops=drops
            )
    return drops

@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """How the MoE layers communicate. dispatch: "auto" (FP8 with an FP8 recipe, else BF16), "fp8"
    or "bf16"; capacity_factor: None (dropless, C = N·K) or a factor of the balanced share N·K/E_p."""

    dispatch: DispatchDtype = "auto"
    capacity_factor: float | None = None

_HLO_BYTES = {"f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}

def all_to_all_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per element type moved by the all-to-alls of an HLO module (per device, per call).

    Sums the result shapes of every `all-to-all` instruction (an all-to-all's result has its
    operands' sizes); e.g. `jax.jit(f).lower(*args).compile().as_text()`.
    """
    total: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if " all-to-all(" not in line or "=" not in line:
            continue
        result = line.split("=", 1)[1].split(" all-to-all(", 1)[0]
        for dtype, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", result):
            if dtype not in _HLO_BYTES:
                raise ValueError(f"unknown HLO element type {dtype!r} in: {line.strip()}")
            n = math.prod(int(x) for x in dims.split(",") if x)
            total[dtype] = total.get(dtype, 0) + n * _HLO_BYTES[dtype]
    return total

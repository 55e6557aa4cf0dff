"""Expert parallelism: a mixture-of-experts layer's experts split over the `expert` mesh axis, the
tokens sent to the devices that hold their experts and the results sent back (shard_map).

Layout (mesh.expert = P > 1; rules.EXPERT_PARALLEL): device p of an expert group (the P devices
that differ only in their `expert` index) holds experts [p E/P, (p+1) E/P) of every layer (then
split over fsdp, gathered per layer) and its own rows of the batch (rows over data x fsdp x
expert). Per MoE layer, with n tokens per device, top-K routing, width D:

  1. route   (outside, as on one device: models/moe.route; replayed ids enter the same way)
  2. pack    the n K (token, choice) rows sorted by expert, so by destination device; row i to
             device d goes to slot [d, i - start_d] of a send buffer [P, C, D] (C = capacity)
  3. send    all_to_all over `expert`: buffer [P, C, D] -> [P, C, D], slot [s, :] now holds what
             device s sent here (with each row's local expert id, [P, C] int32; empty slots have
             the id E/P, past the last expert, and are left out of the groups)
  4. experts the received rows through this device's E/P experts (the block's grouped GEMM:
             models/moe.experts_ragged, or experts_dense, with one choice per row and gate 1)
  5. return  all_to_all back: each row's result is in the slot it was sent from
  6. combine each token's K results weighted by its gates (float32), as on one device

With a `tensor` axis > 1 that divides the experts' width I (rules: `expert_mlp` -> tensor) each
expert stays split over it inside the exchange: the tokens are the same on the tensor devices of
an expert group, each runs its slice of I, and the combined [n, D] float32 outputs are summed
over `tensor` (one psum, as Megatron's MLP); otherwise the experts are whole on every device.

Capacity rule: exact by default. C = n K, the most rows one device can send another (every
choice of every token to one device), so no row is ever dropped and the result equals the
unsharded block's (the same products, a different float order only in the grouped GEMM's
blocking). The price is buffers P times the rows really sent: each all_to_all moves P C D =
P n K D values per device (the (P-1)/P of it that leaves the device; 2 per layer forward, 2
more backward). A capacity factor c > 0 (ModelConfig.expert_capacity_factor, the run config's
mesh.expert_capacity_factor) sets C = ceil(c n K / P): it moves c n K D, and the rows a device
sends one destination past C (in expert order, so the highest expert ids of the busiest
destinations first) are dropped, their expert output 0 in the token's gated sum (GShard /
Switch; no renormalisation). Exactness is the default: RL compares the update's log-probs with
the rollout's, and a dropped row moves them (the rollout and the update group tokens
differently, so they drop different rows). jax.lax.ragged_all_to_all
(moves only the rows sent) does not run on XLA:CPU in this jax (0.10), where the tests run.

Used when tracing under an auto-partitioned ambient mesh (jax.sharding.use_abstract_mesh /
jax.set_mesh; algo/sharded_steps.py sets it when the expert axis is > 1) whose `expert` axis is
> 1 and divides the number of experts, and when the tokens split over the expert axis; otherwise
the block's expert function runs as on one device (under a mesh, XLA gathers the experts).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from brorl_jax.parallel import rules as R

AXIS = "expert"


def _token_axes(mesh, n: int) -> tuple[str, ...]:
    """The batch axes of `mesh` (size > 1, rules.EXPERT_PARALLEL order) whose product divides n
    tokens, taken in order as long as they divide."""
    table = R.logical_table(R.for_mesh("default", mesh))
    names = table["batch"]
    names = (names,) if isinstance(names, str) else tuple(names or ())
    out, size = [], 1
    for a in names:
        s = dict(mesh.shape).get(a, 1)
        if s > 1 and n % (size * s) == 0:
            out.append(a)
            size *= s
    return tuple(out)


def expert_parallel_specs(mesh, n: int, num_experts: int) -> tuple[str, ...] | None:
    """The token axes of the exchange for n tokens and num_experts experts on `mesh`, or None
    when expert parallelism does not apply (module docstring: no expert axis > 1, axes already
    manual, experts or tokens that do not split over it)."""
    if mesh is None or mesh.empty or R.expert_axis_size(mesh) == 1 or mesh.manual_axes:
        return None
    if num_experts % R.expert_axis_size(mesh):
        return None
    axes = _token_axes(mesh, n)
    return axes if AXIS in axes else None


def _dispatch(x, ids, ep: int, el: int, capacity: int):
    """(send buffer [P, C, D], local ids [P, C], (destination, slot) of each sorted row, the
    sort order): the rows of this device's (token, choice) pairs, sorted by expert."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)              # by expert, so by destination device
    expert = jnp.take(flat, order)
    dest = expert // el
    sizes = jnp.bincount(dest, length=ep)
    slot = jnp.arange(n * k) - jnp.take(jnp.cumsum(sizes) - sizes, dest)
    rows = jnp.take(x, order // k, axis=0)
    send = jnp.zeros((ep, capacity, x.shape[1]), x.dtype).at[dest, slot].set(rows, mode="drop")
    local = jnp.full((ep, capacity), el, jnp.int32).at[dest, slot].set(
        (expert - dest * el).astype(jnp.int32), mode="drop")
    return send, local, (dest, slot), order


def capacity(tokens: int, top_k: int, expert: int, factor: float = 0.0) -> int:
    """Rows one device may send another in one exchange (module docstring): tokens x top_k when
    ``factor`` is 0 (exact), else ceil(factor x tokens x top_k / expert), at most that."""
    exact = tokens * top_k
    return exact if factor <= 0 else min(exact, math.ceil(factor * exact / expert))


def _exchange_body(x, ids, gates, *weights, local_fn: Callable, ep: int,
                   width_axis: str | None, capacity_factor: float = 0.0):
    """Per device (module docstring, steps 2-6): x [n, D], ids int [n, K], gates f32 [n, K],
    weights [E/P, ...] (their width I split over `width_axis` when it is given: the results are
    partial sums over it, summed after the combine) -> out [n, D]. Rows past the capacity are
    dropped (mode "drop" on the way out, 0 on the way back)."""
    n, k = ids.shape
    el = weights[0].shape[0]
    send, local, (dest, slot), order = _dispatch(x, ids, ep, el,
                                                 capacity(n, k, ep, capacity_factor))
    a2a = lambda v: jax.lax.all_to_all(v, AXIS, 0, 0)
    recv, recv_ids = a2a(send), a2a(local)
    m = recv.shape[0] * recv.shape[1]
    y = local_fn(recv.reshape(m, -1), recv_ids.reshape(m, 1), jnp.ones((m, 1), jnp.float32),
                 *weights)
    back = a2a(y.reshape(recv.shape))
    rows = back.at[dest, slot].get(mode="fill", fill_value=0)      # [n K, D], expert order
    rows = jnp.take(rows, jnp.argsort(order), axis=0).reshape(n, k, -1)
    out = jnp.einsum("nkd,nk->nd", rows.astype(jnp.float32), gates)
    if width_axis is not None:
        out = jax.lax.psum(out, width_axis)
    return out.astype(x.dtype)


def expert_width_axis(mesh, width: int) -> str | None:
    """The mesh axis the experts' width I is split over (logical `expert_mlp`, size > 1 and
    dividing I), kept split inside the exchange; None: the width is whole on every device."""
    name = R.logical_table(R.for_mesh("default", mesh))["expert_mlp"]
    if not isinstance(name, str) or name == AXIS:
        return None
    size = dict(mesh.shape).get(name, 1)
    return name if size > 1 and width % size == 0 else None


def _per_device(local_fn: Callable, mesh, x, ids, gates, *weights) -> jax.Array:
    """``local_fn`` on each device's tokens under shard_map, without an exchange: the tokens over
    the batch axes that divide them, each expert's width over `tensor` when it divides (the
    partial outputs summed with one psum), the experts otherwise whole on every device (XLA
    gathers them, as it gathers any FSDP weight). For an expert function that runs a Mosaic
    kernel (pallas_kernels.grouped_gemm), which GSPMD cannot partition."""
    axes = _token_axes(mesh, x.shape[0])
    tok = P(axes or None, None)
    width = expert_width_axis(mesh, weights[0].shape[-1])
    w_specs = (P(None, None, width), P(None, None, width), P(None, width, None))

    def body(x, ids, gates, *w):
        out = local_fn(x, ids, gates, *w)
        return jax.lax.psum(out, width) if width is not None else out

    # check_vma=False: the Pallas kernels (megablox's out_shape) are not vma-typed, as in
    # parallel.vocab_parallel; the gradients through the psum / all-to-alls are the same
    # (tests/parallel/test_expert_parallel.py compares them with one device's)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *w_specs), out_specs=tok,
                         check_vma=False)(x, ids, gates, *weights)


def experts_on_mesh(local_fn: Callable, x: jax.Array, ids: jax.Array, gates: jax.Array,
                    gate_proj: jax.Array, up_proj: jax.Array, down_proj: jax.Array,
                    *, manual: bool = False, num_experts: int | None = None,
                    capacity_factor: float = 0.0) -> jax.Array:
    """``local_fn(x, ids, gates, gate_proj, up_proj, down_proj)`` (models/moe.experts_ragged or
    experts_dense: x [N, D], ids int [N, K], gates f32 [N, K], gate_proj / up_proj [E, D, I],
    down_proj [E, I, D] -> [N, D]) with the experts split over the ambient mesh's `expert` axis
    and the tokens exchanged (module docstring), each expert's width I kept split over `tensor`
    (rules' `expert_mlp`) when that axis divides it; where expert parallelism does not apply,
    ``local_fn`` itself, or with ``manual`` (local_fn runs a kernel GSPMD cannot partition) and
    under an auto-partitioned mesh, ``local_fn`` per device (``_per_device``). Weights of fewer
    than ``num_experts`` experts are this device's share inside a shard_map over `expert` (the
    rollout's programs, rollout_param_specs): the exchange runs directly there."""
    weights = (gate_proj, up_proj, down_proj)
    mesh = jax.sharding.get_abstract_mesh()
    if num_experts is not None and gate_proj.shape[0] != num_experts:
        ep = num_experts // gate_proj.shape[0]
        if AXIS not in mesh.manual_axes or dict(mesh.shape).get(AXIS) != ep:
            raise ValueError(f"{gate_proj.shape[0]} of {num_experts} experts on this device, "
                             f"but the trace is not inside a shard_map over a `{AXIS}` axis of "
                             f"size {ep} (the rollout's expert parallelism)")
        return _exchange_body(x, ids, gates, *weights, local_fn=local_fn, ep=ep,
                              width_axis=None, capacity_factor=capacity_factor)
    axes = expert_parallel_specs(mesh, x.shape[0], gate_proj.shape[0])
    if axes is None:
        auto = not mesh.empty and not mesh.manual_axes and mesh.size > 1
        if manual and auto:
            return _per_device(local_fn, mesh, x, ids, gates, *weights)
        return local_fn(x, ids, gates, *weights)
    tok = P(axes, None)
    width = expert_width_axis(mesh, gate_proj.shape[-1])
    w_specs = (P(AXIS, None, width), P(AXIS, None, width), P(AXIS, width, None))
    body = lambda *a: _exchange_body(*a, local_fn=local_fn, ep=R.expert_axis_size(mesh),
                                     width_axis=width, capacity_factor=capacity_factor)
    # check_vma=False: the Pallas kernels (megablox's out_shape) are not vma-typed, as in
    # parallel.vocab_parallel; the gradients through the psum / all-to-alls are the same
    # (tests/parallel/test_expert_parallel.py compares them with one device's)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *w_specs), out_specs=tok,
                         check_vma=False)(x, ids, gates, *weights)


def rollout_expert_axis(mesh, num_experts: int) -> str | None:
    """`expert` when the rollout on ``mesh`` splits a MoE model's experts (an expert axis > 1
    that divides ``num_experts``; 0 for a dense model), else None."""
    if mesh is None or not num_experts:
        return None
    size = dict(mesh.shape).get(AXIS, 1)
    return AXIS if size > 1 and num_experts % size == 0 else None


# The names of a MoE layer's routed-expert weights [E, ...] (models/moe.SparseMoeBlock's params).
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def rollout_param_specs(params, num_experts: int):
    """PartitionSpecs of the rollout's params (the rollout layout: one dict a layer) inside the
    engine's shard_map: each MoE layer's expert weights ([E, ...] leaves under ``moe`` other
    than the router) split over `expert`, everything else replicated. Each device then holds
    E/P experts of every layer and the MoE blocks exchange the tokens (experts_on_mesh)."""
    def spec(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        # the routed experts' leaves only: a shared expert's (moe/shared_*, Qwen2-MoE) and the
        # router stay replicated even where their first dimension happens to equal E
        expert = ("moe" in keys and keys[-1] in EXPERT_LEAVES and leaf.ndim >= 1
                  and leaf.shape[0] == num_experts)
        return P(AXIS) if expert else P()
    return jax.tree_util.tree_map_with_path(spec, params)


def exchange_bytes(tokens: int, top_k: int, hidden: int, expert: int, itemsize: int,
                   capacity_factor: float = 0.0) -> int:
    """Bytes one device sends in one all_to_all of a MoE layer (each way; a forward has 2 per
    layer, its backward 2 more): the (P-1)/P of its [P, C, D] buffer that leaves it, C =
    ``capacity`` (exact: tokens x top_k; tokens: this device's)."""
    c = capacity(tokens, top_k, expert, capacity_factor)
    return (expert - 1) * c * hidden * itemsize if expert > 1 else 0


__all__ = ["AXIS", "capacity", "exchange_bytes", "expert_parallel_specs", "expert_width_axis",
           "experts_on_mesh", "rollout_expert_axis", "rollout_param_specs"]

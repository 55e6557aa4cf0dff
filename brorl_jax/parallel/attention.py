"""The packed-attention kernel on a mesh: pallas_kernels.packed_attention inside shard_map.

GSPMD cannot partition a Mosaic kernel and would replicate a Triton one, so under an
auto-partitioned mesh (the sharded update and log-prob steps, brorl_jax.algo.sharded_steps)
`packed_attention(impl="auto")` alone falls back to its jnp reference and its [T, T] scores.
`packed_attention_on_mesh` runs the kernel per device instead: rows split over the batch axes
(rules.LOGICAL_AXES "batch", the axes of the ambient mesh whose product divides the rows) and
heads over the heads axis ("heads" / "kv_heads") when it divides both the query and the key/value
heads (so each device keeps whole grouped-query groups), the rest replicated. Attention is
row-local and head-local, so no collective is needed inside; outside, XLA moves the activations
into that layout (they already are in it under the default rules). Without such a mesh, or where
the kernel would not run (CPU: "auto" is the reference), it is packed_attention itself.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from brorl_jax.parallel import rules as R
from pallas_kernels import _backend
from pallas_kernels.packed_attention import packed_attention


def _axes(names) -> tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def attention_specs(mesh, q_shape, k_shape, axes: str | dict = "default"
                    ) -> tuple[P, P, P] | None:
    """(q/out spec, k/v spec, segment-ids spec) over `mesh`'s axes of size > 1, or None when
    no axis splits the work (then there is nothing to shard)."""
    table = R.logical_table(R.for_mesh(axes, mesh))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    batch, rows = [], q_shape[0]
    for a in _axes(table["batch"]):
        if sizes.get(a, 1) > 1 and rows % (math.prod(sizes[b] for b in batch) * sizes[a]) == 0:
            batch.append(a)
    heads = [a for a in _axes(table["heads"]) if sizes.get(a, 1) > 1]
    h, hkv = q_shape[2], k_shape[2]
    n = math.prod(sizes[a] for a in heads)
    if heads and (h % n or hkv % n or set(heads) != set(_axes(table["kv_heads"]))):
        heads = []
    if not batch and not heads:
        return None
    b = tuple(batch) or None
    hd = tuple(heads) or None
    return P(b, None, hd, None), P(b, None, hd, None), P(b, None)


def packed_attention_on_mesh(q: jax.Array, k: jax.Array, v: jax.Array,
                             segment_ids: jax.Array, *, impl: str = "auto",
                             family: str | None = None, block: int | None = None,
                             axes: str | dict = "default") -> jax.Array:
    """pallas_kernels.packed_attention (same arguments and result), inside shard_map over the
    ambient mesh when it is auto-partitioned and the kernel would run (module docstring)."""
    run = lambda a, b, c, s: packed_attention(a, b, c, s, impl=impl, family=family, block=block)
    kernel = impl == "pallas" or (impl == "auto" and not _backend.interpret_mode())
    if not kernel or not _backend.under_auto_partitioned_mesh():
        return run(q, k, v, segment_ids)
    mesh = jax.sharding.get_abstract_mesh()
    specs = attention_specs(mesh, q.shape, k.shape, axes)
    if specs is None:
        return run(q, k, v, segment_ids)
    qs, ks, ss = specs
    # check_vma=False: the Pallas kernels are not vma-typed (as in parallel.vocab_parallel)
    return jax.shard_map(run, mesh=mesh, in_specs=(qs, ks, ks, ss), out_specs=qs,
                         check_vma=False)(q, k, v, segment_ids)

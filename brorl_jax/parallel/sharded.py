"""Placement helpers on a mesh: replicate, split rows over the batch axes, put host trees on
devices (one or several processes). The step builders that use them live beside their steps:
brorl_jax.algo.sharded_steps (update, log-probs) and brorl_jax.rollout (generation).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from brorl_jax.parallel import rules as R


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _rows_sharding(mesh: Mesh, ndim: int, axes: str | dict = "default") -> NamedSharding:
    spec = R.logical_to_spec(R.ARRAY_AXES["rows"], R.for_mesh(axes, mesh))
    return NamedSharding(mesh, P(*(tuple(spec) + (None,) * (ndim - 1))))


def constrain_rows(x: jax.Array, mesh: Mesh, axes: str | dict = "default") -> jax.Array:
    """with_sharding_constraint: x's leading (row) axis over the batch axes, the rest replicated
    (axes that do not divide the rows are dropped)."""
    s = _rows_sharding(mesh, x.ndim, axes)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, R.fit_spec(s.spec, x.shape, mesh)))


def row_constraint(mesh: Mesh, axes: str | dict = "default"):
    """The update's `shard_rows` hook: after a split [R] -> [n, R / n], keep the second (row)
    axis over the batch axes (the reshape alone would put the split on the scanned axis, which
    XLA then gathers)."""
    spec = R.logical_to_spec(R.ARRAY_AXES["rows"], R.for_mesh(axes, mesh))

    def one(x):
        want = P(None, *(tuple(spec) + (None,) * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, R.fit_spec(want, x.shape, mesh)))

    return lambda tree: jax.tree.map(one, tree)


def place(tree: Any, shardings: Any) -> Any:
    """device_put every leaf with its sharding (single-controller; multi-host: rules +
    distributed.global_batch). The result may share buffers with device-resident inputs, so a
    step that donates it also deletes them: place host (numpy) copies when the inputs are kept.

    With several processes every process passes the same full value and keeps only the shards
    of its own devices (jax.make_array_from_callback); an array already spread over several
    processes (e.g. a merged base after a LoRA reset) is resharded on device, collectively."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == s else jax.jit(lambda v: v, out_shardings=s)(x)
        if s.is_fully_addressable:
            return jax.device_put(x, s)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def to_host(tree: Any) -> Any:
    """numpy copies of every leaf (jax.device_get); an array spread over several processes is
    all-gathered first, so every process must call it at the same point."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)

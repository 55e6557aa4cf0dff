"""brorl_jax.parallel: the mesh, sharding rules as data, sharded step builders, multi-host start-up.

Light imports only (this package is imported before jax.distributed is initialised):
  mesh            make_mesh, mesh_from_config, use_mesh
  rules           LOGICAL_AXES, PARAM_RULES, ARRAY_AXES, param_shardings, state_shardings
  distributed     maybe_initialize_distributed, initialize, global_batch, log
Heavier modules, imported by name: sharded (step builders), vocab_parallel, expert_parallel
(the mixture-of-experts token exchange, mesh.expert > 1).
See docs/scale.md.
"""
from brorl_jax.parallel.mesh import AXES, make_mesh, mesh_from_config, use_mesh
from brorl_jax.parallel.rules import (
    ARRAY_AXES,
    LOGICAL_AXES,
    PARAM_RULES,
    batch_shardings,
    param_shardings,
    param_specs,
    state_shardings,
    unmatched_params,
)

__all__ = ["AXES", "make_mesh", "mesh_from_config", "use_mesh", "ARRAY_AXES", "LOGICAL_AXES",
           "PARAM_RULES", "batch_shardings", "param_shardings", "param_specs",
           "state_shardings", "unmatched_params"]

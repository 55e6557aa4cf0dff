"""Pure helpers of brorl_jax.parallel.sharded (main process, abstract meshes: no devices)."""
from __future__ import annotations

import jax
import optax
from jax.sharding import AbstractMesh, PartitionSpec as P
from testutil import small_model_config

from brorl_jax.algo import sharded_steps as algo_sharded
from brorl_jax.models import init_params

MESH = AbstractMesh((2, 4, 1), ("data", "fsdp", "tensor"))


def _params():
    cfg = small_model_config()
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def test_train_state_shardings_adam_moments_follow_params_and_counters_replicate():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = algo_sharded.abstract_train_state(_params(), opt)
    sh = algo_sharded.train_state_shardings(state, MESH)
    q = sh.params["layers"]["q_proj"]["kernel"].spec
    assert q == P(None, "fsdp", "tensor")      # D over fsdp, heads over tensor (size 1 here)
    adam = sh.opt_state[1][0]
    assert adam.mu["layers"]["q_proj"]["kernel"].spec == q
    assert adam.nu["embed"]["embedding"].spec == sh.params["embed"]["embedding"].spec
    assert adam.count.spec == P()
    assert sh.step.spec == P()
    assert sh.ref_params["lm_head"]["kernel"].spec == sh.params["lm_head"]["kernel"].spec


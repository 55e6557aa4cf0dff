"""Shared pieces of the two-process test and its single-process reference."""
from __future__ import annotations

import jax
import optax

from brorl_jax.config import algo_config
from brorl_jax.models import init_params

ALGO = algo_config(ppo_mini_batches=2, micro_batch_size=4, kl_coef=1e-3)


def make_optimizer_for_test():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))


def initial_params(cfg):
    return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x,
                        init_params(cfg, jax.random.PRNGKey(0)))

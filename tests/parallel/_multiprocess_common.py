"""Shared pieces of the two-process test and its single-process reference."""
from __future__ import annotations

import jax
import optax

from brorl_jax.config import update_config
from brorl_jax.models import init_params

# The random batch's rollout log-probs are far from pi_old, so TIS and dual-clip decide many tokens;
# with Adam at lr 3e-3 one borderline token flips a near-zero gradient's sign (a 5e-4 step on two
# of 16k embedding entries between layouts). The ICE-POP band without dual-clip keeps every
# decision far from its edge, which is what an equality test of two layouts needs.
ALGO = update_config(ppo_mini_batches=2, micro_batch_size=4, kl_coef=1e-3, tis_mode="ice_pop",
                   tis_high=5.0, dual_clip_c=0.0)


def make_optimizer_for_test():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))


def initial_params(cfg):
    return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x,
                        init_params(cfg, jax.random.PRNGKey(0)))

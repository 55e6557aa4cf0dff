"""Optimizer: sqrt LR rule with its printed derivation, constant AdamW default, Lion, clipping."""
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from brorl_jax.algo import make_optimizer, scaled_learning_rate
from brorl_jax.algo.length_penalty import (
    apply_length_penalty,
    cosine_length_reward,
    length_penalty_active,
)
from brorl_jax.config import ConfigError, make_config, optimizer_config


def test_sqrt_rule_brorl_numbers():
    # ProRL baseline 512 x 16 = 8192 samples/step -> BroRL 128 x 512 = 65536: x sqrt(8)
    assert scaled_learning_rate(1e-6, 8192, 65536) == pytest.approx(1e-6 * math.sqrt(8))
    with pytest.raises(ValueError):
        scaled_learning_rate(1e-6, 0, 10)


def test_adamw_constant_lr_default_and_global_norm_clip():
    cfg = optimizer_config(lr=0.1, grad_clip=1.0, weight_decay=0.0)
    opt = make_optimizer(cfg)
    params = {"w": jnp.zeros(4)}
    state = opt.init(params)
    grads = {"w": jnp.array([30.0, 40.0, 0.0, 0.0])}      # norm 50 -> clipped to 1
    for _ in range(3):
        upd, state = opt.update(grads, state, params)
        # Adam's first steps have |update| = lr per coordinate whatever the scale: constant LR
        np.testing.assert_allclose(np.abs(upd["w"][:2]), 0.1, rtol=1e-4)
    clip = optax.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(params))
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0)


def test_lion_and_schedule_options():
    opt = make_optimizer(optimizer_config(name="lion", lr=0.01, weight_decay=0.0))
    params = {"w": jnp.ones(3)}
    upd, _ = opt.update({"w": jnp.array([1.0, -2.0, 0.5])}, opt.init(params), params)
    np.testing.assert_allclose(upd["w"], [-0.01, 0.01, -0.01], rtol=1e-6)   # sign update
    sched_cfg = optimizer_config(schedule="warmup_cosine", warmup_steps=10)
    assert (sched_cfg.warmup_updates, sched_cfg.decay_updates) == (10, 200)
    assert make_optimizer(sched_cfg) is not None
    with pytest.raises(ConfigError, match="'optim.name' is 'sgd'; allowed: 'adamw', 'lion'"):
        optimizer_config(name="sgd")


def test_cosine_length_penalty_and_schedule():
    eta = cosine_length_reward([0, 50, 100, 150], 100, eta_min=-1.0, eta_max=0.0)
    np.testing.assert_allclose(eta, [0.0, -0.5, -1.0, -1.0], atol=1e-6)
    assert length_penalty_active(0, 100, 500) and length_penalty_active(99, 100, 500)
    assert not length_penalty_active(100, 100, 500) and length_penalty_active(600, 100, 500)
    cfg = make_config(length_penalty=True, length_penalty_coef=0.5, length_penalty_eta_min=-1.0)
    r = apply_length_penalty(np.ones((1, 2)), np.array([[0, 100]]), step=0, max_length=100, algo_cfg=cfg.algo)
    np.testing.assert_allclose(r, [[1.0, 0.5]])
    r_off = apply_length_penalty(np.ones((1, 2)), np.array([[0, 100]]), step=200, max_length=100, algo_cfg=cfg.algo)
    np.testing.assert_allclose(r_off, 1.0)

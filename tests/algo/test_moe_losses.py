"""The router load-balancing loss (algo/moe_losses.py, algo.moe_aux_loss_coef): transformers'
Qwen3-MoE definition on the same router logits; in the update only when the coefficient is
positive (0 runs the program without it, bit for bit); refused at the door on a dense model."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from conftest import random_batch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testutil import tiny_model_config  # noqa: E402

from brorl_jax.algo import create_train_state, make_update_step, moe_losses  # noqa: E402
from brorl_jax.algo.update import PolicyFns, model_policy_fns  # noqa: E402
from brorl_jax.config import ConfigError, default_config, update_config, validate  # noqa: E402
from brorl_jax.models import forward, init_params  # noqa: E402
from brorl_jax.train.door import check_moe_aux_loss  # noqa: E402

MOE = dict(model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_is_transformers_qwen3_moe_one(masked):
    layers, b, t, e, k = 3, 2, 5, 8, 2
    logits = np.random.default_rng(0).normal(size=(layers, b, t, e)).astype(np.float32) * 2
    mask = np.ones((b, t), bool)
    if masked:
        mask[0, 3:] = False                      # right padding
        mask[1, :2] = False                      # left padding
    ours = moe_losses.load_balancing_loss(jnp.asarray(logits), k,
                                          jnp.asarray(mask) if masked else None)
    theirs = load_balancing_loss_func(
        tuple(torch.from_numpy(x.reshape(b * t, e)) for x in logits), num_experts=e, top_k=k,
        attention_mask=torch.from_numpy(mask.astype(np.int64)) if masked else None)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6, abs=1e-7)
    # a forward without a real token adds nothing (transformers: 0/0)
    assert float(moe_losses.load_balancing_loss(jnp.asarray(logits), k, np.zeros((b, t)))) == 0.0


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_model_config(**MOE)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _update(cfg, acfg, params, batch, policy=None):
    sgd = optax.sgd(0.1)
    step = jax.jit(make_update_step(cfg, acfg, sgd, policy=policy))
    return step(create_train_state(params, sgd, with_reference=False), batch,
                jax.random.PRNGKey(0))


def test_update_adds_coef_times_the_token_weighted_micro_batch_aux(moe):
    cfg, params = moe
    batch = random_batch(rows=4, seq=6, seed=1)
    batch = batch.replace(attention_mask=np.asarray(batch.loss_mask) | (np.arange(6) < 2))
    base = dict(micro_batch_size=2, ppo_mini_batches=1, kl_coef=0.0, entropy_coef=0.0,
                tis_mode="off")
    # off (the default): the update's forward is the plain one (as a policy that knows no
    # `aux` keyword calls it): the same bits, no metric
    def plain_hidden(p, tokens, positions, mask, remat):
        return forward(p, cfg, tokens, positions=positions, attention_mask=mask,
                       return_hidden=True, remat=remat)

    off_cfg = update_config(**base)
    assert off_cfg.moe_aux_loss_coef == 0.0
    s0, m0 = _update(cfg, off_cfg, params, batch)
    s1, m1 = _update(cfg, off_cfg, params, batch, policy=PolicyFns(
        hidden=plain_hidden, lm_head=model_policy_fns(cfg).lm_head))
    assert "moe_aux_loss" not in m0 and m0.keys() == m1.keys()
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
        np.testing.assert_array_equal(a, b)
    # on: + coef * (each micro-batch's aux weighted by its share of the real tokens)
    coef = 0.5
    s2, m2 = _update(cfg, update_config(**base, moe_aux_loss_coef=coef), params, batch)
    want, total = 0.0, batch.attention_mask.sum()
    for rows in (slice(0, 2), slice(2, 4)):
        mask = jnp.asarray(batch.attention_mask[rows])
        _, logits = forward(params, cfg, jnp.asarray(batch.input_tokens[rows]),
                            positions=jnp.asarray(batch.positions[rows]), attention_mask=mask,
                            return_router_logits=True)
        aux = moe_losses.load_balancing_loss(logits, cfg.num_experts_per_tok, mask)
        want += float(aux) * float(mask.sum()) / total
    assert float(m2["moe_aux_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(m2["loss"]) == pytest.approx(float(m0["loss"]) + coef * want, rel=1e-5)
    router = lambda s: np.asarray(s.params["layers"]["moe"]["router"])
    assert np.abs(router(s2) - router(s0)).max() > 1e-6       # the router is pushed to balance


def test_aux_loss_key_is_checked_at_the_door():
    cfg = default_config()
    cfg.algo.moe_aux_loss_coef = -0.001
    with pytest.raises(ConfigError, match="'algo.moe_aux_loss_coef'"):
        validate(cfg)
    cfg.algo.moe_aux_loss_coef = 0.001
    run = validate(cfg)
    with pytest.raises(ConfigError, match=r"'algo.moe_aux_loss_coef' = 0.001 .*no experts. "
                                          r"Set algo.moe_aux_loss_coef=0"):
        check_moe_aux_loss(run, tiny_model_config())
    check_moe_aux_loss(run, tiny_model_config(**MOE))               # a MoE model: fine
    check_moe_aux_loss(validate(default_config()), tiny_model_config())   # off: fine

"""Policy loss: every variant (aggregation x KL estimator x TIS mode x entropy bonus) against a
straightforward per-token implementation written here, values and gradients; clip behaviour on
hand-made ratios; KL estimators and TIS weights on hand cases."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax.algo import (
    KL_ESTIMATORS,
    LOSS_AGG,
    get_kl_estimator,
    get_loss_agg,
    kl_penalty,
    policy_loss,
    ppo_clip_objective,
    tis_weights,
)
from brorl_jax.config import ConfigError, update_config

B, T = 4, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.7
    mask[0] = False            # an empty row (padding) must not count in seq_mean_token_mean
    mask[1, 0] = True
    base = np.log(1 / 50)
    return dict(
        logp=(base + 0.4 * rng.normal(size=(B, T))).astype(np.float32),
        entropy=(2.0 + rng.random((B, T))).astype(np.float32),
        old_logp=(base + 0.4 * rng.normal(size=(B, T))).astype(np.float32),
        rollout_logp=(base + 0.6 * rng.normal(size=(B, T))).astype(np.float32),
        ref_logp=(base + 0.4 * rng.normal(size=(B, T))).astype(np.float32),
        advantages=rng.normal(size=B).astype(np.float32),
        mask=mask,
    )


def straightforward_loss(logp, entropy, x, cfg):
    """Per-token loops, written from the formulas (PPO clip-higher with dual-clip, ICE-POP / truncated
    IS, k1 / k2 with its clamp / k3 with veRL's clamps, entropy bonus, token-mean or
    seq-mean-token-mean)."""
    mask = x["mask"]
    terms, weights = [], []
    n_tok = int(mask.sum())
    n_seq = int((mask.sum(1) > 0).sum())
    for b in range(B):
        len_b = int(mask[b].sum())
        for t in range(T):
            if not mask[b, t]:
                continue
            a = float(x["advantages"][b])
            ratio = jnp.exp(logp[b, t] - float(x["old_logp"][b, t]))
            surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * a)
            if a < 0 and cfg.dual_clip_c > 0:          # dual-clip: the loss -surrogate <= -c a
                surrogate = jnp.maximum(surrogate, cfg.dual_clip_c * a)
            k = math.exp(float(x["old_logp"][b, t]) - float(x["rollout_logp"][b, t]))
            if cfg.tis_mode == "ice_pop":
                w_is = k if cfg.tis_low <= k <= cfg.tis_high else 0.0
            elif cfg.tis_mode == "truncate":
                w_is = min(k, cfg.tis_high)
            else:
                w_is = 1.0
            lr = logp[b, t] - float(x["ref_logp"][b, t])
            lr2 = jnp.clip(lr, -cfg.kl_clamp, cfg.kl_clamp)
            lr3 = jnp.clip(lr, -20, 20)
            kl = {"k1": lr, "k2": 0.5 * lr2 * lr2,
                  "k3": jnp.clip(jnp.exp(-lr3) - 1 + lr3, -10, 10)}[cfg.kl_estimator]
            terms.append(-w_is * surrogate + cfg.kl_coef * kl - cfg.entropy_coef * entropy[b, t])
            weights.append(1.0 / n_tok if cfg.loss_agg == "token_mean" else 1.0 / (len_b * n_seq))
    return sum(w * l for w, l in zip(weights, terms))


# The entropy bonus is on in every variant (its "off" case is the same code with a zero weight).
VARIANTS = list(itertools.product(["token_mean", "seq_mean_token_mean"], ["k1", "k2", "k3"],
                                  ["ice_pop", "truncate", "off"], [0.01]))


def test_the_variants_inputs_reach_the_dual_clip_bound():
    """The inputs below put some tokens with A < 0 above the dual-clip bound (c = 1.5 there)."""
    binds = 0
    for i in range(len(VARIANTS)):
        x = _inputs(seed=i)
        ratio = np.exp(x["logp"] - x["old_logp"])
        binds += int(((ratio > 1.5) & (x["advantages"][:, None] < 0) & x["mask"]).sum())
    assert binds >= 5


@pytest.mark.parametrize("agg,kl,tis,ent", VARIANTS)
def test_loss_and_gradient_match_straightforward(agg, kl, tis, ent):
    # kl_coef large and a tight clamp so the KL term (and its clamp) matter numerically
    cfg = update_config(loss_agg=agg, kl_estimator=kl, tis_mode=tis, entropy_coef=ent, kl_coef=0.3,
                      kl_clamp=0.5, dual_clip_c=1.5)
    x = _inputs(seed=VARIANTS.index((agg, kl, tis, ent)))

    def ours(logp, entropy):
        loss, _ = policy_loss(logp, entropy, old_logp=x["old_logp"], rollout_logp=x["rollout_logp"],
                              ref_logp=x["ref_logp"], advantages=x["advantages"], loss_mask=x["mask"],
                              agg_weights=get_loss_agg(agg)(jnp.asarray(x["mask"])), cfg=cfg)
        return loss

    theirs = lambda logp, entropy: straightforward_loss(logp, entropy, x, cfg)
    v1, g1 = jax.value_and_grad(ours, argnums=(0, 1))(x["logp"], x["entropy"])
    v2, g2 = jax.value_and_grad(theirs, argnums=(0, 1))(x["logp"], x["entropy"])
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g1[0])[~x["mask"]] == 0)


def test_equal_logprobs_clip_agrees_with_unclipped_and_clip_frac_zero():
    x = _inputs()
    logp = x["old_logp"]
    pg, ratio, lo, hi, dual = ppo_clip_objective(logp, logp, x["advantages"], 0.2, 0.28, 3.0)
    assert not np.any(dual)
    np.testing.assert_allclose(pg, -x["advantages"][:, None] * np.ones((B, T)), rtol=1e-6)
    np.testing.assert_array_equal(ratio, 1.0)
    assert not np.any(lo) and not np.any(hi)
    g_clip = jax.grad(lambda l: jnp.sum(ppo_clip_objective(l, logp, x["advantages"], 0.2, 0.28)[0]))(logp)
    g_unclip = jax.grad(lambda l: jnp.sum(-x["advantages"][:, None] * jnp.exp(l - logp)))(logp)
    np.testing.assert_allclose(g_clip, g_unclip, rtol=1e-6)
    cfg = update_config(tis_mode="off", kl_coef=0.0)
    _, sums = policy_loss(logp, x["entropy"], old_logp=logp, rollout_logp=logp, ref_logp=None,
                          advantages=x["advantages"], loss_mask=x["mask"],
                          agg_weights=get_loss_agg("token_mean")(jnp.asarray(x["mask"])), cfg=cfg)
    assert float(sums["clip_low_sum"]) == 0 and float(sums["clip_high_sum"]) == 0


@pytest.mark.parametrize("adv,ratio,expect_loss,clipped_side,grad_zero", [
    (-1.0, 4.00, +3.00, "dual", True),    # A<0, r above the dual-clip bound c = 3: loss -c A
    (+1.0, 1.50, -1.28, "high", True),    # A>0, r above 1+eps_high: clipped at 1.28, no gradient
    (+1.0, 1.20, -1.20, None, False),     # inside the band
    (+1.0, 0.50, -0.50, None, False),     # A>0, r below 1-eps_low: NOT clipped (pessimistic min)
    (-1.0, 0.50, +0.80, "low", True),     # A<0, r below 1-eps_low: clipped at 0.8, no gradient
    (-1.0, 1.50, +1.50, None, False),     # A<0, r above 1+eps_high: NOT clipped
    (-2.0, 1.27, +2.54, None, False),     # asymmetric band: 1.27 < 1.28 still inside
])
def test_hand_made_ratios_clipped_on_correct_side(adv, ratio, expect_loss, clipped_side, grad_zero):
    old = jnp.zeros((1, 1))
    logp = jnp.full((1, 1), math.log(ratio))
    pg, r, lo, hi, dual = ppo_clip_objective(logp, old, jnp.array([adv]), 0.2, 0.28, 3.0)
    assert float(pg[0, 0]) == pytest.approx(expect_loss, rel=1e-5)
    assert bool(lo[0, 0]) == (clipped_side == "low") and bool(hi[0, 0]) == (clipped_side == "high")
    assert bool(dual[0, 0]) == (clipped_side == "dual")
    g = jax.grad(lambda l: ppo_clip_objective(l, old, jnp.array([adv]), 0.2, 0.28, 3.0)[0].sum())(logp)
    assert (float(g[0, 0]) == 0.0) == grad_zero


def test_kl_estimators_hand_values_and_clamp():
    lr = jnp.array([0.5, -0.5, 20.0])
    ref = jnp.zeros(3)
    # k1 unclamped (veRL), k2 with its log-ratio clamp (ProRLv2), k3 value clamped at 10 (veRL)
    np.testing.assert_allclose(kl_penalty(lr, ref, "k1", 10.0), [0.5, -0.5, 20.0])
    np.testing.assert_allclose(kl_penalty(lr, ref, "k2", 10.0), [0.125, 0.125, 50.0])
    np.testing.assert_allclose(kl_penalty(lr, ref, "k3", 10.0),
                               [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 10.0], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(jnp.array([-5.0]), jnp.zeros(1), "k3"), [10.0])
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="allowed: \\['k1', 'k2', 'k3'\\]"):
        get_kl_estimator("k4")
    # clamped tokens carry no gradient
    g = jax.grad(lambda l: kl_penalty(l, ref, "k2", 10.0).sum())(lr)
    assert float(g[2]) == 0.0 and float(g[0]) == pytest.approx(0.5)


def test_tis_weights_modes():
    k = jnp.array([0.4, 0.5, 1.0, 5.0, 6.0])
    trainer, rollout = jnp.log(k), jnp.zeros(5)
    w, dropped = tis_weights(trainer, rollout, "ice_pop", 0.5, 5.0)
    np.testing.assert_allclose(w, [0.0, 0.5, 1.0, 5.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(dropped, [True, False, False, False, True])
    w, dropped = tis_weights(trainer, rollout, "truncate", 0.5, 5.0)
    np.testing.assert_allclose(w, [0.4, 0.5, 1.0, 5.0, 5.0], rtol=1e-6)
    w, _ = tis_weights(trainer, rollout, "off")
    np.testing.assert_array_equal(w, 1.0)


def test_aggregation_registry():
    assert sorted(LOSS_AGG) == ["seq_mean_token_mean", "token_mean"]
    with pytest.raises(ValueError, match="allowed"):
        get_loss_agg("sum")
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    np.testing.assert_allclose(LOSS_AGG["token_mean"](mask), np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]]) / 3)
    np.testing.assert_allclose(LOSS_AGG["seq_mean_token_mean"](mask),
                               np.array([[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]]))


def test_config_rejects_bad_names():
    with pytest.raises(ConfigError, match="'algo.kl_estimator' is 'k5'; allowed: 'k1', 'k2', 'k3'"):
        update_config(kl_estimator="k5")
    with pytest.raises(ConfigError, match="unknown config key 'algo.clip_eps'. Did you mean"):
        update_config(clip_eps=0.2)

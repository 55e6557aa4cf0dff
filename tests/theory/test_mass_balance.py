"""Theorem 1 and Lemma 2 of BroRL (arXiv 2510.01180, App. C) checked numerically."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax.theory import mass_balance as mb_lib
from brorl_jax.theory.mass_balance import (
    delta_q_pos,
    lemma2_expected_unsampled,
    linear_surrogate_loss,
    logit_step,
    partial_masses,
    sampled_set_mask,
)

V = 40


def _random_case(rng: np.random.Generator, case: int):
    """Random logits, correct set, sampled set (from N draws) and rewards.

    Alternate cases bias the draws toward correct or incorrect tokens so that both signs of S_R
    and a range of reward balances occur.
    """
    logits = rng.normal(scale=1.5, size=V)
    correct = rng.random(V) < rng.uniform(0.2, 0.8)
    correct[0], correct[1] = True, False                  # both pools non-empty
    n = int(rng.integers(2, 25))
    p = np.exp(logits - logits.max())
    p /= p.sum()
    tilt = np.where(correct, 3.0, 1 / 3.0) if case % 2 == 0 else np.where(correct, 1 / 3.0, 3.0)
    q = p * tilt / (p * tilt).sum()
    sampled = np.zeros(V, bool)
    sampled[rng.choice(V, size=n, p=q)] = True           # the sampled *set*
    r_c = float(rng.uniform(0.2, 2.0))
    r_w = -float(rng.uniform(0.2, 2.0))
    return logits, correct, sampled, n, r_c, r_w


def _q_pos(logits, correct):
    return jnp.sum(jnp.where(correct, jax.nn.softmax(logits), 0.0))


@jax.jit
def _actual_and_predicted(logits, correct, sampled, n, r_c, r_w, lr):
    """Q_pos change after one plain gradient step of size lr, and Theorem 1's prediction."""
    balance = partial_masses(jax.nn.softmax(logits), correct, sampled, reward_correct=r_c,
                             reward_wrong=r_w)
    grad = jax.grad(linear_surrogate_loss)(logits, correct, sampled, n=n, reward_correct=r_c,
                                           reward_wrong=r_w)
    actual = _q_pos(logits - lr * grad, correct) - _q_pos(logits, correct)
    pred = delta_q_pos(balance, lr=lr, n=n, reward_correct=r_c, reward_wrong=r_w).total
    return actual, pred, balance.s_r


def test_theorem1_predicts_one_plain_gradient_step():
    rng = np.random.default_rng(0)
    signs = []
    with jax.enable_x64(True):
        for case in range(16):
            logits, correct, sampled, n, r_c, r_w = _random_case(rng, case)
            rel_errs = []
            for lr in (1.0, 0.1, 0.01, 0.001):
                actual, pred, s_r = _actual_and_predicted(
                    jnp.asarray(logits, jnp.float64), jnp.asarray(correct), sampled,
                    jnp.float64(n), jnp.float64(r_c), jnp.float64(r_w), jnp.float64(lr))
                rel_errs.append(float(abs(actual - pred) / abs(pred)))
            signs.append(np.sign(float(s_r)))
            # First order in the step: the relative error falls ~10x per 10x smaller step.
            assert rel_errs[-1] < 1e-4, (case, rel_errs)
            for big, small in zip(rel_errs, rel_errs[1:]):
                assert small < 0.2 * big or small < 1e-9, (case, rel_errs)
    # The cases cover reward-positive and reward-negative batches.
    assert signs.count(1.0) >= 4 and signs.count(-1.0) >= 4, signs


@jax.jit
def _first_order_and_terms(logits, correct, sampled, n, r_c, r_w):
    p = jax.nn.softmax(logits)
    dz = logit_step(p, correct, sampled, lr=0.5, n=n, reward_correct=r_c, reward_wrong=r_w)
    _, first_order = jax.jvp(lambda z: _q_pos(z, correct), (logits,), (dz,))
    terms = delta_q_pos(partial_masses(p, correct, sampled, reward_correct=r_c,
                                       reward_wrong=r_w),
                        lr=0.5, n=n, reward_correct=r_c, reward_wrong=r_w)
    return first_order, terms


def test_theorem1_terms_equal_exact_first_order_change():
    """The three terms sum to the directional derivative of Q_pos along Δz = (η/N) p (R - S_R)."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        for case in range(8):
            logits, correct, sampled, n, r_c, r_w = _random_case(rng, case)
            first_order, terms = _first_order_and_terms(
                jnp.asarray(logits, jnp.float64), jnp.asarray(correct), jnp.asarray(sampled),
                jnp.float64(n), jnp.float64(r_c), jnp.float64(r_w))
            np.testing.assert_allclose(terms.total, first_order, rtol=1e-10, atol=1e-16)
            assert terms.sampled_correct >= 0 and terms.sampled_incorrect >= 0
            np.testing.assert_allclose(
                terms.total, terms.sampled_correct + terms.sampled_incorrect
                + terms.unsampled_coupling, rtol=1e-12)


def test_logit_step_is_minus_lr_times_surrogate_gradient():
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        logits, correct, sampled, n, r_c, r_w = _random_case(rng, 0)
        logits = jnp.asarray(logits)
        grad = jax.grad(linear_surrogate_loss)(logits, correct, sampled, n=n,
                                               reward_correct=r_c, reward_wrong=r_w)
        dz = logit_step(jax.nn.softmax(logits), correct, sampled, lr=0.3, n=n,
                        reward_correct=r_c, reward_wrong=r_w)
        np.testing.assert_allclose(dz, -0.3 * grad, rtol=1e-12, atol=1e-18)
        # Unsampled tokens all move by -(η/N) S_R p_j.
        p = jax.nn.softmax(logits)
        s_r = partial_masses(p, correct, sampled, reward_correct=r_c, reward_wrong=r_w).s_r
        unsampled = ~np.asarray(sampled)
        np.testing.assert_allclose(np.asarray(dz)[unsampled],
                                   -(0.3 / n) * s_r * np.asarray(p)[unsampled], rtol=1e-12)


def test_mass_balance_on_a_hand_example():
    p = jnp.array([0.4, 0.1, 0.2, 0.05, 0.15, 0.1])
    correct = jnp.array([True, True, False, False, True, False])
    sampled = sampled_set_mask(jnp.array([0, 2, 2, 3]), 6)          # duplicates count once
    np.testing.assert_array_equal(sampled, [True, False, True, True, False, False])
    b = partial_masses(p, correct, sampled, reward_correct=2.0, reward_wrong=-0.5)
    np.testing.assert_allclose(
        [b.p_pos, b.p_neg, b.q_pos, b.q_neg, b.a_2, b.b_2, b.u_pos_2, b.u_neg_2],
        [0.4, 0.25, 0.65, 0.35, 0.16, 0.0425, 0.01 + 0.0225, 0.01], rtol=1e-6)
    np.testing.assert_allclose(b.s_r, 2.0 * 0.4 - 0.5 * 0.25, rtol=1e-6)
    d = delta_q_pos(b, lr=0.1, n=4, reward_correct=2.0, reward_wrong=-0.5)
    s = 0.1 / 4
    np.testing.assert_allclose(d.sampled_correct, s * (2.0 - 0.675) * 0.35 * 0.16, rtol=1e-6)
    np.testing.assert_allclose(d.sampled_incorrect, s * (0.675 + 0.5) * 0.65 * 0.0425, rtol=1e-6)
    np.testing.assert_allclose(d.unsampled_coupling,
                               s * 0.675 * (0.65 * 0.01 - 0.35 * 0.0325), rtol=1e-6)


def test_mass_balance_is_jittable_and_bad_input_is_rejected():
    p = jnp.full((8,), 1 / 8)
    correct = jnp.arange(8) < 3
    sampled = jnp.arange(8) % 2 == 0
    jitted = jax.jit(partial_masses)(p, correct, sampled)
    np.testing.assert_allclose(jitted.s_r, partial_masses(p, correct, sampled).s_r)
    with pytest.raises(ValueError, match="sampled_mask"):
        partial_masses(p, correct, sampled[:4])
    with pytest.raises(ValueError, match="reward_wrong"):
        partial_masses(p, correct, sampled, reward_wrong=0.5)
    with pytest.raises(ValueError, match="reward_correct"):
        delta_q_pos(partial_masses(p, correct, sampled), lr=1.0, n=2, reward_correct=-1.0)
    with pytest.raises(ValueError, match="samples"):
        sampled_set_mask(jnp.zeros((2, 2), jnp.int32), 8)


@pytest.mark.parametrize("n", [1, 4, 16, 64])
def test_lemma2_matches_monte_carlo(n):
    rng = np.random.default_rng(n)
    v = 30
    logits = rng.normal(scale=2.0, size=v)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    correct = rng.random(v) < 0.4
    m = 40_000
    counts = rng.multinomial(n, p, size=m)                  # N i.i.d. draws, m repetitions
    unsampled = counts == 0
    for where in (None, correct, ~correct):
        sel = np.ones(v, bool) if where is None else where
        u2 = np.sum(np.where(unsampled & sel, p ** 2, 0.0), axis=1)     # U_2 per repetition
        se = u2.std() / np.sqrt(m)
        expected = float(lemma2_expected_unsampled(jnp.asarray(p), n, where=where))
        assert abs(u2.mean() - expected) < 5 * se + 1e-7, (n, u2.mean(), expected, se)


def test_lemma2_decreases_in_n_and_is_accurate_for_tiny_p():
    p = jax.nn.softmax(jnp.asarray(np.random.default_rng(3).normal(size=200), jnp.float32))
    values = [float(lemma2_expected_unsampled(p, n)) for n in (0, 1, 4, 16, 512, 51200)]
    np.testing.assert_allclose(values[0], float(jnp.sum(p ** 2)), rtol=1e-6)
    assert all(a > b for a, b in zip(values, values[1:])), values
    # float32: 1 - 1e-9 rounds to 1, but (1 - p)^N = exp(-1e-3) here.
    tiny = jnp.array([1e-9], jnp.float32)
    np.testing.assert_allclose(mb_lib.unsampled_second_moment_terms(tiny, 1_000_000),
                               [1e-18 * np.exp(-1e-3)], rtol=1e-5)
    # Edge cases: p = 1 is always sampled once N >= 1, never when N = 0.
    one = jnp.array([1.0, 0.0])
    np.testing.assert_allclose(lemma2_expected_unsampled(one, 3), 0.0)
    np.testing.assert_allclose(lemma2_expected_unsampled(one, 0), 1.0)
    with pytest.raises(ValueError, match="n"):
        lemma2_expected_unsampled(one, -1)

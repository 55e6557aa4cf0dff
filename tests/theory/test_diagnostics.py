"""Training diagnostics built on BroRL's mass balance (arXiv 2510.01180, §2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax.theory.diagnostics import (
    expected_unsampled_second_moment,
    first_occurrence,
    group_reward_balance,
    reward_balance_metrics,
    unsampled_second_moment_from_logits,
    unsampled_second_moment_from_probs,
)
from brorl_jax.theory.mass_balance import partial_masses


def test_unsampled_second_moment_references_agree_with_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(2, 5, 64)).astype(np.float32)
    for n in (1, 8, 512):
        for temperature in (1.0, 0.7):
            z = logits / temperature
            p = np.exp(z - z.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want = np.sum(p ** 2 * (1 - p) ** n, axis=-1)
            got = unsampled_second_moment_from_logits(jnp.asarray(logits), n, temperature)
            assert got.shape == (2, 5)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
            np.testing.assert_allclose(unsampled_second_moment_from_probs(jnp.asarray(p), n),
                                       want, rtol=2e-5, atol=1e-9)
    with pytest.raises(ValueError, match="temperature"):
        unsampled_second_moment_from_logits(jnp.asarray(logits), 4, 0.0)


def test_expected_unsampled_second_moment_is_the_masked_mean():
    stat = jnp.array([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0]])
    mask = jnp.array([[True, True, True, False], [True, False, False, False]])
    np.testing.assert_allclose(expected_unsampled_second_moment(stat, mask), 0.25, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(expected_unsampled_second_moment)(stat, mask), 0.25,
                               rtol=1e-6)
    assert float(expected_unsampled_second_moment(stat, jnp.zeros_like(mask))) == 0.0
    with pytest.raises(ValueError, match="mask"):
        expected_unsampled_second_moment(stat, mask[:, :2])
    # A trailing axis over several N (the kernel's sum_p2_unsampled [T, K]) is kept.
    stacked = jnp.stack([stat, 2 * stat, 3 * stat], axis=-1)              # [2, 4, 3]
    np.testing.assert_allclose(expected_unsampled_second_moment(stacked, mask), [0.25, 0.5, 0.75],
                               rtol=1e-6)


def test_first_occurrence_marks_each_distinct_response_once():
    ids = jnp.array([[5, 3, 5, 5, 7], [1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(first_occurrence(ids),
                                  [[True, True, False, False, True], [True] * 5])


def _reference_balance(rewards, logps, ids, threshold):
    """Loop-and-set version of the documented statistics for one group."""
    correct = [r >= threshold for r in rewards]
    frac = sum(correct) / len(rewards)
    seen, p_pos, p_neg = set(), 0.0, 0.0
    for c, lp, i in zip(correct, logps, ids):
        if i in seen:
            continue
        seen.add(i)
        if c:
            p_pos += np.exp(lp)
        else:
            p_neg += np.exp(lp)
    weighted = (p_pos - p_neg) / (p_pos + p_neg)
    return dict(frac_correct=frac, s_r_sample=2 * frac - 1, num_distinct=len(seen),
                s_r=p_pos - p_neg, s_r_mass_weighted=weighted,
                s_r_centered=weighted - (2 * frac - 1))


def test_group_reward_balance_matches_a_loop_reference():
    rewards = np.array([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0],
                        [0.0, 1.0, 0.0, 0.0]])
    logps = np.log(np.array([[0.30, 0.20, 0.30, 0.05], [0.1, 0.1, 0.2, 0.3],
                             [0.2, 0.2, 0.1, 0.1], [0.02, 0.4, 0.02, 0.1]]))
    ids = np.array([[0, 1, 0, 2], [0, 1, 2, 3], [0, 1, 2, 3], [7, 8, 7, 9]])
    group_mask = np.array([True, True, True, False])
    out = jax.jit(group_reward_balance)(jnp.asarray(rewards), jnp.asarray(logps),
                                        response_ids=jnp.asarray(ids),
                                        group_mask=jnp.asarray(group_mask))
    for g in range(4):
        want = _reference_balance(rewards[g], logps[g], ids[g], 0.5)
        for k, v in want.items():
            np.testing.assert_allclose(out[k][g], v, rtol=1e-5, atol=1e-7, err_msg=f"{k}[{g}]")
    # Group 0 (reward-positive, duplicate 0.30 counted once): S_R = 0.30 + 0.05 - 0.20 = 0.15.
    np.testing.assert_allclose(out["s_r"][0], 0.15, rtol=1e-5)
    valid = [_reference_balance(rewards[g], logps[g], ids[g], 0.5) for g in range(3)]
    np.testing.assert_allclose(out["mean_s_r_sample"], np.mean([v["s_r_sample"] for v in valid]),
                               rtol=1e-6)
    np.testing.assert_allclose(out["frac_groups_s_r_sample_pos"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["frac_groups_s_r_sample_neg"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["frac_groups_all_correct"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["frac_groups_all_wrong"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["frac_groups_s_r_pos"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["mean_s_r_centered"],
                               np.mean([v["s_r_centered"] for v in valid]), rtol=1e-5, atol=1e-7)
    metrics = reward_balance_metrics(out)
    assert "theory/mean_s_r_sample" in metrics and "theory/frac_correct" not in metrics
    assert all(jnp.ndim(v) == 0 for v in metrics.values())


def test_group_reward_balance_s_r_is_the_papers_s_r_for_a_bandit():
    """Responses as tokens of a categorical policy: s_r equals Theorem 1's S_R (R_c=1, R_w=-1)."""
    rng = np.random.default_rng(1)
    v, g, n = 30, 6, 12
    rewards, logps, ids, want = [], [], [], []
    masses = jax.jit(partial_masses)
    for _ in range(g):
        logits = rng.normal(scale=1.5, size=v)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        correct = rng.random(v) < rng.uniform(0.1, 0.9)
        x = rng.choice(v, size=n, p=p)
        rewards.append(correct[x].astype(np.float32))
        logps.append(np.log(p[x]))
        ids.append(x)
        sampled = np.zeros(v, bool)
        sampled[x] = True
        want.append(float(masses(jnp.asarray(p), jnp.asarray(correct), jnp.asarray(sampled)).s_r))
    out = group_reward_balance(jnp.asarray(np.stack(rewards)), jnp.asarray(np.stack(logps)),
                               response_ids=jnp.asarray(np.stack(ids)))
    np.testing.assert_allclose(out["s_r"], want, rtol=1e-5, atol=1e-7)
    assert min(want) < 0 < max(want)
    np.testing.assert_array_equal(np.sign(out["s_r_mass_weighted"]), np.sign(want))


def test_group_reward_balance_survives_sequence_probability_underflow():
    rewards = jnp.array([[1.0, 0.0, 0.0]])
    logps = jnp.array([[-800.0, -801.0, -801.0]])        # exp() underflows float32
    out = group_reward_balance(rewards, logps)
    e = np.exp(-1.0)
    np.testing.assert_allclose(out["s_r_mass_weighted"][0], (1 - 2 * e) / (1 + 2 * e), rtol=1e-5)
    np.testing.assert_allclose(out["log_p_pos"][0], -800.0, rtol=1e-6)
    assert float(out["s_r"][0]) == 0.0                    # documented: S_R itself underflows
    # Without log-probs only the sample statistics are returned; {-1, 1} rewards work too.
    plain = group_reward_balance(jnp.array([[1.0, -1.0, -1.0, -1.0]]))
    assert "s_r" not in plain
    np.testing.assert_allclose(plain["s_r_sample"], [-0.5])


def test_group_reward_balance_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rewards"):
        group_reward_balance(jnp.zeros((4,)))
    with pytest.raises(ValueError, match="seq_logprobs"):
        group_reward_balance(jnp.zeros((2, 4)), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="group_mask"):
        group_reward_balance(jnp.zeros((2, 4)), group_mask=jnp.ones((3,), bool))

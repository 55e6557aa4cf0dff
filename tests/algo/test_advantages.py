"""Advantage estimators on hand-computed small cases (incl. all-correct / all-wrong groups)."""
import numpy as np
import pytest

from brorl_jax.algo import ADVANTAGES, compute_advantages, get_advantage_fn

R = np.array([[1, 0, 0, 1],
              [1, 1, 1, 1],     # all correct
              [0, 0, 0, 0]],    # all wrong
             np.float32)


def test_registry_names_and_unknown_name():
    assert sorted(ADVANTAGES) == ["dr_grpo", "grpo", "reinforce_pp_baseline", "rloo"]
    with pytest.raises(ValueError, match="allowed: \\['dr_grpo', 'grpo', 'reinforce_pp_baseline', 'rloo'\\]"):
        get_advantage_fn("ppo")


def test_reinforce_pp_baseline_hand_case():
    # group means 0.5, 1, 0 -> A = +-0.5 in group 0, zeros elsewhere; batch mean 0; veRL's
    # unbiased variance over the M = 12 responses: 4 * 0.25 / 11
    a = np.asarray(compute_advantages("reinforce_pp_baseline", R, whiten_eps=0.0))
    expect = np.array([[0.5, -0.5, -0.5, 0.5], [0] * 4, [0] * 4]) / np.sqrt(1 / 11)
    np.testing.assert_allclose(a, expect, rtol=1e-6)


def test_reinforce_pp_baseline_whitens_over_kept_groups_only():
    r = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [5, 5, 5, 9]], np.float32)
    mask = np.array([True, True, False])
    a = np.asarray(compute_advantages("reinforce_pp_baseline", r, mask, whiten_eps=0.0))
    raw = np.array([[0.75, -0.25, -0.25, -0.25], [0.5, 0.5, -0.5, -0.5]])
    expect = (raw - raw.mean()) / raw.std(ddof=1)
    np.testing.assert_allclose(a[:2], expect, rtol=1e-5)
    assert np.all(a[2] == 0)
    assert abs(a[:2].mean()) < 1e-6 and abs(a[:2].std(ddof=1) - 1) < 1e-5


def test_reinforce_pp_baseline_token_weighted_whitening():
    """veRL masked_whiten over tokens: mean and unbiased variance over the M response tokens,
    divided by sqrt(var + whiten_eps)."""
    r = np.array([[1, 0], [0, 1]], np.float32)
    lengths = np.array([[3, 1], [1, 1]], np.float32)
    for eps in (0.0, 1e-8, 0.5):
        a = np.asarray(compute_advantages("reinforce_pp_baseline", r, lengths=lengths,
                                          whiten_eps=eps))
        tokens = np.repeat(np.array([0.5, -0.5, -0.5, 0.5]), lengths.reshape(-1).astype(int))
        m = tokens.size
        var = np.sum((tokens - tokens.mean()) ** 2) / m * m / (m - 1)
        want = (np.array([0.5, -0.5, -0.5, 0.5]) - tokens.mean()) / np.sqrt(var + eps)
        np.testing.assert_allclose(a.reshape(-1), want, rtol=1e-5)
    # per-response and per-token whitening differ on this batch
    per_response = np.asarray(compute_advantages("reinforce_pp_baseline", r))
    assert np.abs(per_response - a).max() > 0.1


def test_grpo_hand_case():
    a = np.asarray(compute_advantages("grpo", R, eps=0.0))
    std = np.sqrt((4 * 0.25) / 3)  # ddof=1
    np.testing.assert_allclose(a[0], np.array([0.5, -0.5, -0.5, 0.5]) / std, rtol=1e-6)
    # all-correct / all-wrong groups: zero advantage, not nan (eps guards 0/0)
    a_eps = np.asarray(compute_advantages("grpo", R))
    assert np.all(a_eps[1:] == 0) and np.all(np.isfinite(a_eps))


def test_rloo_hand_case():
    a = np.asarray(compute_advantages("rloo", R))
    # i=0: 1 - (0+0+1)/3 ; i=1: 0 - (1+0+1)/3
    np.testing.assert_allclose(a[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    assert np.all(a[1:] == 0)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_bad_shapes_raise(name):
    with pytest.raises(ValueError, match="rewards must be"):
        compute_advantages(name, np.zeros((3,)))
    with pytest.raises(ValueError, match="group_mask"):
        compute_advantages(name, np.zeros((3, 4)), np.ones(2, bool))


def test_dr_grpo_is_the_unnormalised_group_advantage():
    # Dr. GRPO (Liu et al. 2025): R - mean_group(R), no division by the group std
    a = np.asarray(compute_advantages("dr_grpo", R))
    np.testing.assert_allclose(a, R - R.mean(1, keepdims=True), atol=1e-7)
    r = np.array([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]], np.float32)
    np.testing.assert_allclose(np.asarray(compute_advantages("dr_grpo", r)),
                               [[2.0, -1.0, -1.0], [0, 0, 0]], atol=1e-6)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_sample_mask_all_true_equals_no_mask(name):
    r = np.random.default_rng(1).integers(0, 2, (5, 6)).astype(np.float32)
    got = compute_advantages(name, r, sample_mask=np.ones(r.shape, bool))
    np.testing.assert_allclose(got, np.asarray(compute_advantages(name, r)), atol=1e-6)


def test_ragged_groups_match_brute_force():
    """Groups of different sizes (adaptive N), padded with sample_mask False."""
    groups = [np.array([1.0, 0, 0, 1]), np.array([1.0, 0, 0, 0, 0, 0, 1, 1]), np.array([0.0, 1])]
    r = np.zeros((3, 8), np.float32)
    mask = np.zeros((3, 8), bool)
    for i, g in enumerate(groups):
        r[i, :len(g)], mask[i, :len(g)] = g, True
    centered = [g - g.mean() for g in groups]
    flat = np.concatenate(centered)
    want = {
        "reinforce_pp_baseline": [c / np.sqrt(flat.var(ddof=1) + 1e-8) for c in centered],
        "rloo": [[g[j] - np.delete(g, j).mean() for j in range(len(g))] for g in groups],
        "grpo": [(g - g.mean()) / (g.std(ddof=1) + 1e-6) for g in groups],
        "dr_grpo": centered,
    }
    assert sorted(want) == sorted(ADVANTAGES)
    for name, expect in want.items():
        got = np.asarray(compute_advantages(name, r, sample_mask=mask))
        for i, w in enumerate(expect):
            np.testing.assert_allclose(got[i, :len(w)], w, rtol=1e-5, atol=1e-6)
            assert np.all(got[i, len(w):] == 0)

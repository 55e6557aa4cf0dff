"""The collect step's policies that are not in the paper (brorl_jax/algo/policies.py): parsing
with errors that name the key, adaptive N's bucket choice and pass-rate state, over-generation's
selection rules, reward clipping and the EMA advantage normaliser (pure, explicit state)."""
import json
import math

import numpy as np
import pytest

from brorl_jax import algo
from brorl_jax.algo import policies as pol
from brorl_jax.config import ConfigError, default_config, validate


def test_every_option_is_off_by_default():
    c = default_config()
    assert c.rollout.temperature_schedule == "" and c.rollout.adaptive_n is False
    assert c.rollout.overgenerate_factor == 1.0 and c.rollout.knapsack is False
    assert (c.rollout.top_k, c.rollout.top_p) == (0, 1.0)
    assert (c.algo.reward_clip_low, c.algo.reward_clip_high) == (-math.inf, math.inf)
    assert c.algo.advantage_normalizer == "batch" and c.algo.entropy_coef == 0.0
    assert (c.optim.name, c.optim.schedule) == ("adamw", "constant")
    assert pol.samples_per_prompt_policy(c.rollout) == pol.FixedN(512)
    r = np.array([[3.0, -5.0]], np.float32)
    assert pol.clip_rewards(r, -math.inf, math.inf) is r


@pytest.mark.parametrize("key,value,pattern", [
    ("rollout.temperature_schedule", "0:1.3,x", r"'rollout.temperature_schedule'.*step:temp"),
    ("rollout.temperature_schedule", "10:1.3,5:0.9", r"steps must increase strictly"),
    ("rollout.temperature_schedule", "0:0", r"temperature > 0"),
    ("rollout.adaptive_n_buckets", "512,256", r"'rollout.adaptive_n_buckets'.*increasing"),
    ("rollout.adaptive_n_thresholds", "0.7", r"one value fewer"),
    ("rollout.adaptive_n_thresholds", "0.3,0.7", r"strictly decreasing"),
    ("rollout.overgenerate_factor", 0.5, r"'rollout.overgenerate_factor' must be >= 1.0"),
    ("rollout.select_rule", "best", r"'rollout.select_rule' is 'best'; allowed"),
    ("algo.reward_clip_high", -math.inf, r"'algo.reward_clip_low' < 'algo.reward_clip_high'"),
    ("algo.advantage_ema_decay", 1.0, r"'algo.advantage_ema_decay' must be in \[0, 1\)"),
    ("optim.final_lr_ratio", 1.5, r"'optim.final_lr_ratio' must be in \[0, 1\]"),
])
def test_bad_option_values_are_named(key, value, pattern):
    c = default_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_option_combinations_are_checked():
    c = default_config()
    c.rollout.adaptive_n = True
    c.algo.prompts_per_step, c.rollout.rollouts_per_prompt = 1, 512
    with pytest.raises(ConfigError, match=r"largest N \(768\) must fit .* 512 rows"):
        validate(c)
    c = default_config()
    c.algo.advantage_normalizer, c.algo.advantage = "ema", "grpo"
    with pytest.raises(ConfigError, match=r"'ema' replaces the batch whitening"):
        validate(c)
    c = default_config()
    c.rollout.knapsack, c.rollout.knapsack_probe = True, 1024
    with pytest.raises(ConfigError, match=r"knapsack_probe \(1024\) must be at most "
                       r"rollout.rollouts_per_prompt \(512\)"):
        validate(c)
    c.rollout.knapsack_probe, c.rollout.adaptive_n = 8, True
    with pytest.raises(ConfigError, match=r"turn off rollout.adaptive_n or rollout.knapsack"):
        validate(c)


def test_knapsack_allocation_is_the_best_split_of_the_budget():
    """Knapsack RL's value is zero for a prompt always or never solved and concave in n; the
    greedy split of the round's spare chunks equals the best split found by brute force, spends
    the whole budget, respects the cap, and gives most to the prompts rarely solved."""
    import itertools
    v = pol.knapsack_value
    assert v(8, 0.0) == v(8, 1.0) == 0.0 and v(1, 0.3) == pytest.approx(0.0)
    gains = np.diff([v(n, 0.2) for n in range(1, 64)])
    assert (gains > 0).all() and (np.diff(gains) <= 1e-15).all()
    correct, probe, chunk, max_n = [0, 1, 4, 8, 7], 8, 4, 32
    budget = len(correct) * 16
    got = pol.knapsack_allocation(correct, probe, budget, chunk, max_n)
    assert sum(got) == budget and max(got) <= max_n
    assert all((t - probe) % chunk == 0 and t >= probe for t in got)
    rates = [(k + 0.5) / (probe + 1) for k in correct]
    total = lambda ns: sum(v(n, p) for n, p in zip(ns, rates))
    spare, cap = (budget - probe * len(correct)) // chunk, (max_n - probe) // chunk
    best = max(total([probe + chunk * c for c in cs])
               for cs in itertools.product(range(cap + 1), repeat=len(correct)) if sum(cs) == spare)
    assert total(got) == pytest.approx(best)
    # the rarely solved get the breadth (an all-wrong probe most: p ~ 1/18), a prompt at 4/8
    # and one always right nothing past the probe
    assert got == [32, 20, 8, 8, 12]
    policy = pol.KnapsackN(n=16, probe=probe, chunk=chunk, max_n=max_n)
    assert policy.allocate(correct) == got and policy.n_for(7) == probe
    assert pol.knapsack_allocation([8, 8], probe=8, budget=16, chunk=4, max_n=64) == [8, 8]


def test_temperature_schedule_phases():
    sched = pol.parse_temperature_schedule("0:1.3, 100:0.9,200:0.7")
    assert sched == ((0, 1.3), (100, 0.9), (200, 0.7))
    got = [pol.temperature_at(sched, s, 1.0) for s in (0, 99, 100, 199, 200, 10_000)]
    assert got == [1.3, 1.3, 0.9, 0.9, 0.7, 0.7]
    assert pol.temperature_at(((50, 0.5),), 10, 1.2) == 1.2     # before the first entry


def test_choose_rollouts_by_pass_rate_and_unseen_prompts_get_the_middle_bucket():
    b, t = pol.parse_adaptive_n("256,512,768", "0.7,0.3")
    assert pol.choose_rollouts(None, b, t) == 512
    assert [pol.choose_rollouts(p, b, t) for p in (1.0, 0.7, 0.69, 0.3, 0.29, 0.0)] == \
        [256, 256, 512, 512, 768, 768]
    assert pol.group_by_n([8, 4, 8, 12]) == [(4, [1]), (8, [0, 2]), (12, [3])]


def test_adaptive_n_pass_rate_ema_and_json_round_trip():
    a = pol.AdaptiveN((4, 8, 12), (0.6, 0.3), decay=0.75)
    a.observe(7, 1.0)
    a.observe(7, 0.0)
    a.observe(3, 1 / 3)
    assert a.rates[7] == pytest.approx(0.75) and a.rates[3] == 1 / 3
    assert (a.n_for(7), a.n_for(3), a.n_for(5), a.max_n) == (4, 8, 8, 12)
    back = pol.AdaptiveN((4, 8, 12), (0.6, 0.3), decay=0.75)
    back.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert back.rates == a.rates                   # exact: floats round-trip through JSON


def _cands():
    # 8 candidates of length 3: rows 0/1/2 are equal, 3/4 are equal; 0, 1, 2, 5 are correct
    toks = np.array([[1, 2, 3]] * 3 + [[4, 5, 6]] * 2 + [[7, 7, 7], [8, 8, 8], [9, 9, 9]])
    return toks, np.full(8, 3), np.array([1, 1, 1, 0, 0, 1, 0, 0], np.float32)


def test_select_dedup_drops_exact_duplicates_first():
    toks, lens, rew = _cands()
    idx, info = pol.select_rollouts(toks, lens, rew, 5, "dedup", np.random.default_rng(0))
    assert info["unique"] == 5 and info["duplicates_kept"] == 0
    assert len({toks[i].tobytes() for i in idx}) == 5
    idx, info = pol.select_rollouts(toks, lens, rew, 7, "dedup", np.random.default_rng(0))
    assert len(idx) == 7 and len(set(idx)) == 7 and info["duplicates_kept"] == 2


def test_select_balanced_and_dedup_then_balanced():
    toks, lens, rew = _cands()
    for seed in range(5):
        idx, _ = pol.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(seed))
        assert rew[idx].sum() == 2 and len(set(idx)) == 4
        idx, _ = pol.select_rollouts(toks, lens, rew, 4, "dedup_then_balanced",
                                     np.random.default_rng(seed))
        assert rew[idx].sum() == 2 and len({toks[i].tobytes() for i in idx}) == 4
    # a group with one correct candidate keeps it (balance as far as availability allows)
    rew1 = np.array([0, 0, 0, 0, 0, 1, 0, 0], np.float32)
    idx, _ = pol.select_rollouts(toks, lens, rew1, 4, "balanced", np.random.default_rng(1))
    assert 5 in idx
    a, _ = pol.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(3))
    b, _ = pol.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    assert pol.num_candidates(512, 1.0) == 512 and pol.num_candidates(4, 1.5) == 6


def test_reward_clipping():
    r = np.array([[-3.0, 0.5, 4.0]], np.float32)
    np.testing.assert_array_equal(pol.clip_rewards(r, -2.0, 2.0), [[-2.0, 0.5, 2.0]])


def test_ema_normalizer_uses_the_running_std_and_is_pure():
    r1 = np.array([[1.0, 0, 0, 0], [1, 1, 0, 1]])
    r2 = np.array([[1.0, 0, 1, 0], [0, 0, 0, 1]]) * 3.0
    full = np.ones(r1.shape, bool)
    ema = pol.ADVANTAGE_NORMALIZERS["ema"]
    kw = dict(eps=1e-6, whiten_eps=1e-8, decay=0.5)
    # decay 0 = this batch's std: REINFORCE++-baseline
    got, _ = ema("reinforce_pp_baseline", r1, full, {}, eps=1e-6, whiten_eps=1e-8, decay=0.0)
    c1 = r1 - r1.mean(1, keepdims=True)
    np.testing.assert_allclose(got, c1 / (c1.std() + 1e-6), atol=1e-5)   # population std
    _, state = ema("reinforce_pp_baseline", r1, full, {}, **kw)
    s1 = np.std(r1 - r1.mean(1, keepdims=True))
    s2 = np.std(r2 - r2.mean(1, keepdims=True))
    frozen = dict(state)
    got, state2 = ema("reinforce_pp_baseline", r2, full, state, **kw)
    assert state == frozen                                   # the input state is not changed
    assert state2["ema_std"] == pytest.approx(0.5 * s1 + 0.5 * s2)
    np.testing.assert_allclose(got, (r2 - r2.mean(1, keepdims=True)) / (0.5 * s1 + 0.5 * s2 + 1e-6),
                               rtol=1e-5)
    # an empty batch leaves the state as it was
    _, state3 = ema("reinforce_pp_baseline", r2, np.zeros(r2.shape, bool), state2, **kw)
    assert state3 == state2
    # "batch" is the estimator itself
    got, st = pol.ADVANTAGE_NORMALIZERS["batch"]("grpo", r1, full, {}, **kw)
    np.testing.assert_allclose(got, algo.compute_advantages("grpo", r1), atol=1e-6)
    assert st == {}

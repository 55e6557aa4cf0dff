"""Dynamic sampling: the group filters follow their rules, rounds fill a fixed row budget with whole
groups in arrival order, the cap gives a clear error (or pads), and the pass rate is kept /
generated."""
import numpy as np
import pytest

from brorl_jax.algo import (
    GROUP_FILTERS,
    DynamicSamplingError,
    Group,
    GroupSampler,
    generation_batch_size,
    select_groups,
)
from brorl_jax.config import make_config


def _sampler(**kw) -> GroupSampler:
    """A GroupSampler with the config's defaults for what the test does not set."""
    cfg = make_config().algo
    base = dict(cap_policy=cfg.dynamic_sampling_cap_policy, rule=cfg.dynamic_sampling_rule,
                correct_threshold=cfg.correct_threshold, enabled=cfg.dynamic_sampling)
    return GroupSampler(**{**base, **kw})


def _group(rewards, tag=0):
    r = np.asarray(rewards, np.float32)
    n = len(r)
    return Group(prompt_ids=[tag], tokens=np.full((n, 3), tag), logprobs=np.zeros((n, 3)),
                 mask=np.ones((n, 3), bool), lengths=np.full(n, 3), rewards=r, shaped=r, index=tag)


def test_correct_count_rule_on_random_rewards():
    rng = np.random.default_rng(0)
    rewards = (rng.random((200, 8)) < rng.random((200, 1))).astype(np.float32)
    rewards[0] = 1.0
    rewards[1] = 0.0
    kept = select_groups(rewards, correct_threshold=1.0)
    expect = [0 < sum(1 for r in row if r >= 1.0) < len(row) for row in rewards]
    np.testing.assert_array_equal(kept, expect)
    assert not kept[0] and not kept[1]


def test_rules_differ_only_on_partial_credit():
    binary = (np.random.default_rng(1).random((50, 4)) < 0.5).astype(np.float32)
    np.testing.assert_array_equal(select_groups(binary, 1.0, "correct_count"),
                                  select_groups(binary, 1.0, "reward_std"))
    partial = np.array([[0.6, 0.6], [1.0, 0.6], [0.25, 0.5], [0.0, 0.0]])
    np.testing.assert_array_equal(select_groups(partial, 1.0, "correct_count"),
                                  [False, True, False, False])
    np.testing.assert_array_equal(select_groups(partial, 1.0, "reward_std"),
                                  [False, True, True, False])
    np.testing.assert_array_equal(select_groups(partial, 0.5, "correct_count"),
                                  [False, False, True, False])
    assert sorted(GROUP_FILTERS) == ["correct_count", "reward_std"]
    with pytest.raises(ValueError, match="allowed: \\['correct_count', 'reward_std'\\]"):
        select_groups(partial, 1.0, "variance")


def test_sampler_fills_exact_budget_over_rounds_and_reports_pass_rate():
    rng = np.random.default_rng(0)
    s = _sampler(row_budget=40, max_group_rows=4, max_generation_rounds=50)
    tag = 0
    while s.need_more():
        groups = []
        for _ in range(5):
            groups.append(_group((rng.random(4) < 0.5).astype(np.float32), tag))
            tag += 1
        s.add_round(groups)
    assert len(s.groups) == 10 and s.rows_used == 40
    assert all(0 < g.rewards.sum() < 4 for g in s.groups)
    stats = s.stats()
    assert stats["pass_rate"] == s.passed_groups / s.generated_groups
    assert stats["generated_groups"] == 5 * stats["generation_rounds"]
    assert stats["padded_rows"] == 0
    tags = [g.index for g in s.groups]              # arrival order, surplus dropped
    assert tags == sorted(tags)


def test_ragged_groups_fill_the_budget_whole():
    s = _sampler(row_budget=10, max_group_rows=4, max_generation_rounds=3, cap_policy="pad")
    s.add_round([_group([1, 0, 0, 0], 0), _group([1, 0], 1), _group([1, 1], 2),
                 _group([0, 1, 0], 3), _group([1, 0, 1, 0], 4)])
    # kept: 0 (4 rows), 1 (2 rows), 3 (3 rows) = 9; 4 no longer fits; group 2 is all-correct
    assert [g.index for g in s.groups] == [0, 1, 3] and s.rows_used == 9
    assert not s.need_more()                        # < max_group_rows rows left: full
    assert s.stats()["padded_rows"] == 1


def test_cap_hit_raises_clear_error():
    s = _sampler(row_budget=16, max_group_rows=4, max_generation_rounds=2)
    with pytest.raises(DynamicSamplingError, match=r"filled 0 of 16 rows .* after 2 rounds .*0 of "
                                                   r"8 groups kept.*raise algo.max_generation_rounds"):
        while s.need_more():
            s.add_round([_group([1, 1, 1, 1]) for _ in range(4)])     # all correct: all dropped


def test_cap_pad_policy_stops_and_reports_padding():
    s = _sampler(row_budget=12, max_group_rows=2, max_generation_rounds=1, cap_policy="pad")
    rewards = [[1, 0], [1, 1], [0, 1], [0, 0], [1, 1], [0, 0]]
    s.add_round([_group(r, i) for i, r in enumerate(rewards)])
    assert not s.need_more()
    assert [g.index for g in s.groups] == [0, 2]
    stats = s.stats()
    assert stats["pass_rate"] == pytest.approx(2 / 6) and stats["padded_rows"] == 8


def test_disabled_keeps_everything_and_config_wiring():
    cfg = make_config(prompts_per_step=3, rollouts_per_prompt=2, dynamic_sampling=False,
                         generation_batch_multiplier=1.6, dynamic_sampling_rule="reward_std")
    s = GroupSampler.from_config(cfg)
    assert (s.row_budget, s.max_group_rows, s.rule) == (6, 2, "reward_std")
    assert generation_batch_size(3, 1.6) == 5
    s.add_round([_group([1, 1], i) for i in range(5)])
    assert s.stats()["pass_rate"] == 1.0 and len(s.groups) == 3 and not s.need_more()

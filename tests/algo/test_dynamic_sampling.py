"""Dynamic sampling: the kept set follows 0 < #correct < N, rounds fill a fixed-shape batch, the
cap gives a clear error (or pads), and the pass rate is kept / generated."""
import numpy as np
import pytest

from brorl_jax.algo import (AlgoConfig, DynamicSampler, DynamicSamplingError, generation_batch_size,
                            run_dynamic_sampling, select_groups)


def test_select_groups_equals_rule_on_random_rewards():
    rng = np.random.default_rng(0)
    rewards = (rng.random((200, 8)) < rng.random((200, 1))).astype(np.float32)
    rewards[0] = 1.0
    rewards[1] = 0.0
    kept = select_groups(rewards, correct_threshold=1.0)
    expect = [0 < sum(1 for r in row if r >= 1.0) < len(row) for row in rewards]
    np.testing.assert_array_equal(kept, expect)
    assert not kept[0] and not kept[1]


def test_select_groups_threshold_for_partial_credit():
    r = np.array([[0.6, 0.6], [1.0, 0.6]])
    np.testing.assert_array_equal(select_groups(r, 1.0), [False, True])
    np.testing.assert_array_equal(select_groups(r, 0.5), [False, False])


def _round_fn(seed, n=4, p_correct=0.5):
    rng = np.random.default_rng(seed)

    def gen(round_index, num_prompts):
        rewards = (rng.random((num_prompts, n)) < p_correct).astype(np.float32)
        ids = np.arange(num_prompts) + 1000 * round_index
        return rewards, {"prompt_id": ids, "tokens": np.tile(ids[:, None, None], (1, n, 3))}

    return gen


def test_sampler_fills_exact_batch_over_rounds_and_reports_pass_rate():
    s = DynamicSampler(prompts_per_step=10, rollouts_per_prompt=4, generation_batch_multiplier=0.5,
                       max_generation_rounds=50)
    assert s.generation_batch_size == 5
    out, valid, stats = run_dynamic_sampling(s, _round_fn(0))
    assert out["tokens"].shape == (10, 4, 3) and out["rewards"].shape == (10, 4)
    assert valid.all()
    assert np.all(select_groups(out["rewards"]))
    assert stats["pass_rate"] == s.kept_groups / s.generated_groups
    assert stats["generated_groups"] == 5 * stats["generation_rounds"]
    # kept groups come in generation order, surplus truncated
    assert np.all(np.diff(out["prompt_id"]) > 0)


def test_cap_hit_raises_clear_error():
    s = DynamicSampler(prompts_per_step=4, rollouts_per_prompt=4, max_generation_rounds=2)
    never_mixed = lambda r, g: (np.ones((g, 4)), {"x": np.zeros(g)})   # all correct: all dropped
    with pytest.raises(DynamicSamplingError, match=r"kept 0 of 8 groups .* after 2 rounds; raise "
                                                   r"algo.max_generation_rounds"):
        run_dynamic_sampling(s, never_mixed)


def test_cap_pad_policy_keeps_shape_and_masks_missing_groups():
    s = DynamicSampler(prompts_per_step=6, rollouts_per_prompt=2, max_generation_rounds=1, cap_policy="pad")
    rewards = np.array([[1, 0], [1, 1], [0, 1], [0, 0], [1, 1], [0, 0]], np.float32)
    s.add(rewards, {"tokens": np.arange(6)[:, None, None] * np.ones((1, 2, 3))})
    assert not s.need_more()
    out, valid, stats = s.finalize()
    assert out["tokens"].shape == (6, 2, 3)
    np.testing.assert_array_equal(valid, [True, True, False, False, False, False])
    np.testing.assert_array_equal(out["tokens"][:2, 0, 0], [0, 2])
    assert np.all(out["tokens"][2:] == 0)
    assert stats["pass_rate"] == pytest.approx(2 / 6) and stats["padded_groups"] == 4


def test_disabled_keeps_everything_and_config_wiring():
    cfg = AlgoConfig(prompts_per_step=3, rollouts_per_prompt=2, dynamic_sampling=False,
                     generation_batch_multiplier=1.6)
    s = DynamicSampler.from_config(cfg)
    assert s.generation_batch_size == generation_batch_size(3, 1.6) == 5
    s.add(np.ones((5, 2)), {})
    out, valid, stats = s.finalize()
    assert valid.all() and stats["pass_rate"] == 1.0 and out["rewards"].shape == (3, 2)


def test_add_validates_shapes():
    s = DynamicSampler(prompts_per_step=2, rollouts_per_prompt=4)
    with pytest.raises(ValueError, match="rewards must be"):
        s.add(np.zeros((2, 3)), {})
    with pytest.raises(ValueError, match="leading dim"):
        s.add(np.zeros((2, 4)), {"tokens": np.zeros((3, 4))})

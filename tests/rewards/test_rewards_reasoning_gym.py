"""Reasoning Gym: seeded prompt source + the tasks' own score_answer as the verifier."""

import pytest

from brorl_jax.rewards import ScoringService, reasoning_gym_records
from brorl_jax.rewards.reasoning_gym_reward import reasoning_gym_reward, task_names

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "spell_backward", "word_sorting",
         "base_conversion"]


def test_records_are_reproducible_and_seeded():
    a = reasoning_gym_records("chain_sum", 5, seed=3)
    b = reasoning_gym_records("chain_sum", 5, seed=3)
    c = reasoning_gym_records("chain_sum", 5, seed=4)
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
    assert all(r["data_source"] == "reasoning_gym/chain_sum" for r in a)
    assert all(r["extra_info"]["answer"] == r["ground_truth"] for r in a)


@pytest.mark.parametrize("task", TASKS)
def test_reference_answers_score_one_in_process(task):
    for rec in reasoning_gym_records(task, 3, seed=0):
        result = reasoning_gym_reward(rec, f"thinking...<answer>{rec['ground_truth']}</answer>")
        assert result.score == 1.0, (task, rec["ground_truth"], result)


def test_reference_answers_score_one_through_the_service():
    records = [rec for task in TASKS for rec in reasoning_gym_records(task, 2, seed=1)]
    right = [f"<answer>{r['ground_truth']}</answer>" for r in records]
    wrong = ["<answer>definitely not it</answer>"] * len(records)
    missing = [str(r["ground_truth"]) for r in records]  # no answer tags
    with ScoringService(num_workers=2, timeout_s=20.0, rewards=["reasoning_gym"]) as svc:
        results = svc.score_batch(records * 3, right + wrong + missing)
    n = len(records)
    assert [r.score for r in results[:n]] == [1.0] * n
    assert all(r.score < 1.0 for r in results[n:2 * n])
    assert all(r.score == 0.0 and r.reason == "no answer extracted" for r in results[2 * n:])


def test_unknown_task_is_a_clear_error():
    assert "basic_arithmetic" in task_names()
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        reasoning_gym_records("no_such_task", 2, seed=0)

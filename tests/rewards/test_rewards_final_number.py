"""Final-number verifier: the last number of the completion equals the ground truth exactly."""

import pytest

from brorl_jax.rewards import score
from brorl_jax.rewards.final_number_reward import final_number_reward, last_number
from brorl_jax.rewards.registry import resolve_reward_name


def _score(truth, completion):
    return final_number_reward({"data_source": "final_number", "ground_truth": truth}, completion)


@pytest.mark.parametrize("truth, completion", [
    ("19", "12 + 7 = 19."),
    (19, "The sum of 12 and 7 is 19"),
    ("19", "12 + 7 = 19.0"),
    ("1234", "The answer is 1,234."),
    (-5, "2 - 7 = -5"),
    ("3.5", "7 / 2 = 3.5 apples"),
    ([19, 20], "it is 20"),                               # a list of acceptable answers
    ("19", "First I thought 18, then corrected: **19**"),   # markdown around the number
])
def test_last_number_right_scores_one(truth, completion):
    result = _score(truth, completion)
    assert (result.score, result.reason) == (1.0, "correct"), result


@pytest.mark.parametrize("truth, completion, extracted", [
    ("19", "19 is 12 + 7", "7"),                 # the LAST number counts, not the first
    ("19", "12 + 7 = 19.5", "19.5"),
    ("5", "12-7", "7"),                            # a hyphen after a digit is not a sign
    ("-7", "x = 7", "7"),
    ("1234", "1,2345", "2345"),                     # a malformed group is two numbers
])
def test_wrong_last_number_scores_zero(truth, completion, extracted):
    result = _score(truth, completion)
    assert (result.score, result.reason) == (0.0, "wrong answer"), result
    assert result.details["extracted"] == extracted


@pytest.mark.parametrize("completion", ["", "I don't know.", "version v1.2.3"])
def test_no_number_scores_zero(completion):
    result = _score("19", completion)
    assert (result.score, result.reason) == (0.0, "no number")
    assert last_number(completion) is None


def test_bad_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="ground_truth 'abc' is not a number"):
        _score("abc", "19")
    with pytest.raises(ValueError, match="ground_truth"):
        final_number_reward({"data_source": "final_number"}, "19")


def test_registered_and_scored_through_the_worker_pool():
    assert resolve_reward_name("final_number") == "final_number"
    records = [{"data_source": "final_number", "ground_truth": "19"}] * 2
    assert score(records, ["12 + 7 = 19", "12 + 7 = 18"]) == [1.0, 0.0]

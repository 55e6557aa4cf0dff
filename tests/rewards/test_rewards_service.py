"""Scoring service: timeouts, deaths, deadlines, recycling, routing, the public score()."""

import time

import pytest

from brorl_jax.rewards import ScoringService, resolve_reward_name, score


def _rec(source, truth="0"):
    return {"data_source": source, "ground_truth": truth}


def test_hanging_verifier_times_out_while_the_rest_is_scored(test_verifiers):
    # A pathological math expression with math-verify's in-process timeout switched off, and
    # a verifier blocked in C: only killing the worker process stops either.
    records = ([_rec("hang")] + [_rec("echo")] * 10 + [_rec("math", "1")] * 2
               + [_rec("echo")] * 10)
    completions = (["x"] + ["1.0"] * 10 + ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}"]
                   + ["0.25"] * 10)
    with ScoringService(num_workers=2, timeout_s=3.0, rewards=["hang", "echo", "math"],
                        reward_options={"math": {"verify_timeout_s": None}},
                        timeout_overrides={"echo": 30.0}) as svc:
        start = time.monotonic()
        results = svc.score_batch(records, completions)
        elapsed = time.monotonic() - start
        assert results[0].score == 0.0 and results[0].reason == "timeout after 3s"
        assert results[11].score == 0.0 and results[11].reason == "timeout after 3s"
        assert results[12].score == 1.0
        assert [r.score for r in results[1:11]] == [1.0] * 10
        assert [r.score for r in results[13:]] == [0.25] * 10
        assert svc.stats["item_timeouts"] == 2
        assert elapsed < 25, elapsed  # two 3 s timeouts in parallel, plus worker restarts
        # The replaced workers serve the next batch.
        again = svc.score_batch([_rec("echo")] * 4, ["0.5"] * 4)
        assert [r.score for r in again] == [0.5] * 4


def test_dead_worker_is_replaced_and_only_its_item_scores_zero(test_verifiers):
    records = [_rec("echo"), _rec("die"), _rec("echo"), _rec("die"), _rec("echo")]
    completions = ["1.0", "segv", "1.0", "exit", "1.0"]
    with ScoringService(num_workers=2, timeout_s=20.0, rewards=["echo", "die"]) as svc:
        results = svc.score_batch(records, completions)
        assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert results[1].reason == "worker died (signal 11)"
        assert results[3].reason == "worker died (exit code 3)"
        assert svc.stats["worker_deaths"] == 2
        assert len(svc.worker_pids()) == 2


def test_batch_deadline_scores_unfinished_items_zero(test_verifiers):
    records = [_rec("echo")] * 3 + [_rec("hang")] * 4
    with ScoringService(num_workers=2, timeout_s=60.0, batch_deadline_s=4.0,
                        rewards=["echo", "hang"]) as svc:
        start = time.monotonic()
        results = svc.score_batch(records, ["1.0"] * 3 + ["x"] * 4)
        elapsed = time.monotonic() - start
    assert elapsed < 12, elapsed
    assert [r.score for r in results[:3]] == [1.0] * 3
    assert all(r.score == 0.0 and r.reason == "batch deadline exceeded" for r in results[3:])


def test_workers_are_recycled(test_verifiers):
    with ScoringService(num_workers=1, timeout_s=20.0, recycle_after=3, rewards=["echo"],
                        max_inflight_per_worker=1) as svc:
        results = svc.score_batch([_rec("echo")] * 9, ["1.0"] * 9)
        pids = {r.details["pid"] for r in results}
        assert len(pids) == 3, pids
        assert svc.stats["workers_recycled"] >= 2


def test_verifier_errors_and_bad_scores_are_reported(test_verifiers):
    with ScoringService(num_workers=1, timeout_s=20.0,
                        rewards=["buggy", "out_of_range", "echo"]) as svc:
        results = svc.score_batch([_rec("buggy"), _rec("out_of_range"), _rec("echo")],
                                  ["x", "x", "1"])
    assert results[0].score == 0.0 and results[0].reason.startswith("verifier error: KeyError")
    assert results[1].score == 0.0 and "in [0, 1]" in results[1].reason
    assert results[2].score == 1.0


def test_routing_by_data_source():
    assert resolve_reward_name("math") == "math"
    assert resolve_reward_name("reasoning_gym/basic_arithmetic") == "reasoning_gym"
    assert resolve_reward_name("gsm8k", {"gsm8k": "math"}) == "math"
    assert resolve_reward_name("taco/hard", {"taco": "code"}) == "code"
    with pytest.raises(ValueError, match="reward_map"):
        resolve_reward_name("my_set")
    # veRL's common data_source names are understood by default (registry.DEFAULT_REWARD_MAP);
    # the config's map wins over them; names without a verifier here are refused by name.
    assert resolve_reward_name("openai/gsm8k") == "final_number"
    assert resolve_reward_name("numina_olympiads") == "math"
    assert resolve_reward_name("aime2024") == "math"
    assert resolve_reward_name("codecontests") == "code"
    assert resolve_reward_name("openai/gsm8k", {"openai/gsm8k": "math"}) == "math"
    assert resolve_reward_name("my_olympiad", {"my_*": "math"}) == "math"
    with pytest.raises(ValueError, match="geo3k, an image-geometry task"):
        resolve_reward_name("hiyouga/geometry3k")
    with pytest.raises(ValueError, match="not registered"):
        resolve_reward_name("gsm8k", {"gsm8k": "nope"})


def test_a_run_loads_only_the_verifiers_its_data_and_config_name():
    """train/context.py: the scoring workers import what their verifiers need (math_verify,
    reasoning_gym, the code sandbox), so a run loads the ones its records resolve to plus those
    rewards.map or a verifier option names, not every registered one."""
    from brorl_jax.train.context import verifiers_for
    records = [{"data_source": "reasoning_gym/basic_arithmetic"}, {"data_source": "openai/gsm8k"},
               {"data_source": "reasoning_gym/leg_counting"}]
    assert verifiers_for(records, {}, {}) == ["final_number", "reasoning_gym"]
    assert verifiers_for(records, {"taco": "code"}, {"math": {"x": 1}}) == [
        "code", "final_number", "math", "reasoning_gym"]
    assert verifiers_for(records, {"openai/gsm8k": "math"}, {}) == ["math", "reasoning_gym"]
    with ScoringService(num_workers=1, rewards=["final_number"]) as service:
        assert service.verifiers == ["final_number"]
        out = service.score_batch([{"data_source": "openai/gsm8k", "ground_truth": "4"}],
                                  ["so #### 4"])
        assert out[0].score == 1.0


def test_bad_calls_are_clear_errors(test_verifiers):
    with pytest.raises(ValueError, match="not registered"):
        ScoringService(num_workers=1, rewards=["nope"])
    with pytest.raises(ValueError, match="num_workers"):
        ScoringService(num_workers=0)
    with ScoringService(num_workers=1, rewards=["echo"]) as svc:
        with pytest.raises(ValueError, match="same length"):
            svc.score_batch([_rec("echo")], [])
        with pytest.raises(ValueError, match="no verifier for data_source"):
            svc.score_batch([_rec("math")], ["1"])  # math not loaded in this service


def test_public_score_with_a_mixed_batch():
    records = [_rec("math", "\\frac{1}{2}"), _rec("math", "2"), _rec("gsm8k", "7"),
               {"data_source": "code", "ground_truth": {"inputs": ["2\n"], "outputs": ["4"]}}]
    completions = ["\\boxed{0.5}", "\\boxed{3}", "#### 7",
                   "```python\nprint(int(input()) * 2)\n```"]
    scores = score(records, completions, timeout_s=20.0, reward_map={"gsm8k": "math"},
                   reward_options={"math": {"final_answer_pattern": r"####\s*(\S+)"}},
                   num_workers=2)
    assert scores == [1.0, 0.0, 1.0, 1.0]


def test_score_never_hides_a_verifier_error(caplog):
    """issue 26.5: a record without a ground truth scores 0 and says why (a warning counted per
    data source, ScoringError with raise_on_error, every reason from score_results)."""
    from brorl_jax.rewards import ScoringError, score_results
    records = [{"data_source": "math", "ground_truth": "1"}, {"data_source": "math"}]
    completions = ["\\boxed{1}", "\\boxed{1}"]
    with ScoringService(num_workers=1, timeout_s=20.0, rewards=["math"]) as svc:
        with caplog.at_level("WARNING", logger="brorl_jax.rewards.service"):
            assert score(records, completions, service=svc) == [1.0, 0.0]
        assert "1 of 2 records could not be judged" in caplog.text
        assert "data source 'math': 1 of 2 not judged (1 error)" in caplog.text
        assert "records[1]: verifier error: ValueError: math record is missing " \
               "'ground_truth'" in caplog.text
        with pytest.raises(ScoringError) as err:
            score(records, completions, service=svc, raise_on_error=True)
        assert err.value.failures[0][:2] == (1, "math")
        assert [r.score for r in err.value.results] == [1.0, 0.0]
        results = score_results(records, completions, service=svc)
        assert results[0].reason == "correct"
        assert results[1].reason.startswith("verifier error: ValueError")
        assert results[1].details["verifier"] == "math" and results[1].details["seconds"] >= 0

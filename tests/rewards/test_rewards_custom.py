"""rewards.custom: a veRL compute_score file scored in the workers, checked at the door."""
import os

import ml_collections
import pytest
from testutil import ROOT, run_main

from brorl_jax.config import default_config, validate
from brorl_jax.errors import ConfigError
from brorl_jax.rewards import ScoringService, custom
from brorl_jax.rewards.health import VerifierHealth
from brorl_jax.rewards.registry import REWARDS

HERE = os.path.dirname(os.path.abspath(__file__))
SCORERS = os.path.join(HERE, "verl_style_scorers.py")


def _rewards_cfg(fn, **over) -> ml_collections.ConfigDict:
    c = default_config().rewards
    c.custom = f"{SCORERS}:{fn}"
    for k, v in over.items():
        c[k] = v
    return c


def _rec(truth, source="my_set"):
    return {"data_source": source, "ground_truth": truth}


@pytest.fixture
def service_for():
    made = []

    def make(cfg, **kw):
        reward_map, options = custom.setup(cfg, {})
        svc = ScoringService(num_workers=kw.pop("num_workers", 1),
                             timeout_s=kw.pop("timeout_s", 10),
                             rewards=[custom.NAME], reward_map=reward_map,
                             reward_options=options, **kw)
        made.append(svc)
        return svc, reward_map, options
    yield make
    for svc in made:
        svc.close()
    REWARDS.pop(custom.NAME, None)


def test_float_and_dict_returns_score_and_extra_fields_are_logged(service_for):
    svc, _, _ = service_for(_rewards_cfg("compute_score"))
    records = [_rec("3"), _rec("3"), _rec("4"), _rec("4")]
    completions = ["<answer>3</answer>", "<answer>5</answer>", "<answer>4</answer>", "x"]
    results = svc.score_batch(records, completions)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    health = VerifierHealth()
    health.add(records, results)
    m = health.metrics()
    assert m["reward_extra/my_set/acc"] == 0.5          # the dict rows' mean
    assert m["verifier/my_set/failed_frac"] == 0.0
    assert m["verifier_cost/my_set/custom/failures"] == 0
    assert m["verifier_cost/my_set/custom/time_s_total"] > 0


def test_raise_text_nan_and_timeout_are_failures_counted_per_source(service_for):
    for fn, reason in [("flaky_compute_score", "verifier error: ValueError: cannot grade"),
                       ("returns_text", "verifier error: TypeError: returned str"),
                       ("returns_nan", "verifier error: ValueError: returned a non-finite"),
                       ("returns_beyond_float32",
                        "verifier error: ValueError: returned 1e+300, beyond float32")]:
        svc, _, _ = service_for(_rewards_cfg(fn))
        records = [_rec("1")] * 3
        results = svc.score_batch(records, ["<answer>1</answer>"] * 3)
        failed = [r for r in results if r.score == 0.0]
        assert failed and all(r.reason.startswith(reason) for r in failed), (fn, results)
        health = VerifierHealth()
        health.add(records, results)
        assert health.metrics()["verifier/my_set/error_frac"] == len(failed) / 3
        assert health.metrics()["verifier_cost/my_set/custom/failures"] == len(failed)
    svc, _, _ = service_for(_rewards_cfg("slow"), timeout_s=1.0)
    (result,) = svc.score_batch([_rec("1")], ["1"])
    assert result.score == 0.0 and result.reason == "timeout after 1s"


def test_scores_keep_their_scale_and_reward_kwargs_reach_the_function(service_for):
    svc, _, _ = service_for(_rewards_cfg("scaled", custom_kwargs='{"scale": 2.0}'))
    results = svc.score_batch([_rec("1"), _rec("1")], ["1", "2"])
    assert [r.score for r in results] == [2.0, -2.0]


def test_sources_pattern_and_rewards_map_precedence():
    cfg = _rewards_cfg("compute_score", custom_sources="mine_*, other")
    try:
        reward_map, _ = custom.setup(cfg, {"mine_b": "math"})
        from brorl_jax.rewards.registry import resolve_reward_name
        assert resolve_reward_name("mine_a", reward_map) == "custom"
        assert resolve_reward_name("other", reward_map) == "custom"
        assert resolve_reward_name("mine_b", reward_map) == "math"       # rewards.map wins
        assert resolve_reward_name("math", reward_map) == "math"
    finally:
        REWARDS.pop(custom.NAME, None)


def test_batched_form_chunks_concurrency_and_batch_timeout(service_for):
    cfg = _rewards_cfg("batch_score", custom_batched=True, custom_batch_size=3,
                       custom_concurrency=1, custom_batch_timeout_s=2.0)
    svc, _, _ = service_for(cfg, num_workers=2)
    records = [_rec("1")] * 7
    results = svc.score_batch(records, ["1", "2", "1", "1", "text", "1", "1"])
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert results[0].details["extra"] == {"batch": 3.0}     # chunks of 3, 3 and 1
    assert results[6].details["extra"] == {"batch": 1.0}
    assert results[4].reason.startswith("verifier error: batch_score returned str")
    # a raise fails its chunk only; a hung chunk times out as a chunk
    results = svc.score_batch(records[:6], ["1", "raise", "1", "1", "1", "1"])
    assert [r.score for r in results] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert results[0].reason == "verifier error: RuntimeError: judge unavailable"
    results = svc.score_batch(records[:6], ["1", "1", "1", "sleep", "1", "1"])
    assert [r.score for r in results[:3]] == [1.0] * 3
    assert all(r.reason == "timeout after 2s (batch)" for r in results[3:])


def test_what_a_reward_function_prints_is_capped(service_for, capfd):
    """A reward function printing 100 kB a call: 30 calls (3 MB) reach the console as at most
    OUTPUT_LIMIT characters per worker and one line saying the rest is dropped."""
    from brorl_jax.rewards._worker import OUTPUT_LIMIT
    svc, _, _ = service_for(_rewards_cfg("prints_a_lot"), num_workers=1)
    capfd.readouterr()
    results = svc.score_batch([_rec("1")] * 30, ["1"] * 30)
    assert [r.score for r in results] == [0.0] * 30 and all(r.reason == "custom" for r in results)
    out, err = capfd.readouterr()
    assert OUTPUT_LIMIT <= len(out) + len(err) < OUTPUT_LIMIT + 200
    assert "beyond 65536 characters is dropped" in out + err


def test_door_check_names_what_is_wrong():
    records = [_rec("1")]
    try:
        for fn, match in [("missing", "has no function 'missing'.*compute_score"),
                          ("wrong_signature", "does not take veRL's reward arguments"),
                          ("returns_text", "failed on the first row it scores.*returned str"),
                          ("returns_beyond_float32", "first row.*beyond float32")]:
            cfg = _rewards_cfg(fn)
            reward_map, options = custom.setup(cfg, {})
            with pytest.raises(custom.CustomRewardError, match=match):
                custom.door_check(cfg, reward_map, options, records)
        cfg = _rewards_cfg("compute_score", custom_sources="nothing_*")
        reward_map, options = custom.setup(cfg, {})
        with pytest.raises(custom.CustomRewardError, match="scores no record"):
            custom.door_check(cfg, reward_map, options, records)
        cfg = _rewards_cfg("compute_score")
        reward_map, options = custom.setup(cfg, {})
        note = custom.door_check(cfg, reward_map, options, records)
        assert "gave 1" in note
    finally:
        REWARDS.pop(custom.NAME, None)


def test_config_refuses_a_missing_file_and_a_bad_spec():
    c = default_config()
    c.rewards.custom = "no/such/file.py:compute_score"
    with pytest.raises(ConfigError, match="rewards.custom.*no file"):
        validate(c)
    c.rewards.custom = "scorer.txt"
    with pytest.raises(ConfigError, match="path/to/file.py:fn"):
        validate(c)
    c.rewards.custom = f"{SCORERS}:compute_score"
    c.rewards.custom_concurrency = 0
    with pytest.raises(ConfigError, match="custom_concurrency"):
        validate(c)


def test_example_file_is_a_plain_verl_scorer():
    import importlib.util
    path = os.path.join(ROOT, "examples", "verl_compute_score.py")
    spec = importlib.util.spec_from_file_location("example_scorer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "brorl_jax" not in open(path).read().split('"""', 2)[2]   # no import of ours
    assert mod.compute_score("gsm8k", "so #### 1,234", "1234")["score"] == 1.0
    assert mod.compute_score("x", "<answer>7</answer>", "8") == {"score": 0.0, "acc": 0.0,
                                                                 "format_ok": 1.0}
    assert [r["score"] for r in mod.compute_score_batch(
        ["a", "b"], ["<answer>1</answer>", "none"], ["1", "1"])] == [1.0, 0.0]


def test_a_verl_scorer_runs_unchanged_through_main(tmp_path, tiny_warm_start):
    """issue 27's goal: a veRL-style file (float and dict returns, a raise every third call)
    drives `main` on configs/tiny.py; the raises are counted per data source, not fatal."""
    import json
    out = run_main(tmp_path / "run", "--config.train.steps=1", "--config.train.tensorboard=False",
                   "--config.rewards.custom=tests/rewards/verl_style_scorers.py:flaky_compute_score",
                   *tiny_warm_start)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "[rewards] rewards.custom tests/rewards/verl_style_scorers.py:flaky_compute_score " \
           "scores *" in out.stdout
    assert "-> custom" in out.stdout                     # the [data] verifiers line
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x.strip()]
    step1 = [x for x in lines if x["step"] == 1][-1]
    source = "reasoning_gym/basic_arithmetic"
    assert 0 < step1[f"verifier/{source}/error_frac"] < 1
    assert step1[f"verifier_cost/{source}/custom/failures"] > 0
    assert step1[f"verifier_cost/{source}/custom/time_s_mean"] > 0
    assert 0 <= step1[f"reward_extra/{source}/acc"] <= 1    # the dict rows' extra field


def test_a_reward_function_failing_on_every_sample_is_told_to_fix_the_function(service_for):
    """A function that raises on completions without its answer tag: the stop names the
    function, not the ground truths' format (the built-in verifiers' fix)."""
    from brorl_jax.rewards.health import VerifierFailure
    svc, _, _ = service_for(_rewards_cfg("raises_on_real_completions"))
    records = [_rec("1")] * 4
    health = VerifierHealth()
    health.add(records, svc.score_batch(records, ["the answer is 1"] * 4))
    with pytest.raises(VerifierFailure, match=r"reward function of rewards.custom raised.*"
                                              r"returning 0 rather than raising"):
        health.check("step 1")

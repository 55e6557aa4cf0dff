"""The plateau experiment (issue 44): its arms' shapes, its statistics, and a smoke run of the whole
command at tiny sizes writing the public plateau.json."""
import json
import math

import numpy as np
import pytest

from brorl_jax.config import derived_learning_rate, validate
from brorl_jax.errors import ConfigError
from brorl_jax.experiments import plateau
from configs import demo, tiny

OPTS = {"seeds": ["0", "1"], "n_prorl": 16, "prompts": 16, "n_brorl": 512, "batch_ratio": 8,
        "plateau_steps": 300, "plateau_eval_every": 20, "plateau_window": 6, "budget": 32_768,
        "eval_prompts": 200, "eval_k": 16, "knapsack_probe": 8,
        "ablations": ["brorl_prorl_lr", "knapsack_prorl_lr"]}


def test_arms_follow_the_paper_shape_budget_and_sqrt_learning_rate():
    base = demo.get_config()
    cfgs = {arm: validate(plateau.arm_config(base, arm, "/start", OPTS)) for arm in plateau.ARMS}
    pro, bro, ada = cfgs["prorl"], cfgs["brorl"], cfgs["adaptive"]
    assert (pro.rollout.rollouts_per_prompt, pro.algo.prompts_per_step) == (16, 16)
    assert (bro.rollout.rollouts_per_prompt, bro.algo.prompts_per_step) == (512, 4)
    assert bro.update_rows == 8 * pro.update_rows          # 8x the samples per update
    lr = {a: derived_learning_rate(c)[0] for a, c in cfgs.items()}
    assert lr["brorl"] / lr["prorl"] == pytest.approx(math.sqrt(8))
    assert lr["adaptive"] == lr["brorl"]
    assert ada.rollout.adaptive_n and ada.rollout.adaptive_n_buckets == "256,512,768"
    assert not pro.rollout.adaptive_n and not bro.rollout.adaptive_n
    kn = cfgs["knapsack"]       # brorl's rows and learning rate, 16x its prompts at mean N 32
    assert (kn.rollout.rollouts_per_prompt, kn.algo.prompts_per_step) == (32, 64)
    assert kn.rollout.knapsack and not bro.rollout.knapsack and lr["knapsack"] == lr["brorl"]
    assert (kn.rollout.knapsack_probe, kn.rollout.knapsack_chunk, kn.rollout.knapsack_max_n) == \
        (8, 8, 256)
    for c in cfgs.values():
        assert c.algo.ppo_mini_batches == base.algo.ppo_mini_batches
        assert c.train.sample_budget == 32_768 and c.model.path == "/start"
        assert c.train.steps * c.update_rows > c.train.sample_budget   # the budget stops first
        assert c.eval.samples_per_prompt == 16 and c.sft.steps == 0
    ablation = validate(plateau.arm_config(base, "brorl_prorl_lr", "/start", OPTS))
    assert ablation.update_rows == bro.update_rows and not ablation.rollout.adaptive_n
    assert derived_learning_rate(ablation)[0] == pytest.approx(lr["prorl"])
    ablation = validate(plateau.arm_config(base, "knapsack_prorl_lr", "/start", OPTS))
    assert ablation.update_rows == kn.update_rows and ablation.rollout.knapsack
    assert derived_learning_rate(ablation)[0] == pytest.approx(lr["prorl"])
    p = validate(plateau.plateau_config(base, "/warm", OPTS))
    assert (p.rollout.rollouts_per_prompt, p.algo.prompts_per_step, p.train.steps) == (16, 16, 300)
    assert derived_learning_rate(p)[0] == lr["prorl"]


def test_slope_interval_and_bootstrap_difference():
    line = plateau.slope_ci([0, 1, 2, 3], [1.0, 1.5, 2.0, 2.5], per=10)
    assert line["slope"] == pytest.approx(5.0) and line["ci95"] == pytest.approx([5.0, 5.0])
    rng = np.random.default_rng(0)
    flat = plateau.slope_ci(np.arange(8), 0.4 + 0.05 * rng.standard_normal(8))
    assert flat["ci95"][0] < 0 < flat["ci95"][1]
    assert plateau.slope_ci([0, 1, 2], [0.3, 0.3, 0.3]) == {"slope": 0.0, "ci95": [0.0, 0.0],
                                                          "points": 3}   # held 0: a plateau
    rising = plateau.slope_ci(np.arange(8), 0.1 * np.arange(8) + 0.01 * rng.standard_normal(8))
    assert rising["ci95"][0] > 0.08
    same = plateau.bootstrap_diff([0.5, 0.5, 0.5], [0.3, 0.3])
    assert same == {"mean": pytest.approx(0.2), "ci95": pytest.approx([0.2, 0.2])}
    apart = plateau.bootstrap_diff([0.50, 0.52, 0.51, 0.53, 0.49], [0.40, 0.41, 0.39, 0.42, 0.38])
    assert 0 < apart["ci95"][0] < apart["mean"] < apart["ci95"][1]
    overlap = plateau.bootstrap_diff([0.3, 0.5, 0.4, 0.6, 0.2], [0.35, 0.45, 0.4, 0.5, 0.3])
    assert overlap["ci95"][0] < 0 < overlap["ci95"][1]


def test_aggregate_and_table_over_seeds():
    run = lambda p0, p1: {"pass1_start": p0, "pass1_end": p1, "pass_at_k_start": {"1": p0},
                          "pass_at_k_end": {"1": p1, "16": p1 + 0.3}, "generated_samples": 640,
                          "steps": 5, "samples_per_s": 100.0, "wall_s": 9.0,
                          "samples_per_s_median_step": 120.0,
                          "dynamic_sampling_pass_rate": 0.5}
    arms = {"prorl": {"0": run(0.4, 0.42), "1": run(0.4, 0.44)},
            "brorl": {"0": run(0.4, 0.5), "1": run(0.4, 0.52)},
            "adaptive": {"0": run(0.4, 0.46), "1": run(0.4, 0.46)}}
    agg = plateau.aggregate(arms)
    assert agg["diff_brorl_minus_prorl"]["mean"] == pytest.approx(0.08)
    assert agg["diff_brorl_minus_prorl"]["ci95"] == pytest.approx([0.06, 0.10])
    assert agg["diff_adaptive_minus_prorl"]["mean"] == pytest.approx(0.03)
    assert agg["diff_adaptive_minus_brorl"]["mean"] == pytest.approx(-0.05)
    md = plateau.table({"arms": arms, **agg})
    assert "| brorl | 2 | 0.400 ± 0.000 | 0.510 ± 0.010 | 0.810 ± 0.010 | 0.500 ± 0.000 | 640 |" in md
    assert "brorl minus prorl: end pass@1 +0.080, 95% bootstrap interval [+0.060, +0.100]" in md


def test_options_refuse_bad_flags_and_quick_sets_tiny_sizes():
    values = {f.name: f.default for f in plateau.FLAGS}
    assert plateau.options(values)["n_brorl"] == 512
    quick = plateau.options({**values, "quick": True})
    assert quick["seeds"] == ["0", "1"] and quick["plateau_steps"] == plateau.QUICK["plateau_steps"]
    assert quick["ablations"] == [] and plateau.options(values)["ablations"] == list(
        plateau.ABLATIONS)
    assert plateau.options({**values, "quick": True, "budget": 7})["budget"] == 7  # flag wins
    for bad, word in (({"seeds": []}, "--seeds"), ({"seeds": ["x"]}, "--seeds"),
                      ({"n_brorl": 100}, "--n_brorl"), ({"plateau_window": 2}, "--plateau_window"),
                      ({"budget": 0}, "--budget"), ({"ablations": ["x"]}, "--ablations"),
                      ({"knapsack_probe": 3}, "--knapsack_probe")):
        with pytest.raises(ConfigError, match=word):
            plateau.options({**values, **bad})


def test_the_whole_experiment_at_tiny_sizes_writes_the_public_json(tmp_path, tiny_warm_start,
                                                                   monkeypatch):
    """Every phase runs: the plateau from the warm start, each arm to its sample budget (not its
    step cap), the differences with their intervals, the table and the plot. One seed keeps it
    under a minute; the statistics over seeds are tested above. The adaptive arm is left out
    (suite time): with no prompt recurring it is the brorl arm run for run, and its config is
    checked above."""
    monkeypatch.setattr(plateau, "ARMS", tuple(a for a in plateau.ARMS if a != "adaptive"))
    base = tiny.get_config()
    base.model.path = tiny_warm_start[0].split("=", 1)[1]
    base.sft.steps = 0
    base.train.tensorboard = False
    base.algo.max_generation_rounds = 1
    opts = {"seeds": ["0"], "n_prorl": 4, "prompts": 2, "n_brorl": 8, "batch_ratio": 2,
            "plateau_steps": 2, "plateau_eval_every": 1, "plateau_window": 3, "budget": 24,
            "eval_prompts": 4, "eval_k": 4, "knapsack_probe": 2, "ablations": []}
    out = tmp_path / "plateau"
    plateau.run(validate(base), str(out), opts, command="test")
    result = json.loads((out / "plateau.json").read_text())
    assert result["seeds"] == [0] and set(result["arms"]) == set(plateau.ARMS)
    for arm, runs in result["arms"].items():
        assert set(runs) == {"0"}
        for r in runs.values():
            assert 24 <= r["generated_samples"] < 24 + 3 * 16, (arm, r)   # stopped by the budget
            assert set(r["pass_at_k_end"]) == {"1", "2", "4"}
            assert r["pass_at_k_end"]["1"] == r["pass1_end"]
            assert 0 <= r["pass1_start"] <= 1 and r["samples_per_s"] > 0 and r["wall_s"] > 0
            assert r["samples_per_s_median_step"] > 0
    for key in ("diff_brorl_minus_prorl", "diff_knapsack_minus_prorl"):
        lo, hi = result[key]["ci95"]
        assert lo <= result[key]["mean"] <= hi
    ends = {a: np.mean([r["pass1_end"] for r in result["arms"][a].values()]) for a in result["arms"]}
    assert result["diff_brorl_minus_prorl"]["mean"] == pytest.approx(ends["brorl"] - ends["prorl"])
    assert len(result["plateau"]["evals"]) == 3            # before, then after each step
    assert (out / "plateau.png").stat().st_size > 0
    assert "| brorl | 1 |" in (out / "plateau.md").read_text()
    plateau.run(validate(base), str(out), opts, command="test")   # finished runs are not redone
    assert json.loads((out / "plateau.json").read_text())["arms"] == result["arms"]

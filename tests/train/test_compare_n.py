"""The N=16 vs N=512 experiment's arms: equal samples per update, equal budget, same start."""
from brorl_jax.config import derived_learning_rate, validate
from brorl_jax.experiments.compare_n import arm_config, summarize_arm
from configs import demo


def test_arms_share_batch_budget_and_learning_rate():
    base = demo.get_config()
    rows = base.algo.prompts_per_step * base.rollout.rollouts_per_prompt
    arms = [arm_config(base, n, rows, samples=16384, evals=3, model_path="/warm") for n in (16, 512)]
    for n, cfg in zip((16, 512), arms):
        validate(cfg)
        assert cfg.rollout.rollouts_per_prompt == n
        assert cfg.algo.prompts_per_step * n == rows
        assert cfg.model.path == "/warm" and cfg.sft.steps == 0
    assert arms[0].train.steps == arms[1].train.steps
    assert derived_learning_rate(arms[0])[0] == derived_learning_rate(arms[1])[0]


def test_summarize_arm_reads_eval_points_and_pass_rates():
    records = [{"step": 0, "eval/pass@1": 0.2, "eval/pass@4": 0.5, "eval/pass@16": 0.6},
               {"step": 1, "counters/generated_samples": 100, "dynamic_sampling/pass_rate": 0.5},
               {"step": 2, "counters/generated_samples": 200, "dynamic_sampling/pass_rate": 0.7,
                "eval/pass@1": 0.3, "eval/pass@4": 0.55, "eval/pass@16": 0.8}]
    out = summarize_arm(records)
    assert out["eval"] == [(0, 0.2), (200, 0.3)]
    assert out["eval_k"] == [(0, 16, 0.6), (200, 16, 0.8)]
    assert out["mean_pass_rate"] == (0.5 + 0.7) / 2


def test_table_spans_seeds_and_start_model_skips_a_zero_step_warm_start(tmp_path):
    from brorl_jax.experiments.compare_n import start_model, table, write

    run = lambda a, b, r: {"eval": [(0, a), (640, b)], "pass_rate": [(64, r)],
                           "mean_pass_rate": r, "correct_frac": [(64, a), (640, b)]}
    results = {16: {0: run(0.1, 0.3, 0.4), 1: run(0.1, 0.5, 0.6)}, 64: {0: run(0.1, 0.2, 0.9)}}
    md = table(results)
    assert "| N = 16 | 2 | 0.100 [0.100, 0.100] | 0.400 [0.300, 0.500] | 0.500 [0.400, 0.600]" in md
    assert "| N = 64 | 1 | 0.100 | 0.200 | 0.900 | 0.100 -> 0.200 | 640 |" in md
    assert "pass@16" not in md           # no run has pass@k points
    for runs in results.values():
        for r in runs.values():
            r["eval_k"] = [(0, 16, 0.25), (640, 16, r["eval"][-1][1] + 0.25)]
    md_k = table(results)
    assert "| generated samples | held-out pass@16 start -> end |" in md_k
    assert "| 640 | 0.250 [0.250, 0.250] -> 0.650 [0.550, 0.750] |" in md_k
    assert "| 640 | 0.250 -> 0.450 |" in md_k
    write(results, str(tmp_path))
    assert (tmp_path / "compare_n.png").stat().st_size > 0
    assert (tmp_path / "compare_n.md").read_text().strip() == md_k
    base = demo.get_config()
    base.sft.steps, base.model.path = 0, "builtin:smollm2-135m-instruct"
    assert start_model(base, str(tmp_path)) == "builtin:smollm2-135m-instruct"
    assert not (tmp_path / "warm_start").exists()

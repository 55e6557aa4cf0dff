"""The paper's comparison, small: N=16 vs N=512 at the same number of generated samples.

  python -m brorl_jax.experiments.compare_n --out=runs/compare_n [--samples=65536]
      [--config=configs/demo.py] [--n=16,512] [--config.key=value ...]

1. One supervised warm start (the demo's) is run once and saved as a Hugging Face directory, so
   both arms start from the same parameters, as BroRL and its ProRL baseline both continue the
   same ProRLv2 checkpoint [BroRL 4.2.1].
2. Each arm runs BroRL with its N. Prompts per step are chosen so both arms put the same number
   of samples into each update (prompts_per_step x N = constant, the 128 x 512 vs 512 x 16 shape
   of the paper scaled down) and the learning rate follows the sqrt batch rule, which then gives
   both arms the same rate. Steps are chosen so each arm generates about `--samples` samples
   before filtering; evaluation runs at fixed fractions of that budget.
3. Held-out pass@1 and the dynamic-sampling pass rate are plotted against generated samples for
   both arms (compare_n.png) and tabulated (compare_n.json).
"""
from __future__ import annotations

import json
import math
import os

from brorl_jax import cli

FLAGS = [cli.Flag("string", "out", "runs/compare_n", "Output directory."),
         cli.Flag("list", "n", ["16", "512"], "Rollouts per prompt of the arms."),
         cli.Flag("integer", "samples", 65536, "Generated samples per arm (before filtering)."),
         cli.Flag("integer", "evals", 4, "Evaluations per arm after the start.")]


def arm_config(base, n: int, rows: int, samples: int, evals: int, model_path: str):
    """The config of one arm: N = n, prompts_per_step = rows / n, steps from the sample budget."""
    cfg = base.copy_and_resolve_references()
    if rows % n:
        raise ValueError(f"update rows {rows} must be divisible by N={n}.")
    cfg.rollout.rollouts_per_prompt = n
    cfg.algo.prompts_per_step = rows // n
    cfg.algo.micro_batch_size = math.gcd(cfg.algo.micro_batch_size, rows)
    per_step = math.ceil(rows * cfg.algo.generation_batch_multiplier)
    cfg.train.steps = max(1, samples // per_step)
    cfg.eval.every = max(1, cfg.train.steps // evals)
    cfg.model.path = model_path
    cfg.sft.steps = 0
    cfg.train.plots = False
    cfg.algo.dynamic_sampling_cap_policy = "pad"   # a round cap must not end an arm early
    return cfg


def run(base, out: str, ns: list[int], samples: int, evals: int) -> dict:
    from brorl_jax.train.logger import read_metrics
    from brorl_jax.train.loop import Trainer

    os.makedirs(out, exist_ok=True)
    warm_dir = os.path.join(out, "warm_start_model")
    if not os.path.isdir(warm_dir):
        warm = base.copy_and_resolve_references()
        warm.train.steps = 0
        warm.train.plots = False
        trainer = Trainer(warm, os.path.join(out, "warm_start"))
        try:
            result = trainer.run()
            from brorl_jax import models
            models.save_pretrained(trainer.model.with_params(result.state.params), warm_dir)
        finally:
            trainer.close()
    rows = base.algo.prompts_per_step * base.rollout.rollouts_per_prompt
    results = {}
    for n in ns:
        cfg = arm_config(base, n, rows, samples, evals, warm_dir)
        workdir = os.path.join(out, f"n{n}")
        trainer = Trainer(cfg, workdir)
        try:
            trainer.run()
        finally:
            trainer.close()
        records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
        results[n] = summarize_arm(records)
    with open(os.path.join(out, "compare_n.json"), "w") as f:
        json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    plot(results, os.path.join(out, "compare_n.png"))
    return results


def summarize_arm(records: list[dict]) -> dict:
    """Eval points (generated samples, pass@1) and per-step pass rates of one arm's metrics."""
    evals, rates = [], []
    for r in records:
        samples = r.get("counters/generated_samples", 0)
        if r.get("eval/pass@1") is not None:
            evals.append((samples, r["eval/pass@1"]))
        if r.get("dynamic_sampling/pass_rate") is not None:
            rates.append((samples, r["dynamic_sampling/pass_rate"]))
    mean_rate = sum(v for _, v in rates) / len(rates) if rates else float("nan")
    return {"eval": evals, "pass_rate": rates, "mean_pass_rate": mean_rate}


def plot(results: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    for n, r in results.items():
        if r["eval"]:
            xs, ys = zip(*r["eval"])
            ax1.plot(xs, ys, marker="o", label=f"N={n}")
        if r["pass_rate"]:
            xs, ys = zip(*r["pass_rate"])
            ax2.plot(xs, ys, marker=".", label=f"N={n} (mean {r['mean_pass_rate']:.2f})")
    ax1.set_title("held-out pass@1")
    ax2.set_title("dynamic-sampling pass rate")
    for ax in (ax1, ax2):
        ax.set_xlabel("generated samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(values: dict) -> int:
    results = run(values["config"], values["out"], [int(n) for n in values["n"]],
                  values["samples"], values["evals"])
    for n, r in results.items():
        first, last = r["eval"][0][1], r["eval"][-1][1]
        print(f"N={n}: pass@1 {first:.3f} -> {last:.3f}, mean dynamic-sampling pass rate "
              f"{r['mean_pass_rate']:.2f}")
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS)

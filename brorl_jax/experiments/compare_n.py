"""The paper's comparison, small: N=16 vs N=512 at the same number of generated samples.

  python -m brorl_jax.experiments.compare_n --out=runs/compare_n [--samples=65536]
      [--config=configs/demo.py] [--n=16,512] [--seeds=0,1,2] [--config.key=value ...]

The hard-prompt regime the paper's claim is about (a start at held-out pass@1 of a few percent):
``--config=configs/smollm2_arith.py:digits=3`` (SmolLM2-135M-Instruct on 3-digit additions, 0.023
held-out; docs/results.md "Breadth on a real model" has the command and its results).

1. Both arms start from the same parameters, as BroRL and its ProRL baseline both continue the
   same ProRLv2 checkpoint [BroRL 4.2.1]: with a supervised warm start in the config
   (sft.steps > 0, the demo's) it is run once and saved as a Hugging Face directory; with
   sft.steps = 0 (a pretrained model, e.g. configs/smollm2_arith.py) the config's model.path.
2. Each arm runs BroRL with its N, once per seed (train.seed: rollout sampling and the update's
   randomness; the prompt order, data.seed, is the same for every run). Prompts per step are
   chosen so both arms put the same number of samples into each update
   (prompts_per_step x N = constant, the 128 x 512 vs 512 x 16 shape of the paper scaled down)
   and the learning rate follows the sqrt batch rule, which then gives both arms the same rate.
   Steps are chosen so each arm generates about `--samples` samples before filtering;
   evaluation runs at fixed fractions of that budget.
3. Held-out pass@1, the dynamic-sampling pass rate (groups with mixed rewards) and the training
   samples' correct fraction per step, for every run (compare_n.json), plotted against generated
   samples (compare_n.png) and summed up over seeds as mean, min and max (compare_n.md).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from brorl_jax import cli

FLAGS = [cli.Flag("string", "out", "runs/compare_n", "Output directory."),
         cli.Flag("list", "n", ["16", "512"], "Rollouts per prompt of the arms."),
         cli.Flag("integer", "samples", 65536, "Generated samples per arm (before filtering)."),
         cli.Flag("integer", "evals", 4, "Evaluations per arm after the start."),
         cli.Flag("list", "seeds", ["0"], "train.seed of each run of each arm.")]


def arm_config(base, n: int, rows: int, samples: int, evals: int, model_path: str):
    """The config of one arm: N = n, prompts_per_step = rows / n, steps from the sample budget."""
    from brorl_jax.algo.policies import N_KEY
    from brorl_jax.errors import ConfigError
    cfg = base.copy_and_resolve_references()
    if rows % n:
        raise ConfigError(f"--n={n}: the update rows of the base config (algo.prompts_per_step x "
                          f"{N_KEY} = {rows}) must be divisible by every N.")
    section, key = N_KEY.split(".")
    cfg[section][key] = n
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


def start_model(base, out: str) -> str:
    """The parameters both arms start from: the config's supervised warm start, run once and
    saved under `out` (sft.steps > 0), else the config's model.path as it is."""
    if base.sft.steps == 0:
        return base.model.path
    from brorl_jax.train.loop import Trainer

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
    return warm_dir


def run(base, out: str, ns: list[int], samples: int, evals: int,
        seeds: list[int] = (0,)) -> dict:
    """{N: {seed: summarize_arm(...)}}, written out after every run (write())."""
    from brorl_jax.train.loop import Trainer
    from brorl_jax.workdir.logger import read_metrics

    os.makedirs(out, exist_ok=True)
    from brorl_jax.config import as_run_config
    model_path = start_model(base, out)
    rows = as_run_config(base).update_rows
    results: dict = {n: {} for n in ns}
    for seed in seeds:              # both arms of a seed before the next seed
        for n in ns:
            cfg = arm_config(base, n, rows, samples, evals, model_path)
            cfg.train.seed = int(seed)
            workdir = os.path.join(out, f"n{n}" if len(seeds) == 1 else f"n{n}_seed{seed}")
            trainer = Trainer(cfg, workdir)
            try:
                trainer.run()
            finally:
                trainer.close()
            records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
            results[n][int(seed)] = summarize_arm(records)
            write(results, out)        # after every run: a partial experiment is still readable
    return results


def write(results: dict, out: str) -> None:
    """compare_n.json (every run), compare_n.md (the table over seeds), compare_n.png."""
    with open(os.path.join(out, "compare_n.json"), "w") as f:
        json.dump({str(n): {str(s): r for s, r in runs.items()} for n, runs in results.items()},
                  f, indent=1)
    with open(os.path.join(out, "compare_n.md"), "w") as f:
        f.write(table(results) + "\n")
    plot(results, os.path.join(out, "compare_n.png"))


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def table(results: dict) -> str:
    """Markdown: per arm, over its seeds, mean [min, max] of held-out pass@1 at the start and
    the end, of the mean dynamic-sampling pass rate and of the training samples' correct
    fraction, the generated samples, and held-out pass@k at the start and the end (k the
    evaluation's samples per prompt, when every run has the same)."""
    ks = {e[1] for runs in results.values() for r in runs.values() for e in r.get("eval_k", [])}
    has_k = all(r.get("eval_k") for runs in results.values() for r in runs.values())
    k_col = f"held-out pass@{max(ks)} start -> end" if len(ks) == 1 and has_k else None
    lines = ["| arm | seeds | held-out pass@1 start | held-out pass@1 end | mean dynamic-sampling "
             "pass rate | training correct fraction, first -> last step | generated samples |"
             + (f" {k_col} |" if k_col else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if k_col else "")]
    for n, runs in results.items():
        rs = list(runs.values())
        if not rs:
            continue
        start = [r["eval"][0][1] for r in rs if r["eval"]]
        end = [r["eval"][-1][1] for r in rs if r["eval"]]
        rate = [r["mean_pass_rate"] for r in rs]
        first = [r["correct_frac"][0][1] for r in rs if r["correct_frac"]]
        last = [r["correct_frac"][-1][1] for r in rs if r["correct_frac"]]
        gen = [r["eval"][-1][0] for r in rs if r["eval"]]
        lines.append(f"| N = {n} | {len(rs)} | {_spread(start)} | {_spread(end)} | "
                     f"{_spread(rate)} | {_spread(first)} -> {_spread(last)} | "
                     f"{int(np.mean(gen)) if gen else 0:,} |"
                     + (f" {_spread([r['eval_k'][0][2] for r in rs if r.get('eval_k')])} -> "
                        f"{_spread([r['eval_k'][-1][2] for r in rs if r.get('eval_k')])} |"
                        if k_col else ""))
    return "\n".join(lines)


def summarize_arm(records: list[dict]) -> dict:
    """Eval points (generated samples, pass@1) and (samples, k, pass@k) for the largest k
    evaluated, per-step dynamic-sampling pass rates and per-step correct fractions of the
    generated samples, from one run's metrics."""
    evals, evals_k, rates, correct = [], [], [], []
    for r in records:
        samples = r.get("counters/generated_samples", 0)
        if r.get("eval/pass@1") is not None:
            evals.append((samples, r["eval/pass@1"]))
            ks = [int(k.split("@")[1]) for k in r if k.startswith("eval/pass@")]
            if max(ks) > 1:       # the largest k the evaluation has samples for
                evals_k.append((samples, max(ks), r[f"eval/pass@{max(ks)}"]))
        if r.get("dynamic_sampling/pass_rate") is not None:
            rates.append((samples, r["dynamic_sampling/pass_rate"]))
        if r.get("reward/correct_frac") is not None:
            correct.append((samples, r["reward/correct_frac"]))
    mean_rate = sum(v for _, v in rates) / len(rates) if rates else float("nan")
    return {"eval": evals, "eval_k": evals_k, "pass_rate": rates, "mean_pass_rate": mean_rate,
            "correct_frac": correct}


def plot(results: dict, path: str) -> None:
    """Held-out pass@1 (and pass@k, dashed) and the dynamic-sampling pass rate against generated
    samples; one line per run, one colour per arm."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    for k, (n, runs) in enumerate(results.items()):
        colour = f"C{k}"
        for j, r in enumerate(runs.values()):
            label = f"N={n}" if j == 0 else None
            if r["eval"]:
                xs, ys = zip(*r["eval"])
                ax1.plot(xs, ys, marker="o", color=colour, alpha=0.8, label=label)
            if r.get("eval_k"):
                xs, ks, ys = zip(*r["eval_k"])
                ax1.plot(xs, ys, marker="s", linestyle="--", color=colour, alpha=0.5,
                         label=f"N={n}, pass@{ks[0]}" if j == 0 else None)
            if r["pass_rate"]:
                xs, ys = zip(*r["pass_rate"])
                ax2.plot(xs, ys, marker=".", color=colour, alpha=0.8, label=label)
    ax1.set_title("held-out pass@1 (pass@k dashed), one line per seed")
    ax2.set_title("dynamic-sampling pass rate")
    for ax in (ax1, ax2):
        ax.set_xlabel("generated samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(values: dict) -> int:
    from brorl_jax.config import validate
    from brorl_jax.errors import ConfigError
    try:
        ns = [int(n) for n in values["n"]]
    except ValueError:
        raise ConfigError(f"--n must be comma-separated integers, got "
                          f"{','.join(values['n'])!r}.") from None
    if any(n < 2 for n in ns):
        raise ConfigError(f"--n: every N must be >= 2 (group baselines), got {ns}.")
    if values["samples"] < 1 or values["evals"] < 1:
        raise ConfigError("--samples and --evals must be >= 1.")
    try:
        seeds = [int(x) for x in values["seeds"]]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got "
                          f"{','.join(values['seeds'])!r}.") from None
    for flag, given in (("--n", ns), ("--seeds", seeds)):
        if not given:
            raise ConfigError(f"{flag} is empty; give at least one value, e.g. "
                              f"{flag}={'16,512' if flag == '--n' else '0,1,2'}.")
    base = validate(values["config"])
    rows = base.update_rows
    for n in ns:
        validate(arm_config(base, n, rows, values["samples"], values["evals"], ""))
    from brorl_jax.workdir.layout import check_writable, prepare
    prepare(values["out"])
    check_writable(values["out"])
    results = run(base, values["out"], ns, values["samples"], values["evals"], seeds)
    print(table(results))
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS, log_dirs=("out",))

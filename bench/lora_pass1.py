"""LoRA against full fine-tuning on a real model (issue 42): held-out pass@1 after the same RL
steps and samples, over seeds, on this CPU.

    python bench/lora_pass1.py [--out runs/lora_pass1] [--seeds 0,1,2] [--steps 4]
        [--arms full,lora_r8,lora_r1] [--lora_lr_ratio 10]

SmolLM2-135M-Instruct on configs/smollm2_arith.py's 2-digit additions (start: held-out pass@1
about 0.16), N = 16 x 4 prompts per step, `--steps` RL steps per run, the same prompts for every
run (data.seed), train.seed per seed. Arms:
  full     every parameter trained, lr = the config's 1e-5;
  lora_rR  rank R on all seven projections (alpha 32), lr = --lora_lr_ratio x the full lr:
           "LoRA without regret" (Schulman et al. 2025) finds LoRA's best learning rate about
           10x full fine-tuning's, the same at every rank with alpha fixed.
KL is off and pi_old is the rollout's own log-probs (as docs/results.md's compare_n runs on this
model, to fit CPU time). Held-out pass@1 and pass@4 on the config's 32 held-out prompts x 4
samples at T = 0.6, before and after. Each finished run is kept (OUT/<arm>_seed<s>/) and not
redone when the command runs again; writes OUT/lora_pass1.json and prints the table: per arm
the mean, standard error and range over seeds, and each LoRA arm's difference to full
fine-tuning with a 95% bootstrap interval over seeds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import write_result  # noqa: E402


def arm_config(arm: str, seed: int, steps: int, lora_lr_ratio: float):
    from brorl_jax.models import lora
    from configs import smollm2_arith
    cfg = smollm2_arith.get_config(f"n=16,prompts=4,steps={steps}")
    cfg.algo.kl_coef = 0.0
    cfg.algo.recompute_old_logprobs = False
    cfg.train.seed = seed
    cfg.train.tensorboard = False
    if arm != "full":
        cfg.model.lora_rank = int(arm.removeprefix("lora_r"))
        cfg.model.lora_alpha = 32.0
        cfg.model.lora_targets = ",".join(lora.TARGETS)
        cfg.optim.lr = cfg.optim.lr * lora_lr_ratio
    return cfg


def one_run(cfg, workdir: str) -> dict:
    from brorl_jax.config import validate
    from brorl_jax.train.loop import Trainer
    from brorl_jax.workdir.logger import read_metrics
    t0 = time.perf_counter()
    trainer = Trainer(validate(cfg), workdir)
    try:
        trainer.run()
    finally:
        trainer.close()
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    evals = [r for r in records if r.get("eval/pass@1") is not None]
    steps = [r for r in records if r.get("time/update_s") is not None]
    return {"pass1_start": evals[0]["eval/pass@1"], "pass1_end": evals[-1]["eval/pass@1"],
            "pass4_end": evals[-1].get("eval/pass@4"),
            "generated_samples": int(steps[-1]["counters/generated_samples"]),
            "update_s_median": float(np.median([r["time/update_s"] for r in steps[1:] or steps])),
            "wall_s": time.perf_counter() - t0}


def bootstrap_diff(a, b, draws: int = 10_000, seed: int = 0) -> dict:
    from brorl_jax.experiments.plateau import bootstrap_diff as diff
    return diff(a, b, draws, seed)


def table(runs: dict) -> str:
    lines = ["| arm | seeds | lr | pass@1 start | pass@1 end, mean ± s.e. [min, max] | pass@4 end "
             "| generated samples | update s (median step) |", "|---|---|---|---|---|---|---|---|"]
    for arm, by_seed in runs.items():
        rs = list(by_seed.values())
        if not rs:
            continue
        end = np.array([r["pass1_end"] for r in rs])
        se = end.std(ddof=1) / np.sqrt(len(end)) if len(end) > 1 else 0.0
        lines.append(f"| {arm} | {len(rs)} | {rs[0]['lr']:.0e} | "
                     f"{np.mean([r['pass1_start'] for r in rs]):.3f} | {end.mean():.3f} ± "
                     f"{se:.3f} [{end.min():.3f}, {end.max():.3f}] | "
                     f"{np.mean([r['pass4_end'] for r in rs]):.3f} | "
                     f"{np.mean([r['generated_samples'] for r in rs]):.0f} | "
                     f"{np.mean([r['update_s_median'] for r in rs]):.1f} |")
    full = [r["pass1_end"] for r in runs.get("full", {}).values()]
    for arm, by_seed in runs.items():
        if arm != "full" and full and by_seed:
            d = bootstrap_diff([r["pass1_end"] for r in by_seed.values()], full)
            lines.append(f"\n{arm} minus full: end pass@1 {d['mean']:+.3f}, 95% bootstrap "
                         f"interval [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/lora_pass1")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--arms", default="full,lora_r8,lora_r1")
    ap.add_argument("--lora_lr_ratio", type=float, default=10.0)
    args = ap.parse_args()
    from brorl_jax.experiments.plateau import compilation_cache
    os.makedirs(args.out, exist_ok=True)
    with compilation_cache(os.path.join(args.out, "jax_cache")):   # seeds share programs
        run_all(args)


def run_all(args) -> None:
    path = os.path.join(args.out, "lora_pass1.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    runs = old.get("runs", {})
    arms = [a for a in args.arms.split(",") if a]
    for seed in (int(s) for s in args.seeds.split(",")):      # every arm of a seed first
        for arm in arms:
            if str(seed) in runs.get(arm, {}):
                continue
            cfg = arm_config(arm, seed, args.steps, args.lora_lr_ratio)
            row = one_run(cfg, os.path.join(args.out, f"{arm}_seed{seed}"))
            row["lr"] = cfg.optim.lr
            runs.setdefault(arm, {})[str(seed)] = row
            write_result(path, "lora_pass1.py", {"steps": args.steps, "runs": runs})
            print(f"[lora_pass1] {arm} seed {seed}: {row}", flush=True)
    md = table(runs)
    with open(os.path.join(args.out, "lora_pass1.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()

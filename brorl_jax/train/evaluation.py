"""Held-out evaluation: pass@k with the unbiased estimator and mean@k; `evaluate(ctx, params,
step)` runs it on a run context's held-out prompts (training and `python -m brorl_jax.evaluate`).

pass@k for one prompt with n samples of which c are correct is 1 - C(n-c, k) / C(n, k)
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1), computed as a
numerically stable product. The paper evaluates pass@1 as the mean over 16 samples at
temperature 0.6, top-p 0.95 [BroRL App. D], which is what `mean@k` of binary rewards equals.
"""
from __future__ import annotations

import numpy as np

from brorl_jax.train.context import EVAL_SEED, merge_health
from brorl_jax.workdir.logger import progress


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples with c correct: 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}.")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got k={k}.")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> tuple[int, ...]:
    """The k of pass@k reported from n samples per prompt: 1, 2, 4, ... below n, and n."""
    return tuple(sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n}))


def summarize(rewards: np.ndarray, ks: tuple[int, ...], correct_threshold: float = 1.0) -> dict:
    """Metrics for rewards [G, n]: eval/pass@k (mean over prompts) and eval/mean@n."""
    rewards = np.asarray(rewards, dtype=np.float64)
    g, n = rewards.shape
    correct = (rewards >= correct_threshold).sum(axis=1)
    out = {f"eval/mean@{n}": float(rewards.mean()), "eval/num_prompts": g}
    for k in ks:
        if k <= n:
            out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    return out


# Samples per rollout call of an evaluation: its prompts go in chunks (prompts_per_call).
SAMPLES_PER_CALL = 4096


def prompts_per_call(k: int) -> int:
    """Prompts per rollout call of an evaluation at k samples per prompt."""
    return max(1, SAMPLES_PER_CALL // k)


def evaluate(ctx, params, step: int) -> dict:
    """pass@k / mean@k of `params` (the update's layout) on the context's held-out prompts at the
    evaluation's sampling settings (eval.*); each process evaluates an equal block of the
    prompts. A data source whose verifier failed on every sample raises VerifierError."""
    k = ctx.cfg.eval.samples_per_prompt
    runtime, prompts_all = ctx.runtime, ctx.eval_prompts
    sampling = ctx.eval_sampling()
    params = runtime.rollout_params(params, sampling.precision)
    procs, index = runtime.num_processes, runtime.process_index
    per = -(-len(prompts_all) // procs)
    first = per * index
    prompts = prompts_all[first:first + per]
    real = len(prompts)
    prompts = prompts + [prompts_all[0]] * (per - real)    # equal shapes everywhere
    rewards, healths = [], []
    chunk = prompts_per_call(k)
    bar = progress(total=len(prompts), desc=f"eval at step {step}: {k} samples per prompt",
                   unit="prompt", enabled=runtime.process_index == 0)
    try:
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            res = ctx.rollouts(params, [ids for ids, _ in part], n=k, sampling=sampling,
                               seed=EVAL_SEED + first + start)
            g, n, s = res.tokens.shape
            scored = ctx.scorer.score([r for _, r in part for _ in range(n)],
                                      res.tokens.reshape(g * n, s), res.lengths.reshape(g * n))
            rewards.append(scored.rewards.reshape(g, n))
            healths.append(scored.health)
            bar.update(len(part))
    finally:
        bar.close()
    ctx.check_health(merge_health(healths), f"the evaluation at step {step}")
    rewards = np.concatenate(rewards)
    reals = runtime.allgather_rows(np.asarray([real]))
    every = runtime.allgather_rows(rewards[None])
    rewards = np.concatenate([every[i][:reals[i]] for i in range(procs)])
    return summarize(rewards, pass_ks(k), ctx.cfg.algo.correct_threshold)

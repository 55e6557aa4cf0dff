"""Held-out evaluation: pass@k with the unbiased estimator and mean@k.

pass@k for one prompt with n samples of which c are correct is 1 - C(n-c, k) / C(n, k)
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1), computed as a
numerically stable product. The paper evaluates pass@1 as the mean over 16 samples at
temperature 0.6, top-p 0.95 [BroRL App. D], which is what `mean@k` of binary rewards equals.
"""
from __future__ import annotations

import numpy as np


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

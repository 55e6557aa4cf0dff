"""Monitoring named by the BroRL write-ups (not in the paper): diversity, effective update ratio,
reward entropy. Host-side numpy over one step's rollouts; cheap next to generation.

  path diversity      fraction of distinct completions in a group (1.0 = all N different)
  n-gram diversity    distinct n-grams / total n-grams over a group's responses (distinct-n)
  effective update    fraction of the step's samples whose advantage is non-zero after
    ratio             filtering (samples that move the policy)
  reward entropy      Shannon entropy (nats) of the empirical reward distribution of the step
"""
from __future__ import annotations

from collections import Counter

import numpy as np


def path_diversity(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per group: distinct responses / N. tokens [G, N, S], lengths [G, N] -> [G]."""
    g, n, _ = tokens.shape
    out = np.empty(g)
    for gi in range(g):
        seen = {tokens[gi, ni, :lengths[gi, ni]].tobytes() for ni in range(n)}
        out[gi] = len(seen) / n
    return out


def ngram_diversity(tokens: np.ndarray, lengths: np.ndarray, n: int = 3) -> np.ndarray:
    """Per group: distinct n-grams / all n-grams over its responses (1.0 when none repeat)."""
    g, samples, _ = tokens.shape
    out = np.ones(g)
    for gi in range(g):
        grams = Counter()
        for si in range(samples):
            seq = tokens[gi, si, :lengths[gi, si]].tolist()
            grams.update(tuple(seq[i:i + n]) for i in range(len(seq) - n + 1))
        total = sum(grams.values())
        if total:
            out[gi] = len(grams) / total
    return out


def effective_update_ratio(advantages: np.ndarray, sample_mask: np.ndarray,
                           atol: float = 1e-8) -> float:
    """Fraction of the batch's real samples with a non-zero advantage."""
    real = sample_mask.astype(bool)
    if not real.any():
        return 0.0
    return float((np.abs(advantages[real]) > atol).mean())


def reward_entropy(rewards: np.ndarray, decimals: int = 3) -> float:
    """Entropy (nats) of the rewards' empirical distribution (values rounded to `decimals`)."""
    _, counts = np.unique(np.round(np.asarray(rewards, np.float64).ravel(), decimals),
                          return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())

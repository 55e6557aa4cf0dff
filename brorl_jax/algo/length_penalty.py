"""Scheduled cosine length penalty (ProRLv2 write-up; BroRL does not say whether it was active).

    eta_len(t) = eta_min + 0.5 (eta_max - eta_min) (1 + cos(pi t / T_max))
    R' = R + lambda_len * eta_len(t)

t = response length, T_max = the context (response) limit: eta_max at t = 0 falling to eta_min at
t = T_max. The penalty is cycled: on for `on_steps` RL steps, then off for `off_steps` (ProRLv2's
example: 100 on, 500 off). eta_min, eta_max and lambda_len are not given anywhere; the defaults in
the run config (algo.length_penalty_*) are ours.
"""
from __future__ import annotations

import numpy as np


def cosine_length_reward(lengths, max_length: int, eta_min: float, eta_max: float) -> np.ndarray:
    """eta_len(t) for lengths [...] (ints) -> float32 [...]; lengths are clipped to [0, max_length]."""
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0; got {max_length}")
    t = np.clip(np.asarray(lengths, np.float64), 0, max_length)
    return (eta_min + 0.5 * (eta_max - eta_min) * (1.0 + np.cos(np.pi * t / max_length))).astype(np.float32)


def length_penalty_active(step: int, on_steps: int, off_steps: int) -> bool:
    """True during the "on" part of the on/off cycle (steps [0, on) of every on+off period)."""
    if on_steps <= 0:
        return False
    if off_steps <= 0:
        return True
    return (step % (on_steps + off_steps)) < on_steps


def apply_length_penalty(rewards, lengths, *, step: int, max_length: int,
                         algo_cfg) -> np.ndarray:
    """R' = R + lambda eta_len(t) when algo.length_penalty and the schedule is on, else R.

    rewards, lengths [G, N]; algo_cfg the run config's algo section. Apply after dynamic-sampling
    selection (which uses the raw verifier score) and before the advantages."""
    r = np.asarray(rewards, np.float32)
    if not algo_cfg.length_penalty or not length_penalty_active(
            step, algo_cfg.length_penalty_on_steps, algo_cfg.length_penalty_off_steps):
        return r
    eta = cosine_length_reward(lengths, max_length, algo_cfg.length_penalty_eta_min,
                               algo_cfg.length_penalty_eta_max)
    return r + np.float32(algo_cfg.length_penalty_coef) * eta

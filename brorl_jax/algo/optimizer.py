"""Optimizer: AdamW (or Lion) with a constant LR by default, global-norm clipping, and BroRL's
sqrt batch-size learning-rate rule.

ProRL v1 §3.2: AdamW, constant LR 2e-6. BroRL §4.2.1: when the batch grows from B0 to B, the LR is
scaled by sqrt(B / B0). The papers do not say what "batch" counts; with samples per step
(128 x 512 = 65,536 vs 512 x 16 = 8,192; BroRL Table 1) the factor is sqrt(8) ~ 2.83.
A warmup + cosine schedule is available but is NOT part of the paper's recipe.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import optax

OPTIMIZERS = ("adamw", "lion")
SCHEDULES = ("constant", "warmup_cosine")


def scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int) -> float:
    """BroRL's rule: lr = base_lr * sqrt(new_batch / base_batch)."""
    if base_lr <= 0 or base_batch <= 0 or new_batch <= 0:
        raise ValueError(f"base_lr, base_batch and new_batch must be > 0; got {base_lr}, {base_batch}, {new_batch}")
    return base_lr * math.sqrt(new_batch / base_batch)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's frozen view of the run config's `optim` section (same key names; defaults
    and checks live in brorl_jax.config). Two fields are derived: learning_rate (optim.lr or the
    sqrt batch rule) and the schedule lengths in optimizer updates (`warmup_updates`,
    `decay_updates`: RL steps x ppo_mini_batches x ppo_epochs). Build with
    brorl_jax.config.optimizer_config(cfg) or optimizer_config(**overrides) in tests."""
    name: str
    learning_rate: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float                 # global-norm clip; 0 = none
    schedule: str
    warmup_updates: int
    decay_updates: int
    final_lr_ratio: float

    @classmethod
    def from_run_config(cls, cfg: Any, learning_rate: float) -> "OptimizerConfig":
        o = cfg.optim
        per_step = cfg.updates_per_step
        return cls(name=o.name, learning_rate=float(learning_rate), b1=o.b1, b2=o.b2, eps=o.eps,
                   weight_decay=o.weight_decay, grad_clip=o.grad_clip, schedule=o.schedule,
                   warmup_updates=o.warmup_steps * per_step,
                   decay_updates=max(cfg.train.steps, o.warmup_steps + 1) * per_step,
                   final_lr_ratio=o.final_lr_ratio)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning rate as a function of optimizer updates done."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_updates,
        decay_steps=max(cfg.decay_updates, cfg.warmup_updates + 1),
        end_value=cfg.learning_rate * cfg.final_lr_ratio)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax chain: clip_by_global_norm(grad_clip) -> adamw | lion with the LR schedule."""
    lr = learning_rate_schedule(cfg)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*parts, opt)

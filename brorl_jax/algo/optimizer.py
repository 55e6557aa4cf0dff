"""Optimizer: AdamW (or Lion) with a constant LR by default, global-norm clipping, and BroRL's
sqrt batch-size learning-rate rule.

ProRL v1 §3.2: AdamW, constant LR 2e-6. BroRL §4.2.1: when the batch grows from B0 to B, the LR is
scaled by sqrt(B / B0). The papers do not say what "batch" counts; with samples per step
(128 x 512 = 65,536 vs 512 x 16 = 8,192) the factor is sqrt(8) ~ 2.83 (paper_notes §1.3).
A warmup + cosine schedule is available but is NOT part of the paper's recipe.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import optax

OPTIMIZERS = ("adamw", "lion")
SCHEDULES = ("constant", "warmup_cosine")


def scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int) -> float:
    """BroRL's rule: lr = base_lr * sqrt(new_batch / base_batch)."""
    if base_lr <= 0 or base_batch <= 0 or new_batch <= 0:
        raise ValueError(f"base_lr, base_batch and new_batch must be > 0; got {base_lr}, {base_batch}, {new_batch}")
    return base_lr * math.sqrt(new_batch / base_batch)


def explain_scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int) -> str:
    """One line showing the derived value, for logs and configs."""
    lr = scaled_learning_rate(base_lr, base_batch, new_batch)
    return (f"learning_rate = base_lr * sqrt(new_batch / base_batch) = {base_lr:g} * sqrt({new_batch} / "
            f"{base_batch}) = {base_lr:g} * {math.sqrt(new_batch / base_batch):.4f} = {lr:.6g} "
            f"(BroRL §4.2.1 sqrt rule; batch counted in samples per step)")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    learning_rate: float = 1e-6            # ProRLv2 OpenRLHF example (impl); ProRL v1: 2e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01             # NeMo-RL default (impl; not in paper)
    max_grad_norm: float = 1.0             # global-norm clip (veRL/NeMo default; not in paper)
    schedule: str = "constant"             # "warmup_cosine" is NOT in the paper
    warmup_steps: int = 0
    decay_steps: int = 1000
    end_lr_fraction: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.name must be one of {OPTIMIZERS}; got {self.name!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {SCHEDULES}; got {self.schedule!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be > 0; got {self.learning_rate}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("OptimizerConfig.max_grad_norm must be > 0 or None (no clipping)")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "OptimizerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        items = dict(mapping.items())
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"OptimizerConfig: unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**items)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_lr_fraction)


def make_optimizer(cfg: OptimizerConfig | None = None) -> optax.GradientTransformation:
    """optax chain: clip_by_global_norm(max_grad_norm) -> adamw | lion with the LR schedule."""
    cfg = cfg or OptimizerConfig()
    lr = learning_rate_schedule(cfg)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
    return optax.chain(*parts, opt)

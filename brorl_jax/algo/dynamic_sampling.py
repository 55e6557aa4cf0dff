"""Dynamic sampling with fixed shapes (DAPO; BroRL §3.1; veRL recipe/dapo, paper_notes §1.5).

Rule: keep a prompt group only if 0 < #correct < N (all-correct and all-wrong groups carry zero
group-baseline advantage, so they only dilute the batch). Generation is repeated in rounds of
ceil(generation_batch_multiplier * prompts_per_step) prompts until prompts_per_step groups are
kept or max_generation_rounds is hit; then

  cap policy "error" (veRL default): raise DynamicSamplingError with a message that says what to raise;
  cap policy "pad": fill the missing groups with zeros and group_valid=False, so the batch handed
                    to the compiled update keeps its fixed shape [prompts_per_step * N, ...] and the
                    padded rows are masked out (loss_mask False, advantage 0).

Surplus kept groups beyond prompts_per_step are dropped (veRL truncates the same way). Everything
here is host-side numpy: it decides which rows exist, never what shape the jitted update sees.
pass_rate = kept groups / generated groups (BroRL Table 2: 41% at N=16, 62% at N=512).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np


class DynamicSamplingError(RuntimeError):
    """The generation-round cap was hit before the step's batch was full (cap policy "error")."""


def select_groups(rewards, correct_threshold: float = 1.0) -> np.ndarray:
    """Kept mask bool [G] for rewards [G, N]: 0 < #(reward >= correct_threshold) < N."""
    r = np.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [G, N]; got shape {r.shape}")
    n_correct = np.sum(r >= correct_threshold, axis=1)
    return (n_correct > 0) & (n_correct < r.shape[1])


def generation_batch_size(prompts_per_step: int, generation_batch_multiplier: float) -> int:
    """Prompts generated per round: ceil(multiplier * prompts_per_step). With BroRL's 62% pass
    rate a multiplier of ~1.6 fills a step in one round (paper_notes §1.5, derived)."""
    return max(1, math.ceil(generation_batch_multiplier * prompts_per_step))


@dataclasses.dataclass
class DynamicSampler:
    """Accumulates kept prompt groups over generation rounds for one RL step.

    Usage:
        sampler = DynamicSampler.from_config(algo_cfg)
        while sampler.need_more():                      # raises on the cap with policy "error"
            out = generate(next_prompts(sampler.generation_batch_size))
            sampler.add(rewards[G, N], {"tokens": [G, N, S], ...})   # arrays with leading G
        batch, group_valid, stats = sampler.finalize()  # leading dim exactly prompts_per_step
    """
    prompts_per_step: int
    rollouts_per_prompt: int
    generation_batch_multiplier: float = 1.0
    max_generation_rounds: int = 8
    cap_policy: str = "error"
    correct_threshold: float = 1.0
    enabled: bool = True
    rounds: int = 0
    generated_groups: int = 0
    kept_groups: int = 0
    _kept: list = dataclasses.field(default_factory=list)
    _template: dict = dataclasses.field(default_factory=dict)   # one group's shape per array

    def __post_init__(self):
        if self.cap_policy not in ("error", "pad"):
            raise ValueError(f"cap_policy must be 'error' or 'pad'; got {self.cap_policy!r}")
        if self.max_generation_rounds < 1:
            raise ValueError(f"max_generation_rounds must be >= 1; got {self.max_generation_rounds}")

    @classmethod
    def from_config(cls, cfg) -> "DynamicSampler":
        """From an AlgoConfig."""
        return cls(prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt,
                   generation_batch_multiplier=cfg.generation_batch_multiplier,
                   max_generation_rounds=cfg.max_generation_rounds,
                   cap_policy=cfg.dynamic_sampling_cap_policy,
                   correct_threshold=cfg.correct_threshold, enabled=cfg.dynamic_sampling)

    @property
    def generation_batch_size(self) -> int:
        return generation_batch_size(self.prompts_per_step, self.generation_batch_multiplier)

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.prompts_per_step

    @property
    def pass_rate(self) -> float:
        """Kept groups / generated groups so far (nan before any round)."""
        return self.kept_groups / self.generated_groups if self.generated_groups else float("nan")

    def _cap_message(self) -> str:
        return (f"dynamic sampling kept {self.kept_groups} of {self.generated_groups} groups "
                f"(needed {self.prompts_per_step}; pass rate {self.pass_rate:.1%}) after {self.rounds} "
                f"rounds; raise algo.max_generation_rounds (now {self.max_generation_rounds}) or "
                f"algo.generation_batch_multiplier (now {self.generation_batch_multiplier}), or set "
                f"algo.dynamic_sampling_cap_policy='pad' to train on a partly masked batch")

    def need_more(self) -> bool:
        """True while another generation round is needed and allowed. At the cap with policy
        "error" it raises DynamicSamplingError; with "pad" it returns False (finalize pads)."""
        if self.full:
            return False
        if self.rounds >= self.max_generation_rounds:
            if self.cap_policy == "error":
                raise DynamicSamplingError(self._cap_message())
            return False
        return True

    def add(self, rewards, arrays: Mapping[str, Any]) -> np.ndarray:
        """Record one generation round: rewards [G, N] and per-group arrays with leading dim G.
        Returns the kept mask [G]."""
        r = np.asarray(rewards)
        if r.ndim != 2 or r.shape[1] != self.rollouts_per_prompt:
            raise ValueError(f"rewards must be [G, N={self.rollouts_per_prompt}]; got shape {r.shape}")
        for k, v in arrays.items():
            if np.shape(v)[0] != r.shape[0]:
                raise ValueError(f"arrays[{k!r}] has leading dim {np.shape(v)[0]}, rewards has G={r.shape[0]}")
        kept = select_groups(r, self.correct_threshold) if self.enabled else np.ones(r.shape[0], bool)
        if not self._template:
            self._template = {k: np.zeros_like(np.asarray(v)[:1]) for k, v in arrays.items()}
            self._template["rewards"] = np.zeros_like(r[:1])
        self.rounds += 1
        self.generated_groups += r.shape[0]
        self.kept_groups += int(kept.sum())
        if kept.any():
            part = {k: np.asarray(v)[kept] for k, v in arrays.items()}
            part["rewards"] = r[kept]
            self._kept.append(part)
        return kept

    def finalize(self) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, float]]:
        """-> (arrays with leading dim prompts_per_step (+ "rewards" [P, N]), group_valid bool [P],
        stats). Raises if not full under policy "error"."""
        if not self.full and self.cap_policy == "error":
            raise DynamicSamplingError(self._cap_message())
        if not self._template:
            raise DynamicSamplingError("DynamicSampler.finalize() called before any add()")
        p = self.prompts_per_step
        out = {}
        for k in self._template:
            parts = [part[k] for part in self._kept] or [self._template[k][:0]]
            cat = np.concatenate(parts, axis=0)[:p]
            if cat.shape[0] < p:  # "pad" policy: zeros, masked by group_valid
                cat = np.concatenate([cat, np.zeros((p - cat.shape[0],) + cat.shape[1:], cat.dtype)])
            out[k] = cat
        n_valid = min(self.kept_groups, p)
        group_valid = np.arange(p) < n_valid
        stats = {"pass_rate": self.pass_rate, "generation_rounds": float(self.rounds),
                 "generated_groups": float(self.generated_groups), "kept_groups": float(self.kept_groups),
                 "padded_groups": float(p - n_valid)}
        return out, group_valid, stats


def run_dynamic_sampling(sampler: DynamicSampler,
                         generate_round: Callable[[int, int], tuple[Any, Mapping[str, Any]]]):
    """Drive `sampler`: generate_round(round_index, num_prompts) -> (rewards [G, N], arrays).
    Returns sampler.finalize()."""
    while sampler.need_more():
        rewards, arrays = generate_round(sampler.rounds, sampler.generation_batch_size)
        sampler.add(rewards, arrays)
    return sampler.finalize()

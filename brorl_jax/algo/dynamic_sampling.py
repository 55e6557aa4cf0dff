"""Dynamic sampling (DAPO; BroRL §3.1; veRL recipe/dapo): which prompt groups enter the update.

A group is one prompt's rollouts. Generation runs in rounds of
ceil(generation_batch_multiplier * prompts_per_step) prompts; after scoring, a group filter
(`GROUP_FILTERS`, chosen by `algo.dynamic_sampling_rule`) keeps the groups that carry a learning
signal, and kept groups are appended, whole and in arrival order, to a budget of
prompts_per_step * N rows (RunConfig.update_rows). Groups usually hold N rows; options not in
the paper (adaptive N) make them vary, and a group that no longer fits the rows left is dropped (veRL drops
surplus groups the same way). The batch is full once less room is left than the largest possible
group. At `max_generation_rounds`:

  cap policy "error" (veRL default): raise DynamicSamplingError saying what to raise;
  cap policy "pad": train on what was kept; the remaining rows are padding (loss-masked).

Everything here is host-side numpy: it decides which rows exist, never what shape the compiled
update sees. pass_rate = groups the filter kept / groups generated (BroRL Table 2: 41% at N=16,
62% at N=512).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from brorl_jax.algo import policies


class DynamicSamplingError(RuntimeError):
    """The generation-round cap was hit before the step's batch was full (cap policy "error")."""


# ------------------------------------------------------------------------------------------------
# Group filters: rewards [n] of one group -> keep it? (the registry is the list of choices)
# ------------------------------------------------------------------------------------------------
def keep_mixed_correct(rewards: np.ndarray, correct_threshold: float) -> bool:
    """BroRL §3.1 / DAPO: 0 < #(reward >= correct_threshold) < n."""
    n_correct = int(np.sum(np.asarray(rewards) >= correct_threshold))
    return 0 < n_correct < len(rewards)


def keep_reward_std(rewards: np.ndarray, correct_threshold: float) -> bool:
    """veRL DAPO recipe (`filter_groups`, metric std > 0) and NeMo-RL: the rewards are not all
    equal. Same as correct_count for 0/1 rewards; also keeps groups with partial credit."""
    del correct_threshold
    r = np.asarray(rewards, np.float64)
    return bool(len(r) > 1 and np.std(r) > 0)


GROUP_FILTERS: dict[str, Callable[[np.ndarray, float], bool]] = {
    "correct_count": keep_mixed_correct,
    "reward_std": keep_reward_std,
}
CAP_POLICIES = ("error", "pad")


def get_group_filter(name: str) -> Callable[[np.ndarray, float], bool]:
    try:
        return GROUP_FILTERS[name]
    except KeyError:
        raise ValueError(f"unknown dynamic_sampling_rule {name!r}; allowed: "
                         f"{sorted(GROUP_FILTERS)}") from None


def select_groups(rewards, correct_threshold: float = 1.0, rule: str = "correct_count") -> np.ndarray:
    """Kept mask bool [G] for rewards [G, N] under the group filter `rule`."""
    r = np.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [G, N]; got shape {r.shape}")
    keep = get_group_filter(rule)
    return np.array([keep(row, correct_threshold) for row in r], bool)


def generation_batch_size(prompts_per_step: int, generation_batch_multiplier: float) -> int:
    """Prompts generated per round: ceil(multiplier * prompts_per_step). With BroRL's 62% pass
    rate a multiplier of ~1.6 fills a step in one round (veRL's gen_batch_size)."""
    return max(1, math.ceil(generation_batch_multiplier * prompts_per_step))


# ------------------------------------------------------------------------------------------------
# Groups and the sampler
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Group:
    """One prompt's rollouts (n of them): tokens / logprobs / mask [n, S], lengths / rewards /
    shaped [n] (rewards = the verifier's scores, which the filter reads; shaped = the reward that
    enters the advantage: length penalty, clipping), prompt_ids the prompt's tokens, index the
    prompt's position in the data loader (adaptive N keys its statistics by it)."""
    prompt_ids: list[int]
    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    shaped: np.ndarray
    index: int = -1
    # a MoE rollout recorded for routing replay (rollout.GroupResult): [n, S, L, K], [P, L, K]
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.rewards)


@dataclasses.dataclass
class GroupSampler:
    """Accumulates the kept groups of one RL step over generation rounds (module docstring).

        sampler = GroupSampler.from_config(run_cfg)
        while sampler.need_more():           # raises at the round cap with policy "error"
            sampler.add_round(groups_of_this_round)
        sampler.groups, sampler.stats()
    """
    # the settings: no defaults here (brorl_jax/config/schema.py holds them; from_config reads them)
    row_budget: int
    max_group_rows: int
    max_generation_rounds: int
    cap_policy: str
    rule: str
    correct_threshold: float
    enabled: bool
    rounds: int = 0
    generated_groups: int = 0
    passed_groups: int = 0
    rows_used: int = 0
    groups: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.cap_policy not in CAP_POLICIES:
            raise ValueError(f"cap_policy must be one of {CAP_POLICIES}; got {self.cap_policy!r}")
        get_group_filter(self.rule)

    @classmethod
    def from_config(cls, cfg, *, row_budget: int | None = None,
                    max_group_rows: int | None = None) -> "GroupSampler":
        """From a RunConfig; row_budget defaults to the update's rows (RunConfig.update_rows; a
        process's share under several processes), max_group_rows to N."""
        a = cfg.algo
        return cls(row_budget=cfg.update_rows if row_budget is None else row_budget,
                   max_group_rows=max_group_rows or policies.nominal_n(cfg.rollout),
                   max_generation_rounds=a.max_generation_rounds,
                   cap_policy=a.dynamic_sampling_cap_policy, rule=a.dynamic_sampling_rule,
                   correct_threshold=a.correct_threshold, enabled=a.dynamic_sampling)

    @property
    def full(self) -> bool:
        return self.row_budget - self.rows_used < self.max_group_rows

    @property
    def pass_rate(self) -> float:
        """Groups the filter kept / groups generated (nan before any round)."""
        return self.passed_groups / self.generated_groups if self.generated_groups else math.nan

    def _cap_message(self) -> str:
        return (f"dynamic sampling filled {self.rows_used} of {self.row_budget} rows with "
                f"{len(self.groups)} groups after {self.rounds} rounds ({self.passed_groups} of "
                f"{self.generated_groups} groups kept by the '{self.rule}' rule, pass rate "
                f"{self.pass_rate:.1%}); raise algo.max_generation_rounds (now "
                f"{self.max_generation_rounds}) or algo.generation_batch_multiplier, or set "
                "algo.dynamic_sampling_cap_policy='pad' to train on a partly masked batch")

    def need_more(self) -> bool:
        """True while another round is needed and allowed; at the cap, "error" raises
        DynamicSamplingError and "pad" returns False."""
        if self.full:
            return False
        if self.rounds >= self.max_generation_rounds:
            if self.cap_policy == "error":
                raise DynamicSamplingError(self._cap_message())
            return False
        return True

    def add_round(self, groups: Sequence[Group]) -> np.ndarray:
        """Records one generation round; returns the filter's kept mask [len(groups)]."""
        self.rounds += 1
        return self.add_groups(groups)

    def add_groups(self, groups: Sequence[Group]) -> np.ndarray:
        """Records groups without counting a round (the stream, which has none: its caller
        keeps `rounds` and the cap); returns the filter's kept mask [len(groups)]."""
        keep_fn = get_group_filter(self.rule)
        kept = np.zeros(len(groups), bool)
        for i, grp in enumerate(groups):
            kept[i] = keep_fn(grp.rewards, self.correct_threshold) if self.enabled else True
            self.generated_groups += 1
            if not kept[i]:
                continue
            self.passed_groups += 1
            if self.rows_used + grp.n <= self.row_budget:
                self.groups.append(grp)
                self.rows_used += grp.n
        return kept

    def stats(self) -> dict[str, float]:
        return {"pass_rate": self.pass_rate, "generation_rounds": float(self.rounds),
                "generated_groups": float(self.generated_groups),
                "kept_groups": float(len(self.groups)),
                "padded_rows": float(self.row_budget - self.rows_used)}

"""The reward record and result types shared by every verifier."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol


@dataclasses.dataclass
class RewardResult:
    """One verifier verdict.

    score: in [0, 1] (binary for math, fraction of tests for code, the dataset's own
        continuous score for Reasoning Gym).
    reason: short machine-greppable cause ("correct", "wrong answer", "no answer extracted",
        "timeout", "worker died (signal 9)", ...).
    details: diagnostics (extracted answer, per-test outcomes, ...); small and picklable.
    """

    score: float
    reason: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        score = float(self.score)
        if not math.isfinite(score) or not 0.0 <= score <= 1.0:
            raise ValueError(f"RewardResult.score must be a finite number in [0, 1], "
                             f"got {self.score!r} (reason {self.reason!r})")
        self.score = score


class RewardFn(Protocol):
    """A verifier: record (veRL style: data_source, ground_truth, optional prompt/extra_info)
    and a completion string in, RewardResult out. Options come from the service's
    reward_options for this verifier, plus time_budget_s (the service's per-item timeout)."""

    def __call__(self, record: Mapping[str, Any], completion: str, *,
                 time_budget_s: float | None = None, **options: Any) -> RewardResult: ...


def require_field(record: Mapping[str, Any], name: str, verifier: str) -> Any:
    if name not in record:
        raise ValueError(f"{verifier} record is missing {name!r}; veRL-style records carry "
                         f"'data_source' and 'ground_truth' (got keys {sorted(record)})")
    return record[name]


# The largest float32: rewards enter the update as float32 (algo.batch), so a larger one becomes
# inf there and every update of its step non-finite.
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass
class UnboundedRewardResult(RewardResult):
    """A verdict whose score is any finite number: a user's reward function (rewards.custom)
    keeps its own scale (veRL's math_dapo, for one, scores -1 / 1)."""

    def __post_init__(self):
        score = float(self.score)
        if not math.isfinite(score):
            raise ValueError(f"reward score must be a finite number, got {self.score!r} "
                             f"(reason {self.reason!r})")
        if abs(score) > FLOAT32_MAX:
            raise ValueError(f"reward score {score:g} is beyond float32, the dtype the update "
                             f"computes in (|score| <= {FLOAT32_MAX:.4g}; reason "
                             f"{self.reason!r})")
        self.score = score

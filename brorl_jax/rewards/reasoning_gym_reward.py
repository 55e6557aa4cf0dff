"""Reasoning Gym: any reasoning-gym task as a seeded prompt source and as its own verifier.

Records: {"data_source": "reasoning_gym/<task>", "prompt": question, "ground_truth": answer,
"extra_info": entry}, where entry is the generator's item (question, answer, metadata); the
verifier calls the task's own score_answer(answer, entry) (continuous in [0, 1], ProRL App. D).
The completion's answer is the last <answer>...</answer> span (reasoning-gym's convention).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

from brorl_jax.rewards.types import RewardResult, require_field

DATA_SOURCE_PREFIX = "reasoning_gym/"


def task_names() -> list[str]:
    """Every task name reasoning-gym registers."""
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


def reasoning_gym_records(task_name: str, size: int, seed: int,
                          **task_config: Any) -> list[dict[str, Any]]:
    """`size` records of task `task_name`, reproducible from `seed` (and task_config)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    if task_name not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task_name!r}; see task_names()")
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    dataset = reasoning_gym.create_dataset(task_name, size=size, seed=seed, **task_config)
    records = []
    for entry in dataset:
        records.append({
            "data_source": DATA_SOURCE_PREFIX + task_name,
            "prompt": entry["question"],
            "ground_truth": entry["answer"],
            "extra_info": _plain(entry),
        })
    return records


def _plain(entry: Mapping[str, Any]) -> dict[str, Any]:
    # The generator's entry as a deep copy, so mutating a record never changes the dataset.
    return copy.deepcopy(dict(entry))


@functools.lru_cache(maxsize=None)
def _score_fn(task_name: str):
    # Building the dataset object once per task and process: some constructors do real work.
    from reasoning_gym import get_score_answer_fn
    return get_score_answer_fn(task_name)


def reasoning_gym_reward(record: Mapping[str, Any], completion: str, *,
                         answer_tag: str = "answer",
                         time_budget_s: float | None = None) -> RewardResult:
    """The task's own score_answer on the completion's last <answer_tag> span."""
    from reasoning_gym.utils import extract_answer

    source = require_field(record, "data_source", "reasoning_gym")
    entry = require_field(record, "extra_info", "reasoning_gym")
    task = str(source)[len(DATA_SOURCE_PREFIX):] if str(source).startswith(
        DATA_SOURCE_PREFIX) else None
    metadata = entry.get("metadata", {}) if isinstance(entry, Mapping) else {}
    task = metadata.get("source_dataset", task) or task
    if not task:
        raise ValueError(f"cannot tell the reasoning-gym task of data_source {source!r}; use "
                         f"'{DATA_SOURCE_PREFIX}<task>'")
    answer = extract_answer(completion, tag_name=answer_tag)
    if answer is None:
        return RewardResult(0.0, "no answer extracted", {"extracted": None})
    score = float(_score_fn(task)(answer, dict(entry)))
    score = min(1.0, max(0.0, score))
    reason = "correct" if score == 1.0 else ("wrong answer" if score == 0.0 else "partial")
    return RewardResult(score, reason, {"extracted": answer[:500], "task": task})

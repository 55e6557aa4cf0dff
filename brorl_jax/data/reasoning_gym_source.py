"""Prompt records from Reasoning Gym's procedural generators (reasoning_gym.create_dataset).

Each generated entry {"question", "answer", "metadata"} becomes a normalized record (see
brorl_jax.data.records): the question as one user message, data_source "reasoning_gym/<task>",
ground_truth the entry's answer, and extra_info the whole entry (made JSON-safe) plus where it came
from, so the scorer can either call ``dataset.score_answer(answer, entry)`` on the stored entry or
regenerate the exact entry with
``reasoning_gym.create_dataset(task, size=info["size"], seed=info["seed"],
**info["config"])[info["index"]]``.
"""
from __future__ import annotations

import difflib
import json
import logging
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from brorl_jax.data.records import EMPTY_PROMPT, MISSING_GROUND_TRUTH, DataReport

DATA_SOURCE_PREFIX = "reasoning_gym/"
logger = logging.getLogger(__name__)


def parse_tasks(text: str) -> dict[str, float]:
    """"basic_arithmetic=3,chain_sum" -> {"basic_arithmetic": 3.0, "chain_sum": 1.0}."""
    tasks: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, weight = item.partition("=")
        try:
            tasks[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reasoning_gym task weight in {item!r} is not a number; write "
                             "'task=weight', e.g. 'chain_sum=2'.") from None
    if not tasks:
        raise ValueError("no reasoning_gym task given; write 'reasoning_gym:task1,task2'.")
    return tasks


def task_sizes(weights: Mapping[str, float], size: int) -> dict[str, int]:
    """Splits `size` prompts over tasks in proportion to `weights` (largest remainder)."""
    total = float(sum(weights.values()))
    exact = {name: size * w / total for name, w in weights.items()}
    sizes = {name: int(x) for name, x in exact.items()}
    # Hand the leftover prompts to the largest fractional parts; ties go to the earlier task.
    order = sorted(weights, key=lambda n: -(exact[n] - sizes[n]))
    for name in order[:size - sum(sizes.values())]:
        sizes[name] += 1
    return sizes


def task_seed(seed: int, task: str) -> int:
    """Per-task generator seed derived from (seed, task), stable across processes and runs."""
    return zlib.crc32(f"{seed}:{task}".encode()) & 0x7FFFFFFF


def json_safe(value: Any) -> Any:
    """Deep copy with tuples -> lists, sets -> sorted lists, numpy scalars -> Python numbers."""
    def default(obj: Any) -> Any:
        if hasattr(obj, "tolist"):
            return obj.tolist()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=repr)
        return str(obj)
    return json.loads(json.dumps(value, default=default))


def reasoning_gym_source(tasks: str | Sequence[str] | Mapping[str, float], size: int,
                         seed: int = 0, *, report: DataReport | None = None,
                         **dataset_kwargs: Any) -> list[dict]:
    """Generates `size` prompt records from Reasoning Gym tasks.

    Args:
      tasks: task names (equal weights), {name: weight}, or the text "name[=weight],name...";
        e.g. ["basic_arithmetic", "chain_sum"] or "basic_arithmetic=3,chain_sum=1".
      size: total number of prompts, split over tasks in proportion to their weights.
      seed: the same (tasks, size, seed, dataset_kwargs) gives the same records on every host
        and run; each task's generator gets its own seed derived from (seed, task).
      report: filled with rows read / kept / skipped (a generator entry without a question or
        answer is skipped and listed, never passed on); without one, skips are logged.
      **dataset_kwargs: generator settings passed to every task's create_dataset (e.g.
        min_terms=2 for basic_arithmetic); give tasks that share these settings.

    Returns:
      Records task by task, in generator order (the prompt loader shuffles). extra_info =
      {"question", "answer", "metadata", "reasoning_gym": {"task", "size", "seed", "index",
      "config"}}.
    """
    import reasoning_gym  # heavy import, only when this source is used

    if isinstance(tasks, str):
        tasks = parse_tasks(tasks)
    weights = dict(tasks) if isinstance(tasks, Mapping) else {name: 1.0 for name in tasks}
    if not weights:
        raise ValueError("reasoning_gym_source needs at least one task.")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}.")
    known = reasoning_gym.factory.DATASETS
    for name, weight in weights.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            raise ValueError(f"unknown reasoning_gym task {name!r}"
                             + (f"; did you mean {close}?" if close else
                                "; see reasoning_gym.factory.DATASETS for the names."))
        if not weight > 0:
            raise ValueError(f"reasoning_gym task {name!r} has weight {weight}; weights must be "
                             "> 0 (drop the task instead).")
    caller_report = report is not None
    report = report if report is not None else DataReport()
    config = json_safe(dataset_kwargs)
    records: list[dict] = []
    for name, n in task_sizes(weights, size).items():
        if n == 0:
            continue
        source = DATA_SOURCE_PREFIX + name
        s = task_seed(seed, name)
        try:
            dataset = reasoning_gym.create_dataset(name, size=n, seed=s, **dataset_kwargs)
        except TypeError as e:
            raise ValueError(f"reasoning_gym task {name!r} rejects the generator settings "
                             f"{sorted(dataset_kwargs)}: {e}") from None
        for index in range(n):
            entry = json_safe(dataset[index])
            report.num_rows += 1
            question, answer = entry.get("question"), entry.get("answer")
            if not isinstance(question, str) or not question.strip():
                report.skip(source, index, EMPTY_PROMPT, "generator gave no question")
                continue
            if answer is None or (isinstance(answer, str) and not answer.strip()):
                report.skip(source, index, MISSING_GROUND_TRUTH, "generator gave no answer")
                continue
            records.append({
                "prompt_messages": [{"role": "user", "content": question}],
                "data_source": source,
                "ground_truth": answer if isinstance(answer, str) else json.dumps(answer),
                "extra_info": {**entry, "reasoning_gym": {"task": name, "size": n, "seed": s,
                                                          "index": index, "config": config}},
                "row": index,
                "source": source,
            })
            report.num_kept += 1
    if report.skipped and not caller_report:  # nobody else will see the report: log it
        logger.warning("reasoning_gym_source: %s", report.summary())
    return records

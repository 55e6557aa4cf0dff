"""Verifier health: which data source gets which verifier (checked when the data loads), and per
step how often a verifier failed rather than judged.

A verdict's `reason` (RewardResult.reason) falls in one of these kinds:

  failures (the verifier could not judge the sample; the 0 says nothing about the answer):
    error        the verifier raised, the sandbox failed, or the ground truth is unreadable
    timeout      the item ran past rewards.timeout_s (or the verifier's own deadline)
    deadline     the batch ran past rewards.batch_deadline_s
    worker_died  the worker process died while scoring the item
  the model's doing (a real 0):
    no_answer    no final answer / code block / number found in the completion
    unparseable  an answer was found but cannot be read as math
  judged: everything else ("correct", "wrong answer", "3/5 tests passed", ...)

VerifierHealth accumulates verdicts per data source; `metrics()` gives, per source,
`verifier/<source>/failed_frac` and `no_answer_frac` every step, plus the fraction of each failure
kind that occurred; the cost of each (data source, verifier) pair,
`verifier_cost/<source>/<verifier>/time_s_mean`, `time_s_max`, `time_s_total` (seconds a worker
spent per verdict, from the verdict's details["seconds"]) and `failures` (count); and the mean of
each extra numeric field a custom reward function returned, `reward_extra/<source>/<field>`.
`check()` raises when every sample of a data source failed: a step trained on those zeros
would be meaningless (and dynamic sampling would stop with a misleading message).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from brorl_jax.rewards.registry import (
    CUSTOM_NAME as CUSTOM,
    REWARDS,
    load_check_fn,
    resolve_reward_name,
)

FAILURE_KINDS = ("error", "timeout", "deadline", "worker_died")
# (prefix of the reason, kind); the first matching prefix wins.
_REASON_KINDS = (
    ("verifier error", "error"), ("sandbox error", "error"),
    ("ground truth not parseable", "error"),
    ("timeout", "timeout"), ("verify timeout", "timeout"), ("batch deadline", "deadline"),
    ("worker died", "worker_died"), ("no answer", "no_answer"), ("no code block", "no_answer"),
    ("no number", "no_answer"), ("answer not parseable", "unparseable"),
)
# What to change when a data source fails on every sample, by failure kind.
FIXES = {
    "error": "check that its ground truths fit the verifier (docs/rewards.md lists each "
             "verifier's format) or map the data source to another verifier with rewards.map",
    "timeout": "raise rewards.timeout_s (per item) or check the verifier on one sample",
    "deadline": "raise rewards.batch_deadline_s or rewards.num_workers",
    "worker_died": "the scoring workers crash (out of memory?); lower rewards.num_workers",
}
# A user's reward function (rewards.custom) that raises is fixed in the function, not the data.
CUSTOM_ERROR_FIX = ("the reward function of rewards.custom raised (the first failure above): "
                    "it must score any completion, e.g. one with no answer or a malformed one, "
                    "returning 0 rather than raising; try it on a few real completions")


def reason_kind(reason: str) -> str:
    """The kind of a verdict's reason (module docstring); "judged" when none applies."""
    for prefix, kind in _REASON_KINDS:
        if reason.startswith(prefix):
            return kind
    return "judged"


class VerifierFailure(RuntimeError):
    """Every sample of a data source failed (message: source, count, first reason, fix)."""


@dataclasses.dataclass
class _Source:
    total: int = 0
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_failure: str = ""
    # verifier -> [verdicts, seconds total, seconds max, failures]
    cost: dict = dataclasses.field(default_factory=dict)
    # extra field -> [sum, count]
    extra: dict = dataclasses.field(default_factory=dict)

    def merge_cost(self, verifier: str, n: int, total: float, top: float, failed: int) -> None:
        c = self.cost.setdefault(verifier, [0, 0.0, 0.0, 0])
        c[0] += n
        c[1] += total
        c[2] = max(c[2], top)
        c[3] += failed

    def merge_extra(self, field: str, total: float, n: int) -> None:
        e = self.extra.setdefault(field, [0.0, 0])
        e[0] += total
        e[1] += n


class VerifierHealth:
    """Verdict kinds per data source over one step (or one evaluation)."""

    def __init__(self):
        self.sources: dict[str, _Source] = {}

    def reset(self) -> None:
        self.sources.clear()

    def add(self, records: Sequence[Mapping[str, Any]], results: Sequence[Any]) -> None:
        for record, result in zip(records, results):
            src = self.sources.setdefault(str(record.get("data_source")), _Source())
            kind = reason_kind(result.reason)
            src.total += 1
            src.kinds[kind] += 1
            if kind in FAILURE_KINDS and not src.first_failure:
                src.first_failure = result.reason
            details = getattr(result, "details", None) or {}
            seconds = float(details.get("seconds", 0.0) or 0.0)
            src.merge_cost(str(details.get("verifier", "?")), 1, seconds, seconds,
                           int(kind in FAILURE_KINDS))
            for field, value in (details.get("extra") or {}).items():
                src.merge_extra(str(field), float(value), 1)

    def to_json(self) -> dict:
        return {name: [src.total, dict(src.kinds), src.first_failure, src.cost, src.extra]
                for name, src in self.sources.items()}

    @classmethod
    def merged(cls, parts: Sequence[dict]) -> "VerifierHealth":
        """One VerifierHealth from several processes' to_json() (their samples together)."""
        out = cls()
        for part in parts:
            for name, (total, kinds, first, *more) in part.items():
                src = out.sources.setdefault(name, _Source())
                src.total += total
                src.kinds.update(kinds)
                src.first_failure = src.first_failure or first
                cost, extra = (more + [{}, {}])[:2]
                for verifier, c in cost.items():
                    src.merge_cost(verifier, *c)
                for field, (total_value, n) in extra.items():
                    src.merge_extra(field, total_value, n)
        return out

    def metrics(self, prefix: str = "verifier/") -> dict[str, float]:
        out = {}
        head = prefix[:-len("verifier/")] if prefix.endswith("verifier/") else prefix
        for name, src in sorted(self.sources.items()):
            failed = sum(src.kinds[k] for k in FAILURE_KINDS)
            out[f"{prefix}{name}/failed_frac"] = failed / src.total
            out[f"{prefix}{name}/no_answer_frac"] = src.kinds["no_answer"] / src.total
            for kind in FAILURE_KINDS + ("unparseable",):
                if src.kinds[kind]:
                    out[f"{prefix}{name}/{kind}_frac"] = src.kinds[kind] / src.total
            for verifier, (n, total, top, failures) in sorted(src.cost.items()):
                key = f"{head}verifier_cost/{name}/{verifier}"
                out[f"{key}/time_s_mean"] = total / n if n else 0.0
                out[f"{key}/time_s_max"] = top
                out[f"{key}/time_s_total"] = total
                out[f"{key}/failures"] = failures
            for field, (total, n) in sorted(src.extra.items()):
                out[f"{head}reward_extra/{name}/{field}"] = total / n
        return out

    def failures(self) -> list[str]:
        """One line per data source with failed verdicts: count, kinds and the first reason."""
        lines = []
        for name, src in sorted(self.sources.items()):
            failed = {k: src.kinds[k] for k in FAILURE_KINDS if src.kinds[k]}
            if failed:
                kinds = ", ".join(f"{v} {k}" for k, v in failed.items())
                lines.append(f"data source {name!r}: {sum(failed.values())} of {src.total} not "
                             f"judged ({kinds}); first: {src.first_failure}")
        return lines

    def check(self, where: str) -> None:
        """Raises VerifierFailure naming the first data source whose every sample failed."""
        for name, src in sorted(self.sources.items()):
            failed = sum(src.kinds[k] for k in FAILURE_KINDS)
            if src.total and failed == src.total:
                kind = reason_kind(src.first_failure)
                fix = (CUSTOM_ERROR_FIX if kind == "error" and CUSTOM in src.cost
                       else FIXES[kind])
                raise VerifierFailure(
                    f"the verifier of data source {name!r} failed on all {src.total} samples of "
                    f"{where}; first failure: {src.first_failure}. Fix: {fix}.")


@dataclasses.dataclass(frozen=True)
class BadGroundTruth:
    """A record whose ground truth its verifier can never match."""
    record: Mapping[str, Any]
    verifier: str
    message: str


def check_records(records: Iterable[Mapping[str, Any]], reward_map: Mapping[str, str] | None
                  ) -> tuple[dict[str, str], list[BadGroundTruth]]:
    """Before any rollout: the verifier of every data source in `records` and the records whose
    ground truth that verifier cannot read (its RewardSpec.check). Raises ValueError naming every
    data source without a verifier and how many rows carry it."""
    records = list(records)
    counts = collections.Counter(str(r.get("data_source")) for r in records)
    verifiers, unmapped = {}, []
    for source in counts:
        try:
            verifiers[source] = resolve_reward_name(source, reward_map)
        except ValueError as e:
            unmapped.append(f"{counts[source]} rows: {e}")
    if unmapped:
        raise ValueError("data sources without a verifier:\n  " + "\n  ".join(unmapped))
    checks = {name: load_check_fn(REWARDS[name]) for name in set(verifiers.values())}
    bad, seen = [], {}
    for r in records:
        name = verifiers[str(r.get("data_source"))]
        check = checks[name]
        if check is None:
            continue
        key = (name, repr(r.get("ground_truth")))
        if key not in seen:
            try:
                check(r.get("ground_truth"))
                seen[key] = None
            except (ValueError, TypeError) as e:
                seen[key] = str(e)
        if seen[key] is not None:
            bad.append(BadGroundTruth(r, name, seen[key]))
    return verifiers, bad

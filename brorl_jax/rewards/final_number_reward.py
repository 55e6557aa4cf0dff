"""Final-number verifier: the last number written in the completion, compared exactly.

For short-answer arithmetic with chat models that answer in prose ("12 + 7 = 19.", "The sum is
19"), where neither \\boxed{} nor a "Final answer:" line can be expected. The rule, exactly:

* a number is a match of ``NUMBER_PATTERN`` (ASCII): optional minus sign, digits (optionally in
  comma-separated groups of three: "1,234"), optional decimal part ("3.5"), not followed by a
  digit; it starts where no letter, digit, "_" or "." stands right before it, so a minus sign
  counts only after a space or punctuation ("12-7" reads 12 and 7, "= -7" reads -7) and
  "v1.2" holds no number; a trailing "." ends a sentence ("19." reads 19);
* the answer is the LAST number in the completion (the decoded text, special tokens removed);
* it scores 1.0 when it equals the ground truth as an exact decimal (``Decimal``: "19", "19.0"
  and "+19" are equal; "19.5" is not 19), else 0.0; no number at all scores 0.0.

ground_truth: a number, a numeric string, or a list of acceptable numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from brorl_jax.rewards.types import RewardResult, require_field

NUMBER_PATTERN = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)"
_NUMBER = re.compile(NUMBER_PATTERN, re.ASCII)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas removed), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def _decimal(value: Any, what: str) -> Decimal:
    if isinstance(value, bool):
        raise ValueError(f"final_number {what} must be a number, got {value!r}")
    try:
        return Decimal(str(value).strip().replace(",", ""))
    except InvalidOperation as e:
        raise ValueError(f"final_number {what} {value!r} is not a number") from e


def final_number_reward(record: Mapping[str, Any], completion: str, *,
                        time_budget_s: float | None = None) -> RewardResult:
    """1.0 when the last number of ``completion`` equals ``record["ground_truth"]`` exactly."""
    del time_budget_s  # a regex over a short string: nothing to bound
    truth = require_field(record, "ground_truth", "final_number")
    golds = [_decimal(t, "ground_truth") for t in
             (truth if isinstance(truth, (list, tuple)) else [truth])]
    if not golds:
        raise ValueError("final_number record has an empty ground_truth list")
    answer = last_number(completion)
    if answer is None:
        return RewardResult(0.0, "no number", {"extracted": None})
    ok = _decimal(answer, "answer") in golds
    return RewardResult(1.0 if ok else 0.0, "correct" if ok else "wrong answer",
                        {"extracted": answer})

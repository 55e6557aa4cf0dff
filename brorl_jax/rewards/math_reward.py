"""Math verifier: extract the final answer, check equivalence with math-verify (binary reward).

Extraction is strict on purpose: the last \\boxed{...} (or \\fbox{...}) of the completion, else
the last match of a configurable final-answer pattern, else nothing -> score 0. The completion
itself is never handed to the checker: math-verify's own extraction would happily find an
expression in a completion that merely restates the question ("compute $1/2+1/2$") and grade
it, which is a known reward hack.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Mapping
from typing import Any

from brorl_jax.rewards.types import RewardResult, require_field

# "Final Answer: 42" / "**Final answer:** $x=3$" on a line of its own (after the last box).
DEFAULT_FINAL_ANSWER_PATTERN = r"(?im)^[ \t>*#_]*final answer[ \t*_]*[:：][ \t*_]*(.+?)[ \t*_.]*$"
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of `\\boxed 5`."""
    best_pos, best = -1, None
    for command in _BOX_COMMANDS:
        pos = text.rfind(command)
        while pos != -1 and pos > best_pos:
            content = _box_content(text, pos + len(command))
            if content is not None:
                best_pos, best = pos, content
                break
            pos = text.rfind(command, 0, pos)
    return best


def _box_content(text: str, i: int) -> str | None:
    if text.startswith("{", i):
        depth = 0
        for j in range(i, len(text)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j]
        return None  # unbalanced: not an answer
    m = re.match(r" +([^\s$]+)", text[i:])  # "\boxed 5"
    return m.group(1) if m else None


def extract_answer(completion: str,
                   final_answer_pattern: str | None = DEFAULT_FINAL_ANSWER_PATTERN) -> str | None:
    """The answer the completion commits to, or None when it commits to none."""
    boxed = extract_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if final_answer_pattern:
        matches = list(re.finditer(final_answer_pattern, completion))
        if matches:
            answer = matches[-1].group(1).strip()
            inner = extract_boxed(answer)
            if inner is not None:
                answer = inner.strip()
            answer = answer.strip().strip("$").strip()
            return answer or None
    return None


class VerifyTimeout(BaseException):  # BaseException: math-verify swallows Exception
    pass


def _with_deadline(seconds: float | None, fn, *args):
    """Runs fn under a SIGALRM deadline when on the main thread (math-verify's own alarm is
    integer-seconds and swallows the timeout, so the reason would be lost)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        return fn(*args)

    def _raise(signum, frame):
        raise VerifyTimeout()

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _silence_math_verify_timeout_warning() -> None:
    """math-verify warns that its own (signal) timeout is off; ours replaces it (see above)."""
    import math_verify.grader
    import math_verify.parser
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True


def _as_latex(answer: str) -> str:
    answer = answer.strip()
    if answer.startswith("$") or "\\boxed" in answer or answer.startswith("\\["):
        return answer
    return "\\boxed{" + answer + "}"


def math_reward(record: Mapping[str, Any], completion: str, *,
                final_answer_pattern: str | None = DEFAULT_FINAL_ANSWER_PATTERN,
                verify_timeout_s: float | None = 5.0, float_rounding: int = 6,
                time_budget_s: float | None = None) -> RewardResult:
    """1.0 when the extracted answer is equivalent to ground_truth under math-verify, else 0.0.

    ground_truth: a string (LaTeX or plain), a number, or a list of acceptable answers.
    verify_timeout_s: in-process deadline for parse+verify (None: rely on the scoring
    service's per-item timeout, which kills the worker).
    """
    from math_verify import parse, verify  # heavy import: only in workers that score math

    _silence_math_verify_timeout_warning()

    truth = require_field(record, "ground_truth", "math")
    golds = truth if isinstance(truth, (list, tuple)) else [truth]
    if not golds:
        raise ValueError("math record has an empty ground_truth list")
    answer = extract_answer(completion, final_answer_pattern)
    if answer is None:
        return RewardResult(0.0, "no answer extracted", {"extracted": None})
    details: dict[str, Any] = {"extracted": answer}

    def _check():
        pred = parse(_as_latex(answer), parsing_timeout=None)
        if not pred:
            return None
        parsed_any = False
        for gold in golds:
            gold_parsed = parse(_as_latex(str(gold)), parsing_timeout=None)
            parsed_any = parsed_any or bool(gold_parsed)
            if gold_parsed and verify(gold_parsed, pred, float_rounding=float_rounding,
                                      timeout_seconds=None):
                return True
        return False if parsed_any else "gold"

    try:
        ok = _with_deadline(verify_timeout_s, _check)
    except VerifyTimeout:
        return RewardResult(0.0, f"verify timeout after {verify_timeout_s}s", details)
    if ok is None:
        return RewardResult(0.0, "answer not parseable", details)
    if ok == "gold":   # a data problem, not the model's: counted as a verifier failure
        return RewardResult(0.0, f"ground truth not parseable: {str(truth)[:80]!r}", details)
    return RewardResult(1.0 if ok else 0.0, "correct" if ok else "wrong answer", details)


def check_ground_truth(truth: Any, *, timeout_s: float = 2.0) -> None:
    """Raises ValueError when math-verify cannot read any of the ground-truth answers as a math
    expression (only a literal string comparison could match it). Run on the data at load time;
    a parse that runs past `timeout_s` is given the benefit of the doubt."""
    from math_verify import parse

    _silence_math_verify_timeout_warning()
    golds = truth if isinstance(truth, (list, tuple)) else [truth]
    if not golds:
        raise ValueError("empty list of ground-truth answers")

    def _any_parses():
        return any(any(not isinstance(x, str) for x in parse(_as_latex(str(g)),
                                                             parsing_timeout=None))
                   for g in golds)

    try:
        ok = _with_deadline(timeout_s, _any_parses)
    except VerifyTimeout:
        return
    if not ok:
        raise ValueError(f"math-verify cannot parse the ground truth {str(truth)[:80]!r} as a "
                         "math expression, so no answer could ever match it")

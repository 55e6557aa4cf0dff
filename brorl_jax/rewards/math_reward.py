"""Math verifier: extract the final answer, check equivalence with math-verify (binary reward).

Extraction is strict on purpose: the completion must commit to an answer (a \\boxed{...} /
\\fbox{...}, or a final-answer line), else it scores 0. The completion itself is never handed
to the checker: math-verify's own extraction would happily find an expression in a completion
that merely restates the question ("compute $1/2+1/2$") and grade it, which is a known reward
hack. The same extraction reads the ground truth when it is a worked solution (with a box).

Rules around math-verify (each has positive and near-miss tests in
tests/rewards/test_rewards_math.py; the graded public pairs in tests/rewards/data/ measure them
together, docs/rewards.md lists them):

  R1 multi-box: boxes separated only by connectors ("and", "or", commas, spacing, "x =") form
     one answer, the list of their contents ("x = \\boxed{2} or x = \\boxed{3}" is "2, 3"); a box
     after any other text ("first \\boxed{7}, corrected: \\boxed{10}") replaces the earlier ones.
     A hedge ("\\boxed{7} or \\boxed{10}") is the set {7, 10}, which matches no single gold.
     A part label ("for part (a)") and one word right after a box before a connector
     ("\\boxed{1} papers and \\boxed{2} bins") are connectors too.
  R2 final-answer lines: "Final Answer: ...", "The final answer is ...", a line starting with
     "Answer", wherever they sit on the line; the last commitment wins, so a final-answer line
     written after the last box replaces it. Sentences are cut to the answer: "The largest $n$
     is 34." -> "34", Minerva's "... I hope it is correct." is dropped; an answer that starts
     with "not" is no answer; a plain-prose sentence ("Jane started growing Sphere 3 hours ago")
     gives its number when it holds exactly one, else no answer (a hedge "3 or 4 hours" is none).
     "Answer \\(", "Answer $" or "Answer $$" at a line's end opens an answer on the next lines.
  R3 thousands separators written with spaces or thin spaces ("1 000", "1\\,000", "12 345 678":
     groups of exactly three digits after a 1-3 digit head) are joined; "1 00" or "12 34" are not.
     Commas ("10,455") are joined only when the gold is a single number: against a list gold
     "10, 455" stays a list. A decimal comma is read only by R12 (answer side, gold a decimal).
  R0 a completion ends at the first chat-template token (<|im_start|>, <|im_end|>,
     <|endoftext|>, <|eot_id|>): what follows is a turn the model was not asked for.
  R4 the imaginary unit: a free symbol i in both answers is sympy's I (so i^2 = -1, sqrt(-4) = 2i)
     unless the gold uses i as an index (a subscript _i, a sum over i).
  R5 degrees inside trigonometric functions are converted to radians (\\sin(90^\\circ - x) is
     \\cos x); a bare 30^\\circ stays 30 (math-verify drops the sign), so "30" still matches it.
  R6 relations vs intervals: a one-variable inequality (or an "or"/"and" of them) compared with an
     interval or union is compared as its solution set (x > 3 is (3, oo)), in both directions;
     a bounded f(x) plays the variable ("0 < f(x) < 1" is (0, 1)); "x \\in S" against a
     relation is S.
  R7 a bare comma list is a set of answers ("enter all solutions", MATH's convention; ordered
     answers are written as tuples "(a, b)"), as math-verify reads it: "4, 10, -2" = "10, 4, -2".
  R8 exact rationals vs decimal expansions (math-verify's own, kept and tested): equal when they
     agree to float_rounding (6) decimals ("0.333333" is 1/3, "0.3333" is not); mixed numbers:
     2\\frac{1}{2} = 5/2 (math-verify's reading, with or without a space) and, added here, the
     plain "3 1/2" = 7/2 (math-verify alone reads "a b/c" as (a + b)/c, so "3 1/2" would match
     a gold of 2).
  R9-R13 live in _math_rules.py: R9 units after a number, in each element of a list ("10
     weeks", "10weeks", "10 cm^2", "5 square units", "12 \\text{ cm}" are the number; a glued
     short unit "10cm" is a product of variables, as a gold "10m" may be 10*m); R10 format
     repairs (a bare % is \\%, a trailing lone backslash is dropped, an over-escaped "\\\\frac"
     answer has its backslashes halved); R11 clock times (with AM/PM or seconds on either side;
     an unmarked time is the 24-hour clock: "20:34" is "8:34 PM", "3:00" is not "3:00 PM"); R12
     a decimal comma in the answer against a gold decimal, when not followed by exactly three
     digits ("1000,99" = 1000.99; a comma gold stays a list); R13 after math-verify says no:
     f(x) = ... against y = ... by their right sides, numbers equal to 1e-9 relative
     (scientific notation; never a rounding: 3.1416 is not pi), a one-row/one-column matrix
     against a tuple entry by entry, and expressions whose difference simplifies to 0 (floats
     as rationals; symbols positive only when the gold takes roots of them). Matrices are
     compared element-wise by math-verify itself.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from brorl_jax.rewards import _math_rules as rules
from brorl_jax.rewards.types import RewardResult, require_field

# R2: a final-answer commitment; group 1 is the rest of the line. Several patterns may be given
# (rewards option final_answer_pattern: one regex or a list); the last match in the text wins.
DEFAULT_FINAL_ANSWER_PATTERN: tuple[str, ...] = (
    r"(?i)\bfinal\s+answer\b[ \t*_]*(?:is\b)?[ \t*_]*[:：]?[ \t*_]*([^\n]*)",
    r"(?im)^[ \t>*#_]*answer\b[ \t*_]*[:：]?[ \t*_]*([^\n]*)",
    r"(?i)\b(?:the|our|my)\s+(?:final\s+)?(?:answer|solution)\s+is\b[ \t:]*([^\n]*)",
    r"(?i)(\$[^$\n]+\$|\\\(.+?\\\))\s+is\s+(?:our|the|my)\s+(?:final\s+)?(?:answer|solution)\b",
)
_END_OF_TURN = re.compile(r"<\|(?:im_start|im_end|endoftext|eot_id)\|>")


def _box_content(text: str, i: int) -> tuple[str, int] | None:
    """(content, end index) of the box argument starting at text[i], or None."""
    if text.startswith("{", i):
        depth = 0
        for j in range(i, len(text)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j], j + 1
        return None  # unbalanced: not an answer
    m = re.match(r" +([^\s$]+)", text[i:])  # "\boxed 5"
    return (m.group(1), i + m.end()) if m else None


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Every balanced \\boxed{...} / \\fbox{...} as (start, end, content), in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text):
        got = _box_content(text, m.end())
        if got is not None:
            out.append((m.start(), got[1], got[0]))
    # a box inside a box counts once (the outer one)
    nested = [b for b in out if any(o[0] < b[0] and b[1] <= o[1] for o in out)]
    return [b for b in out if b not in nested]


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of `\\boxed 5`."""
    boxes = _boxes(text)
    return boxes[-1][2] if boxes else None


_ASSIGN = r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*="
_SPACING = re.compile(r"\\(?:quad|qquad|,|;|:|!| |enspace|hspace\{[^}]*\})|~|\$|\\[()\[\]]|&|\\\\")


def _is_connector(gap: str) -> bool:
    """R1: text between two boxes that joins them into one answer."""
    gap = re.sub(r"\\(?:text|textbf|mathrm)\s*\{([^{}]*)\}", r" \1 ", gap)
    gap = re.sub(r"(?i)\bfor\s+part\s+\(?[a-z0-9]\)?", " ", gap)       # a part label
    gap = re.sub(r"^\s*[A-Za-z]+(?=\s*(?:[,;]|\band\b|\bor\b))", " ", gap)  # "\\boxed{1} papers and"
    gap = _SPACING.sub(" ", gap)
    gap = re.sub(_ASSIGN, " ", gap)
    gap = re.sub(r"(?i)\b(?:and|or)\b|[,;.]", " ", gap)
    return not gap.strip()


def _box_group(text: str, boxes: list[tuple[int, int, str]]) -> str:
    """R1: the last box and the boxes before it that only connectors separate from it."""
    group = [len(boxes) - 1]
    while group[0] > 0 and _is_connector(text[boxes[group[0] - 1][1]:boxes[group[0]][0]]):
        group.insert(0, group[0] - 1)
    if len(group) == 1:
        return boxes[group[0]][2].strip()
    parts = []
    for k in group:
        start, _, content = boxes[k]
        before = text[boxes[k - 1][1] if k > group[0] else max(0, start - 40):start]
        name = re.search(r"(" + _ASSIGN + r")\s*\$?\s*(?:\\\(\s*)?$", before)
        content = content.strip()
        parts.append(f"{name.group(1)} {content}" if name and "=" not in content else content)
    return ", ".join(parts)


def _strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b) and len(s) >= len(a) + len(b) and \
                not (b == "$" and s.endswith("\\$")):
            inner = s[len(a):len(s) - len(b)]
            plain = inner.replace("\\$", "")          # an escaped \$ is a dollar sign
            if a not in plain and b not in plain:
                return inner.strip()
    return s


def _clean_sentence(answer: str) -> str | None:
    """R2: the answer inside a final-answer sentence, or None when it commits to nothing."""
    boxes = _boxes(answer)
    if boxes:
        return _box_group(answer, boxes)
    answer = re.split(r"(?i)[.!]?\s*I hope it is correct", answer)[0]
    answer = re.sub(r"(?i)^\s*(?:the\s+)?(?:final\s+)?answer\s+is\b\s*:?", "", answer)
    answer = re.split(r"(?<![\d.])\.\s+(?=[A-Z])", answer)[0]  # the first sentence
    # "The largest $n$ is 34" -> "34": words (outside math) before the last " is "
    m = re.match(r"(?is)^(.*[A-Za-z].*?)\s\bis\b\s+(.+)$", answer)
    if m and re.search(r"[A-Za-z]{2,}", re.sub(r"\$[^$]*\$|\\\(.*?\\\)", "", m.group(1))):
        answer = m.group(2)
    answer = answer.strip().rstrip(".").strip(" \t*_")
    answer = re.sub(r'^(?:\\?")+|(?:\\?")+$', "", answer).strip()   # "quoted" answers
    answer = _strip_math_delimiters(answer).rstrip(".").strip()
    if not answer or re.match(r"(?i)not\b", answer):
        return None
    if re.search(r"(?<!\\)\$|\\\(", answer):
        # several math pieces: only connectors may sit between them ("$5$ or $6$" is the hedge
        # {5, 6}); words there ("$5$, not $6$") make it no answer, never math-verify's pick
        outside = re.sub(r"(?<!\\)\$[^$]*\$|\\\(.*?\\\)", " ", answer)
        if [w for w in re.findall(r"[A-Za-z]{2,}", outside) if w.lower() not in ("and", "or")]:
            return None
        answer = re.sub(r"(?<!\\)\$|\\[()]", " ", answer).strip()
    if not re.search(r"\$|\\[(\[]|\\[A-Za-z]", answer) and \
            len(re.findall(r"[A-Za-z]{2,}", answer)) >= 2:
        # plain prose ("Jane started growing Sphere 3 hours ago"): its one number, if one
        numbers = re.findall(r"[-+]?\d[\d,]*(?:\.\d+)?", answer)
        return numbers[0] if len(numbers) == 1 else None
    return answer


def extract_answer(completion: str,
                   final_answer_pattern: str | Sequence[str] | None = DEFAULT_FINAL_ANSWER_PATTERN
                   ) -> str | None:
    """The answer the completion commits to, or None when it commits to none (R0, R1, R2)."""
    completion = _END_OF_TURN.split(completion, 1)[0]
    boxes = _boxes(completion)
    patterns = ([final_answer_pattern] if isinstance(final_answer_pattern, str)
                else list(final_answer_pattern or ()))
    lines = []
    for pattern in patterns:
        for m in re.finditer(pattern, completion):
            text = m.group(1)
            opened = text.strip()
            if opened in ("\\(", "\\[", "$$", "$"):   # "Answer \\(" + the answer on next lines
                close = {"\\(": "\\)", "\\[": "\\]", "$$": "$$", "$": "$"}[opened]
                end = completion.find(close, m.end(1))
                if end != -1:
                    text = completion[m.start(1):end + len(close)]
            lines.append((m.start(), text))
    last_box_end = boxes[-1][1] if boxes else -1
    # a final-answer line after the last box wins (R2), if it holds an answer
    for start, text in sorted(lines, reverse=True):
        if start < last_box_end:
            break
        answer = _clean_sentence(text)
        if answer:
            return answer
    if boxes:
        answer = _box_group(completion, boxes)
        return answer or None
    return None


_THOUSANDS = re.compile(r"(?<![\d.,])(\d{1,3})((?:(?:\s|\\,|\\ |\\;|~|\{\\,\}|\\!)\d{3})+)(?![\d])")
_TRIG = r"\\(?:sin|cos|tan|cot|sec|csc)"
_DEGREE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)")


_MIXED_PLAIN = re.compile(r"(?<![\d.,/])(\d+)\s+(\d+)/(\d+)(?![\d./])")


def _mixed(m: re.Match) -> str:
    whole, num, den = m.groups()
    return f"({whole} + \\frac{{{num}}}{{{den}}})"


def normalize_answer(answer: str) -> str:
    """String rules applied to both answers before math-verify parses them (R3, R5, R8-R10)."""
    answer = rules.strip_units(rules.repair(answer))
    answer = _THOUSANDS.sub(lambda m: m.group(1) + re.sub(r"\D", "", m.group(2)), answer)
    answer = _MIXED_PLAIN.sub(_mixed, answer)
    if re.search(_TRIG, answer):
        answer = _DEGREE.sub(r"(\1 \\cdot \\frac{\\pi}{180})", answer)
    return answer


_COMMA_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _single_number(parsed: list) -> bool:
    import sympy
    return bool(parsed) and isinstance(parsed[0], sympy.Number)


def _imaginary_unit(exprs: list, allowed: bool) -> list:
    """R4: free symbol i -> sympy.I in parsed expressions."""
    if not allowed:
        return exprs
    import sympy
    out = []
    for e in exprs:
        if isinstance(e, sympy.Basic):
            i = [s for s in e.free_symbols if getattr(s, "name", None) == "i"]
            if i:
                try:
                    e = e.subs(i[0], sympy.I)
                except Exception:  # noqa: BLE001 - keep math-verify's reading
                    pass
        out.append(e)
    return out


def _as_solution_set(e):
    """R6: a one-variable inequality (or and/or/set of them) as its solution set, else None."""
    import sympy
    from sympy.core.relational import Relational

    def one(x):
        if isinstance(x, Relational) and not isinstance(x, (sympy.Eq, sympy.Ne)):
            return x
        if isinstance(x, (sympy.And, sympy.Or)) and all(one(a) is not None for a in x.args):
            return x
        return None

    parts = list(e.args) if isinstance(e, sympy.FiniteSet) else [e]
    if not parts or any(one(p) is None for p in parts):
        return None
    parts = [_bounded_as_symbol(p) for p in parts]
    symbols = set().union(*(p.free_symbols for p in parts))
    if len(symbols) != 1:
        return None
    (x,) = symbols
    try:
        return sympy.Union(*(p.as_set() for p in parts)) if x.is_real is not False else None
    except Exception:  # noqa: BLE001 - not a solvable inequality: leave it
        return None


def _bounded_as_symbol(e):
    """R6: in `0 < f(x) < 1` the bounded expression f(x) plays the variable (its range)."""
    import sympy
    from sympy.core.function import AppliedUndef
    bounded = {a for a in sympy.preorder_traversal(e) if isinstance(a, AppliedUndef)}
    if len(bounded) == 1:
        return e.subs(bounded.pop(), sympy.Symbol("_bounded", real=True))
    return e


def _membership_as_set(exprs: list) -> list:
    """R6: `x \\in [-2, 7]` (math-verify: Eq(x, Interval)) is the interval itself."""
    import sympy
    return [e.rhs if isinstance(e, sympy.Eq) and isinstance(e.lhs, sympy.Symbol)
            and isinstance(e.rhs, sympy.Set) else e for e in exprs]


def _relations_vs_sets(gold: list, pred: list) -> tuple[list, list]:
    import sympy
    from sympy.core.relational import Relational

    def relation(side):
        return any(isinstance(e, (Relational, sympy.And, sympy.Or)) for e in side)
    if relation(pred):
        gold = _membership_as_set(gold)
    if relation(gold):
        pred = _membership_as_set(pred)

    def convert(side, other):
        if not any(isinstance(o, sympy.Set) and not isinstance(o, sympy.FiniteSet)
                   for o in other):
            return side
        out = []
        for e in side:
            s = _as_solution_set(e) if isinstance(e, sympy.Basic) else None
            out.append(e if s is None else s)
        return out

    return convert(gold, pred), convert(pred, gold)


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


def _answer_latex(answer: str) -> str:
    """An extracted answer as math-verify gets it: boxed, without $ delimiters, so that
    math-verify reads all of it and never picks an expression out of it."""
    answer = _strip_math_delimiters(answer)
    answer = re.sub(r"(?<!\\)\$", " ", answer).strip()
    return "\\boxed{" + answer + "}"


def gold_answer(truth: Any) -> str:
    """The answer a ground truth states: itself, or its committed answer when it is a worked
    solution with boxes (read by the same rules as a completion)."""
    text = str(truth)
    if _boxes(text):
        return extract_answer(text) or text
    return text


def answers_match(gold: Any, answer: str, *, float_rounding: int = 6) -> bool | None:
    """True/False when math-verify (with R3-R8 around it) judges `answer` equal to `gold`;
    None when `answer` cannot be parsed; "gold" when the gold cannot. No deadline here."""
    from math_verify import parse, verify

    gold_text = gold_answer(gold)
    for rule in (rules.clock_times_match, rules.decimal_comma_match):   # R11, R12
        verdict = rule(_strip_math_delimiters(gold_text), _strip_math_delimiters(answer))
        if verdict is not None:
            return verdict
    pred = parse(_answer_latex(normalize_answer(answer)), parsing_timeout=None)
    if not pred:
        return None
    gold_parsed = parse(_as_latex(normalize_answer(gold_text)), parsing_timeout=None)
    if not gold_parsed:
        return "gold"  # type: ignore[return-value]
    if _COMMA_THOUSANDS.fullmatch(answer.strip()) and _single_number(gold_parsed):
        pred = parse(_answer_latex(answer.replace(",", "")), parsing_timeout=None)
    unit = not re.search(r"_\{?i\b|\\sum_\{?i\b|\\prod_\{?i\b", gold_text)
    g = _imaginary_unit(list(gold_parsed), unit)
    p = _imaginary_unit(list(pred), unit)
    g, p = _relations_vs_sets(g, p)
    if verify(g, p, float_rounding=float_rounding, timeout_seconds=None):
        return True
    return _after_math_verify(g, p, float_rounding)


def _after_math_verify(g: list, p: list, float_rounding: int) -> bool:
    """R13: the comparisons math-verify does not make, on its first readings."""
    from math_verify import verify
    if not (g and p):
        return False
    try:
        rhs = rules.function_rhs(g[0], p[0])
        if rhs is not None:
            return bool(verify(rhs[0], rhs[1], float_rounding=float_rounding,
                               timeout_seconds=None))
        vector = rules.vector_entries(g[0], p[0])
        if vector is not None:
            return all(verify(a, b, float_rounding=float_rounding, timeout_seconds=None)
                       for a, b in zip(*vector))
        return rules.same_number(g[0], p[0]) or rules.simplify_equal(g[0], p[0])
    except Exception:  # noqa: BLE001 - sympy gave up: math-verify's "no" stands
        return False


def math_reward(record: Mapping[str, Any], completion: str, *,
                final_answer_pattern: str | Sequence[str] | None = DEFAULT_FINAL_ANSWER_PATTERN,
                verify_timeout_s: float | None = 5.0, float_rounding: int = 6,
                time_budget_s: float | None = None) -> RewardResult:
    """1.0 when the extracted answer is equivalent to ground_truth under math-verify (with the
    rules of the module docstring), else 0.0.

    ground_truth: a string (LaTeX or plain; a worked solution with a box is read like a
    completion), a number, or a list of acceptable answers.
    verify_timeout_s: in-process deadline for parse+verify (None: rely on the scoring
    service's per-item timeout, which kills the worker).
    """
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
        verdicts = [answers_match(gold, answer, float_rounding=float_rounding) for gold in golds]
        if any(v is True for v in verdicts):
            return True
        if all(v is None for v in verdicts):
            return None
        return False if any(v is False for v in verdicts) else "gold"

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
        return any(any(not isinstance(x, str)
                       for x in parse(_as_latex(normalize_answer(gold_answer(g))),
                                      parsing_timeout=None))
                   for g in golds)

    try:
        ok = _with_deadline(timeout_s, _any_parses)
    except VerifyTimeout:
        return
    if not ok:
        raise ValueError(f"math-verify cannot parse the ground truth {str(truth)[:80]!r} as a "
                         "math expression, so no answer could ever match it")

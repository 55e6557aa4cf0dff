"""Rules R9-R13 of the math verifier (math_reward's docstring lists them; each has positive and
near-miss tests in tests/rewards/test_rewards_math.py). String rules run on both answers before
math-verify parses them; the comparisons run after it says "not equal"."""

from __future__ import annotations

import re

# ----- R9 units after a number -----------------------------------------------------------------
# words that are mathematics, never a unit
_MATH_WORDS = frozenset("""and or sqrt sin cos tan cot sec csc log ln exp pi inf infinity mod pmod
det max min gcd lcm arcsin arccos arctan sinh cosh tanh i e""".split())
# short units read as units only when spaced from the number ("10 cm"); glued ("10cm") they are
# a product of variables, as a gold "10m" may mean 10*m
_SHORT_UNITS = frozenset("cm mm km m ft in yd mi kg mg lb oz ml mL".split())
_TRAILING_UNIT = re.compile(
    r"(?s)(?P<head>.*?[\d}])(?P<space>\s*)(?P<words>[A-Za-z]+(?:\s+[A-Za-z]+){0,2})"
    r"(?P<power>\s*\^\s*\{?\s*[23]\s*\}?)?\s*")
_PLAIN_NUMBER = re.compile(r"\s*[-+]?\d+(?:\.\d+)?\s*")


def _top_level_parts(text: str) -> list[str]:
    """text split at the commas outside any bracket (the separators stay with the parts)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(text[start:i + 1])
            start = i + 1
    return parts + [text[start:]]


def strip_units(answer: str) -> str:
    """R9, on each element of a list: `5 weeks`, `10weeks`, `10 cm^2` -> the number; `10cm` ->
    10 * c * m (glued short units are variables)."""
    parts = _top_level_parts(answer)
    return "".join(_strip_unit(p[:-1]) + "," if p.endswith(",") else _strip_unit(p)
                   for p in parts)


def _strip_unit(answer: str) -> str:
    # a unit in \\text{...} reads as spaced words: "10\\text{cm}" is "10 cm"
    plain = re.sub(r"\\(?:text|mbox|mathrm|textnormal|textrm)\s*\{\s*([A-Za-z][A-Za-z ]*)\}"
                   r"(?=\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*$)", r" \1", answer)
    if plain != answer:
        stripped = _strip_unit(plain)
        return stripped if stripped != plain else answer
    m = _TRAILING_UNIT.fullmatch(answer)
    if not m:
        return answer
    words = m.group("words").split()
    if any(w.lower() in _MATH_WORDS for w in words):
        return answer
    if len(words) == 1 and len(words[0]) <= 2:
        if m.group("space"):
            return m.group("head") if words[0] in _SHORT_UNITS else answer
        if _PLAIN_NUMBER.fullmatch(m.group("head")):   # "10cm": variables, kept as a product
            return f"{m.group('head')}\\cdot{{{words[0]}}}{m.group('power') or ''}"
        return answer
    return m.group("head")


# ----- R10 small format repairs ----------------------------------------------------------------
_OVER_ESCAPED = re.compile(r"\\\\(?:begin|end|frac|dfrac|tfrac|sqrt|pi|cdot|left|right|text)\b")


def repair(answer: str) -> str:
    """R10: `28 %` is 28\\% (a bare % is a LaTeX comment); a trailing lone backslash is dropped;
    an over-escaped answer (`\\\\frac`, `\\\\begin{matrix} x \\\\\\\\ 1`) has its backslashes halved."""
    answer = re.sub(r"\s*(?<!\\)%", r"\\%", answer)
    answer = re.sub(r"(?<!\\)\\\s*$", "", answer)
    if _OVER_ESCAPED.search(answer):
        answer = re.sub(r"(?:\\\\)+", lambda m: "\\" * (len(m.group(0)) // 2), answer)
    return answer


# ----- R11 clock times -------------------------------------------------------------------------
_TIME = re.compile(r"(?i)(\d{1,2}):([0-5]\d)(?::([0-5]\d))?\s*([ap])?\.?\s*(m\.?)?")


def _seconds_of_day(answer: str) -> tuple[int, bool] | None:
    text = re.sub(r"\\(?:text|mathrm|textnormal|mbox)\s*\{([^{}]*)\}", r"\1", answer)
    text = text.replace("$", "").replace("\\ ", " ").strip()
    m = _TIME.fullmatch(text)
    if not m or (m.group(4) is None) != (m.group(5) is None):
        return None
    hour, minute, second = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    marked = m.group(4) is not None
    if marked:
        if not 1 <= hour <= 12:
            return None
        hour = hour % 12 + (12 if m.group(4).lower() == "p" else 0)
    elif hour > 23:
        return None
    return hour * 3600 + minute * 60 + second, marked or m.group(3) is not None


def clock_times_match(gold: str, answer: str) -> bool | None:
    """R11: times of day compared as times when either carries AM/PM or seconds (an unmarked
    time is the 24-hour clock: 20:34 = 8:34 PM = 20:34:00, 3:00 != 3:00 PM); None when the rule
    does not apply (plain hh:mm against hh:mm stays math-verify's, which may read a ratio)."""
    g, a = _seconds_of_day(gold), _seconds_of_day(answer)
    if g is None or a is None or not (g[1] or a[1]):
        return None
    return g[0] == a[0]


# ----- R12 decimal commas ----------------------------------------------------------------------
_DECIMAL_COMMA = re.compile(r"\s*([-+]?\d+),(\d+)\s*")
_DECIMAL_POINT = re.compile(r"\s*[-+]?\d*\.\d+\s*")


def decimal_comma_match(gold: str, answer: str) -> bool | None:
    """R12: the gold a decimal with a point, the answer one number with a single comma not
    followed by exactly three digits (so not a thousands separator): the comma is a decimal
    point. An answer list such as {2, 5} can never equal a single decimal, so the rule only
    turns a no into a yes when every digit agrees. Never the other way round: a gold "-2,1"
    is the list of roots {-2, 1}, not -2.1. None when it does not apply."""
    from fractions import Fraction

    m = _DECIMAL_COMMA.fullmatch(answer)
    if m and len(m.group(2)) != 3 and _DECIMAL_POINT.fullmatch(gold):
        return Fraction(f"{m.group(1)}.{m.group(2)}") == Fraction(gold.strip())
    return None


# ----- R13 after math-verify: function equations, symbolic simplification --------------------
def _is_function_name(e) -> bool:
    import sympy
    from sympy.core.function import AppliedUndef
    return isinstance(e, AppliedUndef) or (isinstance(e, sympy.Symbol) and e.name == "y")


def function_rhs(g, p):
    """R13a: `f(x) = 2x + 3` and `y = 2x + 3` name the same function: their right sides, when
    both are equations whose left side is y or f(x) (and at least one is f(x)); else None."""
    import sympy
    from sympy.core.function import AppliedUndef
    if not (isinstance(g, sympy.Eq) and isinstance(p, sympy.Eq)):
        return None
    if not (_is_function_name(g.lhs) and _is_function_name(p.lhs)) or g.lhs == p.lhs:
        return None
    if not (isinstance(g.lhs, AppliedUndef) or isinstance(p.lhs, AppliedUndef)):
        return None
    return g.rhs, p.rhs


def simplify_equal(g, p) -> bool:
    """R13b: two expressions with free symbols whose difference simplifies to 0, floats read as
    rationals (x^{0.5} = \\sqrt{x}); then, when the gold itself takes a root or a fractional
    power of its symbols (so it presumes them positive), symbols are positive reals, unless
    either side uses |.|, sign or a piecewise (gold x against \\sqrt{x^2} stays 0)."""
    import sympy
    exprs = (g, p)
    if not all(isinstance(e, sympy.Expr) and e.free_symbols for e in exprs):
        return False
    if any(e.count_ops() > 120 for e in exprs):
        return False
    diff = sympy.nsimplify(g - p, rational=True)
    if sympy.simplify(diff) == 0:
        return True
    if any(e.has(sympy.Abs, sympy.sign, sympy.Piecewise) for e in exprs):
        return False
    roots = [a for a in sympy.preorder_traversal(sympy.nsimplify(g, rational=True))
             if isinstance(a, sympy.Pow) and not a.exp.is_integer and a.base.free_symbols]
    if not roots:
        return False
    positive = {s: sympy.Symbol(s.name, positive=True) for s in diff.free_symbols
                if isinstance(s, sympy.Symbol)}
    return sympy.simplify(diff.subs(positive)) == 0


def same_number(g, p) -> bool:
    """R13c: two numbers equal to 1e-9 relative (one written in scientific notation:
    2.314814814815 \\times 10^{-3} = 1/432); never a rounding (3.1416 is not \\pi)."""
    import sympy
    if not all(isinstance(e, sympy.Expr) and e.is_number for e in (g, p)):
        return False
    try:
        a, b = complex(sympy.N(g, 30)), complex(sympy.N(p, 30))
    except (TypeError, ValueError):
        return False
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) and max(abs(a), abs(b)) > 0


def vector_entries(g, p):
    """R13d: a one-row or one-column matrix against a tuple or a bracketed pair (math-verify reads
    [0.5, 1] as an interval): their entries, in order, when the counts agree; else None."""
    import sympy
    from sympy.matrices import MatrixBase
    if not isinstance(g, MatrixBase) or min(g.shape) != 1:
        return None
    if isinstance(p, sympy.Tuple):
        entries = list(p)
    elif isinstance(p, sympy.Interval) and p.start.is_finite and p.end.is_finite:
        entries = [p.start, p.end]
    else:
        return None
    return (list(g), entries) if len(entries) == len(g) else None

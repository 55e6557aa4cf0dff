"""The `math` verifier against graded answer pairs from other graders' public test suites.

    python bench/math_graders.py --pairs FILE.jsonl [--show-misses]

FILE holds one JSON object per line: `gold`, `prediction`, `expected` (1 = equivalent, 0 = not),
`form` and `source`. `form` says what the prediction is: "completion" is scored as the model's
text as is; "answer" is an answer a grader receives already extracted, scored as the completion
"\\boxed{<answer>}"; "free-flow" is prose that commits to no final answer, which the source
graders mine for its last expression and this verifier scores 0 by design (reading an
uncommitted completion is the restated-question reward hack; see math_reward's docstring).

Prints agreement, false accepts (a wrong answer scored 1: a reward hack) and false rejects over
the "completion" and "answer" cases, and checks that every free-flow case scores 0. The goal
(issue 27): agreement >= 0.97 and no false accept. Exit 1 when a goal is missed, 2 on bad input.

The pairs are not shipped with the project: they are transcribed from other projects' test
suites (e.g. huggingface/Math-Verify's `tests/*.py` parametrizations, hendrycks/math's
`math_equivalence_test.py`, MARIO_EVAL's `test_is_equiv.py`, NeMo-Skills' `test_math_equal.py`;
docs/rewards.md names the commits measured); build the file from the suites you trust. The rule-by-rule
positive and near-miss tests of our own are in tests/rewards/test_rewards_math.py.
"""
from __future__ import annotations

import argparse
import json
import sys

from brorl_jax.rewards.math_reward import math_reward

FORMS = ("answer", "completion", "free-flow")


def load(path: str) -> list[dict]:
    cases = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
                assert case["form"] in FORMS and case["expected"] in (0, 1)
                str(case["gold"]), str(case["prediction"])
            except (ValueError, KeyError, AssertionError, TypeError):
                raise SystemExit(f"error: {path} line {i}: needs gold, prediction, expected (0/1) "
                                 f"and form (one of {', '.join(FORMS)})") from None
            cases.append(case)
    if not cases:
        raise SystemExit(f"error: {path} holds no pairs")
    return cases


def score(case: dict):
    completion = case["prediction"]
    if case["form"] == "answer":
        completion = "\\boxed{" + completion + "}"
    return math_reward({"data_source": "math", "ground_truth": case["gold"]}, completion)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", required=True, help="JSONL of graded pairs (see the docstring)")
    ap.add_argument("--show-misses", action="store_true", help="print every disagreement")
    args = ap.parse_args(argv)
    try:
        cases = load(args.pairs)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    graded = [c for c in cases if c["form"] != "free-flow"]
    free = [c for c in cases if c["form"] == "free-flow"]
    verdicts = [int(score(c).score == 1.0) for c in graded]
    misses = [(c, v) for c, v in zip(graded, verdicts) if v != c["expected"]]
    false_accepts = [c for c, v in misses if v == 1]
    agreement = 1 - len(misses) / max(len(graded), 1)
    free_bad = [c for c in free if score(c).score != 0.0]
    print(f"pairs: {len(cases)} ({len(graded)} graded, {len(free)} free-flow)")
    print(f"agreement {agreement:.3f} | false accepts {len(false_accepts)} | "
          f"false rejects {len(misses) - len(false_accepts)} | free-flow accepted {len(free_bad)}")
    if args.show_misses:
        for c, v in misses:
            print(f"  got {v} want {c['expected']}: gold {c['gold']!r} | "
                  f"prediction {c['prediction'][-160:]!r} | {c.get('source', '')}")
    ok = agreement >= 0.97 and not false_accepts and not free_bad
    print("goal (agreement >= 0.97, no false accept):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

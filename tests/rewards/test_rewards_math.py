"""Math verifier: extraction is strict, equivalence is math-verify's."""

import pytest

from brorl_jax.rewards.math_reward import extract_answer, extract_boxed, math_reward


def _score(truth, completion, **options):
    return math_reward({"data_source": "math", "ground_truth": truth}, completion, **options)


@pytest.mark.parametrize("truth, completion", [
    ("\\frac{1}{2}", "Half of it, so the answer is \\boxed{0.5}."),          # fraction vs decimal
    ("0.5", "We get $\\boxed{\\dfrac{1}{2}}$"),                                # decimal vs LaTeX
    ("\\frac{3}{4}", "Reasoning...\nFinal Answer: 3/4"),                     # LaTeX vs plain
    ("1/3", "\\boxed{\\frac{1}{3}}"),                                         # plain vs LaTeX
    ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
    ("x^2 + 1", "\\boxed{1 + x^{2}}"),
    ("10", "first \\boxed{7}, corrected: \\boxed{10.0}"),                    # last box counts
    ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),
    (["4", "four"], "\\boxed{4}"),                                            # list of golds
])
def test_equivalent_forms_score_one(truth, completion):
    result = _score(truth, completion)
    assert result.score == 1.0, result
    assert result.reason == "correct"


@pytest.mark.parametrize("truth, completion", [
    ("\\frac{1}{2}", "\\boxed{0.6}"),
    ("\\pi", "\\boxed{3.14}"),
    ("10", "\\boxed{10} is wrong, the answer is \\boxed{11}"),
    ("x^2+1", "\\boxed{x^2-1}"),
])
def test_wrong_answers_score_zero(truth, completion):
    result = _score(truth, completion)
    assert result.score == 0.0 and result.reason == "wrong answer", result


@pytest.mark.parametrize("completion", [
    "I think it is one half.",
    "The answer is \\boxed{}",
    "\\boxed{1/2",                      # unbalanced braces are not an answer
    "",
])
def test_missing_answer_scores_zero(completion):
    result = _score("\\frac{1}{2}", completion)
    assert result.score == 0.0 and result.reason == "no answer extracted", result


def test_restating_the_question_scores_zero():
    question = "Compute $\\frac{1}{2} + \\frac{1}{2}$ and simplify."
    # The hack this guards against: math-verify's own extraction finds the restated
    # expression and grades it correct when handed the whole completion.
    from math_verify import parse, verify
    assert verify(parse("$1$"), parse(question))
    result = _score("1", question)
    assert result.score == 0.0 and result.reason == "no answer extracted"


def test_extraction_helpers():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b \\fbox{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed 5 apples") == "5"
    assert extract_answer("**Final Answer:** $42$.") == "42"
    assert extract_answer("Final answer: 7", final_answer_pattern=None) is None
    assert extract_answer("#### 12", final_answer_pattern=r"####\s*(\S+)") == "12"


def test_pathological_expression_times_out_in_process():
    result = _score("1", "\\boxed{9^{9^{9^{9}}}}", verify_timeout_s=0.5)
    assert result.score == 0.0 and result.reason.startswith("verify timeout")


def test_record_without_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="ground_truth"):
        math_reward({"data_source": "math"}, "\\boxed{1}")

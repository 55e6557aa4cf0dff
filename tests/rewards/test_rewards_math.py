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
    "Put your final answer within \\boxed{}",    # a restated instruction commits to nothing
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


# ----- the rules around math-verify (math_reward's docstring, R0-R8): each with near misses ---

@pytest.mark.parametrize("truth, completion", [
    # R1 multi-box
    ("2, 3", "So x = \\boxed{2} or x = \\boxed{3}."),
    ("\\{2, 3\\}", "$x = \\boxed{2}$ and $x = \\boxed{3}$"),
    ("k = 45, n = 2", "$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$"),
    ("1, 2, 3", "\\boxed{1}, \\boxed{2}, \\boxed{3}"),
    # R2 final-answer sentences and their precedence
    ("34", "Final Answer: The largest $n$ is 34."),
    ("34", "We guessed \\boxed{30} first.\n\nFinal Answer: The final answer is $34$. I hope it "
           "is correct."),
    ("(-6, 10)", "The interval is \\( (-6, 10) \\). Final Answer: The final answer is "
                 "\\((-6, 10)\\). I hope it is correct."),
    ("9", "Answer: $9$"),
    ("9", "Answer \\(\n9\n\\)"),
    ("x \\leq 2", "Thus $x <= 2$ is our answer."),
    ("3", "Final Answer: Jane started growing Sphere 3 hours ago."),
    # R0 the turn ends at a chat-template token
    ("5", "\\boxed{5}<|im_end|><|im_start|>user\nNow \\boxed{7}"),
    # R3 thousands separators
    ("1000", "\\boxed{1 000}"),
    ("1234567", "\\boxed{1\\,234\\,567}"),
    ("10455", "\\boxed{10,455}"),
    # R4 the imaginary unit
    ("-1", "\\boxed{i^2}"),
    ("2i", "\\boxed{\\sqrt{-4}}"),
    ("1+2i", "\\boxed{2i+1}"),
    # R5 degrees inside trigonometric functions
    ("\\cos x", "\\boxed{\\sin(90^\\circ - x)}"),
    ("\\frac{1}{2}", "\\boxed{\\sin 30^{\\circ}}"),
    ("30", "\\boxed{30^\\circ}"),
    # R6 relations vs intervals, both directions
    ("(3, \\infty)", "\\boxed{x > 3}"),
    ("x > 3", "\\boxed{(3, \\infty)}"),
    ("(-\\infty, 2] \\cup [5, \\infty)", "\\boxed{x \\le 2 \\text{ or } x \\ge 5}"),
    # R7 a bare list is a set
    ("10, 4, -2", "\\boxed{4, 10, -2}"),
    # R8 rationals vs decimals, mixed numbers
    ("\\frac{1}{3}", "\\boxed{0.333333}"),
    ("\\frac{2}{3}", "\\boxed{0.6666666667}"),
    ("\\frac{5}{2}", "\\boxed{2\\frac{1}{2}}"),
    ("2\\frac{1}{2}", "\\boxed{\\frac{5}{2}}"),
    ("\\frac{5}{2}", "\\boxed{2 \\frac{1}{2}}"),
    ("\\frac{7}{2}", "\\boxed{3 1/2}"),
    ("-\\frac{7}{2}", "\\boxed{-3 1/2}"),
    # R1 connectors: a part label, a unit word right after a box
    ("(3, 3), (1, 1)", "\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}"),
    ("1, 2", "\\boxed{1} papers and \\boxed{2} bins"),
    # R2: "Answer $" + the answer on the next lines
    ("9", "Answer $\n9\n$"),
    # R6: a bounded expression plays the variable; "x in S" is S
    ("(0, 1)", "\\boxed{0<f(x)<1}"),
    ("x \\in [-2,7]", "\\boxed{-2 \\le x \\le 7}"),
    # R9 units after a number
    ("10", "\\boxed{10 weeks}"),
    ("10", "\\boxed{10weeks}"),
    ("10", "\\boxed{10 \\text{ cm}^2}"),
    ("10 cm^2", "\\boxed{10}"),
    ("5", "\\boxed{5 square units}"),
    ("12, 5", "\\boxed{12 \\text{ cm}} and \\boxed{5 cm}"),
    # R10 format repairs
    ("28\\%", "\\boxed{28 %}"),
    ("185", "\\boxed{185\\}"),
    ("\\\\frac{1}{2}", "\\boxed{0.5}"),
    ("\\\\begin{pmatrix} 1 \\\\\\\\ 2 \\\\end{pmatrix}", "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}"),
    # R11 clock times (an unmarked time is the 24-hour clock)
    ("20:34", "\\boxed{8:34 \\text{ P.M.}}"),
    ("20:34", "\\boxed{20:34:00}"),
    ("3:00 AM", "\\boxed{3:00}"),
    ("12:15 AM", "\\boxed{0:15}"),
    # R12 decimal commas
    ("1000.99", "\\boxed{1000,99}"),
    ("-2.5", "\\boxed{-2,50}"),
    # R13 function equations, simplification, scientific notation; matrices element-wise
    ("f(x) = 2x + 3", "\\boxed{y = 2x + 3}"),
    ("\\frac{v_{0}}{r_{0}} \\frac{1}{\\left(1+r / r_{0}\\right)^{3 / 2}}",
     "\\boxed{\\frac{v_0 \\cdot \\left(\\frac{r_0}{r + r_0}\\right)^{0.5}}{(r + r_0)}}"),
    ("\\frac{x^2-1}{x-1}", "\\boxed{x+1}"),
    ("2.314814814815 \\times 10^{-3}", "\\boxed{\\frac{1}{432}}"),
    ("\\begin{pmatrix} 1 & 1/2 \\\\ 1/3 & 4 \\end{pmatrix}",
     "\\boxed{\\begin{bmatrix} 1 & 0.5 \\\\ \\frac{1}{3} & 4 \\end{bmatrix}}"),
    ("\\begin{matrix} \\frac12 \\\\ 1 \\end{matrix}", "\\boxed{[0.5, 1]}"),
    ("\\begin{pmatrix} 1 & -2 & 3 \\end{pmatrix}", "\\boxed{(1, -2, 3)}"),
    # a gold written as a worked solution with a box is read like a completion
    ("so $n = \\boxed{1,-2}$.", "\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}"),
])
def test_rule_accepts_equivalent_answer(truth, completion):
    result = _score(truth, completion)
    assert result.score == 1.0, result


@pytest.mark.parametrize("truth, completion", [
    # R1: a box after other text replaces earlier ones; a hedge is a set, matching no single gold
    ("10", "first \\boxed{10}, then I rechecked: \\boxed{11}"),
    ("10", "\\boxed{7} or \\boxed{10}"),
    ("2, 3", "x = \\boxed{2} or x = \\boxed{4}"),
    ("2, 3", "\\boxed{2}"),
    ("2, 3", "\\boxed{2}, \\boxed{3}, \\boxed{5}"),
    ("k = 45, n = 2", "$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 3}$"),
    # R2: the last commitment wins; "not" and a prose hedge are no answer
    ("30", "We guessed \\boxed{30} first.\n\nFinal Answer: The final answer is $34$."),
    ("34", "Final Answer: The largest $n$ is 35."),
    ("34", "Final Answer: the answer is not 34"),
    ("3", "Final Answer: 3 or 4 hours"),
    ("9", "Answer: $8$"),
    ("x \\leq 2", "Thus $x < 2$ is our answer."),
    # hedges and words between math pieces are never math-verify's to pick from
    ("6", "The answer is $5$, not $6$."),
    ("5", "Final Answer: 5 (or 6 if rounding)"),
    ("5", "the answer is either 5 or 6"),
    ("5", "Final Answer: $5$ or $6$"),
    ("3", "Final Answer: between 3 and 4"),
    ("12", "The answer is \\boxed{12} or maybe \\boxed{13}"),
    ("12", "\\boxed{12}, \\boxed{13}"),
    # R0: what follows the end of the turn does not count
    ("7", "\\boxed{5}<|im_end|><|im_start|>user\nNow \\boxed{7}"),
    # R3: only groups of exactly three digits are joined
    ("100", "\\boxed{1 00}"),
    ("1234", "\\boxed{12 34}"),
    ("1000", "\\boxed{1 0000}"),
    ("1000.99", "\\boxed{1000,98}"),        # R12: a decimal comma must agree in every digit
    ("1.0", "\\boxed{1,000}"),               # R12: three digits after the comma are thousands
    ("2, 5", "\\boxed{2.5}"),                # R12: a list gold is not a single decimal
    ("25", "\\boxed{2,5}"),                  # R12: nor is an integer gold
    ("-2,1", "\\boxed{-2.1}"),               # R12: a comma gold is a list, never a decimal
    ("10, 455", "\\boxed{10455}"),           # a list gold keeps commas as separators
    # R4
    ("1", "\\boxed{i^2}"),
    ("2i", "\\boxed{\\sqrt{4}}"),
    ("1-2i", "\\boxed{1+2i}"),
    # R5
    ("\\sin x", "\\boxed{\\sin(90^\\circ - x)}"),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\sin 30^{\\circ}}"),
    ("31", "\\boxed{30^\\circ}"),
    # R6
    ("[3, \\infty)", "\\boxed{x > 3}"),
    ("x \\geq 3", "\\boxed{(3, \\infty)}"),
    ("(-\\infty, 2] \\cup [5, \\infty)", "\\boxed{x < 2 \\text{ or } x \\ge 5}"),
    # R7
    ("10, 4, -2", "\\boxed{4, 10, 2}"),
    ("10, 4, -2", "\\boxed{4, 10}"),
    # R8
    ("\\frac{1}{3}", "\\boxed{0.3333}"),
    ("\\frac{2}{3}", "\\boxed{0.667}"),
    ("\\frac{5}{2}", "\\boxed{2\\frac{1}{3}}"),
    ("1", "\\boxed{2\\frac{1}{2}}"),
    ("\\frac{3}{2}", "\\boxed{3 1/2}"),
    ("\\frac{7}{2}", "\\boxed{3 4/2}"),         # math-verify alone: (3 + 4)/2
    ("2", "\\boxed{3 1/2}"),                     # math-verify alone: (3 + 1)/2 = 2
    ("\\frac{7}{2}", "\\boxed{3 1/3}"),
    # R1: more than one word, or words before a connector, still replace earlier boxes
    ("1, 2", "\\boxed{1} no no no no no \\boxed{2}"),
    ("(3, 3), (1, 1)", "\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 2)}"),
    ("7", "\\boxed{7} wrong, \\boxed{10}"),           # joined: the set {7, 10}, no single gold
    # R6
    ("(0, 1)", "\\boxed{0<f(x)\\le 1}"),
    ("x \\in [-2,7]", "\\boxed{-2 < x \\le 7}"),
    # R9: never a different number; glued short letters are variables
    ("10", "\\boxed{11 weeks}"),
    ("100", "\\boxed{10 \\text{ cm}}"),
    ("10cm", "\\boxed{10}"),
    ("10m", "\\boxed{10}"),
    ("10", "\\boxed{10x}"),
    ("10", "\\boxed{10 x}"),
    ("12, 5", "\\boxed{12 cm} and \\boxed{6 cm}"),
    ("2", "\\boxed{2 \\sin x}"),
    ("3", "\\boxed{3 pi}"),
    # R10
    ("28\\%", "\\boxed{29 %}"),
    ("185", "\\boxed{186\\}"),
    # R11
    ("3:00 PM", "\\boxed{3:00}"),
    ("20:34", "\\boxed{8:34 \\text{ A.M.}}"),
    ("20:34", "\\boxed{20:34:01}"),
    ("12:00", "\\boxed{1:00 PM}"),
    # R13: a different function, a different variable, roundings, a different matrix
    ("f(x) = 2x + 3", "\\boxed{y = 2x + 4}"),
    ("x = 3", "\\boxed{y = 3}"),
    ("\\frac{x^2-1}{x-1}", "\\boxed{x-1}"),
    ("|x|", "\\boxed{x}"),
    ("x", "\\boxed{\\sqrt{x^2}}"),                     # symbols positive only if the gold's roots say so
    ("40\\pi", "\\boxed{125.663}"),
    ("\\pi", "\\boxed{3.1416}"),
    ("\\sqrt{2}", "\\boxed{1.414}"),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
     "\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}}"),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
     "\\boxed{\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}}"),
    ("\\begin{matrix} \\frac12 \\\\ 1 \\end{matrix}", "\\boxed{[1, 0.5]}"),   # entries in order
    ("\\begin{pmatrix} 1 & -2 & 3 \\end{pmatrix}", "\\boxed{(1, -2)}"),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\boxed{(1, 2, 3, 4)}"),  # not a vector
])
def test_rule_rejects_near_miss(truth, completion):
    result = _score(truth, completion)
    assert result.score == 0.0, result

"""veRL-style reward functions for the rewards.custom tests: plain veRL files (no brorl_jax
import), imported by path in the scoring workers."""
import re
import time

_calls = 0


def _answer(solution_str):
    found = re.findall(r"<answer>(.*?)</answer>", solution_str, re.S)
    return found[-1].strip() if found else solution_str.strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Float for an odd ground truth, veRL's dict for an even one."""
    correct = _answer(solution_str) == str(ground_truth).strip()
    try:
        even = int(str(ground_truth)) % 2 == 0
    except ValueError:
        even = False
    if even:
        return {"score": float(correct), "acc": float(correct), "length": len(solution_str)}
    return 1.0 if correct else 0.0


def flaky_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Like compute_score, but every third call in a process raises (the first two work, so the
    door check's call passes)."""
    global _calls
    _calls += 1
    if _calls % 3 == 0:
        raise ValueError(f"cannot grade {solution_str[:20]!r}")
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    """veRL's math_dapo scale: -1 / 1, times a reward_kwargs scale."""
    return scale if _answer(solution_str) == str(ground_truth) else -scale


def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "correct"


def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)
    return 1.0


def wrong_signature(solution, answer):
    return 1.0


def batch_score(data_sources, solution_strs, ground_truths, extra_infos=None):
    """The batched form; "raise" in a solution fails its chunk, "text" returns a string."""
    if any("raise" in s for s in solution_strs):
        raise RuntimeError("judge unavailable")
    if any("sleep" in s for s in solution_strs):
        time.sleep(60)
    out = []
    for s, g in zip(solution_strs, ground_truths):
        out.append("oops" if s == "text" else {"score": float(_answer(s) == str(g)),
                                               "batch": float(len(solution_strs))})
    return out


def returns_beyond_float32(data_source, solution_str, ground_truth, extra_info=None):
    return 1e300                    # finite in Python, inf once the update casts it to float32


def prints_a_lot(data_source, solution_str, ground_truth, extra_info=None):
    print("x" * 100_000)            # a reward function debugging itself, 100 kB a call
    return 0.0


def raises_on_real_completions(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.split("<answer>")[1].split("</answer>")[0] == ground_truth)

"""A reward function in veRL's format, used as is by brorl_jax:

    python -m brorl_jax.main --config=configs/tiny.py \
        --config.rewards.custom=examples/verl_compute_score.py:compute_score

veRL would take the same file with
    custom_reward_function.path=examples/verl_compute_score.py
    custom_reward_function.name=compute_score

It reads the answer between <answer> tags (the Reasoning Gym prompts' format) or after "####"
(GSM8K's) and compares it with the ground truth as a number when both are numbers, else as a
stripped string. It returns veRL's dict form: "score" is the reward, the other numeric fields
("acc", "format_ok") are logged per data source as reward_extra/<data_source>/<field>.
Nothing here imports brorl_jax: the file is the user's, imported by path in the scoring workers.
"""
import re

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.S)
_HASHES = re.compile(r"####\s*([^\n]+)")


def _extract(solution_str):
    for pattern in (_TAGGED, _HASHES):
        found = pattern.findall(solution_str)
        if found:
            return found[-1].strip()
    return None


def _same(answer, truth):
    try:
        return abs(float(answer.replace(",", "")) - float(str(truth).replace(",", ""))) < 1e-6
    except ValueError:
        return answer.strip() == str(truth).strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  format_score=0.0, score=1.0):
    answer = _extract(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format_ok": 0.0}
    correct = _same(answer, ground_truth)
    return {"score": score if correct else format_score, "acc": float(correct),
            "format_ok": 1.0}


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos=None):
    """veRL's batched form (BatchRewardManager): lists in, list out. A model-based judge or a
    remote service would send the whole list in one request here."""
    extra_infos = extra_infos or [None] * len(solution_strs)
    return [compute_score(d, s, g, e) for d, s, g, e in
            zip(data_sources, solution_strs, ground_truths, extra_infos)]

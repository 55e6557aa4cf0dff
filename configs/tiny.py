"""A tiny, fast config for smoke tests and kill-and-resume tests (seconds per step on CPU).

Same path as the demo (embedded model, Reasoning Gym arithmetic, SFT warm start, BroRL steps),
at the smallest sizes that still produce mixed groups for dynamic sampling.
"""
import json

from configs.demo import get_config as demo_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/tiny.py takes no preset argument (got {arg!r}): its sizes are "
                         "the tests'; set keys with --config.KEY=VALUE.")
    c = demo_config()
    c.name = "tiny"
    # One-digit sums: after a few dozen supervised steps about one answer in five is right, so
    # groups are mixed and every step really changes the parameters.
    c.data.reasoning_gym_kwargs = json.dumps(dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
        allow_parentheses=False, allow_negation=False))
    c.data.train_size = 2000
    c.data.eval_size = 16
    c.rollout.rollouts_per_prompt = 8
    c.algo.prompts_per_step = 2
    c.algo.micro_batch_size = 8
    c.algo.dynamic_sampling_cap_policy = "pad"      # a random-ish model may keep no group in a round
    c.algo.max_generation_rounds = 2
    c.sft.steps = 60
    c.sft.batch_size = 16
    c.sft.untagged_frac = 0.0           # plain references: the tests want mixed groups at once
    c.eval.num_prompts = 8
    c.eval.samples_per_prompt = 2
    c.eval.every = 0
    c.train.steps = 4
    c.train.checkpoint_every = 1
    c.train.plots = False
    c.rewards.num_workers = 1
    return c

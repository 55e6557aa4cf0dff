"""The embedded default: a real BroRL run on CPU in minutes, with no download.

A tiny Qwen2-shaped model with a character tokenizer is built locally (brorl_jax.models.
demo_model), warm-started by a short supervised phase on Reasoning Gym's basic_arithmetic (sums of
two 1-2 digit numbers), then trained with the BroRL recipe at N=64 (4x ProRL's 16; 16 prompts per
step). Held-out pass@1 (T=0.6, top-p 0.95) is printed before and after.

The warm-start data is deliberately imperfect: 70% of its reference answers are written without
the <answer> tags the Reasoning Gym verifier requires (sft.untagged_frac). Imitation learns both
formats; RL with the exact verifier learns that only one of them is rewarded, which a few dozen
steps can show on a CPU (arithmetic skill itself improves far more slowly at this scale: the
docs/results.md reports both parts of the gain). BroRL itself continues a strong checkpoint; this setup
only makes the loop's effect visible in minutes.
Preset arguments: configs/demo.py:n=16,steps=40 (used by the N=16 vs N=512 comparison);
configs/demo.py:moe=1 trains the demo model's mixture-of-experts sibling instead
(model.path="builtin:demo_moe": Qwen3-MoE shaped, 8 experts, top-2; models/demo_model.py), e.g.
with --config.algo.routing_replay=rollout (docs/results.md, "Mixture of experts: the tiny MoE
demo trains").
"""
import json

from brorl_jax.config import default_config
from configs.common import parse_arg


def get_config(arg: str | None = None):
    opts = parse_arg(arg, {"n": int, "steps": int, "prompts": int, "moe": int})
    c = default_config()
    c.name = "demo"
    # the embedded demo model, or with moe=1 its mixture-of-experts sibling
    c.model.path = "builtin:demo_moe" if opts.get("moe", 0) else ""
    c.model.remat = False
    c.data.train = "reasoning_gym:basic_arithmetic"
    c.data.reasoning_gym_kwargs = json.dumps(dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+"],
        allow_parentheses=False, allow_negation=False))
    c.data.train_size = 20_000
    c.data.eval_size = 200
    c.data.max_prompt_len = 24
    c.data.use_chat_template = True
    c.rollout.rollouts_per_prompt = opts.get("n", 64)
    c.rollout.max_new_tokens = 8
    c.rollout.temperature = 1.0
    c.algo.prompts_per_step = opts.get("prompts", 16)
    c.algo.micro_batch_size = 256
    c.algo.ppo_mini_batches = 1
    c.algo.kl_coef = 1e-4
    c.optim.base_lr = 1.5e-4
    c.optim.base_batch = 16 * 64
    c.optim.weight_decay = 0.0
    c.sft.steps = 800
    c.sft.batch_size = 32
    c.sft.lr = 2e-3
    c.sft.untagged_frac = 0.7
    c.eval.every = 10
    c.eval.num_prompts = 200
    c.eval.samples_per_prompt = 4
    c.eval.max_new_tokens = 8
    c.train.steps = opts.get("steps", 30)
    c.train.checkpoint_every = 10
    c.rewards.num_workers = 2
    return c

"""ProRL baseline as continued in BroRL: N=16 rollouts per prompt, 512 prompts per step.

The same ProRLv2 recipe as configs/brorl.py, with the paper's baseline batch (Table 1).
Preset argument: configs/prorl.py:n=32,prompts=256
"""
from configs.brorl import get_config as brorl_config
from configs.common import parse_arg


def get_config(arg: str | None = None):
    opts = parse_arg(arg, {"n": int, "prompts": int})
    c = brorl_config()
    c.name = "prorl"
    c.rollout.rollouts_per_prompt = opts.get("n", 16)
    c.algo.prompts_per_step = opts.get("prompts", 512)
    c.train.steps = 535                        # the longest ProRL continuation in Table 1
    c.train.checkpoint_every = 20
    return c

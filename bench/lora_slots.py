"""Decode slots on one 80 GB card with LoRA against full fine-tuning (issue 42), from the memory plan.

    python bench/lora_slots.py [--card-gib 80 --rank 32 --n 512 --prompt 1024 --new 15360]

One device runs the update and the rollout (the stack's colocated layout); what the update keeps
resident between steps (algo.update.train_state_bytes: full fine-tuning's float32 parameters,
gradients, AdamW moments and reference plus a compute-dtype copy; under LoRA the frozen base in
the compute dtype and the adapters' buffers), the rollout's copy of the weights
(rollout.plan.rollout_params_bytes) and the update's saved activations for one micro-batch
(algo.update.remat_saved_bytes, full remat) are taken off the card, with the update plan's
headroom (algo.update._REMAT_HEADROOM) left free; the rest is the rollout's memory budget, and
rollout.plan.plan_slots gives the decode slots for one prompt's N samples at the paper's lengths.
Qwen2.5-7B and Qwen2.5-1.5B in bf16, LoRA on all seven projections. Nothing is compiled or run:
these are the plan's numbers, the ones the runtime sizes its engine with. Writes
bench/results/lora_slots.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
from _measure import shape_config, write_result  # noqa: E402

from brorl_jax.algo import update  # noqa: E402
from brorl_jax.models import lora  # noqa: E402
from brorl_jax.models.hf import param_shapes  # noqa: E402
from brorl_jax.rollout import plan  # noqa: E402

GIB = 2 ** 30


def arm(mc, n_params: int, card: int, args) -> dict:
    """The card's budget for the rollout after the update's resident state, and its slots."""
    state = update.train_state_bytes(mc, n_params)
    weights = plan.rollout_params_bytes(mc, n_params)
    acts = update.remat_saved_bytes(mc, args.micro_tokens, "full")
    budget = int(card * (1 - update._REMAT_HEADROOM)) - state - weights - acts
    out = {"train_state_gib": state / GIB, "rollout_weights_gib": weights / GIB,
           "activations_gib": acts / GIB, "rollout_budget_gib": budget / GIB, "slots": 0}
    least = plan.min_budget_bytes(mc, 1, args.prompt, args.n, args.new)
    if budget >= least:
        out["slots"] = plan.plan_slots(mc, 1, args.prompt, args.n, args.new, budget).slots
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card-gib", type=float, default=80.0)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--n", type=int, default=512, help="samples of the prompt (N)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=15360)
    ap.add_argument("--micro-tokens", type=int, default=16384,
                    help="tokens of one update micro-batch (one 16k row)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "lora_slots.json"))
    args = ap.parse_args()
    card = int(args.card_gib * GIB)
    rows = {}
    print(f"one {args.card_gib:g} GiB card, N = {args.n}, prompt {args.prompt} + {args.new} new "
          f"tokens, LoRA rank {args.rank} on q,k,v,o,gate,up,down")
    print("| model | arm | train state GiB | rollout weights GiB | rollout budget GiB | slots |")
    print("|---|---|---|---|---|---|")
    for name in ("qwen2.5-7b", "qwen2.5-1.5b"):
        full = shape_config(name)
        n_params = sum(int(x.size) for x in jax.tree.leaves(param_shapes(full)))
        adapted = full.replace(lora_rank=args.rank, lora_alpha=32.0,
                               lora_targets=tuple(lora.TARGETS))
        rows[name] = {"full": arm(full, n_params, card, args),
                      "lora": arm(adapted, n_params, card, args)}
        for a, r in rows[name].items():
            print(f"| {name} | {a} | {r['train_state_gib']:.1f} | {r['rollout_weights_gib']:.1f} | "
                  f"{r['rollout_budget_gib']:.1f} | {r['slots']} |")
        f, lo = rows[name]["full"]["slots"], rows[name]["lora"]["slots"]
        rows[name]["slots_ratio"] = lo / f if f else None
        print(f"  {name}: LoRA / full fine-tuning slots = "
              + (f"{lo / f:.2f}x" if f else f"{lo} vs none (full fine-tuning does not fit)"))
    write_result(args.out, "lora_slots.py", {"card_gib": args.card_gib, "rank": args.rank,
                                             "n": args.n, "prompt": args.prompt,
                                             "new": args.new, "models": rows})


if __name__ == "__main__":
    main()

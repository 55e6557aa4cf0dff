"""Rollout routing replay on a tiny random Qwen3-MoE, on this CPU (issue 43 items 3-5).

    python bench/moe_replay.py [--batches 4 --prompts 8 --samples 4 --new-tokens 16]

The issue's setting where the rollout and the update route differently: the rollout engine
samples in bfloat16 (Engine(record_routing=True): each token's experts recorded), the update
computes its log-probs in float32 (algo.make_logprob_fn, the update's own pass). Per batch of
--prompts random prompts x --samples samples at T = 1 (the update batch as the trainer builds
it, algo.assemble_groups + routing_replay.attach_routing, padded rows, all of them measured):

  mismatch tok    tokens whose top-k expert set differs in any layer between the rollout and
                  the f32 update's own routing (moe/routing_mismatch_frac)
  mismatch tok-l  the same per (token, layer) (moe/routing_mismatch_frac_layer)
  gap off         mean |log pi_update - log mu_rollout| per response token, own routing
                  (algo.routing_replay="off"; moe/logprob_gap_mean_noreplay)
  gap rollout     the same with the rollout's routing replayed (algo.routing_replay="rollout";
                  moe/logprob_gap_mean)

The model: 2 layers, hidden 32, 64 experts of width 16, top-8 (many experts: near ties, as in
a 128-expert model), expert weights drawn at 3x the init scale so the experts matter against
the residual stream. Writes bench/results/moe_replay.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from brorl_jax import algo  # noqa: E402
from brorl_jax.algo.routing_metrics import routing_metrics  # noqa: E402
from brorl_jax.algo.routing_replay import attach_routing  # noqa: E402
from brorl_jax.config import default_config, update_config  # noqa: E402
from brorl_jax.models import ModelConfig, init_params  # noqa: E402
from brorl_jax.rollout import Engine  # noqa: E402

MODEL = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=False,
             qk_norm=True, tie_word_embeddings=False, max_position_embeddings=64,
             bos_token_id=None, eos_token_ids=(1,), num_experts=64, num_experts_per_tok=8,
             moe_intermediate_size=16, norm_topk_prob=True)
EXPERT_SCALE = 3.0


def model(seed: int = 0):
    """(float32 config, bfloat16 config, params) of the bench's tiny MoE."""
    f32 = ModelConfig(**MODEL)
    params = init_params(f32, jax.random.PRNGKey(seed))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: EXPERT_SCALE * x if "proj" in str(path) and "moe" in str(path) else x,
        params)
    return f32, ModelConfig(**dict(MODEL, dtype="bfloat16")), params


def one_batch(engine, f32, params, acfg, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(2, 64, size=int(rng.integers(4, 12)))) for _ in range(args.prompts)]
    res = engine.generate(params, prompts, rollouts_per_prompt=args.samples,
                          max_new_tokens=args.new_tokens, temperature=1.0, seed=seed)
    n = args.samples
    groups = [algo.Group(prompt_ids=p, tokens=res.tokens[g], logprobs=res.logprobs[g],
                         mask=res.mask[g], lengths=res.lengths[g],
                         rewards=np.zeros(n, np.float32), shaped=np.zeros(n, np.float32),
                         routing=res.routing[g], prompt_routing=res.prompt_routing[g])
              for g, p in enumerate(prompts)]
    rows = len(groups) * n
    batch = algo.assemble_groups(groups, [np.ones(n, np.float32)] * len(groups), rows=rows,
                                 seq_len=12 + args.new_tokens, pack=False)
    batch = attach_routing(batch, groups, rows)
    out = routing_metrics(f32, acfg, params, batch, rows=rows)
    out["response_tokens"] = int(np.asarray(batch.loss_mask).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_replay.json"))
    args = ap.parse_args()
    f32, bf16, params = model()
    engine = Engine(bf16, record_routing=True)
    acfg = update_config(default_config())
    t0, rows = time.perf_counter(), []
    for b in range(args.batches):
        rows.append(one_batch(engine, f32, params, acfg, args, seed=b))
    print("| batch | response tokens | mismatch tok | mismatch tok-l | gap off | gap rollout |")
    print("|---|---|---|---|---|---|")
    for b, r in enumerate(rows):
        print(f"| {b} | {r['response_tokens']} | {r['moe/routing_mismatch_frac']:.3f} | "
              f"{r['moe/routing_mismatch_frac_layer']:.3f} | "
              f"{r['moe/logprob_gap_mean_noreplay']:.2e} | {r['moe/logprob_gap_mean']:.2e} |")
    print(f"({time.perf_counter() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].platform})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""FP8 rollouts on a real model, on this CPU (issue 41; FP8 is emulated by XLA here: numerics only,
the speed lives in the compiled GPU program, bench/roofline.py).

    python bench/fp8_rollout.py [--prompts 32 --samples 4 --new-tokens 64]

SmolLM2-135M-Instruct (bench/real_model.py's workload: configs/smollm2_arith.py's questions
through SmolLM2's chat template). Two measurements, printed side by side in one run:

* **the behaviour-vs-trainer gap** per rollout precision: each arm samples --samples
  completions of --prompts prompts at T = 1 with the rollout engine (compute dtype bfloat16, as
  on a GPU), then the trainer's log-probs of the same tokens are computed by the update's
  forward in float32 (models.forward). Per token: mean |log pi_trainer - log mu| (the metric
  rollout/logprob_gap_mean), the k3 KL (rollout/behaviour_kl), the 99th percentile of |delta|,
  and the fraction of tokens truncated IS would cap (pi / mu > algo.tis_high = 2).
  Arms: float32 rollout (the floor: kernels only), bf16, bf16 + fp8 KV, fp8 weights, fp8 both.
* **greedy agreement**: T = 0 decoding of the same prompts, fp8 arms against bf16: the fraction
  of positions with the same token (over bf16's valid tokens) and of identical completions.

Writes bench/results/fp8_rollout.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _measure import write_result  # noqa: E402
from real_model import smollm2_workload  # noqa: E402

from brorl_jax.config import RunConfig  # noqa: E402
from brorl_jax.models.precision import with_precision  # noqa: E402
from brorl_jax.rollout import Engine  # noqa: E402

# arm -> (compute dtype, weights, KV[, mlp_impl]); "_gpu": the GPU's FP8 GEMM kernels
# (pallas_kernels.fp8_gemm: activations scaled per token x 128 channels), interpreted here,
# where the other arms run qwix's GEMMs (scaled per token)
ARMS = {"float32": ("float32", "bf16", "bf16"), "bf16": ("bfloat16", "bf16", "bf16"),
        "bf16_w+fp8_kv": ("bfloat16", "bf16", "fp8"), "fp8_w+bf16_kv": ("bfloat16", "fp8", "bf16"),
        "fp8_w+fp8_kv": ("bfloat16", "fp8", "fp8"),
        "fp8_w+fp8_kv_gpu": ("bfloat16", "fp8", "fp8", "pallas")}
TIS_HIGH = RunConfig().algo.tis_high


def trainer_logprobs(model, prompts, tokens, lengths) -> np.ndarray:
    """log pi(token) of each sampled token under the float32 forward, [G, N, S] (0 past length)."""
    g, n, s = tokens.shape
    out = np.zeros((g, n, s), np.float32)
    fwd = jax.jit(lambda p, t: jax.nn.log_softmax(model(t, params=p).astype(jnp.float32), -1))
    for gi, prompt in enumerate(prompts):
        seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (n, 1)), tokens[gi]], 1)
        logp = np.asarray(fwd(model.params, jnp.asarray(seqs)))
        p = len(prompt)
        picked = np.take_along_axis(logp[:, p - 1:p - 1 + s], tokens[gi][..., None], -1)[..., 0]
        out[gi] = np.where(np.arange(s)[None] < lengths[gi][:, None], picked, 0.0)
    return out


def gap_row(mu, pi, mask) -> dict:
    d = np.clip((pi - mu)[mask], -20, 20)
    return {"tokens": int(mask.sum()), "logprob_gap_mean": float(np.abs(d).mean()),
            "behaviour_kl": float(np.mean(np.expm1(d) - d)),
            "abs_gap_p99": float(np.quantile(np.abs(d), 0.99)),
            "tis_truncated_frac": float(np.mean(np.exp(d) > TIS_HIGH))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                    help="the arms to run (bf16, the greedy baseline, always runs)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "fp8_rollout.json"))
    args = ap.parse_args()
    model, prompts, _, eos = smollm2_workload(args.prompts)
    kw = dict(max_new_tokens=args.new_tokens, eos_ids=eos)
    gap, greedy, seconds = {}, {}, {}
    arms = ["bf16"] + [a for a in args.arms if a != "bf16"]
    for arm in arms:
        dtype, w, kv, *impl = ARMS[arm]
        cfg = model.config.replace(dtype=dtype, **({"mlp_impl": impl[0]} if impl else {}))
        engine = Engine(with_precision(cfg, w, kv))
        t0 = time.perf_counter()
        res = engine.generate(model.params, prompts, rollouts_per_prompt=args.samples,
                              temperature=1.0, seed=0, **kw)
        tok, lens = np.asarray(res.tokens), np.asarray(res.lengths)
        pi = trainer_logprobs(model, prompts, tok, lens)
        gap[arm] = gap_row(np.asarray(res.logprobs), pi, np.asarray(res.mask))
        greedy[arm] = engine.generate(model.params, prompts, rollouts_per_prompt=1,
                                      temperature=0.0, seed=0, **kw)
        seconds[arm] = time.perf_counter() - t0
        print(f"{arm:15s} " + "  ".join(f"{k} {v:.4g}" for k, v in gap[arm].items()), flush=True)
    base = greedy["bf16"]
    valid = np.asarray(base.mask)[:, 0]
    agree = {}
    for arm in arms:
        same = np.asarray(greedy[arm].tokens)[:, 0] == np.asarray(base.tokens)[:, 0]
        first = np.where(~same & valid, np.arange(same.shape[1])[None], same.shape[1]).min(1)
        agree[arm] = {"token_agreement": float(same[valid].mean()),
                      "identical_completions": float(np.mean(np.all(same | ~valid, axis=1))),
                      # greedy errors compound: after the first different token the rest
                      # follows another prefix; the share of bf16's tokens before it
                      "tokens_before_first_difference": float(
                          np.minimum(first, valid.sum(1)).sum() / valid.sum())}
        print(f"greedy {arm:15s} tokens equal to bf16's {agree[arm]['token_agreement']:.3f}, "
              f"identical completions {agree[arm]['identical_completions']:.3f}, tokens before "
              f"the first difference {agree[arm]['tokens_before_first_difference']:.3f}")
    write_result(args.out, "fp8_rollout.py", {
        "model": "SmolLM2-135M-Instruct", "prompts": args.prompts, "samples": args.samples,
        "new_tokens": args.new_tokens, "trainer": "float32 forward", "tis_high": TIS_HIGH,
        "gap": gap, "greedy_vs_bf16": agree, "seconds": seconds})


if __name__ == "__main__":
    main()

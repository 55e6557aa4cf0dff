"""Benchmark: one RL update step (pi_old pass + PPO mini-batches with micro-batched gradient
accumulation) for N in {16, 64, 256, 512} rollouts per prompt at a fixed number of prompts.

    python bench/update.py                          # 4 layers, D=256, V=32k, 1 prompt, T=32
    python bench/update.py --prompts 2 --ns 16 64

Goal: peak memory flat in N (it is set by micro_batch_size, not by the batch), time ~linear in the
number of tokens. Each N runs in its own subprocess; memory is the peak above the resident params,
optimizer state and batch (host RSS on CPU, device peak bytes on GPU/TPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(a) -> None:
    import jax
    import numpy as np

    from _measure import current_rss_bytes, device_peak_bytes, peak_rss_bytes
    from brorl_jax.algo import create_train_state, make_optimizer, make_update_step
    from brorl_jax.config import algo_config, optimizer_config
    from brorl_jax.models import ModelConfig, init_params

    mc = ModelConfig(model_type="qwen2", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                     num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=a.hidden // 4, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                     attention_bias=True, qk_norm=False, tie_word_embeddings=True,
                     max_position_embeddings=a.seq, bos_token_id=None, eos_token_ids=(1,))
    n = a.n
    cfg = algo_config(rollouts_per_prompt=n, prompts_per_step=a.prompts, micro_batch_size=a.micro,
                      ppo_mini_batches=a.mini_batches)
    opt = make_optimizer(optimizer_config(lr=1e-6))
    state = create_train_state(init_params(mc, jax.random.PRNGKey(0)), opt)
    rows, t = cfg.batch_rows, a.seq
    rng = np.random.default_rng(0)
    mask = np.zeros((rows, t), bool)
    mask[:, a.seq // 4:] = True
    batch = {"input_tokens": rng.integers(0, a.vocab, (rows, t)).astype(np.int32),
             "positions": np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
             "loss_mask": mask, "targets": rng.integers(0, a.vocab, (rows, t)).astype(np.int32),
             "old_logprobs": np.full((rows, t), -10.0, np.float32),
             "ref_logprobs": np.full((rows, t), -10.0, np.float32),
             "advantages": rng.normal(size=rows).astype(np.float32)}
    batch = jax.device_put(batch)
    update = jax.jit(make_update_step(mc, cfg, opt))
    compiled = update.lower(state, batch, jax.random.PRNGKey(0)).compile()
    jax.block_until_ready(batch)
    base = current_rss_bytes()
    t0 = time.perf_counter()
    new_state, m = compiled(state, batch, jax.random.PRNGKey(0))
    jax.block_until_ready(new_state)
    elapsed = time.perf_counter() - t0
    on_cpu = jax.default_backend() == "cpu"
    peak = (peak_rss_bytes() - base) if on_cpu else device_peak_bytes()
    print("RESULT " + json.dumps({"time_s": elapsed, "peak_bytes": peak, "rows": rows, "tokens": rows * t,
                                  "finite": float(m["finite"])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_size (rows)")
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    import jax
    print(f"# bench/update.py  backend={jax.default_backend()}  layers={a.layers} D={a.hidden} V={a.vocab} "
          f"T={a.seq} prompts={a.prompts} micro_batch_size={a.micro} ppo_mini_batches={a.mini_batches}")
    print("| N | rows | tokens | time (s) | peak mem (GB) | mem / mem(N=first) | time / token (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    from _measure import run_child
    for n in a.ns:
        r = run_child(os.path.abspath(__file__),
                      ["--n", str(n), "--prompts", str(a.prompts), "--seq", str(a.seq), "--layers", str(a.layers),
                       "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--micro", str(a.micro),
                       "--mini-batches", str(a.mini_batches)], a.timeout)
        if "error" in r:
            print(f"| {n} | | | error: {r['error']} | | | |", flush=True)
            continue
        first = first or r
        print(f"| {n} | {r['rows']} | {r['tokens']} | {r['time_s']:.2f} | {r['peak_bytes'] / 1e9:.3f} | "
              f"{r['peak_bytes'] / max(first['peak_bytes'], 1):.2f} | {1e3 * r['time_s'] / r['tokens']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()

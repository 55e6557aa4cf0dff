"""Benchmark: one RL update step (pi_old pass + PPO mini-batches with micro-batched gradient
accumulation) for N in {16, 64, 256, 512} rollouts per prompt at a fixed number of prompts.

    python bench/update.py                          # 4 layers, D=256, V=32k, 1 prompt, T=32
    python bench/update.py --prompts 2 --ns 16 64

Goal: peak memory flat in N (it is set by micro_batch_size, not by the batch), time ~linear in the
number of tokens. Each N runs in its own subprocess; memory is the peak above the resident params,
optimizer state and batch (host RSS on CPU, device peak bytes on GPU/TPU).

    python bench/update.py --long-tail              # packed vs padded vs uniform lengths

Long-tail case (issue 15): G=2 prompts x N=64, prompts of 32 tokens, response lengths geometric with
mean 32, capped at 256. One step = reference log-prob pass + the update (pi_old pass + PPO step),
timed for the same rollouts packed (algo.assemble_update_batch, rows of 32 + 256 tokens) and padded
(pack=False, every row 288 tokens), and for a batch whose responses all have the mean length
(32 + 32 = 64 tokens per row, no padding: the rate the update should reach). Rate = real tokens
(prompt + response) per second. Goal: packed >= 0.7 x the uniform rate. The three run in one
process, interleaved, --repeats times each; medians are reported.

    python bench/update.py --long-tail --model smollm2 --prompts 4 --n 16 --cap 64

The same comparison on a real model: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct), its
chat-templated arithmetic prompts (bench/real_model.py) and responses it sampled itself at T = 1
(its own stop token, so the lengths are its real length distribution, truncated at --cap); the
uniform batch has every response at the sampled mean length.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(a) -> None:
    import jax
    from _measure import current_rss_bytes, device_peak_bytes, peak_rss_bytes

    from brorl_jax.algo import UpdateBatch, create_train_state, make_optimizer, make_update_step
    from brorl_jax.config import make_config, optimizer_config
    from brorl_jax.models import init_params

    mc = _model_config(a, a.seq)
    n = a.n
    run = make_config(rollouts_per_prompt=n, prompts_per_step=a.prompts, micro_batch_size=a.micro,
                      ppo_mini_batches=a.mini_batches)
    cfg = run.update
    opt = make_optimizer(optimizer_config(lr=1e-6))
    state = create_train_state(init_params(mc, jax.random.PRNGKey(0)), opt)
    rows, t = run.update_rows, a.seq
    rng = np.random.default_rng(0)
    mask = np.zeros((rows, t), bool)
    mask[:, a.seq // 4:] = True
    batch = UpdateBatch(input_tokens=rng.integers(0, a.vocab, (rows, t)).astype(np.int32),
                        positions=np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
                        loss_mask=mask, targets=rng.integers(0, a.vocab, (rows, t)).astype(np.int32),
                        old_logprobs=np.full((rows, t), -10.0, np.float32),
                        ref_logprobs=np.full((rows, t), -10.0, np.float32),
                        advantages=rng.normal(size=rows).astype(np.float32))
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


def _model_config(a, max_len):
    from brorl_jax.models import ModelConfig
    return ModelConfig(model_type="qwen2", vocab_size=a.vocab, hidden_size=a.hidden,
                       intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                       rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                       attention_bias=True, qk_norm=False, tie_word_embeddings=True,
                       max_position_embeddings=max_len, bos_token_id=None, eos_token_ids=(1,))


def long_tail_rollouts(a, lengths, rng):
    """G x N rollouts with the given response lengths [G, N] (tokens past a length are 0)."""
    g, n = lengths.shape
    s = int(lengths.max())
    mask = np.arange(s)[None, None, :] < lengths[..., None]
    prompts = [list(map(int, rng.integers(2, a.vocab, a.prompt_len))) for _ in range(g)]
    tokens = rng.integers(2, a.vocab, (g, n, s)) * mask
    logprobs = np.where(mask, -3.0 + 0.1 * rng.normal(size=(g, n, s)), 0.0).astype(np.float32)
    adv = rng.normal(size=(g, n)).astype(np.float32)
    return prompts, tokens, logprobs, mask, adv


def _divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)


def real_model_rollouts(a):
    """SmolLM2's own samples of its arithmetic prompts: (model config, params, rollouts with the
    sampled lengths, rollouts with every response at the mean length, lengths [G, N])."""
    from real_model import smollm2_workload

    from brorl_jax.rollout import generate
    model, prompts, _, eos = smollm2_workload(a.prompts, seed=a.seed)
    res = generate(model, prompts, rollouts_per_prompt=a.n, max_new_tokens=a.cap,
                   temperature=1.0, seed=a.seed, eos_ids=eos)
    rng = np.random.default_rng(a.seed + 1)
    adv = rng.normal(size=res.lengths.shape).astype(np.float32)
    mean = max(1, int(round(res.lengths.mean())))
    a.mean, a.prompt_len = mean, max(len(p) for p in prompts)
    uni_mask = np.ones(res.tokens.shape[:2] + (mean,), bool)
    uni_tokens = np.where(uni_mask, np.pad(res.tokens, ((0, 0), (0, 0), (0, max(0, mean - a.cap))))
                          [..., :mean], 0)
    sampled = (prompts, res.tokens, res.logprobs, res.mask, adv)
    uniform = (prompts, uni_tokens, np.full(uni_mask.shape, -3.0, np.float32), uni_mask, adv)
    return model.config, model.params, sampled, uniform, res.lengths


def long_tail_child(a) -> None:
    import jax

    from brorl_jax.algo import (
        assemble_update_batch,
        create_train_state,
        make_logprob_fn,
        make_optimizer,
        make_update_step,
    )
    from brorl_jax.config import optimizer_config, update_config
    from brorl_jax.models import init_params

    g, n = a.prompts, a.n
    rng = np.random.default_rng(a.seed)
    if a.model == "smollm2":
        mc, params, sampled, uniform_args, lengths = real_model_rollouts(a)
        uniform = np.full((g, n), a.mean)
    else:
        lengths = np.minimum(rng.geometric(1.0 / a.mean, (g, n)), a.cap)
        uniform = np.full((g, n), a.mean)
        mc = _model_config(a, a.prompt_len + a.cap)
        params = init_params(mc, jax.random.PRNGKey(0))
    opt = make_optimizer(optimizer_config(lr=1e-6))
    base = dict(rollouts_per_prompt=n, prompts_per_step=g, ppo_mini_batches=a.mini_batches,
                kl_coef=1e-4)
    mini_rows = g * n // a.mini_batches
    variants = {}
    for name, lens, pack in (("uniform", uniform, False), ("packed", lengths, True),
                             ("padded", lengths, False)):
        if a.model == "smollm2":
            args = uniform_args if name == "uniform" else sampled
        else:
            args = long_tail_rollouts(a, lens, np.random.default_rng(a.seed + 1))
        t = a.prompt_len + (a.mean if name == "uniform" else a.cap)
        micro = max(1, a.micro_tokens // t)
        if pack:
            batch = assemble_update_batch(*args, seq_len=t, mini_batches=a.mini_batches,
                                          row_multiple=micro)
        else:
            micro = _divisor_at_most(mini_rows, micro)
            batch = assemble_update_batch(*args, seq_len=t, pack=False)
        cfg = update_config(micro_batch_tokens=micro * t, **base)
        real = int(sum(len(p) for p in args[0]) * n + lens.sum())
        variants[name] = dict(batch=jax.device_put(batch), cfg=cfg, real_tokens=real,
                              rows=batch.input_tokens.shape[0], width=t, micro_rows=micro,
                              update=jax.jit(make_update_step(mc, cfg, opt)),
                              ref=jax.jit(make_logprob_fn(mc, cfg)))
    state = create_train_state(params, opt)

    def step(v):
        ref_lp, _, _ = v["ref"](state.ref_params, v["batch"])
        new_state, metrics = v["update"](state, v["batch"].replace(ref_logprobs=ref_lp),
                                         jax.random.PRNGKey(0))
        jax.block_until_ready(new_state)
        return metrics

    times = {k: [] for k in variants}
    for v in variants.values():             # compile and warm up
        m = step(v)
        v["n_tokens"] = float(m["n_tokens"])
    for _ in range(a.repeats):
        for name, v in variants.items():
            t0 = time.perf_counter()
            step(v)
            times[name].append(time.perf_counter() - t0)
    out = {name: dict(time_s=float(np.median(times[name])), times=times[name],
                      real_tokens=v["real_tokens"], rows=v["rows"], width=v["width"],
                      micro_rows=v["micro_rows"], loss_tokens=v["n_tokens"])
           for name, v in variants.items()}
    out["mean_response"] = float(lengths.mean())
    out["max_response"] = int(lengths.max())
    print("RESULT " + json.dumps(out), flush=True)


def long_tail_main(a) -> None:
    import jax
    from _measure import run_child
    model = ("SmolLM2-135M-Instruct (its own samples, chat-templated arithmetic prompts)"
             if a.model == "smollm2" else
             f"layers={a.layers} D={a.hidden} V={a.vocab} prompt={a.prompt_len} responses ~ "
             f"geometric(mean {a.mean})")
    print(f"# bench/update.py --long-tail  backend={jax.default_backend()}  {model}  G={a.prompts} "
          f"N={a.n} responses capped at {a.cap}  ppo_mini_batches={a.mini_batches} "
          f"micro_batch_tokens~{a.micro_tokens}  median of {a.repeats}")
    r = run_child(os.path.abspath(__file__),
                  ["--long-tail", "--prompts", str(a.prompts), "--n", str(a.n), "--layers", str(a.layers),
                   "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--mini-batches", str(a.mini_batches),
                   "--prompt-len", str(a.prompt_len), "--mean", str(a.mean), "--cap", str(a.cap),
                   "--micro-tokens", str(a.micro_tokens), "--repeats", str(a.repeats),
                   "--seed", str(a.seed), "--model", a.model], a.timeout)
    if "error" in r:
        print(f"error: {r['error']}")
        return
    print(f"# sampled response lengths: mean {r['mean_response']:.1f}, max {r['max_response']}")
    print("| batch | rows x width | micro rows | real tokens | computed tokens | time (s) | "
          "tokens/s | rate / uniform |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    uni = r["uniform"]["real_tokens"] / r["uniform"]["time_s"]
    labels = {"uniform": "uniform (every response = mean, padded)",
              "packed": "long-tail, packed (default)", "padded": "long-tail, padded (pack=False)"}
    for name in ("uniform", "packed", "padded"):
        v = r[name]
        rate = v["real_tokens"] / v["time_s"]
        print(f"| {labels[name]} | {v['rows']} x {v['width']} | {v['micro_rows']} | {v['real_tokens']} | "
              f"{v['rows'] * v['width']} | {v['time_s']:.2f} | {rate:.0f} | {rate / uni:.2f} |", flush=True)
    print("times (s): " + "; ".join(f"{k}: " + ", ".join(f"{t:.2f}" for t in r[k]["times"])
                                     for k in ("uniform", "packed", "padded")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 1; --long-tail: 2)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_size (rows)")
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--long-tail", action="store_true",
                    help="packed vs padded vs uniform response lengths (see the docstring)")
    ap.add_argument("--prompt-len", type=int, default=32, help="long-tail: prompt tokens")
    ap.add_argument("--mean", type=int, default=32, help="long-tail: mean response length")
    ap.add_argument("--cap", type=int, default=256, help="long-tail: max response length")
    ap.add_argument("--micro-tokens", type=int, default=1024,
                    help="long-tail: tokens per micro-batch (algo.micro_batch_tokens). On CPU keep it "
                         "<= 1024 or a multiple: the chunked log-prob pads a micro-batch's tokens "
                         "to whole 1024-token blocks")
    ap.add_argument("--repeats", type=int, default=3, help="long-tail: timed steps per variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help="--long-tail: rollouts per prompt (default 64)")
    ap.add_argument("--model", choices=("random", "smollm2"), default="random",
                    help="--long-tail: a random Qwen2-shaped model, or SmolLM2-135M-Instruct with "
                         "its own sampled responses")
    a = ap.parse_args()
    if not a.long_tail:
        a.prompts = a.prompts or 1
    if a.long_tail:
        a.n, a.prompts = a.n or 64, a.prompts or 2
        if a.child:
            long_tail_child(a)
        else:
            long_tail_main(a)
        return
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

"""Benchmark: per-token log-prob + entropy, forward and backward, naive vs chunked vs Pallas.

    python bench/logprob.py                       # V=151,936, D=1536, T in {1024, 4096, 16384}
    python bench/logprob.py --tokens 1024 4096    # fewer token counts (CPU: 16k takes ~10 min)

Each (impl, T) runs in its own subprocess: the time is one jitted value_and_grad of
sum(logp) + sum(entropy) with respect to hidden and lm_head (after compilation), the memory is
the peak above the inputs (host RSS on CPU, device peak bytes on GPU/TPU). The naive path is
skipped when its [T, V] float32 buffers would exceed --naive-budget-gb (it is then reported as the
estimate). Ratios are printed against naive where naive ran. The Pallas kernel is timed only on
GPU/TPU (interpreted on CPU it is a correctness tool, not a speed path) unless --pallas-on-cpu.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(impl: str, tokens: int, vocab: int, hidden: int, dtype: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _measure import current_rss_bytes, device_peak_bytes, peak_rss_bytes

    from pallas_kernels import fused_logprob

    dt = jnp.dtype(dtype)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = (jax.random.normal(k[0], (tokens, hidden)) * 1.0).astype(dt)
    w = (jax.random.normal(k[1], (hidden, vocab)) * (1.0 / np.sqrt(hidden))).astype(dt)
    tg = jax.random.randint(k[2], (tokens,), 0, vocab)
    jax.block_until_ready((h, w, tg))

    def f(h, w):
        lp, en = fused_logprob(h, w, tg, impl=impl)
        return jnp.sum(lp) + jnp.sum(en)

    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    compiled = step.lower(h, w).compile()
    base = current_rss_bytes()
    t0 = time.perf_counter()
    val, grads = compiled(h, w)
    jax.block_until_ready(grads)
    elapsed = time.perf_counter() - t0
    on_cpu = jax.default_backend() == "cpu"
    peak = (peak_rss_bytes() - base) if on_cpu else device_peak_bytes()
    print("RESULT " + json.dumps({"time_s": elapsed, "peak_bytes": peak, "value": float(val),
                                  "backend": jax.default_backend()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--impls", nargs="+", default=["naive", "chunked", "pallas"])
    ap.add_argument("--naive-budget-gb", type=float, default=10.0)
    ap.add_argument("--pallas-on-cpu", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.impl, args.tokens[0], args.vocab, args.hidden, args.dtype)
        return

    import jax
    backend = jax.default_backend()
    print(f"# bench/logprob.py  backend={backend}  V={args.vocab}  D={args.hidden}  dtype={args.dtype}  "
          f"(forward + backward wrt hidden and lm_head)")
    print("| tokens | impl | time (s) | peak mem (GB) | time / naive | mem / naive |")
    print("|---:|---|---:|---:|---:|---:|")
    for t in args.tokens:
        naive = None
        for impl in args.impls:
            if impl == "pallas" and backend == "cpu" and not args.pallas_on_cpu:
                print(f"| {t} | pallas | skipped: interpreted on CPU (correctness only) | | | |", flush=True)
                continue
            if impl == "naive":
                need = 3 * t * args.vocab * 4 / 1e9   # logits, softmax, dlogits in f32
                if need > args.naive_budget_gb:
                    print(f"| {t} | naive | skipped: needs ~{need:.1f} GB > --naive-budget-gb "
                          f"{args.naive_budget_gb:g} | | | |", flush=True)
                    continue
            r = __import__("_measure").run_child(os.path.abspath(__file__),
                                                 ["--impl", impl, "--tokens", str(t), "--vocab", str(args.vocab),
                                                  "--hidden", str(args.hidden), "--dtype", args.dtype],
                                                 args.timeout)
            if "error" in r:
                print(f"| {t} | {impl} | error: {r['error']} | | | |", flush=True)
                continue
            if impl == "naive":
                naive = r
            ratio_t = f"{r['time_s'] / naive['time_s']:.2f}" if naive else "n/a"
            ratio_m = f"{r['peak_bytes'] / naive['peak_bytes']:.3f}" if naive and naive["peak_bytes"] else "n/a"
            print(f"| {t} | {impl} | {r['time_s']:.2f} | {r['peak_bytes'] / 1e9:.2f} | {ratio_t} | {ratio_m} |",
                  flush=True)


if __name__ == "__main__":
    main()

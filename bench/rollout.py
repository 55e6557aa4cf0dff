"""Benchmark of the large-N rollout engine (brorl_jax.rollout.generate).

For a random-weight model of realistic shape for this machine (Qwen2-style, 4 layers, hidden 512,
vocab 32000) and a fixed budget of generated samples, it measures for prompt lengths 128 and 1024
and N in {16, 64, 256, 512, 1024}: samples/s, tokens/s, the rollout's peak XLA buffer memory and
the decode loop's achieved FLOP/s next to this machine's measured float32 matmul rate. In the same
run it measures the same work done the naive way (prompt repeated N times: brorl_jax.rollout.
generate_naive, as Tunix/transformers do) and by transformers' ``generate`` (torch CPU,
``num_return_sequences``) on the same weights, and prints the ratios.

The naive path and transformers cost the same per sample whatever N is (everything is repeated),
so they are measured once per prompt length on a smaller batch (``--naive-samples``,
``--hf-samples``) and compared per sample. Stop tokens are disabled so every sample generates
exactly ``--new-tokens`` tokens (fixed work).

    python bench/rollout.py            # default (~10 min on an idle 2-core machine)
    python bench/rollout.py --quick    # N in {16, 512}, fewer samples and tokens
Writes bench/results/rollout[-quick].json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brorl_jax.models import from_pretrained  # noqa: E402
from brorl_jax.rollout import generate, generate_naive, kv_bytes  # noqa: E402
from brorl_jax.rollout.engine import decode_chunk, prefill_prompts  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps float32 [n,n]x[n,n] matmul rate of this machine through XLA, FLOP/s."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def make_model(path: Path):
    """Random Qwen2-style HF checkpoint (transformers init), saved and loaded by brorl_jax."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, **MODEL)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf, from_pretrained(path)


def decode_flops(cfg, prompt_len: int, new_tokens: int, rows: int) -> float:
    """Useful FLOPs of the decode loop: rows x (S-1) forward steps, matmuls + attention over the
    real prompt length and the tokens generated so far (2 FLOPs per multiply-add)."""
    d, h, hkv, dh, i, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    per_layer = 2 * d * (h + 2 * hkv) * dh + 2 * h * dh * d + 2 * 3 * d * i
    steps = new_tokens - 1
    ctx = prompt_len * steps + sum(range(1, steps + 1))  # keys attended, summed over steps
    attn = cfg.num_hidden_layers * 4 * h * dh * ctx
    return rows * (steps * (cfg.num_hidden_layers * per_layer + 2 * d * v) + attn)


def peak_buffer_bytes(fn, *args, **kwargs) -> int:
    """XLA's buffer assignment of the compiled function: arguments + outputs + temporaries minus
    aliased (donated) bytes: the device memory the call needs at its peak."""
    ma = fn.lower(*args, **kwargs).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def shared_peak_bytes(model, result, new_tokens: int) -> int:
    """Peak XLA buffers of the rollout's two compiled programs for this run's padded shapes."""
    cfg, st = model.config, result.stats
    g, p, n = st["padded_num_prompts"], st["padded_prompt_len"], st["samples_per_chunk"]
    sds = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda x: sds(x.shape, x.dtype), model.params)
    kv = sds((cfg.num_hidden_layers, g, p, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    suffix = sds((cfg.num_hidden_layers, g, n, new_tokens, cfg.num_key_value_heads, cfg.head_dim),
                 jnp.float32)
    pre = peak_buffer_bytes(prefill_prompts, params, cfg, sds((g, p), jnp.int32), sds((g,), jnp.int32))
    dec = peak_buffer_bytes(
        decode_chunk, params, kv, kv, sds((g,), jnp.int32), sds((g, cfg.vocab_size), jnp.float32),
        sds((g, n), jnp.int32), sds((g,), jnp.bool_), sds((2,), jnp.uint32), suffix, suffix,
        cfg=cfg, max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0, eos_ids=(),
        attention_impl="reference", sampling_impl="reference",
    )
    return max(pre, dec)


def timed(fn, repeats: int = 1):
    """(result, seconds) of the fastest of ``repeats`` calls after one warm-up (compile) call."""
    fn()
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def hf_generate_rate(hf, prompt: list[int], num_return: int, new_tokens: int) -> float:
    """transformers' generate: one prompt, num_return_sequences samples; samples/s (warm)."""
    import torch

    ids = torch.tensor([prompt])

    def run():
        with torch.no_grad():
            return hf.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               num_return_sequences=num_return, pad_token_id=0)

    with torch.no_grad():  # warm-up on a tiny call
        hf.generate(ids, do_sample=True, max_new_tokens=2, num_return_sequences=2, pad_token_id=0)
    t = time.perf_counter()
    out = run()
    dt = time.perf_counter() - t
    assert out.shape == (num_return, len(prompt) + new_tokens)
    return num_return / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N in {16, 512}, 512 samples, 8 tokens")
    ap.add_argument("--samples", type=int, default=1024, help="generated samples per config")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    ap.add_argument("--naive-samples", type=int, default=64, help="batch of the naive baseline")
    ap.add_argument("--hf-samples", type=int, default=32, help="num_return_sequences for transformers")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.samples, args.new_tokens, args.ns = 512, 8, [16, 512]
        args.naive_samples, args.hf_samples = 64, 16

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    rate = matmul_rate()
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__} on {jax.default_backend()}; float32 matmul (2048^3): "
          f"{rate / 1e9:.1f} GFLOP/s", flush=True)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = make_model(Path(tmp))
        cfg = model.config
        print(f"# model: qwen2-style, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, "
              f"random weights; {args.samples} samples x {args.new_tokens} new tokens per config, "
              "T=1, no top-k/top-p, stop tokens off", flush=True)
        rng = np.random.default_rng(0)
        kw = dict(max_new_tokens=args.new_tokens, temperature=1.0, eos_ids=())
        for plen in args.prompt_lens:
            # naive (prompt repeated N times) and transformers: per-sample cost independent of N
            prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, plen)]
            naive, naive_s = timed(lambda: generate_naive(
                model, [prompt], rollouts_per_prompt=args.naive_samples, **kw))
            naive_rate = args.naive_samples / naive_s
            naive_kv = kv_bytes(cfg, 1, plen + args.new_tokens)
            print(f"P={plen}: naive repeated-prompt path {naive_rate:.1f} samples/s "
                  f"(batch {args.naive_samples}, prefill {naive.stats['prefill_seconds']:.2f}s, "
                  f"decode {naive.stats['decode_seconds']:.2f}s)", flush=True)
            hf_rate = None
            if not args.no_hf:
                hf_rate = hf_generate_rate(hf, prompt, args.hf_samples, args.new_tokens)
                print(f"P={plen}: transformers generate {hf_rate:.1f} samples/s "
                      f"(num_return_sequences={args.hf_samples})", flush=True)
            for n in args.ns:
                g = max(1, args.samples // n)
                prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, plen)] for _ in range(g)]
                res, secs = timed(lambda: generate(model, prompts, rollouts_per_prompt=n, **kw))
                samples = g * n
                st = res.stats
                flops = decode_flops(cfg, plen, args.new_tokens, st["decode_forward_rows"]
                                     // max(args.new_tokens - 1, 1))
                dec_rate = flops / st["decode_seconds"]
                row = dict(
                    prompt_len=plen, n=n, prompts=g, samples=samples, seconds=secs,
                    samples_per_s=samples / secs, tokens_per_s=samples * args.new_tokens / secs,
                    prefill_s=st["prefill_seconds"], decode_s=st["decode_seconds"],
                    decode_flops_per_s=dec_rate, decode_frac_of_matmul=dec_rate / rate,
                    peak_bytes=shared_peak_bytes(model, res, args.new_tokens),
                    kv_bytes_shared=kv_bytes(cfg, g, plen) + kv_bytes(cfg, samples, args.new_tokens),
                    kv_bytes_naive=naive_kv * samples,
                    naive_samples_per_s=naive_rate, hf_samples_per_s=hf_rate,
                    speedup_vs_naive=samples / secs / naive_rate,
                    speedup_vs_hf=None if hf_rate is None else samples / secs / hf_rate,
                )
                rows_out.append(row)
                print(f"P={plen} N={n}: {row['samples_per_s']:.1f} samples/s, "
                      f"{row['speedup_vs_naive']:.2f}x naive", flush=True)

    # N vs N=16 at the same number of samples
    for row in rows_out:
        base = [r for r in rows_out if r["prompt_len"] == row["prompt_len"] and r["n"] == min(args.ns)]
        row["speedup_vs_smallest_n"] = row["samples_per_s"] / base[0]["samples_per_s"]
    header = ("| P | N | prompts | samples/s | tokens/s | prefill s | decode s | decode GFLOP/s "
              f"| % of matmul | peak MiB | KV MiB shared / naive | vs N={min(args.ns)} | vs naive "
              "| vs HF |")
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows_out:
        hf = "-" if r["speedup_vs_hf"] is None else f"{r['speedup_vs_hf']:.1f}x"
        print(f"| {r['prompt_len']} | {r['n']} | {r['prompts']} | {r['samples_per_s']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} | "
              f"{r['decode_flops_per_s'] / 1e9:.1f} | {100 * r['decode_frac_of_matmul']:.0f}% | "
              f"{r['peak_bytes'] / 2**20:.0f} | {r['kv_bytes_shared'] / 2**20:.0f} / "
              f"{r['kv_bytes_naive'] / 2**20:.0f} | {r['speedup_vs_smallest_n']:.2f}x | "
              f"{r['speedup_vs_naive']:.1f}x | {hf} |")
    print(f"\nmatmul reference: {rate / 1e9:.1f} GFLOP/s (float32 2048^3 via XLA). Goals at N=512: "
          ">= 5x naive at P=1024, >= 3x transformers, decode >= 60% of matmul.")
    out = args.out or Path(__file__).parent / "results" / ("rollout-quick.json" if args.quick else "rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args={k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()},
                                   matmul_flops_per_s=rate, model=MODEL, rows=rows_out), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

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
    python bench/rollout.py --sections long-tail   # only the long-tailed lengths
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

from brorl_jax.models import ModelConfig, from_pretrained, init_params  # noqa: E402
from brorl_jax.rollout import Engine, generate_naive, kv_bytes, rollout_bytes  # noqa: E402

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


def peak_buffer_bytes(lowered) -> int:
    """XLA's buffer assignment of a lowered program: arguments + outputs + temporaries minus
    aliased (donated) bytes: the device memory the call needs at its peak."""
    ma = lowered.compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def shared_peak_bytes(engine, model, result, new_tokens: int) -> int:
    """Peak XLA buffers of the rollout's decode program (its state: prompt pool, slots and their
    KV, results; parameters included) for this run's shapes."""
    st = result.stats
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    return peak_buffer_bytes(engine.lower_decode(
        params, prompt_len=st["padded_prompt_len"], num_prompts=st["padded_num_prompts"],
        rollouts_per_prompt=result.rollouts_per_prompt, max_new_tokens=new_tokens))


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


# ----------------------------------------------------------------------------------------------
# Long-tailed lengths: continuous batching vs uniform lengths vs lock step
# ----------------------------------------------------------------------------------------------
TAIL_MODEL = dict(model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=704,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def tail_model():
    """Random Qwen2-shaped model (transformers' init, brorl_jax.models.init_params)."""
    cfg = ModelConfig(**TAIL_MODEL, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                      attention_bias=True, qk_norm=False, tie_word_embeddings=False,
                      max_position_embeddings=2048, bos_token_id=None, eos_token_ids=(2,))
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _median_run(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, float(np.median(times)), times


def _ms_per_step(decode_calls) -> dict[int, float]:
    """{slots: ms per decode step} over a call's decode returns (slots, steps, seconds): what a
    step costs at each slot bucket the tail went through."""
    agg: dict[int, list] = {}
    for slots, steps, sec in decode_calls:
        a = agg.setdefault(int(slots), [0, 0.0])
        a[0] += steps
        a[1] += sec
    return {s: 1e3 * sec / steps for s, (steps, sec) in sorted(agg.items(), reverse=True) if steps}


def long_tail(args) -> list[dict]:
    """2 prompts x N samples, a stop set of vocab/32 ids (lengths roughly geometric), once with
    every sample in a slot and once with a budget of 4x more samples than slots. Timed runs of
    the three paths are interleaved (repeats, medians) so machine load hits them alike."""
    cfg, params = tail_model()
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, args.tail_prompt_len)]
               for _ in range(args.tail_prompts)]
    stop = sorted(rng.choice(cfg.vocab_size, cfg.vocab_size // 32, replace=False).tolist())
    n, s = args.tail_n, args.tail_new_tokens
    cont, lock = Engine(cfg), Engine(cfg, schedule="lockstep")
    # the uniform-length baseline has no tail: pages for all of every slot (kv_fraction 1)
    full = Engine(cfg, kv_fraction=1.0)
    print(f"# long tail: qwen2-shaped, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}; {len(prompts)} prompts x N={n}, max_new_tokens {s}, "
          f"{len(stop)} stop ids, P={args.tail_prompt_len}, T=1", flush=True)
    rows = []
    samples = len(prompts) * n
    for case, slots in (("all samples in slots", samples), ("4x samples per slot", samples // 4)):
        # the budget of `slots` slots with pages for a quarter of their capacity (the default)
        budget = rollout_bytes(cfg, len(prompts), args.tail_prompt_len, n, s, slots)
        kw = dict(rollouts_per_prompt=n, temperature=1.0, seed=0)
        run_cont = lambda: cont.generate(params, prompts, max_new_tokens=s, eos_ids=stop,
                                         memory_budget_bytes=budget, **kw)
        first = run_cont()                                     # compiles
        mean = max(1, int(round(first.lengths.mean())))
        num_slots = first.stats["num_slots"]
        # the same samples at a uniform length = the mean, with the same number of slots
        ubudget = rollout_bytes(cfg, len(prompts), args.tail_prompt_len, n, mean, num_slots,
                                kv_fraction=1.0)
        run_uni = lambda: full.generate(params, prompts, max_new_tokens=mean, eos_ids=(),
                                        memory_budget_bytes=ubudget, **kw)
        run_lock = lambda: lock.generate(params, prompts, max_new_tokens=s, eos_ids=stop,
                                         memory_budget_bytes=budget, **kw)
        uni = run_uni()
        assert uni.stats["num_slots"] == num_slots, (uni.stats["num_slots"], num_slots)
        assert uni.stats["stalls"] == 0
        lk = run_lock() if not args.no_lockstep else None
        # same samples up to float rounding: batches of different composition round differently,
        # which flips a token only where a sample's uniform falls on a CDF boundary
        same = None if lk is None else float(np.mean(np.all(lk.tokens == first.tokens, axis=-1)))
        t_c, t_u, t_l = [], [], []
        for _ in range(args.repeats):
            res, sec, _ = _median_run(run_cont, 1)
            t_c.append(sec)
            _, sec, _ = _median_run(run_uni, 1)
            t_u.append(sec)
            if lk is not None and len(t_l) < args.lockstep_repeats:
                _, sec, _ = _median_run(run_lock, 1)
                t_l.append(sec)
        lens = res.lengths
        useful = int(lens.sum())
        c_rate = useful / np.median(t_c)
        u_rate = int(uni.lengths.sum()) / np.median(t_u)
        l_rate = useful / np.median(t_l) if t_l else None
        st = res.stats
        row = dict(case=case, slots=num_slots, samples=samples, useful_tokens=useful,
                   mean_len=float(lens.mean()), median_len=float(np.median(lens)),
                   p90_len=float(np.percentile(lens, 90)), max_len=int(lens.max()),
                   truncated=int(res.truncated.sum()), uniform_len=mean,
                   same_samples_as_lockstep=same,
                   continuous_tok_s=c_rate, uniform_tok_s=u_rate, lockstep_tok_s=l_rate,
                   vs_uniform=c_rate / u_rate, vs_lockstep=None if l_rate is None else c_rate / l_rate,
                   seconds=dict(continuous=t_c, uniform=t_u, lockstep=t_l),
                   occupancy=st["occupancy"], mean_live_slots=st["mean_live_slots"],
                   decode_steps=st["decode_steps"], refills=st["refills"],
                   compactions=st["compactions"], round_trips=st["round_trips"],
                   host_seconds=st["host_seconds"], total_seconds=st["total_seconds"],
                   init_seconds=st["init_seconds"], pages=st["pages_per_device"],
                   stalls=st["stalls"], restarts=st["restarts"],
                   compiled=cont.num_compiled(),
                   ms_per_step_by_slots=_ms_per_step(st["decode_calls"]))
        rows.append(row)
        print(f"{case}: lengths mean {row['mean_len']:.1f} median {row['median_len']:.0f} "
              f"p90 {row['p90_len']:.0f} max {row['max_len']}; continuous {c_rate:.0f} tok/s, "
              f"uniform({mean}) {u_rate:.0f}, lockstep "
              f"{'-' if l_rate is None else f'{l_rate:.0f}'}; occupancy {st['occupancy']:.2f}, "
              f"{st['refills']} refills, {st['compactions']} compactions, {st['round_trips']} "
              f"host round trips ({st['host_seconds']:.2f} s of {st['total_seconds']:.2f} s), "
              f"{st['pages_per_device']} pages of {st['page_size']}, {st['stalls']} page waits, "
              f"{st['restarts']} restarts; samples identical to lock step: "
              f"{'-' if same is None else f'{100 * same:.2f}%'}", flush=True)
        print("  ms per decode step by slot bucket: " + ", ".join(
            f"{s}: {ms:.1f}" for s, ms in row["ms_per_step_by_slots"].items()), flush=True)
    print()
    header = ("| case | slots | lengths mean / median / p90 / max | continuous tok/s | uniform "
              "tok/s (len) | lock-step tok/s | vs uniform | vs lock step | occupancy | refills "
              "| compactions | round trips | host s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        vl = "-" if r["vs_lockstep"] is None else f"{r['vs_lockstep']:.1f}x"
        lr = "-" if r["lockstep_tok_s"] is None else f"{r['lockstep_tok_s']:.0f}"
        print(f"| {r['case']} | {r['slots']} | {r['mean_len']:.1f} / {r['median_len']:.0f} / "
              f"{r['p90_len']:.0f} / {r['max_len']} | {r['continuous_tok_s']:.0f} | "
              f"{r['uniform_tok_s']:.0f} ({r['uniform_len']}) | {lr} | {r['vs_uniform']:.2f} | "
              f"{vl} | {r['occupancy']:.2f} | {r['refills']} | {r['compactions']} | "
              f"{r['round_trips']} | {r['host_seconds']:.2f} |")
    print(f"\n(medians of {args.repeats} interleaved runs; lock step {args.lockstep_repeats}). "
          "Goal: continuous >= 0.7 of the uniform rate in both cases.")
    return rows


def streaming_overlap(args) -> dict:
    """A consumer that spends `--verify-ms` per group (a stand-in for scoring in worker
    processes) on the stream: wall time against rollout alone + consumer time."""
    cfg, params = tail_model()
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, 32)] for _ in range(16)]
    stop = sorted(rng.choice(cfg.vocab_size, cfg.vocab_size // 32, replace=False).tolist())
    engine = Engine(cfg)
    kw = dict(rollouts_per_prompt=64, max_new_tokens=128, temperature=1.0, seed=0, eos_ids=stop,
              memory_budget_bytes=rollout_bytes(cfg, 16, 32, 64, 128, 256))
    engine.generate(params, prompts, **kw)                     # compiles
    _, t_roll, _ = _median_run(lambda: engine.generate(params, prompts, **kw), 1)
    verify = args.verify_ms / 1e3
    t0 = time.perf_counter()
    arrivals = []
    for _ in engine.stream(params, prompts, **kw):
        arrivals.append(time.perf_counter() - t0)
        time.sleep(verify)                                      # the consumer's work per group
    wall = time.perf_counter() - t0
    serial = t_roll + verify * len(prompts)
    out = dict(rollout_s=t_roll, consumer_s=verify * len(prompts), wall_s=wall, serial_s=serial,
               first_group_s=arrivals[0], last_group_s=arrivals[-1])
    print(f"streaming: rollout alone {t_roll:.2f} s, consumer {verify * len(prompts):.2f} s "
          f"({len(prompts)} groups x {args.verify_ms} ms); streamed wall {wall:.2f} s vs "
          f"{serial:.2f} s in sequence (first group after {arrivals[0]:.2f} s)", flush=True)
    return out


def fixed_lengths(args, rate: float) -> list[dict]:
    """Fixed-length rows (stop tokens off): N, prompt length, naive and transformers."""
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = make_model(Path(tmp))
        cfg = model.config
        engine = Engine(cfg)
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
                res, secs = timed(lambda: engine.generate(model.params, prompts,
                                                          rollouts_per_prompt=n, **kw),
                                  repeats=args.fixed_repeats)
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
                    peak_bytes=shared_peak_bytes(engine, model, res, args.new_tokens),
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
    return rows_out


SECTIONS = ("fixed", "long-tail", "streaming")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="N in {16, 512}, 512 samples, 8 tokens")
    ap.add_argument("--samples", type=int, default=1024, help="generated samples per config")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    ap.add_argument("--naive-samples", type=int, default=64, help="batch of the naive baseline")
    ap.add_argument("--hf-samples", type=int, default=32, help="num_return_sequences for transformers")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--fixed-repeats", type=int, default=1, help="best of, per fixed-length row")
    ap.add_argument("--tail-prompts", type=int, default=2)
    ap.add_argument("--tail-n", type=int, default=512)
    ap.add_argument("--tail-new-tokens", type=int, default=256)
    ap.add_argument("--tail-prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed runs (long tail)")
    ap.add_argument("--lockstep-repeats", type=int, default=1)
    ap.add_argument("--no-lockstep", action="store_true")
    ap.add_argument("--verify-ms", type=float, default=250.0, help="streaming consumer per group")
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
    result = dict(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  matmul_flops_per_s=rate, model=MODEL, tail_model=TAIL_MODEL)
    if "long-tail" in args.sections:
        result["long_tail"] = long_tail(args)
    if "streaming" in args.sections:
        result["streaming"] = streaming_overlap(args)
    if "fixed" in args.sections:
        result["rows"] = fixed_lengths(args, rate)
    out = args.out or Path(__file__).parent / "results" / ("rollout-quick.json" if args.quick else "rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

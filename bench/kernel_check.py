"""Kernels against their references, and their speed against the XLA paths, on one device.

    python bench/kernel_check.py --out $OUT/kernel_check.md        # on a GPU/TPU (~1-2 min)
    python bench/kernel_check.py --small                            # CPU smoke run (interpreted)

Per kernel and impl at the paper's shapes (Qwen2.5-1.5B vocab/width; an 8B width for the
log-prob): numerics against the plain reference (token agreement and log-prob difference for
sampling; value and gradient differences for the fused log-prob) and the median wall time of the
jitted call, with its ratio to the XLA path measured in the same run. Run by
bench/device_check.sh; prints a markdown table and writes it (plus JSON beside it) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import targets as tg  # noqa: E402


def timed(fn, *args, repeat: int) -> float:
    """Median seconds of fn(*args) (jitted, compiled before timing)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sampling_rows(rows: int, vocab: int, repeat: int) -> list[dict]:
    out = []
    key = jax.random.PRNGKey(0)
    logits = jax.random.normal(key, (rows, vocab), jnp.float32) * 3.0
    u = jax.random.uniform(jax.random.PRNGKey(1), (rows,))
    impls = ["reference", "pallas"]
    triton_ok = pk.jax_triton_available()
    for variant, kw in tg.SAMPLING_VARIANTS.items():
        ref_fn = jax.jit(lambda x, u, kw=kw: pk.sample_tokens(x, u, impl="reference", **kw))
        tok_r, lp_r = ref_fn(logits, u)
        t_ref = timed(ref_fn, logits, u, repeat=repeat)
        for impl in impls + (["triton"] if triton_ok and "top_k" not in kw else []):
            row = dict(kernel="sample_tokens", variant=variant, impl=impl,
                       shape=f"[{rows},{vocab}] f32")
            try:
                fn = jax.jit(lambda x, u, kw=kw, impl=impl: pk.sample_tokens(x, u, impl=impl, **kw))
                tok, lp = fn(logits, u)
                row["numerics"] = (f"tokens equal {float(jnp.mean(tok == tok_r)):.4f}, "
                                   f"max |dlogp| {float(jnp.max(jnp.abs(lp - lp_r))):.2e}")
                row["ok"] = bool(jnp.mean(tok == tok_r) >= 0.999 and
                                 jnp.max(jnp.abs(lp - lp_r)) < 1e-3)
                t = t_ref if impl == "reference" else timed(fn, logits, u, repeat=repeat)
                row["ms"] = t * 1e3
                row["vs_xla"] = t_ref / t
            except Exception as e:  # noqa: BLE001 - the failure is the result
                row.update(numerics=f"FAILED: {type(e).__name__}: {str(e)[:160]}", ok=False)
            out.append(row)
    return out


def logprob_rows(tokens: int, hidden: int, vocab: int, dtype: str, repeat: int,
                 naive: bool) -> list[dict]:
    out = []
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    h = jax.random.normal(ks[0], (tokens, hidden), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (hidden, vocab), jnp.float32) * hidden ** -0.5).astype(dtype)
    y = jax.random.randint(ks[2], (tokens,), 0, vocab)

    def make(impl):
        def loss(h, w):
            lp, ent = pk.fused_logprob(h, w, y, impl=impl)
            return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    base = "naive" if naive else "chunked"
    (_, (lp_b, ent_b)), (dh_b, dw_b) = make(base)(h, w)
    t_base = timed(make(base), h, w, repeat=repeat)
    rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                             jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-6))
    for impl in ([base] if base == "chunked" else ["naive", "chunked"]) + ["pallas"]:
        row = dict(kernel="fused_logprob fwd+bwd", variant=f"T={tokens}", impl=impl,
                   shape=f"D={hidden} V={vocab} {dtype}")
        try:
            fn = make(impl)
            (_, (lp, ent)), (dh, dw) = fn(h, w)
            dl = float(jnp.max(jnp.abs(lp - lp_b)))
            de = float(jnp.max(jnp.abs(ent - ent_b)))
            gh, gw = rel(dh, dh_b), rel(dw, dw_b)
            row["numerics"] = (f"vs {base}: |dlogp| {dl:.1e}, |dH| {de:.1e}, "
                               f"rel dgrad_h {gh:.1e}, rel dgrad_W {gw:.1e}")
            tol = 5e-2 if dtype == "bfloat16" else 2e-3
            row["ok"] = dl < tol * 10 and de < tol * 10 and gh < tol and gw < tol
            t = t_base if impl == base else timed(fn, h, w, repeat=repeat)
            row["ms"] = t * 1e3
            row["vs_xla"] = t_base / t
        except Exception as e:  # noqa: BLE001
            row.update(numerics=f"FAILED: {type(e).__name__}: {str(e)[:160]}", ok=False)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kernel_check.md"))
    args = ap.parse_args(argv)
    m15, m8 = tg.MODEL_SHAPES["qwen2.5-1.5b"], tg.MODEL_SHAPES["qwen3-8b"]
    if args.small:
        rows = sampling_rows(8, 1000, args.repeat)
        rows += logprob_rows(64, 64, 1000, "float32", args.repeat, naive=True)
    else:
        rows = sampling_rows(tg.SAMPLING_ROWS, m15.vocab, args.repeat)
        rows += logprob_rows(tg.LOGPROB_TOKENS, m15.hidden, m15.vocab, "bfloat16", args.repeat,
                             naive=True)
        rows += logprob_rows(2048, m8.hidden, m8.vocab, "bfloat16", args.repeat, naive=False)
    dev = jax.devices()[0]
    lines = [f"# bench/kernel_check.py on {dev.device_kind} (jax {jax.__version__})", "",
             "ms: median of the jitted call; vs XLA: the XLA path's time / this impl's time "
             "(sampling: the jnp reference; log-prob: naive full logits, or chunked).", "",
             "| kernel | variant | impl | shape | numerics | ok | ms | vs XLA |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        ratio = f"{r['vs_xla']:.2f}x" if "vs_xla" in r else "-"
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['impl']} | {r['shape']} | "
                     f"{r['numerics']} | {'yes' if r.get('ok') else 'NO'} | {ms} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

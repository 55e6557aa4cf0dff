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
    for impl in ([base] if base == "chunked" else ["naive", "chunked"]) + ["pallas"]:
        row = dict(kernel="fused_logprob fwd+bwd", variant=f"T={tokens}", impl=impl,
                   shape=f"D={hidden} V={vocab} {dtype}")
        fn = make(impl)

        def check(fn=fn):
            (_, (lp, ent)), (dh, dw) = fn(h, w)
            dl = float(jnp.max(jnp.abs(lp - lp_b)))
            de = float(jnp.max(jnp.abs(ent - ent_b)))
            gh, gw = _rel(dh, dh_b), _rel(dw, dw_b)
            tol = 5e-2 if dtype == "bfloat16" else 2e-3
            return (f"vs {base}: |dlogp| {dl:.1e}, |dH| {de:.1e}, rel dgrad_h {gh:.1e}, "
                    f"rel dgrad_W {gw:.1e}",
                    dl < tol * 10 and de < tol * 10 and gh < tol and gw < tol)

        out.append(_measured(row, check, lambda fn=fn: timed(fn, h, w, repeat=repeat), t_base,
                             impl == base))
    return out


def _rel(a, b) -> float:
    """max |a - b| / max |b| in float32."""
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                 jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-6))


def _measured(row: dict, check, time_it, base_s: float, is_base: bool) -> dict:
    """`row` with check()'s (numerics, ok) and the impl's time beside the XLA path's (the base's
    own time when it is the base); a failure is the row's result."""
    try:
        row["numerics"], row["ok"] = check()
        t = base_s if is_base else time_it()
        row["ms"] = t * 1e3
        row["vs_xla"] = base_s / t
    except Exception as e:  # noqa: BLE001
        row.update(numerics=f"FAILED: {type(e).__name__}: {str(e)[:160]}", ok=False)
    return row


def swiglu_rows(tokens: int, hidden: int, inter: int, dtype: str, repeat: int) -> list[dict]:
    """The fused SwiGLU MLP (pallas_kernels.swiglu_mlp) forward + backward against the XLA
    expression: values and the four gradients, and the time of the whole MLP (its GEMMs
    included), as the update runs it."""
    from pallas_kernels.swiglu_mlp import swiglu_mlp
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(ks[0], (tokens, hidden), jnp.float32).astype(dtype)
    wg, wu = ((jax.random.normal(k, (hidden, inter), jnp.float32) * hidden ** -0.5).astype(dtype)
              for k in ks[1:3])
    wd = (jax.random.normal(ks[3], (inter, hidden), jnp.float32) * inter ** -0.5).astype(dtype)
    ct = jax.random.normal(ks[4], (tokens, hidden), jnp.float32).astype(dtype)

    def make(impl):
        def loss(*a):
            y = swiglu_mlp(*a, impl=impl)
            return jnp.sum(y.astype(jnp.float32) * ct), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    (_, y_b), g_b = make("reference")(x, wg, wu, wd)
    t_base = timed(make("reference"), x, wg, wu, wd, repeat=repeat)
    out = []
    for impl in ("reference", "pallas"):
        row = dict(kernel="swiglu_mlp fwd+bwd", variant=f"T={tokens}", impl=impl,
                   shape=f"D={hidden} I={inter} {dtype}")
        fn = make(impl)

        def check(fn=fn):
            (_, y), g = fn(x, wg, wu, wd)
            errs = [_rel(y, y_b)] + [_rel(a, b) for a, b in zip(g, g_b)]
            return ("vs reference: rel dy {:.1e}, rel dgrads x/Wg/Wu/Wd "
                    "{:.1e}/{:.1e}/{:.1e}/{:.1e}".format(*errs),
                    max(errs) < (5e-2 if dtype == "bfloat16" else 2e-3))

        out.append(_measured(row, check, lambda fn=fn: timed(fn, x, wg, wu, wd, repeat=repeat),
                             t_base, impl == "reference"))
    return out


def fp8_rows(tokens: int, hidden: int, inter: int, repeat: int) -> list[dict]:
    """The rollout's FP8 SwiGLU MLP (pallas_kernels.fp8_gemm: input quantized per token x 128
    channels in the kernels, the down projection fed in e4m3) against the same arithmetic in
    jnp, and its time beside the XLA form qwix compiles to (per-token scales, e4m3 x e4m3
    dot_generals, silu(g) * u and the down input's quantization as XLA fusions), at decode
    shapes (one token per slot)."""
    from pallas_kernels import fp8_gemm as fg
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    x = jax.random.normal(ks[0], (tokens, hidden), jnp.float32).astype(jnp.bfloat16)

    def quantized(k, shape):
        w = jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5
        s = jnp.max(jnp.abs(w), axis=0, keepdims=True) / fg.E4M3_MAX
        return (w / s).astype(fg.E4M3), s.astype(jnp.bfloat16)
    w = sum((quantized(k, sh) for k, sh in zip(ks[1:], [(hidden, inter)] * 2
                                                + [(inter, hidden)])), ())

    def xla(x, wg, sg, wu, su, wd, sd):
        dot = lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32)
        xq, sx = fg.block_quantize(x, hidden)
        g = (dot(xq, wg) * sx * sg.astype(jnp.float32)).astype(x.dtype)
        u = (dot(xq, wu) * sx * su.astype(jnp.float32)).astype(x.dtype)
        aq, sa = fg.block_quantize(jax.nn.silu(g) * u, inter)
        return (dot(aq, wd) * sa * sd.astype(jnp.float32)).astype(x.dtype)
    fns = {"xla (qwix's form)": jax.jit(xla), "pallas": jax.jit(fg.fp8_swiglu_mlp)}
    want = jax.jit(lambda *a: fg.fp8_swiglu_mlp_reference(*a)[0])(x, *w)
    t_base = timed(fns["xla (qwix's form)"], x, *w, repeat=repeat)
    out = []
    for impl, fn in fns.items():
        row = dict(kernel="fp8 swiglu_mlp (rollout)", variant=f"T={tokens}", impl=impl,
                   shape=f"D={hidden} I={inter} e4m3")

        def check(fn=fn):
            err = _rel(fn(x, *w), want)
            return f"vs the kernels' jnp arithmetic: rel {err:.1e}", err < 6e-2

        out.append(_measured(row, check, lambda fn=fn: timed(fn, x, *w, repeat=repeat),
                             t_base, impl.startswith("xla")))
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
        rows += swiglu_rows(64, 64, 128, "float32", args.repeat)
        rows += fp8_rows(64, 64, 256, args.repeat)
    else:
        rows = sampling_rows(tg.SAMPLING_ROWS, m15.vocab, args.repeat)
        rows += logprob_rows(tg.LOGPROB_TOKENS, m15.hidden, m15.vocab, "bfloat16", args.repeat,
                             naive=True)
        rows += logprob_rows(2048, m8.hidden, m8.vocab, "bfloat16", args.repeat, naive=False)
        # one micro-batch of the update at 8 x 2048 (2 rows x 2048 tokens)
        rows += swiglu_rows(4096, m15.hidden, m15.intermediate, "bfloat16", args.repeat)
        # the rollout's decode step at 256 slots with fp8 weights
        rows += fp8_rows(256, m15.hidden, m15.intermediate, args.repeat)
    dev = jax.devices()[0]
    lines = [f"# bench/kernel_check.py on {dev.device_kind} (jax {jax.__version__})", "",
             "ms: median of the jitted call; vs XLA: the XLA path's time / this impl's time "
             "(sampling: the jnp reference; log-prob: naive full logits, or chunked; SwiGLU: "
             "the XLA expression; fp8: qwix's per-token W8A8 form in XLA).", "",
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

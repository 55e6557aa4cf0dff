"""The update step on a real GPU (issue 25, item 4): 8 packed rows x 2048 tokens on
Qwen2.5-1.5B shapes (random weights), as configs/brorl.py runs it; achieved MFU next to the
roofline's prediction for the very program that ran.

    python bench/device_update_check.py [--steps 3] [--json FILE]

On the device: builds the update as bench/_roofline_update.py does (the trainer's program, the
memory plan's remat policy for this device), compiles it, walks ITS optimized HLO with the same
declarations (so the prediction is of the program that runs, with the real autotuned GEMMs),
then times `--steps` steps after one warm-up. Prints one line per figure and a last line
"update: achieved MFU A (predicted ceiling P, A/P = R); step S ms (predicted T ms)".
bench/device_check.sh calls it. Needs a GPU; on a CPU it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)


def _target_of(kind: str) -> str:
    return "h200" if "H200" in kind else "h100"


def random_packed_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Packed rows of random sequences (lengths 128..1024 tokens, the row's tail padding)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        start, sid = 0, 1
        while start < seq - 128:
            n = min(int(rng.integers(128, 1025)), seq - start)
            seg[r, start:start + n], pos[r, start:start + n] = sid, np.arange(n)
            start, sid = start + n, sid + 1
    real = seg > 0
    from brorl_jax.algo import UpdateBatch
    return UpdateBatch(
        input_tokens=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        positions=pos, segment_ids=seg,
        loss_mask=real & (pos > 16),
        targets=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        old_logprobs=np.where(real, -2.0 + 0.1 * rng.normal(size=(rows, seq)), 0).astype(np.float32),
        ref_logprobs=np.where(real, -2.0 + 0.1 * rng.normal(size=(rows, seq)), 0).astype(np.float32),
        advantages=np.where(real, rng.normal(size=(rows, seq)), 0).astype(np.float32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import dataclasses

    import jax
    import jax.numpy as jnp
    if jax.default_backend() != "gpu":
        print(f"device_update_check: needs a GPU (backend is {jax.default_backend()!r})",
              file=sys.stderr)
        return 2
    import _roofline_update as ru
    from roofline import TARGETS, model_config

    from brorl_jax import algo
    from brorl_jax.algo.update import device_memory_bytes, plan_remat_policy
    from brorl_jax.config import optimizer_config
    from brorl_jax.models import init_params

    kind = jax.devices()[0].device_kind
    target = _target_of(kind)
    cfg, mc = model_config("qwen2.5-1.5b")
    mc = dataclasses.replace(mc, attention_impl=cfg.model.attention_impl)
    update, _, acfg = ru.build_update(cfg, mc, device_bytes=None)   # the device's own memory
    opt = algo.make_optimizer(optimizer_config(cfg))
    params = init_params(mc, jax.random.PRNGKey(0))
    state = algo.create_train_state(params, opt, with_reference=acfg.kl_coef > 0)
    batch = jax.tree.map(jnp.asarray, random_packed_batch(ru.ROWS, ru.SEQ, mc.vocab_size))
    key = jax.random.PRNGKey(1)
    t0 = time.perf_counter()
    compiled = update.lower(state, batch, key).compile()
    print(f"compiled in {time.perf_counter() - t0:.1f} s on {kind}", flush=True)
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    mini = ru.ROWS // acfg.ppo_mini_batches
    micro = min(acfg.micro_batch_size, mini)
    mem = device_memory_bytes()
    built = dict(hlo=compiled.as_text(), n_params=n_params, attention_impl=mc.attention_impl,
                 remat_policy=plan_remat_policy(mc, micro * ru.SEQ, n_params, mem),
                 ppo_mini_batches=acfg.ppo_mini_batches, micro_rows=micro,
                 recompute_old_logprobs=acfg.recompute_old_logprobs, temp_bytes=0, compile_s=0)
    pred = ru.report_from_hlo(target, "qwen2.5-1.5b", built)
    state, m = compiled(state, batch, key)                 # warm-up (state donated)
    jax.block_until_ready(m)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, m = compiled(state, batch, key)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step = min(times)
    peak = TARGETS[target]["flops"]
    achieved = pred["flops_needed"] / (step * peak)
    out = dict(device=kind, target=target, step_s=step, steps_s=times,
               achieved_mfu=achieved, predicted_mfu_ceiling=pred["mfu_ceiling"],
               predicted_step_s=pred["predicted_step_s"], flops_needed=pred["flops_needed"],
               flops_executed=pred["flops_executed"], remat_policy=built["remat_policy"],
               loss=float(m["loss"]), finite=float(m["finite"]),
               peak_memory_bytes=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"))
    print(json.dumps({k: v for k, v in out.items() if k != "steps_s"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(out, predicted=pred), f, indent=1)
    print(f"update: achieved MFU {achieved:.3f} (predicted ceiling {pred['mfu_ceiling']:.3f}, "
          f"A/P = {achieved / pred['mfu_ceiling']:.2f}); step {step * 1e3:.0f} ms (predicted "
          f"{pred['predicted_step_s'] * 1e3:.0f} ms); remat {built['remat_policy']}")
    return 0 if out["finite"] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

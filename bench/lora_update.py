"""The update step's time with LoRA against full fine-tuning on a real model (issue 42), on this CPU.

    python bench/lora_update.py [--rows 16 --seq 128 --ranks 8,1 --reps 5 --remat config]

SmolLM2-135M-Instruct (float32), the update as configs/smollm2_arith.py trains it here (its
UpdateConfig: KL on, one PPO mini-batch, model.remat off; `--remat full` instead
rematerialises every layer, the CPU default of configs without that setting), one jitted
algo.make_update_step per arm (full fine-tuning; LoRA at each rank on all seven projections),
the same random batch (rows x seq tokens, one micro-batch), AdamW. The arms are timed
interleaved, rep by rep, after one warm-up call each (compile excluded), so machine load hits
them alike; printed: the median seconds per update and each LoRA
arm's ratio to full fine-tuning. Writes bench/results/lora_update.json.
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
from _measure import write_result  # noqa: E402

from brorl_jax.algo import adapters, create_train_state, make_optimizer, make_update_step  # noqa: E402
from brorl_jax.algo.batch import UpdateBatch  # noqa: E402
from brorl_jax.config import optimizer_config, update_config  # noqa: E402
from brorl_jax.models import SMOLLM2_NAME, from_pretrained, lora  # noqa: E402


def random_batch(rows: int, seq: int, vocab: int, rng) -> UpdateBatch:
    tokens = rng.integers(0, vocab, size=(rows, seq + 1)).astype(np.int32)
    mask = np.zeros((rows, seq), bool)
    mask[:, seq // 4:] = True                         # a quarter prompt, the rest response
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq))
    return UpdateBatch(input_tokens=tokens[:, :-1], positions=positions, targets=tokens[:, 1:],
                       loss_mask=mask,
                       old_logprobs=np.full((rows, seq), -3.0, np.float32),
                       ref_logprobs=np.full((rows, seq), -3.0, np.float32),
                       advantages=rng.standard_normal(rows).astype(np.float32))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ranks", default="8,1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--remat", default="config", choices=("config", "full"),
                    help="config: configs/smollm2_arith.py's model.remat (off); full: every layer")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "lora_update.json"))
    args = ap.parse_args()
    model = from_pretrained("builtin:" + SMOLLM2_NAME)
    from configs import smollm2_arith
    run_cfg = smollm2_arith.get_config(f"n={args.rows},prompts=1")
    run_cfg.algo.micro_batch_size = args.rows
    if args.remat == "full":
        run_cfg.model.remat = True
    cfg = update_config(run_cfg)
    opt = make_optimizer(optimizer_config(lr=1e-6))
    batch = random_batch(args.rows, args.seq, model.config.vocab_size, np.random.default_rng(0))
    arms = {"full": (model.config, lambda mc: create_train_state(model.params, opt))}
    for r in (int(x) for x in args.ranks.split(",")):
        mc = model.config.replace(lora_rank=r, lora_alpha=32.0, lora_targets=lora.TARGETS)
        arms[f"lora_r{r}"] = (mc, lambda mc: adapters.lora_train_state(model.params, mc, opt,
                                                                       seed=0))
    steps, states = {}, {}
    for name, (mc, make_state) in arms.items():
        steps[name] = jax.jit(make_update_step(mc, cfg, opt))
        states[name] = make_state(mc)
        states[name], _ = steps[name](states[name], batch, jax.random.key(0))   # warm-up
        jax.block_until_ready(states[name])
    seconds = {name: [] for name in arms}
    for _ in range(args.reps):
        for name in arms:
            t0 = time.perf_counter()
            states[name], m = steps[name](states[name], batch, jax.random.key(1))
            jax.block_until_ready((states[name], m))
            seconds[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(v)) for name, v in seconds.items()}
    for name in arms:
        print(f"{name:8s} median {med[name]:.3f} s per update  ({med[name] / med['full']:.2f}x "
              f"full fine-tuning)  reps {['%.3f' % s for s in seconds[name]]}")
    write_result(args.out, "lora_update.py", {
        "model": "SmolLM2-135M-Instruct (float32)", "rows": args.rows, "seq": args.seq,
        "remat": bool(cfg.remat), "kl_coef": cfg.kl_coef,
        "seconds": seconds, "median_s": med,
        "ratio_to_full": {k: v / med["full"] for k, v in med.items()}})


if __name__ == "__main__":
    main()

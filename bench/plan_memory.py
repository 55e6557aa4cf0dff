"""The paper-scale plan checked by the compiler: per-device memory of every step on 64 devices.

Compiles, ahead of time and on CPU with 64 simulated devices, the steps of configs/brorl_64gpu.py
(Qwen2-1.5B shape, N=1024, 16k context, mesh data=8 x fsdp=8) from abstract inputs
(jax.eval_shape params and optimizer state, jax.ShapeDtypeStruct batches; nothing is allocated),
and prints compiled.memory_analysis() per device next to the hand calculation of docs/scale.md:

  update_micro   the update on ONE micro-batch per device (64 rows x 16384 tokens: 1 sequence per
                 device), the peak of the gradient-accumulation loop
  update_full    the whole step: 65,536 rows, 4 PPO mini-batches, 256 micro-batches each
  logprob        reference / pi_old log-probs of the whole step's batch
  decode         the rollout's decode program (rollout.Engine on the mesh, under shard_map):
                 the decode slots the memory budget gives each device, its prompt pool and
                 results, 15,360 new tokens, bf16 params replicated (Runtime.rollout_params'
                 copy, one buffer per layer; held across the step, so the hand calculation
                 counts it beside the update's state too)

Each update/log-prob step is compiled with the model's plain [B, H, T, T] attention and with
query-chunked attention (brorl_jax/models/chunked_attention.py) to show what the T x T scores cost,
and with the log-prob as the unsharded code runs it ("algo": pallas_kernels.fused_logprob under
plain jit) and through the update's hooks as parallel.sharded sets them ("shard_map": per-device
fused log-prob, rows kept sharded after every split).
The XLA CPU compiler's buffer assignment is not the GPU compiler's (different fusion and
scheduling), so its numbers are an estimate of the same program, not a GPU measurement.

    python bench/plan_memory.py                      # all steps (~3-5 minutes on 2 cores)
    python bench/plan_memory.py --steps=update_micro --attention=chunked --json=plan.json

Mixture of experts: `--model=qwen3_30b_a3b` prints the per-device plan of Qwen3-30B-A3B
(configs/brorl_64gpu.qwen3_30b_a3b) on this run shape (N = 1024, 16k context, 4 PPO mini-batches,
one sequence per device per micro-batch, the rollout budget of brorl_64gpu) with rollout routing
replay on (algo.routing_replay="rollout"), for 8 x 80 GB (fsdp=8, 8 prompts a step: the same
1024 rows per device as) and for the 64-GPU layout (data=8 x fsdp=8, 64 prompts a step): the
project's own plan functions (rollout.plan.plan_slots with the routing record, algo.update's
state and remat counts, models.moe.routing_record_bytes) and this file's hand calculation; no
compile (seconds):

    python bench/plan_memory.py --model=qwen3_30b_a3b
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

NUM_DEVICES = 64
if "jax" in sys.modules:
    raise RuntimeError("bench/plan_memory.py must set XLA_FLAGS before jax is imported")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from brorl_jax.algo import UpdateBatch, sharded_steps as algo_sharded  # noqa: E402
from brorl_jax.algo.optimizer import make_optimizer  # noqa: E402
from brorl_jax.config import optimizer_config, update_config  # noqa: E402
from brorl_jax.models import init_params  # noqa: E402
from brorl_jax.parallel.mesh import make_mesh  # noqa: E402
from brorl_jax.rollout.plan import rollout_params_bytes  # noqa: E402
from configs import brorl_64gpu  # noqa: E402

GIB = 2**30
STEPS = ("update_micro", "update_full", "logprob", "decode")
DEVICE_BYTES = 80 * 10**9         # an 80 GB GPU (H100 / A100 80GB)
# The MoE plan's layouts: mesh, devices, prompts a step (N = 1024 each: 1024 rows per device)
# (the dense plan's data=8 x fsdp=8 shards the state 8 ways only; fsdp=64 is the 30B's layout)
MOE_LAYOUTS = {"8 x 80 GB": (dict(data=1, fsdp=8), 8, 8),
               "64 x 80 GB, data=8 x fsdp=8": (brorl_64gpu.MESH, brorl_64gpu.NUM_DEVICES, 64),
               "64 x 80 GB, fsdp=64": (dict(data=1, fsdp=64), brorl_64gpu.NUM_DEVICES, 64),
               # expert parallel (mesh.expert): experts over expert x fsdp, the rest over fsdp;
               # the rollout's experts over expert (parallel/expert_parallel.py)
               "64 x 80 GB, fsdp=8 x expert=8": (dict(data=1, fsdp=8, expert=8),
                                                 brorl_64gpu.NUM_DEVICES, 64)}


def abstract_batch(rows: int, seq: int) -> UpdateBatch:
    i32 = lambda: jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    f32 = lambda: jax.ShapeDtypeStruct((rows, seq), jnp.float32)
    return UpdateBatch(input_tokens=i32(), positions=i32(),
                       loss_mask=jax.ShapeDtypeStruct((rows, seq), jnp.bool_), targets=i32(),
                       old_logprobs=f32(), ref_logprobs=f32(),
                       advantages=jax.ShapeDtypeStruct((rows,), jnp.float32))


# -------------------------------------------------------------------------------------------------
# Hand calculation (docs/scale.md): bytes per device
# -------------------------------------------------------------------------------------------------
def hand_calculation(mc, *, fsdp: int, devices: int, seq: int, rows_per_step: int,
                     q_chunk: int) -> dict:
    n_params = sum(x.size for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))))
    d, i, l, h, v = (mc.hidden_size, mc.mlp_width, mc.num_hidden_layers,
                     mc.num_attention_heads, mc.vocab_size)
    shard = n_params * 4 / fsdp
    embeddings = v * d * (1 if mc.tie_word_embeddings else 2)
    layer_params = (n_params - embeddings - d) / l
    out = {
        "n_params": n_params,
        "params_f32": shard,
        "ref_params_f32": shard,
        "adam_mu_nu_f32": 2 * shard,
        "grad_accumulator_f32": shard,
        "micro_step_grads_f32": shard,
        "remat_layer_inputs_bf16": l * seq * d * 2,
        # f32 scores, bf16 probs, f32 score gradients of the layer being recomputed
        "attention_scores_plain": h * seq * seq * (4 + 2 + 4),
        "attention_scores_chunked": h * q_chunk * seq * (4 + 2 + 4),
        "mlp_activations_bf16": seq * i * 2 * 4,
        "gathered_layer_weights_f32": 2 * layer_params * 4,          # current + prefetched layer
        "gathered_embedding_f32_and_bf16": v * d * (4 + 2),
        "fused_logprob_tiles_and_dlm_head": 4096 * 16384 * 4 * 3 + v * d * 4,
        "batch_per_device_full_step": rows_per_step / devices * seq * (4 + 4 + 1 + 4 + 4 + 4 + 4),
        # Runtime.rollout_params' copy (compute dtype, replicated, one buffer per layer), held
        # from one update to the next: it sits beside the update's state during the update too
        "rollout_params_copy_held": rollout_params_bytes(mc, n_params),
    }
    return out


def rollout_hand(mc, *, slots: int, pool: int, prompt_len: int, new_tokens: int) -> dict:
    """Rollout decode, per device: `slots` decode slots, `pool` prompts' KV."""
    kv_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2  # bf16
    n_params = sum(x.size for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))))
    return {
        "rollout_params_bf16_replicated": rollout_params_bytes(mc, n_params),
        "rollout_prompt_kv (pool prompts)": pool * prompt_len * kv_per_token,
        "rollout_slot_kv (slots/device)": slots * new_tokens * kv_per_token,
        "rollout_logits_f32 (x4 sampling temps)": slots * mc.vocab_size * 4 * 4,
        "kv_per_sample": new_tokens * kv_per_token,
    }


def moe_plan(mesh: dict, devices: int, prompts: int) -> dict:
    """Qwen3-30B-A3B on brorl_64gpu's run shape with routing replay, per device (the module
    docstring): the update's and the rollout's items and totals, bytes."""
    from brorl_jax.algo import update
    from brorl_jax.models.moe import routing_record_bytes
    from brorl_jax.rollout.plan import bucket_num_prompts, plan_slots, route_bytes
    cfg = brorl_64gpu.get_config(f"prompts={prompts}")
    mc, rmc = brorl_64gpu.qwen3_30b_a3b(), brorl_64gpu.qwen3_30b_a3b(param_dtype="bfloat16")
    p, s, n = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, cfg.rollout.rollouts_per_prompt
    seq, rows, fsdp = p + s, n * prompts, mesh["fsdp"]
    hand = hand_calculation(mc, fsdp=fsdp, devices=devices, seq=seq, rows_per_step=rows,
                            q_chunk=512)
    n_params = hand["n_params"]
    tokens = rows // devices * seq
    ep = mesh.get("expert", 1)
    if ep > 1:
        hand.update(_expert_parallel_terms(mc, n_params, fsdp=fsdp, expert=ep, seq=seq))
    upd = {k: hand[k] for k in ("params_f32", "ref_params_f32", "adam_mu_nu_f32",
                                "grad_accumulator_f32", "micro_step_grads_f32",
                                "remat_layer_inputs_bf16", "gathered_layer_weights_f32",
                                "gathered_embedding_f32_and_bf16",
                                "fused_logprob_tiles_and_dlm_head",
                                "batch_per_device_full_step", "rollout_params_copy_held")}
    # the layer being recomputed in the backward keeps what an un-rematerialised one does
    # (flash attention, the K experts' SwiGLU, the router: remat_saved_bytes "none")
    flash = dataclasses.replace(mc, attention_impl="flash")
    upd["recomputed_layer_activations"] = update.remat_saved_bytes(flash, seq, "none") // \
        mc.num_hidden_layers
    upd["batch_routing_record (replay)"] = routing_record_bytes(mc, tokens)
    g = bucket_num_prompts(math.ceil(prompts * cfg.algo.generation_batch_multiplier))
    budget = int(brorl_64gpu.ROLLOUT_GIB_PER_DEVICE * GIB) * devices
    plans = [plan_slots(rmc, g, p, n, s, budget, num_devices=devices, record_routing=r,
                        page_size=16) for r in (True, False)]
    share = plans[0].share
    record = route_bytes(rmc, share * s, True)     # a prompt's samples' (res_route entry)
    roll = {"rollout_params_bf16_replicated": rollout_params_bytes(rmc, n_params),
            "rollout_working_memory (plan_slots, budget)": plans[0].bytes_per_device,
            "  of which the pool's routing record": plans[0].pool * (
                route_bytes(rmc, p, True) + record) + record,
            "train_state_resident (params, ref, Adam)": sum(
                hand[k] for k in ("params_f32", "ref_params_f32", "adam_mu_nu_f32"))}
    if ep > 1:
        upd.update({k: hand[k] for k in EP_ITEMS})
        roll["rollout_params_bf16_replicated"] = rollout_params_bytes(rmc, n_params, ep)
    return dict(n_params=n_params, update=upd, rollout=roll, slots=plans[0].slots,
                slots_without_record=plans[1].slots,
                pool=plans[0].pool, share=plans[0].share, g=g, rows=rows, tokens=tokens,
                state_bytes_f32_plan=update.train_state_bytes(mc, n_params) / fsdp,
                rollout_params_sharded=rollout_params_bytes(rmc, n_params, ep) / fsdp)


EP_ITEMS = ("expert_exchange_buffers (exact capacity)", "expert_gemm_rows_[P C, I]")


def _expert_parallel_terms(mc, n_params: int, *, fsdp: int, expert: int, seq: int) -> dict:
    """hand_calculation's items under expert parallelism (mesh.expert = P): the experts split
    over expert x fsdp, the rest over fsdp; a layer's gather holds its E/P experts; the exact
    capacity's buffers of a one-sequence micro-batch (docs/scale.md section 1: send, received,
    results, returned [P, C, D] bf16 with C = seq K) and the expert GEMMs' [P C, I] rows (gate,
    up, their product; bf16)."""
    from brorl_jax.rollout.plan import rollout_params_bytes
    l, e, d, w = mc.num_hidden_layers, mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
    experts = l * e * 3 * d * w
    shard = (n_params - experts) * 4 / fsdp + experts * 4 / (fsdp * expert)
    layer_rest = (n_params - experts - mc.vocab_size * d * (1 if mc.tie_word_embeddings else 2)
                  - d) / l
    rows = expert * seq * mc.num_experts_per_tok
    return {"params_f32": shard, "ref_params_f32": shard, "adam_mu_nu_f32": 2 * shard,
            "grad_accumulator_f32": shard, "micro_step_grads_f32": shard,
            "gathered_layer_weights_f32": 2 * (layer_rest + e // expert * 3 * d * w) * 4,
            "rollout_params_copy_held": rollout_params_bytes(mc, n_params, expert),
            EP_ITEMS[0]: 4 * rows * d * 2, EP_ITEMS[1]: 3 * rows * w * 2}


def print_moe_plan() -> dict:
    """Prints moe_plan for each of MOE_LAYOUTS; returns them."""
    out = {}
    for name, (mesh, devices, prompts) in MOE_LAYOUTS.items():
        plan = out[name] = moe_plan(mesh, devices, prompts)
        print(f"\nQwen3-30B-A3B ({plan['n_params']:,} parameters), {name}: mesh {mesh}, "
              f"{prompts} prompts x N=1024 = {plan['rows']:,} rows x 16384 tokens a step "
              f"({plan['tokens']:,} tokens per device), routing replay on; per device:")
        for part in ("update", "rollout"):
            total = sum(b for k, b in plan[part].items() if not k.startswith("  "))
            copy = plan[part].get("rollout_params_copy_held",
                                  plan[part].get("rollout_params_bf16_replicated"))
            for k, b in plan[part].items():
                print(f"  {part:8s} {k:48s} {_fmt(b)}")
            for what, t in (("TOTAL", total), ("TOTAL, rollout copy sharded over fsdp",
                                               total - copy + plan["rollout_params_sharded"])):
                fits = "fits" if t <= DEVICE_BYTES else "does NOT fit"
                print(f"  {part:8s} {what:48s} {_fmt(t)}  ({fits} 80 GB = "
                      f"{DEVICE_BYTES / GIB:.1f} GiB)")
        print(f"  rollout: {plan['g']} prompts a round, {plan['slots']} decode slots "
              f"({plan['slots_without_record']} without the routing record), {plan['pool']} "
              f"pooled prompts, {plan['share']} samples of each per device")
    return out


def _fmt(b: float) -> str:
    return f"{b / GIB:8.2f} GiB"


def memory_row(compiled) -> dict:
    m = compiled.memory_analysis()
    row = {k: int(getattr(m, k + "_in_bytes", 0) or 0) for k in
           ("argument_size", "output_size", "alias_size", "temp_size", "generated_code_size")}
    row["peak_estimate"] = (row["argument_size"] + row["output_size"] - row["alias_size"]
                            + row["temp_size"])
    return row


# -------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--attention", default="plain,chunked")
    ap.add_argument("--q_chunk", type=int, default=512)
    ap.add_argument("--json", default="")
    ap.add_argument("--model", default="qwen2_1p5b", choices=("qwen2_1p5b", "qwen3_30b_a3b"),
                    help="qwen3_30b_a3b: the mixture-of-experts plan (hand, no compile)")
    ap.add_argument("--logprob", default="algo,shard_map",
                    help="algo: pallas_kernels.fused_logprob under plain jit (update default)\n"
                         "shard_map: the update's logprob_fn / shard_rows hooks set by\n"
                         "parallel.sharded (per-device fused log-prob, rows kept sharded)")
    args = ap.parse_args(argv)
    if args.model == "qwen3_30b_a3b":
        plans = print_moe_plan()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plans, f, indent=1)
        return 0
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise SystemExit(f"--steps: unknown {bad}; choose from {STEPS}")

    cfg = brorl_64gpu.get_config()
    mc = brorl_64gpu.qwen2_1p5b()
    mesh = make_mesh(brorl_64gpu.MESH)
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens           # 16384
    n, prompts = cfg.rollout.rollouts_per_prompt, cfg.algo.prompts_per_step
    rows = n * prompts                                                   # 65,536
    micro = cfg.algo.micro_batch_size                                    # 64 = 1 per device
    print(f"plan: {mc.num_hidden_layers} layers, hidden {mc.hidden_size}, vocab {mc.vocab_size}, "
          f"N={n}, {prompts} prompts/step = {rows} rows x {seq} tokens; mesh "
          f"{dict(mesh.shape)} on {len(jax.devices())} simulated CPU devices", flush=True)

    params = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    optimizer = make_optimizer(optimizer_config(cfg))
    state = algo_sharded.abstract_train_state(params, optimizer, with_reference=True)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    hand = hand_calculation(mc, fsdp=mesh.shape["fsdp"], devices=NUM_DEVICES, seq=seq,
                            rows_per_step=rows, q_chunk=args.q_chunk)
    results = {"hand": hand, "compiled": {}}

    def record(name, jitted, *abstract):
        t0 = time.perf_counter()
        compiled = jitted.lower(*abstract).compile()
        row = memory_row(compiled)
        row["compile_seconds"] = round(time.perf_counter() - t0, 1)
        results["compiled"][name] = row
        print(f"{name:32s} args {_fmt(row['argument_size'])} out {_fmt(row['output_size'])} "
              f"alias {_fmt(row['alias_size'])} temp {_fmt(row['temp_size'])} code "
              f"{row['generated_code_size'] / 2**20:6.1f} MiB | peak~ {_fmt(row['peak_estimate'])}"
              f" ({row['compile_seconds']} s)", flush=True)

    attentions = [a for a in args.attention.split(",") if a]
    for attention in attentions:
        for lp in [x for x in args.logprob.split(",") if x]:
            tag = f"{attention},{lp}"
            if "update_micro" in steps:
                algo = update_config(cfg, prompts_per_step=1, ppo_mini_batches=1,
                                   micro_batch_size=micro, kl_coef=1e-4, remat=True)
                batch = abstract_batch(micro, seq)
                fn, _ = algo_sharded.make_sharded_update(mc, algo, optimizer, mesh, state, batch,
                                                    attention=attention, q_chunk=args.q_chunk,
                                                    logprob=lp)
                record(f"update_micro[{tag}]", fn, state, batch, rng)
            if "update_full" in steps:
                algo = update_config(cfg, micro_batch_size=micro, kl_coef=1e-4, remat=True)
                batch = abstract_batch(rows, seq)
                fn, _ = algo_sharded.make_sharded_update(mc, algo, optimizer, mesh, state, batch,
                                                    attention=attention, q_chunk=args.q_chunk,
                                                    logprob=lp)
                record(f"update_full[{tag}]", fn, state, batch, rng)
            if "logprob" in steps:
                algo = update_config(cfg, micro_batch_size=micro)
                batch = abstract_batch(rows, seq).token_rows()
                fn, _ = algo_sharded.make_sharded_logprob(mc, algo, mesh, params, batch,
                                                     micro_batch_size=micro, attention=attention,
                                                     q_chunk=args.q_chunk, logprob=lp)
                record(f"logprob[{tag}]", fn, params, batch)

    if "decode" in steps:
        from brorl_jax.rollout import Engine
        from brorl_jax.rollout.plan import bucket_num_prompts
        rmc = brorl_64gpu.qwen2_1p5b(param_dtype="bfloat16")   # the rollout's bf16 copy
        p, s = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
        g = bucket_num_prompts(math.ceil(prompts * cfg.algo.generation_batch_multiplier))
        budget = int(cfg.rollout.memory_budget_gb * GIB)
        engine = Engine(rmc, mesh=mesh, impl="reference")
        plan = engine.plan(g, p, n, s, budget)
        print(f"rollout: {g} prompts per generation round, N={n}: {plan.slots} decode slots and "
              f"{plan.pool} pooled prompts per device ({plan.share} samples of each prompt per "
              "device)", flush=True)
        rparams = jax.eval_shape(lambda: init_params(rmc, jax.random.PRNGKey(0)))
        t0 = time.perf_counter()
        compiled = engine.lower_decode(rparams, prompt_len=p, rollouts_per_prompt=n,
                                       max_new_tokens=s, num_prompts=g,
                                       memory_budget_bytes=budget).compile()
        row = memory_row(compiled)
        row["compile_seconds"] = round(time.perf_counter() - t0, 1)
        name = f"decode[slots={plan.slots},pool={plan.pool}]"
        results["compiled"][name] = row
        print(f"{name:32s} args {_fmt(row['argument_size'])} out {_fmt(row['output_size'])} "
              f"alias {_fmt(row['alias_size'])} temp {_fmt(row['temp_size'])} | peak~ "
              f"{_fmt(row['peak_estimate'])} ({row['compile_seconds']} s)", flush=True)
        hand.update(rollout_hand(rmc, slots=plan.slots, pool=plan.pool, prompt_len=p,
                                 new_tokens=s))

    print("\nhand calculation, per device:")
    for k, b in hand.items():
        if k == "n_params":
            print(f"  {k:40s} {b:,}")
        else:
            print(f"  {k:40s} {_fmt(b)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

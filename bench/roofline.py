"""Roofline of the compiled GPU programs, without a GPU (issue 25): bytes per decode step vs the
floor, host syncs and collectives per decode step; the update's flops vs needed and MFU ceiling.

    python bench/roofline.py --target h100 --model qwen2.5-1.5b --json FILE
    python bench/roofline.py --target h200 --cases slots256_ctx4k --hlo-dir /tmp/hlo

Needs the ``compile`` extra (jax-cuda12-plugin + jax-cuda12-pjrt of the installed jax; TPU:
libtpu): without it, it says so and exits 2. Keep the extra out of the project venv if you like:
``pip install --target DIR ...`` and ``PYTHONPATH=DIR``.

What it does, per decode case: builds the rollout's decode program AS THE TRAINER RUNS IT
(``configs/brorl.py``'s model and rollout settings, float32 master weights passed through
``Runtime.rollout_params``, the engine's decode program of ``rollout/programs.py`` with the
kernels ``impl="auto"`` picks on the target), compiles it for a topology description of the card
(no device), and walks the optimized HLO kernel by kernel (``bench/_hlo_walk.py``): while-loop
bodies multiplied by their trip counts, each Pallas kernel's traffic from the declaration beside
it (``pallas_kernels.decode_attention.slot_decode_attention_traffic``,
``pallas_kernels.sampling.sample_tokens_traffic``) at the case's lengths. One decode step is one
iteration of the decode loop divided by the steps it runs between two stop checks.

The floor of a decode step (bytes that any implementation must move):
  weights   every parameter once, in the compute dtype (the tied embedding once: the LM head)
  KV        the live KV once: each live prompt's KV (shared by its slots) + every live slot's own
  new K/V   one position per slot per layer, written
  logits    [slots, V] float32, written once and read once
With the rollout's weights and KV in fp8 (the ``_fp8`` cases, issue 41): the 7 projections of
each layer at one byte + their per-output-channel scales (the embedding / LM head, the norms and
the biases stay in the compute dtype; models.precision.rollout_weight_bytes), the KV at one byte
per element + a float32 scale per position and KV head (rollout.plan.kv_bytes); the rest as bf16.
Predicted step time = max(bytes / HBM bandwidth, flops / peak bf16 tensor flops); tokens/s =
live slots / step time. A deviceless compile has no GEMM autotuning: its default split-K float32
partial sums are reported beside the bytes, not counted (issue 25's definition).

Cases (per device; CASES below): ``slots256_ctx4k`` (256 slots of one 1024-token prompt, 3072
own positions on average: a 4k context), ``tail32_ctx8k`` (a 32-slot tail, 8k context),
``mesh64_plan`` (configs/brorl_64gpu.py on 64 devices: the plan's slots per device), their
``_fp8`` forms (fp8 weights and KV) and ``moe_*`` on Qwen3-30B-A3B whatever --model says
(configs/brorl_64gpu.qwen3_30b_a3b; the grouped GEMM kernel, its cost declared by
``grouped_gemm_kernel_cost``, or moe_impl "ragged" / "dense", the 8k tail, expert parallel).

The floor of a mixture-of-experts step reads only the experts some live slot routes to: with
uniform routing a layer's expert is missed by all S slots with probability (1 - K/E)^S, so the
weights term is the non-expert parameters + (1 - (1 - K/E)^S) x the experts' (at 256 slots,
top-8 of 128: 1 - 6.7e-8, every expert: 61.1 GB of bf16 a step, 9.1x the 6.7 GB of one
token's active parameters: its 8 experts a layer, attention, embedding and LM head). The
report's ``expert_coverage`` is that fraction.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

# name -> (platform, HBM bytes/s, dense bf16 tensor flops/s, GpuTargetConfig device string)
TARGETS = {
    "h100": dict(platform="cuda", bandwidth=3.35e12, flops=989e12, memory=80e9,
                 desc="NVIDIA H100 80GB HBM3 (SXM: 3.35 TB/s, 989 TFLOP/s bf16 dense)"),
    "h200": dict(platform="cuda", bandwidth=4.8e12, flops=989e12, memory=141e9,
                 desc="NVIDIA H200 (141 GB HBM3e: 4.8 TB/s, 989 TFLOP/s bf16 dense)"),
    "v5e": dict(platform="tpu", bandwidth=8.19e11, flops=197e12, memory=16e9,
                desc="TPU v5e (819 GB/s, 197 TFLOP/s bf16; report only)"),
}
CASES = {
    # slots per device, prompts in flight, prompt positions, mean own positions
    "slots256_ctx4k": dict(slots=256, prompts=1, prompt_len=1024, own_len=3072),
    "tail32_ctx8k": dict(slots=32, prompts=1, prompt_len=1024, own_len=7168),
    "mesh64_plan": dict(slots=None, prompts=None, prompt_len=1024, own_len=3072),
    # issue 41: the same shapes with the rollout's weights and KV cache in fp8
    "slots256_ctx4k_fp8": dict(slots=256, prompts=1, prompt_len=1024, own_len=3072,
                               precision=("fp8", "fp8")),
    "tail32_ctx8k_fp8": dict(slots=32, prompts=1, prompt_len=1024, own_len=7168,
                             precision=("fp8", "fp8")),
    # issue 43: a mixture-of-experts decode step (the case names its model)
    "moe_slots256_ctx4k": dict(slots=256, prompts=1, prompt_len=1024, own_len=3072,
                               model="qwen3-30b-a3b"),
    # the same with XLA's jax.lax.ragged_dot (models/moe.py experts_ragged) and with every expert
    # on every token (experts_dense)
    "moe_slots256_ctx4k_ragged": dict(slots=256, prompts=1, prompt_len=1024, own_len=3072,
                                      model="qwen3-30b-a3b", moe_impl="ragged"),
    "moe_slots256_ctx4k_dense": dict(slots=256, prompts=1, prompt_len=1024, own_len=3072,
                                     model="qwen3-30b-a3b", moe_impl="dense"),
    # the long tail: 32 slots left at an 8k context (few tokens a step, most experts still read)
    "moe_tail32_ctx8k": dict(slots=32, prompts=1, prompt_len=1024, own_len=7168,
                             model="qwen3-30b-a3b"),
    # expert parallel: 8 devices (mesh expert = 8), each with 16 experts a layer and 128 slots
    # of its own (the per-device numbers; the tokens exchanged with all-to-alls)
    "moe_ep8_slots128_ctx4k": dict(slots=128, prompts=1, prompt_len=1024, own_len=3072,
                                   model="qwen3-30b-a3b", expert=8),
}
MODELS = ("qwen2.5-1.5b", "qwen3-30b-a3b")
GB = 1e9


def _target_config(target: str) -> str:
    from compile_check import H100_TARGET_CONFIG
    if target == "h100":
        return H100_TARGET_CONFIG
    # H200: the H100's SM (sm_90, same shared memory and cores), 141 GB at 4.8 TB/s
    return (H100_TARGET_CONFIG.replace("memory_bandwidth: 3352320000000",
                                       "memory_bandwidth: 4800000000000")
            .replace("device_memory_size: 84929347584", "device_memory_size: 150754820096")
            .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))


def missing_extra(target: str) -> str | None:
    """Why the compile extra for ``target`` is missing (None: present)."""
    cuda = ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")
    need = cuda if TARGETS[target]["platform"] == "cuda" else ("libtpu",)
    def absent(name):     # find_spec of "a.b" raises when "a" itself is missing
        try:
            return importlib.util.find_spec(name) is None
        except ModuleNotFoundError:
            return True
    gone = [m for m in need if absent(m)]
    if gone:
        return (f"bench/roofline.py needs the 'compile' extra for --target {target} (missing: "
                f"{', '.join(gone)}): pip install -e '.[compile]' (or pip install --target DIR "
                "the pyproject's compile pins and set PYTHONPATH=DIR)")
    return None


def model_config(model: str, case: str | None = None):
    """The model as configs/brorl.py trains it: bf16 compute, float32 master weights (a case
    that names its model, CASES[case]["model"], runs that one)."""
    from configs import brorl, brorl_64gpu
    model = CASES.get(case, {}).get("model", model)
    if model not in MODELS:
        raise SystemExit(f"--model {model!r}: choose from {MODELS}")
    cfg = brorl.get_config()
    build = {"qwen2.5-1.5b": brorl_64gpu.qwen2_1p5b,  # Qwen2-1.5B's architecture (28 layers,
             "qwen3-30b-a3b": brorl_64gpu.qwen3_30b_a3b}[model]   # 1536 wide, tied 151936)
    mc = build(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    if "moe_impl" in CASES.get(case, {}):       # the experts' form (models.moe.EXPERT_FNS)
        mc = dataclasses.replace(mc, moe_impl=CASES[case]["moe_impl"])
    return cfg, mc


# ------------------------------------------------------------------------------------------------
# one case (in a subprocess): build, compile, save the optimized HLO
# ------------------------------------------------------------------------------------------------

def _rollout_params(cfg, mc, abstract, precision=None):
    """What the trainer hands the rollout: Runtime.rollout_params of the master weights (at
    ``precision``, (weights, kv); None: the config's)."""
    import jax

    from brorl_jax.train.runtime import LocalRuntime
    runtime = LocalRuntime(cfg, mc, None, diagnostics_n=None)
    return jax.eval_shape(lambda p: runtime.rollout_params(p, precision), abstract), runtime


def compile_case(target: str, model: str, case: str) -> dict:
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pallas_kernels as pk
    from brorl_jax.models import init_params
    from brorl_jax.rollout import Engine

    platform = TARGETS[target]["platform"]
    cfg, mc = model_config(model, case)
    c = dict(CASES[case])
    n_dev = 64 if case == "mesh64_plan" else c.get("expert", 1)
    if platform == "cuda":
        topo = topologies.get_topology_desc(platform="cuda", target_config=_target_config(target),
                                            topology={64: "1x8x8", 8: "1x1x8"}.get(n_dev,
                                                                                  "1x1x1"))
    else:
        topo = topologies.get_topology_desc(topology_name="v5e:8x8" if n_dev == 64 else "v5e:2x2",
                                            platform="tpu")
    import numpy as np
    t0 = time.perf_counter()
    abstract = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    with pk.compile_target(platform):
        precision = c.get("precision")
        rparams, runtime = _rollout_params(cfg, mc, abstract, precision)
        n = cfg.rollout.rollouts_per_prompt
        call = dict(prompt_len=c["prompt_len"], max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                    top_p=cfg.rollout.top_p)
        if n_dev == 64:
            from brorl_jax.rollout.plan import bucket_num_prompts
            from configs import brorl_64gpu
            pcfg = brorl_64gpu.get_config()
            mesh = jax.sharding.Mesh(np.asarray(topo.devices).reshape(8, 8, 1),
                                     ("data", "fsdp", "tensor"))
            n = pcfg.rollout.rollouts_per_prompt
            g = bucket_num_prompts(math.ceil(pcfg.algo.prompts_per_step
                                             * pcfg.algo.generation_batch_multiplier))
            budget = int(pcfg.rollout.memory_budget_gb * 2**30)
            engine = Engine(mc, mesh=mesh, impl=pcfg.rollout.impl)
            plan = engine.plan(g, c["prompt_len"], n, pcfg.rollout.max_new_tokens, budget)
            c["slots"], c["prompts"] = plan.slots, -(-plan.slots // plan.share)
            fn, args = engine.decode_program(rparams, rollouts_per_prompt=n, num_prompts=g,
                                             memory_budget_bytes=budget, **call)
            rep, dev = NamedSharding(mesh, P()), NamedSharding(mesh, P(engine.axes))
            n_rep = len(jax.tree.leaves(args[:4]))
            leaves, tree = jax.tree.flatten(args)
            args = jax.tree.unflatten(tree, [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep if i < n_rep else dev)
                for i, x in enumerate(leaves)])
        elif n_dev > 1:     # expert parallel: each device its experts and its own slots
            from brorl_jax.parallel.expert_parallel import rollout_param_specs
            mesh = jax.sharding.Mesh(np.asarray(topo.devices[:n_dev]), ("expert",))
            engine = Engine(runtime.rollout_cfg(mc, precision), mesh=mesh,
                            impl=runtime.rollout_impl,
                            record_routing=runtime.record_routing and mc.is_moe)
            fn, args = engine.decode_program(rparams, rollouts_per_prompt=n,
                                             num_prompts=c["prompts"], slots=c["slots"], **call)
            specs = rollout_param_specs(args[0], mc.num_experts)
            dev = NamedSharding(mesh, P(engine.axes))
            place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                      sharding=NamedSharding(mesh, s))
            args = (jax.tree.map(place, args[0], specs),
                    *jax.tree.map(lambda x: place(x, P()), args[1:4]),
                    *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                                  args[4:]))
        else:
            mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
            engine = runtime.rollout_engine(mc, precision)
            fn, args = engine.decode_program(rparams, rollouts_per_prompt=n,
                                             num_prompts=c["prompts"], slots=c["slots"],
                                             sharding=NamedSharding(mesh, P()), **call)
        check_every = engine.check_every          # the target's, as the program was built
        with jax.set_mesh(mesh):
            lowered = fn.trace(*args).lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
    t2 = time.perf_counter()
    leaves = jax.tree.leaves(rparams)
    mem = compiled.memory_analysis()
    return dict(
        hlo=compiled.as_text(), lower_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1),
        slots=c["slots"], prompts=c["prompts"], devices=n_dev,
        check_every=int(check_every),
        precision=[engine.cfg.weight_precision, engine.cfg.kv_precision],
        param_dtypes=sorted({str(x.dtype) for x in leaves}),
        # the model's parameters (the master tree: an fp8 copy also holds its scales)
        n_params=int(sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))),
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
        argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0) or 0))


# ------------------------------------------------------------------------------------------------
# the report of one case
# ------------------------------------------------------------------------------------------------

def floor_bytes(mc, *, slots: int, prompts: int, prompt_len: int, own_len: float,
                n_params: int, expert: int = 1) -> dict:
    """The floor of one decode step (module docstring), term by term, at ``mc``'s rollout
    precision: under fp8 weights the projections at one byte + their per-channel scales
    (models.precision.rollout_weight_bytes; embedding / LM head, norms and biases stay in the
    compute dtype), under an fp8 KV cache a byte per element + a float32 scale per position and
    KV head (rollout.plan.kv_bytes)."""
    from brorl_jax.rollout.plan import kv_bytes, rollout_params_bytes
    weights = rollout_params_bytes(mc, n_params, expert)     # under EP: this device's experts
    if mc.is_moe:       # only the experts some slot routes to (module docstring); under expert
        # parallelism the device's experts serve the slots of all `expert` devices
        experts = (mc.num_hidden_layers * mc.num_experts * 3 * mc.hidden_size
                   * mc.moe_intermediate_size * 2) // expert      # bf16
        weights -= round(experts * (1 - expert_coverage(mc, slots * expert)))
    return dict(weights=weights,
                kv=kv_bytes(mc, prompts, prompt_len) + kv_bytes(mc, slots, own_len),
                new_kv=kv_bytes(mc, slots, 1),
                logits=2 * slots * mc.vocab_size * 4)


def expert_coverage(mc, slots: int) -> float:
    """Expected fraction of a layer's experts at least one of ``slots`` tokens routes to, under
    uniform routing (1.0 for a dense model): 1 - (1 - K/E)^slots."""
    if not mc.is_moe:
        return 1.0
    return 1.0 - (1.0 - mc.num_experts_per_tok / mc.num_experts) ** slots


# The Pallas GEMM kernels (custom calls gemms() cannot see into) -> (input, weight) operands.
_PALLAS_GEMMS = {"fp8_linear": (0, 1), "fp8_swiglu_gate_up": (0, 1), "fp8_down": (0, 2),
                 "swiglu_gate_up": (0, 1), "swiglu_bwd": (0, 1)}
_HLO_TYPE = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8e4m3fn"}


def pallas_gemms(module) -> list[tuple[str, str, str, str, str]]:
    """gemms() rows of the Pallas GEMM kernels: "pallas <kernel>", operand types as read."""
    import _hlo_walk as hw
    out = []
    for ins in (i for c in module.computations.values() for i in c.instrs
                if i.opcode == "custom-call"):
        kernel = max((k for k in _PALLAS_GEMMS if k in ins.kernel_name), key=len, default=None)
        if kernel is not None:
            ops = [_HLO_TYPE.get(str(d), str(d)) for d, _ in hw.operands_of(ins)]
            a, b = _PALLAS_GEMMS[kernel]
            out.append((f"pallas {kernel}", ops[a], ops[b], ins.shapes[0][0], ins.op_name))
    return out


def gemm_forms(module) -> list[dict]:
    """Each distinct GEMM of the program (bench/_hlo_walk.gemms, pallas_gemms): its form
    ("triton" fusion, a cuBLAS(Lt) custom call target or "pallas <kernel>"), the types its
    operands are read as ("a->b": converted on the way, e.g. a weight dequantized before a plain
    GEMM), its result type, the JAX operation (the last two op_name parts) and how many."""
    import _hlo_walk as hw
    counts: dict[tuple, int] = {}
    for form, lhs, rhs, result, op in hw.gemms(module) + pallas_gemms(module):
        key = (form, lhs, rhs, result, "/".join(op.split("/")[-2:]))
        counts[key] = counts.get(key, 0) + 1
    return [dict(form=f, lhs=a, rhs=b, result=r, op=o, count=n)
            for (f, a, b, r, o), n in sorted(counts.items(), key=lambda x: -x[1])]


def decode_report(target: str, model: str, case: str, built: dict) -> dict:
    import _hlo_walk as hw

    from brorl_jax.models.precision import with_precision
    from pallas_kernels.decode_attention import slot_decode_attention_traffic
    from pallas_kernels.fp8_gemm import KERNEL_NAMES as FP8_KERNELS, fp8_gemm_kernel_cost
    from pallas_kernels.grouped_gemm import KERNEL_NAMES as GG_KERNELS, grouped_gemm_kernel_cost
    from pallas_kernels.sampling import sample_tokens_traffic
    from pallas_kernels.swiglu_mlp import KERNEL_NAMES as MLP_KERNELS, swiglu_mlp_kernel_cost
    cfg, mc = model_config(model, case)
    mc = with_precision(mc, *built.get("precision", ("bf16", "bf16")))
    c = dict(CASES[case], slots=built["slots"], prompts=built["prompts"])
    family = "triton" if TARGETS[target]["platform"] == "cuda" else "mosaic"
    per_prompt = [c["slots"] // c["prompts"]] * c["prompts"]
    per_prompt[-1] += c["slots"] - sum(per_prompt)
    ops = hw.operands_of
    attn = lambda kernel: lambda ins: slot_decode_attention_traffic(
        kernel, ops(ins), group=mc.num_attention_heads // mc.num_key_value_heads,
        slots_per_prompt=per_prompt, prompt_len=c["prompt_len"], own_len=c["own_len"],
        family=family)
    custom = {
        "slot_decode_attention_prefix": attn("slot_decode_attention_prefix"),
        "slot_decode_attention_own": attn("slot_decode_attention_own"),
        "sample_tokens": lambda ins: sample_tokens_traffic(
            ops(ins), vocab=mc.vocab_size, temperature=cfg.rollout.temperature,
            top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p),
    }
    custom.update({n: (lambda n: lambda ins: swiglu_mlp_kernel_cost(n, ops(ins), ins.shapes))(n)
                   for n in MLP_KERNELS})
    custom.update({n: (lambda n: lambda ins: fp8_gemm_kernel_cost(n, ops(ins), ins.shapes))(n)
                   for n in FP8_KERNELS})
    # the rows in groups: a device's slots' (token, choice) rows; under expert parallelism the
    # rows it receives (as many on average) in an exchange buffer expert times that size
    gg_rows = c["slots"] * max(1, mc.num_experts_per_tok)
    custom.update({n: (lambda n: lambda ins: grouped_gemm_kernel_cost(
        n, ops(ins), ins.shapes, gg_rows))(n) for n in GG_KERNELS})
    module = hw.parse(built["hlo"])
    entry = hw.walk(module, custom)
    decode_loops = [lp for lp in entry.loops if lp.trip_count is None and lp.depth == 0]
    if not decode_loops:
        raise RuntimeError("no decode while_loop of unknown trip count in the entry computation")
    outer = max(decode_loops, key=lambda lp: lp.body.bytes)
    k = built["check_every"]
    inner = [lp for lp in outer.body.loops if lp.trip_count == k and lp.depth == 1]
    step_loop = inner[0] if (k > 1 and inner) else outer
    if k > 1 and not inner:
        raise RuntimeError(f"check_every={k} but no inner loop of {k} steps in the decode loop")
    it = outer.per_iteration()
    per_step = lambda x: x / k
    floor = floor_bytes(mc, slots=c["slots"], prompts=c["prompts"], prompt_len=c["prompt_len"],
                        own_len=c["own_len"], n_params=built["n_params"],
                        expert=c.get("expert", 1))
    fl = sum(floor.values())
    tgt = TARGETS[target]
    b, f = per_step(it.bytes), per_step(it.flops)
    step_s = max(b / tgt["bandwidth"], f / tgt["flops"])
    step_it = step_loop.per_iteration() if step_loop is not outer else it
    return dict(
        case=case, slots=int(c["slots"]), context=int(c["prompt_len"] + c["own_len"]),
        bytes_per_step=b, floor_bytes_per_step=fl,
        host_syncs_per_step=per_step(it.host_syncs),
        collectives_per_step=int(round(step_it.collectives)) if step_loop is not outer
        else int(round(it.collectives)),
        collectives_per_check=int(round(it.collectives - (k * step_it.collectives
                                                           if step_loop is not outer else 0))),
        check_every=k, ratio=b / fl, floor_terms=floor, flops_per_step=f,
        expert_coverage=expert_coverage(mc, c["slots"]),
        split_k_bytes_per_step=per_step(it.split_k_bytes),
        kernels_per_step=per_step(it.kernels),
        predicted_step_ms=1e3 * step_s, predicted_tokens_per_s=c["slots"] / step_s,
        floor_tokens_per_s=c["slots"] / (fl / tgt["bandwidth"]),
        devices=built["devices"], param_dtypes=built["param_dtypes"],
        weight_precision=mc.weight_precision, kv_precision=mc.kv_precision,
        largest_copies=[dict(bytes=per_step(x), shape=s, op=o[-90:])
                        for x, s, o in it.largest_copies(5)],
        largest_kernels=[dict(bytes=per_step(x), name=n, type=t, op=o[-90:])
                         for x, n, t, o in it.largest(8)],
        undeclared_custom_calls=sorted(set(it.undeclared)), gemms=gemm_forms(module),
        compile_s=built["compile_s"], temp_bytes=built["temp_bytes"])


def measure_device(model: str, slots: int, prompt_len: int, own_len: int,
                   precision: str = "bf16") -> dict:
    """On a real GPU (bench/device_check.sh): the decode loop at ``slots`` slots on the model's
    shapes (random weights, one random prompt, no stop token, max_new_tokens = 2 x own_len,
    so the mean own length over the run is ``own_len``), its weights and KV cache at
    ``precision`` ("bf16" | "fp8": both, models.precision.with_precision), run once to compile and
    once timed; next to the bytes per step this walker predicts for the same program compiled
    for this device at the same lengths."""
    import jax
    import numpy as np

    from brorl_jax.models import init_params
    from brorl_jax.models.precision import with_precision
    from brorl_jax.rollout import Engine

    cfg, mc = model_config(model)
    if jax.default_backend() != "gpu":
        raise SystemExit(f"--measure-device needs a GPU backend, not {jax.default_backend()!r} "
                         "(bench/device_check.sh runs it on a lent GPU)")
    new = 2 * own_len
    engine = Engine(with_precision(mc, precision, precision), impl="auto")
    params = engine.rollout_params(init_params(mc, jax.random.PRNGKey(0)))
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, mc.vocab_size, prompt_len)]
    call = dict(rollouts_per_prompt=slots, max_new_tokens=new, temperature=1.0, eos_ids=())
    t0 = time.perf_counter()
    engine.generate(params, [prompt], **call)   # compiles every program of this call
    t_compile = time.perf_counter() - t0
    res = engine.generate(params, [prompt], **call)
    st = res.stats
    fn, args = engine.decode_program(params, prompt_len=prompt_len, num_prompts=1, slots=slots,
                                     rollouts_per_prompt=slots, max_new_tokens=new)
    text = fn.trace(*args).lower().compile().as_text()
    master = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    built = dict(hlo=text, slots=slots, prompts=1, devices=1, check_every=engine.check_every,
                 precision=[precision, precision],
                 param_dtypes=sorted({str(x.dtype) for x in jax.tree.leaves(params)}),
                 n_params=int(sum(x.size for x in jax.tree.leaves(master))), compile_s=None,
                 temp_bytes=0)
    CASES["device"] = dict(slots=slots, prompts=1, prompt_len=prompt_len, own_len=own_len)
    pred = decode_report("h100", model, "device", built)
    steps, secs = st["decode_steps"], st["decode_seconds"]
    return dict(precision=precision, slots=slots, context=prompt_len + own_len,
                decode_steps=steps,
                decode_seconds=secs, tokens_per_s=st["useful_tokens"] / max(secs, 1e-9),
                step_ms=1e3 * secs / max(steps, 1),
                predicted_bytes_per_step=pred["bytes_per_step"],
                floor_bytes_per_step=pred["floor_bytes_per_step"],
                achieved_bytes_per_s=pred["bytes_per_step"] * steps / max(secs, 1e-9),
                compile_and_warm_s=t_compile, device=str(jax.devices()[0]))


def _measure_main(args) -> int:
    """--measure-device: each of --precisions timed in turn in this process; with bf16 and fp8
    both, the fp8 / bf16 ratios measured side by side (the last line printed)."""
    runs = {}
    for prec in args.precisions:
        r = runs[prec] = measure_device(args.model, args.slots, 1024, args.own_len, prec)
        print(json.dumps(r, indent=1))
        print(f"decode ({prec} weights + KV) on {r['device']}: {r['slots']} slots, mean context "
              f"{r['context']}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s; "
              f"achieved {r['achieved_bytes_per_s'] / 1e12:.2f} TB/s of the walker's "
              f"{r['predicted_bytes_per_step'] / GB:.2f} GB/step (floor "
              f"{r['floor_bytes_per_step'] / GB:.2f} GB/step)", flush=True)
    out = runs if len(runs) > 1 else next(iter(runs.values()))
    if {"bf16", "fp8"} <= set(runs):
        b, f = runs["bf16"], runs["fp8"]
        out = dict(runs, fp8_over_bf16=dict(
            step_ms=f["step_ms"] / b["step_ms"], tokens_per_s=f["tokens_per_s"] / b["tokens_per_s"],
            predicted_bytes=f["predicted_bytes_per_step"] / b["predicted_bytes_per_step"]))
        x = out["fp8_over_bf16"]
        print(f"fp8 / bf16 decode, measured side by side: step time x{x['step_ms']:.2f}, "
              f"tokens/s x{x['tokens_per_s']:.2f} (walker's bytes/step x{x['predicted_bytes']:.2f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def update_section(target: str, model: str):
    if importlib.util.find_spec("_roofline_update") is None:
        print("update: bench/_roofline_update.py is absent (the update half of the roofline): "
              '"update": null', flush=True)
        return None
    from _roofline_update import update_report
    return update_report(target, model)


def _fmt_case(r: dict) -> str:
    return (f"| {r['case']} | {r['slots']} | {r['context']} | {r['bytes_per_step'] / GB:.2f} | "
            f"{r['floor_bytes_per_step'] / GB:.2f} | {r['ratio']:.2f} | "
            f"{r['split_k_bytes_per_step'] / GB:.2f} | {r['predicted_step_ms']:.2f} | "
            f"{r['predicted_tokens_per_s']:,.0f} | {r['host_syncs_per_step']:.3f} | "
            f"{r['collectives_per_step']} ({r['collectives_per_check']} per check of "
            f"{r['check_every']}) |")


HEADER = ("| case | slots | context | GB/step | floor GB | x floor | split-K GB (apart) | "
          "step ms | tokens/s | host syncs/step | collectives/step |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100", choices=list(TARGETS))
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=list(MODELS))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--hlo-dir", default="", help="save each case's optimized HLO here")
    ap.add_argument("--reuse", action="store_true",
                    help="read a case compiled earlier into --hlo-dir instead of compiling")
    ap.add_argument("--no-update", action="store_true", help="decode cases only")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
    ap.add_argument("--measure-device", action="store_true",
                    help="on a GPU: time the decode loop (random weights) next to the walk of "
                         "the same program compiled for that GPU (bench/device_check.sh)")
    ap.add_argument("--slots", type=int, default=256, help="--measure-device: decode slots")
    ap.add_argument("--precisions", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                    help="--measure-device: the weights' and KV cache's precision, each timed")
    ap.add_argument("--own-len", type=int, default=1536,
                    help="--measure-device: mean own positions (2x new tokens, run twice)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.measure_device:      # on the GPU itself: no compile extra, no topology
        return _measure_main(args)
    why = missing_extra(args.target)
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.one:
        target, model, case, out = json.loads(args.one)
        built = compile_case(target, model, case)
        with open(out, "w") as f:
            json.dump(built, f)
        return 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_WORKER_HOSTNAMES="localhost")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print(f"target: {TARGETS[args.target]['desc']}; model {args.model} as configs/brorl.py runs "
          "it (bf16 compute, float32 master weights through Runtime.rollout_params)", flush=True)
    rows = []
    import tempfile
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    for case in args.cases:
        out = os.path.join(args.hlo_dir or tempfile.mkdtemp(prefix="roofline_"),
                           f"{args.target}_{case}.json")
        t0 = time.perf_counter()
        if args.reuse and os.path.exists(out):
            proc = subprocess.CompletedProcess([], 0)
        else:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--target",
                                   args.target, "--one",
                                   json.dumps([args.target, args.model, case, out])],
                                  env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            print(f"{case}: compile FAILED ({proc.returncode}):\n{tail}", flush=True)
            return 1
        with open(out) as f:
            built = json.load(f)
        r = decode_report(args.target, args.model, case, built)
        rows.append(r)
        ft = {k: v / GB for k, v in r["floor_terms"].items()}
        print(f"{case}: {time.perf_counter() - t0:.0f} s (compile {built['compile_s']} s); "
              f"weights {'/'.join(r['param_dtypes'])}; floor = weights {ft['weights']:.2f} + KV "
              f"{ft['kv']:.2f} + new K/V {ft['new_kv']:.3f} + logits {ft['logits']:.3f} GB; "
              "largest kernels: " + "; ".join(
                  f"{k['bytes'] / GB:.2f} GB {k['type']} ({k['op'].split('/')[-2:][0]})"
                  for k in r["largest_kernels"][:4]) + "; largest copies: " + (
                  "; ".join(f"{x['bytes'] / GB:.3f} GB {x['shape']}"
                            for x in r["largest_copies"][:3]) or "none"), flush=True)
        print("  GEMMs: " + "; ".join(f"{g['count']}x {g['form']} {g['lhs']} x {g['rhs']} -> "
                                       f"{g['result']} ({g['op'].split('/')[0]})"
                                       for g in r["gemms"]), flush=True)
        if r["undeclared_custom_calls"]:
            print(f"  undeclared custom calls (operands + outputs counted): "
                  f"{r['undeclared_custom_calls']}", flush=True)
    print("\n" + HEADER)
    for r in rows:
        print(_fmt_case(r))
    report = {"target": args.target, "model": args.model, "decode": rows,
              "update": None if args.no_update else update_section(args.target, args.model)}
    if report["update"]:
        u = report["update"]
        print(f"\nupdate: {u['rows']} x {u['seq']}: flops executed / needed "
              f"{u['flops_executed'] / max(u['flops_needed'], 1):.2f}, MFU ceiling "
              f"{u['mfu_ceiling']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

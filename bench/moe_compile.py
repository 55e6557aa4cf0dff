"""Qwen3-30B-A3B's update and rollout decode compiled expert parallel, without a device (issue 43).

    PYTHONPATH=<compile extra>:. python bench/moe_compile.py --target h100 --json FILE
    PYTHONPATH=<libtpu dir>:. python bench/moe_compile.py --target v5e --layers 2 --json FILE

For a GPU target: 8 H100s (topology 1x1x8), mesh expert = 8; for TPU: 16 chips of libtpu's
v5e:4x4, mesh fsdp = 4 x expert = 4 (a 16 GB chip holds 2 of the 48 layers: --layers 2). The model is
configs/brorl_64gpu.qwen3_30b_a3b (128 experts of width 768, top-8; bf16 compute, float32 master
weights; --layers replaces the layer count, nothing else). Two programs, each compiled by XLA for
the target (no device):

* ``update``: the trainer's sharded update step (algo.sharded_steps.make_sharded_update: the
  rules of rules.for_mesh, the experts over `expert`, every device its rows; PPO with the KL
  term, Adam, routing replayed from the batch's int8 record), one packed micro-batch of
  ``--tokens`` tokens per device (default 4096; the exact capacity's buffers grow with it:
  docs/scale.md section 1).
* ``decode``: the rollout's decode program (rollout.Engine on the mesh, configs/brorl.py's
  rollout settings, the routing recorded), each device its own ``--slots`` slots of one
  1024-token prompt and its 16 (GPU) / 32 (TPU) experts a layer (replicated over fsdp).

Per program: lower and compile seconds, XLA's memory analysis per device (arguments, temporaries),
the all-to-alls of the token exchange and the grouped-GEMM kernel calls in the compiled program.
What this does not show: speed (no device; bench/roofline.py walks the decode program's bytes),
collectives' time, the run-time memory of a real step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

SEQ = 2048                    # packed row width of the update batch
PROMPT_LEN, MAX_NEW = 1024, 3072


def _mesh(target: str, expert: int | None = None):
    import jax
    import numpy as np
    from jax.experimental import topologies
    from roofline import TARGETS, _target_config
    if TARGETS[target]["platform"] == "cuda":
        topo = topologies.get_topology_desc(platform="cuda", target_config=_target_config(target),
                                            topology="1x1x8")
        ep = 8 if expert is None else expert                  # expert = 8 (or fsdp = 8 / ep)
        devices = np.asarray(topo.devices).reshape(1, 8 // ep, ep, 1)
    else:     # 16 v5e chips: fsdp = 4 (a 16 GB chip holds a quarter of the embeddings)
        topo = topologies.get_topology_desc(topology_name="v5e:4x4", platform="tpu")
        ep = 4 if expert is None else expert                  # x expert = 4
        devices = np.asarray(topo.devices).reshape(1, 16 // ep, ep, 1)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "expert", "tensor"))


CAPACITY_FACTOR = 0.0        # --capacity-factor: mesh.expert_capacity_factor (0 = exact)


def _model(layers: int | None):
    from configs import brorl, brorl_64gpu
    cfg = brorl.get_config()
    mc = brorl_64gpu.qwen3_30b_a3b(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    mc = dataclasses.replace(mc, expert_capacity_factor=CAPACITY_FACTOR)
    if layers:
        mc = dataclasses.replace(mc, num_hidden_layers=layers)
    cfg.algo.routing_replay = "rollout"
    return cfg, mc


def _kernel_calls(text: str) -> dict:
    """Counts in the compiled program: the token exchange's all-to-alls (those a shard_map's
    jax.lax.all_to_all made: XLA's own resharding moves arrays with all-to-alls too), the
    grouped-GEMM kernels, all Pallas/Mosaic calls."""
    if os.environ.get("MOE_COMPILE_HLO"):
        with open(os.environ["MOE_COMPILE_HLO"], "a") as f:
            f.write(text)
    lines = [ln for ln in text.splitlines() if " custom-call(" in ln]
    a2a = [ln for ln in text.splitlines() if re.search(r"all-to-all(-start)?\(", ln)]
    return {"all_to_all": len(a2a),
            "all_to_all_exchange": sum("shard_map" in ln and "all_to_all" in ln for ln in a2a),
            "grouped_gemm": sum("grouped_gemm" in ln for ln in lines),
            "mosaic_or_triton": sum(("mosaic" in ln or "triton" in ln or "tpu_custom_call" in ln)
                                    for ln in lines)}


def _summary(compiled, t0, t1, t2) -> dict:
    mem = compiled.memory_analysis()
    return dict(lower_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1),
                argument_gib=round(mem.argument_size_in_bytes / 2**30, 2),
                temp_gib=round(mem.temp_size_in_bytes / 2**30, 2),
                output_gib=round(mem.output_size_in_bytes / 2**30, 2),
                **_kernel_calls(compiled.as_text()))


def compile_update(target: str, layers: int | None, tokens: int, expert: int | None = None
                   ) -> dict:
    import jax
    import numpy as np
    from _roofline_update import packed_batch_shapes
    from jax.sharding import NamedSharding, PartitionSpec as P
    from roofline import TARGETS

    import pallas_kernels as pk
    from brorl_jax import algo
    from brorl_jax.algo import sharded_steps
    from brorl_jax.config import optimizer_config, update_config
    from brorl_jax.models import init_params
    from brorl_jax.models.moe import route_dtype
    cfg, mc = _model(layers)
    mesh = _mesh(target, expert)
    n_dev = mesh.devices.size
    rows = n_dev * max(1, tokens // SEQ)
    cfg.algo.ppo_mini_batches = 1          # one mini-batch of one micro-batch: the rows of
    cfg.algo.micro_batch_size = rows       # all devices, --tokens of them a device
    cfg.algo.micro_batch_tokens = 0
    acfg = update_config(cfg)
    opt = algo.make_optimizer(optimizer_config(cfg))
    t0 = time.perf_counter()
    with pk.compile_target(TARGETS[target]["platform"]):
        params = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
        state = jax.eval_shape(lambda p: algo.create_train_state(
            p, opt, with_reference=acfg.kl_coef > 0), params)
        batch = packed_batch_shapes(rows, SEQ).replace(routing=jax.ShapeDtypeStruct(
            (rows, SEQ, mc.num_hidden_layers, mc.num_experts_per_tok), route_dtype(mc)))
        update, sh = sharded_steps.make_sharded_update(mc, acfg, opt, mesh, state, batch,
                                                       rules=cfg.mesh.rules)
        place = lambda tree, shard: jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shard)
        key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=NamedSharding(mesh, P()))
        with jax.set_mesh(mesh):
            lowered = update.trace(place(state, sh["state"]), place(batch, sh["batch"]),
                                   key).lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
    out = _summary(compiled, t0, t1, time.perf_counter())
    out.update(devices=n_dev, rows=rows, seq=SEQ, tokens_per_device=rows // n_dev * SEQ,
               n_params=int(sum(math.prod(x.shape) for x in jax.tree.leaves(params))),
               gate_proj_spec=str(sh["state"].params["layers"]["moe"]["gate_proj"].spec))
    return out


def compile_decode(target: str, layers: int | None, slots: int, expert: int | None = None
                   ) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from roofline import TARGETS

    import pallas_kernels as pk
    from brorl_jax.models import init_params
    from brorl_jax.parallel.expert_parallel import rollout_param_specs
    from brorl_jax.rollout import Engine
    from brorl_jax.train.runtime import LocalRuntime
    cfg, mc = _model(layers)
    mesh = _mesh(target, expert)
    t0 = time.perf_counter()
    with pk.compile_target(TARGETS[target]["platform"]):
        runtime = LocalRuntime(cfg, mc, None, diagnostics_n=None)
        abstract = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
        rparams = jax.eval_shape(runtime.rollout_params, abstract)
        engine = Engine(runtime.rollout_cfg(mc), mesh=mesh, impl=runtime.rollout_impl,
                        record_routing=True)
        fn, args = engine.decode_program(
            rparams, prompt_len=PROMPT_LEN, max_new_tokens=MAX_NEW, num_prompts=1, slots=slots,
            rollouts_per_prompt=cfg.rollout.rollouts_per_prompt,
            temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p)
        place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
        args = (jax.tree.map(place, args[0], rollout_param_specs(args[0], mc.num_experts)),
                *jax.tree.map(lambda x: place(x, P()), args[1:4]),
                *jax.tree.map(lambda x: place(x, P(engine.axes)), args[4:]))
        with jax.set_mesh(mesh):
            lowered = fn.trace(*args).lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
    out = _summary(compiled, t0, t1, time.perf_counter())
    out.update(devices=mesh.devices.size, slots_per_device=slots)
    return out


def main(argv=None) -> int:
    from roofline import TARGETS, missing_extra
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100", choices=list(TARGETS))
    ap.add_argument("--layers", type=int, default=None, help="replace the 48 layers")
    ap.add_argument("--tokens", type=int, default=4096, help="update tokens per device")
    ap.add_argument("--slots", type=int, default=128, help="decode slots per device")
    ap.add_argument("--programs", nargs="+", default=["update", "decode"],
                    choices=["update", "decode"])
    ap.add_argument("--expert", type=int, default=None,
                    help="the expert axis (default 8 on GPU, 4 on TPU; 1: no expert parallelism, "
                         "the experts over fsdp and the kernel per device)")
    ap.add_argument("--capacity-factor", type=float, default=0.0,
                    help="mesh.expert_capacity_factor (0 = exact: every row sent)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    global CAPACITY_FACTOR
    CAPACITY_FACTOR = args.capacity_factor
    why = missing_extra(args.target)
    if why:
        print(why, file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    report = dict(target=TARGETS[args.target]["desc"], layers=args.layers or 48,
                  capacity_factor=args.capacity_factor, expert=args.expert)
    for prog in args.programs:
        fn = compile_update if prog == "update" else compile_decode
        size = args.tokens if prog == "update" else args.slots
        report[prog] = fn(args.target, args.layers, size, args.expert)
        print(prog, json.dumps(report[prog]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

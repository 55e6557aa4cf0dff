"""The update half of bench/roofline.py (issue 25): the RL update step at 8 packed rows x 2048
tokens on Qwen2.5-1.5B shapes, compiled for a GPU target without a GPU, walked kernel by kernel.

    python bench/_roofline_update.py --target h100 [--json FILE] [--hlo FILE] [--attention reference]
    python bench/_roofline_update.py --lora_table [--targets h100 v5e] [--models ...] [--layers 2]

--lora_table (issue 42): the update with LoRA (``--lora_rank`` 32, ``--lora_alpha`` 32, all seven
projections; the state of algo.adapters.lora_train_state) beside full fine-tuning, compiled for
H100 and TPU v5e (libtpu's v5e:2x2 topology, one chip) at pallas_kernels.targets.MODEL_SHAPES:
compiled or the compiler's reason, compile seconds, memory_analysis() argument and temp bytes.
On GPU/TPU the layers are unrolled (models.transformer.layer_loop_form), so compile time grows
with ``--layers``.

The program is the trainer's (``configs/brorl.py``): bf16 compute over float32 master weights,
remat on with the policy ``algo.update.plan_remat_policy`` picks for the target's memory (what
``make_update_step`` picks on the device itself: the allocator's default 75 % of it),
``model.attention_impl`` / ``algo.logprob_impl`` as configured (``impl="auto"`` resolves to the
kernels on the target), ``algo.ppo_mini_batches`` optimizer steps with micro-batches of
``algo.micro_batch_size`` rows, pi_old recomputed as the recipe does (its pass counts in the
executed flops and the time), the KL reference log-probs as an input (a separate program).

Definitions (the issue's):
  flops needed    6 x params x tokens (the tied embedding counted once, as the LM head) + the
                  causal half of attention for the gradient pass (3 x 2 x 2 x T^2 / 2 x H x Dh
                  per row and layer: forward + backward)
  flops executed  every dot XLA runs (HLO walk; loop bodies x trip counts) + the Pallas kernels'
                  declared flops (attention: the tile pairs the kernels visit; log-prob: their
                  tiles), including the pi_old pass, the remat recomputation and padding
  predicted time  per kernel max(flops / peak, bytes / bandwidth), summed (a GEMM's bytes: its
                  operands + output; a deviceless compile's default split-K float32 partials are
                  reported apart, not counted)
  MFU ceiling     flops needed / (predicted time x peak)

Pallas kernels are opaque to the walk; their flops and bytes come from declarations beside the
kernels (pallas_kernels.packed_attention.packed_attention_kernel_cost,
pallas_kernels.fused_logprob.fused_logprob_kernel_cost), matched by kernel name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

ROWS, SEQ = 8, 2048
# the allocator's default share of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION = 0.75): what
# device_memory_bytes() reports on the device, so what the memory plan sees there
ALLOCATOR_FRACTION = 0.75


def _targets():
    from roofline import TARGETS, _target_config, missing_extra, model_config
    return TARGETS, _target_config, missing_extra, model_config


def packed_batch_shapes(rows: int = ROWS, seq: int = SEQ):
    """The packed update batch (algo.UpdateBatch in algo.batch's packed layout) as
    ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    from brorl_jax.algo import UpdateBatch
    i32, f32 = jnp.int32, jnp.float32
    s = lambda dt: jax.ShapeDtypeStruct((rows, seq), dt)
    return UpdateBatch(input_tokens=s(i32), positions=s(i32), loss_mask=s(jnp.bool_),
                       targets=s(i32), old_logprobs=s(f32), ref_logprobs=s(f32),
                       advantages=s(f32), segment_ids=s(i32))


def build_update(cfg, mc, *, device_bytes: int | None, remat_policy: str | None = None):
    """(jitted update, abstract state, algo config) as the trainer builds them (LocalRuntime);
    under LoRA (mc.lora_rank > 0) the state of algo.adapters.lora_train_state (the base frozen in
    the compute dtype, the adapters alone in the optimizer, no reference copy)."""
    import jax

    from brorl_jax import algo
    from brorl_jax.algo import adapters
    from brorl_jax.config import optimizer_config, update_config
    from brorl_jax.models import init_params, lora
    acfg = update_config(cfg)
    opt = algo.make_optimizer(optimizer_config(cfg))
    abstract = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    if lora.enabled(mc):
        state = jax.eval_shape(lambda p: adapters.lora_train_state(p, mc, opt, seed=0), abstract)
    else:
        state = jax.eval_shape(
            lambda p: algo.create_train_state(p, opt, with_reference=acfg.kl_coef > 0), abstract)
    step = algo.make_update_step(mc, acfg, opt, device_bytes=device_bytes,
                                 remat_policy=remat_policy)
    return jax.jit(step, donate_argnums=(0,)), state, acfg


def _model(model: str, layers: int | None, lora_rank: int, lora_alpha: float):
    """(run config, ModelConfig): bench/roofline.py's model, or a pallas_kernels.targets
    MODEL_SHAPES name with configs/brorl.py's dtypes (bf16 compute, float32 master weights);
    ``layers`` replaces the layer count (the layers are unrolled on GPU/TPU: fewer compile
    faster; the widths, heads and vocabulary stay the model's); with
    ``lora_rank`` > 0 LoRA on all seven projections at ``lora_alpha``."""
    from brorl_jax.models import lora
    from pallas_kernels.targets import MODEL_SHAPES
    _, _, _, model_config = _targets()
    if model in MODEL_SHAPES and model != "qwen2.5-1.5b":
        from _measure import shape_config

        from configs import brorl
        cfg = brorl.get_config()
        mc = dataclasses.replace(shape_config(model, layers=layers, dtype=cfg.model.dtype),
                                 param_dtype=cfg.model.param_dtype)
    else:
        cfg, mc = model_config(model)
    if layers:
        mc = dataclasses.replace(mc, num_hidden_layers=layers)
    if lora_rank:
        mc = dataclasses.replace(mc, lora_rank=lora_rank, lora_alpha=float(lora_alpha),
                                 lora_targets=tuple(lora.TARGETS))
    return cfg, mc


def _mesh(target: str, platform: str):
    """A one-device mesh of the target's topology description (no device needed): the GPU's
    GpuTargetConfig, or libtpu's v5e:2x2 as bench/compile_check.py builds it."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    if platform == "tpu":
        topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    else:
        _, target_config, _, _ = _targets()
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                            topology="1x1x1")
    return jax.sharding.Mesh(np.asarray(topo.devices[:1]), ("x",))


def compile_update(target: str, model: str, attention: str | None = None,
                   remat: str | None = None, micro_per_mini: int = 1, lora_rank: int = 0,
                   lora_alpha: float = 32.0, layers: int | None = None) -> dict:
    """The update compiled and described (``hlo`` and the settings it was built with). With
    ``micro_per_mini`` M > 1 the batch is M x 8 rows and every mini-batch holds M micro-batches
    of the 8 x 2048 program's 2 rows (gradients accumulated over them before its optimizer
    step), as a mini-batch of the recipe holds many. ``lora_rank``, ``layers``: see _model."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pallas_kernels as pk
    from brorl_jax.algo.update import plan_remat_policy

    targets, _, _, _ = _targets()
    tgt = targets[target]
    cfg, mc = _model(model, layers, lora_rank, lora_alpha)
    mc = dataclasses.replace(mc, attention_impl=attention or cfg.model.attention_impl)
    rows = ROWS * micro_per_mini
    if micro_per_mini > 1:      # the same micro-batch as the 8-row program, M of them
        cfg.algo.micro_batch_size = ROWS // cfg.algo.ppo_mini_batches
        cfg.algo.micro_batch_tokens = 0
    mesh = _mesh(target, tgt["platform"])
    rep = NamedSharding(mesh, P())
    device_bytes = int(tgt["memory"] * ALLOCATOR_FRACTION)
    t0 = time.perf_counter()
    with pk.compile_target(tgt["platform"]):
        update, state, acfg = build_update(cfg, mc, device_bytes=device_bytes, remat_policy=remat)
        place = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)
        batch = place(packed_batch_shapes(rows))
        key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=rep)
        with jax.set_mesh(mesh):
            lowered = update.trace(place(state), batch, key).lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
        t2 = time.perf_counter()
        n_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)))
        mini = rows // acfg.ppo_mini_batches
        micro = min(acfg.micro_batch_size if acfg.micro_batch_tokens <= 0
                    else acfg.micro_batch_tokens // SEQ, mini)
        # the policy the step took: planned for the target (its kernels decide what is kept)
        policy = remat or plan_remat_policy(mc, micro * SEQ, n_params, device_bytes)
    mem = compiled.memory_analysis()
    return dict(hlo=compiled.as_text(), lower_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1),
                n_params=n_params, layers=mc.num_hidden_layers, lora_rank=mc.lora_rank,
                attention_impl=mc.attention_impl, remat_policy=policy,
                ppo_mini_batches=acfg.ppo_mini_batches, ppo_epochs=acfg.ppo_epochs,
                micro_rows=micro, rows=rows, micro_per_mini=micro_per_mini,
                recompute_old_logprobs=acfg.recompute_old_logprobs,
                temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
                argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0) or 0))


def flops_needed(mc, n_params: int, rows: int = ROWS, seq: int = SEQ) -> dict:
    """6 x params x tokens + the causal half of attention, forward + backward (3 x forward)."""
    from pallas_kernels.packed_attention import causal_attention_flops
    dense = 6.0 * n_params * rows * seq
    attn = 3.0 * mc.num_hidden_layers * causal_attention_flops(
        rows, seq, mc.num_attention_heads, mc.head_dim)
    return dict(dense=dense, attention=attn, total=dense + attn)


def _kernel_time(b: float, f: float, tgt: dict) -> float:
    return max(b / tgt["bandwidth"], f / tgt["flops"])


def report_from_hlo(target: str, model: str, built: dict) -> dict:
    import _hlo_walk as hw

    from pallas_kernels.fused_logprob import fused_logprob_kernel_cost
    from pallas_kernels.packed_attention import KERNEL_NAMES, packed_attention_kernel_cost
    from pallas_kernels.swiglu_mlp import KERNEL_NAMES as MLP_KERNELS, swiglu_mlp_kernel_cost

    targets, _, _, model_config = _targets()
    tgt = targets[target]
    _, mc = model_config(model)
    kernels: list = []          # (bytes, flops, what) per kernel launch, x trip counts

    def declared(fn, name):
        def one(ins):
            comp = walker_comp[0]
            ops = [comp.by_name[o].shapes[0] for o in ins.operands if o in comp.by_name]
            return fn(name, ops, ins.shapes)
        return one

    custom = {n: declared(packed_attention_kernel_cost, n) for n in KERNEL_NAMES["triton"]}
    custom.update({n: declared(fused_logprob_kernel_cost, n) for n in
                   ("fused_logprob_fwd", "fused_logprob_bwd_hidden", "fused_logprob_bwd_lm_head")})
    custom.update({n: declared(swiglu_mlp_kernel_cost, n) for n in MLP_KERNELS})
    module = hw.parse(built["hlo"])
    walker_comp: list = [None]
    cost = _walk_kernels(hw, module, custom, kernels, walker_comp)
    needed = flops_needed(mc, built["n_params"])
    t = sum(_kernel_time(b, f, tgt) for b, f, _ in kernels)
    compute_bound = sum(f / tgt["flops"] for b, f, _ in kernels if f / tgt["flops"] >= b / tgt["bandwidth"])
    by_kind: dict = {}
    for b, f, what in kernels:
        k = by_kind.setdefault(what, dict(bytes=0.0, flops=0.0, seconds=0.0, launches=0.0))
        k["bytes"] += b
        k["flops"] += f
        k["seconds"] += _kernel_time(b, f, tgt)
        k["launches"] += 1
    executed = cost.flops
    return dict(
        rows=ROWS, seq=SEQ, flops_executed=executed, flops_needed=needed["total"],
        mfu_ceiling=needed["total"] / (t * tgt["flops"]),
        executed_over_needed=executed / needed["total"],
        flops_needed_terms=needed, predicted_step_s=t,
        compute_bound_s=compute_bound, bytes=cost.bytes, split_k_bytes=cost.split_k_bytes,
        by_kind={k: v for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"])},
        largest_kernels=[dict(bytes=b, name=n, type=ty[:80], op=o[-90:])
                         for b, n, ty, o in cost.largest(8)],
        largest_copies=[dict(bytes=b, shape=s, op=o[-90:]) for b, s, o in cost.largest_copies(5)],
        custom_calls=sorted({k for k, _, _ in cost.custom}),
        undeclared_custom_calls=sorted(set(cost.undeclared)),
        n_params=built["n_params"], attention_impl=built["attention_impl"],
        remat_policy=built["remat_policy"], ppo_mini_batches=built["ppo_mini_batches"],
        micro_rows=built["micro_rows"], recompute_old_logprobs=built["recompute_old_logprobs"],
        temp_bytes=built["temp_bytes"], compile_s=built["compile_s"], target=target)


def _walk_kernels(hw, module, custom, kernels: list, current: list):
    """hw.walk, plus the (bytes, flops, kind) of every kernel launch times its loop multiplicity
    (the walker's per-kernel items carry bytes only; a kernel's roofline needs both)."""
    rec: dict = {}

    class Recorder(hw._Walker):
        def _instr(self, ins, comp, cost, depth):
            b0, f0 = cost.bytes, cost.flops
            current[0] = comp
            super()._instr(ins, comp, cost, depth)
            rec.setdefault((comp.name, ins.name), (ins, cost.bytes - b0, cost.flops - f0))

    cost = Recorder(module, custom).computation(module.entry)
    mult = {module.entry: 1.0}
    order = [module.entry]
    for name in order:                          # callers before callees (breadth first)
        for ins in module.computations[name].instrs:
            subs = []
            if ins.opcode == "while":
                trip = ins.backend_config().get("known_trip_count", {}).get("n")
                trip = int(trip) if trip is not None else 1
                subs = [(ins.attr("body"), trip), (ins.attr("condition"), trip + 1)]
            elif ins.opcode in ("call", "async-start"):
                subs = [(ins.attr("to_apply") or ins.attr("calls"), 1)]
            elif ins.opcode == "conditional":
                subs = [(b, 1) for b in re.findall(r"%([A-Za-z0-9_.\-]+)", ins.attrs)
                        if b in module.computations]
            for sub, times in subs:
                if sub in module.computations:
                    if sub not in mult:
                        order.append(sub)
                    mult[sub] = mult.get(sub, 0.0) + mult[name] * times
    for (comp, _), (ins, b, f) in rec.items():
        if not (b or f):
            continue
        text = ins.op_name + " " + ins.attrs
        kind = ("attention" if ins.opcode == "custom-call" and "mha_" in text
                else "logprob" if ins.opcode == "custom-call" and "fused_logprob" in text
                else "mlp" if ins.opcode == "custom-call" and "swiglu_" in text
                else "custom" if ins.opcode == "custom-call"
                else "gemm" if f else "memory")
        kernels.append((b * mult.get(comp, 1.0), f * mult.get(comp, 1.0), kind))
    return cost


def update_report(target: str, model: str, *, attention: str | None = None,
                  remat: str | None = None, hlo_out: str | None = None,
                  timeout: float = 3600.0, micro_per_mini: int = 1) -> dict:
    """Compile (in a subprocess: JAX_PLATFORMS=cpu with the compile extra's plugins) and report."""
    out = tempfile.mktemp(prefix="roofline_update_", suffix=".json")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    cache = os.environ.get("ROOFLINE_UPDATE_BUILT")     # reuse a compile (debugging the report)
    if cache and os.path.exists(cache):
        with open(cache) as f:
            built = json.load(f)
        return dict(report_from_hlo(target, model, built), wall_s=0.0)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                           json.dumps([target, model, attention, remat, out,
                                       micro_per_mini])], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError("update compile failed:\n" + "\n".join(
            (proc.stderr or proc.stdout).strip().splitlines()[-12:]))
    with open(out) as f:
        built = json.load(f)
    if cache:
        os.replace(out, cache)
    else:
        os.unlink(out)
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(built["hlo"])
    r = report_from_hlo(target, model, built)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    return r


def _compile_case(target: str, model: str, *, lora_rank: int, lora_alpha: float,
                  layers: int | None, timeout: float) -> dict:
    """One compile_update in a subprocess (JAX_PLATFORMS=cpu; for TPU, libtpu's deviceless
    settings of bench/compile_check.py): its description without the HLO, or status FAILED and
    the compiler's reason."""
    from compile_check import TPU_ENV, _short
    out = tempfile.mktemp(prefix="roofline_update_", suffix=".json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", **TPU_ENV)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    case = dict(target=target, model=model, lora_rank=lora_rank, layers=layers)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(
            [target, model, None, None, out, 1, lora_rank, lora_alpha, layers])], env=env,
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case, status=f"TIMEOUT after {timeout:.0f} s")
    if proc.returncode != 0 or not os.path.exists(out):
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        # the exception's own line (the traceback's last "...Error: ..."), else the tail
        raised = [l for l in lines if re.match(r"\s*[\w.]+(Error|Exception): ", l)]
        why = raised[-1] if raised else " ".join(lines[-6:]) or f"exit {proc.returncode}"
        return dict(case, status="FAILED: " + _short(why, limit=300),
                    compile_s=f"failed after {time.perf_counter() - t0:.0f} s in all")
    with open(out) as f:
        built = json.load(f)
    os.unlink(out)
    built.pop("hlo")
    return dict(case, **built, status="compiled")


def lora_table(targets, models, *, lora_rank: int = 32, lora_alpha: float = 32.0,
               layers: int | None = None, timeout: float = 1800.0,
               arms=("full", "lora")) -> list[str]:
    """Markdown rows: the update with LoRA (all seven projections) and with full fine-tuning
    (``arms``: both, or one) per target and model, compiled or the compiler's reason, compile
    seconds, the compiled program's argument bytes (the training state + the 8 x 2048 batch)
    and temp bytes, and LoRA's argument bytes over full fine-tuning's."""
    gib = lambda r, k: f"{r[k] / 2**30:.2f}" if k in r else "-"
    rows = ["| target | model | layers | arm | status | remat | compile s | argument GiB | "
            "temp GiB | LoRA / full arguments |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(rows[0] + "\n" + rows[1], flush=True)
    for target in targets:
        for model in models:
            full, lo = ((_compile_case(target, model, lora_rank=r, lora_alpha=lora_alpha,
                                       layers=layers, timeout=timeout) if arm in arms else None)
                        for arm, r in (("full", 0), ("lora", lora_rank)))
            for r in (x for x in (full, lo) if x is not None):
                ratio = (f"{lo['argument_bytes'] / full['argument_bytes']:.3f}"
                         if r is lo and full and "argument_bytes" in lo
                         and full.get("argument_bytes") else "")
                arm = f"LoRA r{lora_rank} a{lora_alpha:g}" if r["lora_rank"] else "full"
                rows.append(f"| {target} | {model} | {r.get('layers', layers) or 'all'} | {arm} | "
                            f"{r['status']} | {r.get('remat_policy', '-')} | "
                            f"{r.get('compile_s', '-')} | {gib(r, 'argument_bytes')} | "
                            f"{gib(r, 'temp_bytes')} | {ratio} |")
                print(rows[-1], flush=True)
    return rows


def steady_state_report(target: str, model: str, *, micro: tuple[int, int] = (2, 3)) -> dict:
    """The update's cost per 8 x 2048 rows once the optimizer is amortised, as in the recipe
    (each optimizer step there covers a 16,384-sample mini-batch, hundreds of micro-batches):
    the programs with M = micro[0] and micro[1] micro-batches in each of the 4 mini-batches are
    compiled and walked, and their difference (micro[1] - micro[0] more micro-batches of 2 rows
    in each mini-batch: 8 rows, 16,384 tokens, their gradient passes, pi_old pass and
    gradient accumulation, no optimizer step) is set against the flops those tokens need.
    Both programs accumulate (M >= 2), so the difference holds no one-off cost."""
    a, b = (update_report(target, model, micro_per_mini=m) for m in micro)
    targets, _, _, model_config = _targets()
    _, mc = model_config(model)
    rows = ROWS * (micro[1] - micro[0])
    needed = flops_needed(mc, a["n_params"], rows=rows)["total"]
    seconds = b["predicted_step_s"] - a["predicted_step_s"]
    by_kind = {k: {f: b["by_kind"].get(k, {}).get(f, 0.0) - a["by_kind"].get(k, {}).get(f, 0.0)
                   for f in ("seconds", "bytes", "flops")}
               for k in sorted(set(a["by_kind"]) | set(b["by_kind"]))}
    return dict(rows=rows, seq=SEQ, micro_per_mini=list(micro), predicted_s=seconds,
                flops_executed=b["flops_executed"] - a["flops_executed"], flops_needed=needed,
                executed_over_needed=(b["flops_executed"] - a["flops_executed"]) / needed,
                mfu_ceiling=needed / (seconds * targets[target]["flops"]),
                bytes=b["bytes"] - a["bytes"], by_kind=by_kind,
                compile_s=[a["compile_s"], b["compile_s"]], target=target)


def main(argv=None) -> int:
    from brorl_jax.models.transformer import REMAT_POLICIES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100", choices=("h100", "h200"))
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--attention", default=None, help="override model.attention_impl")
    ap.add_argument("--remat", default=None, choices=REMAT_POLICIES,
                    help="override the memory plan's remat policy")
    ap.add_argument("--json", default="")
    ap.add_argument("--hlo", default="", help="save the optimized HLO here")
    ap.add_argument("--steady", action="store_true",
                    help="also the cost per 8 x 2048 rows with the optimizer amortised "
                         "(steady_state_report: two more compiles)")
    ap.add_argument("--lora_table", action="store_true",
                    help="instead: the update with LoRA (--lora_rank, --lora_alpha, all seven "
                         "projections) and with full fine-tuning compiled for --targets x "
                         "--models, a markdown table (lora_table)")
    ap.add_argument("--targets", nargs="+", default=["h100", "v5e"],
                    choices=("h100", "h200", "v5e"))
    ap.add_argument("--models", nargs="+", default=None,
                    help="default: pallas_kernels.targets.MODEL_SHAPES")
    ap.add_argument("--lora_rank", type=int, default=32)
    ap.add_argument("--lora_alpha", type=float, default=32.0)
    ap.add_argument("--layers", type=int, default=None,
                    help="with --lora_table: layers of each model (default its own count)")
    ap.add_argument("--arms", nargs="+", default=["full", "lora"], choices=("full", "lora"),
                    help="with --lora_table: which of the two to compile")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="with --lora_table: seconds per compile")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _, _, missing_extra, _ = _targets()
    for target in args.targets if args.lora_table else [args.target]:
        why = missing_extra(target)
        if why:
            print(why, file=sys.stderr)
            return 2
    if args.one:
        target, model, attention, remat, out, micro_per_mini, *lora = json.loads(args.one)
        built = compile_update(target, model, attention, remat, micro_per_mini, *lora)
        with open(out, "w") as f:
            json.dump(built, f)
        return 0
    if args.lora_table:
        from pallas_kernels.targets import MODEL_SHAPES
        lora_table(args.targets, args.models or list(MODEL_SHAPES), lora_rank=args.lora_rank,
                   lora_alpha=args.lora_alpha, layers=args.layers, timeout=args.timeout,
                   arms=args.arms)
        return 0
    r = update_report(args.target, args.model, attention=args.attention, remat=args.remat,
                      hlo_out=args.hlo or None)
    print(f"update {r['rows']} x {r['seq']} packed on {args.target} (attention {r['attention_impl']}, "
          f"remat {r['remat_policy']}, {r['ppo_mini_batches']} mini-batches of "
          f"{r['micro_rows']}-row micro-batches, pi_old recomputed: "
          f"{r['recompute_old_logprobs']}): compiled in {r['compile_s']} s")
    print(f"flops executed {r['flops_executed'] / 1e12:.1f} T / needed {r['flops_needed'] / 1e12:.1f} T"
          f" = {r['executed_over_needed']:.2f}; predicted {r['predicted_step_s'] * 1e3:.0f} ms; "
          f"MFU ceiling {r['mfu_ceiling']:.3f}; bytes {r['bytes'] / 1e12:.2f} TB "
          f"(split-K partials apart: {r['split_k_bytes'] / 1e12:.2f} TB)")
    for k, v in r["by_kind"].items():
        print(f"  {k:10s} {v['seconds'] * 1e3:8.1f} ms  {v['flops'] / 1e12:8.1f} TFLOP  "
              f"{v['bytes'] / 1e9:9.1f} GB  {v['launches']:.0f} launches")
    print("  largest kernels: " + "; ".join(f"{k['bytes'] / 1e9:.1f} GB {k['type']}"
                                          for k in r["largest_kernels"][:5]))
    if r["undeclared_custom_calls"]:
        print(f"  undeclared custom calls: {r['undeclared_custom_calls']}")
    if args.steady:
        st = steady_state_report(args.target, args.model)
        r["steady_state"] = st
        print(f"steady state (optimizer amortised; the difference of {st['micro_per_mini'][0]} "
              f"and {st['micro_per_mini'][1]} micro-batches per mini-batch): "
              f"{st['rows']} x {st['seq']} in {st['predicted_s'] * 1e3:.0f} ms, flops executed / "
              f"needed {st['executed_over_needed']:.2f}, MFU ceiling {st['mfu_ceiling']:.3f}")
        for k, v in st["by_kind"].items():
            print(f"  {k:10s} {v['seconds'] * 1e3:8.1f} ms  {v['flops'] / 1e12:8.1f} TFLOP  "
                  f"{v['bytes'] / 1e9:9.1f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

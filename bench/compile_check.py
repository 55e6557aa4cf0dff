"""Full deviceless compile of the Pallas kernels for an H100 and a TPU v5e target (issue 19).

No GPU or TPU is needed: XLA compiles for a *topology description* of the card (GPU: a
GpuTargetConfig of an H100, Triton -> PTX -> cubin; TPU: libtpu's v5e:2x2 topology, Mosaic ->
TPU code). That catches what lowering alone does not: shared-memory and VMEM overflow, Triton
and Mosaic compiler failures, compile times. It does not catch numerics, races or speed (those
need bench/device_check.sh on a real GPU).

Needs the optional extra (about 3.5 GB, no CUDA runtime): ``pip install -e '.[compile]'``
(jax-cuda12-plugin + jax-cuda12-pjrt + libtpu of the installed jax version). Keep it out of the
project venv if you like: jax then tries (and fails) to start the CUDA/TPU backends at import;
this script sets JAX_PLATFORMS=cpu so the plugins register without starting a device.

    python bench/compile_check.py                                   # everything (~10-20 min)
    python bench/compile_check.py --targets h100 --kernels sample_tokens --models qwen2.5-1.5b
    python bench/compile_check.py --list                            # the cases, nothing compiled

Each case runs in its own subprocess (a compiler crash or a --timeout stops only that case).
Prints a markdown table and writes it to --out: per target, kernel, model shape and dtype:
"compiled" or the compiler's reason, the kernel's shared memory (GPU, from XLA's thunk
sequence) or scoped VMEM (TPU, from the compiled custom call), lowering and compile seconds.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # this checkout's pallas_kernels, not an installed copy

TARGETS = {
    "h100": dict(platform="cuda", desc="NVIDIA H100 80GB HBM3 (sm_90, 227 KiB smem/block)"),
    "v5e": dict(platform="tpu", desc="TPU v5 lite (v5e:2x2 topology, one chip used)"),
}
KERNELS = ("sample_tokens", "sample_tokens_greedy", "sample_tokens_top_k_top_p",
           "sample_tokens_triton", "fused_logprob_fwd", "fused_logprob_fwd_bwd",
           "decode_attention", "decode_attention_slots", "decode_attention_slots_fp8",
           "rollout_decode", "rollout_decode_fp8", "swiglu_mlp_fwd_bwd")
JAX_TRITON = ("sample_tokens_triton",)   # the jax_triton kernel
# GPU kernels only: jax_triton's; the fused SwiGLU MLP (TPU runs XLA's own MLP fusions)
GPU_ONLY = JAX_TRITON + ("swiglu_mlp_fwd_bwd",)
# The H100 GpuTargetConfig (text proto) XLA compiles against (the values of a real H100 80GB HBM3's device description).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
           "TPU_WORKER_HOSTNAMES": "localhost"}
# Pallas kernel names (pallas_call name=...) whose resources are reported.
_KERNEL_NAMES = ("sample_tokens", "fused_logprob", "slot_decode_attention", "swiglu_", "fp8_")


def _short(msg: str, limit: int = 220) -> str:
    """The compiler's reason on one table line: the most telling line of the message."""
    lines = [l.strip() for l in str(msg).splitlines() if l.strip()]
    keys = ("exceeds", "limit", "Maximum", "requires", "power of 2", "Unsupported", "not supported",
            "cannot", "Error", "error", "failed", "must")
    pick = next((l for l in lines if any(k in l for k in keys)), lines[0] if lines else "")
    pick = re.sub(r"\s+", " ", pick).replace("|", "/")
    return pick[:limit] + ("..." if len(pick) > limit else "")


# ------------------------------------------------------------------------------------------------
# one case (runs in the subprocess)
# ------------------------------------------------------------------------------------------------

def _build(kernel: str, model: str, dtype: str, sharding):
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from pallas_kernels import targets as tg

    m = tg.MODEL_SHAPES[model]
    dt = jnp.dtype(dtype)
    sds = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
    if kernel.startswith("sample_tokens"):
        variant = {"sample_tokens": "plain", "sample_tokens_greedy": "greedy",
                   "sample_tokens_top_k_top_p": "top_k_top_p",
                   "sample_tokens_triton": "plain"}[kernel]
        kw = tg.SAMPLING_VARIANTS[variant]
        impl = "triton" if kernel == "sample_tokens_triton" else "pallas"
        args = (sds((tg.SAMPLING_ROWS, m.vocab)), sds((tg.SAMPLING_ROWS,), jnp.float32))
        fn = lambda x, u: pk.sample_tokens(x, u, impl=impl, **kw)
        shape = f"logits[{tg.SAMPLING_ROWS},{m.vocab}]"
    elif kernel.startswith("fused_logprob"):
        t = tg.LOGPROB_TOKENS
        args = (sds((t, m.hidden)), sds((m.hidden, m.vocab)), sds((t,), jnp.int32))
        if kernel == "fused_logprob_fwd":
            fn = lambda h, w, y: pk.fused_logprob(h, w, y, impl="pallas")
        else:
            def fn(h, w, y):
                def loss(h, w):
                    lp, ent = pk.fused_logprob(h, w, y, impl="pallas")
                    return jnp.sum(lp) + 0.01 * jnp.sum(ent)
                return jax.grad(loss, argnums=(0, 1))(h, w)
        shape = f"h[{t},{m.hidden}] W[{m.hidden},{m.vocab}]"
    elif kernel == "swiglu_mlp_fwd_bwd":
        from pallas_kernels.swiglu_mlp import swiglu_mlp
        t = tg.LOGPROB_TOKENS
        args = (sds((t, m.hidden)), sds((m.hidden, m.intermediate)),
                sds((m.hidden, m.intermediate)), sds((m.intermediate, m.hidden)))
        fn = lambda *a: jax.grad(lambda *z: jnp.sum(swiglu_mlp(*z, impl="pallas").astype(
            jnp.float32)), argnums=(0, 1, 2, 3))(*a)
        shape = f"x[{t},{m.hidden}] W[{m.hidden},{m.intermediate}]"
    elif kernel == "decode_attention":
        c = tg.DECODE_ATTENTION
        b, n, p, s = c["batch"], c["samples"], c["prefix"], c["suffix"]
        args = (sds((b, n, m.heads, m.head_dim)), sds((b, p, m.kv_heads, m.head_dim)),
                sds((b, p, m.kv_heads, m.head_dim)), sds((b,), jnp.int32),
                sds((b, n, s, m.kv_heads, m.head_dim)), sds((b, n, s, m.kv_heads, m.head_dim)),
                sds((b, n), jnp.int32))
        fn = lambda *a: pk.shared_prefix_decode_attention(*a, impl="pallas")
        shape = f"B{b} N{n} H{m.heads}/{m.kv_heads} P{p} S{s}"
    elif kernel in ("decode_attention_slots", "decode_attention_slots_fp8"):
        from pallas_kernels.decode_attention import (
            FP8_KV_DTYPE,
            KVScales,
            default_page_size,
            slot_decode_attention,
        )
        c = tg.SLOT_DECODE_ATTENTION
        b, k, p, s, nl = c["slots"], c["pool"], c["prompt"], c["own"], c["layers"]
        page = default_page_size()      # under compile_target: the target's page size
        n_pages = int(b * s // page * c["page_fraction"])
        fp8 = kernel.endswith("_fp8")   # e4m3 KV with its scale rows; q in ``dtype``
        kv_dt = FP8_KV_DTYPE if fp8 else dt
        pool = sds((nl, k, m.kv_heads, p, m.head_dim), kv_dt)
        pages = sds((nl, n_pages, m.kv_heads, page, m.head_dim), kv_dt)
        i32 = lambda *shape: sds(shape, jnp.int32)
        f32 = lambda x: sds(x.shape[:-1], jnp.float32)
        args = (sds((b, m.heads, m.head_dim)), pool, pool, i32(k), i32(b), pages, pages,
                i32(b, s // page), i32(b), i32()) + (
            (KVScales(f32(pool), f32(pool), f32(pages), f32(pages)),) if fp8 else ())
        fn = lambda q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer, *sc: slot_decode_attention(
            q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer=layer, impl="pallas",
            kv_scales=sc[0] if sc else None)
        shape = (f"slots {b} H{m.heads}/{m.kv_heads} pool {k}x{p} own {s} in "
                 f"{n_pages} pages of {page}" + (" (e4m3 KV)" if fp8 else ""))
    elif kernel in ("rollout_decode", "rollout_decode_fp8"):
        # the rollout's whole decode program (brorl_jax.rollout.Engine: refill, pages, layers
        # with the slot attention kernels, the sampling kernel) for a 2-layer model of these
        # widths at the shapes of tg.SLOT_DECODE_ATTENTION; _fp8: its weights and KV in fp8
        # (issue 41: e4m3 projections, int8 on TPU; e4m3 KV with its scales)
        from _measure import shape_config

        from brorl_jax.models import init_params
        from brorl_jax.models.precision import with_precision
        from brorl_jax.rollout import Engine
        c = tg.SLOT_DECODE_ATTENTION
        cfg = shape_config(model, layers=c["layers"], dtype=dtype,
                           max_position_embeddings=2 * c["own"])
        fp8 = kernel.endswith("_fp8")
        if fp8:
            cfg = with_precision(cfg, "fp8", "fp8")
        engine = Engine(cfg, impl="pallas", kv_fraction=c["page_fraction"])
        fn, args = engine.decode_program(
            jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))),
            prompt_len=c["prompt"], rollouts_per_prompt=512, max_new_tokens=c["own"],
            num_prompts=c["pool"], slots=c["slots"], sharding=sharding)
        shape = (f"{c['layers']} layers, {c['slots']} slots, pool {c['pool']}x{c['prompt']}, "
                 f"S {c['own']}" + (" (fp8 weights + KV)" if fp8 else ""))
    else:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
    return fn, args, shape


def _gpu_mma(dump_dir: str) -> dict[str, str]:
    """The tensor-core instructions of each Pallas kernel's PTX (e.g. "wgmma e4m3": Hopper's
    FP8 MMA; "mma.sync f16": Ampere-style f16 MMA), from XLA's dumped .ptx files."""
    found = {}
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        text = open(path).read()
        kinds = sorted({f"{op} {ty}" for op, ty in re.findall(
            r"\b(wgmma|mma)\.(?:mma_async\.)?sync\.aligned\.[\w.]*?\.f32\.(\w+?)\.", text)})
        for name in re.findall(r"\.entry\s+(\w+)\(", text):
            if kinds:
                found[name] = "/".join(kinds)
    return found


def _gpu_smem(dump_dir: str) -> str:
    """Shared memory per Pallas kernel from XLA's dumped thunk sequence (and, in brackets, its
    tensor-core instructions, _gpu_mma)."""
    found = {}
    for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
        for line in open(path):
            mt = re.search(r"kCustomKernel.*\]\s+(\S+) grid: .*shared_memory: (\d+) bytes", line)
            if mt and any(k in mt.group(1) for k in _KERNEL_NAMES):
                found[mt.group(1)] = max(found.get(mt.group(1), 0), int(mt.group(2)))
    mma = _gpu_mma(dump_dir)
    return ", ".join(f"{k}: {v / 1024:.0f} KiB" + (f" ({mma[k]})" if k in mma else "")
                     for k, v in sorted(found.items())) or "-"


def _jax_triton_smem(dump_dir: str) -> str:
    """Shared memory of the kernels jax_triton compiled (its dump's compile_info files)."""
    found = {}
    for path in glob.glob(os.path.join(dump_dir, "*", "*.compile_info")):
        mt = re.search(r"(\S+): shared_mem_bytes: (\d+)", open(path).read())
        if mt:
            found[mt.group(1)] = max(found.get(mt.group(1), 0), int(mt.group(2)))
    return ", ".join(f"{k}: {v / 1024:.0f} KiB" for k, v in sorted(found.items())) or "-"


def _tpu_vmem(compiled_text: str) -> str:
    """Scoped VMEM each Mosaic kernel uses (used_scoped_memory_configs of its custom call)."""
    found = {}
    for line in compiled_text.splitlines():
        if "tpu_custom_call" not in line:
            continue
        name = re.match(r'\s*(?:ROOT )?%([A-Za-z_]+?)(?:\.\d+)* = ', line)
        used = re.search(r'used_scoped_memory_configs":\[\{[^\]]*"size":"(\d+)"', line)
        if name and used:
            k = name.group(1)
            k = next((k[k.find(n):] for n in _KERNEL_NAMES if n in k), k).rstrip("_")
            found[k] = max(found.get(k, 0), int(used.group(1)))
    return ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(found.items())) or "-"


def run_one(target: str, kernel: str, model: str, dtype: str) -> dict:
    platform = TARGETS[target]["platform"]
    dump_dir = tempfile.mkdtemp(prefix="compile_check_")
    if platform == "cuda":   # XLA writes the thunk sequence (kernel shared memory) here
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={dump_dir}").strip()
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pallas_kernels as pk

    out = dict(target=target, kernel=kernel, model=model, dtype=dtype, shape="", status="",
               memory="-", lower_s=None, compile_s=None)
    try:
        if platform == "cuda":
            topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG,
                                                topology="1x1x1")
        else:
            topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
        mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
        with pk.compile_target(platform):      # shapes that follow the target (page size)
            fn, args, out["shape"] = _build(kernel, model, dtype, NamedSharding(mesh, P()))
        if kernel in JAX_TRITON:   # jax_triton writes PTX and compile_info (shared memory) here
            from jax_triton import triton_lib
            triton_lib._JAX_TRITON_DUMP_DIR = dump_dir
        t0 = time.perf_counter()
        with pk.compile_target(platform), jax.set_mesh(mesh):
            jitted = fn if hasattr(fn, "trace") else jax.jit(fn)   # keep a program's donation
            lowered = jitted.trace(*args).lower()
            out["lower_s"] = round(time.perf_counter() - t0, 2)
            text = lowered.as_text()
            call = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
            if kernel in JAX_TRITON:   # jax_triton compiles to cubin while lowering
                call = "triton_kernel_call"
            if call not in text:
                raise RuntimeError(f"lowered module holds no {call}: the kernel did not lower")
            t1 = time.perf_counter()
            compiled = lowered.compile()
            out["compile_s"] = round(time.perf_counter() - t1, 2)
        out["status"] = "compiled"
        if kernel in JAX_TRITON:
            out["memory"] = _jax_triton_smem(dump_dir)
        else:
            out["memory"] = (_gpu_smem(dump_dir) if platform == "cuda"
                             else _tpu_vmem(compiled.as_text()))
    except Exception as e:  # noqa: BLE001 - the reason is the result
        out["status"] = "FAILED: " + _short(f"{type(e).__name__}: {e}")
        if out["lower_s"] is not None and out["compile_s"] is None:
            out["compile_s"] = round(time.perf_counter() - t1, 2) if "t1" in locals() else None
    finally:
        subprocess.run(["rm", "-rf", dump_dir], check=False)
    return out


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def _cases(args):
    for target in args.targets:
        for kernel in args.kernels:
            if kernel in GPU_ONLY and TARGETS[target]["platform"] != "cuda":
                continue
            for model in args.models:
                for dtype in args.dtypes:
                    yield target, kernel, model, dtype


def _row(r: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.1f}"
    return (f"| {r['target']} | {r['kernel']} | {r['model']} | {r['dtype']} | {r['shape']} | "
            f"{r['status']} | {r['memory']} | {f(r['lower_s'])} | {f(r['compile_s'])} |")


HEADER = ("| target | kernel | model | dtype | shape | status | smem (GPU) / VMEM (TPU) | "
          "lower s | compile s |\n|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    from pallas_kernels import targets as tg
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--models", "--shapes", nargs="+", default=list(tg.MODEL_SHAPES),
                    choices=list(tg.MODEL_SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=list(tg.DTYPES), choices=list(tg.DTYPES))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "compile_check.md"))
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: run one case, print JSON
    args = ap.parse_args(argv)

    if args.one:
        print("RESULT " + json.dumps(run_one(*json.loads(args.one))), flush=True)
        return 0
    cases = list(_cases(args))
    if args.list:
        for c in cases:
            print(*c)
        return 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", **TPU_ENV)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rows = []
    print(HEADER, flush=True)
    for case in cases:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                                   json.dumps(case)], env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                r = dict(zip(("target", "kernel", "model", "dtype"), case), shape="", memory="-",
                         status="FAILED: " + _short(" ".join(tail) or f"exit {proc.returncode}"),
                         lower_s=None, compile_s=None)
            else:
                r = json.loads(line[len("RESULT "):])
        except subprocess.TimeoutExpired:
            r = dict(zip(("target", "kernel", "model", "dtype"), case), shape="", memory="-",
                     status=f"TIMEOUT after {args.timeout:.0f} s", lower_s=None,
                     compile_s=round(time.perf_counter() - t0, 1))
        rows.append(r)
        print(_row(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    import jax
    with open(args.out, "w") as f:
        f.write(f"# bench/compile_check.py (jax {jax.__version__})\n\n")
        f.write("Targets: " + "; ".join(f"{k}: {v['desc']}" for k, v in TARGETS.items()
                                        if k in args.targets) + "\n\n")
        f.write(HEADER + "\n" + "\n".join(_row(r) for r in rows) + "\n")
    n_ok = sum(r["status"] == "compiled" for r in rows)
    print(f"\n{n_ok}/{len(rows)} compiled; table written to {args.out}")
    return 0 if n_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

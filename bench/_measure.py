"""Helpers shared by the bench scripts: run one variant in a fresh subprocess and read its peak
memory (host RSS on CPU, device peak_bytes_in_use on GPU/TPU)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def device_peak_bytes():
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run_child(script: str, args: list[str], timeout: float) -> dict:
    """Run `python script --child args...`; the child prints one JSON line starting with RESULT."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        out = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {out.returncode}: {' | '.join(tail)}"}


def write_result(path: str, script: str, fields: dict) -> None:
    """A bench's JSON at ``path``: the command that made it (``script`` and this process's
    arguments), the machine (CPU, cores, jax and its backend), then ``fields``."""
    import platform

    import jax
    out = {"command": f"python bench/{script} " + " ".join(sys.argv[1:]),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                      f"jax {jax.__version__} on {jax.default_backend()}", **fields}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


def shape_config(name: str, *, layers: int | None = None, dtype: str = "bfloat16",
                 max_position_embeddings: int = 32768):
    """The ModelConfig of pallas_kernels.targets.MODEL_SHAPES[name] (its own layer count unless
    `layers`), in `dtype`; RoPE and norm settings of the Qwen/Llama families."""
    from brorl_jax.models import ModelConfig
    from pallas_kernels.targets import MODEL_SHAPES
    m = MODEL_SHAPES[name]
    return ModelConfig(
        model_type=m.model_type, vocab_size=m.vocab, hidden_size=m.hidden,
        intermediate_size=m.intermediate, num_hidden_layers=layers or m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
        rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6,
        attention_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3",
        tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=max_position_embeddings, bos_token_id=None, eos_token_ids=(2,),
        param_dtype=dtype, dtype=dtype)


"""The paper-scale plan: a 1.5B Qwen2-shaped model, N=1024, 16k context, on 64 GPUs (8 nodes x 8).

BroRL ran Qwen2-1.5B (DeepSeek-R1-Distill-Qwen-1.5B lineage) at N=512 on 64 H100s; this plan
doubles N to 1024 at the same 65,536 samples per step (64 prompts x 1024 after dynamic-sampling
filtering), with a 16k context (1024 prompt + 15360 new tokens).

Mesh (justified in docs/scale.md): data=8 x fsdp=8 x tensor=1.
  * fsdp=8 inside a node (NVLink): parameters, reference parameters and Adam moments are split
    8 ways; XLA all-gathers one layer's weights at a time (the layers are a lax.scan).
  * data=8 across nodes (InfiniBand): only the gradient reduction crosses nodes.
  * tensor=1: a 1536-wide model with 2 KV heads gains nothing from tensor parallelism (the KV
    heads cannot be split more than 2 ways; per-layer activation all-reduces would cost more
    than the 1.5B-parameter all-gathers FSDP needs).
  * The update processes one 16k-token sequence per device per micro-batch: micro_batch_size =
    64 (global) = 1 row x 64 devices.
  * The rollout (continuous batching, docs/rollout.md) runs on all 64 devices under shard_map
    with the parameters replicated: each device decodes its 16 of every prompt's 1024 samples
    in its own decode slots, refilled as samples stop; each prompt is prefilled once per device
    into that device's prompt pool and its KV shared by all the device's slots.

python -m brorl_jax.main --config=configs/brorl_64gpu.py --config.model.path=... (see
launch/slurm_gpu.sbatch). bench/plan_memory.py compiles the steps of this plan for a 64-device
mesh on CPU and prints the compiler's per-device memory next to the hand calculation.
"""
from brorl_jax.models import ModelConfig
from configs import brorl
from configs.common import parse_arg

MESH = {"data": 8, "fsdp": 8, "tensor": 1}
NUM_DEVICES = 64
# Rollout working memory per device (decode slots, their KV pages, the prompt pool; docs/scale.md);
# the engine's budget counts all devices together.
ROLLOUT_GIB_PER_DEVICE = 28.0


def qwen2_1p5b(dtype: str = "bfloat16", param_dtype: str = "float32") -> ModelConfig:
    """Qwen2-1.5B's architecture (HF config.json of Qwen/Qwen2-1.5B): 1.54B parameters with the
    tied 151936 x 1536 embedding. Float32 master params: bf16 cannot hold an update of lr ~3e-6
    relative to a weight (bf16 resolves ~4e-3 relative), see docs/scale.md."""
    return ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        rope_theta=1_000_000.0, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=True,
        qk_norm=False, tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=None, eos_token_ids=(151643,), param_dtype=param_dtype, dtype=dtype)


def qwen3_30b_a3b(dtype: str = "bfloat16", param_dtype: str = "float32") -> ModelConfig:
    """Qwen3-30B-A3B's architecture (HF config.json of Qwen/Qwen3-30B-A3B): 48 layers, hidden
    2048, 32 query / 4 KV heads of 128, 128 experts of width 768, top-8 (normalised), vocab
    151936, untied; 30,532,122,624 parameters (3.35 B active per token). bench/plan_memory.py
    --model=qwen3_30b_a3b plans it on this file's run shape (docs/scale.md section 5)."""
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rope_theta=1_000_000.0, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=False,
        qk_norm=True, tie_word_embeddings=False, max_position_embeddings=40960,
        bos_token_id=None, eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, param_dtype=param_dtype, dtype=dtype)


def get_config(arg: str | None = None):
    opts = parse_arg(arg, {"n": int, "prompts": int})
    n = opts.get("n", 1024)
    c = brorl.get_config(f"n={n},prompts={opts.get('prompts', 65536 // n)}")
    c.name = "brorl_64gpu"
    c.model.dtype = "bfloat16"            # compute
    c.model.param_dtype = "float32"       # master weights, Adam moments and gradients in f32
    c.model.remat = True
    c.data.max_prompt_len = 1024
    c.rollout.max_new_tokens = 16384 - 1024
    # Sizes the rollout's decode slots: for a generation round of 96 prompts (64 x 1.5) x 1024
    # samples, rollout.plan_slots (page size 16 on GPU) gives 261 slots per device (16,704 in
    # flight of the round's 98,304 samples), KV pages for a quarter of their full length
    # (plan.KV_FRACTION) and a pool of 19 prompts per device; finished slots take the next
    # pending sample, and the tail is compacted to smaller slot buckets.
    c.rollout.memory_budget_gb = ROLLOUT_GIB_PER_DEVICE * NUM_DEVICES
    c.algo.ppo_mini_batches = 4
    c.algo.micro_batch_size = NUM_DEVICES   # one 16k-token sequence per device per micro-batch
    c.mesh.data = MESH["data"]
    c.mesh.fsdp = MESH["fsdp"]
    c.mesh.tensor = MESH["tensor"]
    c.mesh.rules = "default"
    return c

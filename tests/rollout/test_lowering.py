"""The rollout's decode program (the whole while_loop: refill, layers, slot attention, sampling,
recording) traces from ShapeDtypeStructs and lowers for GPU and TPU on this CPU machine, for a
2-layer model of each family's real widths, with the Pallas attention kernels in it."""
from __future__ import annotations

import contextlib

import jax
import pytest

import pallas_kernels
from brorl_jax.models import ModelConfig, init_params
from brorl_jax.rollout import Engine

# (model_type, hidden, heads, kv heads, head dim, vocab, intermediate, tied embeddings)
FAMILIES = {
    "qwen2.5-1.5b": ("qwen2", 1536, 12, 2, 128, 151_936, 8960, True),
    "qwen2.5-7b": ("qwen2", 3584, 28, 4, 128, 152_064, 18944, False),
    "qwen3-8b": ("qwen3", 4096, 32, 8, 128, 151_936, 12288, False),
    "llama-3.1-8b": ("llama", 4096, 32, 8, 128, 128_256, 14336, False),
}
_CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _config(name: str) -> ModelConfig:
    mt, hidden, heads, kv, dh, vocab, inter, tied = FAMILIES[name]
    return ModelConfig(model_type=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=dh, rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6,
                       attention_bias=mt == "qwen2", qk_norm=mt == "qwen3",
                       tie_word_embeddings=tied, max_position_embeddings=32768,
                       bos_token_id=None, eos_token_ids=(2,), param_dtype="bfloat16",
                       dtype="bfloat16")


def _tpu_mesh():
    from jax._src.mesh import AbstractDevice  # no public constructor in jax 0.10
    dev = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("devices",), abstract_device=dev)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decode_program_lowers_for_gpu_and_tpu(platform, family):
    cfg = _config(family)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    # The attention is this engine's Pallas kernels. On GPU the sampling kernel stays the jnp
    # reference here: at these vocabularies it does not compile on main yet (issue 19).
    impl = ({"attention": "pallas", "sampling": "reference"} if platform == "cuda"
            else "pallas")
    mesh = _tpu_mesh() if platform == "tpu" else None
    with pallas_kernels.compile_target(platform), (
            jax.sharding.use_abstract_mesh(mesh) if mesh else contextlib.nullcontext()):
        engine = Engine(cfg, mesh=mesh, impl=impl)
        lowered = engine.lower_decode(params, prompt_len=1024, rollouts_per_prompt=512,
                                      max_new_tokens=16384, num_prompts=4, slots=64,
                                      platform=platform)
    text = lowered.as_text()
    assert "slot_decode_attention_prefix" in text and "slot_decode_attention_own" in text
    assert text.count(_CUSTOM_CALL[platform]) >= 2


def test_decode_program_lowers_on_a_tpu_mesh_under_shard_map():
    """8 TPU devices: the Mosaic kernels run inside the engine's shard_map (GSPMD cannot
    partition them), each device with its share of the samples."""
    cfg = _config("qwen2.5-1.5b")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    from jax._src.mesh import AbstractDevice
    dev = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "fsdp"), abstract_device=dev)
    with pallas_kernels.compile_target("tpu"), jax.sharding.use_abstract_mesh(mesh):
        engine = Engine(cfg, mesh=mesh, impl="pallas")
        text = engine.lower_decode(params, prompt_len=1024, rollouts_per_prompt=512,
                                   max_new_tokens=16384, num_prompts=4, slots=64,
                                   platform="tpu").as_text()
    assert engine.num_devices == 8 and text.count("tpu_custom_call") >= 2
    assert "shard_map" in text or "sdy.manual_computation" in text or "manual" in text

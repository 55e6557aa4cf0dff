"""The rollout's decode program (the whole while_loop: refill, pages, layers, slot attention,
sampling, recording) traces from ShapeDtypeStructs and lowers for GPU and TPU on this CPU machine,
for a 2-layer model of each family's real widths (pallas_kernels/targets.py), with the Pallas
attention and sampling kernels in it; on an 8-device TPU mesh under shard_map too."""
from __future__ import annotations

import contextlib

import jax
import pytest

import pallas_kernels as pk
from brorl_jax.models import ModelConfig, init_params
from brorl_jax.rollout import Engine
from pallas_kernels import targets as tg

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

_CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# a pool of 4 prompts of 1024 positions, BroRL's N and 16k context, 64 slots per device
_CALL = dict(prompt_len=1024, rollouts_per_prompt=512, max_new_tokens=16384, num_prompts=4,
             slots=64)


def _config(name: str) -> ModelConfig:
    m = tg.MODEL_SHAPES[name]
    return ModelConfig(model_type=m.model_type, vocab_size=m.vocab, hidden_size=m.hidden,
                       intermediate_size=m.intermediate, num_hidden_layers=2,
                       num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                       head_dim=m.head_dim, rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6,
                       attention_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3",
                       tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=32768,
                       bos_token_id=None, eos_token_ids=(2,), param_dtype="bfloat16",
                       dtype="bfloat16")


def _lower(cfg, platform, mesh):
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    with pk.compile_target(platform), (jax.sharding.use_abstract_mesh(mesh) if mesh is not None
                                       else contextlib.nullcontext()):
        engine = Engine(cfg, mesh=mesh, impl="pallas")
        return engine, engine.lower_decode(params, platform=platform, **_CALL).as_text()


@pytest.mark.parametrize("family", list(tg.MODEL_SHAPES))
@pytest.mark.parametrize("platform", list(_CUSTOM_CALL))
def test_decode_program_lowers_for_gpu_and_tpu(platform, family):
    mesh = pk.tpu_abstract_mesh() if platform == "tpu" else None
    _, text = _lower(_config(family), platform, mesh)
    assert "slot_decode_attention_prefix" in text and "slot_decode_attention_own" in text
    assert "sample_tokens" in text
    # attention (2 kernels, once in the layer scan) and sampling (decode step)
    assert text.count(_CUSTOM_CALL[platform]) >= 3


def test_decode_program_lowers_on_a_tpu_mesh_under_shard_map():
    """8 TPU devices: the Mosaic kernels run inside the engine's shard_map (GSPMD cannot
    partition them), each device with its share of the samples."""
    mesh = pk.tpu_abstract_mesh((4, 2), ("data", "fsdp"))
    engine, text = _lower(_config("qwen2.5-1.5b"), "tpu", mesh)
    assert engine.num_devices == 8 and text.count("tpu_custom_call") >= 3
    assert "sdy.manual_computation" in text or "shard_map" in text

"""A tiny packed update step (pi_old pass, remat "dots", two mini-batches, the model's default
attention_impl) lowered for a GPU/TPU target from abstract shapes, for the tests that look for
the attention kernels and for the absence of a [T, T] array in it (tests/kernels and
tests/parallel). T = 384 is no other dimension of the program."""
from __future__ import annotations

T = 384
# What a Pallas kernel lowers to, per platform: a Triton call on CUDA, a Mosaic call on TPU.
CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def packed_update_text(platform: str, *, rows: int, hidden: int, kv_heads: int,
                       rollouts_per_prompt: int, micro_batch_size: int, lora_rank: int = 0) -> str:
    """The lowered module text of the step, traced under whatever mesh and compile target the
    caller has entered; with lora_rank > 0 LoRA's step (all seven projections, alpha 32, the
    train state of algo.adapters.lora_train_state)."""
    import jax
    import jax.numpy as jnp
    import optax
    from testutil import tiny_model_config

    from brorl_jax.algo import UpdateBatch, create_train_state, make_update_step
    from brorl_jax.config import default_config, update_config
    from brorl_jax.models import init_params
    mc = tiny_model_config(vocab_size=640, hidden_size=hidden, intermediate_size=192,
                           num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=128,
                           tie_word_embeddings=True, max_position_embeddings=512,
                           dtype="bfloat16", attention_impl=default_config().model.attention_impl)
    cfg = update_config(rollouts_per_prompt=rollouts_per_prompt, prompts_per_step=2,
                        micro_batch_size=micro_batch_size, ppo_mini_batches=2, kl_coef=0.0)
    opt = optax.adam(1e-3)
    params = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda p: create_train_state(p, opt, with_reference=False), params)
    if lora_rank:
        from brorl_jax.algo.adapters import lora_train_state
        from brorl_jax.models import lora
        mc = mc.replace(lora_rank=lora_rank, lora_alpha=32.0, lora_targets=tuple(lora.TARGETS))
        state = jax.eval_shape(lambda p: lora_train_state(p, mc, opt, seed=0), params)
    i32 = lambda: jax.ShapeDtypeStruct((rows, T), jnp.int32)
    f32 = lambda: jax.ShapeDtypeStruct((rows, T), jnp.float32)
    batch = UpdateBatch(input_tokens=i32(), positions=i32(), targets=i32(), segment_ids=i32(),
                        loss_mask=jax.ShapeDtypeStruct((rows, T), jnp.bool_),
                        old_logprobs=f32(), ref_logprobs=f32(), advantages=f32())
    step = make_update_step(mc, cfg, opt, remat_policy="dots")
    return jax.jit(step).trace(state, batch, None).lower(
        lowering_platforms=(platform,)).as_text()


def kernel_names(platform: str) -> tuple[str, ...]:
    return ("mha_forward", "mha_backward") if platform == "cuda" else ("flash_attention",)


def attention_fwd_bwd_text(attend, platform: str, b: int, t: int, h: int, hkv: int,
                           dh: int) -> str:
    """The lowered text of attend(q, k, v, segment_ids)'s forward and q/k/v gradient at bf16
    [b, t, h/hkv, dh] shapes, traced under the caller's mesh and compile target."""
    import jax
    import jax.numpy as jnp
    sds = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)

    def fwd_bwd(q, k, v, seg):
        f = lambda q, k, v: jnp.sum(attend(q, k, v, seg).astype(jnp.float32))
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(fwd_bwd).trace(sds(b, t, h, dh), sds(b, t, hkv, dh), sds(b, t, hkv, dh),
                                  sds(b, t, dt=jnp.int32)).lower(
        lowering_platforms=(platform,)).as_text()

"""The kernels, and the update and log-prob steps around them, lower for real GPU and TPU
targets at the paper's model shapes, on this CPU machine (issue 19).

Inside pallas_kernels.compile_target(platform) the kernels trace their compiled form, so
`jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=(platform,))` runs the Triton
(cuda) or Mosaic (tpu) lowering rules; nothing is allocated. Each test asserts that the lowered
module holds the kernel's custom call, i.e. the real kernel and not its interpreted jnp form or
an XLA fallback. Full compiles (shared memory / VMEM) are bench/compile_check.py's job.
"""
from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import pytest
from lowering import CUSTOM_CALL

import pallas_kernels as pk
from pallas_kernels import targets as tg
from pallas_kernels.swiglu_mlp import KERNEL_NAMES

PLATFORMS = tuple(CUSTOM_CALL)
VOCABS = sorted({m.vocab for m in tg.MODEL_SHAPES.values()})
HIDDENS = sorted({m.hidden for m in tg.MODEL_SHAPES.values()})


@contextlib.contextmanager
def target(platform):
    """compile_target plus, for tpu, an abstract TPU device (Mosaic asks for the device kind)."""
    with pk.compile_target(platform), contextlib.ExitStack() as stack:
        if platform == "tpu":
            stack.enter_context(jax.sharding.use_abstract_mesh(pk.tpu_abstract_mesh()))
        yield


def lowered_text(platform, fn, *args) -> str:
    with target(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", tg.DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("variant", list(tg.SAMPLING_VARIANTS))
def test_sample_tokens_lowers(platform, dtype, vocab, variant):
    kw = tg.SAMPLING_VARIANTS[variant]
    text = lowered_text(platform, lambda x, u: pk.sample_tokens(x, u, impl="pallas", **kw),
                        sds((tg.SAMPLING_ROWS, vocab), dtype), sds((tg.SAMPLING_ROWS,), "float32"))
    assert text.count(CUSTOM_CALL[platform]) == 1


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", tg.DTYPES)
@pytest.mark.parametrize("model", list(tg.MODEL_SHAPES))
def test_fused_logprob_forward_and_backward_lower(platform, dtype, model):
    m = tg.MODEL_SHAPES[model]
    t = tg.LOGPROB_TOKENS

    def fwd_bwd(h, w, y):
        def loss(h, w):
            lp, ent = pk.fused_logprob(h, w, y, impl="pallas")
            return jnp.sum(lp) + jnp.sum(ent)
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    text = lowered_text(platform, fwd_bwd, sds((t, m.hidden), dtype), sds((m.hidden, m.vocab), dtype),
                        sds((t,), "int32"))
    # forward, backward for d hidden (+ dz on GPU, whose d lm_head is a GEMM), backward for d
    # lm_head (TPU)
    names = ("fused_logprob_fwd", "fused_logprob_bwd_hidden") + (
        ("fused_logprob_bwd_lm_head",) if platform == "tpu" else ())
    assert text.count(CUSTOM_CALL[platform]) == len(names)
    for name in names:
        assert name in text


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_fused_logprob_stats_lowers(platform, hidden):
    vocab = max(VOCABS)
    fn = lambda h, w, y: pk.fused_logprob_stats(h, w, y, impl="pallas")
    text = lowered_text(platform, fn, sds((1024, hidden), "bfloat16"),
                        sds((hidden, vocab), "bfloat16"), sds((1024,), "int32"))
    assert text.count(CUSTOM_CALL[platform]) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="outside a target, a GPU/TPU backend "
                    "compiles the kernel too: the interpreted form exists only on CPU")
def test_lowering_outside_the_target_is_interpreted_and_not_reused():
    """The same kernel traced outside compile_target (CPU: interpreted jnp) and inside it must not
    share a jit-cache entry: the module-level jitted sampler keys on the target."""
    x, u = sds((8, 1000), "float32"), sds((8,), "float32")
    fn = lambda x, u: pk.sample_tokens_pallas(x, u)
    cpu = jax.jit(fn).trace(x, u).lower(lowering_platforms=("cpu",)).as_text()
    gpu = lowered_text("cuda", fn, x, u)
    assert CUSTOM_CALL["cuda"] not in cpu and CUSTOM_CALL["cuda"] in gpu
    assert CUSTOM_CALL["cuda"] not in jax.jit(fn).trace(x, u).lower(
        lowering_platforms=("cpu",)).as_text()


def test_gpu_kernels_name_the_triton_lowering():
    """jax >= 0.10 sends a GPU pallas_call without compiler params to Mosaic GPU: every GPU kernel
    here passes Triton params, so no Mosaic GPU call appears."""
    fn = lambda h, w, y, x, u: (pk.fused_logprob(h, w, y, impl="pallas"),
                                pk.sample_tokens(x, u, impl="pallas"))
    text = lowered_text("cuda", fn, sds((64, 256), "bfloat16"), sds((256, 1000), "bfloat16"),
                        sds((64,), "int32"), sds((8, 1000), "float32"), sds((8,), "float32"))
    assert "mosaic_gpu" not in text and text.count(CUSTOM_CALL["cuda"]) == 2


def test_auto_picks_the_kernel_on_targets_and_falls_back_once_with_a_reason(caplog):
    """impl='auto' chooses the kernel for a compile target, and the XLA path (logged once per
    reason) where the kernel cannot compile: here, float64 logits."""
    from pallas_kernels.fused_logprob import resolve_impl as logprob_impl
    with target("cuda"):
        assert logprob_impl("auto") == "pallas"
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    x64 = jax.ShapeDtypeStruct((4, 300), jnp.float64)
    with target("tpu"):
        from pallas_kernels.sampling import resolve_impl
        assert resolve_impl("auto", x64) == "reference"
        assert resolve_impl("auto", x64) == "reference"
        with pytest.raises(ValueError, match="float64"):
            resolve_impl("pallas", x64)
    msgs = [r.getMessage() for r in caplog.records if "sample_tokens" in r.getMessage()]
    assert len(msgs) == 1 and "float64" in msgs[0]


def test_auto_under_a_mesh_outside_shard_map_falls_back(caplog):
    """GSPMD cannot partition a Mosaic call: under an auto-partitioned mesh 'auto' takes the
    chunked path (and says so), inside shard_map it keeps the kernel."""
    mesh = pk.tpu_abstract_mesh((2,), ("data",))
    h, w, y = sds((64, 256), "bfloat16"), sds((256, 1000), "bfloat16"), sds((64,), "int32")
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    with pk.compile_target("tpu"), jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(lambda h, w, y: pk.fused_logprob(h, w, y)).trace(h, w, y).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in text
    assert any("shard_map" in r.getMessage() for r in caplog.records)
    from jax.sharding import PartitionSpec as P
    sm = jax.shard_map(lambda h, w, y: pk.fused_logprob(h, w, y), mesh=mesh,
                       in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P("data")),
                       check_vma=False)
    with pk.compile_target("tpu"), jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(sm).trace(h, w, y).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


# ------------------------------------------------------------------------------------------------
# the update and log-prob steps of a 2-layer model of each family's real widths
# ------------------------------------------------------------------------------------------------

def _model_cfg(name: str):
    from brorl_jax.models import ModelConfig
    m = tg.MODEL_SHAPES[name]
    scaling = ((("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
               if m.model_type == "llama" else None)
    return ModelConfig(model_type=m.model_type, vocab_size=m.vocab, hidden_size=m.hidden,
                       intermediate_size=m.intermediate, num_hidden_layers=2,
                       num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                       head_dim=m.head_dim, rope_theta=1e6, rope_scaling=scaling,
                       rms_norm_eps=1e-6, attention_bias=m.model_type == "qwen2",
                       qk_norm=m.model_type == "qwen3", tie_word_embeddings=m.tie_word_embeddings,
                       max_position_embeddings=4096, bos_token_id=None, eos_token_ids=(0,),
                       param_dtype="bfloat16", dtype="bfloat16", attention_impl="xla")


def _abstract_batch(rows: int, seq: int):
    i, b, f = (lambda s: sds(s, "int32")), (lambda s: sds(s, "bool")), (lambda s: sds(s, "float32"))
    from brorl_jax.algo import UpdateBatch
    return UpdateBatch(input_tokens=i((rows, seq)), positions=i((rows, seq)),
                       loss_mask=b((rows, seq)), targets=i((rows, seq)),
                       old_logprobs=f((rows, seq)), ref_logprobs=f((rows, seq)),
                       advantages=f((rows,)))


@pytest.mark.slow
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("model", list(tg.MODEL_SHAPES))
def test_update_and_logprob_steps_lower(platform, model):
    from brorl_jax import algo
    from brorl_jax.algo.update import pi_old_in_gradient_pass
    from brorl_jax.config import optimizer_config, update_config
    from brorl_jax.models import init_params

    cfg = _model_cfg(model)
    acfg = update_config(micro_batch_size=2, kl_coef=0.0)
    opt = algo.make_optimizer(optimizer_config())
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda p: algo.create_train_state(p, opt, with_reference=False), params)
    batch = _abstract_batch(rows=4, seq=64)
    update = algo.make_update_step(cfg, acfg, opt)
    logprobs = algo.make_logprob_fn(cfg, acfg)
    call = CUSTOM_CALL[platform]
    mlp = lambda text: {n: text.count(f'name = "{n}"') for n in KERNEL_NAMES}
    text = lowered_text(platform, update, state, batch)
    # the log-prob's forward and backward kernels (d hidden; on TPU also d lm_head, on GPU an
    # XLA GEMM), plus the pi_old forward unless it is folded into the gradient pass
    per_pass = 3 if platform == "tpu" else 2
    pi_old = 0 if pi_old_in_gradient_pass(acfg) else 1
    # on GPU each layer's MLP is the fused SwiGLU kernels: a gate/up kernel per layer in each
    # forward (pi_old, the gradient pass, and the "full" policy's rerun in the backward: no
    # device memory is known here, so the plan takes "full"), one backward kernel per layer
    fwd_passes = 1 + pi_old + 1
    want = ({"swiglu_gate_up": 2 * fwd_passes, "swiglu_bwd": 2} if platform == "cuda"
            else {n: 0 for n in KERNEL_NAMES})
    assert mlp(text) == want
    assert text.count(call) - sum(mlp(text).values()) == per_pass + pi_old, text.count(call)
    text = lowered_text(platform, logprobs, params, batch)
    assert mlp(text) == ({"swiglu_gate_up": 2, "swiglu_bwd": 0} if platform == "cuda"
                         else {n: 0 for n in KERNEL_NAMES})
    assert text.count(call) - sum(mlp(text).values()) == 1


def test_lora_update_lowers_for_tpu_with_the_kernels_and_a_frozen_bf16_base():
    """LoRA's update step (rank 32 on all seven projections) lowers for TPU with the Mosaic
    attention and log-prob kernels, and its state is the base in bf16 with the adapters alone
    in float32: no stacked [L, D_in, D_out] float32 array (master copy, moment) enters. The
    full compiles at the four model shapes: bench/_roofline_update.py --lora_table."""
    import re

    from lowering import kernel_names, packed_update_text
    with target("tpu"):
        text = packed_update_text("tpu", rows=4, hidden=128, kv_heads=1, rollouts_per_prompt=2,
                                  micro_batch_size=1, lora_rank=32)
    for name in kernel_names("tpu") + ("fused_logprob_fwd", "fused_logprob_bwd_hidden"):
        assert name in text, name
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    f32 = set(re.findall(r"tensor<2x(\d+)x(\d+)xf32>", main))      # 2 layers
    assert f32 and all("32" in dims for dims in f32), f32                 # A [L, D_in, r], B [L, r, D_out]
    assert "tensor<2x128x256xbf16>" in main                               # q's kernel, frozen


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vocab_parallel_logprob_runs_the_kernel_inside_shard_map(platform):
    """Vocabulary split over `tensor`, tokens over `data` (a 2x2 abstract mesh): forward and
    backward kernels per shard, inside shard_map, none left for GSPMD to partition."""
    from brorl_jax.parallel.vocab_parallel import vocab_parallel_logprob
    m = tg.MODEL_SHAPES["qwen2.5-7b"]
    mesh = (pk.tpu_abstract_mesh((2, 2), ("data", "tensor")) if platform == "tpu"
            else jax.sharding.AbstractMesh((2, 2), ("data", "tensor")))

    def fwd_bwd(h, w, y):
        def loss(h, w):
            lp, ent = vocab_parallel_logprob(h, w, y, mesh=mesh, token_axes=("data",))
            return jnp.sum(lp) + jnp.sum(ent)
        return jax.grad(loss, argnums=(0, 1))(h, w)

    args = (sds((2048, m.hidden), "bfloat16"), sds((m.hidden, m.vocab), "bfloat16"),
            sds((2048,), "int32"))
    with pk.compile_target(platform), jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(CUSTOM_CALL[platform]) == (3 if platform == "tpu" else 2)
    assert "sdy.manual_computation" in text or "shard_map" in text

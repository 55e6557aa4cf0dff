"""The GPU ("triton") backward of fused_logprob recomputes the logits once: its d hidden kernel
writes dz and one GEMM per token chunk forms d lm_head. Several chunks (a chunk size below the
token count) give the reference gradients; lowered for cuda the backward holds one kernel (the
forward another) and a GEMM, no second logits kernel."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.fused_logprob.reference import fused_logprob_reference

fl = importlib.import_module("pallas_kernels.fused_logprob")   # the module (the package exports
#                                                                 the function under this name)
fl_triton = importlib.import_module("pallas_kernels.fused_logprob.triton")
T, D, V, TEMP = 45, 32, 300, 0.7


def _grads(fn, h, w, tg, gl, ge):
    def f(h, w):
        lp, en = fn(h, w)
        return jnp.sum(gl * lp) + jnp.sum(ge * en)
    return jax.grad(f, argnums=(0, 1))(h, w)


def test_chunked_dz_backward_matches_reference(monkeypatch):
    monkeypatch.setattr(fl_triton, "_DZ_CHUNK_TOKENS", 16)      # 45 tokens in tiles of 16: 3 chunks
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h = jax.random.normal(k[0], (T, D))
    w = jax.random.normal(k[1], (D, V)) * 0.5
    tg = jax.random.randint(k[2], (T,), 0, V)
    gl, ge = jax.random.normal(k[3], (T,)), jax.random.normal(k[4], (T,))
    got = _grads(lambda h, w: fl.fused_logprob(h, w, tg, temperature=TEMP, impl="pallas",
                                               block_t=16, block_v=128, family="triton"),
                 h, w, tg, gl, ge)
    want = _grads(lambda h, w: fused_logprob_reference(h, w, tg, temperature=TEMP), h, w, tg, gl, ge)
    for name, a, b in zip(("d_hidden", "d_lm_head"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5, err_msg=name)


def test_cuda_backward_has_one_logits_kernel():
    sds = jax.ShapeDtypeStruct

    def fwd_bwd(h, w, y):
        return jax.grad(lambda h, w: jnp.sum(fl.fused_logprob(h, w, y, impl="pallas")[0]),
                        argnums=(0, 1))(h, w)

    with pk.compile_target("cuda"):
        text = jax.jit(fwd_bwd).trace(sds((4096, 1536), jnp.bfloat16),
                                      sds((1536, 151_936), jnp.bfloat16),
                                      sds((4096,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "fused_logprob_bwd_hidden" in text and "fused_logprob_bwd_lm_head" not in text
    b, f = fl.fused_logprob_kernel_cost("fused_logprob_bwd_hidden",
                                        [("bf16", (4096, 1536)), ("bf16", (1536, 151_936))])
    assert f == 2 * 2 * 4096 * 1536 * 151_936 and b > 4096 * 151_936 * 2     # writes dz

"""Run by test_fused_logprob.py with 4 simulated CPU devices (XLA_FLAGS set by the test):
the vocabulary split over a mesh axis, each shard running the (interpreted) kernel, against the
unsharded reference: values and gradients. Prints one line per case; exits non-zero on a miss."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from brorl_jax.parallel.vocab_parallel import vocab_parallel_logprob
from pallas_kernels import fused_logprob_reference, fused_logprob_vocab_shard

mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
T, D, V, TEMP = 32, 32, 512, 0.7
k = jax.random.split(jax.random.PRNGKey(0), 5)
h = jax.random.normal(k[0], (T, D))
w = jax.random.normal(k[1], (D, V)) * 0.5
y = jax.random.randint(k[2], (T,), 0, V)
g1, g2 = jax.random.normal(k[3], (T,)), jax.random.normal(k[4], (T,))


def value_and_grads(logprob):
    def loss(h, w):
        lp, en = logprob(h, w)
        return jnp.sum(g1 * lp) + jnp.sum(g2 * en), (lp, en)
    (_, (lp, en)), (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
    return lp, en, dh, dw


ref = value_and_grads(lambda h, w: fused_logprob_reference(h, w, y, temperature=TEMP))


def per_shard(impl, **kw):
    body = lambda h, w, y: fused_logprob_vocab_shard(
        h, w, y, axis_name="tensor", vocab_start=lax.axis_index("tensor") * w.shape[1],
        temperature=TEMP, impl=impl, **kw)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", None), P(None, "tensor"), P("data")),
                      out_specs=(P("data"), P("data")), check_vma=False)
    return lambda h, w: f(h, w, y)


cases = {
    "shard chunked": per_shard("chunked"),
    "shard pallas mosaic": per_shard("pallas", block_t=16, block_v=128, family="mosaic"),
    # the wiring: on CPU impl="pallas" interprets the triton family, default tiles
    "vocab_parallel_logprob pallas": lambda h, w: vocab_parallel_logprob(
        h, w, y, mesh=mesh, token_axes=("data",), temperature=TEMP, impl="pallas"),
}
bad = 0
for name, fn in cases.items():
    out = value_and_grads(fn)
    errs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(out, ref)]
    ok = all(e < 5e-5 for e in errs)
    bad += not ok
    print(name, "ok" if ok else "MISMATCH", ["%.1e" % e for e in errs])
sys.exit(bad)

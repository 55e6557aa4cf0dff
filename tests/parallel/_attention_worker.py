"""Subprocess body for test_attention_on_mesh.py: brorl_jax.parallel.attention on 8 simulated CPU
devices (a data x fsdp x tensor = 2 x 2 x 2 mesh), the kernel interpreted inside shard_map,
against the jnp reference on one device: values and the gradients of q, k, v on real tokens.

Usage: python _attention_worker.py   (prints one JSON line: the largest errors per case)
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from brorl_jax.parallel.attention import packed_attention_on_mesh
from brorl_jax.parallel.mesh import make_mesh, use_mesh
from pallas_kernels.packed_attention import packed_attention_reference


def case(b, t, h, hkv, dh, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q, k, v, w = mk(b, t, h, dh), mk(b, t, hkv, dh), mk(b, t, hkv, dh), mk(b, t, h, dh)
    seg = np.zeros((b, t), np.int32)
    for r in range(b):               # 1-3 segments per row, then padding
        cuts = np.sort(rng.choice(np.arange(4, t), size=rng.integers(1, 4), replace=False))
        start = 0
        for i, c in enumerate(cuts):
            seg[r, start:c] = i + 1
            start = c
    seg = jnp.asarray(seg)
    real = (seg > 0)[..., None, None]
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v, seg), 0.0) * w)
    kernel = lambda q, k, v, s: packed_attention_on_mesh(q, k, v, s, impl="pallas",
                                                         family="triton", block=16)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with use_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp")))
        q, k, v = (jax.device_put(x, rows) for x in (q, k, v))
        got, grads = jax.jit(jax.value_and_grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
        text = jax.jit(kernel).trace(q, k, v, seg).lower().as_text()
    want, wgrads = jax.value_and_grad(loss(packed_attention_reference), argnums=(0, 1, 2))(
        *(jax.device_get(x) for x in (q, k, v)))
    err = {"value": float(abs(got - want) / max(abs(want), 1.0))}
    for name, a, r in zip("qkv", grads, wgrads):
        err[f"d{name}"] = float(np.abs(np.asarray(a) - np.asarray(r)).max())
    err["shard_map"] = "manual_computation" in text or "shard_map" in text
    return err


if __name__ == "__main__":
    print(json.dumps({"heads_split": case(4, 40, 4, 2, 16, 0),        # heads over tensor
                      "heads_kept": case(4, 40, 2, 1, 16, 1)}))       # 1 kv head: replicated

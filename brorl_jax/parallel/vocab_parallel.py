"""Fused log-prob and entropy with the vocabulary split over the `tensor` mesh axis (shard_map).

For z = hidden @ lm_head / temperature with lm_head [D, V] split column-wise over k shards,
shard j holds z_j = z[:, j V/k : (j+1) V/k] and computes partial statistics over its slice:

    m_j = max_v z_j                     M   = pmax_j m_j             (global max, no gradient:
    s_j = sum_v e^{z_j - M}             S   = psum_j s_j              lse does not depend on it)
    a_j = sum_v e^{z_j - M} (z_j - M)   A   = psum_j a_j
    t_j = z[y] if y in slice j else 0   z_y = psum_j t_j

    logp    = z_y - lse,  lse = M + log S                     (log-softmax at the target)
    entropy = -sum_v p_v log p_v = log S - A / S              (p = softmax z)

Only [T]-sized vectors cross the tensor axis (one pmax and three psums per call), never the
[T, V] logits. Within a shard the token axis is processed in blocks (lax.map) whose logits are
rematerialised in the backward pass (jax.checkpoint), so memory is O(block_t * V / k).

Gradients flow through the collectives: shard_map with check_vma=True tracks that `hidden` is
the same on every tensor shard while the lm_head slice differs, so the backward pass psums the
per-shard d hidden contributions; d lm_head stays sharded. Tests compare values and gradients
with pallas_kernels.fused_logprob.reference (the unsharded naive reference).

Where the Pallas kernel compiles (GPU/TPU), each shard instead runs it on its columns
(pallas_kernels.fused_logprob_vocab_shard: the same merge of per-shard lse / target logit /
entropy, with a custom VJP that runs the kernel's backward per shard against the merged
statistics), so under a mesh the Mosaic/Triton kernel always runs inside shard_map.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels import interpret_mode

_NEG = -1e30


def _block_stats(h, w, y, col0, inv_temp):
    """Partial stats of one token block against this shard's vocab slice.

    h [bt, D], w [D, Vk], y [bt] int32, col0 = first global column of the slice.
    -> (m [bt], z_target [bt]) before the global max is known; the sums come in a second pass."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32) * inv_temp
    col = col0 + jnp.arange(w.shape[1], dtype=jnp.int32)[None, :]
    t = jnp.sum(jnp.where(col == y[:, None], z, 0.0), axis=-1)
    return z, t


def _local_logprob(hidden, lm_head, targets, *, axis: str, inv_temp: float, block_t: int):
    """Per-shard body: hidden [t, D] (same on every `axis` shard), lm_head [D, V/k] (this shard's
    columns), targets [t] -> (logp [t], entropy [t]) identical on every shard."""
    t_len, d = hidden.shape
    vk = lm_head.shape[1]
    col0 = lax.axis_index(axis) * vk
    bt = min(block_t, t_len)
    pad = (-t_len) % bt
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, bt, d)
    y = jnp.pad(targets.astype(jnp.int32), (0, pad)).reshape(-1, bt)

    # Pass 1: local max (no gradient needed: lse is invariant to the shift) and target logit.
    @jax.checkpoint
    def first(args):
        hb, yb = args
        z, t = _block_stats(hb, lm_head, yb, col0, inv_temp)
        return lax.stop_gradient(jnp.max(z, axis=-1)), t

    m_loc, t_loc = lax.map(first, (h, y))
    m = lax.pmax(m_loc, axis)                       # [nb, bt], same on every shard

    # Pass 2: sums relative to the global max (logits recomputed, never stored).
    @jax.checkpoint
    def second(args):
        hb, yb, mb = args
        z, _ = _block_stats(hb, lm_head, yb, col0, inv_temp)
        zc = z - mb[:, None]
        e = jnp.exp(zc)
        return jnp.sum(e, axis=-1), jnp.sum(e * zc, axis=-1)

    s_loc, a_loc = lax.map(second, (h, y, m))
    s, a, z_y = lax.psum((s_loc, a_loc, t_loc), axis)
    log_s = jnp.log(s)
    logp = z_y - (m + log_s)
    entropy = log_s - a / s
    return logp.reshape(-1)[:t_len], entropy.reshape(-1)[:t_len]


def vocab_parallel_logprob(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    mesh: Mesh,
    vocab_axis: str = "tensor",
    token_axes: Sequence[str] | str | None = ("data", "fsdp"),
    temperature: float = 1.0,
    block_t: int = 1024,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """log softmax(z)[target] and entropy of softmax(z), z = hidden @ lm_head / temperature, with
    V split over `vocab_axis` and tokens over `token_axes`.

    Args:
      hidden: [T, D] final normed hidden states (T divisible by the token-axes size).
      lm_head: [D, V] output embedding (V divisible by the vocab-axis size).
      targets: [T] int token ids.
      mesh: the device mesh; vocab_axis / token_axes name its axes.
      impl: where the Pallas kernel compiles (GPU/TPU: "auto"), or with impl="pallas", each shard
        runs pallas_kernels.fused_logprob_vocab_shard (the kernel on its vocabulary columns inside
        shard_map, statistics merged over `vocab_axis`); otherwise ("auto" on CPU, "chunked",
        "naive") the jnp body below, blocks of `block_t` tokens.
    Returns:
      (logp [T] f32, entropy [T] f32), sharded over token_axes; differentiable wrt hidden and
      lm_head (the lm_head gradient keeps lm_head's vocab sharding).
    """
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"vocab_parallel_logprob: need hidden [T, D] and lm_head [D, V]; got "
                         f"{hidden.shape} and {lm_head.shape}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"vocab_parallel_logprob: targets must be [T={hidden.shape[0]}], got "
                         f"{targets.shape}")
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_logprob: temperature must be > 0, got {temperature}")
    k = mesh.shape[vocab_axis]
    if lm_head.shape[1] % k:
        raise ValueError(f"vocab_parallel_logprob: vocabulary {lm_head.shape[1]} is not divisible "
                         f"by mesh axis {vocab_axis!r} of size {k}; pad the lm_head or change "
                         "mesh.tensor.")
    if isinstance(token_axes, str):
        token_axes = (token_axes,)
    token_axes = tuple(a for a in (token_axes or ()) if mesh.shape[a] > 1)
    n_tok = 1
    for a in token_axes:
        n_tok *= mesh.shape[a]
    if hidden.shape[0] % n_tok:
        raise ValueError(f"vocab_parallel_logprob: {hidden.shape[0]} tokens do not split over "
                         f"mesh axes {token_axes} (size {n_tok}).")
    tok = token_axes if token_axes else None
    specs = dict(mesh=mesh, in_specs=(P(tok, None), P(None, vocab_axis), P(tok)),
                 out_specs=(P(tok), P(tok)))
    if impl == "pallas" or (impl == "auto" and not interpret_mode()):
        from pallas_kernels.fused_logprob import fused_logprob_vocab_shard

        def kernel_body(h, w, y):
            # "auto" resolves per shard: the kernel, or the chunked path (logged) where it cannot
            # compile for these shapes; check_vma=False: the kernels are not vma-typed (the
            # cotangent convention this implies is handled in fused_logprob_vocab_shard).
            return fused_logprob_vocab_shard(
                h, w, y, axis_name=vocab_axis, vocab_start=lax.axis_index(vocab_axis) * w.shape[1],
                temperature=temperature, impl=impl)

        return jax.shard_map(kernel_body, check_vma=False, **specs)(hidden, lm_head, targets)
    body = functools.partial(_local_logprob, axis=vocab_axis, inv_temp=float(1.0 / temperature),
                             block_t=int(block_t))
    return jax.shard_map(body, check_vma=True, **specs)(hidden, lm_head, targets)


def sharded_fused_logprob(mesh: Mesh, *, vocab_axis: str = "tensor",
                          token_axes: Sequence[str] | str | None = ("data", "fsdp")):
    """A drop-in for pallas_kernels.fused_logprob(hidden, lm_head, targets, *, temperature, impl)
    that runs per device under shard_map: tokens split over `token_axes`, and the vocabulary
    over `vocab_axis` when that axis is larger than 1 (vocab_parallel_logprob); with a size-1
    vocab axis each device calls the fused kernel on its own tokens with the whole lm_head.

    Why: under plain jit the partitioner cannot split a Pallas call (it replicates its inputs)
    and the chunked path's token-block loop runs over a sharded axis (XLA gathers it), so a
    micro-batch's [tokens, D] hidden states would be gathered on every device."""
    from pallas_kernels import fused_logprob

    if isinstance(token_axes, str):
        token_axes = (token_axes,)
    candidates = tuple(a for a in (token_axes or ()) if mesh.shape[a] > 1)

    def logprob(hidden, lm_head, targets, *, temperature: float = 1.0, impl: str = "auto"):
        # the token axes that divide this call's token count (tiny micro-batches use fewer)
        axes, size = [], 1
        for a in candidates:
            if hidden.shape[0] % (size * mesh.shape[a]) == 0:
                axes.append(a)
                size *= mesh.shape[a]
        axes = tuple(axes)
        if mesh.shape[vocab_axis] > 1:
            return vocab_parallel_logprob(hidden, lm_head, targets, mesh=mesh,
                                          vocab_axis=vocab_axis, token_axes=axes,
                                          temperature=temperature, impl=impl)
        tok = axes if axes else None
        # check_vma=False: the kernel's internal scans are not vma-typed. The lm_head enters
        # replicated (P()), and shard_map's transpose sums its per-device cotangents over the
        # token axes; tests/parallel checks the gradients against the unsharded reference.
        body = functools.partial(fused_logprob, temperature=temperature, impl=impl)
        return jax.shard_map(lambda h, w, y: body(h, w, y), mesh=mesh,
                             in_specs=(P(tok, None), P(), P(tok)), out_specs=(P(tok), P(tok)),
                             check_vma=False)(hidden, lm_head, targets)

    return logprob

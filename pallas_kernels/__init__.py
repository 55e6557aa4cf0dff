"""Pallas kernels for brorl_jax's hot paths, each with a plain-jnp reference beside it.

This package never imports brorl_jax. Kernels interpret on CPU and compile on GPU/TPU; the mode
comes from the backend (`interpret_mode()`), or from `compile_target("cuda" | "tpu")` when
tracing for a device this machine does not have.
"""
from pallas_kernels._backend import (
    backend,
    compile_target,
    interpret_mode,
    jax_triton_available,
    kernel_family,
    tpu_abstract_mesh,
)

__all__ = ["backend", "compile_target", "interpret_mode", "jax_triton_available", "kernel_family",
           "tpu_abstract_mesh"]

# fused log-prob / entropy over vocab tiles (algo update); reference beside it.
from pallas_kernels.fused_logprob import (  # noqa: E402
    fused_logprob,
    fused_logprob_stats,
    fused_logprob_vocab_shard,
)
from pallas_kernels.fused_logprob.reference import (  # noqa: E402
    fused_logprob_reference,
    fused_logprob_stats_reference,
)

__all__ += ["fused_logprob", "fused_logprob_stats", "fused_logprob_vocab_shard", "fused_logprob_reference",
            "fused_logprob_stats_reference"]

# rollout: sort-free token sampling, slot decode attention over shared prompts and paged own KV
# (what the rollout engine runs) and its grouped shared-prefix form; references beside them.
from pallas_kernels.decode_attention import (  # noqa: E402
    shared_prefix_decode_attention,
    shared_prefix_decode_attention_pallas,
    shared_prefix_decode_attention_reference,
    slot_decode_attention,
    slot_decode_attention_pallas,
    slot_decode_attention_reference,
)
from pallas_kernels.sampling import sample_tokens, sample_tokens_pallas, sample_tokens_reference  # noqa: E402

__all__ += ["shared_prefix_decode_attention", "shared_prefix_decode_attention_pallas",
            "shared_prefix_decode_attention_reference", "sample_tokens", "sample_tokens_pallas",
            "sample_tokens_reference", "slot_decode_attention", "slot_decode_attention_pallas",
            "slot_decode_attention_reference"]
from pallas_kernels.packed_attention import (  # noqa: E402
    packed_attention,
    packed_attention_reference,
)

__all__ += ["packed_attention", "packed_attention_reference"]

"""The import path of the naive `fused_logprob` reference; its code is in
pallas_kernels/fused_logprob/reference.py."""
from pallas_kernels.fused_logprob.reference import (  # noqa: F401
    fused_logprob_reference,
    fused_logprob_stats_reference,
    reference_logits,
)

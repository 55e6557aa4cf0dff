"""brorl_jax: BroRL (large-N RLVR) in JAX."""

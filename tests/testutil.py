"""Helpers the test files share, in one place (a uniquely named module, not a package: the
tests/* folders are not packages; tests/ is on the path because conftest.py lives there, and
subprocess workers get it from their PYTHONPATH). Comparing two runs' metrics is
tests/run_metrics.py; starting commands, tests/procs.py.

    ROOT                                the repository root (str): where commands run
    main_command(workdir, *overrides)   `python -m brorl_jax.main` on configs/tiny.py, as a list
    run_main(workdir, *overrides)       that command run to its end from ROOT (procs.run), output
                                        captured as text
    tiny_model_config(**changes)        a tiny ModelConfig (hidden 32, vocab 64)
    small_model_config(**changes)       the same family twice as wide (hidden 64, vocab 256)

Nothing here imports JAX at import time: tests that never build a model stay light.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_command(workdir, *overrides, config: str = "configs/tiny.py") -> list[str]:
    """`python -m brorl_jax.main --config=CONFIG --workdir=WORKDIR OVERRIDES...` (run it with
    procs.run / procs.Popen, cwd=ROOT)."""
    return [sys.executable, "-m", "brorl_jax.main", f"--config={config}",
            f"--workdir={workdir}", *overrides]


def run_main(workdir, *overrides, config: str = "configs/tiny.py", env: dict | None = None,
             timeout: float = 600):
    """subprocess.CompletedProcess of main_command(...) run from ROOT (env None: this process's
    environment), stdout and stderr captured as text."""
    import procs
    return procs.run(main_command(workdir, *overrides, config=config), cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)


# A tiny qwen2-family model: 2 layers, hidden 32, 4 query heads over 2 KV heads (GQA) of 8
# dimensions, vocab 64. Every field is spelled out, so a default changed in ModelConfig changes
# no test; a test names only what it changes.
TINY_MODEL = dict(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=True, qk_norm=False,
    tie_word_embeddings=False, max_position_embeddings=64, bos_token_id=None, eos_token_ids=(1,))
# The same family twice as wide (hidden 64, heads of 16), vocab 256: the mesh tests' model.
SMALL_MODEL = dict(TINY_MODEL, vocab_size=256, hidden_size=64, intermediate_size=128,
                   head_dim=16, eos_token_ids=(3,))


def tiny_model_config(**changes):
    """brorl_jax.models.ModelConfig of TINY_MODEL with `changes`."""
    from brorl_jax.models import ModelConfig
    return ModelConfig(**dict(TINY_MODEL, **changes))


def small_model_config(**changes):
    """brorl_jax.models.ModelConfig of SMALL_MODEL with `changes`."""
    return tiny_model_config(**dict(SMALL_MODEL, **changes))

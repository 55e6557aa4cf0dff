"""Fixtures shared across test packages."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One persistent JAX compilation cache for the session, set before anything imports jax: the
# many runs of the same tiny configs (in this process and in the `main` subprocesses, which
# inherit the environment) compile each program once. A cache hit returns the executable XLA
# would build again, so no result depends on it. Removed at exit; an outer setting wins.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="brorl_jax_test_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _CACHE, True)

# The suite compiles hundreds of tiny programs, and LLVM's optimisation is most of each CPU
# compile while buying nothing at these shapes: off for the session (subprocesses inherit it).
# It changes the last bits of float results (vectorised reductions), which no tolerance-based
# test sees; the tests that pin exact numbers of the default build (the recorded tiny run and the
# runs it is compared with bit for bit: tests/train/test_loop.py and the shared warm start) run
# their subprocesses with EXACT_ENV, the environment as it came.
FAST_COMPILE_FLAGS = ["--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true"]
EXACT_ENV = dict(os.environ)
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + FAST_COMPILE_FLAGS)


@pytest.fixture(scope="session")
def tiny_warm_start(tmp_path_factory) -> list[str]:
    """Command-line overrides that start configs/tiny.py from its supervised warm start, built
    once per session (`main` with train.steps=0 saves it as warm_start_model/): the loop tests
    then spend their time on RL steps, not on repeating the same 60 supervised steps."""
    work = tmp_path_factory.mktemp("tiny_warm_start")
    out = subprocess.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
         "--config.train.steps=0", "--config.train.tensorboard=False"],
        cwd=ROOT, env=EXACT_ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [f"--config.model.path={work / 'warm_start_model'}", "--config.sft.steps=0"]

"""Fixtures shared across test packages."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_warm_start(tmp_path_factory) -> list[str]:
    """Command-line overrides that start configs/tiny.py from its supervised warm start, built
    once per session (`main` with train.steps=0 saves it as warm_start_model/): the loop tests
    then spend their time on RL steps, not on repeating the same 60 supervised steps."""
    work = tmp_path_factory.mktemp("tiny_warm_start")
    out = subprocess.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
         "--config.train.steps=0", "--config.train.tensorboard=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [f"--config.model.path={work / 'warm_start_model'}", "--config.sft.steps=0"]

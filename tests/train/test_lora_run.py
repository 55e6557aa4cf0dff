"""A LoRA run end to end through `main` (issue 42): it trains only adapters, merges them at a
reference reset, and a run stopped after its checkpoint and resumed gives the uninterrupted run's
weights bit for bit (the base is reloaded from model.path and the merged adapters re-merged)."""
import os

import jax
import numpy as np
import pytest
from testutil import run_main

from brorl_jax.models import lora
from brorl_jax.train.loop import restore_checkpoint, restore_params
from brorl_jax.workdir import saved_config
from brorl_jax.workdir.logger import read_metrics

pytestmark = pytest.mark.slow     # end-to-end: out of `-m "not slow"`

LORA = ["--config.model.lora_rank=4", "--config.algo.ref_reset_every=1",
        "--config.train.tensorboard=False"]


def _train(workdir, steps, warm):
    out = run_main(workdir, f"--config.train.steps={steps}", *LORA, *warm)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _final(workdir, steps):
    cfg = saved_config.as_config(str(workdir))
    _, params, step = restore_params(cfg, str(workdir))
    assert step == steps
    return cfg, jax.tree.map(np.asarray, params)


def test_lora_run_resumes_bit_identically_across_a_reset(tmp_path, tiny_warm_start):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _train(straight, 2, tiny_warm_start)
    _train(stopped, 1, tiny_warm_start)           # stops after the reset at step 1 and its save
    out = _train(stopped, 2, tiny_warm_start)
    assert "[resume] from checkpoint step 1" in out.stdout
    cfg, want = _final(straight, 2)
    _, got = _final(stopped, 2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
    # what the checkpoint holds: adapters and the merged sets of the resets at steps 1 and 2,
    # no base
    _, saved, _ = restore_checkpoint(cfg, str(straight))
    assert len(saved.lora_merged) == 2 and set(saved.params) == {lora.KEY}
    base = restore_params(cfg, str(straight), 1)[1]
    assert any(not np.array_equal(np.asarray(x), y) for x, y in
               zip(jax.tree.leaves(base), jax.tree.leaves(got)))      # it trained
    steps = [r["step"] for r in read_metrics(os.path.join(stopped, "metrics.jsonl"))]
    assert steps == [0, 1, 2]

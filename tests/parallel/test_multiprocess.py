"""A real two-process run on localhost through jax.distributed (gloo CPU collectives).

Two subprocesses with 2 CPU devices each form a 4-device data=2 x fsdp=2 mesh, feed only their
own rows of each global batch, run 3 real update steps, and write the gathered parameters plus
an orbax checkpoint they save and restore collectively. Both must agree with each other, with
the restored checkpoint, and with the same 3 steps run in this single process without a mesh.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import procs
import pytest
from parallel_testutil import HERE, device_env, free_port, wait_all
from testutil import ROOT

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

STEPS = 3


def _single_process_params():
    sys.path.insert(0, HERE)
    from _multiprocess_common import ALGO, initial_params, make_optimizer_for_test
    from _sharded_worker import tiny_config, update_batch

    from brorl_jax.algo import create_train_state, make_update_step

    cfg = tiny_config()
    optimizer = make_optimizer_for_test()
    state = create_train_state(initial_params(cfg), optimizer)
    update = jax.jit(make_update_step(cfg, ALGO, optimizer))
    for step in range(STEPS):
        state, _ = update(state, update_batch(16, 16, cfg.vocab_size, seed=step),
                          jax.random.PRNGKey(100 + step))
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}


def test_two_processes_train_and_agree(tmp_path):
    port = free_port()
    env = device_env(2)
    workers = [procs.Popen(
        [sys.executable, os.path.join(HERE, "_multiprocess_worker.py"), str(i), "2", str(port),
         str(tmp_path), str(STEPS)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = wait_all(workers, timeout=420)
    reports = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert sorted(r["pid"] for r in reports) == [0, 1]
    assert reports[0]["checksum"] == reports[1]["checksum"]
    assert "step 0 loss" in outs[0] and "step 0 loss" not in outs[1]   # logging from process 0
    assert reports[0]["meta"] == {"note": "two-process test"}
    assert "fsdp" in reports[0]["restored_sharding"]

    got = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(2)]
    want = _single_process_params()
    initial = jax.tree_util.tree_flatten_with_path(
        __import__("_multiprocess_common").initial_params(
            __import__("_sharded_worker").tiny_config()))[0]
    moved = 0.0
    for key, ref in want.items():
        np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
        np.testing.assert_array_equal(got[0]["restored" + key], got[0][key], err_msg=key)
        np.testing.assert_allclose(got[0][key], ref, atol=1e-4, rtol=1e-4, err_msg=key)
    for path, x0 in initial:
        moved = max(moved, float(np.abs(want[jax.tree_util.keystr(path)] - np.asarray(x0)).max()))
    assert moved > 1e-3       # the steps really changed the parameters

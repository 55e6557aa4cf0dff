"""One process of the two-process run in test_multiprocess.py (jax.distributed on localhost).

Usage: python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR STEPS
Each process has 2 CPU devices (XLA_FLAGS set by the test); the global mesh is data=2 x fsdp=2.
Both processes build the same initial params (same seed), feed ONLY their own rows of every
global batch (jax.make_array_from_process_local_data via distributed.global_batch), run STEPS
real update steps (algo.make_update_step through algo_sharded.make_sharded_update), save the state
with orbax collectively (workdir.checkpoint.Checkpointer), restore it, and write the gathered
final params and the restored ones to OUT_DIR/params_<pid>.npz.
"""
from __future__ import annotations

import json
import os
import sys


def main(pid: int, nproc: int, port: int, out_dir: str, steps: int) -> None:
    from brorl_jax.parallel import distributed
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid)

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(__file__))
    from _multiprocess_common import ALGO, initial_params, make_optimizer_for_test
    from _sharded_worker import tiny_config, update_batch

    from brorl_jax.algo import create_train_state, sharded_steps as algo_sharded
    from brorl_jax.parallel import sharded
    from brorl_jax.parallel.distributed import global_batch, process_rows
    from brorl_jax.parallel.mesh import make_mesh

    assert jax.process_count() == nproc and len(jax.devices()) == 2 * nproc
    cfg = tiny_config()
    mesh = make_mesh({"data": -1, "fsdp": 2, "tensor": 1})
    optimizer = make_optimizer_for_test()
    params = initial_params(cfg)
    host_state = jax.device_get(create_train_state(params, optimizer))
    batch0 = update_batch(16, 16, cfg.vocab_size, seed=0)
    update, sh = algo_sharded.make_sharded_update(cfg, ALGO, optimizer, mesh, host_state, batch0)
    state = sharded.place(host_state, sh["state"])
    rows = process_rows(16)
    for step in range(steps):
        full = update_batch(16, 16, cfg.vocab_size, seed=step)      # every host could build it...
        local = jax.tree.map(lambda v: v[rows], full)               # ...but feeds only its rows
        state, metrics = update(state, global_batch(local, sh["batch"]),
                                jax.random.PRNGKey(100 + step))
        distributed.log(f"step {step} loss {float(metrics['loss']):.6f}")

    final = multihost_utils.process_allgather(state.params, tiled=True)
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(final)[0]}

    # Collective orbax checkpoint: every process writes its shards, then reads them back.
    from brorl_jax.workdir.checkpoint import Checkpointer
    ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), async_save=False)
    ckpt.save(steps, state, {"note": "two-process test"})
    ckpt.wait()
    restored, meta = ckpt.restore(steps, state)
    ckpt.close()
    back = multihost_utils.process_allgather(restored.params, tiled=True)
    for p, x in jax.tree_util.tree_flatten_with_path(back)[0]:
        flat["restored" + jax.tree_util.keystr(p)] = np.asarray(x)
    np.savez(os.path.join(out_dir, f"params_{pid}.npz"), **flat)
    checksum = float(sum(np.asarray(v, np.float64).sum() for k, v in flat.items()
                         if not k.startswith("restored")))
    print(json.dumps({"pid": pid, "checksum": checksum, "meta": meta,
                      "restored_sharding": str(restored.params["layers"]["q_proj"]["kernel"]
                                               .sharding.spec)}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))

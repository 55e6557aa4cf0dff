"""One process of a mesh run of the real training loop (tests/train/test_loop_mesh.py).

Usage: python _mesh_worker.py WORKDIR OUT_NPZ [--config.key=value ...]
Devices come from XLA_FLAGS; several processes from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID (brorl_jax.parallel.distributed.maybe_initialize_distributed, as `main` does).
Runs brorl_jax.train.loop.Trainer on configs/tiny.py with the overrides, then writes the final
parameters, gathered to this process, to OUT_NPZ.
"""
from __future__ import annotations

import json
import sys


def main(workdir: str, out: str, overrides: list[str]) -> None:
    from brorl_jax.parallel.distributed import maybe_initialize_distributed
    maybe_initialize_distributed()

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from brorl_jax.train.loop import Trainer
    from configs import tiny

    cfg = tiny.get_config()
    for item in overrides:
        key, value = item.removeprefix("--config.").split("=", 1)
        section, name = key.split(".")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:        # a bare string such as a path
            parsed = value
        cfg[section][name] = type(cfg[section][name])(parsed)
    trainer = Trainer(cfg, workdir)
    try:
        params = trainer.run().state.params
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(params, tiled=True)
        flat = {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(out, **flat)
        rt = trainer.runtime
        ids = lambda mesh: sorted(int(d.id) for d in mesh.devices.flat) if mesh else None
        print(json.dumps({"pid": jax.process_index(), "devices": jax.device_count(),
                          "mesh": dict(getattr(rt, "mesh", {}) and rt.mesh.shape) or None,
                          "train_devices": ids(getattr(rt, "mesh", None)),
                          "rollout_devices": ids(rt.rollout_mesh)}), flush=True)
    finally:
        trainer.close()
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

"""Where the loop's compiled steps run: one device, a mesh of devices, or several processes.

The loop (train/loop.py) is written once; this module decides how its three device-facing calls
run, from the devices JAX sees and the config's `mesh` section (brorl_jax.parallel):

  one device        plain `jax.jit` of algo.make_update_step / make_logprob_fn and
                    rollout.generate (the path every CPU test and the demo take).
  one process,      the mesh of `mesh.data x mesh.fsdp x mesh.tensor` over all devices; the
  several devices   train state is sharded by the `mesh.rules` rule set (parallel.rules), the
                    update and log-prob steps are parallel.sharded.make_sharded_update /
                    make_sharded_logprob (explicit in/out shardings, donated state), and rollouts
                    go through a rollout.Engine on the mesh (under shard_map: each device decodes
                    its share of every prompt's N samples).
  several processes the same global mesh for the update (jax.distributed; each process feeds only
  (jax.distributed)  its rows via distributed.global_batch). Rollouts are local: every process
                    reads its own shard of the prompts (data.make_prompt_loader's defaults),
                    generates on its own devices with a host copy of the current parameters
                    (gathered once per step), scores its own samples and fills its share
                    (prompts_per_step / processes) of the update batch by dynamic sampling. Only
                    the update and a few small gathers (advantage whitening over the whole batch,
                    metrics, evaluation rewards, data-iterator states for checkpoints) cross
                    processes. Orbax writes and reads the sharded state collectively; process 0
                    logs.

Choice (not in the paper, which does not describe its system): rollouts in the multi-process case
are per-process so that generation, the dominant cost at large N, needs no cross-host traffic
beyond the once-per-step parameter gather.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import numpy as np

from brorl_jax import algo
from brorl_jax.config import ConfigError


def use_mesh() -> bool:
    """The mesh path runs whenever JAX sees more than one device (over all processes)."""
    return jax.device_count() > 1


@dataclasses.dataclass
class _Steps:
    update: Callable
    logprob: Callable | None
    batch_sharding: dict


class MeshRuntime:
    """Sharded steps for a Trainer on a mesh (one or several processes)."""

    def __init__(self, cfg, model_cfg, optimizer, *, diagnostics_n: int | None):
        from brorl_jax.parallel.mesh import batch_axis_size, make_mesh, mesh_from_config
        self.model_cfg = model_cfg
        self.optimizer = optimizer
        self.diagnostics_n = diagnostics_n
        self.rules = cfg.mesh.rules
        try:
            self.mesh = mesh_from_config(cfg.mesh)
        except ValueError as e:     # sizes that do not fit the devices JAX sees
            raise ConfigError(str(e)) from None
        self.num_processes = jax.process_count()
        self.process_index = jax.process_index()
        # Rollouts: the global mesh in one process; each process's own devices otherwise.
        self.rollout_mesh = (self.mesh if self.num_processes == 1 else
                             make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.local_devices()))
        rows = cfg.algo.prompts_per_step * cfg.rollout.rollouts_per_prompt
        split = batch_axis_size(self.mesh)
        if rows % split:
            raise ConfigError(
                f"the update batch (algo.prompts_per_step x rollout.rollouts_per_prompt = {rows} "
                f"rows) does not split over the mesh's data x fsdp = {split} devices; make it a "
                f"multiple of {split} or change mesh.data / mesh.fsdp.")
        if self.num_processes > 1 and cfg.algo.prompts_per_step % self.num_processes:
            raise ConfigError(
                f"algo.prompts_per_step={cfg.algo.prompts_per_step} must be a multiple of the "
                f"{self.num_processes} processes: each process fills an equal share of the "
                "update batch with its own prompts.")
        self._steps: dict[Any, _Steps] = {}
        self._state_sharding = None
        self._rollout = None          # rollout.Engine on rollout_mesh (holds its compiled programs)

    # ------------------------------------------------------------------ state
    def state_sharding(self, state):
        if self._state_sharding is None:
            from brorl_jax.parallel.sharded import train_state_shardings
            self._state_sharding = train_state_shardings(state, self.mesh, self.rules)
        return self._state_sharding

    def place_state(self, state):
        """The state laid out on the mesh (every process passes the same full values)."""
        from brorl_jax.parallel.sharded import place
        return place(jax.device_get(state), self.state_sharding(state))

    def host_params(self, params):
        """A full host copy of (possibly cross-process sharded) parameters."""
        if self.num_processes == 1:
            return params
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(params, tiled=True)

    # ------------------------------------------------------------------ update
    def _compile(self, algo_cfg, state, local_batch: dict) -> _Steps:
        from brorl_jax.parallel import sharded
        p = self.num_processes
        abstract = {k: jax.ShapeDtypeStruct((v.shape[0] * p,) + v.shape[1:], v.dtype)
                    for k, v in local_batch.items()}
        with_ref = algo_cfg.kl_coef > 0
        if "ref_logprobs" not in abstract:   # assemble_update_batch zero-fills it
            rows, t = abstract["input_tokens"].shape
            abstract["ref_logprobs"] = jax.ShapeDtypeStruct((rows, t), np.float32)
        update, sh = sharded.make_sharded_update(
            self.model_cfg, algo_cfg, self.optimizer, self.mesh, state, abstract,
            rules=self.rules, diagnostics_n=self.diagnostics_n)
        logprob = None
        if with_ref:
            no_ref = {k: v for k, v in abstract.items() if k != "ref_logprobs"}
            logprob, _ = sharded.make_sharded_logprob(self.model_cfg, algo_cfg, self.mesh,
                                                      state.params, no_ref, rules=self.rules)
        return _Steps(update, logprob, sh["batch"])

    def update(self, algo_cfg, state, local_batch: dict, rng):
        """One update on the mesh from this process's rows of the batch (host numpy)."""
        from brorl_jax.parallel.distributed import global_batch
        from brorl_jax.parallel.sharded import place
        key = (algo_cfg, tuple(sorted((k, v.shape, str(v.dtype))
                                      for k, v in local_batch.items())))
        if key not in self._steps:
            self._steps[key] = self._compile(algo_cfg, state, local_batch)
        steps = self._steps[key]
        shard = {k: s for k, s in steps.batch_sharding.items() if k in local_batch}
        if self.num_processes > 1:
            batch = global_batch(local_batch, shard)
        else:
            batch = place(local_batch, shard)
        if steps.logprob is not None:
            inputs = {k: v for k, v in batch.items() if k != "ref_logprobs"}
            batch["ref_logprobs"], _, _ = steps.logprob(state.ref_params, inputs)
        rng = np.asarray(jax.random.key_data(rng))      # a host value: replicated everywhere
        return steps.update(state, batch, rng)

    # ------------------------------------------------------------------ rollout
    def generate(self, model, params, prompts, *, impl: str = "auto", **kwargs):
        from brorl_jax.rollout import Engine
        if self._rollout is None or self._rollout.impl != impl:
            self._rollout = Engine(model.config, mesh=self.rollout_mesh, impl=impl)
        return self._rollout.generate(params, prompts, **kwargs)

    # ------------------------------------------------------------------ cross-process helpers
    def allgather_rows(self, x: np.ndarray) -> np.ndarray:
        """Concatenates every process's equal-shaped array along axis 0 (process order)."""
        if self.num_processes == 1:
            return np.asarray(x)
        from jax.experimental import multihost_utils
        out = np.asarray(multihost_utils.process_allgather(np.asarray(x)))
        return out.reshape((-1,) + out.shape[2:])

    def allgather_json(self, obj) -> list:
        """Every process's JSON-serialisable value, in process order."""
        if self.num_processes == 1:
            return [obj]
        from jax.experimental import multihost_utils
        raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).ravel()
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[:raw.size] = raw
        every = np.asarray(multihost_utils.process_allgather(padded))
        return [json.loads(bytes(every[i, :sizes[i]]).decode()) for i in range(len(sizes))]

    def reduce_metrics(self, metrics: dict, sums: Sequence[str] = (),
                       maxes: Sequence[str] = ()) -> dict:
        """Process-mean of every scalar metric (sum for the keys in `sums`, max for `maxes`)."""
        if self.num_processes == 1:
            return metrics
        keys = sorted(k for k, v in metrics.items() if np.ndim(v) == 0)
        every = self.allgather_rows(np.asarray([[float(metrics[k]) for k in keys]], np.float64))
        out = dict(metrics)
        for i, k in enumerate(keys):
            col = every[:, i]
            out[k] = float(col.sum() if k in sums else col.max() if k in maxes else col.mean())
        return out


def global_advantages(runtime: MeshRuntime | None, estimator: str, shaped: np.ndarray,
                      group_valid: np.ndarray, *, eps: float) -> np.ndarray:
    """Advantages of this process's kept groups, normalised over the whole (all-process) batch
    as the paper's REINFORCE++-baseline whitening requires."""
    if runtime is None or runtime.num_processes == 1:
        return np.asarray(algo.compute_advantages(estimator, shaped, group_valid, eps=eps))
    all_shaped = runtime.allgather_rows(shaped)
    all_valid = runtime.allgather_rows(group_valid)
    adv = np.asarray(algo.compute_advantages(estimator, all_shaped, all_valid, eps=eps))
    g = shaped.shape[0]
    return adv[runtime.process_index * g:(runtime.process_index + 1) * g]

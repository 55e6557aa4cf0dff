"""Where the loop's compiled steps run: one device, a mesh of devices, or several processes.

The RL step (train/step.py), the evaluation and the warm start talk to one interface, `Runtime`
(held by the run context, train/context.py), and never ask which one they have:

  place_state(state)            the train state laid out for the update
  rollout_params(params)        the rollout's copy of the parameters: compute dtype, one buffer
                                per layer (rollout.programs.rollout_layout), made once per update
                                on device and held until the next (never through the host)
  generate(model, params, prompts, **rollout_kwargs) -> rollout.RolloutResult
  stream(model, params, prompts, **rollout_kwargs) -> rollout.RolloutStream (groups as they finish)
  rollout_engine(model_cfg)     the rollout.Engine held for the run (its compiled programs)
  update(algo_cfg, state, batch, rng) -> (state, metrics): reference log-probs (KL on) and the
                                PPO update on this process's rows (host numpy)
  relayout(state)               device arrays back in the update's layout (reference reset)
  place_params(params)          a params tree in the update's layout (a LoRA resume's merges)
  broadcast(tree)               process 0's value everywhere (the warm start)
  allgather_rows / allgather_json / reduce_metrics   cross-process helpers (identities with one
                                process)

  LocalRuntime   one device: plain `jax.jit` of algo.make_update_step / make_logprob_fn and
                 a rollout.Engine (the path every CPU test and the demo take).
  MeshRuntime    several devices, one or several processes: the mesh of
                 `mesh.data x mesh.fsdp x mesh.tensor`; the train state sharded by the
                 `mesh.rules` rule set (parallel.rules); sharded update and log-prob steps
                 (explicit in/out shardings, donated state); rollouts by a rollout.Engine on the
                 rollout mesh (under shard_map: each device decodes its share of every prompt's
                 samples in its own slots).
                 With several processes (jax.distributed) each process feeds only its rows of the
                 update (distributed.global_batch); rollouts are local: every process reads its
                 own prompt shard, generates on its own devices with a replicated copy of the
                 current parameters (all-gathered on device once per step, cast to the compute
                 dtype; each process keeps its own devices' replicas), scores its own samples and
                 fills its share
                 of the update batch. Only the update and small gathers (advantage normalisation,
                 metrics, evaluation rewards, data-iterator states) cross processes.
                 Disaggregated (mesh.rollout_devices = R): the rollout mesh is the first R
                 devices (with P processes: the first R / P of each process's, so rollouts
                 stay per-process), the update's mesh the others; rollout_params casts on the
                 training devices and moves the copy to the rollout devices (one process:
                 jax.device_put between the meshes; several: the gather on the training mesh,
                 then a device-to-device copy of a local replica to each own rollout device),
                 so the engine can decode while the update runs
                 (algo.decode_during_update, collect.decode_during_update).

Compiled programs live on the runtime object the run context holds (one per UpdateConfig, e.g. per
scheduled temperature; collect-only settings are not in it), never in module-level caches.

Choice (not in the paper, which does not describe its system): rollouts in the multi-process case
are per-process so that generation, the dominant cost at large N, needs no cross-host traffic
beyond the once-per-step parameter gather.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from brorl_jax import algo, rollout
from brorl_jax.algo import sharded_steps as algo_sharded
from brorl_jax.config import ConfigError, as_run_config, check_update_split
from brorl_jax.models.precision import with_precision
from brorl_jax.parallel import distributed, expert_parallel as ep, rules as R, sharded
from brorl_jax.parallel.mesh import batch_axis_size, make_mesh, mesh_from_config


def make_runtime(cfg, model_cfg, optimizer, *, diagnostics_n: int | None,
                 paused_engine_bytes: int | None = None) -> "Runtime":
    """MeshRuntime whenever JAX sees more than one device (over all processes), else LocalRuntime."""
    runtime = MeshRuntime if jax.device_count() > 1 else LocalRuntime
    return runtime(cfg, model_cfg, optimizer, diagnostics_n=diagnostics_n,
                   paused_engine_bytes=paused_engine_bytes)


class Runtime:
    """The interface (module docstring) and the cross-process helpers both runtimes share."""

    num_processes: int = 1
    process_index: int = 0
    row_multiple: int = 1           # this process's update rows must be a multiple of it

    def __init__(self, cfg, model_cfg, optimizer, *, diagnostics_n: int | None,
                 paused_engine_bytes: int | None = None):
        self.model_cfg = model_cfg
        self.optimizer = optimizer
        self.diagnostics_n = diagnostics_n
        self.rollout_impl = cfg.rollout.impl
        # algo.routing_replay="rollout": the engines record each token's experts (MoE only)
        self.record_routing = as_run_config(cfg).algo.routing_replay == "rollout"
        # the training rollouts' precision (rollout.weight_dtype / kv_dtype); evaluation passes
        # its own (Sampling.precision)
        self.precision = (cfg.rollout.weight_dtype, cfg.rollout.kv_dtype)
        self.memory_budget_bytes = as_run_config(cfg).memory_budget_bytes
        # the stream left paused across the update (RunConfig.carries_samples): the door's
        # count (train/door.py), counted here for a runtime built outside a run
        if paused_engine_bytes is None:
            from brorl_jax.train import rollout_calls
            paused_engine_bytes = rollout_calls.paused_engine_bytes(
                cfg, model_cfg, num_devices=rollout_calls.rollout_device_count(cfg),
                num_processes=jax.process_count())
        self.paused_engine_bytes = paused_engine_bytes
        self._steps: dict[Any, Any] = {}
        self._rollout: dict = {}        # precision -> rollout.Engine
        self._rollout_copy: tuple | None = None     # (source params, the rollout's copy)
        self._layout_fns: dict[Any, Callable] = {}

    # -- cross-process helpers ------------------------------------------------------------------
    def allgather_rows(self, x: np.ndarray) -> np.ndarray:
        """Concatenates every process's equal-shaped array along axis 0 (process order)."""
        if self.num_processes == 1:
            return np.asarray(x)
        out = np.asarray(multihost_utils.process_allgather(np.asarray(x)))
        return out.reshape((-1,) + out.shape[2:])

    def allgather_json(self, obj) -> list:
        """Every process's JSON-serialisable value, in process order."""
        if self.num_processes == 1:
            return [obj]
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

    def broadcast(self, tree):
        """Process 0's value of `tree` on every process (host values)."""
        if self.num_processes == 1:
            return tree
        return multihost_utils.broadcast_one_to_all(jax.device_get(tree))

    # -- the interface ----------------------------------------------------------------------------
    def place_state(self, state):
        """The state laid out for the update, from host values (the same on every process)."""
        raise NotImplementedError

    def relayout(self, state):
        """The state (device arrays, e.g. after a reference reset) in the update's layout."""
        raise NotImplementedError

    def place_params(self, params):
        """A params tree (host or device values) in the update's layout of the params."""
        raise NotImplementedError

    def rollout_params(self, params, precision=None):
        """The rollout's copy of ``params`` (see the module docstring) at ``precision``
        ((weights, kv); default the training rollouts')."""
        raise NotImplementedError

    def rollout_cfg(self, model_cfg, precision=None):
        """The rollout engine's model config: ``model_cfg`` at ``precision`` (models.precision)."""
        return with_precision(model_cfg, *(precision or self.precision))

    def _rollout_layout(self, params, sharding=None, precision=None):
        """``rollout.programs.rollout_layout`` of ``params`` under jit (``sharding``: its
        output sharding), made once per distinct ``params`` object and held (the one copy the
        memory plan counts: rollout.plan.rollout_params_bytes); the previous copy is dropped
        before the next is made."""
        cfg = self.rollout_cfg(self.model_cfg, precision)
        held = self._rollout_copy
        if held is not None and held[0] is params and held[1] == cfg:
            return held[2]
        self._rollout_copy = None
        if (sharding, cfg) not in self._layout_fns:
            from brorl_jax.rollout.programs import rollout_layout
            self._layout_fns[sharding, cfg] = jax.jit(
                lambda p: rollout_layout(p, cfg), out_shardings=getattr(sharding, "tree",
                                                                        sharding))
        out = self._layout_fns[sharding, cfg](params)
        self._rollout_copy = (params, cfg, out)
        return out

    rollout_mesh = None             # None: one device (LocalRuntime)
    rollout_devices = 0             # > 0: disaggregated (MeshRuntime, mesh.rollout_devices)

    def generate(self, model, params, prompts, *, precision=None, **kwargs):
        """Rollouts (rollout.RolloutResult) through the runtime's rollout Engine."""
        return self.rollout_engine(model.config, precision).generate(
            params, prompts, memory_budget_bytes=self.memory_budget_bytes, **kwargs)

    def stream(self, model, params, prompts, *, precision=None, **kwargs):
        """The same rollouts as a rollout.RolloutStream: each prompt's group as soon as its
        samples are done, while a background thread keeps decoding."""
        return self.rollout_engine(model.config, precision).stream(
            params, prompts, memory_budget_bytes=self.memory_budget_bytes, **kwargs)

    def open_stream(self, model, params, *, precision=None, **kwargs):
        """An open rollout.RolloutStream (Engine.open_stream): prompts fed while it decodes,
        paused between steps, weights swapped in (algo.stream_rounds)."""
        return self.rollout_engine(model.config, precision).open_stream(
            params, memory_budget_bytes=self.memory_budget_bytes, **kwargs)

    def rollout_engine(self, model_cfg, precision=None) -> rollout.Engine:
        """The rollout's compiled programs, held for the run (one Engine per model config and
        precision; on the rollout mesh under shard_map, so the Pallas kernels run per device)."""
        cfg = self.rollout_cfg(model_cfg, precision)
        key = (cfg.weight_precision, cfg.kv_precision)
        engine = self._rollout.get(key)
        if engine is None or engine.cfg != cfg:
            engine = self._rollout[key] = rollout.Engine(
                cfg, mesh=self.rollout_mesh, impl=self.rollout_impl,
                record_routing=self.record_routing and cfg.is_moe)
        return engine

    def update(self, algo_cfg, state, batch: algo.UpdateBatch, rng):
        raise NotImplementedError

    def update_device_bytes(self) -> int | None:
        """The device memory the update's remat policy plans with (make_update_step's
        device_bytes): the device's, less the rollout engine paused beside the update
        (train/door.py DoorFacts.paused_engine_bytes); None where unknown (CPU)."""
        mem = algo.update.device_memory_bytes()
        return None if mem is None else max(0, mem - self.paused_engine_bytes)


@dataclasses.dataclass
class _LocalSteps:
    update: Callable
    logprob: Callable


class LocalRuntime(Runtime):
    """One device: jitted steps, a rollout.Engine."""

    def place_state(self, state):
        return state

    def relayout(self, state):
        return state

    def place_params(self, params):
        return params

    def rollout_params(self, params, precision=None):
        return self._rollout_layout(params, precision=precision)

    def _compiled(self, algo_cfg) -> _LocalSteps:
        if algo_cfg not in self._steps:
            self._steps[algo_cfg] = _LocalSteps(
                jax.jit(algo.make_update_step(self.model_cfg, algo_cfg, self.optimizer,
                                              diagnostics_n=self.diagnostics_n,
                                              device_bytes=self.update_device_bytes()),
                        donate_argnums=(0,)),
                jax.jit(algo.make_logprob_fn(self.model_cfg, algo_cfg)))
        return self._steps[algo_cfg]

    def update(self, algo_cfg, state, batch: algo.UpdateBatch, rng):
        steps = self._compiled(algo_cfg)
        batch = jax.tree.map(jnp.asarray, batch)
        if algo_cfg.kl_coef > 0:
            ref_logprobs, _, _ = steps.logprob(algo.adapters.reference_params(state), batch)
            batch = batch.replace(ref_logprobs=ref_logprobs)
        merged, state = algo.adapters.detach_merged(state)     # LoRA: host-side, not updated
        state, metrics = steps.update(state, batch, rng)
        return algo.adapters.attach_merged(state, merged), metrics


def disaggregated_devices(rollout_devices: int) -> tuple[list, list]:
    """(this process's rollout devices, the training devices) for mesh.rollout_devices = R:
    in one process the first R devices and the rest; with P processes the first R / P of each
    process's devices (config.check_mesh: R a multiple of P) and, for training, the rest of
    every process's, in jax.devices() order. R = 0: ([], every device)."""
    devices = jax.devices()
    if not rollout_devices:
        return [], list(devices)
    share = rollout_devices // jax.process_count()
    local = {d.process_index: [] for d in devices}
    for d in devices:
        local[d.process_index].append(d)
    rollout = {d for own in local.values() for d in own[:share]}
    return (local[jax.process_index()][:share], [d for d in devices if d not in rollout])


def _local_replicas(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` (replicated over the training mesh, which spans every process) as an array of
    `sharding` (replicated over this process's rollout devices): each rollout device gets a
    device-to-device copy of a replica on one of this process's training devices. JAX's
    cross-host reshard needs one device set on both sides, so the gather runs on the training
    mesh (its collectives) and only the local copies cross to the rollout devices."""
    replica = x.addressable_shards[0].data
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [jax.device_put(replica, d) for d in sharding.addressable_devices])


class _Split:
    """A pytree of shardings as a hashable key (by identity; MeshRuntime._expert_split keeps one
    per rollout config)."""

    def __init__(self, tree):
        self.tree = tree


@dataclasses.dataclass
class _MeshSteps:
    update: Callable
    logprob: Callable | None
    batch_sharding: algo.UpdateBatch      # of NamedShardings


class MeshRuntime(Runtime):
    """Sharded steps on a mesh (one or several processes); see the module docstring."""

    def __init__(self, cfg, model_cfg, optimizer, *, diagnostics_n: int | None,
                 paused_engine_bytes: int | None = None):
        super().__init__(cfg, model_cfg, optimizer, diagnostics_n=diagnostics_n,
                         paused_engine_bytes=paused_engine_bytes)
        self.rules = cfg.mesh.rules
        self.rollout_devices = int(cfg.mesh.rollout_devices)
        self.num_processes = jax.process_count()
        self.process_index = jax.process_index()
        own, train = disaggregated_devices(self.rollout_devices)
        try:
            self.mesh = mesh_from_config(cfg.mesh, train)
        except ValueError as e:     # sizes that do not fit the devices JAX sees
            raise ConfigError(str(e)) from None
        # Rollouts: the global mesh in one process; each process's own devices otherwise; when
        # disaggregated, this process's share of the mesh.rollout_devices devices (the update
        # has the others).
        row = {"data": -1, "fsdp": 1, "tensor": 1}
        self.rollout_mesh = (make_mesh(row, own) if self.rollout_devices else
                             self.mesh if self.num_processes == 1 else
                             make_mesh(row, jax.local_devices()))
        split = batch_axis_size(self.mesh)
        check_update_split(as_run_config(cfg), split, self.num_processes)
        self._state_sharding = None
        # each process's rows of a packed batch split evenly over its batch devices
        self.row_multiple = max(1, split // self.num_processes)

    # -- state ----------------------------------------------------------------------------------
    def state_sharding(self, state):
        if self._state_sharding is None:
            self._state_sharding = algo_sharded.train_state_shardings(state, self.mesh, self.rules)
        return self._state_sharding

    def place_state(self, state):
        """The state laid out on the mesh (every process passes the same full values); under
        LoRA the merged adapters stay on the host (algo.adapters.detach_merged)."""
        merged, state = algo.adapters.detach_merged(state)
        state = sharded.place(jax.device_get(state), self.state_sharding(state))
        return algo.adapters.attach_merged(state, merged)

    def relayout(self, state):
        merged, state = algo.adapters.detach_merged(state)
        state = sharded.place(state, self.state_sharding(state))
        return algo.adapters.attach_merged(state, merged)

    def place_params(self, params):
        return sharded.place(params, R.param_shardings(params, self.mesh, self.rules))

    def rollout_params(self, params, precision=None):
        """The rollout's copy, replicated on the rollout mesh. With several processes the
        all-gather runs on device over the global mesh, and each process's replicas become
        arrays of its own rollout mesh (its local devices) without a copy."""
        local = NamedSharding(self.rollout_mesh, P())
        if self.rollout_devices:      # cast on the training devices, then moved: a reshard
            cfg = self.rollout_cfg(self.model_cfg, precision)
            held = self._rollout_copy
            if held is not None and held[0] is params and held[1] == cfg:
                return held[2]
            full = self._rollout_layout(params, NamedSharding(self.mesh, P()), precision)
            if self.num_processes == 1:
                moved = jax.device_put(full, local)
            else:   # each process copies a local replica of the gathered copy to its own
                moved = jax.tree.map(lambda x: _local_replicas(x, local), full)
            self._rollout_copy = (params, cfg, moved)   # the training devices' copy is dropped
            return moved
        if self.num_processes == 1:
            if ep.rollout_expert_axis(self.rollout_mesh, self.model_cfg.num_experts):
                local = self._expert_split(params, precision)
            return self._rollout_layout(params, local, precision)
        full = self._rollout_layout(params, NamedSharding(self.mesh, P()), precision)
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            x.shape, local, [s.data for s in x.addressable_shards
                             if s.device in local.device_set]), full)

    def _expert_split(self, params, precision):
        """The rollout copy's shardings under expert parallelism: each MoE layer's experts split
        over `expert` (as the engine's programs take them), the rest replicated. A hashable
        stand-in (_Split) keys the cached layout function."""
        cfg = self.rollout_cfg(self.model_cfg, precision)
        splits = self.__dict__.setdefault("_splits", {})
        if cfg not in splits:
            from brorl_jax.rollout.programs import rollout_layout
            shapes = jax.eval_shape(lambda p: rollout_layout(p, cfg), params)
            specs = ep.rollout_param_specs(shapes, cfg.num_experts)
            splits[cfg] = _Split(jax.tree.map(lambda s: NamedSharding(self.rollout_mesh, s),
                                              specs))
        return splits[cfg]

    # -- update ---------------------------------------------------------------------------------
    def _compile(self, algo_cfg, state, local_batch: algo.UpdateBatch) -> _MeshSteps:
        p = self.num_processes
        abstract = jax.tree.map(
            lambda v: jax.ShapeDtypeStruct((v.shape[0] * p,) + v.shape[1:], v.dtype), local_batch)
        if algo_cfg.kl_coef > 0 and abstract.ref_logprobs is None:   # filled by the update call
            abstract = abstract.replace(
                ref_logprobs=jax.ShapeDtypeStruct(abstract.input_tokens.shape, np.float32))
        update, sh = algo_sharded.make_sharded_update(
            self.model_cfg, algo_cfg, self.optimizer, self.mesh, state, abstract,
            rules=self.rules, diagnostics_n=self.diagnostics_n,
            device_bytes=self.update_device_bytes())
        logprob = None
        if algo_cfg.kl_coef > 0:
            logprob, _ = algo_sharded.make_sharded_logprob(     # under LoRA: the base's
                self.model_cfg, algo_cfg, self.mesh, algo.adapters.reference_params(state),
                abstract.replace(ref_logprobs=None), rules=self.rules)
        return _MeshSteps(update, logprob, sh["batch"])

    def update(self, algo_cfg, state, local_batch: algo.UpdateBatch, rng):
        """One update on the mesh from this process's rows of the batch (host numpy)."""
        key = (algo_cfg, jax.tree.structure(local_batch),
               tuple((v.shape, str(v.dtype)) for v in jax.tree.leaves(local_batch)))
        if key not in self._steps:
            self._steps[key] = self._compile(algo_cfg, state, local_batch)
        steps = self._steps[key]
        shard = steps.batch_sharding
        if local_batch.ref_logprobs is None:     # the reference log-probs are computed below
            shard = shard.replace(ref_logprobs=None)
        if self.num_processes > 1:
            batch = distributed.global_batch(local_batch, shard)
        else:
            batch = sharded.place(local_batch, shard)
        if steps.logprob is not None:
            ref_logprobs, _, _ = steps.logprob(algo.adapters.reference_params(state),
                                               batch.replace(ref_logprobs=None))
            batch = batch.replace(ref_logprobs=ref_logprobs)
        rng = np.asarray(jax.random.key_data(rng))      # a host value: replicated everywhere
        merged, state = algo.adapters.detach_merged(state)     # LoRA: host-side, not updated
        state, metrics = steps.update(state, batch, rng)
        return algo.adapters.attach_merged(state, merged), metrics

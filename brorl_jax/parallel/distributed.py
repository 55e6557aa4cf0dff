"""Multi-host start-up on JAX's own runtime (`jax.distributed`), and per-host data helpers.

Which environment we are in decides how `jax.distributed.initialize` is called:
  explicit   - JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set (bare machines,
               tests on localhost). JAX_LOCAL_DEVICE_IDS="0,1" optionally picks local devices.
  kubernetes - JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES set and the process id taken from the
               indexed Job's JOB_COMPLETION_INDEX (launch/jobset.yaml)
  slurm      - srun with more than one task: JAX's SLURM cluster detection fills everything in
  tpu        - a multi-host TPU slice: JAX's Cloud TPU detection fills everything in
  single     - none of the above: nothing to initialise

On CPU the cross-process collectives need an implementation: gloo (jax_cpu_collectives_
implementation), set before initialisation.

Data: every host reads only its shard of the prompts (brorl_jax.data.make_prompt_loader with
shard_index=jax.process_index(), shard_count=jax.process_count(), the defaults) and the global
batch is assembled from the per-host pieces by `global_batch`
(jax.make_array_from_process_local_data), so no host ever holds the whole batch.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np


def detect_environment(env: dict | None = None) -> str:
    """Names the launch environment: "explicit", "kubernetes", "slurm", "tpu" or "single"."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS") and env.get("JAX_NUM_PROCESSES"):
        if env.get("JAX_PROCESS_ID") is None and env.get("JOB_COMPLETION_INDEX") is not None:
            return "kubernetes"
        return "explicit"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return "slurm"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if hosts and len(hosts.split(",")) > 1:
        return "tpu"
    return "single"


_initialized = False


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: list[int] | None = None,
               *, cpu_collectives: str = "gloo") -> None:
    """`jax.distributed.initialize` with explicit flags (None = JAX's cluster auto-detection).

    Must run before anything touches a JAX device. On CPU, cross-process collectives use
    `cpu_collectives` ("gloo" or "mpi")."""
    global _initialized
    if _initialized:
        return
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if coordinator_address is None:
        jax.distributed.initialize()          # SLURM / Cloud TPU auto-detection
    else:
        if num_processes is None or process_id is None:
            raise ValueError("initialize(coordinator_address=...) also needs num_processes and "
                             "process_id (or set JAX_NUM_PROCESSES / JAX_PROCESS_ID).")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, num_processes="
                             f"{num_processes}).")
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id,
                                   local_device_ids=local_device_ids)
    _initialized = True


def maybe_initialize_distributed(env: dict | None = None) -> str:
    """Calls `jax.distributed.initialize` when the environment describes several processes.

    Must run before anything touches a JAX device. Returns the environment name."""
    env = os.environ if env is None else env
    kind = detect_environment(env)
    if kind == "single" or _initialized:
        return kind
    if kind in ("explicit", "kubernetes"):
        local = env.get("JAX_LOCAL_DEVICE_IDS")
        pid = env.get("JAX_PROCESS_ID", env.get("JOB_COMPLETION_INDEX"))
        initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]), int(pid),
                   [int(i) for i in local.split(",")] if local else None)
    else:
        initialize()
    return kind


def is_main_process() -> bool:
    """True on process 0: the one that logs, prints and writes plots."""
    return jax.process_index() == 0


def log(msg: str) -> None:
    """print() from process 0 only."""
    if is_main_process():
        print(msg, flush=True)


def process_rows(global_rows: int) -> slice:
    """The rows of a global batch this process supplies (contiguous, equal blocks).

    With a batch sharded over ("data", "fsdp") on its leading axis and devices ordered by
    process (make_mesh), process p owns rows [p * R / P, (p + 1) * R / P)."""
    count, index = jax.process_count(), jax.process_index()
    if global_rows % count:
        raise ValueError(f"global batch of {global_rows} rows does not split over {count} "
                         "processes; make the batch a multiple of jax.process_count().")
    per = global_rows // count
    return slice(index * per, (index + 1) * per)


def global_batch(local: Any, shardings: Any) -> Any:
    """Global jax.Arrays from this process's rows: `local` holds this host's [R / P, ...] slice
    of every leaf, `shardings` the global NamedShardings (rules.batch_shardings)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local, shardings)

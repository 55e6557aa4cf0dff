"""Multi-host start-up on JAX's own runtime (`jax.distributed`).

Which environment we are in decides how `jax.distributed.initialize` is called:
  explicit  - JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set (Kubernetes JobSet
              manifests in launch/ set them from the pod index; also handy on bare machines)
  SLURM     - srun with more than one task: JAX's SLURM cluster detection fills everything in
  TPU VM    - a multi-host TPU slice: JAX's Cloud TPU detection fills everything in
  single    - none of the above: nothing to initialise
"""
from __future__ import annotations

import os

import jax


def detect_environment(env: dict | None = None) -> str:
    """Names the launch environment: "explicit", "slurm", "tpu" or "single"."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS") and env.get("JAX_NUM_PROCESSES"):
        return "explicit"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return "slurm"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if hosts and len(hosts.split(",")) > 1:
        return "tpu"
    return "single"


_initialized = False


def maybe_initialize_distributed() -> str:
    """Calls `jax.distributed.initialize` when the environment describes several processes.

    Must run before anything touches a JAX device. Returns the environment name.
    """
    global _initialized
    kind = detect_environment()
    if kind == "single" or _initialized:
        return kind
    if kind == "explicit":
        local = os.environ.get("JAX_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
    else:
        jax.distributed.initialize()   # SLURM / Cloud TPU auto-detection
    _initialized = True
    return kind

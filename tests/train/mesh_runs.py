"""Runs of tests/train/_mesh_worker.py (the real training loop on a mesh), shared by
test_loop_mesh.py and test_disaggregated.py: one process with simulated CPU devices, or two
processes on localhost through jax.distributed (gloo). Each run's last stdout line is the
worker's JSON report (process index, devices, the training and rollout meshes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import procs
from testutil import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_mesh_worker.py")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parallel"))
from parallel_testutil import device_env, free_port, wait_all  # noqa: E402


def worker_env(num_devices: int, **extra) -> dict:
    env = device_env(num_devices)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_one(num_devices, workdir, out, *overrides, timeout=600):
    """(report, stdout) of one process with `num_devices` devices."""
    proc = procs.run([sys.executable, WORKER, str(workdir), str(out), *overrides],
                     env=worker_env(num_devices), cwd=ROOT, capture_output=True, text=True,
                     timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def run_two(workdir, outs, overrides, *, devices_per_process=2, timeout=600):
    """([report of process 0, of process 1], [their stdouts]): two processes of
    `devices_per_process` devices each, one workdir, outs[i] process i's parameters."""
    port = free_port()
    workers = [procs.Popen(
        [sys.executable, WORKER, str(workdir), str(outs[i]), *overrides],
        env=worker_env(devices_per_process, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    texts = wait_all(workers, timeout)
    return [json.loads(t.strip().splitlines()[-1]) for t in texts], texts


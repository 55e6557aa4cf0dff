"""Helpers for tests/parallel: run a script in a subprocess with simulated CPU devices.

The main pytest process keeps its single CPU device; XLA_FLAGS must be set before jax is
imported, so anything that needs 8 devices runs in a fresh interpreter.
"""
from __future__ import annotations

import os
import socket
import sys

import procs
from testutil import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def device_env(num_devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, os.path.dirname(HERE)]   # + tests/testutil
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    return env


def run_script(script: str, args: list[str], num_devices: int, timeout: float = 600):
    """Runs tests/parallel/<script> with `num_devices` CPU devices; raises with its output on
    failure."""
    proc = procs.run([sys.executable, os.path.join(HERE, script), *args],
                     env=device_env(num_devices), cwd=ROOT, capture_output=True, text=True,
                     timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(workers, timeout: float) -> list[str]:
    """The stdouts of started processes (text pipes), each asserted to exit 0 (its output in
    the message otherwise); any still running at the end is killed."""
    outs = []
    try:
        for p in workers:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"process failed:\n{out[-3000:]}\n{err[-6000:]}"
            outs.append(out)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
    return outs

"""Scoring worker entry point: `python -m brorl_jax.rewards._worker <socket fd>`.

Started by service.ScoringService; protocol over a multiprocessing Connection:
  parent -> worker: sys.path (list), then (specs, options, report_isolation)
  worker -> parent: ("ready", pid, isolation report or None)
  parent -> worker: (key, verifier name, record, completion, time budget s) ... or None (stop)
  worker -> parent: (key, RewardResult) for each item, in order
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

logger = logging.getLogger("brorl_jax.rewards.worker")


def main(fd: int) -> None:
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: they are the trainer's to
    # handle (it stops at a safe point, then stops the workers; a worker whose parent is gone
    # sees EOF on its socket and exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    from brorl_jax.rewards.registry import load_reward_fn
    from brorl_jax.rewards.types import RewardResult

    specs, options, report_isolation = conn.recv()
    fns = {}
    for name, spec in specs.items():
        for module in spec.preload:
            try:
                importlib.import_module(module)
            except ImportError as e:
                logger.warning("reward %r: could not preload %s (%s)", name, module, e)
        fns[name] = load_reward_fn(spec)
    isolation = None
    if report_isolation:
        from brorl_jax.rewards.sandbox import isolation_report
        isolation = isolation_report()
    conn.send(("ready", os.getpid(), isolation))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the service is gone
        if msg is None:
            return
        key, name, record, completion, budget = msg
        try:
            result = fns[name](record, completion, time_budget_s=budget, **options.get(name, {}))
            if not isinstance(result, RewardResult):
                raise TypeError(f"verifier {name!r} returned {type(result).__name__}, "
                                "expected RewardResult")
        except Exception as e:  # noqa: BLE001 - a verifier bug scores 0, the worker lives on
            result = RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}"[:500],
                                  {"verifier": name})
        conn.send((key, result))


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""Scoring worker entry point: `python -m brorl_jax.rewards._worker <socket fd>`.

Started by service.ScoringService; protocol over a multiprocessing Connection:
  parent -> worker: sys.path (list), then (specs, options, report_isolation)
  worker -> parent: ("ready", pid, isolation report or None)
  parent -> worker: (key, verifier name, record, completion, time budget s) ... or None (stop)
  worker -> parent: (key, RewardResult) for each item, in order
  A batched verifier (RewardSpec.batched) gets lists of records and completions in one message
  and answers (key, list of RewardResult). Every verdict's details carry "verifier" and
  "seconds" (the time its call took; a chunk's time is shared equally by its items).

What verifiers print (a user's reward function debugging itself) reaches the trainer's console
through the worker's sys.stdout / sys.stderr, capped at OUTPUT_LIMIT characters per worker (both
streams together); the rest is dropped with one line saying so, as the code sandbox caps a test's
output. Writes below Python (os.write, a C library) are not capped.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

logger = logging.getLogger("brorl_jax.rewards.worker")

OUTPUT_LIMIT = 64 << 10         # characters of printed output a worker passes on


class _Budget:
    left = OUTPUT_LIMIT
    dropped = 0


class _CappedStream(io.TextIOBase):
    """A worker's sys.stdout or sys.stderr: writes reach `target` while the shared budget
    lasts; past it they are dropped, and the first drop says so on `target`."""

    def __init__(self, target, budget: _Budget):
        self.target, self.budget = target, budget

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        b = self.budget
        kept = s[:max(0, b.left)]
        if kept:
            b.left -= len(kept)
            self.target.write(kept)
        if len(kept) < len(s):
            if not b.dropped:
                self.target.write(f"\n[rewards worker {os.getpid()}] what the verifiers print "
                                  f"beyond {OUTPUT_LIMIT} characters is dropped\n")
            b.dropped += len(s) - len(kept)
        self.target.flush()
        return len(s)

    def flush(self) -> None:
        self.target.flush()


def main(fd: int) -> None:
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: they are the trainer's to
    # handle (it stops at a safe point, then stops the workers; a worker whose parent is gone
    # sees EOF on its socket and exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    budget = _Budget()
    sys.stdout = _CappedStream(sys.stdout, budget)
    sys.stderr = _CappedStream(sys.stderr, budget)
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
        start = time.perf_counter()
        if specs[name].batched:
            result = _call_batched(fns[name], name, record, completion, budget,
                                   options.get(name, {}), RewardResult)
            seconds = (time.perf_counter() - start) / max(1, len(result))
            for r in result:
                r.details.setdefault("verifier", name)
                r.details["seconds"] = seconds
        else:
            try:
                result = fns[name](record, completion, time_budget_s=budget,
                                   **options.get(name, {}))
                if not isinstance(result, RewardResult):
                    raise TypeError(f"verifier {name!r} returned {type(result).__name__}, "
                                    "expected RewardResult")
            except Exception as e:  # noqa: BLE001 - a verifier bug scores 0, the worker lives on
                result = RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}"[:500])
            result.details.setdefault("verifier", name)
            result.details["seconds"] = time.perf_counter() - start
        conn.send((key, result))


def _call_batched(fn, name, records, completions, budget, options, result_type) -> list:
    """One call of a batched verifier; a raise or a wrong-length answer fails every item."""
    try:
        results = fn(records, completions, time_budget_s=budget, **options)
        if not isinstance(results, list) or len(results) != len(records) or \
                not all(isinstance(r, result_type) for r in results):
            raise TypeError(f"batched verifier {name!r} must return a list of "
                            f"{len(records)} RewardResult, got {type(results).__name__}"
                            + (f" of length {len(results)}" if isinstance(results, list) else ""))
        return results
    except Exception as e:  # noqa: BLE001 - a verifier bug scores 0, the worker lives on
        reason = f"verifier error: {type(e).__name__}: {e}"[:500]
        return [result_type(0.0, reason) for _ in records]


if __name__ == "__main__":
    main(int(sys.argv[1]))

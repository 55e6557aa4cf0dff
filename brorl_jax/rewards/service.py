"""Scoring service: verifiers run in a pool of worker processes, never in the trainer.

Workers are fresh interpreters (`python -m brorl_jax.rewards._worker`, started with
subprocess: fork+exec, the safe way from a process that holds JAX threads; the trainer itself
is never forked). Unlike multiprocessing's spawn/forkserver, this does not re-import the
trainer's __main__ module (and with it JAX) in every worker. Each worker talks over its own
socket with multiprocessing's Connection (pickled messages), takes several items in flight so
the latency hides behind work, and scores them one at a time in its main thread.

Guarantees of score_batch(records, completions):
  * per-item timeout: an item whose verifier runs longer than its timeout is abandoned, its
    worker is killed (SIGKILL) and replaced; the item scores 0 with reason "timeout ...".
  * a worker that dies (segfault, OOM kill, os._exit) is replaced; the item it was scoring
    scores 0 with reason "worker died ..."; the items queued behind it go to other workers.
  * per-batch deadline: when it passes, every unfinished item scores 0 ("batch deadline
    exceeded") and the call returns.
  * one slow item never blocks the others: the rest of the batch keeps flowing to the other
    workers.
  * recycling: a worker that has scored recycle_after items is retired after its in-flight
    items and replaced, so memory does not creep.
  * a verifier that raises gives 0 with reason "verifier error: ..."; the worker lives on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from brorl_jax.rewards.registry import REWARDS, resolve_reward_name
from brorl_jax.rewards.types import RewardResult

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 180.0
_MAX_START_FAILURES = 3


class _WorkerProcess:
    """A worker interpreter: Popen handle plus the parent's end of its socket."""

    def __init__(self, init_message: tuple):
        parent_sock, child_sock = socket.socketpair()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "brorl_jax.rewards._worker", str(child_sock.fileno())],
                pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            child_sock.close()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        self.pid = self.popen.pid
        self.conn.send(list(sys.path))  # so verifiers registered from any module unpickle
        self.conn.send(init_message)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


@dataclasses.dataclass
class _Worker:
    proc: _WorkerProcess
    conn: Any
    started: float
    ready: bool = False
    inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
    head_started: float = 0.0     # when the worker began the item at the head of inflight
    done: int = 0
    draining: bool = False        # recycled: no new items, retire when inflight is empty


class ScoringService:
    """A pool of scoring workers (see the module docstring for the guarantees).

    Args:
      num_workers: worker processes (default: the CPUs this process may use).
      timeout_s: per-item timeout in seconds (also passed to verifiers as time_budget_s).
      batch_deadline_s: wall-clock limit for one score_batch call (None: no limit).
      recycle_after: items a worker scores before it is replaced.
      reward_map: data_source (or its family before "/") -> verifier name.
      reward_options: verifier name -> keyword options, e.g. {"code": {"timeout_per_test_s": 5}}.
      timeout_overrides: verifier name -> per-item timeout replacing timeout_s.
      rewards: the verifiers this service loads (default: every registered one); fewer means
        faster worker start (each worker imports what its verifiers need).
      max_inflight_per_worker: items queued on one worker's pipe at once.
    """

    def __init__(self, num_workers: int | None = None, timeout_s: float = 10.0,
                 batch_deadline_s: float | None = None, recycle_after: int = 1000, *,
                 reward_map: Mapping[str, str] | None = None,
                 reward_options: Mapping[str, Mapping[str, Any]] | None = None,
                 timeout_overrides: Mapping[str, float] | None = None,
                 rewards: Sequence[str] | None = None, max_inflight_per_worker: int = 4):
        if num_workers is None:
            num_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if batch_deadline_s is not None and not batch_deadline_s > 0:
            raise ValueError(f"batch_deadline_s must be > 0 or None, got {batch_deadline_s}")
        if recycle_after < 1:
            raise ValueError(f"recycle_after must be >= 1, got {recycle_after}")
        if max_inflight_per_worker < 1:
            raise ValueError("max_inflight_per_worker must be >= 1")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.batch_deadline_s = batch_deadline_s
        self.recycle_after = recycle_after
        self.reward_map = dict(reward_map or {})
        self.timeout_overrides = {k: float(v) for k, v in (timeout_overrides or {}).items()}
        self.max_inflight = max_inflight_per_worker
        if rewards is None:
            self._specs = dict(REWARDS)
        else:
            unknown = [r for r in rewards if r not in REWARDS]
            if unknown:
                raise ValueError(f"rewards {unknown} are not registered "
                                 f"(registered: {sorted(REWARDS)})")
            self._specs = {r: REWARDS[r] for r in rewards}
        for name in list(self.reward_map.values()) + list(reward_options or {}) \
                + list(self.timeout_overrides):
            if name not in self._specs:
                raise ValueError(f"unknown verifier {name!r} in the service config "
                                 f"(registered: {sorted(self._specs)})")
        self._options = {k: dict(v) for k, v in (reward_options or {}).items()}
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._batch_id = 0
        self._closed = False
        self._lock = threading.Lock()
        self.isolation: dict | None = None
        self.stats = collections.Counter()
        for _ in range(num_workers):
            self._start_worker()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    # ----- worker management -------------------------------------------------------------

    def _start_worker(self) -> None:
        proc = _WorkerProcess((self._specs, self._options, "code" in self._specs))
        self._workers.append(_Worker(proc, proc.conn, time.monotonic()))
        self.stats["workers_started"] += 1

    def _retire(self, w: _Worker, graceful: bool) -> None:
        if graceful:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(timeout=2.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        w.conn.close()
        self._workers.remove(w)

    @property
    def verifiers(self) -> list[str]:
        """The verifiers this service's workers load (the `rewards` it was built with)."""
        return sorted(self._specs)

    def worker_pids(self) -> list[int]:
        """pids of the current workers (for monitoring and tests)."""
        return [w.proc.pid for w in self._workers]

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._start_worker()

    def _on_ready(self, w: _Worker, msg) -> None:
        _, _, isolation = msg
        w.ready = True
        self._start_failures = 0
        if isolation is not None and self.isolation is None:
            self.isolation = isolation
            logger.info("scoring service: code sandbox isolation in force: %s", isolation)

    def _check_startup(self, w: _Worker, now: float) -> bool:
        """Handles a worker that died or hung before becoming ready; True if it was retired."""
        if w.ready:
            return False
        dead = not w.proc.is_alive()
        if dead or now - w.started > _STARTUP_TIMEOUT_S:
            code = w.proc.exitcode
            self._retire(w, graceful=False)
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                raise RuntimeError(f"scoring workers fail to start (last exit code {code}); "
                                   "check that the verifiers import in a fresh process")
            return True
        return False

    # ----- scoring -----------------------------------------------------------------------

    def score_batch(self, records: Sequence[Mapping[str, Any]],
                    completions: Sequence[str]) -> list[RewardResult]:
        """Scores completions[i] against records[i] (e.g. N prompts x G rollouts, flattened)."""
        if self._closed:
            raise RuntimeError("ScoringService is closed")
        if len(records) != len(completions):
            raise ValueError(f"records ({len(records)}) and completions ({len(completions)}) "
                             "must have the same length")
        names = []
        for i, (rec, comp) in enumerate(zip(records, completions)):
            if not isinstance(rec, Mapping):
                raise ValueError(f"records[{i}] must be a dict, got {type(rec).__name__}")
            if not isinstance(comp, str):
                raise ValueError(f"completions[{i}] must be a str, got {type(comp).__name__}")
            names.append(resolve_reward_name(rec.get("data_source"), self.reward_map,
                                             self._specs))
        with self._lock:
            return self._score(records, completions, names)

    def _units(self, names: list[str]) -> list[list[int]]:
        """Items grouped into what one worker message carries: one item, or for a batched
        verifier a chunk of up to its batch_size items."""
        units, chunks = [], {}
        for i, name in enumerate(names):
            spec = self._specs[name]
            if not spec.batched:
                units.append([i])
                continue
            chunk = chunks.get(name)
            if chunk is None or len(chunk) >= spec.batch_size:
                chunk = chunks[name] = []
                units.append(chunk)
            chunk.append(i)
        return units

    def _score(self, records, completions, names) -> list[RewardResult]:
        self._batch_id += 1
        call = _Call(self, self._batch_id, records, completions, names)
        deadline = (None if self.batch_deadline_s is None
                    else time.monotonic() + self.batch_deadline_s)
        while call.remaining:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._expire(call)
                break
            self._ensure_workers()
            for w in list(self._workers):
                if self._check_startup(w, now) or not w.ready or w.draining:
                    continue
                call.dispatch(w)
            ready = self._wait(call, deadline)
            for w in list(self._workers):
                self._tend(call, w, w.conn in ready)
        self._ensure_workers()
        return call.results  # type: ignore[return-value]

    def _expire(self, call: _Call) -> None:
        """The batch deadline passed: every unfinished item scores 0 and its worker goes."""
        for w in [w for w in self._workers if w.inflight]:
            w.inflight.clear()
            self._retire(w, graceful=False)
        for k in range(len(call.units)):
            if any(call.results[i] is None for i in call.units[k]):
                call.finish(k, RewardResult(0.0, "batch deadline exceeded",
                                            {"verifier": call.name[k]}))
        self.stats["batch_deadline_hits"] += 1

    def _wait(self, call: _Call, deadline: float | None) -> set:
        """Sleeps until a message, a death, the earliest item timeout or the deadline; the
        connections that have something to read."""
        wake = [deadline] if deadline is not None else []
        wake += [w.head_started + call.timeouts[w.inflight[0]] for w in self._workers
                 if w.inflight]
        wake += [w.started + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        wait_s = max(0.0, min(wake) - time.monotonic()) if wake else 1.0
        # A worker's death closes its socket, which wakes this wait (EOF).
        objs = [w.conn for w in self._workers]
        return set(multiprocessing.connection.wait(objs, timeout=min(wait_s, 1.0)))

    def _tend(self, call: _Call, w: _Worker, readable: bool) -> None:
        """One worker after a wait: its results, its death, its item's timeout, its recycling."""
        if readable and call.receive(w):                # EOF: let the exit status arrive
            w.proc.join(timeout=2.0)
            w.proc.kill()
            w.proc.join(timeout=5.0)
        if not w.proc.is_alive():
            if w.ready or w.inflight:
                code = w.proc.exitcode
                how = (f"signal {-code}" if code is not None and code < 0
                       else f"exit code {code}")
                self.stats["worker_deaths"] += 1
                call.fail_worker(w, f"worker died ({how})")
            else:
                self._check_startup(w, time.monotonic())
            return
        if w.inflight:
            limit = call.timeouts[w.inflight[0]]
            if time.monotonic() - w.head_started > limit:
                self.stats["item_timeouts"] += 1
                call.fail_worker(w, f"timeout after {limit:g}s")
                return
        if w.done >= self.recycle_after:
            w.draining = True
            if not w.inflight:
                self.stats["workers_recycled"] += 1
                self._retire(w, graceful=True)

    def close(self) -> None:
        """Stops every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ScoringService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Call:
    """One score_batch call's books: its units of work (an item, or a chunk of a batched
    verifier's items), their results, the units waiting to be sent and the chunks of each
    batched verifier being scored."""

    def __init__(self, service: ScoringService, batch_id: int, records, completions, names):
        self.service, self.batch = service, batch_id
        self.records, self.completions = records, completions
        self.results: list[RewardResult | None] = [None] * len(records)
        self.remaining = len(records)
        self.units = service._units(names)
        self.name = [names[u[0]] for u in self.units]            # each unit's verifier
        specs = service._specs
        self.batched = [specs[nm].batched for nm in self.name]
        self.timeouts = [specs[nm].batch_timeout_s if b
                         else service.timeout_overrides.get(nm, service.timeout_s)
                         for nm, b in zip(self.name, self.batched)]
        self.pending = collections.deque(range(len(self.units)))
        self.chunks_inflight = collections.Counter()   # batched verifier -> chunks being scored

    def finish(self, k: int, res) -> None:
        for j, i in enumerate(self.units[k]):
            if self.results[i] is None:
                one = res[j] if isinstance(res, list) else res
                if isinstance(res, list) or j == 0:
                    self.results[i] = one
                else:   # a failure blamed on a whole chunk: each item gets its own copy
                    self.results[i] = RewardResult(0.0, one.reason, dict(one.details))
                self.remaining -= 1
        if self.batched[k]:
            self.chunks_inflight[self.name[k]] -= 1

    def failure(self, k: int, reason: str, seconds: float | None = None) -> RewardResult:
        details = {"verifier": self.name[k]}
        if seconds is not None:
            details["seconds"] = seconds / len(self.units[k])
        return RewardResult(0.0, reason + (" (batch)" if self.batched[k] else ""), details)

    def fail_worker(self, w: _Worker, reason: str) -> None:
        """Blames the unit being scored; sends the ones queued behind it elsewhere."""
        if w.inflight:
            head = w.inflight.popleft()
            self.finish(head, self.failure(head, reason, time.monotonic() - w.head_started))
            for k in w.inflight:
                if self.batched[k]:
                    self.chunks_inflight[self.name[k]] -= 1
            self.pending.extendleft(reversed(w.inflight))
            w.inflight.clear()
        self.service._retire(w, graceful=False)

    def dispatch(self, w: _Worker) -> None:
        """Sends pending units to a ready worker, up to its in-flight limit."""
        held = []   # chunks of a batched verifier already at its concurrency limit
        while self.pending and len(w.inflight) < self.service.max_inflight:
            k = self.pending.popleft()
            name, unit = self.name[k], self.units[k]
            if self.batched[k]:
                if self.chunks_inflight[name] >= self.service._specs[name].concurrency:
                    held.append(k)
                    continue
                payload = ([self.records[i] for i in unit], [self.completions[i] for i in unit])
            else:
                payload = (self.records[unit[0]], self.completions[unit[0]])
            if not w.inflight:
                w.head_started = time.monotonic()
            try:
                w.conn.send(((self.batch, k), name, *payload, self.timeouts[k]))
            except (OSError, ValueError):
                self.pending.appendleft(k)
                break
            w.inflight.append(k)
            if self.batched[k]:
                self.chunks_inflight[name] += 1
        self.pending.extendleft(reversed(held))

    def receive(self, w: _Worker) -> bool:
        """Reads what a worker sent; True when its socket is closed (the worker died)."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    self.service._on_ready(w, msg)
                    continue
                (b, k), res = msg
                if b != self.batch or not w.inflight or w.inflight[0] != k:
                    continue  # stale (cannot happen with in-order workers)
                w.inflight.popleft()
                w.head_started = time.monotonic()
                w.done += len(self.units[k])
                self.finish(k, res)
        except (EOFError, OSError):
            return True
        return False


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    end = time.monotonic() + 2.0
    for w in workers:
        w.proc.join(timeout=max(0.0, end - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        w.conn.close()
    workers.clear()


class ScoringError(RuntimeError):
    """Raised by score(..., raise_on_error=True) when a verifier could not judge some records.

    failures: [(index, data_source, reason)]; results: every record's RewardResult."""

    def __init__(self, message: str, failures: list[tuple[int, str, str]],
                 results: list[RewardResult]):
        super().__init__(message)
        self.failures = failures
        self.results = results


def score_results(records: Sequence[Mapping[str, Any]], completions: Sequence[str],
                  timeout_s: float | None = None, *, service: ScoringService | None = None,
                  **service_kwargs: Any) -> list[RewardResult]:
    """Scores a batch and returns every verdict: score, reason ("correct", "wrong answer",
    "no answer extracted", "verifier error: ValueError: math record is missing
    'ground_truth' ...", "timeout after 10s", ...) and details. Arguments as score()."""
    if len(records) != len(completions):
        raise ValueError(f"records ({len(records)}) and completions ({len(completions)}) "
                         "must have the same length")
    if not records:
        return []
    if service is not None:
        return service.score_batch(records, completions)
    service_kwargs.setdefault("num_workers", max(1, min(len(records), len(
        os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)))
    with ScoringService(timeout_s=10.0 if timeout_s is None else timeout_s,
                        **service_kwargs) as service:
        return service.score_batch(records, completions)


def score(records: Sequence[Mapping[str, Any]], completions: Sequence[str],
          timeout_s: float | None = None, *, service: ScoringService | None = None,
          raise_on_error: bool = False, **service_kwargs: Any) -> list[float]:
    """Scores a batch and returns the scores only (the public one-call surface).

    With `service` (e.g. a long-lived pool the caller owns) it scores there; otherwise it starts
    a temporary service for this call (`service_kwargs` are its settings).

    A record the verifier could not judge (it raised, e.g. on a record without a ground truth;
    it timed out; its worker died: rewards/health.py's failure kinds) scores 0, and is never
    hidden: the records and reasons, counted per data source by the health check, go to this
    module's logger as a warning, or with raise_on_error=True raise ScoringError (its
    .failures lists (index, data_source, reason), its .results every verdict). For every
    record's reason use score_results().
    """
    from brorl_jax.rewards.health import FAILURE_KINDS, VerifierHealth, reason_kind

    results = score_results(records, completions, timeout_s, service=service, **service_kwargs)
    failures = [(i, str(rec.get("data_source")), res.reason)
                for i, (rec, res) in enumerate(zip(records, results))
                if reason_kind(res.reason) in FAILURE_KINDS]
    if failures:
        health = VerifierHealth()
        health.add(records, results)
        first = ", ".join(f"records[{i}]: {reason}" for i, _, reason in failures[:3])
        message = (f"rewards.score: {len(failures)} of {len(records)} records could not be "
                   f"judged and scored 0 ({'; '.join(health.failures())}); {first}"
                   + (" ..." if len(failures) > 3 else ""))
        if raise_on_error:
            raise ScoringError(message, failures, results)
        logger.warning("%s", message)
    return [r.score for r in results]

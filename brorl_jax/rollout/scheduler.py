"""The host side of one rollout call (:class:`Scheduler`): continuous batching over the engine's
device programs (``programs.py``), with the call's counters typed (:class:`CallCounters`) and its
progress (:class:`Progress`) for statistics of a stream spanning RL steps.

Nothing outside ``rollout/`` uses a Scheduler: a consumer holds a :class:`~.stream.RolloutStream`
(or an open stream's handle, :class:`~.stream.OpenStream`)."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from brorl_jax.rollout import programs
from brorl_jax.rollout.plan import PREFILL_SCORE_BYTES, SlotPlan, slot_buckets
from brorl_jax.rollout.types import GroupResult, group_result, validate_inputs, with_routing


@dataclasses.dataclass
class CallCounters:
    """The host counters of one call. slot_steps: decode steps x slots (the decode's forward rows,
    over devices); round_trips: decode calls waited for; admissions: prefill calls. Seconds:
    init (allocation), prefill, decode (launch to summary on the host). Who waited for whom
    (docs/rollout.md "Waits"): host_wait = the host blocked on the device (a decode call's
    summary, a prefill); device_idle = from the end of one device call to the launch of the
    next, the end timed by a waiter thread (so a consumer that holds the stream, e.g. scoring a
    group, is seen), never across a pause (Scheduler.resume)."""
    slot_steps: int = 0
    compactions: int = 0
    round_trips: int = 0
    admissions: int = 0
    init_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    host_wait: float = 0.0
    device_idle: float = 0.0


@dataclasses.dataclass(frozen=True)
class Progress:
    """Cumulative counters of a call up to its launched decode call: decode steps, live
    slot-steps, slot-steps, refills, compactions, delivered tokens and the two waits (seconds).
    The difference of two (``later - earlier``) is what a stream did in between (an RL step)."""
    decode_steps: int = 0
    live_slot_steps: int = 0
    slot_steps: int = 0
    refills: int = 0
    compactions: int = 0
    useful_tokens: int = 0
    host_wait: float = 0.0
    device_idle: float = 0.0

    def __sub__(self, other: "Progress") -> "Progress":
        return Progress(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                           for f in dataclasses.fields(self)})

    @property
    def occupancy(self) -> float:
        """Live slots over slots, averaged over the decode steps (0 with none)."""
        return self.live_slot_steps / self.slot_steps if self.slot_steps else 0.0


class _Waiter:
    """A daemon thread that waits for each decode call's summary in turn and notes when it was
    ready (Scheduler's device-idle clock): the host may be elsewhere when a call ends. ``floor``:
    ends are never counted before it (Scheduler.resume)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._ended: queue.Queue = queue.Queue()
        self.floor = 0.0
        self._thread = threading.Thread(target=self._run, name="rollout-waiter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                jax.block_until_ready(item)
            except Exception:  # noqa: BLE001 - the host's own wait reports a failed call
                pass
            self._ended.put(time.perf_counter())

    def watch(self, summary: Any) -> None:
        self._queue.put(summary)

    def ended(self) -> float | None:
        """When the oldest watched call was ready (its summary was just fetched by the host)."""
        try:
            return self._ended.get(timeout=5.0)
        except queue.Empty:       # never expected: the summary is on the host already
            return None

    def stop(self) -> None:
        self._queue.put(None)


# What Scheduler.run yields at each return to the host of an open stream (never a group).
HOST_RETURN = object()


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def admission_rows(cfg, spec: programs.Spec) -> int:
    """Prompts per admission call: the pool (rounded to a power of two), bounded by the
    prefill's [Ga, H, P, P] attention-score bytes (a power of two)."""
    per_prompt = 4 * cfg.num_attention_heads * spec.prompt_len ** 2
    rows = max(1, min(_pow2_at_least(spec.pool), PREFILL_SCORE_BYTES // max(per_prompt, 1)))
    return 1 << (rows.bit_length() - 1)


class Scheduler:
    """The host side of one rollout call: continuous batching over the engine's device programs.

    :meth:`Engine.stream` builds one per call. It holds the device state (prompt pool, slots, KV
    pages, device counters: ``programs.init_*``), which prompt each pool entry holds, and the
    call's host counters (:class:`CallCounters`). :meth:`run` is the loop; each of its steps is a
    method:

      start()      allocate the device state
      admit()      prefill the next prompts into free pool entries (two admission sizes at most)
      decode()     launch the decode loop, which runs on the device until a prompt's group is
                   complete or the tail fits a smaller slot bucket (not waited for)
      wait()       that call's summary on the host (steps, live/pending samples, complete entries)
      collect()    fetch the complete groups, free their pool entries, admit the next prompts
      compact()    once nothing is left to admit: move the live samples into the smallest slot
                   bucket that holds them, so the tail's compute follows the live samples
      hand_out()   the fetched groups as GroupResults (run() does it while the next decode runs)
    and ``call_stats(scheduler)`` the call's statistics (docs/rollout.md; final once run() ended).
    """

    def __init__(self, engine: Any, params: Any, prompts: Sequence[Sequence[int]],
                 spec: programs.Spec, plan: SlotPlan, stop: Any, seed_key: np.ndarray,
                 *, open_feed: bool = False):
        self.engine, self.params, self.prompts = engine, params, list(prompts)
        self.spec, self.plan, self.stop, self.seed_key = spec, plan, stop, seed_key
        # An open feed (Engine.open_stream): more prompts may come (feed()), so the loop never
        # treats the call as drained (no "final" tail shrink, no compaction) until close_feed().
        self.open = bool(open_feed)
        self.marks_returns = bool(open_feed)   # yield HOST_RETURN at each return to the host
        self.version = 0                       # the caller's label of the current weights
        self.admitted_version: dict = {}       # prompt -> version its prefill (and token 0) ran
        self.swaps: dict = {}                  # prompt -> [(version, first new token [N])]
        self.num_slots = plan.slots            # the current slot bucket (per device)
        self.entry_prompt = [-1] * spec.pool   # the prompt each pool entry holds (-1: free)
        self.next_prompt = 0                   # prompts admitted so far
        self.ready: list = []                  # fetched, not handed out: (prompt, arrays, step)
        self.delivered = 0                     # groups handed out
        self.useful_tokens = 0                 # their generated tokens
        self.steps = 0                         # decode steps run so far (device counter)
        self.decode_calls: list = []           # (slots, steps, seconds) of each decode call
        self.counters = CallCounters()
        self._idle_since: float | None = None      # when the device last went idle
        self._waiter: _Waiter | None = None
        self.pool = self.slots = self.kv = self.device_stats = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.admit_rows = admission_rows(engine.cfg, spec)     # prompts per admission call

    @property
    def num_prompts(self) -> int:
        """Prompts given so far (all of them unless the feed is open)."""
        return len(self.prompts)

    @property
    def all_fetched(self) -> bool:
        """Every prompt's group is complete and fetched (handed out or ready to be), and no more
        prompts can come."""
        return not self.open and self.delivered + len(self.ready) >= self.num_prompts

    @property
    def in_flight(self) -> int:
        """Prompts given whose group is not handed out yet (admitted or waiting for an entry)."""
        return self.num_prompts - self.delivered

    # -- an open feed (Engine.open_stream): the consumer adds prompts and swaps weights ----------
    def feed(self, prompts: Sequence[Sequence[int]]) -> range:
        """More prompts for an open stream; -> their prompt indices (GroupResult.prompt_index).
        They are admitted at the next return to the host that finds a free pool entry."""
        if not self.open:
            raise RuntimeError("feed() needs an open stream (Engine.open_stream) not yet closed")
        sp = self.spec
        prompts = validate_inputs(self.engine.cfg, prompts, sp.n,
                                  sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k)
        for pr in prompts:
            if len(pr) > sp.prompt_len:
                raise ValueError(f"a fed prompt has {len(pr)} tokens; this open stream takes at "
                                 f"most {sp.prompt_len} (its prompt_len)")
        first = self.num_prompts
        self.prompts.extend(prompts)
        return range(first, self.num_prompts)

    def close_feed(self) -> None:
        """No more prompts: the stream ends once every group given is handed out."""
        self.open = False

    def swap_params(self, params: Any, version: int | None = None) -> None:
        """Decode (and prefill) with ``params`` from the next device call on; ``version``
        labels them (default: one more). Samples in flight keep their tokens and KV so far:
        each token's recorded log-prob is that of the weights (and cache) it was sampled with.
        ``admitted_version[g]``: the version prompt g was admitted (prefilled, its samples'
        first tokens drawn) under, the oldest of its tokens."""
        version = self.version + 1 if version is None else int(version)
        # every admitted prompt not handed out: from which token on the new weights sample it
        busy = [(e, g) for e, g in enumerate(self.entry_prompt) if g >= 0]
        if self.slots is not None and busy:     # waits for the decode call in flight
            for g, first in swap_starts(self.slots, self.pool, busy, self.spec,
                                        self.engine.num_devices):
                self.swaps.setdefault(g, []).append((version, first))
        self.params = params
        self.version = version

    def progress(self) -> Progress:
        """:class:`Progress` up to the launched decode call (it is waited for), for per-step
        statistics of a stream spanning RL steps (take differences)."""
        c = self.counters
        if self.device_stats is None:
            return Progress()
        st = jax.device_get(self.device_stats)
        steps = int(st.steps[0])
        pending = (steps - self.steps) * self.num_slots * self.engine.num_devices
        return Progress(decode_steps=steps, live_slot_steps=int(st.live.sum()),
                        slot_steps=c.slot_steps + pending, refills=int(st.refills.sum()),
                        compactions=c.compactions, useful_tokens=self.useful_tokens,
                        host_wait=c.host_wait, device_idle=c.device_idle)

    def _program(self, name: str, *extra):
        return self.engine._program(name, self.spec, *extra)

    def _launch(self) -> None:
        """A device call is about to start: the time since the device went idle counts as
        device idle (time the device waited for the host)."""
        if self._idle_since is not None:
            self.counters.device_idle += max(0.0, time.perf_counter() - self._idle_since)
        self._idle_since = None

    def _blocked(self, since: float) -> None:
        """The host has just waited (from ``since``) for a device call that is now done."""
        now = time.perf_counter()
        self.counters.host_wait += now - since
        self._idle_since = now

    def resume(self) -> None:
        """The consumer takes the stream up again after a pause (an RL step's update ran in
        between): the device's idle time is counted from now, not from the pause."""
        if self._idle_since is not None:
            self._idle_since = max(self._idle_since, time.perf_counter())
        if self._waiter is not None:
            self._waiter.floor = time.perf_counter()

    def start(self) -> None:
        self.started_at = time.perf_counter()
        state = self._program("init", self.num_slots)()[0]
        self.pool, self.slots, self.kv, self.device_stats = state
        jax.block_until_ready(self.kv.pages_k)
        self.counters.init_seconds = time.perf_counter() - self.started_at
        self._idle_since = time.perf_counter()

    def admit(self) -> None:
        spec, k_pool = self.spec, self.spec.pool
        free = [e for e in range(k_pool) if self.entry_prompt[e] < 0]
        while free and self.next_prompt < self.num_prompts:
            take = min(len(free), self.num_prompts - self.next_prompt, self.admit_rows)
            ga = 1 if take == 1 else self.admit_rows     # two admission programs at most
            toks = np.zeros((ga, spec.prompt_len), np.int32)
            lens = np.ones((ga,), np.int32)
            gids = np.full((ga,), -1, np.int32)
            ents = np.full((ga,), k_pool, np.int32)
            for r in range(take):
                g = self.next_prompt + r
                pr = self.prompts[g]
                toks[r, : len(pr)] = pr
                lens[r], gids[r], ents[r] = len(pr), g, free[r]
                self.entry_prompt[free[r]] = g
                self.admitted_version[g] = self.version
            t0 = time.perf_counter()
            self._launch()
            self.pool = self._program("admit", ga)(self.params, toks, lens, ents, gids, self.stop,
                                                   self.seed_key, self.pool)[0]
            jax.block_until_ready(self.pool.gid)
            self._blocked(t0)
            self.counters.prefill_seconds += time.perf_counter() - t0
            self.counters.admissions += 1
            self.next_prompt += take
            free = free[take:]

    def decode(self) -> Any:
        """Launch one decode call (asynchronously); -> its summary, still on the device."""
        self._launch()
        (self.pool, self.slots, self.kv, self.device_stats), summary = self._program("decode")(
            self.params, self.stop, self.seed_key,
            np.bool_(not self.open and self.next_prompt >= self.num_prompts),
            self.pool, self.slots, self.kv, self.device_stats)
        if self._waiter is None:
            self._waiter = _Waiter()
        self._waiter.watch(summary)
        return summary

    def wait(self, summary: Any, launched_at: float) -> tuple[dict, bool]:
        """(the decode call's summary on the host, whether it ran any steps)."""
        t0 = time.perf_counter()
        sm = jax.device_get(summary)
        self._blocked(t0)
        ended = self._waiter.ended() if self._waiter is not None else None
        if ended is not None:        # the call ended before the host asked (it was elsewhere)
            self._idle_since = min(self._idle_since, max(ended, self._waiter.floor))
        seconds = time.perf_counter() - launched_at
        self.counters.decode_seconds += seconds
        steps = int(sm["steps"])
        ran = steps - self.steps
        self.decode_calls.append((self.num_slots, ran, seconds))
        self.counters.round_trips += 1
        self.counters.slot_steps += ran * self.num_slots * self.engine.num_devices
        self.steps = steps
        return sm, ran > 0

    def collect(self, sm: dict) -> bool:
        """Fetch the groups the decode call completed, free their entries, admit more prompts;
        -> whether any group completed."""
        done = [e for e in range(self.spec.pool) if sm["complete"][e]]
        waiting = self.next_prompt < self.num_prompts
        for e in done:
            self.ready.append((self.entry_prompt[e],
                               self._program("fetch")(np.int32(e), self.pool)[0], self.steps))
        if done:
            free = np.zeros((self.spec.pool,), bool)
            free[done] = True
            self.pool = self._program("release")(free, self.pool)[0]
            for e in done:
                self.entry_prompt[e] = -1
            self.admit()
        elif waiting and min(self.entry_prompt) < 0:    # fed since the last return (open feed)
            before = self.next_prompt
            self.admit()
            return self.next_prompt > before
        return bool(done)

    def compact(self, sm: dict) -> bool:
        """Once every prompt is admitted and no sample is pending, move the live samples into the
        smallest slot bucket that holds them; -> whether the slots were compacted."""
        if (self.spec.lockstep or self.open or self.next_prompt < self.num_prompts
                or int(sm["pending"])
                or self.all_fetched):
            return False
        compacted = False
        for smaller in slot_buckets(self.num_slots, min(self.spec.min_slots, self.num_slots))[1:]:
            if int(sm["live"]) > smaller:
                break
            self.slots = self._program("compact", smaller)(self.slots)[0]
            self.num_slots = smaller
            self.counters.compactions += 1
            compacted = True
        return compacted

    def hand_out(self) -> Iterator[GroupResult]:
        """The fetched groups, each trimmed to its N samples, in completion order."""
        ready, self.ready = self.ready, []
        rows = self.engine.num_devices * self.spec.share
        for gid, arrays, step in ready:
            arrays = jax.device_get(arrays)
            tok, logp, lens, fin, *route = (np.asarray(a).reshape((rows,) + a.shape[2:])
                                            [: self.spec.n]
                                            for a in arrays[:5])
            group = group_result(gid, tok, logp, lens, fin, len(self.prompts[gid]), step,
                           time.perf_counter() - self.started_at)
            if route:   # Spec.record_routing: the response's and the prompt's (device 0's copy)
                group = with_routing(group, route[0], arrays[5][0])
            n = self.spec.n
            group = dataclasses.replace(group, versions=(
                (self.admitted_version.pop(gid, 0), np.zeros((n,), np.int32)),
                *self.swaps.pop(gid, ())))
            self.delivered += 1
            self.useful_tokens += int(group.lengths.sum())
            yield group

    def run(self, should_stop: Callable[[], bool]) -> Iterator[GroupResult]:
        """Admit, decode, collect and compact until every group is handed out (or should_stop()
        is true at a return to the host); yields each prompt's group as it is complete."""
        self.start()
        self.admit()
        try:
            while not self.all_fetched and not should_stop():
                t0 = time.perf_counter()
                summary = self.decode()
                yield from self.hand_out()   # the previous return's groups, while this call runs
                sm, ran = self.wait(summary, t0)
                progressed = self.collect(sm) or ran
                progressed = self.compact(sm) or progressed
                if not progressed and self.open and self.in_flight == 0:
                    raise RuntimeError("an open rollout stream was asked for a group with none "
                                       "in flight: feed() prompts or close_feed() first")
                if not progressed:
                    raise RuntimeError(f"rollout scheduler made no progress (a bug): summary={sm}, "
                                       f"slots={self.num_slots}, entries={self.entry_prompt}")
                if self.marks_returns:     # an open stream: RolloutStream.advance stops here
                    yield HOST_RETURN
            yield from self.hand_out()
        finally:
            self.ended_at = time.perf_counter()
            if self._waiter is not None:
                self._waiter.stop()
                self._waiter = None


def swap_starts(slots, pool, busy, spec: programs.Spec, num_devices: int):
    """At a weight swap, per busy pool entry (entry, prompt): (prompt, the index of each of its
    N samples' first token the new weights will sample): live: the token after its current one;
    pending: 1, token 0 was drawn at admission; finished: never, S. Waits for the decode call in
    flight (it runs under the old weights). A sample restarted later for want of pages (a memory
    budget) redraws its tokens from 1 under the weights of then: its record is a bound."""
    sl = jax.device_get({k: getattr(slots, k) for k in ("entry", "sample", "t")})
    pl = jax.device_get({k: getattr(pool, k) for k in ("queue", "qlen", "qnext")})
    share, n, s = spec.share, spec.n, spec.max_new_tokens
    for e, g in busy:
        first = np.full((num_devices * share,), s, np.int32)
        for d in range(num_devices):
            pend = pl["queue"][d, e, pl["qnext"][d, e]:pl["qlen"][d, e]]
            first[d * share + pend] = 1
            live = sl["entry"][d] == e
            first[d * share + sl["sample"][d][live]] = sl["t"][d][live] + 1
        yield g, first[:n]


def call_stats(sch: Scheduler) -> dict:
    """The call's statistics (docs/rollout.md: RolloutResult.stats, RolloutStream.stats), for
    logging and benchmarks; {} before start."""
    if sch.device_stats is None:
        return {}
    final = jax.device_get(sch.device_stats)
    total = (sch.ended_at or time.perf_counter()) - sch.started_at
    plan, d, c = sch.plan, sch.engine.num_devices, sch.counters
    steps = int(final.steps[0])
    live = int(final.live.sum())
    return dict(
        useful_tokens=sch.useful_tokens,
        decode_steps=steps, num_slots=plan.slots * d, slots_per_device=plan.slots,
        pool_size=sch.spec.pool, devices=d, schedule=sch.engine.schedule,
        mean_live_slots=live / max(steps, 1), occupancy=live / max(c.slot_steps, 1),
        decode_forward_rows=c.slot_steps,
        assigned=int(final.assigned.sum()), refills=int(final.refills.sum()),
        page_size=plan.page_size, pages_per_device=plan.num_pages,
        stalls=int(final.stalls.sum()), restarts=int(final.restarts.sum()),
        compactions=c.compactions, round_trips=c.round_trips,
        admissions=c.admissions, prefill_seconds=c.prefill_seconds,
        decode_seconds=c.decode_seconds, init_seconds=c.init_seconds,
        host_seconds=total - c.prefill_seconds - c.decode_seconds - c.init_seconds,
        host_wait_seconds=c.host_wait,
        device_idle_seconds=c.device_idle,
        total_seconds=total, padded_prompt_len=sch.spec.prompt_len,
        padded_num_prompts=sch.num_prompts, memory_bytes_per_device=plan.bytes_per_device,
        decode_calls=list(sch.decode_calls))

"""Large-N rollout engine: continuous batching over decode slots, prompts prefilled once and shared.

BroRL (arXiv 2510.01180, Sec. 4) samples N = 512 continuations per prompt, and RLVR responses are
long-tailed. The engine keeps a fixed number of decode *slots* (sized from the memory budget); a
slot holds one sample's own KV and position. Prompts live in a small *pool*: each is prefilled
once when admitted and its KV is shared by all its slots, and kept only while a sample of it is
pending or live. Inside one compiled ``lax.while_loop`` a slot whose sample stops takes the next
pending sample, of the same prompt while it has one (no prefill), else of the next prompt. The
loop returns to the host only when a prompt's group of N samples is complete (it is handed out and
its entry re-used for the next prompt), or when nothing is left to admit and the live samples fit
the next smaller slot bucket (the tail is compacted, so its compute follows the live samples), so
host round trips number about (prompts + log2(slots)) per call, never one per token.
The device programs (admission, the decode loop, compaction, fetch) are in ``programs.py``; the
host side of one call is a :class:`Scheduler`, whose methods are those steps, and a
:class:`RolloutStream` hands its groups to the consumer (from a thread) as they complete.

``schedule="lockstep"`` keeps the earlier behaviour (a wave of samples decodes until its longest
one stops, then the next wave starts) for comparison and as a test reference.

Randomness: sample ``n`` of prompt ``g`` draws its step-t uniform from
``fold_in(fold_in(PRNGKey(seed), g * N + n), t)``, so results do not depend on the slot count,
the budget, the schedule, the device or the order.

Log-probs: ``logprobs[g, n, t] = log_softmax(logits / T)[token]`` over the full vocabulary,
i.e. the temperature-scaled distribution *before* top-k/top-p filtering (what the trainer
recomputes for the truncated importance-sampling ratio, BroRL Sec. 3.1); greedy (T = 0) reports
``log_softmax(logits)``.

Under a mesh every program runs inside ``shard_map`` over all mesh devices (Pallas kernels are not
auto-partitioned): each device decodes its share (``ceil(N / devices)``) of every prompt's samples
in its own slots, with its own copy of the prompt pool; the loop's stop tests are combined over
devices (psum/pmax), so all devices return to the host together.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from brorl_jax.models import ModelConfig
from brorl_jax.models.transformer import dtype_of
from brorl_jax.rollout import programs
from brorl_jax.rollout.plan import (
    KV_FRACTION,
    PREFILL_SCORE_BYTES,
    SCHEDULES,
    SlotPlan,
    bucket_prompt_length,
    default_check_every,
    default_min_slots,
    pages_for,
    plan_slots,
    pool_size_for,
    resolve_eos_ids,
    slot_buckets,
    stop_table,
    stream_plan,
    validate_inputs,
)
from pallas_kernels.decode_attention import resolve_impl as _resolve_attention_impl
from pallas_kernels.sampling import resolve_impl as _resolve_sampling_impl


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """Rollouts of G prompts x N samples, S = max_new_tokens (numpy arrays).

    tokens int32[G, N, S]: generated ids, ``pad_id`` (0) past ``lengths``.
    logprobs float32[G, N, S]: sampling-time ``log_softmax(logits / T)[token]`` (0 past lengths).
    lengths int32[G, N]: generated tokens per sample, the stop token included.
    finished bool[G, N]: a stop token was generated. truncated bool[G, N]: hit max_new_tokens
    without a stop token (exactly one of finished/truncated is True).
    mask bool[G, N, S]: ``t < lengths``.  prompt_lengths int32[G].
    stats: per call, for logging and benchmarks (see ``Engine`` and docs/rollout.md): useful_tokens,
      decode_steps, num_slots, pool_size, mean_live_slots, occupancy, refills, compactions,
      round_trips, prefill/decode/host/total seconds, decode_forward_rows, decode_calls, ...
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    mask: np.ndarray
    prompt_lengths: np.ndarray
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def rollouts_per_prompt(self) -> int:
        return self.tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The N samples of one prompt, handed out as soon as all of them are done.

    prompt_index: position of the prompt in the call's ``prompts``. tokens/logprobs [N, S],
    lengths/finished/truncated [N], mask [N, S] as in :class:`RolloutResult`.
    decode_step: decode steps run (since the call started) when the group completed.
    seconds: wall time from the start of the call to the group being ready on the host.
    versions: the weights its tokens were sampled with, ((version, first [N]), ...) oldest
    first: token t of sample n came from the last version whose first[n] <= t (the first entry
    is the version it was admitted under, first = 0; an open stream adds one per weight swap
    while the group was in flight: Scheduler.swap_params). ``((0, zeros),)`` in a plain call.
    """

    prompt_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    mask: np.ndarray
    prompt_length: int
    decode_step: int
    seconds: float
    versions: tuple = ()


def _group(prompt_index, tok, logp, lengths, fin, prompt_length, step, seconds) -> GroupResult:
    s = tok.shape[-1]
    mask = np.arange(s) < lengths[:, None]
    fin = fin.astype(bool)
    return GroupResult(prompt_index=int(prompt_index),
                       tokens=np.where(mask, tok, 0).astype(np.int32),
                       logprobs=np.where(mask, logp, 0.0).astype(np.float32),
                       lengths=lengths.astype(np.int32), finished=fin, truncated=~fin, mask=mask,
                       prompt_length=int(prompt_length), decode_step=int(step),
                       seconds=float(seconds))


def assemble(groups: Sequence[GroupResult], stats: dict | None = None) -> RolloutResult:
    """A :class:`RolloutResult` from every prompt's group (any order)."""
    groups = sorted(groups, key=lambda gr: gr.prompt_index)
    stack = lambda name: np.stack([getattr(gr, name) for gr in groups])
    return RolloutResult(tokens=stack("tokens"), logprobs=stack("logprobs"),
                         lengths=stack("lengths"), finished=stack("finished"),
                         truncated=stack("truncated"), mask=stack("mask"),
                         prompt_lengths=np.asarray([gr.prompt_length for gr in groups], np.int32),
                         stats=dict(stats or {}))


class RolloutStream:
    """Iterator over :class:`GroupResult` in completion order, while decoding goes on.

    With ``background=True`` (default of :meth:`Engine.stream`) a thread drives the device loop
    and queues each group as it completes, so the consumer's work per group (decoding text,
    sending it to verifier processes) overlaps decoding instead of pausing it. ``stats`` holds the
    call's statistics (:meth:`Scheduler.stats`) once the device loop has ended (the stream is
    exhausted or closed); ``result()`` consumes what is left and assembles the full
    :class:`RolloutResult`. ``close()`` (or leaving a ``with`` block) stops the device loop at its
    next return to the host. ``wait_seconds``: how long the consumer has waited for groups (in
    ``__next__``); the device never waits for the consumer (the queue is unbounded: at most all of
    the call's groups, which generate() would hold anyway). ``started_at``/``finished_at``:
    ``time.perf_counter()`` at the call and when the device loop ended (None until then), so a
    consumer can tell how long it kept going after decoding ended.

    ``run(should_stop)`` is the device loop as an iterator of groups (``scheduler.run`` unless an
    engine wraps it); the statistics come from ``scheduler`` itself, never through the iterator.
    """

    def __init__(self, scheduler: "Scheduler", run: Callable[[Callable[[], bool]], Iterator],
                 *, background: bool):
        self._scheduler = scheduler
        self._closed = False
        self._ended = False
        self._delivered: list[GroupResult] = []
        self.wait_seconds = 0.0
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None     # when the device loop returned for good
        self.stats: dict = {}
        self._gen = run(lambda: self._closed)
        self._buffer: collections.deque = collections.deque()     # advance()'s groups
        self._queue: queue.Queue | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._drive, name="rollout-stream", daemon=True)
            self._thread.start()

    def _loop_ended(self) -> None:
        self.stats = self._scheduler.stats()
        self.finished_at = time.perf_counter()

    def _drive(self) -> None:
        try:
            for group in self._gen:
                if group is not HOST_RETURN:
                    self._queue.put(("group", group))
            self._loop_ended()
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self.finished_at = time.perf_counter()
            self._queue.put(("error", e))
        self._queue.put(("end", None))

    def _next_item(self):
        if self._buffer:
            return self._buffer.popleft()
        while (got := self._raw())[0] == "return":
            pass
        return got

    def _raw(self):
        """The device loop's next item: ("group", GroupResult), ("return", None) at a return to
        the host (open streams), ("end", None) or ("error", exception)."""
        if self._queue is None:
            try:
                item = next(self._gen)
            except StopIteration:
                self._loop_ended()
                return "end", None
            return ("return", None) if item is HOST_RETURN else ("group", item)
        return self._queue.get()

    def unread(self, group: GroupResult) -> None:
        """Gives back a group ``__next__`` handed out: it comes out again first (a consumer
        that took it early, e.g. while verdicts were pending). Groups given back last first
        come out again in their order."""
        at = next((i for i in range(len(self._delivered) - 1, -1, -1)
                   if self._delivered[i] is group), None)
        if at is None:
            raise ValueError("unread() takes back only a group this stream handed out")
        del self._delivered[at]
        self._buffer.appendleft(("group", group))

    @property
    def buffered(self) -> int:
        """Groups advance() has kept that __next__ has not handed out yet."""
        return sum(1 for kind, _ in self._buffer if kind == "group")

    def advance(self, calls: int | None = None, until: Callable[[], bool] | None = None) -> int:
        """Drives the device loop of a stream without background thread, with no consumer
        taking groups, for ``calls`` more returns to the host (None: no limit) or until
        ``until()`` is true at one; the groups that complete meanwhile are kept, in order, for
        ``__next__``. Stops early when nothing is in flight. It ends at a return to the host,
        before the next device call: a weight swap then applies to the very next call. Used to
        keep decoding while the update runs (docs/rollout.md "Decoding during the update").
        -> the returns to the host it ran."""
        if self._queue is not None:
            raise RuntimeError("advance() drives a stream that runs in the caller's thread "
                               "(Engine.open_stream), not one with a background driver")
        done = 0
        while (not self._ended and (calls is None or done < calls)
               and not (until is not None and until()) and self._scheduler.in_flight > 0):
            kind, item = self._raw()
            if kind == "return":
                done += 1
                continue
            self._buffer.append((kind, item))
            if kind != "group":
                break
        return done

    def __iter__(self) -> "RolloutStream":
        return self

    def __next__(self) -> GroupResult:
        if self._ended:             # the end (or an error) was delivered: nothing more comes
            raise StopIteration
        t0 = time.perf_counter()
        kind, item = self._next_item()
        self.wait_seconds += time.perf_counter() - t0
        if kind in ("error", "end"):
            self._ended = True
            if kind == "error":
                raise item
            raise StopIteration
        self._delivered.append(item)
        return item

    @property
    def scheduler(self) -> "Scheduler":
        """The call's Scheduler (an open stream's feed, weight swap and progress live there)."""
        return self._scheduler

    def close(self) -> None:
        self._closed = True
        if self._queue is not None:
            for _ in self:   # let the driver thread reach its next host return and finish
                pass
        elif not self._ended:
            self._gen.close()
            self._ended = True
            self._loop_ended()

    def __enter__(self) -> "RolloutStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def result(self) -> RolloutResult:
        for _ in self:
            pass
        return assemble(self._delivered, self.stats)


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


class Scheduler:
    """The host side of one rollout call: continuous batching over the engine's device programs.

    :meth:`Engine.stream` builds one per call. It holds the device state (prompt pool, slots, KV
    pages, device counters: ``programs.init_*``), which prompt each pool entry holds, and the
    call's host counters. :meth:`run` is the loop; each of its steps is a method:

      start()      allocate the device state
      admit()      prefill the next prompts into free pool entries (two admission sizes at most)
      decode()     launch the decode loop, which runs on the device until a prompt's group is
                   complete or the tail fits a smaller slot bucket (not waited for)
      wait()       that call's summary on the host (steps, live/pending samples, complete entries)
      collect()    fetch the complete groups, free their pool entries, admit the next prompts
      compact()    once nothing is left to admit: move the live samples into the smallest slot
                   bucket that holds them, so the tail's compute follows the live samples
      hand_out()   the fetched groups as GroupResults (run() does it while the next decode runs)
      stats()      the call's statistics (docs/rollout.md; final once run() has ended)
    """

    def __init__(self, engine: "Engine", params: Any, prompts: Sequence[Sequence[int]],
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
        self.counters = dict(slot_steps=0, compactions=0, round_trips=0, admissions=0)
        self.seconds = dict(init=0.0, prefill=0.0, decode=0.0)
        # Who waited for whom (docs/rollout.md "Waits"): host_wait = the host blocked on the
        # device (a decode call's summary, a prefill); device_idle = from the end of one device
        # call to the launch of the next, the end timed by a waiter thread (so a consumer that
        # holds the stream, e.g. scoring a group, is seen), never across a pause (resume()).
        self.waits = dict(host_wait=0.0, device_idle=0.0)
        self._idle_since: float | None = None      # when the device last went idle
        self._waiter: _Waiter | None = None
        self.pool = self.slots = self.kv = self.device_stats = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        # Prompts per admission call: the pool (rounded to a power of two), bounded by the
        # prefill's [Ga, H, P, P] attention-score bytes.
        per_prompt = 4 * engine.cfg.num_attention_heads * spec.prompt_len ** 2
        rows = max(1, min(_pow2_at_least(spec.pool), PREFILL_SCORE_BYTES // max(per_prompt, 1)))
        self.admit_rows = 1 << (rows.bit_length() - 1)

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
        prompts = validate_inputs(self.engine.cfg, prompts, sp.rollouts_per_prompt,
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
        self._record_swap(version)
        self.params = params
        self.version = version

    def _record_swap(self, version: int) -> None:
        """For every admitted prompt not handed out: the index of each sample's first token the
        new weights will sample (live: the token after its current one; pending: 1, token 0
        was drawn at admission; finished: never, S). Waits for the decode call in flight (it
        runs under the old weights). A sample restarted later for want of pages (a memory
        budget) redraws its tokens from 1 under the weights of then: its record is a bound."""
        busy = [(e, g) for e, g in enumerate(self.entry_prompt) if g >= 0]
        if self.slots is None or not busy:
            return
        sl = jax.device_get({k: getattr(self.slots, k) for k in ("entry", "sample", "t")})
        pool = jax.device_get({k: getattr(self.pool, k) for k in ("queue", "qlen", "qnext")})
        share, n, s = self.spec.share, self.spec.rollouts_per_prompt, self.spec.max_new_tokens
        for e, g in busy:
            first = np.full((self.engine.num_devices * share,), s, np.int32)
            for d in range(self.engine.num_devices):
                pend = pool["queue"][d, e, pool["qnext"][d, e]:pool["qlen"][d, e]]
                first[d * share + pend] = 1
                live = sl["entry"][d] == e
                first[d * share + sl["sample"][d][live]] = sl["t"][d][live] + 1
            self.swaps.setdefault(g, []).append((version, first[:n]))

    def progress(self) -> dict:
        """Cumulative counters up to the launched decode call (it is waited for): decode steps,
        live slot-steps, slot-steps, refills, compactions and delivered tokens, for per-step
        statistics of a stream spanning RL steps (take differences)."""
        if self.device_stats is None:
            return dict(decode_steps=0, live_slot_steps=0, slot_steps=0, refills=0,
                        compactions=0, useful_tokens=0, host_wait=0.0, device_idle=0.0)
        st = jax.device_get(self.device_stats)
        steps = int(st.steps[0])
        pending = (steps - self.steps) * self.num_slots * self.engine.num_devices
        return dict(decode_steps=steps, live_slot_steps=int(st.live.sum()),
                    slot_steps=self.counters["slot_steps"] + pending,
                    refills=int(st.refills.sum()), compactions=self.counters["compactions"],
                    useful_tokens=self.useful_tokens, **self.waits)

    def _program(self, name: str, *extra):
        return self.engine._program(name, self.spec, *extra)

    def _launch(self) -> None:
        """A device call is about to start: the time since the device went idle counts as
        device idle (time the device waited for the host)."""
        if self._idle_since is not None:
            self.waits["device_idle"] += max(0.0, time.perf_counter() - self._idle_since)
        self._idle_since = None

    def _blocked(self, since: float) -> None:
        """The host has just waited (from ``since``) for a device call that is now done."""
        now = time.perf_counter()
        self.waits["host_wait"] += now - since
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
        self.seconds["init"] = time.perf_counter() - self.started_at
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
            self.seconds["prefill"] += time.perf_counter() - t0
            self.counters["admissions"] += 1
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
        self.seconds["decode"] += seconds
        steps = int(sm["steps"])
        ran = steps - self.steps
        self.decode_calls.append((self.num_slots, ran, seconds))
        self.counters["round_trips"] += 1
        self.counters["slot_steps"] += ran * self.num_slots * self.engine.num_devices
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
            self.counters["compactions"] += 1
            compacted = True
        return compacted

    def hand_out(self) -> Iterator[GroupResult]:
        """The fetched groups, each trimmed to its N samples, in completion order."""
        ready, self.ready = self.ready, []
        rows = self.engine.num_devices * self.spec.share
        for gid, arrays, step in ready:
            tok, logp, lens, fin = (np.asarray(a).reshape((rows,) + a.shape[2:])
                                    [: self.spec.rollouts_per_prompt]
                                    for a in jax.device_get(arrays))
            group = _group(gid, tok, logp, lens, fin, len(self.prompts[gid]), step,
                           time.perf_counter() - self.started_at)
            n = self.spec.rollouts_per_prompt
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

    def stats(self) -> dict:
        """The call's statistics (docs/rollout.md), for logging and benchmarks; {} before start."""
        if self.device_stats is None:
            return {}
        final = jax.device_get(self.device_stats)
        total = (self.ended_at or time.perf_counter()) - self.started_at
        plan, d, c, sec = self.plan, self.engine.num_devices, self.counters, self.seconds
        steps = int(final.steps[0])
        live = int(final.live.sum())
        return dict(
            useful_tokens=self.useful_tokens,
            decode_steps=steps, num_slots=plan.slots * d, slots_per_device=plan.slots,
            pool_size=self.spec.pool, devices=d, schedule=self.engine.schedule,
            mean_live_slots=live / max(steps, 1), occupancy=live / max(c["slot_steps"], 1),
            decode_forward_rows=c["slot_steps"],
            assigned=int(final.assigned.sum()), refills=int(final.refills.sum()),
            page_size=plan.page_size, pages_per_device=plan.num_pages,
            stalls=int(final.stalls.sum()), restarts=int(final.restarts.sum()),
            compactions=c["compactions"], round_trips=c["round_trips"],
            admissions=c["admissions"], prefill_seconds=sec["prefill"],
            decode_seconds=sec["decode"], init_seconds=sec["init"],
            host_seconds=total - sec["prefill"] - sec["decode"] - sec["init"],
            host_wait_seconds=self.waits["host_wait"],
            device_idle_seconds=self.waits["device_idle"],
            total_seconds=total, padded_prompt_len=self.spec.prompt_len,
            padded_num_prompts=self.num_prompts, memory_bytes_per_device=plan.bytes_per_device,
            decode_calls=list(self.decode_calls))


class Engine:
    """The rollout's compiled programs for one model config and device layout.

    Hold one for the lifetime of a training run: each distinct shape (prompt bucket, slots,
    pool, sampling settings) is compiled once, on first use, and kept on this object (nothing is
    cached at module level). ``num_compiled()`` counts them.

    Args:
      model_cfg: the model's ``ModelConfig``.
      mesh: a ``jax.sharding.Mesh`` of this process's devices (or an ``AbstractMesh`` to trace and
        lower only); every program runs inside ``shard_map`` over all its axes. None: one device
        (the same programs under plain jit).
      impl: kernels: "auto" (Pallas on GPU/TPU, jnp reference on CPU), "pallas" or "reference";
        or a mapping {"attention": ..., "sampling": ...} to choose per kernel.
      schedule: "continuous" (refill finished slots, compact the tail) or "lockstep".
      min_slots: the smallest slot bucket the tail is compacted to (default
        ``plan.default_min_slots()`` of the platform traced for: 8 on CPU, 32 on GPU/TPU).
      page_size: positions per KV page (default: 128 when tracing for TPU, else 16).
      kv_fraction: with a memory budget, the share of the slots' full length their pages cover
        (``plan.KV_FRACTION``; 1 = never wait for a page).
      check_every: decode steps between two checks of the loop's stop condition (default
        ``plan.default_check_every()`` of the platform traced for; the samples do not depend
        on it).
    """

    def __init__(self, model_cfg: ModelConfig, *, mesh: Any = None, impl: str = "auto",
                 schedule: str = "continuous", min_slots: int | None = None,
                 page_size: int | None = None, kv_fraction: float = KV_FRACTION,
                 check_every: int | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if min_slots is not None and (not isinstance(min_slots, int) or min_slots < 1):
            raise ValueError(f"min_slots must be a positive int, got {min_slots!r}")
        self.cfg = model_cfg
        self.impl = impl
        self._kernel_impls()   # validate now
        self.schedule = schedule
        self._min_slots = min_slots
        self.page_size = page_size
        if not 0 < kv_fraction <= 1:
            raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction!r}")
        self.kv_fraction = kv_fraction
        if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        self._check_every = check_every
        if isinstance(mesh, Mesh) and jax.process_count() > 1:
            local = set(jax.local_devices())
            if not all(d in local for d in mesh.devices.flat):
                raise ValueError("the rollout mesh must hold only this process's devices "
                                 "(jax.local_devices()); each process runs its own rollouts")
        self.mesh = mesh            # None: one device, the programs run without shard_map
        self.axes = () if mesh is None else tuple(mesh.axis_names)
        self.num_devices = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in self.axes]))
        self._programs: dict = {}

    @property
    def min_slots(self) -> int:
        """The smallest slot bucket: as given, else the platform's (resolved when a program is
        built, so it follows the compile target)."""
        return default_min_slots() if self._min_slots is None else self._min_slots

    @property
    def check_every(self) -> int:
        """Decode steps between stop checks: as given, else the platform's."""
        return default_check_every() if self._check_every is None else self._check_every

    # ------------------------------------------------------------------ programs
    def _spec(self, *, prompt_len, max_new_tokens, plan: SlotPlan, rollouts_per_prompt,
              temperature, top_k, top_p) -> programs.Spec:
        return programs.Spec(
            cfg=self.cfg, prompt_len=int(prompt_len), max_new_tokens=int(max_new_tokens),
            page_size=plan.page_size, max_pages=plan.max_pages, num_pages=plan.num_pages,
            pool=plan.pool, share=plan.share,
            rollouts_per_prompt=int(rollouts_per_prompt), temperature=float(temperature),
            top_k=int(top_k), top_p=float(top_p),
            attention_impl=_resolve_attention_impl(
                self._kernel_impls()[0], dtype_of(self.cfg.dtype), plan.page_size,
                in_shard_map=True),     # a mesh's programs run under shard_map
            sampling_impl=_resolve_sampling_impl(self._kernel_impls()[1]),
            lockstep=self.schedule == "lockstep", min_slots=self.min_slots, axes=self.axes,
            check_every=self.check_every)

    def _kernel_impls(self) -> tuple[str, str]:
        """(attention impl, sampling impl) from ``impl`` (resolved when a program is built, so
        "auto" follows the compile target)."""
        impl = self.impl
        if isinstance(impl, str):
            out = (impl, impl)
        elif hasattr(impl, "keys") and set(impl) <= {"attention", "sampling"}:
            out = (impl.get("attention", "auto"), impl.get("sampling", "auto"))
        else:
            raise ValueError(f"impl must be 'auto', 'pallas', 'reference' or a mapping with keys "
                             f"'attention'/'sampling', got {impl!r}")
        _resolve_attention_impl(out[0], in_shard_map=True), _resolve_sampling_impl(out[1])
        return out

    def _smap(self, fn, n_rep: int, n_dev: int, donate: tuple[int, ...] = ()):
        """jit(shard_map(fn)): the first n_rep arguments replicated, the next n_dev per device
        (leading device axis); fn(dev_index, *rep, *per_device) -> (per_device_out, rep_out).
        On one device (no mesh) the same body runs under plain jit (device axis of size 1)."""
        axes = self.axes

        def per_device(*args):
            rep, devs = args[:n_rep], jax.tree.map(lambda x: x[0], args[n_rep:])
            dev = jax.lax.axis_index(axes) if axes else jnp.int32(0)
            d_out, r_out = fn(dev, *rep, *devs)
            return jax.tree.map(lambda x: x[None], d_out), r_out

        if self.mesh is None:
            return jax.jit(per_device, donate_argnums=donate)
        dev = P(axes)
        mapped = jax.shard_map(per_device, mesh=self.mesh,
                               in_specs=(P(),) * n_rep + (dev,) * n_dev, out_specs=(dev, P()),
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=donate)

    def _program(self, name: str, spec: programs.Spec, *extra):
        key = (name, spec, *extra)
        if key in self._programs:
            return self._programs[key]
        if name == "init":
            num_slots, = extra
            fn = self._smap(lambda dev: ((programs.init_pool(spec),
                                          programs.init_slots(spec, num_slots),
                                          programs.init_kv(spec), programs.init_stats()), None),
                            0, 0)
        elif name == "admit":
            fn = self._smap(lambda dev, params, tokens, lengths, entries, gids, stop, seed, pool: (
                programs.admit(params, pool, tokens, lengths, entries, gids, stop, seed,
                               spec=spec, dev=dev), None), 7, 1, donate=(7,))
        elif name == "release":
            fn = self._smap(lambda dev, free, pool: (programs.release(pool, free), None), 1, 1,
                            donate=(1,))
        elif name == "decode":
            def decode(dev, params, stop, seed, final, pool, slots, kv, stats):
                pool, slots, kv, stats, sm = programs.decode(params, pool, slots, kv, stats, stop,
                                                             seed, final, spec=spec, dev=dev)
                return (pool, slots, kv, stats), sm
            fn = self._smap(decode, 4, 4, donate=(4, 5, 6, 7))
        elif name == "compact":
            num_slots, = extra
            fn = self._smap(lambda dev, slots: (programs.compact(slots, num_slots=num_slots), None),
                            0, 1)
        elif name == "fetch":
            fn = self._smap(lambda dev, entry, pool: (programs.fetch(pool, entry), None), 1, 1)
        else:
            raise KeyError(name)
        self._programs[key] = fn
        return fn

    def rollout_params(self, params: Any) -> Any:
        """``params`` in the programs' layout (``programs.rollout_layout``: compute dtype, one
        buffer per layer), converted on device once per call unless already in it (the trainer
        passes ``Runtime.rollout_params``' copy, made once per update)."""
        if programs.in_rollout_layout(params, self.cfg):
            return params
        if getattr(self, "_layout", None) is None:
            self._layout = jax.jit(lambda p: programs.rollout_layout(p, self.cfg))
        if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
            return jax.eval_shape(self._layout, params)
        return self._layout(params)

    def num_compiled(self) -> dict[str, int]:
        """Compiled executables per program kind ("decode", "compact", "admit", ...)."""
        out: dict[str, int] = {}
        for key, fn in self._programs.items():
            out[key[0]] = out.get(key[0], 0) + fn._cache_size()
        return out

    # ------------------------------------------------------------------ planning
    def plan(self, num_prompts: int, prompt_len: int, rollouts_per_prompt: int,
             max_new_tokens: int, memory_budget_bytes: int | None = None) -> SlotPlan:
        """Slots, pages and pool entries per device for a call (see ``plan.plan_slots``)."""
        return plan_slots(self.cfg, num_prompts, prompt_len, rollouts_per_prompt, max_new_tokens,
                          memory_budget_bytes, num_devices=self.num_devices,
                          min_slots=self.min_slots, page_size=self.page_size,
                          kv_fraction=self.kv_fraction)

    def decode_program(self, params: Any, *, prompt_len: int, rollouts_per_prompt: int,
                       max_new_tokens: int, num_prompts: int = 1, slots: int | None = None,
                       memory_budget_bytes: int | None = None, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, sharding: Any = None):
        """(the jitted decode program, its arguments as ShapeDtypeStructs) for a call of these
        shapes, nothing allocated: ``params`` may be ShapeDtypeStructs; ``slots`` overrides the
        budget's slot count (with its pool and ``kv_fraction`` of pages); ``sharding`` is put on
        every argument (e.g. a device of a compile-only topology)."""
        params = self.rollout_params(params)     # as stream() runs it
        plan = self.plan(num_prompts, prompt_len, rollouts_per_prompt, max_new_tokens,
                         memory_budget_bytes)
        if slots is not None:   # that many slots, their pool and kv_fraction of their length
            pages = pages_for(int(slots), max_new_tokens, plan.page_size, self.kv_fraction)
            plan = dataclasses.replace(plan, slots=int(slots), num_pages=pages,
                                       pool=pool_size_for(int(slots), plan.share, num_prompts),
                                       buckets=slot_buckets(int(slots),
                                                            min(self.min_slots, int(slots))))
        spec = self._spec(prompt_len=prompt_len, max_new_tokens=max_new_tokens, plan=plan,
                          rollouts_per_prompt=rollouts_per_prompt, temperature=temperature,
                          top_k=top_k, top_p=top_p)
        d = self.num_devices
        shapes = jax.eval_shape(lambda: (programs.init_pool(spec),
                                         programs.init_slots(spec, plan.slots),
                                         programs.init_kv(spec), programs.init_stats()))
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        state = jax.tree.map(lambda x: sds((d,) + tuple(x.shape), x.dtype), shapes)
        args = (jax.tree.map(lambda x: sds(x.shape, x.dtype), params),
                sds((self.cfg.vocab_size,), jnp.bool_), sds((2,), jnp.uint32),
                sds((), jnp.bool_), *state)
        return self._program("decode", spec), args

    def lower_decode(self, params: Any, *, platform: str | None = None, **call):
        """The decode program (:meth:`decode_program`, same keywords) traced and lowered.
        ``platform`` ("cuda"/"tpu") lowers for that target; wrap the call in
        ``pallas_kernels.compile_target(platform)`` (and for "tpu" build the engine on an
        AbstractMesh of TPU devices) so the kernels trace their compiled form."""
        fn, args = self.decode_program(params, **call)
        return fn.trace(*args).lower(lowering_platforms=(platform,) if platform else None)

    # ------------------------------------------------------------------ calls
    def generate(self, params: Any, prompts: Sequence[Sequence[int]], **kwargs) -> RolloutResult:
        """All groups at once: :meth:`stream` without a thread, assembled."""
        return self.stream(params, prompts, background=False, **kwargs).result()

    def stream(self, params: Any, prompts: Sequence[Sequence[int]], *, rollouts_per_prompt: int,
               max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, eos_ids: Sequence[int] | None = None,
               memory_budget_bytes: int | None = None, background: bool = True) -> RolloutStream:
        """Each prompt's group of N samples as soon as it is complete (a :class:`RolloutStream`).

        Arguments as in :func:`brorl_jax.rollout.generate`; ``eos_ids`` defaults to the config's
        ``eos_token_ids``. Inputs are checked here, before anything runs."""
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError("this engine's mesh is abstract: it can only lower (lower_decode)")
        cfg = self.cfg
        prompts = validate_inputs(cfg, prompts, rollouts_per_prompt, max_new_tokens,
                                  temperature, top_p, top_k)
        eos = tuple(cfg.eos_token_ids) if eos_ids is None else tuple(eos_ids)
        stop = stop_table(cfg, eos)
        if memory_budget_bytes is not None and (
                not isinstance(memory_budget_bytes, (int, np.integer)) or memory_budget_bytes <= 0):
            raise ValueError(f"memory_budget_bytes must be a positive int or None, got "
                             f"{memory_budget_bytes!r}")
        p = bucket_prompt_length(max(len(x) for x in prompts))
        plan = self.plan(len(prompts), p, rollouts_per_prompt, max_new_tokens,
                         memory_budget_bytes)
        spec = self._spec(prompt_len=p, max_new_tokens=max_new_tokens, plan=plan,
                          rollouts_per_prompt=rollouts_per_prompt, temperature=temperature,
                          top_k=top_k, top_p=top_p)
        params = self.rollout_params(params)     # a no-op on Runtime.rollout_params' copy
        if self.mesh is not None:       # replicated on the mesh once per call
            params = jax.device_put(params, NamedSharding(self.mesh, P()))
        scheduler = Scheduler(self, params, prompts, spec, plan, stop,
                              np.asarray(jax.random.PRNGKey(seed)))
        return RolloutStream(scheduler, functools.partial(self._run, scheduler),
                             background=background)

    def open_stream(self, params: Any, *, prompt_len: int, plan_prompts: int,
                    rollouts_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    eos_ids: Sequence[int] | None = None,
                    memory_budget_bytes: int | None = None) -> RolloutStream:
        """A stream with no prompts yet and an open feed (docs/rollout.md "One stream across
        rounds and steps"): ``stream.scheduler.feed(prompts)`` adds prompts of up to
        ``prompt_len`` tokens at any time, ``swap_params`` changes the weights between two host
        returns, ``close_feed`` lets it end. It runs in the caller's thread (no background
        driver): the consumer decides what to feed between the groups it takes, so what is
        admitted when, and under which weights, follows the groups alone (reproducible).
        Leaving the iteration suspended pauses the engine with its slots, pages and prompt pool
        kept (the decode call launched last runs to its end). The slots are planned as for a
        call of ``plan_prompts`` prompts; the pool holds twice the prompts the slots do, +2
        (rollout.plan.stream_plan), so a freed slot finds pending work while prompts are fed,
        even with several prompts held by their last (long) sample."""
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError("this engine's mesh is abstract: it can only lower (lower_decode)")
        cfg = self.cfg
        validate_inputs(cfg, [[0]], rollouts_per_prompt, max_new_tokens, temperature, top_p,
                        top_k)
        if not isinstance(plan_prompts, (int, np.integer)) or plan_prompts < 1:
            raise ValueError(f"plan_prompts must be a positive int, got {plan_prompts!r}")
        eos = tuple(cfg.eos_token_ids) if eos_ids is None else tuple(eos_ids)
        p = bucket_prompt_length(int(prompt_len))
        plan = stream_plan(cfg, self.plan(int(plan_prompts), p, rollouts_per_prompt,
                                          max_new_tokens, memory_budget_bytes),
                           p, max_new_tokens)
        spec = self._spec(prompt_len=p, max_new_tokens=max_new_tokens, plan=plan,
                          rollouts_per_prompt=rollouts_per_prompt, temperature=temperature,
                          top_k=top_k, top_p=top_p)
        params = self.rollout_params(params)
        if self.mesh is not None:
            params = jax.device_put(params, NamedSharding(self.mesh, P()))
        scheduler = Scheduler(self, params, [], spec, plan, stop_table(cfg, eos),
                              np.asarray(jax.random.PRNGKey(seed)), open_feed=True)
        return RolloutStream(scheduler, functools.partial(self._run, scheduler),
                             background=False)

    def _run(self, scheduler: Scheduler, should_stop: Callable[[], bool]) -> Iterator[GroupResult]:
        """The device loop of a stream: ``scheduler.run`` (one place to wrap it, e.g. a test that
        slows the loop down)."""
        return scheduler.run(should_stop)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def _hashable(impl):
    return tuple(sorted(impl.items())) if hasattr(impl, "items") else impl


@functools.lru_cache(maxsize=4)
def _default_engine(cfg: ModelConfig, mesh: Any, impl: Any) -> Engine:
    """generate()'s engine when the caller holds none: a few recent ones are kept (bounded) so
    repeated calls with the same model do not recompile; a training loop holds its own Engine."""
    return Engine(cfg, mesh=mesh, impl=dict(impl) if isinstance(impl, tuple) else impl)


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    rollouts_per_prompt: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    memory_budget_bytes: int | None = None,
    params: dict | None = None,
    impl: str = "auto",
    mesh: Any = None,
) -> RolloutResult:
    """Sample ``rollouts_per_prompt`` continuations of each prompt, prefilling each prompt once.

    Args:
      model: a ``brorl_jax.models.Model`` (``from_pretrained``): its config, params and stop ids.
      prompts: G token-id lists of any (non-zero) lengths.
      rollouts_per_prompt: N samples per prompt. max_new_tokens: S, the response budget.
      temperature: 0 = greedy. top_p in (0, 1], top_k >= 0 (0 = off): HF order, top-k then top-p.
      seed: RNG seed; sample ``g * N + n`` has its own stream, independent of the schedule.
      eos_ids: stop tokens (default: the model's generation config, then its config); any number.
      memory_budget_bytes: bound on the rollout's working memory over all devices (not the
        parameters); it sets the number of decode slots (see ``plan.plan_slots``).
      params: overrides ``model.params`` (the trainer's current policy).
      impl: kernels: "auto" (Pallas on GPU/TPU, jnp reference on CPU), "pallas" or "reference".
      mesh: a ``jax.sharding.Mesh``: each device decodes its share of every prompt's samples
        (same tokens for a seed as without).

    Returns:
      :class:`RolloutResult` with tokens/logprobs [G, N, S], lengths/finished/truncated [G, N].

    Uses a bounded set of recently used engines; a caller that generates repeatedly (a training
    loop) should hold an :class:`Engine` and call its ``generate`` / ``stream``.
    """
    eos = resolve_eos_ids(model, eos_ids)
    engine = _default_engine(model.config, mesh, _hashable(impl))
    return engine.generate(
        model.params if params is None else params, prompts,
        rollouts_per_prompt=rollouts_per_prompt, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, eos_ids=eos,
        memory_budget_bytes=memory_budget_bytes)


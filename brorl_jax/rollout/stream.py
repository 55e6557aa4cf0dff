"""The consumer's side of a rollout call: :class:`RolloutStream` hands each prompt's group out as
it completes (from a background thread, or driven in the caller's thread), and
:class:`OpenStream` is the handle of an open stream (Engine.open_stream): feed prompts, swap the
weights with a version label, read its progress, resume after a pause, count what is in flight.
The call's :class:`~.scheduler.Scheduler` stays inside: nothing outside ``rollout/`` touches it."""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from brorl_jax.rollout.plan import SlotPlan
from brorl_jax.rollout.scheduler import HOST_RETURN, Progress, Scheduler, call_stats
from brorl_jax.rollout.types import GroupResult, RolloutResult, assemble


class RolloutStream:
    """Iterator over :class:`GroupResult` in completion order, while decoding goes on.

    With ``background=True`` (default of :meth:`Engine.stream`) a thread drives the device loop
    and queues each group as it completes, so the consumer's work per group (decoding text,
    sending it to verifier processes) overlaps decoding instead of pausing it. ``stats`` holds the
    call's statistics (``scheduler.call_stats``) once the device loop has ended (the stream is
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

    def __init__(self, scheduler: Scheduler, run: Callable[[Callable[[], bool]], Iterator],
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
        self.stats = call_stats(self._scheduler)
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



class OpenStream(RolloutStream):
    """The handle of an open stream (:meth:`Engine.open_stream`, docs/rollout.md "One stream
    across rounds and steps"): it runs in the caller's thread, prompts are fed at any time and
    the weights swapped between two returns to the host; the stream ends once the feed is closed
    and every group given is handed out."""

    def __init__(self, scheduler: Scheduler, run: Callable[[Callable[[], bool]], Iterator]):
        super().__init__(scheduler, run, background=False)

    def feed(self, prompts: Sequence[Sequence[int]]) -> range:
        """More prompts (each of at most the stream's prompt_len tokens); -> their prompt
        indices (GroupResult.prompt_index). They are admitted at the next return to the host
        that finds a free pool entry."""
        return self._scheduler.feed(prompts)

    def close_feed(self) -> None:
        """No more prompts: the stream ends once every group given is handed out."""
        self._scheduler.close_feed()

    def swap_params(self, params: Any, version: int | None = None) -> None:
        """Decode (and prefill) with ``params`` (in the rollout's layout: Engine.rollout_params)
        from the next device call on; ``version`` labels them (default: one more). Samples in
        flight keep their tokens and KV so far; GroupResult.versions says from which token on
        each sample was drawn by which weights."""
        self._scheduler.swap_params(params, version)

    @property
    def version(self) -> int:
        """The label of the current weights (Engine.open_stream's ``version``, then each swap's)."""
        return self._scheduler.version

    @property
    def in_flight(self) -> int:
        """Fed prompts whose group the consumer has not taken: in the engine, or complete and
        kept (advance(), unread()) for ``__next__``."""
        return self._scheduler.in_flight + self.buffered

    @property
    def plan(self) -> SlotPlan:
        """The layout the stream allocated (rollout.plan.stream_plan): slots, pages, pool."""
        return self._scheduler.plan

    @property
    def pool_size(self) -> int:
        """Prompt-pool entries per device: more prompts in flight only wait for one."""
        return self._scheduler.spec.pool

    def progress(self) -> Progress:
        """Cumulative counters up to the launched decode call (:class:`Progress`; subtract two
        for what the stream did in between)."""
        return self._scheduler.progress()

    def resume(self) -> None:
        """The consumer takes the stream up again after a pause (an RL step's update ran in
        between): the device's idle time is counted from now, not from the pause."""
        self._scheduler.resume()

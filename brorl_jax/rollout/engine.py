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
host side of one call is a ``scheduler.Scheduler``, whose methods are those steps, and a
``stream.RolloutStream`` hands its groups to the consumer (from a thread) as they complete
(``stream.OpenStream``: the handle of an open stream); the result types are in ``types.py``.
This module holds the :class:`Engine` (the compiled programs of one model and device layout,
built from ``PROGRAM_BUILDERS``) and :func:`generate`.

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

import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from brorl_jax.models import ModelConfig
from brorl_jax.models.transformer import dtype_of
from brorl_jax.parallel import expert_parallel as ep
from brorl_jax.rollout import programs
from brorl_jax.rollout.plan import (
    KV_FRACTION,
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
)
from brorl_jax.rollout.routing import check_recordable
from brorl_jax.rollout.scheduler import Scheduler
from brorl_jax.rollout.stream import OpenStream, RolloutStream
from brorl_jax.rollout.types import GroupResult, RolloutResult, validate_inputs
from pallas_kernels.decode_attention import resolve_impl as _resolve_attention_impl
from pallas_kernels.sampling import resolve_impl as _resolve_sampling_impl


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
      record_routing: a mixture-of-experts model: record each token's experts (the results'
        ``routing`` / ``prompt_routing``, rollout/routing.py) for routing replay in the update.
    """

    def __init__(self, model_cfg: ModelConfig, *, mesh: Any = None, impl: str = "auto",
                 schedule: str = "continuous", min_slots: int | None = None,
                 page_size: int | None = None, kv_fraction: float = KV_FRACTION,
                 check_every: int | None = None, record_routing: bool = False):
        if record_routing:
            check_recordable(model_cfg)
        self.record_routing = bool(record_routing)
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
            n=int(rollouts_per_prompt), temperature=float(temperature),
            top_k=int(top_k), top_p=float(top_p),
            attention_impl=_resolve_attention_impl(
                self._kernel_impls()[0], dtype_of(self.cfg.dtype), plan.page_size,
                in_shard_map=True),     # a mesh's programs run under shard_map
            sampling_impl=_resolve_sampling_impl(self._kernel_impls()[1]),
            lockstep=self.schedule == "lockstep", min_slots=self.min_slots, axes=self.axes,
            check_every=self.check_every, record_routing=self.record_routing)

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

    def _smap(self, fn, n_rep: int, n_dev: int, donate: tuple[int, ...] = (),
              params_first: bool = False):
        """jit(shard_map(fn)): the first n_rep arguments replicated, the next n_dev per device
        (leading device axis); fn(dev_index, *rep, *per_device) -> (per_device_out, rep_out).
        With ``params_first`` the first replicated argument is the model's params: under expert
        parallelism (a MoE model on a mesh with an `expert` axis) each device then gets its
        experts only (parallel.expert_parallel.rollout_param_specs) and the MoE blocks exchange
        the tokens. On one device (no mesh) the same body runs under plain jit (device axis of
        size 1)."""
        axes = self.axes

        def per_device(*args):
            rep, devs = args[:n_rep], jax.tree.map(lambda x: x[0], args[n_rep:])
            dev = jax.lax.axis_index(axes) if axes else jnp.int32(0)
            d_out, r_out = fn(dev, *rep, *devs)
            return jax.tree.map(lambda x: x[None], d_out), r_out

        if self.mesh is None:
            return jax.jit(per_device, donate_argnums=donate)
        dev = P(axes)
        split = params_first and ep.rollout_expert_axis(self.mesh, self.cfg.num_experts)

        def mapped(*args):
            rep = [P()] * n_rep
            if split:
                rep[0] = ep.rollout_param_specs(args[0], self.cfg.num_experts)
            return jax.shard_map(per_device, mesh=self.mesh, in_specs=(*rep, *(dev,) * n_dev),
                                 out_specs=(dev, P()), check_vma=False)(*args)
        return jax.jit(mapped, donate_argnums=donate)

    def _program(self, name: str, spec: programs.Spec, *extra):
        """The jitted program ``name`` (a key of PROGRAM_BUILDERS) for ``spec``, built once."""
        key = (name, spec, *extra)
        if key not in self._programs:
            self._programs[key] = PROGRAM_BUILDERS[name](self, spec, *extra)
        return self._programs[key]

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
                          kv_fraction=self.kv_fraction, record_routing=self.record_routing)

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
        self._check_concrete()
        prompts = validate_inputs(self.cfg, prompts, rollouts_per_prompt, max_new_tokens,
                                  temperature, top_p, top_k)
        if memory_budget_bytes is not None and (
                not isinstance(memory_budget_bytes, (int, np.integer)) or memory_budget_bytes <= 0):
            raise ValueError(f"memory_budget_bytes must be a positive int or None, got "
                             f"{memory_budget_bytes!r}")
        p = bucket_prompt_length(max(len(x) for x in prompts))
        plan = self.plan(len(prompts), p, rollouts_per_prompt, max_new_tokens,
                         memory_budget_bytes)
        scheduler = self._start(params, prompts, p, plan, rollouts_per_prompt=rollouts_per_prompt,
                                max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, eos_ids=eos_ids)
        return RolloutStream(scheduler, functools.partial(self._run, scheduler),
                             background=background)

    def open_stream(self, params: Any, *, prompt_len: int, plan_prompts: int,
                    rollouts_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    eos_ids: Sequence[int] | None = None,
                    memory_budget_bytes: int | None = None, version: int = 0) -> OpenStream:
        """A stream with no prompts yet and an open feed (docs/rollout.md "One stream across
        rounds and steps"), as its handle (:class:`OpenStream`): ``feed(prompts)`` adds prompts
        of up to ``prompt_len`` tokens at any time, ``swap_params`` changes the weights between
        two host returns (``version`` labels the first ones), ``close_feed`` lets it end. It
        runs in the caller's thread (no background driver): the consumer decides what to feed
        between the groups it takes, so what is admitted when, and under which weights, follows
        the groups alone (reproducible). Leaving the iteration suspended pauses the engine with
        its slots, pages and prompt pool kept (the decode call launched last runs to its end).
        The slots are planned as for a call of ``plan_prompts`` prompts; the pool holds twice
        the prompts the slots do, +2 (rollout.plan.stream_plan), so a freed slot finds pending
        work while prompts are fed, even with several prompts held by their last (long)
        sample."""
        self._check_concrete()
        validate_inputs(self.cfg, [[0]], rollouts_per_prompt, max_new_tokens, temperature, top_p,
                        top_k)
        if not isinstance(plan_prompts, (int, np.integer)) or plan_prompts < 1:
            raise ValueError(f"plan_prompts must be a positive int, got {plan_prompts!r}")
        p = bucket_prompt_length(int(prompt_len))
        plan = stream_plan(self.cfg, self.plan(int(plan_prompts), p, rollouts_per_prompt,
                                               max_new_tokens, memory_budget_bytes),
                           p, max_new_tokens, self.record_routing)
        scheduler = self._start(params, [], p, plan, rollouts_per_prompt=rollouts_per_prompt,
                                max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, eos_ids=eos_ids,
                                open_feed=True)
        scheduler.version = int(version)
        return OpenStream(scheduler, functools.partial(self._run, scheduler))

    def _check_concrete(self) -> None:
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError("this engine's mesh is abstract: it can only lower (lower_decode)")

    def _start(self, params: Any, prompts: list, prompt_len: int, plan: SlotPlan, *,
               rollouts_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float,
               top_k: int, seed: int, eos_ids: Sequence[int] | None,
               open_feed: bool = False) -> Scheduler:
        """The shared start of a call (stream or open stream): its programs' spec, the weights
        in the rollout's layout (replicated on the mesh once per call), the stop table and the
        seed, in the call's Scheduler."""
        spec = self._spec(prompt_len=prompt_len, max_new_tokens=max_new_tokens, plan=plan,
                          rollouts_per_prompt=rollouts_per_prompt, temperature=temperature,
                          top_k=top_k, top_p=top_p)
        eos = tuple(self.cfg.eos_token_ids) if eos_ids is None else tuple(eos_ids)
        params = self.rollout_params(params)     # a no-op on Runtime.rollout_params' copy
        if self.mesh is not None:
            params = jax.device_put(params, NamedSharding(self.mesh, P()))
        return Scheduler(self, params, prompts, spec, plan, stop_table(self.cfg, eos),
                         np.asarray(jax.random.PRNGKey(seed)), open_feed=open_feed)

    def _run(self, scheduler: Scheduler, should_stop: Callable[[], bool]) -> Iterator[GroupResult]:
        """The device loop of a stream: ``scheduler.run`` (one place to wrap it, e.g. a test that
        slows the loop down)."""
        return scheduler.run(should_stop)


# ----------------------------------------------------------------------------------------------
# The device programs by name: each builder (engine, spec, *shape) -> the jitted program, the
# per-device bodies of programs.py under engine._smap (replicated args first, then per device)
# ----------------------------------------------------------------------------------------------
def _build_init(engine: Engine, spec: programs.Spec, num_slots: int):
    return engine._smap(lambda dev: ((programs.init_pool(spec),
                                      programs.init_slots(spec, num_slots),
                                      programs.init_kv(spec), programs.init_stats()), None), 0, 0)


def _build_admit(engine: Engine, spec: programs.Spec, rows: int):
    del rows    # one program per admission size (the key), traced from the arguments
    return engine._smap(lambda dev, params, tokens, lengths, entries, gids, stop, seed, pool: (
        programs.admit(params, pool, tokens, lengths, entries, gids, stop, seed,
                       spec=spec, dev=dev), None), 7, 1, donate=(7,), params_first=True)


def _build_release(engine: Engine, spec: programs.Spec):
    return engine._smap(lambda dev, free, pool: (programs.release(pool, free), None), 1, 1,
                        donate=(1,))


def _build_decode(engine: Engine, spec: programs.Spec):
    def decode(dev, params, stop, seed, final, pool, slots, kv, stats):
        pool, slots, kv, stats, sm = programs.decode(params, pool, slots, kv, stats, stop,
                                                     seed, final, spec=spec, dev=dev)
        return (pool, slots, kv, stats), sm
    return engine._smap(decode, 4, 4, donate=(4, 5, 6, 7), params_first=True)


def _build_compact(engine: Engine, spec: programs.Spec, num_slots: int):
    return engine._smap(lambda dev, slots: (programs.compact(slots, num_slots=num_slots), None),
                        0, 1)


def _build_fetch(engine: Engine, spec: programs.Spec):
    return engine._smap(lambda dev, entry, pool: (programs.fetch(pool, entry), None), 1, 1)


PROGRAM_BUILDERS: dict[str, Callable[..., Any]] = {
    "init": _build_init, "admit": _build_admit, "release": _build_release,
    "decode": _build_decode, "compact": _build_compact, "fetch": _build_fetch,
}


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

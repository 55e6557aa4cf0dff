"""Shapes, input checks and the memory model of the rollout (host side, no device work).

Sizes are per device: under a mesh every device holds ``share = ceil(N / devices)`` samples of each
prompt, its own decode slots and its own copy of the prompt pool (see engine.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from brorl_jax.models import ModelConfig
from brorl_jax.models.moe import routing_record_bytes
from brorl_jax.models.precision import rollout_weight_bytes
from brorl_jax.models.transformer import dtype_of
from pallas_kernels import _backend
from pallas_kernels.decode_attention import default_page_size

# Attention-score bytes allowed per prefill call ([Ga, H, P, P] f32); more prompts are admitted in
# several calls.
PREFILL_SCORE_BYTES = 256 * 2**20
# The share of a slot's capacity (max_new_tokens) its KV pages cover on average, in a memory
# budget: lengths are long-tailed, so the live KV of a slot averages well below its capacity.
# A sample that finds no free page waits (its RNG is keyed by step index, so nothing changes);
# if every live sample waits, the youngest is restarted (same tokens again).
KV_FRACTION = 0.25
# Smallest slot bucket the tail is compacted to, per platform. On CPU a decode step's cost follows
# its rows down to a few (`python bench/rollout.py --sections long-tail`, its model on the 2-core
# dev CPU: 32 slots 7.2 ms a step, 16 4.2 ms, 8 2.8 ms), so the tail compacts down to 8 slots. On
# GPU and TPU reading the weights dominates a decode step below a few dozen rows (not measured
# here: Qwen2.5-1.5B reads ~3 GB of bf16 weights per step, 32 rows are ~0.1 TFLOP), so smaller
# programs there would only add compiles.
MIN_SLOTS = {"cpu": 8, "gpu": 32, "tpu": 32}
# Slot buckets per halving of the slot count: 2^j x (1, 5/4, 3/2, 7/4). The live batch drains about
# exponentially in the tail, so the occupancy between two compactions averages ~0.9 (the long-tail
# benchmark: 0.91 / 0.97 against 0.79 / 0.87 with two per octave and a floor of 32; continuous /
# uniform rate 0.71-0.76 against 0.53 / 0.61); compiled decode programs grow as
# 4 log2(slots / min_slots).
BUCKET_STEPS = (4, 5, 6, 7)
# Decode steps between two checks of the decode loop's stop condition, per platform. On GPU a
# while_loop whose trip count XLA cannot see copies its predicate to the host and waits on every
# iteration (and under a mesh the condition reduces over all devices): checking every 16 steps
# (an inner loop of known trip count) makes that one host round trip and one cross-device
# reduction per 16 tokens (`python bench/roofline.py`: host syncs per decode step). Steps past a
# stop are harmless (draws are keyed by sample and token index: the same samples) but are
# wasted work at the very end of a call (< 16 steps); on CPU a check costs nothing, so 1.
CHECK_EVERY = {"cpu": 1, "gpu": 16, "tpu": 16}
# First tokens are drawn for at most this many samples per sampling call at admission.
FIRST_TOKEN_ROWS = 256
SCHEDULES = ("continuous", "lockstep")


def bucket_prompt_length(length: int) -> int:
    """Padded prompt length: the next power of two up to 64, then the next multiple of 64.

    Keeps the number of distinct compiled shapes small while wasting < 64 positions on long prompts.
    """
    if length <= 64:
        return max(8, 1 << (length - 1).bit_length())
    return -(-length // 64) * 64


def bucket_num_prompts(num_prompts: int) -> int:
    """Padded prompt batch: the next power of two."""
    return 1 << (num_prompts - 1).bit_length()


def _itemsize(cfg: ModelConfig) -> int:
    return jnp.dtype(dtype_of(cfg.dtype)).itemsize


def kv_bytes(cfg: ModelConfig, num_sequences: int, length: int) -> int:
    """Bytes of a K+V cache for ``num_sequences`` sequences of ``length`` positions, all layers,
    at the config's KV precision (models.precision.kv_bytes_per_element: an fp8 cache stores a
    byte per element and a float32 scale per position and KV head)."""
    positions = 2 * cfg.num_hidden_layers * num_sequences * length * cfg.num_key_value_heads
    if cfg.kv_precision == "fp8":
        return positions * (cfg.head_dim + 4)
    return positions * cfg.head_dim * _itemsize(cfg)


def cache_len(max_new_tokens: int, page_size: int | None = None) -> int:
    """Positions a slot can hold: max_new_tokens rounded up to whole pages."""
    page_size = page_size or default_page_size()
    return -(-max_new_tokens // page_size) * page_size


def page_bytes(cfg: ModelConfig, page_size: int | None = None) -> int:
    """One page of own KV: K and V of ``page_size`` positions, all layers."""
    page_size = page_size or default_page_size()
    return kv_bytes(cfg, 1, page_size)


def slot_bytes(cfg: ModelConfig, max_new_tokens: int, page_size: int | None = None) -> int:
    """Device memory of one decode slot besides its KV pages: its logits row and the sampling
    temporaries (~4 f32 rows of V), activations, attention temporaries, its page-table row."""
    page_size = page_size or default_page_size()
    activations = 4 * (4 * cfg.hidden_size + 3 * cfg.mlp_width
                       + 4 * cfg.num_attention_heads * cfg.head_dim)
    if cfg.is_moe:  # the router's probabilities and the token's rows sorted by expert
        activations += 4 * (cfg.num_experts + cfg.num_experts_per_tok * cfg.hidden_size)
    pages = cache_len(max_new_tokens, page_size) // page_size
    return 4 * 4 * cfg.vocab_size + activations + 4 * pages + 64


def pages_for(slots: int, max_new_tokens: int, page_size: int | None = None,
              kv_fraction: float = KV_FRACTION) -> int:
    """Pages planned for ``slots`` slots: ``kv_fraction`` of their full length (the share of a
    slot's capacity that is live on average), never less than one whole sample nor than one page
    per slot."""
    page_size = page_size or default_page_size()
    full = cache_len(max_new_tokens, page_size) // page_size
    return max(full, slots, math.ceil(slots * full * kv_fraction))


def pool_entry_bytes(cfg: ModelConfig, prompt_len: int, share: int, max_new_tokens: int,
                     record_routing: bool = False) -> int:
    """Device memory of one prompt-pool entry: the prompt's KV and its samples' results
    (tokens and log-probs ``[share, S]``, lengths, flags, queue); recording routing
    (rollout/routing.py), the prompt's and its samples' expert ids too (``route_bytes``)."""
    return (kv_bytes(cfg, 1, prompt_len) + results_bytes(share, max_new_tokens) + 32
            + route_bytes(cfg, prompt_len, record_routing)
            + route_bytes(cfg, share * max_new_tokens, record_routing))


def route_bytes(cfg: ModelConfig, tokens: int, record_routing: bool) -> int:
    """The routing record of ``tokens`` tokens when the engine records it (``Engine(
    record_routing=True)``: prefix_route / res_route, L x K ids a token), else 0."""
    return routing_record_bytes(cfg, tokens) if record_routing else 0


def results_bytes(share: int, max_new_tokens: int) -> int:
    """One prompt's results on a device: tokens and log-probs [share, S], lengths, flags, queue."""
    return share * (8 * max_new_tokens + 16)


def admission_bytes(cfg: ModelConfig, share: int) -> int:
    """Temporaries of admitting a prompt beyond its entry: the last logits and the first-token
    draws (a chunk of broadcast logits rows and the sampling temporaries)."""
    return 4 * cfg.vocab_size * (1 + 4 * min(share, FIRST_TOKEN_ROWS))


def pool_size_for(slots: int, share: int, num_prompts: int) -> int:
    """Prompt-pool entries: the prompts ``slots`` can hold at once, +1 being drained and +1
    prefilled ahead, so a freed slot always finds pending work while prompts remain."""
    return int(min(num_prompts, -(-slots // max(share, 1)) + 2))


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """Per-device decode layout: ``slots`` decode slots, ``pool`` prompt entries, ``share``
    samples of each prompt; own KV in ``num_pages`` pages of ``page_size`` positions (a slot
    holds up to ``max_pages`` of them); the tail is compacted through ``buckets`` (descending
    slot counts)."""
    slots: int
    pool: int
    share: int
    page_size: int
    max_pages: int
    num_pages: int
    buckets: tuple[int, ...]
    bytes_per_device: int

    @property
    def cache_len(self) -> int:
        return self.page_size * self.max_pages


def default_min_slots(platform: str | None = None) -> int:
    """The smallest slot bucket on ``platform`` (default: the compile target or JAX's backend)."""
    return MIN_SLOTS.get(platform or _backend.backend(), max(MIN_SLOTS.values()))


def default_check_every(platform: str | None = None) -> int:
    """Decode steps between stop checks on ``platform`` (default: the compile target or JAX's
    backend); see ``CHECK_EVERY``."""
    return CHECK_EVERY.get(platform or _backend.backend(), max(CHECK_EVERY.values()))


def rollout_params_bytes(cfg: ModelConfig, num_params: int, expert: int = 1) -> int:
    """Device memory of the rollout's copy of the parameters (``Runtime.rollout_params``: the
    compute dtype, one buffer per layer, replicated on every rollout device). It is held by the
    runtime from one update to the next, beside the trainer's master weights, and is not part of
    a rollout memory budget (which covers the working memory only). Under fp8 weights the
    projections take a byte each (models.precision.rollout_weight_bytes). A MoE model's rollout
    on a mesh whose `expert` axis (``expert`` > 1) divides its experts holds E / expert of them
    a device (parallel.expert_parallel.rollout_param_specs)."""
    full = rollout_weight_bytes(cfg, num_params)
    if expert <= 1 or not cfg.is_moe or cfg.num_experts % expert:
        return full
    experts = rollout_weight_bytes(cfg, num_params) - rollout_weight_bytes(
        cfg, num_params - cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size
        * cfg.moe_intermediate_size)
    return full - experts + experts // expert


def slot_buckets(slots: int, min_slots: int | None = None) -> tuple[int, ...]:
    """Slot counts of the compiled decode programs, descending: ``slots``, then the whole numbers
    2^j x (1, 5/4, 3/2, 7/4) below it down to ``min_slots`` (default :func:`default_min_slots`).
    The live batch is compacted to the next one when it fits, so the compute follows the live
    samples within a factor 1.33 (mean occupancy of an exponentially draining batch ~0.9) with
    O(log slots) programs."""
    min_slots = default_min_slots() if min_slots is None else min_slots
    ladder, p = set(), 1
    while p < slots:
        ladder.update(p * k // 4 for k in BUCKET_STEPS
                      if p * k % 4 == 0 and min_slots <= p * k // 4 < slots)
        p *= 2
    return (slots,) + tuple(sorted(ladder, reverse=True))


def rollout_bytes(cfg: ModelConfig, num_prompts: int, prompt_len: int, samples_per_prompt: int,
                  max_new_tokens: int, slots: int, *, num_devices: int = 1,
                  page_size: int | None = None, kv_fraction: float = KV_FRACTION,
                  num_pages: int | None = None, record_routing: bool = False) -> int:
    """Working memory per device of ``slots`` decode slots, their KV pages (``num_pages``, default
    :func:`pages_for`) and their prompt pool (with its routing record when recorded)."""
    page_size = page_size or default_page_size()
    share = -(-samples_per_prompt // num_devices)
    if num_pages is None:
        num_pages = pages_for(slots, max_new_tokens, page_size, kv_fraction)
    return (slots * slot_bytes(cfg, max_new_tokens, page_size)
            + (num_pages + 1) * page_bytes(cfg, page_size)     # +1: the write-off page
            + pool_size_for(slots, share, num_prompts)
            * pool_entry_bytes(cfg, prompt_len, share, max_new_tokens, record_routing)
            + results_bytes(share, max_new_tokens)    # the results' spare entry (programs.py)
            + route_bytes(cfg, share * max_new_tokens, record_routing)     # and its routing's
            + admission_bytes(cfg, share))


def min_budget_bytes(cfg: ModelConfig, num_prompts: int, prompt_len: int,
                     samples_per_prompt: int, max_new_tokens: int, *, num_devices: int = 1,
                     page_size: int | None = None, kv_fraction: float = KV_FRACTION,
                     record_routing: bool = False) -> int:
    """The smallest ``memory_budget_bytes`` :func:`plan_slots` accepts for a call of these
    shapes (over all ``num_devices``): one decode slot with the pages of a whole sample and its
    prompt pool on every device."""
    return num_devices * rollout_bytes(
        cfg, num_prompts, prompt_len, samples_per_prompt, max_new_tokens, 1,
        num_devices=num_devices, page_size=page_size, kv_fraction=kv_fraction,
        record_routing=record_routing)


def plan_slots(cfg: ModelConfig, num_prompts: int, prompt_len: int, samples_per_prompt: int,
               max_new_tokens: int, memory_budget_bytes: int | None, *, num_devices: int = 1,
               min_slots: int | None = None, page_size: int | None = None,
               kv_fraction: float = KV_FRACTION, record_routing: bool = False) -> SlotPlan:
    """Decode slots, KV pages and prompt-pool entries per device from the memory budget.

    ``memory_budget_bytes`` covers the rollout's working memory over all ``num_devices`` (not the
    parameters; :func:`rollout_bytes` per device). Without a budget every sample gets a slot and
    pages for its full length (nothing ever waits for a page). With a budget, the slots are the
    most that fit with :func:`pages_for` pages each (``kv_fraction`` of their capacity), and the
    pages take the rest of the budget. A budget below one slot with one whole sample's pages and
    its pool raises ``ValueError`` naming the minimum. ``record_routing``: the engine records
    each token's experts (rollout routing replay): the pool's entries hold them too.
    """
    page_size = page_size or default_page_size()
    if not 0 < kv_fraction <= 1:
        raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
    share = -(-samples_per_prompt // num_devices)
    samples = num_prompts * share
    max_pages = cache_len(max_new_tokens, page_size) // page_size
    need = lambda b, pages=None: rollout_bytes(
        cfg, num_prompts, prompt_len, samples_per_prompt, max_new_tokens, b,
        num_devices=num_devices, page_size=page_size, kv_fraction=kv_fraction, num_pages=pages,
        record_routing=record_routing)
    if memory_budget_bytes is None:
        slots = samples
        pages = slots * max_pages
    else:
        budget = int(memory_budget_bytes) // num_devices
        least = min_budget_bytes(cfg, num_prompts, prompt_len, samples_per_prompt,
                                 max_new_tokens, num_devices=num_devices, page_size=page_size,
                                 kv_fraction=kv_fraction, record_routing=record_routing)
        if memory_budget_bytes < least:
            raise ValueError(
                f"memory_budget_bytes={memory_budget_bytes} is too small: one decode slot with "
                f"the pages of a whole sample and its prompt pool needs {need(1)} bytes per "
                f"device; pass at least {least} (over {num_devices} device(s)) "
                "or shorter prompts or a smaller max_new_tokens")
        # need() grows with b: bisect the largest b that fits
        lo, hi = 1, max(1, samples)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
        slots = lo
        # the rest of the budget buys pages (no more than every slot's full length)
        spare = budget - need(slots, 0)
        pages = max(max_pages, min(slots * max_pages, spare // page_bytes(cfg, page_size)))
    pool = pool_size_for(min(slots, samples), share, num_prompts)
    floor = default_min_slots() if min_slots is None else min_slots
    return SlotPlan(slots=slots, pool=pool, share=share, page_size=page_size,
                    max_pages=max_pages, num_pages=int(pages),
                    buckets=slot_buckets(slots, min(floor, slots)),
                    bytes_per_device=need(slots, pages))


def stream_pool_size(slots: int, share: int) -> int:
    """Prompt-pool entries of an open stream (Engine.open_stream): twice the prompts the slots
    hold, +2. With long-tailed lengths a prompt keeps its entry until its slowest sample stops,
    while its other slots already decode others, so the pool holds more than one call's."""
    return 2 * -(-int(slots) // max(int(share), 1)) + 2


def stream_plan(cfg: ModelConfig, plan: SlotPlan, prompt_len: int,
                max_new_tokens: int, record_routing: bool = False) -> SlotPlan:
    """``plan`` (:func:`plan_slots` for the stream's ``plan_prompts``) with an open stream's
    prompt pool (:func:`stream_pool_size`) and its bytes: the layout the engine allocates for a
    stream and holds while paused between RL steps (the memory plan counts it beside the update
    when samples are carried, train/door.py)."""
    pool = stream_pool_size(plan.slots, plan.share)
    extra = (pool - plan.pool) * pool_entry_bytes(cfg, prompt_len, plan.share, max_new_tokens,
                                                  record_routing)
    return dataclasses.replace(plan, pool=pool, bytes_per_device=plan.bytes_per_device + extra)


def stop_table(cfg: ModelConfig, eos_ids: Sequence[int]) -> np.ndarray:
    """bool[V]: True at the stop tokens (one lookup per sampled token, any number of stop ids)."""
    ids = np.asarray(sorted({int(e) for e in eos_ids}), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise ValueError(f"eos_ids must be token ids in [0, vocab_size={cfg.vocab_size}), got "
                         f"{ids[(ids < 0) | (ids >= cfg.vocab_size)].tolist()[:5]}")
    table = np.zeros((cfg.vocab_size,), bool)
    table[ids] = True
    return table


def resolve_eos_ids(model: Any, eos_ids: Sequence[int] | None) -> tuple[int, ...]:
    """Stop tokens: ``eos_ids`` if given, else the model's generation config, else its config."""
    if eos_ids is not None:
        return tuple(sorted({int(e) for e in eos_ids}))
    ids = tuple(getattr(model, "generation_eos_ids", ()) or ()) or tuple(model.config.eos_token_ids)
    return tuple(sorted({int(e) for e in ids}))


def pad_prompts(prompts: list[list[int]], num_rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``tokens int32[num_rows, length]`` and ``lengths int32[num_rows]``.

    Rows past ``len(prompts)`` are one-token dummy prompts (their samples are discarded)."""
    tokens = np.zeros((num_rows, length), np.int32)
    lengths = np.ones((num_rows,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    return tokens, lengths

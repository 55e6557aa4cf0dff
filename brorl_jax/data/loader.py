"""The prompt loader: tokenized, length-filtered, host-sharded, shuffled batches of prompts (grain).

Pipeline (grain MapDataset, everything deterministic from `seed`):

    records --tokenize + drop over-long (pre-pass, counted)--> prompts
      [shard_index : n_even : shard_count]      # disjoint equal slices, one per host
      .shuffle(seed)                            # reshuffled every epoch by .repeat
      .batch(batch_size // shard_count, drop_remainder=True)   # a batch never spans two epochs
      .repeat(num_epochs)                       # None: forever
      .to_iter_dataset()                        # iterator with get_state()/set_state()

The pre-pass tokenizes every prompt once, up front: prompt datasets are small (thousands to a
few hundred thousand rows), and filtering before batching keeps every batch full and makes the
number of skipped prompts known before training starts. All hosts run the same pre-pass, so they
agree on the kept prompts and each takes its own slice.

An element of a batch is one prompt; a batch is a `PromptBatch` of B = loader.local_batch_size
prompts (token ids, lengths, loader indices, records).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from brorl_jax.data.records import PROMPT_TOO_LONG, SHARD_REMAINDER, DataReport

# Tokenizing in chunks bounds memory and lets a PromptTokenizer use one batched call per chunk.
_TOKENIZE_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One kept prompt: its position among the kept prompts, token ids and record."""
    index: int
    ids: np.ndarray            # int32[L], L <= max_prompt_len
    record: dict


def tokenize_and_filter(records: Sequence[dict], tokenizer_fn: Callable[[dict], Sequence[int]],
                        max_prompt_len: int | None) -> tuple[list[Prompt], DataReport]:
    """Tokenizes every record and drops (and counts) prompts longer than max_prompt_len.

    Returns the kept prompts, in record order, and a report whose skipped rows carry the
    reason "prompt_too_long" and the length.
    """
    report = DataReport(num_rows=len(records))
    encode_batch = getattr(tokenizer_fn, "encode_batch", None)
    prompts: list[Prompt] = []
    for start in range(0, len(records), _TOKENIZE_CHUNK):
        chunk = records[start:start + _TOKENIZE_CHUNK]
        ids_list = encode_batch(chunk) if encode_batch else [tokenizer_fn(r) for r in chunk]
        for record, ids in zip(chunk, ids_list, strict=True):
            if len(ids) == 0:
                raise ValueError(f"tokenizer_fn gave no tokens for {record.get('source')} row "
                                 f"{record.get('row')}; check the tokenizer and chat template.")
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                report.skip(str(record.get("source")), int(record.get("row", -1)),
                            PROMPT_TOO_LONG, f"{len(ids)} tokens > max_prompt_len "
                            f"{max_prompt_len}")
                continue
            prompts.append(Prompt(len(prompts), np.asarray(ids, dtype=np.int32), record))
    report.num_kept = len(prompts)
    return prompts, report


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One batch of the loader: B prompts."""
    prompt_ids: list            # list[list[int]], ready for rollout.generate(prompts=...)
    prompt_lengths: np.ndarray  # int32[B]
    index: np.ndarray           # int64[B], position in loader.prompts (all hosts agree)
    records: list               # list[dict], the normalized records, for the reward scorer

    def __len__(self) -> int:
        return len(self.index)


def _collate(prompts: Sequence[Prompt]) -> PromptBatch:
    # Records are deep-copied so a caller that edits a batch cannot change the dataset.
    return PromptBatch(prompt_ids=[p.ids.tolist() for p in prompts],
                       prompt_lengths=np.array([len(p.ids) for p in prompts], dtype=np.int32),
                       index=np.array([p.index for p in prompts], dtype=np.int64),
                       records=[copy.deepcopy(p.record) for p in prompts])


def _fingerprint(prompts: Sequence[Prompt]) -> str:
    """Short digest of the kept prompts (source, row, length), to refuse a mismatched restore."""
    h = hashlib.sha1()
    for p in prompts:
        # The file's base name only, so moving the data directory does not block a resume.
        source = os.path.basename(str(p.record.get("source")))
        h.update(f"{source}|{p.record.get('row')}|{len(p.ids)};".encode())
    return h.hexdigest()[:16]


class PromptIterator:
    """Iterator over prompt batches whose position is a small JSON-able dict.

    get_state() -> {"next_index": int, "config": {...}}; set_state(state) restores it exactly,
    and raises ValueError when the state belongs to a different dataset, seed, batch size or
    host count (resuming such a run would silently feed different prompts). Hosts step in
    lockstep, so every host has the same state: one saved copy restores all of them.
    """

    def __init__(self, grain_iterator: grain.DatasetIterator, config: dict):
        self._it = grain_iterator
        self._config = config

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def get_state(self) -> dict:
        return {**self._it.get_state(), "config": dict(self._config)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        saved = state.get("config")
        if saved is not None and dict(saved) != self._config:
            diff = {k: (saved.get(k), self._config.get(k))
                    for k in set(saved) | set(self._config) if saved.get(k) != self._config.get(k)}
            raise ValueError("prompt loader state does not match this loader (saved, current): "
                             f"{diff}. Resume with the same data, seed, batch_size, "
                             "max_prompt_len and host count, or start the data from scratch.")
        self._it.set_state({k: v for k, v in state.items() if k != "config"})


@dataclasses.dataclass(frozen=True)
class PromptLoader:
    """Batches of prompts for one host; iterate it (each iter() starts from the beginning).

    Attributes:
      dataset: the grain MapDataset of batches (length sys.maxsize when repeating forever).
      prompts: every kept prompt (all hosts), in record order; Prompt.index is the position here.
      report: the pre-pass report (rows skipped as prompt_too_long or shard_remainder).
      batch_size: prompts per generation round over all hosts.
      local_batch_size: batch_size // shard_count, the size of this host's batches.
      steps_per_epoch: batches per epoch (the same on every host).
      shard_index, shard_count: this host's slice.
    """
    dataset: grain.MapDataset
    prompts: list[Prompt]
    report: DataReport
    batch_size: int
    local_batch_size: int
    steps_per_epoch: int
    shard_index: int
    shard_count: int
    state_config: dict

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def num_too_long(self) -> int:
        return self.report.num_skipped(PROMPT_TOO_LONG)

    def __iter__(self) -> PromptIterator:
        # In-memory data: grain recommends no reader threads (they would only contend for the GIL).
        iter_ds = self.dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        return PromptIterator(iter(iter_ds), self.state_config)


def make_prompt_loader(records: Sequence[dict], tokenizer_fn: Callable[[dict], Sequence[int]], *,
                       batch_size: int, seed: int, shuffle: bool = True,
                       num_epochs: int | None = None, max_prompt_len: int | None = None,
                       shard_index: int | None = None, shard_count: int | None = None,
                       ) -> PromptLoader:
    """Builds the prompt loader (see the module docstring for the pipeline and batch layout).

    Args:
      records: normalized records (load_dataset / reasoning_gym_source).
      tokenizer_fn: record -> token ids; usually a PromptTokenizer.
      batch_size: prompts per generation round summed over all hosts; divisible by shard_count.
      seed: shuffle seed (same on every host).
      shuffle: False keeps record order (each epoch identical).
      num_epochs: passes over the data; None repeats forever.
      max_prompt_len: longer prompts are skipped and counted; defaults to
        tokenizer_fn.max_prompt_len (PromptTokenizer), None means no limit.
      shard_index, shard_count: this host's slice; default jax.process_index()/process_count().
    """
    if shard_index is None or shard_count is None:
        import jax  # only for the defaults; the data path itself needs no JAX
        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                         f"shard_count={shard_count}.")
    if batch_size < 1 or batch_size % shard_count:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of shard_count="
                         f"{shard_count} (it counts prompts over all hosts).")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}.")
    if not records:
        raise ValueError("make_prompt_loader got no records.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed}.")
    if max_prompt_len is None:
        max_prompt_len = getattr(tokenizer_fn, "max_prompt_len", None)

    prompts, report = tokenize_and_filter(records, tokenizer_fn, max_prompt_len)
    # Equal slices keep every host on the same number of steps (an unequal one would stall the
    # others in a collective at the end of an epoch); the few prompts left over are reported.
    num_even = len(prompts) - len(prompts) % shard_count
    for p in prompts[num_even:]:
        report.skip(str(p.record.get("source")), int(p.record.get("row", -1)), SHARD_REMAINDER,
                    f"{len(prompts)} prompts do not split evenly over {shard_count} hosts")
    prompts = prompts[:num_even]
    report.num_kept = num_even
    local_batch_size = batch_size // shard_count
    steps_per_epoch = (num_even // shard_count) // local_batch_size
    if steps_per_epoch == 0:
        too_long = report.num_skipped(PROMPT_TOO_LONG)
        fix = "add data"
        if too_long:
            longest = max(int(s.detail.split()[0]) for s in report.skipped
                          if s.reason == PROMPT_TOO_LONG)
            fix = (f"raise data.max_prompt_len (now {max_prompt_len}; the longest prompt has "
                   f"{longest} tokens), or add data")
        raise ValueError(f"{num_even} usable prompts (of {len(records)}; {too_long} longer than "
                         f"data.max_prompt_len={max_prompt_len}) cannot fill one batch (a "
                         f"generation round) of {batch_size} prompts over {shard_count} hosts; {fix} (or "
                         "lower algo.prompts_per_step).")

    dataset = grain.MapDataset.source(prompts)[shard_index::shard_count]
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.batch(local_batch_size, drop_remainder=True, batch_fn=_collate)
    dataset = dataset.repeat(num_epochs)
    state_config = {"num_prompts": len(prompts), "fingerprint": _fingerprint(prompts),
                    "batch_size": batch_size, "seed": seed, "shuffle": shuffle,
                    "max_prompt_len": max_prompt_len, "shard_count": shard_count}
    return PromptLoader(dataset=dataset, prompts=prompts, report=report, batch_size=batch_size,
                        local_batch_size=local_batch_size, steps_per_epoch=steps_per_epoch,
                        shard_index=shard_index, shard_count=shard_count,
                        state_config=state_config)

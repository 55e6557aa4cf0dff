"""make_prompt_loader: over-long prompts counted, seeded shuffle, checkpointable state, shards."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from brorl_jax.data import PromptTokenizer, load_dataset, make_prompt_loader, records as rec


def make_records(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i}+{i}?",
             "data_source": "math", "ground_truth": str(2 * i), "extra_info": {"i": i},
             "row": i, "source": "mem"} for i in range(n)]


def indices(batches) -> list[list[int]]:
    return [b.index.tolist() for b in batches]


def take(it, k):
    return [next(it) for _ in range(k)]


def test_over_long_prompt_is_counted_and_never_truncated(tmp_path, char_tokenizer):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1), "data_source": "math"}
            for i in range(8)]
    rows[5]["question"] = "x" * 200                                   # over-long prompt, row 5
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, load_report = load_dataset(path)
    assert load_report.num_skipped() == 0
    pt = PromptTokenizer(char_tokenizer, max_prompt_len=64)
    loader = make_prompt_loader(records, pt, batch_size=7, seed=0, num_epochs=1,
                                shard_index=0, shard_count=1)
    assert loader.num_too_long == 1 and loader.num_prompts == 7
    (skipped,) = loader.report.skipped
    assert (skipped.source, skipped.row, skipped.reason) == (str(path), 5, rec.PROMPT_TOO_LONG)
    long_len = len(pt(records[5]))
    assert long_len > 200 and skipped.detail == f"{long_len} tokens > max_prompt_len 64"
    (batch,) = list(loader)                                          # one full batch, then done
    assert sorted(r["row"] for r in batch.records) == [0, 1, 2, 3, 4, 6, 7]
    for ids, length, record in zip(batch.prompt_ids, batch.prompt_lengths,
                                   batch.records):
        assert ids == pt(record) and len(ids) == length <= 64    # the full, untruncated prompt


def test_verl_parquet_through_loader(tmp_path, char_tokenizer):
    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": f"{i}*2?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i}} for i in range(6)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records, _ = load_dataset(str(path))
    loader = make_prompt_loader(records, PromptTokenizer(char_tokenizer, max_prompt_len=128),
                                batch_size=3, seed=1, num_epochs=1, shard_index=0,
                                shard_count=1)
    batches = list(loader)
    assert len(batches) == 2 == loader.steps_per_epoch
    seen = [r for b in batches for r in b.records]
    assert sorted(r["extra_info"]["index"] for r in seen) == list(range(6))
    for b in batches:
        assert b.prompt_lengths.dtype == np.int32 and b.index.dtype == np.int64
        assert all(isinstance(t, int) for ids in b.prompt_ids for t in ids)


def test_batches_are_full_and_each_epoch_covers_the_data(char_tokenizer):
    loader = make_prompt_loader(make_records(12), PromptTokenizer(char_tokenizer, 256),
                                batch_size=4, seed=3, num_epochs=2, shard_index=0,
                                shard_count=1)
    batches = list(loader)
    assert len(batches) == 2 * loader.steps_per_epoch == 6
    idx = indices(batches)
    assert all(len(b) == 4 for b in idx)
    epoch1, epoch2 = sum(idx[:3], []), sum(idx[3:], [])
    assert sorted(epoch1) == sorted(epoch2) == list(range(12))
    assert epoch1 != epoch2                                  # reshuffled each epoch


def test_shuffle_is_reproducible_with_a_seed_and_changes_with_another(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, 256)

    def order(seed, shuffle=True):
        loader = make_prompt_loader(make_records(20), pt, batch_size=5, seed=seed,
                                    shuffle=shuffle, num_epochs=1, shard_index=0,
                                    shard_count=1)
        return sum(indices(loader), [])

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert sorted(order(8)) == list(range(20))
    assert order(7, shuffle=False) == list(range(20))


def test_iterator_state_restores_exactly(char_tokenizer):
    loader = make_prompt_loader(make_records(12), PromptTokenizer(char_tokenizer, 256),
                                batch_size=4, seed=5, shard_index=0, shard_count=1)
    it = iter(loader)
    take(it, 5)                                              # crosses the first epoch boundary
    state = json.loads(json.dumps(it.get_state()))           # a checkpoint is plain JSON
    expected = take(it, 4)
    fresh = iter(loader)
    fresh.set_state(state)
    got = take(fresh, 4)
    assert indices(got) == indices(expected)
    assert [b.records for b in got] == [b.records for b in expected]
    assert [b.prompt_ids for b in got] == [b.prompt_ids for b in expected]
    # A loader rebuilt from scratch (a restarted job) restores to the same place too.
    rebuilt = make_prompt_loader(make_records(12), PromptTokenizer(char_tokenizer, 256),
                                 batch_size=4, seed=5, shard_index=0, shard_count=1)
    again = iter(rebuilt)
    again.set_state(state)
    assert indices(take(again, 4)) == indices(expected)


def test_restoring_a_state_from_another_configuration_raises(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, 256)
    it = iter(make_prompt_loader(make_records(12), pt, batch_size=4, seed=5, shard_index=0,
                                 shard_count=1))
    next(it)
    state = it.get_state()
    other = iter(make_prompt_loader(make_records(12), pt, batch_size=4, seed=6, shard_index=0,
                                    shard_count=1))
    with pytest.raises(ValueError, match="seed"):
        other.set_state(state)
    fewer = iter(make_prompt_loader(make_records(11), pt, batch_size=4, seed=5, shard_index=0,
                                    shard_count=1))
    with pytest.raises(ValueError, match="num_prompts"):
        fewer.set_state(state)


def test_host_shards_are_disjoint_equal_and_cover_the_data(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, 256)

    def shard(index, n):
        loader = make_prompt_loader(make_records(n), pt, batch_size=4, seed=11, num_epochs=1,
                                    shard_index=index, shard_count=2)
        return loader, sum(indices(loader), [])

    (l0, s0), (l1, s1) = shard(0, 12), shard(1, 12)
    assert l0.local_batch_size == 2 and l0.steps_per_epoch == l1.steps_per_epoch == 3
    assert not set(s0) & set(s1)
    assert sorted(s0 + s1) == list(range(12))
    # One saved state (e.g. host 0's) restores every host: the hosts step in lockstep.
    it0, it1 = iter(l0), iter(l1)
    next(it0), next(it1)
    state = json.loads(json.dumps(it0.get_state()))
    assert state == it1.get_state()
    expected1 = next(it1).index.tolist()
    restored1 = iter(l1)
    restored1.set_state(state)
    assert next(restored1).index.tolist() == expected1
    # 13 prompts over 2 hosts: equal shards of 6, the 13th is reported, not silently lost.
    (l0, s0), (l1, s1) = shard(0, 13), shard(1, 13)
    assert len(s0) == len(s1) == 6 and not set(s0) & set(s1)
    assert l0.report.counts() == {rec.SHARD_REMAINDER: 1}
    assert sorted(s0 + s1 + [l0.report.skipped[0].row]) == list(range(13))


def test_records_in_batches_are_copies(char_tokenizer):
    loader = make_prompt_loader(make_records(4), PromptTokenizer(char_tokenizer, 256),
                                batch_size=2, seed=0, shard_index=0, shard_count=1)
    batch = next(iter(loader))
    batch.records[0]["extra_info"]["i"] = -1
    assert all(p.record["extra_info"]["i"] >= 0 for p in loader.prompts)


def test_bad_loader_arguments_raise(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, 256)
    with pytest.raises(ValueError, match="multiple of shard_count"):
        make_prompt_loader(make_records(8), pt, batch_size=3, seed=0, shard_index=0,
                           shard_count=2)
    with pytest.raises(ValueError, match="cannot fill one batch"):
        make_prompt_loader(make_records(3), pt, batch_size=4, seed=0, shard_index=0,
                           shard_count=1)
    with pytest.raises(ValueError, match="shard_index"):
        make_prompt_loader(make_records(8), pt, batch_size=2, seed=0, shard_index=2,
                           shard_count=2)
    with pytest.raises(ValueError, match="num_epochs"):
        make_prompt_loader(make_records(8), pt, batch_size=2, seed=0, num_epochs=0,
                           shard_index=0, shard_count=1)


def test_default_shard_is_this_jax_process(char_tokenizer):
    loader = make_prompt_loader(make_records(4), PromptTokenizer(char_tokenizer, 256),
                                batch_size=2, seed=0)
    assert (loader.shard_index, loader.shard_count) == (0, 1)

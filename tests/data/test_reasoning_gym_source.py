"""Reasoning Gym prompt source: reproducible, weighted, scorable from the record alone."""
from __future__ import annotations

import json

import pytest
import reasoning_gym

from brorl_jax.data import (
    DataReport,
    PromptTokenizer,
    load_dataset,
    make_prompt_loader,
    reasoning_gym_source,
)
from brorl_jax.data.reasoning_gym_source import parse_tasks, task_sizes

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting"]


def test_same_seed_same_records_other_seed_other_records():
    report = DataReport()
    a = reasoning_gym_source(TASKS, size=12, seed=3, report=report)
    b = reasoning_gym_source(",".join(TASKS), size=12, seed=3)      # the text form is the same
    c = reasoning_gym_source(TASKS, size=12, seed=4)
    assert a == b
    assert [r["prompt_messages"] for r in a] != [r["prompt_messages"] for r in c]
    assert (report.num_rows, report.num_kept, report.num_skipped()) == (12, 12, 0)
    assert sorted({r["data_source"] for r in a}) == [f"reasoning_gym/{t}" for t in TASKS]
    assert [sum(r["data_source"].endswith(t) for r in a) for t in TASKS] == [4, 4, 4]


def test_record_is_json_and_scores_its_own_answer():
    records = reasoning_gym_source(TASKS, size=6, seed=0)
    for r in records:
        r2 = json.loads(json.dumps(r))                      # survives a trip to a worker process
        info = r2["extra_info"]
        assert r2["prompt_messages"] == [{"role": "user", "content": info["question"]}]
        assert r2["ground_truth"] == info["answer"]
        task = info["reasoning_gym"]["task"]
        entry = {k: info[k] for k in ("question", "answer", "metadata")}
        assert reasoning_gym.get_score_answer_fn(task)(r2["ground_truth"], entry) == 1.0
        # The exact entry can also be regenerated from (task, size, seed, index).
        g = info["reasoning_gym"]
        regenerated = reasoning_gym.create_dataset(task, size=g["size"], seed=g["seed"],
                                                   **g["config"])
        assert regenerated[g["index"]]["question"] == info["question"]


def test_generator_settings_reach_every_task_and_are_recorded():
    settings = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
                    allow_parentheses=False, allow_negation=False)
    records = reasoning_gym_source("basic_arithmetic", size=5, seed=0, **settings)
    for r in records:
        expression = r["extra_info"]["metadata"]["expression"]
        assert expression.count("+") == 1 and "-" not in expression and "(" not in expression
        g = r["extra_info"]["reasoning_gym"]
        assert g["config"] == settings
        again = reasoning_gym.create_dataset("basic_arithmetic", size=g["size"], seed=g["seed"],
                                             **g["config"])[g["index"]]
        assert again["question"] == r["extra_info"]["question"]
    with pytest.raises(ValueError, match="rejects the generator settings"):
        reasoning_gym_source("leg_counting", size=2, seed=0, operators=["+"])


def test_weights_split_the_size():
    assert task_sizes({"a": 3, "b": 1}, 8) == {"a": 6, "b": 2}
    assert sum(task_sizes({"a": 1, "b": 1, "c": 1}, 10).values()) == 10
    assert parse_tasks("basic_arithmetic=3, chain_sum") == {"basic_arithmetic": 3.0,
                                                            "chain_sum": 1.0}
    records, _ = load_dataset("reasoning_gym:basic_arithmetic=3,chain_sum=1", size=8, seed=0)
    sources = [r["data_source"] for r in records]
    assert sources.count("reasoning_gym/basic_arithmetic") == 6
    assert sources.count("reasoning_gym/chain_sum") == 2


def test_unknown_task_and_bad_weight_raise():
    with pytest.raises(ValueError, match="did you mean"):
        reasoning_gym_source(["chain_summ"], size=2)
    with pytest.raises(ValueError, match="weight"):
        reasoning_gym_source({"chain_sum": 0}, size=2)
    with pytest.raises(ValueError, match="not a number"):
        parse_tasks("chain_sum=x")
    with pytest.raises(ValueError, match="no reasoning_gym task"):
        reasoning_gym_source(" , ", size=2)


def test_reasoning_gym_prompts_flow_through_the_loader(char_tokenizer):
    records = reasoning_gym_source(TASKS, size=9, seed=0)
    loader = make_prompt_loader(records, PromptTokenizer(char_tokenizer, max_prompt_len=2048),
                                batch_size=3, seed=0, num_epochs=1, shard_index=0,
                                shard_count=1)
    batches = list(loader)
    assert len(batches) == 3 and loader.num_too_long == 0
    assert sorted(r["row"] + 100 * TASKS.index(r["data_source"].split("/")[1])
                  for b in batches for r in b.records) == sorted(
        r["row"] + 100 * TASKS.index(r["data_source"].split("/")[1]) for r in records)


def test_entries_without_question_or_answer_are_reported(monkeypatch, caplog):
    entries = [{"question": "1+1?", "answer": "2", "metadata": {}},
               {"question": "2+2?", "answer": None, "metadata": {}},
               {"question": " ", "answer": "3", "metadata": {}}]
    monkeypatch.setattr(reasoning_gym, "create_dataset", lambda name, size, seed: entries)
    report = DataReport()
    records = reasoning_gym_source(["chain_sum"], size=3, seed=0, report=report)
    assert [r["row"] for r in records] == [0]
    assert [(s.row, s.reason) for s in report.skipped] == [(1, "missing_ground_truth"),
                                                           (2, "empty_prompt")]
    with caplog.at_level("WARNING", logger="brorl_jax.data.reasoning_gym_source"):
        reasoning_gym_source(["chain_sum"], size=3, seed=0)     # no report: the skips are logged
    assert "reasoning_gym/chain_sum row 1: missing_ground_truth" in caplog.text

"""Loading prompt files: JSONL, veRL-style and flat Parquet; bad rows reported by row number."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from brorl_jax.data import DataReport, load_dataset, load_jsonl, load_parquet, records as rec


def write_jsonl(path, lines: list) -> None:
    """Each item is a dict (dumped as JSON) or a raw string line."""
    with open(path, "w", encoding="utf-8") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")


def verl_rows() -> list[dict]:
    """veRL's Parquet layout: chat-message prompt, data_source, reward_model, extra_info."""
    def row(i, content, ground_truth, source="math"):
        return {"data_source": source,
                "prompt": [{"role": "system", "content": "Think step by step."},
                           {"role": "user", "content": content}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"split": "train", "index": i}}
    return [row(0, "What is 1+1?", "2"),
            row(1, "What is 2+3?", None),                 # missing ground truth
            row(2, "   ", "7"),                           # only the system message has text
            row(3, "Sum of 4 and 4?", "8"),
            row(4, "Reverse 'ab'.", json.dumps({"inputs": ["ab\n"], "outputs": ["ba\n"]}),
                source="code")]


def test_jsonl_flat_layout_loads_and_reports_bad_rows_by_row_number(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [
        {"question": "What is 1+1?", "answer": "2", "data_source": "math"},    # line 1, row 0
        {"question": "What is 2+2?", "data_source": "math"},                   # row 1: no answer
        "",                                                                    # blank: ignored
        {"question": "", "answer": "3", "data_source": "math"},                # row 3: empty
        "{not json",                                                           # row 4: bad JSON
        [1, 2, 3],                                                             # row 5: not object
        {"prompt": "Compute 6*7.", "ground_truth": 42, "data_source": "math",
         "extra_info": {"id": "q7"}},                                          # row 6: ok
    ])
    records, report = load_jsonl(path)
    assert [r["row"] for r in records] == [0, 6]
    assert records[0] == {"prompt": "What is 1+1?", "data_source": "math", "ground_truth": "2",
                          "extra_info": {}, "row": 0, "source": str(path)}
    assert records[1]["ground_truth"] == "42"            # numbers become text
    assert records[1]["extra_info"] == {"id": "q7"}
    assert [(s.row, s.reason) for s in report.skipped] == [
        (1, rec.MISSING_GROUND_TRUTH), (3, rec.EMPTY_PROMPT), (4, rec.INVALID_JSON),
        (5, rec.NOT_AN_OBJECT)]
    assert (report.num_rows, report.num_kept) == (6, 2)
    assert report.counts() == {rec.MISSING_GROUND_TRUTH: 1, rec.EMPTY_PROMPT: 1,
                               rec.INVALID_JSON: 1, rec.NOT_AN_OBJECT: 1}
    text = report.summary()
    assert f"{path} row 1 (line 2): missing_ground_truth" in text
    assert "row 3 (line 4): empty_prompt" in text
    json.dumps(report.to_dict())                         # loggable as JSON


def test_verl_parquet_layout_loads(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    records, report = load_parquet(path)
    assert [r["row"] for r in records] == [0, 3, 4]
    first = records[0]
    assert "prompt" not in first                         # exactly one prompt key
    assert first["prompt_messages"] == [{"role": "system", "content": "Think step by step."},
                                        {"role": "user", "content": "What is 1+1?"}]
    assert first["data_source"] == "math" and first["ground_truth"] == "2"
    assert first["extra_info"] == {"split": "train", "index": 0}
    assert records[2]["data_source"] == "code"
    assert json.loads(records[2]["ground_truth"]) == {"inputs": ["ab\n"], "outputs": ["ba\n"]}
    assert [(s.row, s.reason) for s in report.skipped] == [(1, rec.MISSING_GROUND_TRUTH),
                                                           (2, rec.EMPTY_PROMPT)]
    for r in records:                                    # records are plain JSON data
        json.dumps(r)


def test_verl_parquet_empty_prompt_reported(tmp_path):
    rows = verl_rows()[:1] + [{"data_source": "math", "prompt": [],
                               "reward_model": {"style": "rule", "ground_truth": "1"},
                               "extra_info": {"split": "train", "index": 1}},
                              {"data_source": "math",
                               "prompt": [{"role": "user", "content": "  \n"}],
                               "reward_model": {"style": "rule", "ground_truth": "1"},
                               "extra_info": {"split": "train", "index": 2}}]
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records, report = load_parquet(path)
    assert len(records) == 1
    assert [(s.row, s.reason) for s in report.skipped] == [(1, rec.EMPTY_PROMPT),
                                                           (2, rec.EMPTY_PROMPT)]
    assert "empty.parquet row 2: empty_prompt" in report.summary()


def test_flat_parquet_with_field_mapping_and_default_data_source(tmp_path):
    path = tmp_path / "custom.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"problem_text": "1+1?", "label": {"value": "2"}},
        {"problem_text": "2+2?", "label": {"value": None}},
    ]), path)
    with pytest.raises(ValueError, match="no usable rows"):
        load_parquet(path)                               # nothing found under default names
    records, report = load_parquet(
        path, fields={"prompt": "problem_text", "ground_truth": "label.value"},
        data_source="math")
    assert [(r["prompt"], r["ground_truth"], r["data_source"]) for r in records] == [
        ("1+1?", "2", "math")]
    assert [(s.row, s.reason) for s in report.skipped] == [(1, rec.MISSING_GROUND_TRUTH)]


def test_missing_data_source_is_reported_not_guessed(tmp_path):
    path = tmp_path / "nosource.jsonl"
    write_jsonl(path, [{"question": "1+1?", "answer": "2"},
                       {"question": "2+2?", "answer": "4", "data_source": "math"}])
    records, report = load_jsonl(path)
    assert [r["row"] for r in records] == [1]
    assert report.skipped[0].reason == rec.MISSING_DATA_SOURCE and report.skipped[0].row == 0


def test_bad_fields_and_unknown_format_raise(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"question": "1+1?", "answer": "2", "data_source": "math"}])
    with pytest.raises(ValueError, match="unknown keys"):
        load_jsonl(path, fields={"answer": "x"})
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_dataset(tmp_path / "a.csv")
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "missing.jsonl")


def test_load_dataset_dispatches_and_merges_reports(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    write_jsonl(jsonl, [{"question": "1+1?", "answer": "2", "data_source": "math"},
                        {"question": "no answer", "data_source": "math"}])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), parquet)
    records, report = load_dataset([str(jsonl), parquet])
    assert [r["source"] for r in records] == [str(jsonl)] + [str(parquet)] * 3
    assert isinstance(report, DataReport)
    assert (report.num_rows, report.num_kept, report.num_skipped()) == (7, 4, 3)
    assert [(s.source, s.row, s.reason) for s in report.skipped] == [
        (str(jsonl), 1, rec.MISSING_GROUND_TRUTH), (str(parquet), 1, rec.MISSING_GROUND_TRUTH),
        (str(parquet), 2, rec.EMPTY_PROMPT)]


def test_text_utf8_cannot_encode_is_a_skipped_row(tmp_path):
    """Valid JSON, invalid Unicode: an escaped lone surrogate used to reach the tokenizer and
    end the run with a traceback naming no row."""
    path = tmp_path / "surrogate.jsonl"
    write_jsonl(path, ['{"question": "\\ud800 1+1?", "answer": "2", "data_source": "math"}',
                       {"question": "2+2?", "answer": "4", "data_source": "math"}])
    records, report = load_jsonl(path)
    assert [r["row"] for r in records] == [1]
    assert report.skipped[0].reason == rec.INVALID_UNICODE and report.skipped[0].row == 0
    assert "surrogate" in report.skipped[0].detail


def test_chat_roles_are_checked_and_sharegpt_names_read_as_theirs(tmp_path):
    """ShareGPT's 'human' passed to the chat template as is; now it is read as 'user' ('gpt' as
    'assistant') and a role no template knows skips the row naming it."""
    path = tmp_path / "roles.jsonl"
    write_jsonl(path, [
        {"prompt": [{"role": "human", "content": "1+1?"}], "answer": "2", "data_source": "math"},
        {"prompt": [{"role": "narrator", "content": "2+2?"}], "answer": "4", "data_source": "math"},
    ])
    records, report = load_jsonl(path)
    assert records[0]["prompt_messages"] == [{"role": "user", "content": "1+1?"}]
    assert report.skipped[0].reason == rec.BAD_PROMPT and report.skipped[0].row == 1
    assert "role 'narrator'" in report.skipped[0].detail

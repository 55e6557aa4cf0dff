"""Prompt records: loading JSONL / Parquet (veRL layout or flat) into one normalized form.

A normalized record is a plain, JSON-serializable dict; it is what the reward scorer receives
(veRL style: the scorer reads "data_source", "ground_truth" and "extra_info"):

    {"prompt_messages": [{"role": "user", "content": "..."}, ...],   # chat prompt, or
     "prompt": "raw text",                 # plain text (exactly one of the two keys is present)
     "data_source": "math" | "code" | "reasoning_gym/<task>" | ...,
     "ground_truth": str | dict | list,    # code (APPS style): {"inputs", "outputs"[, "fn_name"]}
     "extra_info": dict,
     "row": int,                           # 0-based row in the source (JSONL: line number - 1)
     "source": str}                        # file path or generator name

Two row layouts are understood without configuration:

* veRL's Parquet layout: ``prompt`` = list of chat messages, ``data_source``,
  ``reward_model = {"ground_truth": ..., "style": ...}``, ``extra_info`` (dict).
* a flat layout: ``prompt`` / ``question`` / ``problem`` text, ``ground_truth`` / ``answer``,
  ``data_source``.

Other column names are mapped with ``fields={"prompt": "my_col", "ground_truth": "meta.label"}``
(dotted names reach into nested dicts). A row that cannot become a record (no ground truth,
empty prompt, unparseable JSON line, ...) is skipped and listed in a :class:`DataReport` with its
row number and reason; nothing is dropped silently.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from brorl_jax.errors import DataError, DataFileNotFoundError

# Reasons a row is skipped; the keys of DataReport.counts().
NOT_UTF8 = "not_utf8"
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
EMPTY_PROMPT = "empty_prompt"
BAD_PROMPT = "bad_prompt"
MISSING_GROUND_TRUTH = "missing_ground_truth"
MISSING_DATA_SOURCE = "missing_data_source"
PROMPT_TOO_LONG = "prompt_too_long"
SHARD_REMAINDER = "shard_remainder"
# The roles a chat template takes, and ShareGPT's names for two of them (read as these).
CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}

INVALID_UNICODE = "invalid_unicode"       # text UTF-8 cannot encode (a lone surrogate)
BAD_GROUND_TRUTH = "bad_ground_truth"     # the data source's verifier cannot read it

# Where each normalized field is looked for, in order, when no `fields` mapping names a column.
DEFAULT_FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "question", "problem"),
    "ground_truth": ("reward_model.ground_truth", "ground_truth", "answer"),
    "data_source": ("data_source",),
    "extra_info": ("extra_info",),
}

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class SkippedRow:
    """One row left out of the dataset and why. `row` is 0-based (JSONL: line number - 1)."""
    source: str
    row: int
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        where = f"{self.source} row {self.row}"
        if self.source.endswith(".jsonl"):
            where += f" (line {self.row + 1})"
        return f"{where}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclasses.dataclass
class DataReport:
    """What a loading (or filtering) stage read, kept and skipped, row by row.

    Attributes:
      num_rows: rows the stage looked at.
      num_kept: rows that became records (or passed the filter).
      skipped: every left-out row with its source, row number and reason.
    """
    num_rows: int = 0
    num_kept: int = 0
    skipped: list[SkippedRow] = dataclasses.field(default_factory=list)
    columns: list[str] = dataclasses.field(default_factory=list)   # the top-level columns seen

    def skip(self, source: str, row: int, reason: str, detail: str = "") -> None:
        self.skipped.append(SkippedRow(source, row, reason, detail))

    def counts(self) -> dict[str, int]:
        """Number of skipped rows per reason, e.g. {"missing_ground_truth": 2}."""
        return dict(collections.Counter(s.reason for s in self.skipped))

    def num_skipped(self, reason: str | None = None) -> int:
        if reason is None:
            return len(self.skipped)
        return sum(s.reason == reason for s in self.skipped)

    def merge(self, other: DataReport) -> DataReport:
        """A new report holding both reports' rows (for several files loaded together)."""
        return DataReport(self.num_rows + other.num_rows, self.num_kept + other.num_kept,
                          self.skipped + other.skipped,
                          self.columns + [c for c in other.columns if c not in self.columns])

    def summary(self, max_listed: int = 10) -> str:
        """Human-readable summary for logs: totals, counts per reason, first skipped rows."""
        lines = [f"{self.num_kept} of {self.num_rows} rows kept, {len(self.skipped)} skipped"
                 + (f" {self.counts()}" if self.skipped else "")]
        lines += [f"  {s}" for s in self.skipped[:max_listed]]
        if len(self.skipped) > max_listed:
            lines.append(f"  ... and {len(self.skipped) - max_listed} more")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-able form (for a run's log directory)."""
        return {"num_rows": self.num_rows, "num_kept": self.num_kept, "counts": self.counts(),
                "skipped": [dataclasses.asdict(s) for s in self.skipped]}


def _get_path(row: Mapping, dotted: str) -> Any:
    """row["a"]["b"] for "a.b"; a literal key containing dots wins. _MISSING when absent."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _lookup(row: Mapping, field: str, fields: Mapping[str, str]) -> Any:
    if field in fields:
        return _get_path(row, fields[field])
    for name in DEFAULT_FIELDS[field]:
        value = _get_path(row, name)
        if value is not _MISSING and value is not None:
            return value
    return _MISSING


def _check_fields(fields: Mapping[str, str] | None) -> dict[str, str]:
    fields = dict(fields or {})
    unknown = set(fields) - set(DEFAULT_FIELDS)
    if unknown:
        raise ValueError(f"fields= has unknown keys {sorted(unknown)}; the normalized fields are "
                         f"{sorted(DEFAULT_FIELDS)} (map each to your column name, e.g. "
                         "{'ground_truth': 'reward_model.ground_truth'}).")
    return fields


def _normalize_prompt(value: Any) -> tuple[list[dict] | None, str | None, str, str]:
    """(prompt_messages, prompt_text, skip_reason, detail); skip_reason "" when usable."""
    if value is _MISSING or value is None:
        return None, None, EMPTY_PROMPT, "no prompt column"
    if isinstance(value, str):
        if not value.strip():
            return None, None, EMPTY_PROMPT, "prompt text is blank"
        return None, value, "", ""
    if isinstance(value, Sequence) or hasattr(value, "tolist"):  # list, tuple or numpy array
        value = value.tolist() if hasattr(value, "tolist") else list(value)
        if not value:
            return None, None, EMPTY_PROMPT, "prompt has no messages"
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                return None, None, BAD_PROMPT, (f"message {i} is not a {{'role': str, "
                                                f"'content': str}} dict: {m!r:.80}")
            role = SHAREGPT_ROLES.get(m["role"], m["role"])
            if role not in CHAT_ROLES:
                return None, None, BAD_PROMPT, (
                    f"message {i} has role {m['role']!r}; roles are {', '.join(CHAT_ROLES)} "
                    f"(ShareGPT's {', '.join(SHAREGPT_ROLES)} are read as "
                    f"{', '.join(SHAREGPT_ROLES.values())})")
            messages.append({"role": role, "content": m["content"]})
        # A system message alone is an instruction without a question: count it as empty.
        if not any(m["content"].strip() for m in messages if m["role"] != "system"):
            return None, None, EMPTY_PROMPT, "no non-blank user message"
        return messages, None, "", ""
    return None, None, BAD_PROMPT, (f"prompt is a {type(value).__name__}; expected text or a list "
                                    "of chat messages")


def _normalize_ground_truth(value: Any) -> Any:
    """Numbers become text ("42"), so every scorer sees str | dict | list. _MISSING when empty."""
    if value is _MISSING or value is None:
        return _MISSING
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalar or array from Parquet
        return _normalize_ground_truth(value.tolist())
    if isinstance(value, str) and not value.strip():
        return _MISSING
    if isinstance(value, (list, tuple, Mapping)) and len(value) == 0:
        return _MISSING
    if isinstance(value, tuple):
        return list(value)
    return value


def normalize_row(row: Any, *, source: str, row_index: int, report: DataReport,
                  fields: Mapping[str, str] | None = None,
                  data_source: str | None = None) -> dict | None:
    """Turns one raw row (veRL or flat layout) into a normalized record, or None when skipped.

    A skipped row is added to `report` with `row_index` and the reason. `data_source` fills in
    rows that have none (it never overrides a row's own value).
    """
    fields = _check_fields(fields)
    if not isinstance(row, Mapping):
        report.skip(source, row_index, NOT_AN_OBJECT, f"row is a {type(row).__name__}")
        return None
    messages, text, reason, detail = _normalize_prompt(_lookup(row, "prompt", fields))
    if reason:
        report.skip(source, row_index, reason, detail)
        return None
    ground_truth = _normalize_ground_truth(_lookup(row, "ground_truth", fields))
    try:        # the tokenizer and the verifiers take UTF-8: a lone surrogate cannot be encoded
        json.dumps([messages, text, ground_truth], ensure_ascii=False, default=str).encode()
    except UnicodeEncodeError as e:
        report.skip(source, row_index, INVALID_UNICODE,
                    f"{e.reason} at character {e.start} of the row's text (e.g. an escaped lone "
                    "surrogate such as \\ud800)")
        return None
    if ground_truth is _MISSING:
        looked = [fields["ground_truth"]] if "ground_truth" in fields else list(
            DEFAULT_FIELDS["ground_truth"])
        report.skip(source, row_index, MISSING_GROUND_TRUTH, f"no value in {looked}")
        return None
    row_source = _lookup(row, "data_source", fields)
    if row_source is _MISSING or row_source is None or row_source == "":
        row_source = data_source
    if not row_source:
        report.skip(source, row_index, MISSING_DATA_SOURCE,
                    "add a data_source column, or set --config.data.default_source=NAME (e.g. "
                    "math) for rows without one")
        return None
    extra_info = _lookup(row, "extra_info", fields)
    if extra_info is _MISSING or extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, Mapping):
        extra_info = {"value": extra_info}
    prompt = {"prompt_messages": messages} if messages is not None else {"prompt": text}
    return {**prompt, "data_source": str(row_source), "ground_truth": ground_truth,
            "extra_info": dict(extra_info), "row": row_index, "source": source}


def normalize_rows(rows: Iterable[tuple[int, Any]], *, source: str,
                   fields: Mapping[str, str] | None = None, data_source: str | None = None,
                   report: DataReport | None = None) -> tuple[list[dict], DataReport]:
    """normalize_row over (row_index, row) pairs; returns (records, report)."""
    report = report if report is not None else DataReport()
    records = []
    for row_index, row in rows:
        report.num_rows += 1
        if isinstance(row, Mapping) and len(report.columns) < 200:
            report.columns += [str(k) for k in row if str(k) not in report.columns]
        record = normalize_row(row, source=source, row_index=row_index, report=report,
                               fields=fields, data_source=data_source)
        if record is not None:
            records.append(record)
            report.num_kept += 1
    return records, report


def _require_records(records: list[dict], report: DataReport, source: str) -> None:
    if not records:
        columns = ", ".join(report.columns) if report.columns else "none (no row is a JSON object)"
        looked = "; ".join(f"{k} in {' / '.join(v)}" for k, v in DEFAULT_FIELDS.items()
                           if k != "extra_info")
        raise DataError(f"{source}: no usable rows. {report.summary()}\nIts columns: {columns}. "
                        f"Looked for {looked}. If your columns have other names, map them with "
                        "--config.data.fields='{\"prompt\": \"COLUMN\", \"ground_truth\": "
                        "\"COLUMN\"}' (fields= in Python).")


def _missing(source: str) -> DataFileNotFoundError:
    folder = os.path.dirname(source) or "."
    near = []
    if os.path.isdir(folder):
        import difflib
        near = difflib.get_close_matches(os.path.basename(source), os.listdir(folder), n=1)
    hint = f" Did you mean {os.path.join(folder, near[0])!r}?" if near else ""
    return DataFileNotFoundError(f"data file {source!r} not found.{hint}")


def load_jsonl(path: str | os.PathLike, *, fields: Mapping[str, str] | None = None,
               data_source: str | None = None) -> tuple[list[dict], DataReport]:
    """Loads a JSON-lines prompt file (one JSON object per line; blank lines are ignored).

    Returns (records, report). Lines that are not UTF-8, not valid JSON or not an object, or rows
    without a ground truth / with an empty prompt, are skipped and listed in the report
    (row = line - 1). Raises DataFileNotFoundError (a FileNotFoundError) for a missing file and
    DataError (a ValueError) naming the file and its columns when no row is usable.
    """
    source = os.fspath(path)
    report = DataReport()
    if not os.path.isfile(source):
        raise _missing(source)

    def rows() -> Iterator[tuple[int, Any]]:
        with open(source, "rb") as f:
            for line_index, raw in enumerate(f):
                try:
                    line = raw.decode("utf-8-sig" if line_index == 0 else "utf-8")
                except UnicodeDecodeError as e:
                    report.num_rows += 1
                    report.skip(source, line_index, NOT_UTF8,
                                f"byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield line_index, json.loads(line)
                except json.JSONDecodeError as e:
                    report.num_rows += 1
                    report.skip(source, line_index, INVALID_JSON, f"{e.msg} at column {e.colno}")

    records, report = normalize_rows(rows(), source=source, fields=fields,
                                     data_source=data_source, report=report)
    _require_records(records, report, source)
    return records, report


def load_parquet(path: str | os.PathLike, *, fields: Mapping[str, str] | None = None,
                 data_source: str | None = None,
                 read_batch_rows: int = 4096) -> tuple[list[dict], DataReport]:
    """Loads a Parquet prompt file, e.g. one written for veRL (see the module docstring).

    Rows are read `read_batch_rows` at a time so a large file never sits in memory twice.
    Returns (records, report); bad rows are skipped and listed with their 0-based row index.
    """
    import pyarrow.parquet as pq  # only needed here; keeps `import brorl_jax.data` light

    source = os.fspath(path)
    if not os.path.isfile(source):
        raise _missing(source)
    try:
        parquet_file = pq.ParquetFile(source)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(f"{source}: not a readable Parquet file ({e}).") from e
    report = DataReport(columns=list(parquet_file.schema_arrow.names))

    def rows() -> Iterator[tuple[int, Any]]:
        row_index = 0
        for batch in parquet_file.iter_batches(batch_size=read_batch_rows):
            for row in batch.to_pylist():
                yield row_index, row
                row_index += 1

    records, report = normalize_rows(rows(), source=source, fields=fields,
                                     data_source=data_source, report=report)
    _require_records(records, report, source)
    return records, report

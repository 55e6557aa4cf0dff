"""Prompt data: JSONL / Parquet (veRL layout) / Reasoning Gym sources -> tokenized grain batches.

    records, report = load_dataset("train.parquet")            # or "reasoning_gym:chain_sum"
    logging.info(report.summary())
    loader = make_prompt_loader(records, PromptTokenizer(tok, max_prompt_len=1024),
                                batch_size=128, seed=0)
    logging.info(loader.report.summary())                      # over-long prompts, counted
    it = iter(loader); batch = next(it); state = it.get_state()  # state: small JSON-able dict
"""
from brorl_jax.data.loader import (
    Prompt,
    PromptBatch,
    PromptIterator,
    PromptLoader,
    make_prompt_loader,
    tokenize_and_filter,
)
from brorl_jax.data.reasoning_gym_source import reasoning_gym_source
from brorl_jax.data.records import (
    DataReport,
    SkippedRow,
    load_jsonl,
    load_parquet,
    normalize_row,
)
from brorl_jax.data.sources import check_overlap, load_dataset, load_train_and_eval
from brorl_jax.data.tokenize import PromptTokenizer

__all__ = [
    "DataReport", "Prompt", "PromptBatch", "PromptIterator", "PromptLoader", "PromptTokenizer", "SkippedRow",
    "check_overlap", "load_dataset", "load_train_and_eval", "load_jsonl", "load_parquet",
    "make_prompt_loader", "normalize_row",
    "reasoning_gym_source", "tokenize_and_filter",
]

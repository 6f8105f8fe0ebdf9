"""Prompt datasets (jsonl, parquet), chat templates, tokenization and the per-step prompt sampler (one file,
or several pooled or mixed by weight: `mixture.py`)."""

from megatron_rl.data.dataset import SKIP_REASONS, LoadReport, Prompt, PromptDataset, SkippedRow, load_prompt_dataset
from megatron_rl.data.fields import MISSING, get_field
from megatron_rl.data.mixture import WeightedSampler, pooled
from megatron_rl.data.prompts import PromptFormatError, PromptRenderer, as_messages, render_prompt, uses_chat_template
from megatron_rl.data.readers import DataError, RawRow, RowLocation, iter_rows
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.data.tokenizer import TOKENIZER_FILES, check_tokenizer_vocab, has_tokenizer_files, load_tokenizer

__all__ = [
    "MISSING",
    "SKIP_REASONS",
    "TOKENIZER_FILES",
    "WeightedSampler",
    "DataError",
    "LoadReport",
    "Prompt",
    "PromptDataset",
    "PromptFormatError",
    "PromptRenderer",
    "PromptSampler",
    "RawRow",
    "RowLocation",
    "SkippedRow",
    "as_messages",
    "check_tokenizer_vocab",
    "get_field",
    "has_tokenizer_files",
    "iter_rows",
    "load_prompt_dataset",
    "load_tokenizer",
    "pooled",
    "render_prompt",
    "uses_chat_template",
]

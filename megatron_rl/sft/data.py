"""SFT examples: a prompt (rendered like RL prompts) and a target response, from jsonl/parquet rows.

A row is an RL task row plus the response under `data.response_key` (default "response"), e.g.
examples/tiny_math's sft.jsonl. The prompt goes through the same loading as RL prompts
(`data.prompt_key`, chat template, `data.max_prompt_tokens`); the response is tokenized without
special tokens and ends with the tokenizer's EOS token, as the chat template closes an assistant
turn. A row without a usable response is skipped and counted like a row without an answer (the
skip report names `data.response_key`'s value as the missing key, file and line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.config import DataConfig
from megatron_rl.data import DataError, LoadReport, load_prompt_dataset


@dataclass(frozen=True)
class SFTExample:
    """Token ids of one prompt and its target response (EOS included)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


def load_sft_examples(path: str | Path, tokenizer: Any, data: DataConfig) -> tuple[list[SFTExample], LoadReport]:
    """The usable examples of `path`, in file order, and the load report (skipped rows with reasons)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"data.tokenizer_path: the tokenizer {type(tokenizer).__name__} has no EOS token to end responses"
        )
    prompts = load_prompt_dataset(path, tokenizer, dataclasses.replace(data, answer_key=data.response_key))
    texts = list(dict.fromkeys(p.answer for p in prompts))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids_of = {text: (*ids, eos) for text, ids in zip(texts, encoded, strict=True)}
    examples = [SFTExample(tuple(p.input_ids), ids_of[p.answer]) for p in prompts]
    responses = LoadReport(str(path))
    for p in prompts:
        responses.count_unk(p.location, ids_of[p.answer], tokenizer.unk_token_id)
    responses.warn_unk("responses")
    prompts.report.unk_tokens += responses.unk_tokens
    prompts.report.unk_rows += responses.unk_rows
    return examples, prompts.report


def sft_batch(examples: Sequence[SFTExample]) -> ActorBatch:
    """The actor batch of `examples`: prompt + response tokens; the loss covers every response token."""
    if not examples:
        raise ValueError("sft_batch: no examples")
    return ActorBatch(
        tokens=[torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long) for e in examples],
        prompt_lengths=[len(e.prompt_ids) for e in examples],
    )

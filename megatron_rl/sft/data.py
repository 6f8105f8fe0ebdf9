"""SFT examples: a prompt (rendered like RL prompts) and a target response, from jsonl/parquet rows.

A row is an RL task row plus the response under `data.response_key` (default "response"), e.g.
examples/tiny_math's sft.jsonl. The prompt goes through the same loading as RL prompts
(`data.prompt_key`, chat template, `data.max_prompt_tokens`); the response is tokenized without
special tokens and ends with the tokenizer's EOS token, as the chat template closes an assistant
turn. A row without a usable response is skipped and counted like a row without an answer (the
skip report names `data.response_key`'s value as the missing key, file and line).

The response may also be a multi-turn trace, a list of messages that starts and ends with an
assistant turn, e.g. `[{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role":
"tool", "content": "56088"}, {"role": "assistant", "content": "Answer: 56088"}]`
(examples/tiny_tools). Its tokens are those of an RL episode (`megatron_rl.envs`): each assistant
turn's text and EOS, trained on; each other message rendered as an observation by the episodes'
`TurnRenderer` (the chat template's delimiters, the message, the next assistant header), out of the
loss.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.config import DataConfig
from megatron_rl.data import DataError, LoadReport, load_prompt_dataset
from megatron_rl.data.fields import get_field
from megatron_rl.envs import TurnRenderer


@dataclass(frozen=True)
class SFTExample:
    """Token ids of one prompt and its target response (EOS included); `loss_mask` [len(response_ids)]
    marks the tokens trained on (None = all: a single-turn response)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...] | None = None


def load_sft_examples(path: str | Path, tokenizer: Any, data: DataConfig) -> tuple[list[SFTExample], LoadReport]:
    """The usable examples of `path`, in file order, and the load report (skipped rows with reasons)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"data.tokenizer_path: the tokenizer {type(tokenizer).__name__} has no EOS token to end responses"
        )
    prompts = load_prompt_dataset(
        path, tokenizer, dataclasses.replace(data, answer_key=data.response_key), answer_messages=True
    )
    is_trace = [isinstance(get_field(p.raw, data.response_key), list) for p in prompts]
    texts = list(dict.fromkeys(p.answer for p, trace in zip(prompts, is_trace, strict=True) if not trace))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    targets: dict[tuple[bool, str], tuple[tuple[int, ...], tuple[bool, ...] | None]] = {
        (False, text): ((*ids, eos), None) for text, ids in zip(texts, encoded, strict=True)
    }
    renderer = TurnRenderer(tokenizer)
    for p, trace in zip(prompts, is_trace, strict=True):
        if trace and (True, p.answer) not in targets:
            targets[(True, p.answer)] = _trace_ids(json.loads(p.answer), tokenizer, renderer, eos)
    examples = [
        SFTExample(tuple(p.input_ids), *targets[(trace, p.answer)]) for p, trace in zip(prompts, is_trace, strict=True)
    ]
    responses = LoadReport(str(path))
    for p, trace in zip(prompts, is_trace, strict=True):
        responses.count_unk(p.location, targets[(trace, p.answer)][0], tokenizer.unk_token_id)
    responses.warn_unk("responses")
    prompts.report.unk_tokens += responses.unk_tokens
    prompts.report.unk_rows += responses.unk_rows
    return examples, prompts.report


def _trace_ids(
    messages: list[dict[str, str]], tokenizer: Any, renderer: TurnRenderer, eos: int
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(response ids, loss mask) of a multi-turn trace: assistant turns trained on, observations not."""
    ids: list[int] = []
    mask: list[bool] = []
    for message in messages:
        if message["role"] == "assistant":
            turn = [*tokenizer.encode(message["content"], add_special_tokens=False), eos]
            ids += turn
            mask += [True] * len(turn)
        else:
            observation = renderer.observation_ids(message["content"], message["role"], ids[-1])
            ids += observation
            mask += [False] * len(observation)
    return tuple(ids), tuple(mask)


def sft_batch(examples: Sequence[SFTExample]) -> ActorBatch:
    """The actor batch of `examples`: prompt + response tokens; the loss covers the response tokens
    of each example's loss mask (every one for a single-turn response)."""
    if not examples:
        raise ValueError("sft_batch: no examples")
    masks = None
    if any(e.loss_mask is not None for e in examples):
        masks = [
            torch.tensor(e.loss_mask if e.loss_mask is not None else [True] * len(e.response_ids), dtype=torch.bool)
            for e in examples
        ]
    return ActorBatch(
        tokens=[torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long) for e in examples],
        prompt_lengths=[len(e.prompt_ids) for e in examples],
        response_mask=masks,
    )

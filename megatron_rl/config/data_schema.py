"""The `data` and `eval` sections of the configuration tree (`megatron_rl.config.schema.Config`): where the
prompts come from, how several files mix, and how held-out prompts are evaluated."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.fields import described as _f


@dataclass
class DataConfig:
    train_path: str | None = _f(None, "training prompts (.jsonl or .parquet)")
    eval_path: str | None = _f(None, "held-out prompts for evaluation")
    tokenizer_path: str | None = _f(None, "tokenizer folder; null = model.hf_path")
    prompt_key: str = _f("prompt", "row key of the prompt (a string or chat messages); dots for nesting")
    answer_key: str = _f("reward_model.ground_truth", "row key of the reference answer; dots for nesting")
    response_key: str = _f(
        "response",
        "row key of the target response (megatron-rl sft): text, or a multi-turn trace as a list of chat "
        "messages (assistant turns trained on, the others out of the loss); dots for nesting",
    )
    apply_chat_template: bool = _f(True, "wrap prompts with the tokenizer's chat template when it has one")
    max_prompt_tokens: int = _f(1024, "longer prompts are skipped and counted", ge=1)
    shuffle: bool = _f(True, "shuffle prompts every epoch")
    seed: int = _f(1234, "data order seed")


@dataclass
class EvalConfig:
    every: int = _f(0, "evaluate every n steps; 0 = never", ge=0)
    max_prompts: int = _f(500, "held-out prompts per evaluation", ge=1)
    temperature: float = _f(0.0, "evaluation sampling temperature (0 = greedy)", ge=0)

"""The `data` and `eval` sections of the configuration tree (`megatron_rl.config.schema.Config`): where the
prompts come from, how several files mix, and how held-out prompts are evaluated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.config.fields import described as _f


@dataclass
class DataConfig:
    train_path: Any = _f(
        None,
        "training prompts: a .jsonl or .parquet file, or a list of them (one pool, every row once an epoch, "
        "unless data.train_weights)",
    )
    train_weights: list = _f(
        [],
        "with a list of train files: one weight per file; each prompt of a step comes from file i with "
        "probability weight_i / sum, each file drawn epoch by epoch in its own order; empty = one pool",
    )
    eval_path: Any = _f(
        None, "held-out prompts for evaluation: a file, or a list of them (metrics per file: eval/NAME/...)"
    )
    eval_names: list = _f(
        [], "with a list of eval files: the NAME of each in eval/NAME/... metrics; empty = the files' stems"
    )
    tokenizer_path: str | None = _f(
        None, "tokenizer folder; null = model.hf_path, else the hf_config/ of a converted checkpoint.load"
    )
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
    max_prompts: int = _f(500, "held-out prompts per evaluation (per file with a list of eval files)", ge=1)
    temperature: float = _f(0.0, "evaluation sampling temperature (0 = greedy)", ge=0)
    n_samples: int = _f(
        1,
        "responses per held-out prompt; > 1 (needs eval.temperature > 0) reports eval/mean@N (mean accuracy of "
        "the responses) and eval/pass@N (a prompt counts when any of its N responses is correct)",
        ge=1,
    )
    pass_k: list = _f(
        [],
        "with eval.n_samples = N: further k < N reported as eval/pass@k by the Codex paper's unbiased "
        "estimator 1 - C(N - c, k) / C(N, k) (c correct of the N), averaged over prompts",
    )

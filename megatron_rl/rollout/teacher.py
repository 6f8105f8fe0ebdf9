"""On-policy distillation's teacher on the rollout side: its engine, the check of its tokenizer, its errors.

The teacher is a second engine handle (`engine.RolloutEngine`) on the rollout loop: a local engine the run
starts on `distill.teacher` (a Hugging Face folder, served at the folder's dtype), or `distill.teacher_urls`
(SGLang servers or a router). It answers `prompt_logprobs` (a prefill only: `GenerationClient.prompt_logprobs`), or
with `distill.mode = forward_topk` `prompt_scores` (the top `distill.top_k` tokens at each position too),
through the same client, so its failures are the rollout engine's: connection errors and 502/503/504 retried
(`rollout.max_retries`, backoff, failover), a dead local teacher restarted (`rollout.max_engine_restarts`; its
weights never change, so nothing is resynced), and past that a `TeacherError`, which stops the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.types import PromptScores


class TeacherError(RuntimeError):
    """The teacher could not score a step's samples: the run stops, nothing trained on a missing score."""


class Teacher(Protocol):
    """What distillation asks of the teacher's engine (`engine.RolloutEngine`, the tests' fakes)."""

    async def prompt_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Each sequence's log-prob of every token from its start on, given the tokens before it."""
        ...

    async def prompt_scores(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int], top_k: int
    ) -> list[PromptScores]:
        """The same, with the `top_k` most likely tokens at each of those positions (`distill.mode = forward_topk`)."""
        ...

    def close(self) -> None: ...


def teacher_rollout(rollout: Any, distill: Any) -> Any:
    """The `rollout` section as the teacher's engine reads it: its own address or folder and key, a free port,
    no per-token weight versions (the teacher's weights never change)."""
    return dataclasses.replace(
        rollout,
        engine="sglang" if distill.teacher_urls else "local",
        sglang_urls=list(distill.teacher_urls),
        api_key=distill.api_key or rollout.api_key,
        port=None,
        partial_rollout=False,
        return_routed_experts=False,
    )


def start_teacher(rollout: Any, distill: Any, loop: RolloutLoop, log_path: str) -> Any:
    """The teacher's engine handle on `loop` (a local engine on `distill.teacher` is started and waited for;
    its log goes to `log_path`)."""
    from megatron_rl.rollout.engine import RolloutEngine

    return RolloutEngine.from_config(
        teacher_rollout(rollout, distill), loop, model_path=distill.teacher, log_path=log_path
    )


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """The first difference of two Hugging Face tokenizers in what token ids mean (vocabulary size, a token's
    string, the special tokens' ids), in words; None when they tokenize alike."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if len(mine) != len(theirs):
        return f"the student's vocabulary has {len(mine)} tokens, the teacher's {len(theirs)}"
    by_id_mine = {i: t for t, i in mine.items()}
    by_id_theirs = {i: t for t, i in theirs.items()}
    for token_id in sorted(set(by_id_mine) | set(by_id_theirs)):
        a, b = by_id_mine.get(token_id), by_id_theirs.get(token_id)
        if a != b:
            return f"token id {token_id} is {a!r} for the student, {b!r} for the teacher"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} is {a} for the student, {b} for the teacher"
    return None

"""On-policy distillation in the rollout runtime: the teacher scores every generated sample, its tokenizer is
checked first, and each step reports what it cost.

`score_with_teacher` runs on the rollout loop inside the collector's `generate`, right after a round's (or, in
`fully_async`, a group's) episodes: so it overlaps with the generation of the other rounds or groups (and in
`one_step_off` with training), and a fully asynchronous group enters the buffer, under the staleness bound,
only once scored. Each sequence of an episode (`segments_of`) is sent whole, its prompt unscored: the teacher
returns the log-prob of every output token, observation tokens too, which the advantage leaves out
(`samples.distill_advantage`; with `distill.mode = forward_topk`, the loss mask in the trainer). With
`forward_topk` the teacher also gives its top `distill.top_k` tokens at every output token, which go to the
trainer in the step batch (`ActorBatch.teacher_top_ids`, `teacher_top_logprobs`). Aborted episodes are never trained on and not scored. A teacher that fails
past its retries (and restarts) raises `TeacherError`: the step fails, no sample goes on without its score.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.config import Config, ConfigError
from megatron_rl.envs import Trajectory, segments_of
from megatron_rl.rollout.sglang import SGLangError
from megatron_rl.rollout.teacher import Teacher, TeacherError, tokenizer_difference
from megatron_rl.rollout.types import PromptScores


def check_teacher_tokenizer(cfg: Config, student: Any) -> None:
    """ConfigError naming the first difference when the teacher's tokenizer (`distill.tokenizer`, else the
    `distill.teacher` folder) is not the student's (`student`: the run's tokenizer)."""
    from megatron_rl.data import load_tokenizer

    key = "distill.tokenizer" if cfg.distill.tokenizer else "distill.teacher"
    path = cfg.distill.tokenizer or cfg.distill.teacher
    assert path is not None  # check_distill: a teacher folder, or teacher_urls with distill.tokenizer
    difference = tokenizer_difference(student, load_tokenizer(path, key))
    if difference is not None:
        raise ConfigError(
            f"{key} = {path!r}: the teacher's tokenizer differs from the student's ({difference}); on-policy "
            "distillation scores the student's token ids with the teacher, so both need one tokenizer"
        )


@dataclass
class TeacherMeter:
    """The teacher's work since the last `take`: sequences and tokens scored, seconds spent."""

    tokens: int = 0
    seconds: float = 0.0

    def take(self) -> dict[str, float]:
        """`distill/teacher_tokens_per_s` and `time/teacher` (the seconds the loop spent waiting for the
        teacher) since the last call, then zero."""
        out = {
            "distill/teacher_tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "time/teacher": self.seconds,
        }
        self.tokens, self.seconds = 0, 0.0
        return out


async def score_with_teacher(
    teacher: Teacher, episodes: Sequence[Trajectory], meter: TeacherMeter, top_k: int = 0
) -> None:
    """Set `teacher_logprobs` on every sequence of the episodes that were not aborted (see the module doc), and
    with `top_k` (`distill.mode = forward_topk`) `teacher_top_ids` / `teacher_top_logprobs` too."""
    sequences = [seq for e in episodes if not e.aborted for seq in segments_of(e) if seq.output_ids]
    if not sequences:
        return
    began = time.perf_counter()
    tokens, starts = [seq.prompt_ids + seq.output_ids for seq in sequences], [len(seq.prompt_ids) for seq in sequences]
    try:
        if top_k:
            scores = await teacher.prompt_scores(tokens, starts, top_k)
        else:
            scores = [PromptScores(v, [], []) for v in await teacher.prompt_logprobs(tokens, starts)]
    except SGLangError as err:
        raise TeacherError(
            f"the teacher could not score {len(sequences)} sample(s): {err}; stopping (nothing is trained on a "
            "missing teacher score)"
        ) from err
    for seq, score in zip(sequences, scores, strict=True):
        if len(score.logprobs) != len(seq.output_ids):
            raise TeacherError(
                f"the teacher gave {len(score.logprobs)} log-probs for {len(seq.output_ids)} output tokens"
            )
        seq.teacher_logprobs = score.logprobs
        if top_k:
            rows = [len(score.top_ids), len(score.top_logprobs)]
            widths = {len(r) for r in (*score.top_ids, *score.top_logprobs)}
            if rows != [len(seq.output_ids)] * 2 or widths != {top_k}:
                raise TeacherError(
                    f"the teacher gave top-k rows {rows} of widths {sorted(widths)} for {len(seq.output_ids)} "
                    f"output tokens and distill.top_k = {top_k}"
                )
            seq.teacher_top_ids, seq.teacher_top_logprobs = score.top_ids, score.top_logprobs
    meter.seconds += time.perf_counter() - began
    meter.tokens += sum(len(t) for t in tokens)


def reverse_kl_metrics(sequences: Sequence[Trajectory]) -> dict[str, float]:
    """`distill/reverse_kl`: the mean over the generated tokens of log pi_student - log pi_teacher (the k1
    estimate of KL(pi_student || pi_teacher) per token) of the sequences the teacher scored."""
    gaps = [
        torch.tensor(seq.logprobs, dtype=torch.float64)[mask]
        - torch.tensor(seq.teacher_logprobs, dtype=torch.float64)[mask]
        for seq in sequences
        if seq.teacher_logprobs is not None
        for mask in [torch.tensor(seq.loss_mask, dtype=torch.bool)]
    ]
    tokens = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)
    return {"distill/reverse_kl": float(tokens.mean()) if tokens.numel() else 0.0}

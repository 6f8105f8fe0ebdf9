"""Batched scoring: rewards for many responses, with a failing reward function counted, never fatal."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any

from megatron_rl.rewards.registry import RewardFn, resolve_rule
from megatron_rl.rewards.rules import Verdict

if TYPE_CHECKING:
    from megatron_rl.config import RewardConfig

logger = logging.getLogger(__name__)
_MAX_ERRORS_KEPT = 5


@dataclass
class RewardStats:
    """Counts over scored responses: correct, without an extractable answer, and failed (raised)."""

    count: int = 0
    correct: int = 0
    no_answer: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failure messages

    def merge(self, other: RewardStats) -> RewardStats:
        """The counts of both (e.g. over the generation rounds of one step)."""
        return RewardStats(
            self.count + other.count,
            self.correct + other.correct,
            self.no_answer + other.no_answer,
            self.failed + other.failed,
            self.reward_sum + other.reward_sum,
            (self.errors + other.errors)[:_MAX_ERRORS_KEPT],
        )

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        n = max(self.count, 1)
        return {
            f"{prefix}mean": self.reward_sum / n,
            f"{prefix}accuracy": self.correct / n,
            f"{prefix}no_answer_fraction": self.no_answer / n,
            f"{prefix}failures": float(self.failed),
            f"{prefix}count": float(self.count),
        }


@dataclass
class RewardResult:
    """Per response: reward, whether it is correct, whether the reward function failed, and the
    extracted final answer (None when none was found, the function failed or does not report one)."""

    rewards: list[float]
    correct: list[bool]
    failed: list[bool]
    extracted: list[str | None]
    stats: RewardStats


class RewardScorer:
    """Scores responses against reference answers with the rule of a `reward` config section.

    Built-in rules give reward.correct_reward / reward.incorrect_reward. A custom function may return a
    bool (mapped the same way) or a finite number (the reward; counted correct when >= correct_reward).
    When the function raises or returns anything else, that response gets reward.failure_reward and
    the failure is counted in the stats.
    """

    def __init__(self, cfg: RewardConfig, rule: RewardFn | None = None) -> None:
        self.cfg = cfg
        self.rule = rule if rule is not None else resolve_rule(cfg)
        self._failure_logged = False

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if len(responses) != len(answers):
            raise ValueError(f"RewardScorer.score: {len(responses)} responses but {len(answers)} answers")
        result = RewardResult([], [], [], [], RewardStats())
        stats = result.stats
        for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
            try:
                reward, correct, extracted, found = self._interpret(self.rule(response, answer))
            except Exception as err:  # any failure of user or library code is one failed sample
                self._log_failure(err)
                if len(stats.errors) < _MAX_ERRORS_KEPT:
                    stats.errors.append(f"response {i}: {type(err).__name__}: {err}")
                reward, correct, extracted, found = float(self.cfg.failure_reward), False, None, True
                stats.failed += 1
                result.failed.append(True)
            else:
                result.failed.append(False)
            result.rewards.append(reward)
            result.correct.append(correct)
            result.extracted.append(extracted)
            stats.count += 1
            stats.correct += correct
            stats.no_answer += not found
            stats.reward_sum += reward
        return result

    def _interpret(self, out: Any) -> tuple[float, bool, str | None, bool]:
        """(reward, correct, extracted answer, answer found) of a rule's return value."""
        if isinstance(out, Verdict):
            return self._binary(out.correct), out.correct, out.extracted, out.extracted is not None
        if isinstance(out, bool):
            return self._binary(out), out, None, True
        if isinstance(out, Real) and math.isfinite(float(out)):
            value = float(out)
            return value, value >= self.cfg.correct_reward, None, True
        raise TypeError(f"the reward function returned {out!r}; expected a bool or a finite number")

    def _binary(self, correct: bool) -> float:
        return float(self.cfg.correct_reward if correct else self.cfg.incorrect_reward)

    def _log_failure(self, err: Exception) -> None:
        if not self._failure_logged:
            self._failure_logged = True
            logger.warning(
                "reward function failed (reward.failure_reward is used; later failures are only counted)", exc_info=err
            )

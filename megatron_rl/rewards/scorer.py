"""Batched scoring: rewards for many responses, a failing reward function counted, and fatal only
beyond `reward.max_failure_frac` of a step's responses. Local rules run in worker processes
(`rewards/workers.py`), each response under `reward.item_timeout_s`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rl.rewards.protocol import ItemError, RewardItem, RuleOutput
from megatron_rl.rewards.registry import RULE_NAMES, RewardFn, extra_arguments, resolve_rule, rule_caller

if TYPE_CHECKING:
    from megatron_rl.config import RewardConfig
    from megatron_rl.rewards.remote import LoopRunner, RemoteRewardClient
    from megatron_rl.rewards.workers import RewardWorkers

logger = logging.getLogger(__name__)
_MAX_ERRORS_KEPT = 5


class RewardFailureError(RuntimeError):
    """More than `reward.max_failure_frac` of a step's responses could not be scored."""


@dataclass
class RewardStats:
    """Counts over scored responses: correct, without an extractable answer, failed (raised, timed out
    or not answered), and timed out (past reward.item_timeout_s or the server's --item-timeout-s; also
    counted in `failed`)."""

    count: int = 0
    correct: int = 0
    no_answer: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failure messages
    timeouts: int = 0

    def merge(self, other: RewardStats) -> RewardStats:
        """The counts of both (e.g. over the generation rounds of one step)."""
        return RewardStats(
            count=self.count + other.count,
            correct=self.correct + other.correct,
            no_answer=self.no_answer + other.no_answer,
            failed=self.failed + other.failed,
            reward_sum=self.reward_sum + other.reward_sum,
            errors=(self.errors + other.errors)[:_MAX_ERRORS_KEPT],
            timeouts=self.timeouts + other.timeouts,
        )

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        n = max(self.count, 1)
        return {
            f"{prefix}mean": self.reward_sum / n,
            f"{prefix}accuracy": self.correct / n,
            f"{prefix}no_answer_fraction": self.no_answer / n,
            f"{prefix}failures": float(self.failed),
            f"{prefix}timeouts": float(self.timeouts),
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


class ScoredPrompt(Protocol):
    """What scoring needs of a prompt (`megatron_rl.data.Prompt` has it): the rendered text the model
    saw, the reference answer and the data row."""

    text: str
    answer: str
    raw: Mapping[str, Any]


class RewardScorer:
    """Scores responses against reference answers with the rule of a `reward` config section.

    Built-in rules give reward.correct_reward / reward.incorrect_reward. A custom function may return a
    bool (mapped the same way) or a finite number (the reward; counted correct when >= correct_reward).
    When the function raises or returns anything else, that response gets reward.failure_reward and
    the failure is counted in the stats (the loop leaves its group out, and `check_failures` stops the
    run beyond reward.max_failure_frac). The rule of reward.type runs in reward.workers processes
    (`rewards/workers.py`, started at the first `score`; `close` ends them), and a response scored
    longer than reward.item_timeout_s is such a failure, counted in `RewardStats.timeouts` too. With
    reward.type = remote the reward server runs the function (`rewards/remote.py`); a batch the server
    does not answer, or answers against the protocol, is counted the same way; its client runs on the
    rollout runtime's loop (`run`: `RolloutLoop.run`). An explicit `rule` runs in this thread, with no time
    limit.
    """

    def __init__(self, cfg: RewardConfig, rule: RewardFn | None = None, run: LoopRunner | None = None) -> None:
        self.cfg = cfg
        self.remote: RemoteRewardClient | None = None
        self.workers: RewardWorkers | None = None
        if rule is None and cfg.type == "remote":
            from megatron_rl.rewards.remote import RemoteRewardClient

            if run is None:
                raise ValueError("reward.type = 'remote' scores on the rollout runtime's loop: pass its `run`")
            self.remote = RemoteRewardClient.from_config(cfg, run)
            self.remote.check()
        elif rule is not None:
            self._call = rule_caller(rule)
        else:
            from megatron_rl.rewards.workers import RewardWorkers

            function = resolve_rule(cfg)  # a function that cannot load fails here, naming the setting
            self._extras = extra_arguments(function)  # what else the items must carry to the workers
            spec, where = (
                (cfg.type, f"reward.type = {cfg.type!r}")
                if cfg.type in RULE_NAMES
                else (str(cfg.custom_function), f"reward.custom_function = {cfg.custom_function!r}")
            )
            self.workers = RewardWorkers(
                spec, cfg.workers, cfg.item_timeout_s, where=where, timeout_name="reward.item_timeout_s"
            )

    def score_prompts(self, responses: Sequence[str], prompts: Sequence[ScoredPrompt]) -> RewardResult:
        """`score` of response i against prompts[i]'s answer, with its text and data row."""
        return self.score(responses, [p.answer for p in prompts], [p.text for p in prompts], [p.raw for p in prompts])

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str] | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Rewards of `responses` against `answers`; `prompts` and `rows` (optional) reach functions
        that take them and the reward server."""
        for name, values in (("answers", answers), ("prompts", prompts), ("rows", rows)):
            if values is not None and len(values) != len(responses):
                raise ValueError(f"RewardScorer.score: {len(responses)} responses but {len(values)} {name}")
        items = [
            RewardItem(response, answer, prompts[i] if prompts else None, rows[i] if rows else None)
            for i, (response, answer) in enumerate(zip(responses, answers, strict=True))
        ]
        outputs: Sequence[RuleOutput | Exception]
        if self.remote is not None:
            outputs = self.remote.score(items)
        elif self.workers is not None:
            outputs = self.workers.score([self._strip(item) for item in items])
        else:
            outputs = [self._local(item) for item in items]
        result = RewardResult([], [], [], [], RewardStats())
        stats = result.stats
        for i, out in enumerate(outputs):
            if isinstance(out, Exception):
                if not stats.failed:
                    logger.debug("the first reward failure of %d responses", len(outputs), exc_info=out)
                if len(stats.errors) < _MAX_ERRORS_KEPT:
                    # an ItemError's message names the function's exception already
                    message = str(out) if isinstance(out, ItemError) else f"{type(out).__name__}: {out}"
                    stats.errors.append(f"response {i}: {message}")
                reward, correct, extracted, found = float(self.cfg.failure_reward), False, None, True
                stats.failed += 1
                stats.timeouts += int(isinstance(out, ItemError) and out.timeout)
                result.failed.append(True)
            else:
                reward, correct, extracted, found = self._interpret(out)
                result.failed.append(False)
            result.rewards.append(reward)
            result.correct.append(correct)
            result.extracted.append(extracted)
            stats.count += 1
            stats.correct += correct
            stats.no_answer += not found
            stats.reward_sum += reward
        return result

    def _strip(self, item: RewardItem) -> RewardItem:
        """`item` without the prompt and row when the function does not take them (less to send)."""
        prompt = item.prompt if "prompt" in self._extras else None
        row = item.row if "row" in self._extras else None
        same = prompt is item.prompt and row is item.row
        return item if same else RewardItem(item.response, item.answer, prompt, row)

    def close(self) -> None:
        """End the reward worker processes (idempotent; a batch still scoring fails, later ones raise)."""
        if self.workers is not None:
            self.workers.close()

    def _local(self, item: RewardItem) -> RuleOutput | Exception:
        try:
            return RuleOutput.of(self._call(item.response, item.answer, item.prompt, item.row))
        except Exception as err:  # any failure of user or library code is one failed sample
            return err

    def _interpret(self, out: RuleOutput) -> tuple[float, bool, str | None, bool]:
        """(reward, correct, extracted answer, answer found) of a rule's output."""
        if out.correct is not None:
            return self._binary(out.correct), out.correct, out.extracted, out.found
        return out.score, out.score >= self.cfg.correct_reward, None, True

    def _binary(self, correct: bool) -> float:
        return float(self.cfg.correct_reward if correct else self.cfg.incorrect_reward)

    @property
    def source(self) -> str:
        """What scores the responses, as the configuration names it."""
        if self.remote is not None:
            return f"the reward server at reward.url = {self.remote.url}"
        if self.cfg.type == "custom":
            return f"reward.custom_function = {self.cfg.custom_function!r}"
        return f"the reward rule reward.type = {self.cfg.type!r}"

    def check_failures(self, stats: RewardStats, where: str) -> None:
        """Raise RewardFailureError, one line naming the source and the first failure, when more than
        reward.max_failure_frac of the responses counted in `stats` failed (`where`: e.g. "step 3")."""
        limit = self.cfg.max_failure_frac
        if stats.failed <= limit * stats.count:
            return
        first = " ".join(stats.errors[0].split()) if stats.errors else "no message"
        raise RewardFailureError(
            f"{where}: {stats.failed} of {stats.count} rewards failed ({stats.failed / stats.count:.0%}, above "
            f"reward.max_failure_frac = {limit:g}) from {self.source}; first: {first}"
        )

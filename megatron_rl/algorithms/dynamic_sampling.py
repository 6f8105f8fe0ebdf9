"""DAPO's dynamic sampling: keep only prompt groups whose rewards differ, and sample until the batch is full.

A group whose responses all got the same reward has zero advantage everywhere, hence no policy
gradient; DAPO over-samples and drops such groups. `filter_groups` finds them in one generation
batch; `DynamicSamplingAccumulator` collects kept groups over generation rounds until the target
number of groups is reached or `algorithm.max_gen_rounds` rounds have run, in which case the
groups kept so far are used as they are and `target_missed` is set in the metrics.

A user's filter (`algorithm.dynamic_sampling_filter`, slime's `--dynamic-sampling-filter-path`) takes
the place of the reward spread: `user_filter` keeps the groups for which it returns True.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GroupFilter:
    """keep_groups: [num_groups] bool; keep_samples: [num_groups * group_size] bool; kept/total: group counts."""

    keep_groups: torch.Tensor
    keep_samples: torch.Tensor
    kept: int
    total: int


def filter_groups(rewards: torch.Tensor, group_size: int, *, min_spread: float = 0.0) -> GroupFilter:
    """Keep the groups whose reward spread (max - min) is above `min_spread` (default: any difference).

    `rewards`: [N] with the responses of one prompt contiguous (N = num_groups * group_size); pass
    the quantity DAPO filters on (accuracy, or the final reward).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"filter_groups: rewards of shape {tuple(rewards.shape)} do not split into groups of group_size={group_size}"
        )
    grouped = rewards.view(-1, group_size)
    spread = grouped.amax(dim=-1) - grouped.amin(dim=-1)
    keep = spread > min_spread
    return GroupFilter(
        keep_groups=keep,
        keep_samples=keep.repeat_interleave(group_size),
        kept=int(keep.sum()),
        total=int(keep.numel()),
    )


class GroupFilterError(RuntimeError):
    """A user's group filter raised, or returned something other than a bool."""


def user_filter(keep: Callable[[Any], Any], groups: Sequence[Any], group_size: int, name: str) -> GroupFilter:
    """Keep the groups for which `keep(group)` returns True (a bool, or a 0-dim numpy/torch bool);
    `name` names the function in the GroupFilterError of a call that raised or returned anything else."""
    verdicts = []
    for k, group in enumerate(groups):
        try:
            verdict = keep(group)
        except Exception as err:
            raise GroupFilterError(f"{name} raised on group {k} of the round: {err!r}") from err
        value = verdict.item() if getattr(verdict, "ndim", None) == 0 else verdict
        if not isinstance(value, bool):
            raise GroupFilterError(
                f"{name} returned {type(verdict).__name__} {verdict!r} for group {k} of the round: "
                "it must return True (keep the group) or False (drop it)"
            )
        verdicts.append(value)
    keep_groups = torch.tensor(verdicts, dtype=torch.bool)
    return GroupFilter(
        keep_groups=keep_groups,
        keep_samples=keep_groups.repeat_interleave(group_size),
        kept=int(keep_groups.sum()),
        total=len(verdicts),
    )


@dataclass
class DynamicSamplingResult:
    """groups: the kept group payloads, in arrival order, at most the target number.
    rewards: [len(groups) * group_size] float32, the rewards of those groups.
    metrics: rounds, groups_generated, groups_kept (informative, before trimming), groups_used,
    groups_surplus (kept but beyond the target), target_missed (1.0 when max rounds ran out).
    """

    groups: list[Any]
    rewards: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class DynamicSamplingAccumulator:
    """Collects informative groups over generation rounds.

    Usage: `while not acc.done: acc.add(rewards, groups)` with one generation batch per call
    (`groups[k]` is the caller's payload for group k, e.g. its samples; `rewards` as in
    `filter_groups`), then `acc.result()`. With `keep` (a user's filter, named `keep_name` in its
    errors), `keep(groups[k])` decides in place of the reward spread (`user_filter`).
    """

    def __init__(
        self,
        target_groups: int,
        group_size: int,
        max_rounds: int,
        *,
        min_spread: float = 0.0,
        keep: Callable[[Any], Any] | None = None,
        keep_name: str = "the group filter",
    ) -> None:
        if target_groups < 1 or group_size < 1 or max_rounds < 1:
            raise ValueError(
                f"DynamicSamplingAccumulator: target_groups ({target_groups}), group_size ({group_size}) "
                f"and max_rounds ({max_rounds}) must be >= 1"
            )
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.min_spread = min_spread
        self.keep = keep
        self.keep_name = keep_name
        self.rounds = 0
        self.generated = 0
        self._groups: list[Any] = []
        self._rewards: list[torch.Tensor] = []

    @property
    def kept(self) -> int:
        return len(self._groups)

    @property
    def done(self) -> bool:
        """True once the target is reached or the rounds are used up."""
        return self.kept >= self.target_groups or self.rounds >= self.max_rounds

    def add(self, rewards: torch.Tensor, groups: Sequence[Any]) -> GroupFilter:
        """Filter one generation batch and keep its informative groups; returns that batch's filter."""
        if self.rounds >= self.max_rounds:
            raise RuntimeError(f"DynamicSamplingAccumulator.add: all {self.max_rounds} rounds are already used")
        if self.keep is None:
            filt = filter_groups(rewards, self.group_size, min_spread=self.min_spread)
        else:
            filt = user_filter(self.keep, groups, self.group_size, self.keep_name)
        if len(groups) != filt.total:
            raise ValueError(f"DynamicSamplingAccumulator.add: {len(groups)} group payloads for {filt.total} groups")
        grouped = rewards.float().view(-1, self.group_size)
        for k in torch.nonzero(filt.keep_groups).flatten().tolist():
            self._groups.append(groups[k])
            self._rewards.append(grouped[k])
        self.rounds += 1
        self.generated += filt.total
        return filt

    def result(self) -> DynamicSamplingResult:
        """The kept groups, trimmed to the target; `target_missed` when fewer were found."""
        used = min(self.kept, self.target_groups)
        rewards = torch.cat(self._rewards[:used]) if used else torch.zeros(0)
        metrics = {
            "rounds": float(self.rounds),
            "groups_generated": float(self.generated),
            "groups_kept": float(self.kept),
            "groups_used": float(used),
            "groups_surplus": float(self.kept - used),
            "target_missed": float(used < self.target_groups),
        }
        return DynamicSamplingResult(groups=self._groups[:used], rewards=rewards, metrics=metrics)

"""The episode: one `Trajectory` per episode from the engine's answers to the actor batch.

The engine answers each `/generate` with a `Sample` (`rollout.types`: one response); an episode
(`envs.episodes`, or an agent's through the gateway) appends its turns' samples and the observations
between them to one `Trajectory`, the only episode type from there on: the rewards, dynamic sampling,
the asynchronous buffer and the sample builder (`loop.samples`) all take trajectories.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_rl.rollout.types import Finished, Sample


@dataclass
class Trajectory(Finished):
    """A whole episode: `output_ids` is everything after the prompt (generated and observation tokens),
    `logprobs` the engine's on generated tokens and 0 on observations; the engine's fields of the last
    turn (`finish_reason`, `matched_stop`, `weight_version`, `rid`, `server`, `meta_info`), per output
    token its weight version (`weight_versions`) and, over the whole sequence, its routed experts (R3).
    Per output token: `loss_mask` (True = generated), `turn_of_token` (the turn it belongs to or
    follows). `turn_rewards`: one per generated turn (the environment's, 0 when it gave none).
    `earlier_segments`: an agent episode's segments before this one (a call through the gateway that
    rewrote the history began each next one), trained as sequences of their own with this
    trajectory's reward and advantage (`segments_of`)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the last turn's: "stop", "length" or "abort"
    matched_stop: int | str | None = None
    routed_experts: np.ndarray | None = None  # int32 [len(prompt) + len(output) - 1, layers, top_k]
    weight_version: str | None = None
    weight_versions: list[str] | None = None  # one per output token; None = the engine reported none
    rid: str = ""
    server: str = ""
    meta_info: dict = field(default_factory=dict, repr=False)
    loss_mask: list[bool] = field(default_factory=list)
    turn_of_token: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    end_reason: str = ""
    events: Counter = field(default_factory=Counter)
    earlier_segments: list[Trajectory] = field(default_factory=list)
    # on-policy distillation: the teacher's log-prob of every output token (observations' unused), once scored
    teacher_logprobs: list[float] | None = None
    # distill.mode = forward_topk: per output token the teacher's top-k token ids and their log-probs
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)


def segments_of(episode: Trajectory) -> list[Trajectory]:
    """The sequences an episode trains, in order: its earlier segments, then the episode itself."""
    return [*episode.earlier_segments, episode]


@dataclass
class RoutedExperts:
    """A trajectory's routed experts per token, assembled over its calls: each position from the first
    call whose routing covers it."""

    parts: list[np.ndarray] = field(default_factory=list)
    covered: int = 0

    def add(self, rows: Any) -> np.ndarray:
        """The call's routing (one row per position it covers); the whole trajectory's so far."""
        rows = np.asarray(rows)
        self.parts.append(rows[self.covered :])
        self.covered = max(self.covered, rows.shape[0])
        return np.concatenate(self.parts, axis=0)


def append_generated(traj: Trajectory, sample: Sample, turn: int, routed: RoutedExperts) -> None:
    """The engine's turn `turn` (`sample`) appended: trained tokens with the engine's log-probs, their
    weight versions and routing; the sample's finish fields; a turn reward of 0 for now."""
    out = list(sample.output_ids)
    if not sample.aborted and (sample.logprobs is None or len(sample.logprobs) != len(out)):
        raise RuntimeError(f"rollout engine: turn {turn} returned {len(out)} tokens but no log-prob for each")
    traj.output_ids += out
    traj.logprobs += list(sample.logprobs or [0.0] * len(out))
    traj.loss_mask += [True] * len(out)
    traj.turn_of_token += [turn] * len(out)
    # per-token weight versions across turns (a turn's tokens may span weight updates: partial rollouts)
    turn_versions = sample.weight_versions or [sample.weight_version or "default"] * len(out)
    traj.weight_versions = [*(traj.weight_versions or []), *turn_versions]
    for name in ("finish_reason", "matched_stop", "weight_version", "rid", "server", "meta_info"):
        setattr(traj, name, getattr(sample, name))
    if sample.routed_experts is not None:
        traj.routed_experts = routed.add(sample.routed_experts)
    traj.turn_rewards.append(0.0)


def append_observation(traj: Trajectory, ids: list[int], turn: int) -> None:
    """Message tokens after turn `turn` appended: not trained (mask 0, log-prob 0), of the last turn's version."""
    versions = traj.weight_versions or []
    last = versions[-1] if versions else "default"
    traj.weight_versions = versions + [last] * len(ids)
    traj.output_ids += ids
    traj.logprobs += [0.0] * len(ids)
    traj.loss_mask += [False] * len(ids)
    traj.turn_of_token += [turn] * len(ids)


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`env/turns_mean`, `env/end_<reason>` and `env/<event>` counts of a set of trajectories."""
    n = max(len(trajectories), 1)
    metrics = {"env/turns_mean": sum(t.turns for t in trajectories) / n}
    for t in trajectories:
        key = f"env/end_{t.end_reason}"
        metrics[key] = metrics.get(key, 0.0) + 1.0
        for event, count in t.events.items():
            metrics[f"env/{event}"] = metrics.get(f"env/{event}", 0.0) + float(count)
    return metrics

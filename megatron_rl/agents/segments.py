"""An agent episode's state in the gateway: its segments (one trajectory each), counts and limits.

A call whose messages extend a segment's conversation (`Segment.extended_by`: its messages, the
gateway's last answer as it was or without its tool calls, then new messages) continues it; any
other call starts a new segment. A call appends the new messages' tokens (loss mask 0) and the
engine's (`append_call`, as `run_episodes` appends observations and turns), cut at a stop string
first when one came (`cut_at_stop`).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_rl.envs.trajectory import RoutedExperts, Trajectory, append_generated, append_observation
from megatron_rl.rollout.types import Sample


def message_key(message: dict[str, Any]) -> tuple:
    """What makes two messages the same turn of a conversation: role, content, the tools called."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls", ())
    )
    return message["role"], message["content"].strip(), calls


@dataclass
class Segment:
    """One trajectory of an episode: its prompt, the trajectory, the conversation's message keys."""

    prompt_ids: list[int]
    traj: Trajectory
    keys: list[tuple] = field(default_factory=list)
    routed: RoutedExperts = field(default_factory=RoutedExperts)

    @classmethod
    def fresh(cls, prompt_ids: list[int]) -> Segment:
        return cls(prompt_ids, Trajectory(prompt_ids=prompt_ids, output_ids=[], logprobs=[], finish_reason="stop"))

    def extended_by(self, keys: list[tuple]) -> bool:
        """`keys` are this conversation, the gateway's last answer, then at least one new message."""
        n = len(self.keys)
        if len(keys) <= n or keys[: n - 1] != self.keys[:-1]:
            return False
        given, ours = keys[n - 1], self.keys[-1]
        # the answer echoed as it was, or its content without the tool calls
        return given == ours or (given[2] == () and given[:2] == ours[:2])


@dataclass
class EpisodeState:
    index: int
    segments: list[Segment] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    calls: int = 0
    limit: str | None = None  # "max_turns" / "max_total_tokens": the episode hit it
    failure: str | None = None  # an engine abort or a gateway error: the episode cannot be trained
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class EpisodeRecord:
    """What an episode left: its segments' trajectories, in order, its counts and calls."""

    trajectories: list[Trajectory]
    events: Counter
    calls: int
    limit: str | None
    failure: str | None


def cut_at_stop(sample: Sample, stops: Sequence[str], decode: Callable[[list[int]], str]) -> Sample:
    """`sample` cut after the first output token whose text (`decode` of the tokens so far) holds one
    of `stops`, with finish reason "stop" and that string as `matched_stop`: what an engine that stops
    on strings would have generated. `sample` itself when no stop string occurs (or it was aborted)."""
    out = list(sample.output_ids)
    if not stops or sample.aborted or not any(stop in decode(out) for stop in stops):
        return sample
    low, high = 1, len(out)  # the shortest prefix that holds a stop string (a longer prefix's text extends it)
    while low < high:
        mid = (low + high) // 2
        if any(stop in decode(out[:mid]) for stop in stops):
            high = mid
        else:
            low = mid + 1
    text = decode(out[:low])
    matched = min((stop for stop in stops if stop in text), key=text.find)
    routed = sample.routed_experts
    return replace(
        sample,
        output_ids=out[:low],
        logprobs=None if sample.logprobs is None else list(sample.logprobs)[:low],
        weight_versions=None if sample.weight_versions is None else list(sample.weight_versions)[:low],
        routed_experts=None if routed is None else routed[: len(sample.prompt_ids) + low - 1],
        finish_reason="stop",
        matched_stop=matched,
    )


def append_call(seg: Segment, delta: list[int], sample: Sample) -> None:
    """The new messages' tokens (not trained) then the engine's, as `run_episodes` appends them."""
    traj = seg.traj
    if delta:
        append_observation(traj, delta, traj.turns - 1)
    append_generated(traj, sample, traj.turns, seg.routed)

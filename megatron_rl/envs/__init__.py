"""Multi-turn environments: the interface, tool calls, built-ins, and token-in-token-out episodes."""

from megatron_rl.envs.base import (
    BUILTIN_ENVS,
    Environment,
    Observation,
    SingleTurn,
    Turn,
    environment_class,
    environment_factory,
)
from megatron_rl.envs.episodes import TurnRenderer, run_episodes
from megatron_rl.envs.tools import MalformedCall, ToolCall, ToolEnvironment, call_with_timeout, parse_tool_calls
from megatron_rl.envs.trajectory import Trajectory, episode_metrics, segments_of

__all__ = [
    "BUILTIN_ENVS",
    "Environment",
    "MalformedCall",
    "Observation",
    "SingleTurn",
    "ToolCall",
    "ToolEnvironment",
    "Trajectory",
    "Turn",
    "TurnRenderer",
    "call_with_timeout",
    "environment_class",
    "environment_factory",
    "episode_metrics",
    "parse_tool_calls",
    "run_episodes",
    "segments_of",
]

"""The interface a multi-turn environment implements, in plain Python, and how one is loaded.

An episode: `start(row)` gives the first messages (None: the data row's own prompt tokens, as a
single-turn run uses them); then, after every model turn, `step(turn)` gives the `Observation` to
append (text, rendered through the chat template, or token ids, appended as they are), an optional
reward for that turn, and whether the episode ended. One instance serves one episode.

`env.type` names a built-in (`single_turn`, `calculator`, `http_tool`) or a user class as
`module:Class` (a subclass of `Environment`, constructed with the `env` config section). `agent`
is no environment of this kind: its episodes are a black-box agent's calls to the OpenAI-compatible
gateway (`megatron_rl.agents`); `environment_class` checks its `env.agent` function imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import ConfigError, EnvConfig


@dataclass(frozen=True)
class Turn:
    """The model's turn `index` (0 = the first): its decoded text and the engine's token ids."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass
class Observation:
    """What follows a model turn. `text` is rendered as a `role` message through the chat template;
    `token_ids` are appended verbatim (give one of the two, or neither when `done`). `reward` is the
    turn's own reward (None = 0); `events` name what happened (e.g. "malformed_tool_call"), each
    counted in the step's metrics as `env/<event>`."""

    text: str | None = None
    token_ids: list[int] | None = None
    role: str = "tool"
    reward: float | None = None
    done: bool = False
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.text is not None and self.token_ids is not None:
            raise ValueError("Observation: give text or token_ids, not both")
        if not self.done and self.text is None and self.token_ids is None:
            raise ValueError("Observation: an episode that goes on needs text or token_ids to append")


class Environment:
    """Subclass and override `step` (and `start` for episodes that begin with their own messages)."""

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg

    def start(self, row: Any) -> list[dict[str, str]] | None:
        """The first messages of the episode for data row `row` (a `megatron_rl.data.Prompt`);
        None = the row's prompt tokens as the dataset tokenized them."""
        return None

    def step(self, turn: Turn) -> Observation:
        """The observation after the model's `turn`. May be `async def step`: it then runs on the
        episodes' event loop (it must not block it); a plain `step` runs on a thread of its own."""
        raise NotImplementedError(f"{type(self).__name__}.step: an Environment must say what follows a model turn")


class SingleTurn(Environment):
    """One model turn, then the episode ends: the single-turn RL of a prompt dataset."""

    def step(self, turn: Turn) -> Observation:
        return Observation(done=True)


def _builtin(name: str) -> type[Environment]:
    if name == "single_turn":
        return SingleTurn
    if name == "calculator":
        from megatron_rl.envs.calculator import CalculatorEnv

        return CalculatorEnv
    from megatron_rl.envs.http_tool import HttpToolEnv

    return HttpToolEnv


BUILTIN_ENVS = ("single_turn", "calculator", "http_tool")


class AgentEpisodes(Environment):
    """`env.type=agent`: a placeholder; its episodes run through `megatron_rl.agents`, not `run_episodes`."""

    def step(self, turn: Turn) -> Observation:
        raise NotImplementedError("env.type = 'agent': episodes run through megatron_rl.agents.run_agent_episodes")


def _named(key: str, name: str, expected: str) -> tuple[str, Any]:
    """(module name, attribute) of the `module:attribute` that setting `key` names; ConfigError naming
    the key otherwise (`expected`: what the setting takes)."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {name!r}: {expected}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key} = {name!r}: cannot import module {module_name!r}: {err}") from err
    return module_name, getattr(module, attr, None)


def agent_function(cfg: EnvConfig) -> Callable[..., Any]:
    """The callable `env.agent` names, `module:function` or `path/to/file.py:function` (loaded as
    reward.custom_function is); ConfigError naming the key otherwise."""
    from megatron_rl.rewards import RewardConfigError, load_custom_function

    try:
        return load_custom_function(str(cfg.agent), where=f"env.agent = {cfg.agent!r}")
    except RewardConfigError as err:
        raise ConfigError(str(err)) from err


def environment_class(cfg: EnvConfig) -> type[Environment]:
    """The class `env.type` names; ConfigError naming the key and the allowed values otherwise."""
    name = cfg.type
    if name in BUILTIN_ENVS:
        return _builtin(name)
    if name == "agent":
        if cfg.agent:
            agent_function(cfg)
        return AgentEpisodes
    module_name, cls = _named("env.type", name, f"allowed: {[*BUILTIN_ENVS, 'agent']} or module:Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(
            f"env.type = {name!r}: {name.partition(':')[2]!r} in {module_name} is not a subclass of "
            "megatron_rl.envs.Environment"
        )
    return cls


def environment_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """A constructor of one fresh environment per episode."""
    cls = environment_class(cfg)
    return lambda: cls(cfg)

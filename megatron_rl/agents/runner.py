"""`env.type=agent`: one black-box agent per episode, its model calls through the gateway.

The agent is `env.agent` (`module:function`: `async def agent(base_url, api_key, row) -> float | None`,
a plain function runs on a thread) or `env.agent_command` (a shell command per episode, with
`OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` in its environment and the row as JSON on
stdin: `{"index", "prompt", "answer", "row"}`; a last stdout line `{"reward": x}` is its reward).
Episodes run side by side, at most `max_concurrency` at once, each within `env.agent_timeout_s`.
`run_agent_episodes` runs them, and the gateway they call, on the running loop (the rollout runtime's).

An episode's trajectory is its last segment (`Gateway`: a call that rewrote the history began it);
the earlier ones are counted (`env/gateway_resets`) and ride along in its `earlier_segments`: the
collector trains each as a sequence of its own with the episode's reward and advantage (a group
still counts episodes). `AgentEpisode.segments` lists them all. The reward the agent gives is kept in the trajectory's
`meta_info["agent_reward"]`: the episode's score with `env.agent_reward` (the collector's
`agent_rewards`), else the run's reward rule (`reward.*`) scores the trajectory's text as for any
environment. An agent that raises, exits non-zero, runs past `env.agent_timeout_s`, returns a
reward that is not a finite number, or never calls the model is a failed episode
(`env/agent_errors`, `env/agent_timeouts` for the timeouts, `env/end_agent_error`): its trajectory's
finish reason is `abort`, so the collector leaves its group out, as for an engine abort. An agent
that fails after the gateway refused a call over `env.max_turns` or `env.max_total_tokens` ended by
that limit: its trajectory is trained (`env/end_max_turns`, `env/end_max_total_tokens`). An episode
still running `checkpoint.preempt_timeout_s` after a stop signal is aborted (`env/end_preempted`,
`megatron_rl.rollout.preempt`): its agent is cancelled, its group left out, and it is no failure.

An agent command runs in a process group of its own, which every way out of its episode kills (its
timeout, a cancellation, the abort): the agent and whatever it started. If the trainer is killed
outright, the command's shell gets SIGTERM (Linux's parent-death signal) and kills the group itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import secrets
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, TypeVar

from megatron_rl.agents.gateway import MODEL, EpisodeRecord, Gateway
from megatron_rl.config import EnvConfig
from megatron_rl.envs.base import agent_function
from megatron_rl.envs.episodes import Trajectory, TurnRenderer
from megatron_rl.envs.tools import on_daemon_thread
from megatron_rl.rollout.local.launcher import die_with_parent
from megatron_rl.rollout.preempt import EpisodesAborted, abortable
from megatron_rl.rollout.types import Engine, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
_STDERR_TAIL = 2000


class AgentError(RuntimeError):
    """The agent failed: raised, exited non-zero, gave a bad reward."""


@dataclass
class AgentEpisode:
    """An episode's trajectory (its last segment, holding the earlier ones), every segment, the agent's
    reward and error."""

    trajectory: Trajectory
    segments: list[Trajectory] = field(default_factory=list)
    reward: float | None = None
    error: str | None = None


def row_json(row: Any) -> str:
    """The task row an agent command reads on stdin."""
    fields = {"index": getattr(row, "index", None), "prompt": getattr(row, "text", None)}
    fields["answer"] = getattr(row, "answer", None)
    fields["row"] = getattr(row, "raw", None)
    return json.dumps(fields, default=str)


def _reward(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise AgentError(f"{what} gave the reward {value!r}, not a finite number")
    return float(value)


async def _run_function(fn: Callable[..., Any], base_url: str, api_key: str, row: Any) -> float | None:
    if inspect.iscoroutinefunction(fn):
        value = await fn(base_url, api_key, row)
    else:
        value = await on_daemon_thread(lambda: fn(base_url, api_key, row))
        if inspect.isawaitable(value):
            value = await value
    return _reward(value, "the agent function")


def in_own_group(command: str) -> str:
    """`command` as a shell script that, on SIGTERM (its parent-death signal), kills its process group:
    the command runs as a background job (stdin passed on) the shell waits for, exiting with its status."""
    return f"trap 'kill -9 0' TERM\nexec 3<&0\n{{ {command}\n}} <&3 3<&- &\nwait $!\n"


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _start_command(command: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """The agent command started in a process group of its own (and out of reach of a terminal's
    Ctrl-C). A cancellation meanwhile lets the start finish, then kills the group: asyncio's own
    clean-up of a cancelled start waits for pipes that the command's children may hold for ever."""
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_shell(
            in_own_group(command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    )
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        _kill_group(await starting)
        raise


async def _run_command(command: str, base_url: str, api_key: str, model: str, row: Any, timeout_s: float):
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model}
    proc = await _start_command(command, env)
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await proc.communicate(row_json(row).encode())
    except BaseException as err:  # its timeout, or cancelled (the run stopping, the abort): the group ends
        _kill_group(proc)
        if isinstance(err, TimeoutError):
            await proc.wait()
        raise
    if proc.returncode != 0:
        tail = stderr.decode(errors="replace")[-_STDERR_TAIL:].strip()
        raise AgentError(f"the agent command exited with status {proc.returncode}: {tail}")
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return None
    return _reward(last.get("reward"), "the agent command") if isinstance(last, dict) else None


def _episode(
    row: Any, record: EpisodeRecord, reward: float | None, error: str | None, end: str = "agent_error"
) -> AgentEpisode:
    segments = record.trajectories
    if error is None and record.calls == 0:
        error = "the agent never called the model"
    if error is not None and record.limit is not None and record.failure is None and segments:
        error = None  # the agent stopped at a limit the gateway refused: the episode is trained as it is
    failed = error is not None or record.failure is not None
    if segments:
        traj = segments[-1]
    else:
        prompt = list(getattr(row, "input_ids", ()))
        traj = Trajectory(prompt_ids=prompt, output_ids=[], logprobs=[], finish_reason="abort")
    traj.events.update(record.events)
    if failed:
        if end == "agent_error":  # an episode aborted by a stop signal is no failure
            traj.events["agent_errors"] += 1
        traj.finish_reason, traj.end_reason = "abort", end
        traj.meta_info = {**traj.meta_info, "agent_error": error or record.failure}
    else:
        traj.end_reason = record.limit or "done"
        traj.earlier_segments = [s for s in segments[:-1] if s.output_ids]
        if reward is not None:
            traj.meta_info = {**traj.meta_info, "agent_reward": reward}
    return AgentEpisode(traj, segments, reward, error or record.failure)


async def run_agent_episodes(
    engine: Engine,
    rows: Sequence[Any],
    params: Callable[[int, int], SamplingParams],
    renderer: TurnRenderer,
    cfg: EnvConfig,
    *,
    max_concurrency: int = 64,
    return_routed_experts: bool = False,
    agent: Callable[..., Any] | None = None,
) -> list[AgentEpisode]:
    """One agent episode per row, in order, each a coroutine on the running loop, through a gateway
    started for them (on the same loop; `agent`: the function to run instead of `env.agent` /
    `env.agent_command`). `params(call, i)`: the sampling of episode i's call."""
    if agent is None and cfg.agent:
        agent = agent_function(cfg)
    if agent is None and not cfg.agent_command:
        raise ValueError("env.type = 'agent' needs env.agent or env.agent_command")
    key = secrets.token_urlsafe(24)
    gateway = Gateway(
        engine,
        renderer,
        cfg,
        params,
        key,
        max_concurrency=max_concurrency,
        return_routed_experts=return_routed_experts,
    )
    async with gateway:
        return await _all(gateway, rows, cfg, agent, key, max_concurrency)


async def _all(
    gateway: Gateway, rows: Sequence[Any], cfg: EnvConfig, agent: Callable[..., Any] | None, key: str, limit: int
) -> list[AgentEpisode]:
    slots = asyncio.Semaphore(limit)

    async def one(i: int, row: Any) -> AgentEpisode:
        async with slots:
            episode = gateway.open_episode(i)
            url = gateway.base_url(episode)
            reward, error, timed_out, end = None, None, False, "agent_error"
            try:
                if agent is not None:
                    async with asyncio.timeout(cfg.agent_timeout_s):
                        reward = await abortable(_run_function(agent, url, key, row))
                else:
                    command = _run_command(cfg.agent_command, url, key, gateway.model, row, cfg.agent_timeout_s)
                    reward = await abortable(command)
            except EpisodesAborted as err:
                error, end = str(err), "preempted"
            except TimeoutError:
                timed_out = True
                error = f"the agent ran past env.agent_timeout_s = {cfg.agent_timeout_s:g} s"
            except Exception as err:  # the agent's own bug: its episode fails, the step goes on
                error = f"{type(err).__name__}: {err}"
            record = gateway.finish(episode)
            if timed_out:
                record.events["agent_timeouts"] += 1
            result = _episode(row, record, reward, error, end)
            if result.error is not None and end == "agent_error":
                log.warning("agent episode %d failed: %s", i, result.error)
            return result

    return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))


__all__ = ["MODEL", "AgentEpisode", "AgentError", "run_agent_episodes", "row_json"]

"""Running episodes against the engine, token in, token out.

Each episode is a coroutine on one event loop: `/generate` with the whole trajectory's
`input_ids`, then `Environment.step`, then the next turn, so the episodes overlap and a finished
turn goes on at once, never waiting for the slowest generation or step of the batch (the requests
the episodes make at the same moment go as one batch: a round's first turns, in episode order). At most
`env.max_concurrent_steps` steps run at once (an `async def step` on the loop itself, a plain `step`
on a daemon thread of its own), each within `env.step_timeout_s`. The trajectory is exactly the engine's generated tokens followed by the observation's
tokens (the chat template's turn delimiters and the observation, tokenized once, by
`TurnRenderer`): the conversation is never decoded and re-tokenized, so the trainer scores the
tokens the engine sampled. Observation tokens get loss mask 0 and log-prob 0 (they are never
compared with the trainer's). Routed experts (R3) are assembled per token of the final trajectory:
each position from the first call whose routing covers it (the call that generated the token, or
the next call's prefill for the last token of a turn and the observation's tokens).

An episode ends with one reason, counted as `env/end_<reason>`: `done` (the environment said so),
`length` (a turn hit its token budget), `abort` (the engine aborted the request), `preempted` (aborted
`checkpoint.preempt_timeout_s` after a stop signal: `megatron_rl.rollout.preempt`),
`max_turns` (`env.max_turns` turns ran), `max_total_tokens` (the next observation, plus one token to
generate, would not fit in `env.max_total_tokens`, by default the model's positions), `env_error`
(the environment's `step` raised, counted as `env/env_error`, ran past `env.step_timeout_s`,
`env/step_timeout`, or its observation could not be rendered or holds a token outside the
vocabulary, `env/render_error`: the episode ends, the step goes on). A turn reward that is not a
finite number is the environment's bug: `EnvRewardError`, naming it, stops the step.

Observation text is tokenized as text: special-token text inside it (`<|im_end|>` in a tool's
output) never becomes the control token, so only the chat template's own delimiters are special.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from megatron_rl.config import EnvConfig
from megatron_rl.envs.base import Environment, Observation, Turn
from megatron_rl.envs.failures import start_messages
from megatron_rl.envs.tools import on_daemon_thread, tool_response
from megatron_rl.envs.trajectory import (
    RoutedExperts,
    Trajectory,
    append_generated,
    append_observation,
)
from megatron_rl.rollout.preempt import abortable
from megatron_rl.rollout.types import Engine, Sample, SamplingParams

log = logging.getLogger(__name__)
_USER, _ASSISTANT = "\x00megatron-rl-user\x00", "\x00megatron-rl-assistant\x00"
_CONTENT = "\x00megatron-rl-content\x00"


class EnvRewardError(ValueError):
    """An environment gave a turn reward that is not a finite number."""


class StepTimeoutError(RuntimeError):
    """An environment's `step` ran past env.step_timeout_s (and was abandoned)."""


class TurnRenderer:
    """The token ids of an observation message, through the tokenizer's chat template.

    With a template: the text the template adds after an assistant turn for the message (its
    delimiters, the message, the next assistant header), less the end-of-turn token when the engine
    already generated it. Without one: the message on its own lines (a tool result inside
    `<tool_response>`). Either way tokenized once, with no special tokens added; the message itself
    without special tokens (`split_special_tokens`), so its text cannot forge a turn end or a role.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        # what text may still encode to: the unknown token (a character outside the vocabulary)
        self.control_ids = self.special_ids - {getattr(tokenizer, "unk_token_id", None)}
        self.vocab_size: int | None = len(tokenizer) if hasattr(tokenizer, "__len__") else None

    def text(self, content: str, role: str, last_generated_id: int | None) -> str:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return "\n" + (tool_response(content) if role == "tool" else content) + "\n"
        history = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        rendered = tok.apply_chat_template(
            [*history, {"role": role, "content": content}], tokenize=False, add_generation_prompt=True
        )
        return self._after_assistant(rendered, last_generated_id)

    def _after_assistant(self, rendered: str, last_generated_id: int | None) -> str:
        """What the template renders after the assistant's content, less the end-of-turn token the
        engine already generated."""
        cut = rendered.find(_ASSISTANT)
        if cut < 0:
            raise ValueError("the chat template drops the assistant's content; observations cannot be rendered")
        delta = rendered[cut + len(_ASSISTANT) :]
        if last_generated_id is not None and last_generated_id in self.special_ids:
            end_of_turn = self.tokenizer.decode([last_generated_id])
            if end_of_turn and delta.startswith(end_of_turn):
                delta = delta[len(end_of_turn) :]
        return delta

    def messages_ids(self, messages: list[dict[str, Any]], last_generated_id: int | None) -> list[int]:
        """The token ids that follow an assistant turn for several messages at once (each a dict with
        `role` and string `content`, other keys passed to the template), up to the next assistant
        header: one message as `observation_ids`; several rendered together (a template may join
        consecutive tool messages into one turn), each content as plain text."""
        if not messages:
            return []
        if len(messages) == 1 and set(messages[0]) <= {"role", "content"}:
            return self.observation_ids(messages[0]["content"], messages[0]["role"], last_generated_id)
        if not getattr(self.tokenizer, "chat_template", None):
            return [i for m in messages for i in self.observation_ids(m["content"], m["role"], None)]
        marks = [f"{_CONTENT}{k}\x00" for k in range(len(messages))]
        history = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        rendered = self.tokenizer.apply_chat_template([*history, *marked], tokenize=False, add_generation_prompt=True)
        rest = self._after_assistant(rendered, last_generated_id)
        encode, ids = self.tokenizer.encode, []
        for mark, m in zip(marks, messages, strict=True):
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                raise ValueError(
                    f"the chat template does not hold a {m['role']!r} message's content once; it cannot be rendered"
                )
            ids += [*encode(before, add_special_tokens=False), *self.plain_ids(m["content"])]
        return ids + list(encode(rest, add_special_tokens=False))

    def observation_ids(self, content: str, role: str, last_generated_id: int | None) -> list[int]:
        """The template's text around the message tokenized as usual, the message as plain text."""
        before, found, after = self.text(_CONTENT, role, last_generated_id).partition(_CONTENT)
        if not found or _CONTENT in after:
            raise ValueError(
                f"the chat template does not hold a {role!r} message's content once; it cannot be rendered"
            )
        encode = self.tokenizer.encode
        return [
            *encode(before, add_special_tokens=False),
            *self.plain_ids(content),
            *encode(after, add_special_tokens=False),
        ]

    def plain_ids(self, text: str) -> list[int]:
        """`text` tokenized with its special-token text split into ordinary tokens; ValueError when the
        tokenizer cannot split it (a tokenizer without `split_special_tokens`)."""
        try:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        except TypeError:  # a tokenizer without the option: checked below
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        forged = sorted({i for i in ids if i in self.control_ids})
        if forged:
            raise ValueError(
                f"the observation's text encodes to the special token(s) {forged[:5]}, which the "
                "tokenizer cannot split into text"
            )
        return ids

    def check_ids(self, ids: list[int]) -> list[int]:
        """`ids` when each is a token of the vocabulary; ValueError naming the first that is not."""
        bad = next((i for i in ids if i < 0 or (self.vocab_size is not None and i >= self.vocab_size)), None)
        if bad is not None:
            raise ValueError(
                f"observation token {bad} is outside the vocabulary (0-{self.vocab_size - 1})"
                if self.vocab_size is not None
                else f"observation token {bad} is negative"
            )
        return ids

    def first_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template's tokens of `messages` (with `tools` when given), then the assistant header."""
        kwargs = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
        if isinstance(ids, Mapping):  # transformers 5 answers a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


@dataclass
class _Episode:
    env: Environment
    prompt_ids: list[int]
    traj: Trajectory
    routed: RoutedExperts = field(default_factory=RoutedExperts)
    live: bool = True

    def end(self, reason: str) -> None:
        self.traj.end_reason, self.live = reason, False

    def abort(self) -> None:
        """Aborted by a stop signal's deadline (`abortable`): its group is left out."""
        self.traj.finish_reason = "abort"
        self.end("preempted")


async def run_episodes(
    engine: Engine,
    envs: Sequence[Environment],
    rows: Sequence[Any],
    params: Callable[[int, int], SamplingParams],
    renderer: TurnRenderer,
    cfg: EnvConfig,
    *,
    return_routed_experts: bool = False,
    stall_warning_s: float = 0.0,
) -> list[Trajectory]:
    """One trajectory per (environment, data row), in order, each episode a coroutine on the running
    loop; `params(turn, i)` the sampling of episode i's turn. `episode_metrics` gives their `env/*`
    metrics. A `step` running longer than `stall_warning_s` (0 = never) is warned about, again after
    each further `stall_warning_s`."""
    episodes = []
    for env, row in zip(envs, rows, strict=True):
        messages = start_messages(env, row, cfg)
        prompt_ids = list(row.input_ids) if messages is None else renderer.first_ids(messages)
        traj = Trajectory(prompt_ids=prompt_ids, output_ids=[], logprobs=[], finish_reason="stop")
        episodes.append(_Episode(env, prompt_ids, traj))
    await _EpisodeRun(engine, params, renderer, cfg, return_routed_experts, stall_warning_s).all(episodes)
    return [ep.traj for ep in episodes]


class _TurnBatches:
    """The episodes' turn requests made in one iteration of their loop go to the engine as one
    `generate` call (a task on the loop): the episodes of a round start together, so their first turns
    are one batch in episode order; later turns go as the episodes reach them. Each request's future
    gets its sample, or the call's error."""

    def __init__(self, engine: Engine, return_routed_experts: bool) -> None:
        self.engine, self.return_routed_experts = engine, return_routed_experts
        self.pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self.calls: set[asyncio.Task] = set()  # the engine calls running (a task is only weakly held by the loop)

    async def generate(self, ids: list[int], params: SamplingParams) -> Sample:
        loop = asyncio.get_running_loop()
        if not self.pending:
            loop.call_soon(self._send)  # after the other episodes that are ready have asked too
        answer = loop.create_future()
        self.pending.append((ids, params, answer))
        return await answer

    def _send(self) -> None:
        batch, self.pending = self.pending, []
        call = asyncio.ensure_future(
            self.engine.generate(
                [ids for ids, _, _ in batch], [p for _, p, _ in batch], return_routed_experts=self.return_routed_experts
            )
        )
        self.calls.add(call)
        call.add_done_callback(self.calls.discard)
        call.add_done_callback(functools.partial(self._answer, [answer for _, _, answer in batch]))

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    @staticmethod
    def _answer(answers: list[asyncio.Future], call: asyncio.Future) -> None:
        error = None if call.cancelled() else call.exception()
        for k, answer in enumerate(answers):
            if answer.done():
                continue
            if call.cancelled():
                answer.cancel()
            elif error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(call.result()[k])


@dataclass
class _EpisodeRun:
    """The episodes of one `run_episodes` call, each a coroutine on the rollout runtime's loop: a turn's `/generate` (`_TurnBatches`),
    then its step. The tokenizer's work (decoding a turn, rendering an observation) runs on the loop's
    thread alone."""

    engine: Engine
    params: Callable[[int, int], SamplingParams]
    renderer: TurnRenderer
    cfg: EnvConfig
    return_routed_experts: bool
    stall_warning_s: float

    async def all(self, episodes: list[_Episode]) -> None:
        steps = asyncio.Semaphore(self.cfg.max_concurrent_steps)
        batches = _TurnBatches(self.engine, self.return_routed_experts)
        try:
            await asyncio.gather(
                *(abortable(self.one(i, ep, batches, steps), ep.abort) for i, ep in enumerate(episodes))
            )
        finally:
            batches.cancel()  # a call still generating for episodes that are gone (cancelled, or another failed)

    async def one(self, i: int, ep: _Episode, batches: _TurnBatches, steps: asyncio.Semaphore) -> None:
        cfg = self.cfg
        for turn in range(cfg.max_turns):
            ids = ep.prompt_ids + ep.traj.output_ids
            p = self.params(turn, i)
            if cfg.max_total_tokens is not None:
                p = dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, cfg.max_total_tokens - len(ids)))
            done = _record(ep, await batches.generate(ids, p), turn, self.renderer)
            if done is None:
                return
            async with steps:
                step = asyncio.ensure_future(_step(ep.env, done, cfg, self.stall_warning_s))
                await asyncio.wait([step])
            _observe(ep, done, step, self.renderer, cfg)
            if not ep.live:
                return


async def _step(env: Environment, turn: Turn, cfg: EnvConfig, stall_warning_s: float) -> Observation:
    """`env.step(turn)`: awaited when it is a coroutine function, else run on a daemon thread of its
    own; abandoned after env.step_timeout_s (StepTimeoutError)."""
    name = type(env).__name__
    if inspect.iscoroutinefunction(env.step):
        running = asyncio.ensure_future(env.step(turn))
    else:
        running = asyncio.ensure_future(on_daemon_thread(lambda: env.step(turn)))
    loop = asyncio.get_running_loop()
    began = loop.time()
    while True:
        left = cfg.step_timeout_s - (loop.time() - began)
        warn = 0 < stall_warning_s < left
        finished, _ = await asyncio.wait([running], timeout=stall_warning_s if warn else max(left, 0.0))
        if finished:
            break
        if not warn:
            running.cancel()
            raise StepTimeoutError(f"{name}.step ran past env.step_timeout_s = {cfg.step_timeout_s:g} s")
        ran, limit = loop.time() - began, cfg.step_timeout_s
        log.warning("%s.step has run for %.0f s on turn %d (env.step_timeout_s = %g)", name, ran, turn.index, limit)
    value = running.result()
    if not isinstance(value, Observation):
        raise TypeError(f"{name}.step returned {type(value).__name__}, not an Observation")
    return value


def _turn_reward(obs: Observation, env: Environment, turn: int, cfg: EnvConfig) -> float:
    reward = obs.reward
    if reward is None:
        return 0.0
    if not isinstance(reward, Real) or not math.isfinite(reward):
        raise EnvRewardError(
            f"env.type = {cfg.type!r}: {type(env).__name__}.step gave turn {turn} the reward {reward!r}; "
            "a turn reward must be a finite number (or None)"
        )
    return float(reward)


def _record(ep: _Episode, sample: Sample, turn: int, renderer: TurnRenderer) -> Turn | None:
    """Append the engine's turn to the trajectory; the `Turn` to step on, or None when the episode ended."""
    append_generated(ep.traj, sample, turn, ep.routed)
    if sample.aborted:
        ep.end("abort")
        return None
    if sample.truncated:
        ep.end("length")
        return None
    out = list(sample.output_ids)
    text = renderer.tokenizer.batch_decode([out], skip_special_tokens=True)[0]
    return Turn(turn, text, tuple(out), sample.finish_reason)


def _observe(ep: _Episode, done: Turn, step: asyncio.Future, renderer: TurnRenderer, cfg: EnvConfig) -> None:
    """The environment's answer to the turn `done` (`step`'s result): the episode ends, or its
    observation is appended."""
    traj, turn, out = ep.traj, done.index, done.token_ids
    try:
        obs = step.result()
    except Exception as err:  # a user environment's bug ends its episode, counted, not the step
        traj.events["step_timeout" if isinstance(err, StepTimeoutError) else "env_error"] += 1
        traj.meta_info = {**traj.meta_info, "env_error": f"{type(ep.env).__name__}.step: {type(err).__name__}: {err}"}
        return ep.end("env_error")
    traj.events.update(obs.events)
    traj.turn_rewards[-1] = _turn_reward(obs, ep.env, turn, cfg)
    if obs.done:
        return ep.end("done")
    if turn + 1 >= cfg.max_turns:
        return ep.end("max_turns")
    try:
        if obs.token_ids is not None:
            obs_ids = renderer.check_ids([int(t) for t in obs.token_ids])
        else:
            obs_ids = renderer.observation_ids(obs.text, obs.role, out[-1] if out else None)
    except Exception as err:  # e.g. a chat template that refuses the observation's role, a token out of range
        traj.events["render_error"] += 1
        traj.meta_info = {**traj.meta_info, "env_error": f"{type(err).__name__}: {err}"}
        return ep.end("env_error")
    total = len(ep.prompt_ids) + len(traj.output_ids) + len(obs_ids)
    if cfg.max_total_tokens is not None and total + 1 > cfg.max_total_tokens:
        return ep.end("max_total_tokens")
    append_observation(traj, obs_ids, turn)

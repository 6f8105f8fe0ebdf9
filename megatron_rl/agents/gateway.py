"""An OpenAI-compatible chat-completions gateway in front of the rollout engine, token in, token out.

A black-box agent (any program that speaks OpenAI's chat API) is trained by pointing it at
`Gateway.base_url(episode)`: `http://127.0.0.1:PORT/episodes/<episode-id>/v1`, so each call is
tied to its episode's trajectory. Endpoints: `GET {base}/models` and `POST {base}/chat/completions`
(its fields and bounds: `openai_chat.py`; the body at most `MAX_BODY_BYTES`). Every request needs
`Authorization: Bearer KEY`, compared in constant time.

Token in, token out: an episode's first call is the chat template's rendering of its messages
(with `tools`; `render.fresh_ids`: special-token text inside them stays text); a later call whose
messages extend the history (the previous call's messages, the assistant message the gateway
answered, then new messages) is the previous prompt tokens + the generated ids + the new messages'
tokens (`TurnRenderer.messages_ids`: the template's delta after an assistant turn, the contents as
plain text). Earlier turns are never re-tokenized. A call that does not extend the history starts a
new segment (`env/gateway_resets`), a trajectory of its own (`segments.py`).

Generation: one engine request per call, awaited on the rollout runtime's loop, with the run's sampling (`params(call, episode)`), `max_tokens` capped by it
and by what is left of `env.max_total_tokens`. The request's `temperature` is ignored (counted,
`env/gateway_temperature_ignored`): the trainer scores the tokens at `rollout.temperature`. A
`stop` string that is one token becomes a stop token; a longer one cuts the response after the first
token whose text completes it (`segments.cut_at_stop`: the tokens after it are dropped, never
trained, as if the engine had stopped there; `env/gateway_stop_strings`), and the answer's content
ends before it. More than `env.max_turns` calls, or a prompt that leaves no room in
`env.max_total_tokens`, answer 400 and mark the episode as ended by that limit.

Threads: the gateway's site runs on the event loop that starts it (the rollout runtime's), which reads
requests, owns the episodes' state and awaits the engine; parsing a body, rendering and decoding run on
the render threads (`render.RenderPool`), so a large request holds up its own episode only.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from megatron_rl.agents.openai_chat import (
    ChatRequest,
    RequestError,
    error_response,
    logprobs_content,
    parse_message,
    parse_request,
    reply_message,
    template_messages,
)
from megatron_rl.agents.render import RenderPool, fresh_ids
from megatron_rl.agents.segments import EpisodeRecord, EpisodeState, Segment, append_call, cut_at_stop, message_key
from megatron_rl.config import EnvConfig
from megatron_rl.envs.episodes import TurnRenderer
from megatron_rl.http.body import BodyError, parse_json, read_body
from megatron_rl.http.server import Serving, application, authorized, key_check, start
from megatron_rl.rollout.types import Engine, Sample, SamplingParams

log = logging.getLogger(__name__)

MODEL = "megatron-rl-policy"
MAX_BODY_BYTES = 32 << 20


class Gateway:
    """The gateway server on 127.0.0.1 (`port` 0: a free one), on the event loop that `start`s it.

    `params(call, episode)` gives the sampling of an episode's call (its `max_new_tokens` the cap);
    `open_episode(index)` an id whose `base_url` the agent calls; `finish(id)` closes it and gives its
    `EpisodeRecord` (both on the gateway's loop)."""

    def __init__(
        self,
        engine: Engine,
        renderer: TurnRenderer,
        cfg: EnvConfig,
        params: Callable[[int, int], SamplingParams],
        api_key: str,
        *,
        max_concurrency: int = 64,
        return_routed_experts: bool = False,
        model: str = MODEL,
        port: int = 0,
    ) -> None:
        self.engine, self.renderer, self.cfg, self.params = engine, renderer, cfg, params
        self.api_key, self.model, self.port = api_key, model, port
        self.return_routed_experts, self.max_concurrency = return_routed_experts, max_concurrency
        self._render = RenderPool(renderer)
        self._episodes: dict[str, EpisodeState] = {}
        self._serving: Serving | None = None

    # ---- life ----
    async def start(self) -> Gateway:
        try:
            await self._start_server()
        except BaseException:
            self._render.close()
            raise
        return self

    async def _start_server(self) -> None:
        refusal = "a valid API key is required (Authorization: Bearer KEY)"
        checked = key_check(
            lambda r: authorized(r, self.api_key), lambda: error_response(401, refusal, "authentication_error")
        )
        app = application(MAX_BODY_BYTES, [checked])
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        # closing waits at most 1 s for a call still generating (its agent timed out): it is left out anyway;
        # aiohttp's default listen backlog (128) refuses connections when more agents than that
        # connect at once: their clients then fail on a connect timeout
        backlog = max(128, 2 * self.max_concurrency)
        self._serving = await start(app, port=self.port, shutdown_timeout_s=1.0, backlog=backlog)
        self.port = self._serving.port

    async def close(self) -> None:
        """Stop serving (a call still generating is cancelled, `Serving.close` bounds it) and the render threads."""
        try:
            if self._serving is not None:
                await self._serving.close()
        finally:
            self._render.close()

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- episodes ----
    def open_episode(self, index: int) -> str:
        episode = uuid.uuid4().hex
        self._episodes[episode] = EpisodeState(index)
        return episode

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def finish(self, episode: str) -> EpisodeRecord:
        state = self._episodes.pop(episode)
        state.closed = True  # a call still generating is answered 404 and left out
        return EpisodeRecord([s.traj for s in state.segments], state.events, state.calls, state.limit, state.failure)

    # ---- endpoints ----
    def _state(self, request: web.Request) -> EpisodeState:
        state = self._episodes.get(request.match_info["episode"])
        if state is None:
            raise RequestError(404, f"no open episode {request.match_info['episode']!r}", "not_found_error")
        return state

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._state(request)
        except RequestError as err:
            return error_response(err.status, err.message, err.kind)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "megatron-rl"}]}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        state = None
        try:
            state = self._state(request)
            try:
                raw = await read_body(request, MAX_BODY_BYTES)
            except BodyError as err:
                raise RequestError(err.status, str(err)) from None
            chat = await self._render.run(lambda _: _parse_body(raw))
            async with state.lock:
                if state.closed:
                    raise RequestError(404, "the episode ended", "not_found_error")
                return web.json_response(await self._complete(state, chat))
        except RequestError as err:
            return error_response(err.status, err.message, err.kind, err.code)
        except Exception as err:  # the gateway's or the engine's failure: the episode cannot be trained
            log.exception("agent gateway: a chat completion failed")
            if state is not None:
                state.failure = f"{type(err).__name__}: {err}"
                state.events["gateway_errors"] += 1
            return error_response(500, f"{type(err).__name__}: {err}", "server_error")

    # ---- one completion: render (a render thread), generate (awaited), answer (a render thread) ----
    async def _complete(self, state: EpisodeState, chat: ChatRequest) -> dict[str, Any]:
        cfg = self.cfg
        if state.calls >= cfg.max_turns:
            state.limit = "max_turns"
            raise RequestError(400, f"the episode made env.max_turns = {cfg.max_turns} calls", code="max_turns")
        seg = state.segments[-1] if state.segments else None
        prompt = await self._render.run(_prompt, seg, chat)
        ids = prompt.ids
        p = self.params(state.calls, state.index)
        room = p.max_new_tokens
        if cfg.max_total_tokens is not None:
            room = min(room, cfg.max_total_tokens - len(ids))
        if room < 1:
            state.limit = "max_total_tokens"
            raise RequestError(
                400,
                f"the conversation ({len(ids)} tokens) leaves no room in env.max_total_tokens = {cfg.max_total_tokens}",
                code="context_length_exceeded",
            )
        changes: dict[str, Any] = {"max_new_tokens": min(room, chat.max_tokens or room)}
        if chat.temperature is not None and chat.temperature != p.temperature:
            state.events["gateway_temperature_ignored"] += 1
        if prompt.stops:
            changes["stop_token_ids"] = tuple(dict.fromkeys([*p.stop_token_ids, *prompt.stops]))
        p = replace(p, **changes)
        if prompt.fresh is not None:
            if seg is not None:
                state.events["gateway_resets"] += 1
                seg.traj.end_reason = seg.traj.end_reason or "reset"
            seg = prompt.fresh
            state.segments.append(seg)
        (sample,) = await self.engine.generate([ids], [p], return_routed_experts=self.return_routed_experts)
        answer = None if sample.aborted else await self._render.run(_answer, sample, prompt.stop_strings, chat.logprobs)
        if state.closed:  # finish() returned the record: its trajectories are no longer ours to extend
            raise RequestError(404, "the episode ended while the call generated", "not_found_error")
        state.calls += 1
        if answer is None:
            append_call(seg, prompt.delta, sample)
            seg.traj.end_reason = "abort"
            state.failure = "the engine aborted the request"
            raise RequestError(503, "the engine aborted the request", "server_error")
        append_call(seg, prompt.delta, answer.sample)
        state.events.update(answer.events)
        seg.keys = prompt.keys + [answer.key]
        out = answer.sample.output_ids
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {"index": 0, "message": answer.message, "finish_reason": answer.finish, "logprobs": answer.logprobs}
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)},
        }


@dataclass
class _Prompt:
    """A call's prompt: its messages' keys, its tokens, the new messages' tokens when it continues the last
    segment (`fresh` None) or the segment it begins, its stop tokens and longer stop strings."""

    keys: list[tuple]
    ids: list[int]
    delta: list[int]
    fresh: Segment | None
    stops: list[int]
    stop_strings: list[str]


@dataclass
class _Answer:
    """A call's answer: the sample (cut at a stop string), the assistant message, its finish reason and
    key, the events it counts, the choice's `logprobs`."""

    sample: Sample
    message: dict[str, Any]
    finish: str
    key: tuple
    events: Counter
    logprobs: dict[str, Any] | None


def _parse_body(raw: bytes) -> ChatRequest:
    try:
        return parse_request(parse_json(raw))
    except BodyError as err:
        raise RequestError(err.status, str(err)) from None


def _prompt(renderer: TurnRenderer, seg: Segment | None, chat: ChatRequest) -> _Prompt:
    """Run on a render thread while the episode's lock is held: nothing else changes `seg` meanwhile."""
    keys = [message_key(m) for m in chat.messages]
    if seg is not None and seg.extended_by(keys):
        last = seg.traj.output_ids[-1] if seg.traj.output_ids else None
        try:
            delta = renderer.messages_ids(template_messages(chat.messages[len(seg.keys) :]), last)
        except ValueError as err:
            raise RequestError(400, f"the new messages cannot be rendered: {err}") from None
        ids, fresh = seg.prompt_ids + seg.traj.output_ids + delta, None
    else:
        try:
            ids = fresh_ids(renderer, template_messages(chat.messages), chat.tools)
        except Exception as err:  # a template that refuses the conversation
            raise RequestError(400, f"the messages cannot be rendered: {type(err).__name__}: {err}") from None
        delta, fresh = [], Segment.fresh(ids)
    stops, stop_strings = [], []
    for text in chat.stop:
        one = renderer.tokenizer.encode(text, add_special_tokens=False)
        if len(one) == 1:
            stops.append(int(one[0]))
        else:
            stop_strings.append(text)
    return _Prompt(keys, ids, delta, fresh, stops, stop_strings)


def _answer(renderer: TurnRenderer, sample: Sample, stop_strings: list[str], logprobs: bool) -> _Answer:
    tok, events = renderer.tokenizer, Counter()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    cut = cut_at_stop(sample, stop_strings, decode)
    out = [int(t) for t in cut.output_ids]
    text = decode(out)
    if cut is not sample:
        events["gateway_stop_strings"] += 1
        text = text[: text.find(cut.matched_stop)]
    message, finish = reply_message(text, cut.truncated, events)
    content = logprobs_content(tok, out, cut.logprobs) if logprobs else None
    return _Answer(cut, message, finish, message_key(parse_message(message, 0)), events, content)

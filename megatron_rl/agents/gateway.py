"""An OpenAI-compatible chat-completions gateway in front of the rollout engine, token in, token out.

A black-box agent (any program that speaks OpenAI's chat API) is trained by pointing it at
`Gateway.base_url(episode)`: `http://127.0.0.1:PORT/episodes/<episode-id>/v1`, so each call is
tied to its episode's trajectory. Endpoints: `GET {base}/models` and `POST {base}/chat/completions`
(`messages`, `tools`, `temperature`, `max_tokens` / `max_completion_tokens`, `stop`, `logprobs`;
unknown fields ignored; `stream` and `n` > 1 refused). Every request needs
`Authorization: Bearer KEY`, compared in constant time.

Token in, token out: an episode's first call is the chat template's rendering of its messages
(with `tools`); a later call whose messages extend the history (the previous call's messages, the
assistant message the gateway answered, then new messages) is the previous prompt tokens + the
generated ids + the new messages' tokens (`TurnRenderer.messages_ids`: the template's delta after
an assistant turn, the contents as plain text). Earlier turns are never re-tokenized. A call that
does not extend the history starts a new segment (`env/gateway_resets`), a trajectory of its own.

Generation: one engine request per call, the engine's synchronous `generate` on a thread pool,
with the run's sampling (`params(call, episode)`), `max_tokens` capped by it and by what is left
of `env.max_total_tokens`. The request's `temperature` is ignored (counted,
`env/gateway_temperature_ignored`): the trainer scores the tokens at `rollout.temperature`. A
`stop` string that is one token becomes a stop token; a longer one cuts the response after the first
token whose text completes it (`cut_at_stop`: the tokens after it are dropped, never trained, as if
the engine had stopped there; `env/gateway_stop_strings`), and the answer's content ends before it.
More than `env.max_turns` calls, or a prompt that leaves no room in `env.max_total_tokens`, answer
400 and mark the episode as ended by that limit.

Everything that touches the tokenizer runs on the gateway's event-loop thread (one thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from numbers import Real
from typing import Any

from aiohttp import web

from megatron_rl.config import EnvConfig
from megatron_rl.envs.episodes import RoutedExperts, Trajectory, TurnRenderer, append_generated, append_observation
from megatron_rl.envs.tools import MalformedCall, ToolCall, parse_tool_calls
from megatron_rl.http_body import READ_TIMEOUT_S, BodyError, app_runner, authorized, parse_json, read_body
from megatron_rl.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)

MODEL = "megatron-rl-policy"
MAX_BODY_BYTES = 32 << 20
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request answered with an OpenAI-style error: `status`, `message`, `kind` (its `type`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: the text ones
        texts = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}[{k}]: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}: must be a string, a list of text parts or null")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(400, f"{where}: must be a list")
    calls = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(
                400, f"{where}[{k}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the string it is
        calls.append(
            {"id": str(call.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return calls


def _message(value: Any, k: int) -> dict[str, Any]:
    """A request message, normalized: role, content (a string), tool_calls, tool_call_id, name."""
    where = f"messages[{k}]"
    if not isinstance(value, dict):
        raise RequestError(400, f"{where}: must be an object")
    role = value.get("role")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role: must be one of {list(ROLES)}, got {role!r}")
    message: dict[str, Any] = {"role": role, "content": _content(value.get("content"), f"{where}.content")}
    calls = _tool_calls(value.get("tool_calls"), f"{where}.tool_calls")
    if calls:
        message["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if isinstance(value.get(key), str):
            message[key] = value[key]
    return message


def parse_request(body: Any) -> ChatRequest:
    """The chat-completions request `body` (parsed JSON); RequestError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of messages is required")
    if body.get("stream"):
        raise RequestError(400, "stream: streaming is not supported by this gateway")
    if body.get("n") not in (None, 1):
        raise RequestError(400, "n: only one choice per request is supported")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "tools: must be a list of tool objects")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, Real) or not 0 <= temperature <= 2
    ):
        raise RequestError(400, f"temperature: must be a number in [0, 2], got {temperature!r}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(400, f"max_tokens: must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "stop: must be a string or a list of strings")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(400, "logprobs: must be a boolean")
    return ChatRequest(
        [_message(m, k) for k, m in enumerate(messages)],
        tools or None,
        None if temperature is None else float(temperature),
        max_tokens,
        list(stop or []),
        bool(logprobs),
    )


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
    reply_key: tuple | None = None  # the key of the assistant message the gateway answered last
    routed: RoutedExperts = field(default_factory=RoutedExperts)

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


class Gateway:
    """The gateway server on 127.0.0.1 (`port` 0: a free one) on its own event-loop thread.

    `params(call, episode)` gives the sampling of an episode's call (its `max_new_tokens` the cap);
    `open_episode(index)` an id whose `base_url` the agent calls; `finish(id)` (or `finish_async`
    from another event loop) closes it and gives its `EpisodeRecord`."""

    def __init__(
        self,
        engine: Any,
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
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="gateway-generate")
        self._episodes: dict[str, EpisodeState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ---- life ----
    def start(self) -> Gateway:
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._start_server())
            except BaseException as err:  # reported to start()
                failure.append(err)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            pending = asyncio.all_tasks(loop)  # a call whose agent gave up, still generating: cancelled
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=serve, name="agent-gateway", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    async def _start_server(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        # closing waits at most 1 s for a call still generating (its agent timed out): it is left out anyway
        self._runner = app_runner(app, READ_TIMEOUT_S, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        # aiohttp's default listen backlog (128) refuses connections when more agents than that
        # connect at once: their clients then fail on a connect timeout
        backlog = max(128, 2 * self.max_concurrency)
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=backlog)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def close(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- episodes ----
    def open_episode(self, index: int) -> str:
        episode = uuid.uuid4().hex
        self._call(self._open(episode, index))
        return episode

    async def open_episode_async(self, index: int) -> str:
        """`open_episode` from another event loop."""
        episode = uuid.uuid4().hex
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._open(episode, index), self._loop))
        return episode

    async def _open(self, episode: str, index: int) -> None:
        self._episodes[episode] = EpisodeState(index)

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def finish(self, episode: str) -> EpisodeRecord:
        return self._call(self._finish(episode))

    async def finish_async(self, episode: str) -> EpisodeRecord:
        """`finish` from another event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._finish(episode), self._loop))

    async def _finish(self, episode: str) -> EpisodeRecord:
        state = self._episodes.pop(episode)
        state.closed = True  # a call still generating is answered 404 and left out
        return EpisodeRecord([s.traj for s in state.segments], state.events, state.calls, state.limit, state.failure)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- endpoints ----
    def _state(self, request: web.Request) -> EpisodeState:
        if not authorized(request, self.api_key):
            raise RequestError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error")
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
                body = parse_json(await read_body(request, MAX_BODY_BYTES))
            except BodyError as err:
                raise RequestError(err.status, str(err)) from None
            chat = parse_request(body)
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

    # ---- one completion ----
    async def _complete(self, state: EpisodeState, chat: ChatRequest) -> dict[str, Any]:
        cfg, tok = self.cfg, self.renderer.tokenizer
        if state.calls >= cfg.max_turns:
            state.limit = "max_turns"
            raise RequestError(400, f"the episode made env.max_turns = {cfg.max_turns} calls", code="max_turns")
        keys = [message_key(m) for m in chat.messages]
        seg = state.segments[-1] if state.segments else None
        if seg is not None and seg.extended_by(keys):
            new = chat.messages[len(seg.keys) :]
            last = seg.traj.output_ids[-1] if seg.traj.output_ids else None
            try:
                delta = self.renderer.messages_ids(_template_messages(new), last)
            except ValueError as err:
                raise RequestError(400, f"the new messages cannot be rendered: {err}") from None
            ids = seg.prompt_ids + seg.traj.output_ids + delta
            fresh = None
        else:
            try:
                prompt = self.renderer.first_ids(_template_messages(chat.messages), chat.tools)
            except Exception as err:  # a template that refuses the conversation
                raise RequestError(400, f"the messages cannot be rendered: {type(err).__name__}: {err}") from None
            delta, ids = [], prompt
            fresh = Segment(prompt, Trajectory(prompt_ids=prompt, output_ids=[], logprobs=[], finish_reason="stop"))
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
        stops, stop_strings = [], []
        for text in chat.stop:
            one = tok.encode(text, add_special_tokens=False)
            if len(one) == 1:
                stops.append(int(one[0]))
            else:
                stop_strings.append(text)
        if stops:
            changes["stop_token_ids"] = tuple(dict.fromkeys([*p.stop_token_ids, *stops]))
        p = replace(p, **changes)
        if fresh is not None:
            if seg is not None:
                state.events["gateway_resets"] += 1
                seg.traj.end_reason = seg.traj.end_reason or "reset"
            seg = fresh
            state.segments.append(seg)
        loop = asyncio.get_running_loop()
        routed = self.return_routed_experts
        (sample,) = await loop.run_in_executor(
            self._pool, lambda: self.engine.generate([ids], [p], return_routed_experts=routed)
        )
        if state.closed:
            raise RequestError(404, "the episode ended while the call generated", "not_found_error")
        state.calls += 1
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        cut = cut_at_stop(sample, stop_strings, decode)
        stop_string = cut.matched_stop if cut is not sample else None
        if stop_string is not None:
            state.events["gateway_stop_strings"] += 1
            sample = cut
        out = [int(t) for t in sample.output_ids]
        _append(seg, delta, sample)
        if sample.aborted:
            seg.traj.end_reason = "abort"
            state.failure = "the engine aborted the request"
            raise RequestError(503, "the engine aborted the request", "server_error")
        text = decode(out)
        if isinstance(stop_string, str):
            text = text[: text.find(stop_string)]
        message, finish = self._reply(text, sample.truncated, state)
        seg.keys = keys + [message_key(_message(message, 0))]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": self._logprobs(out, sample.logprobs) if chat.logprobs else None,
                }
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)},
        }

    def _reply(self, text: str, truncated: bool, state: EpisodeState) -> tuple[dict[str, Any], str]:
        parsed = parse_tool_calls(text)
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        state.events["malformed_tool_call"] += sum(isinstance(c, MalformedCall) for c in parsed)
        if not calls:
            return {"role": "assistant", "content": text}, "length" if truncated else "stop"
        state.events["tool_call"] += len(calls)
        content = text[: text.find("<tool_call>")].strip() or None
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"

    def _logprobs(self, out: list[int], logprobs: list[float]) -> dict[str, Any]:
        tok = self.renderer.tokenizer
        content = []
        for t, lp in zip(out, logprobs, strict=True):
            piece = tok.decode([t])
            content.append(
                {
                    "token": piece,
                    "logprob": lp if math.isfinite(lp) else -9999.0,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [],
                }
            )
        return {"content": content}


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


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: tool calls without ids, arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"type": "function", "function": c["function"]} for c in m["tool_calls"]]
        out.append(m)
    return out


def _append(seg: Segment, delta: list[int], sample: Any) -> None:
    """The new messages' tokens (not trained) then the engine's, as `run_episodes` appends them."""
    traj = seg.traj
    if delta:
        append_observation(traj, delta, traj.turns - 1)
    append_generated(traj, sample, traj.turns, seg.routed)

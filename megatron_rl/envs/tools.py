"""Tool calls in the Qwen/Hermes format, parsed leniently, and the environment that runs them.

A model turn calls tools with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or
more); the environment answers with one `tool` message holding a `<tool_response>` per call (the
chat template renders it as the tool turn). Lenient: whitespace and a ```json fence around the
object, `arguments` given as a JSON string, `parameters` for `arguments`, and a last call left
open by a turn that stopped early are accepted. Anything else is a malformed call: an error
response the model can read, counted as `env/malformed_tool_call`, never an exception (JSON nested
too deep or with an integer past Python's digit limit included). A tool that raises gives an error
response (`env/tool_error`); one that runs past `env.tool_timeout_s` is abandoned
(`env/tool_timeout`). At most `env.max_tool_calls` calls of a turn run; the rest get one error
response (`env/too_many_tool_calls`). A turn without a tool call is the final answer: the episode ends.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.envs.base import Environment, Observation, Turn

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    text: str
    reason: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` of `text`, in order: a ToolCall, or a MalformedCall saying what is wrong."""
    calls: list[ToolCall | MalformedCall] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        try:
            obj = _json(body)
        except ValueError as err:
            calls.append(MalformedCall(body, f"not JSON ({err})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(MalformedCall(body, 'expected an object with a string "name"'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = _json(args) if args.strip() else {}
            except ValueError:
                calls.append(MalformedCall(body, '"arguments" is a string that is not a JSON object'))
                continue
        if not isinstance(args, dict):
            calls.append(MalformedCall(body, f'"arguments" must be an object, got {type(args).__name__}'))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def _json(text: str) -> Any:
    """json.loads, its every failure a ValueError: nesting too deep for the decoder's recursion, an
    integer longer than int's digit limit, or not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{err.msg} at char {err.pos}") from None
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as err:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(str(err).split(";")[0]) from None


class ToolTimeout(Exception):
    """Raised by a tool that enforces its own deadline (e.g. an HTTP timeout): counted as a timeout."""


def call_with_timeout(
    fn: Callable[[], Any],
    timeout_s: float,
    warn_every_s: float = 0.0,
    on_stall: Callable[[float], None] | None = None,
) -> tuple[str, Any]:
    """("ok", result), ("error", the exception) or ("timeout", None) after `timeout_s` seconds;
    `on_stall(seconds running)` after each `warn_every_s` (0 = never) while it runs.

    The call runs on a daemon thread: a call that never returns is abandoned, not joined."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put(("ok", fn()))
        except Exception as err:  # the tool's failure is the model's observation, not the step's
            box.put(("error", err))

    threading.Thread(target=run, daemon=True, name="megatron-rl-tool").start()
    began = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - began)
        if left <= 0:
            return "timeout", None
        warn = on_stall is not None and 0 < warn_every_s < left
        try:
            return box.get(timeout=warn_every_s if warn else left)
        except queue.Empty:
            if warn:
                on_stall(time.monotonic() - began)


async def on_daemon_thread(work: Callable[[], Any]) -> Any:
    """`work()` on a daemon thread of its own: one that never returns is abandoned at a timeout, and
    holds up neither the event loop's end nor the interpreter's (as `asyncio.to_thread` would)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(value: Any, err: BaseException | None) -> None:
        if not done.done():
            done.set_exception(err) if err is not None else done.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = work()
        except BaseException as err:  # handed to the awaiting coroutine
            error = err
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has ended: nobody waits for it
            pass

    threading.Thread(target=run, name="agent", daemon=True).start()
    return await done


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


class ToolEnvironment(Environment):
    """Runs the tool calls of each turn; subclasses provide `call_tool(name, arguments) -> str`."""

    tool_names: tuple[str, ...] = ()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError(f"{type(self).__name__}.call_tool")

    def step(self, turn: Turn) -> Observation:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Observation(done=True)
        responses, events = [], []
        limit = self.cfg.max_tool_calls
        for call in calls[:limit]:
            if isinstance(call, MalformedCall):
                events.append("malformed_tool_call")
                responses.append(json.dumps({"error": f"malformed tool call: {call.reason}"}))
                continue
            if self.tool_names and call.name not in self.tool_names:
                events.append("unknown_tool")
                responses.append(json.dumps({"error": f"unknown tool {call.name!r}; tools: {list(self.tool_names)}"}))
                continue
            status, value = call_with_timeout(
                lambda c=call: self.call_tool(c.name, c.arguments), self.cfg.tool_timeout_s
            )
            if status == "ok":
                events.append("tool_call")
                responses.append(str(value))
            elif status == "error" and not isinstance(value, ToolTimeout):
                events.append("tool_error")
                responses.append(json.dumps({"error": f"{type(value).__name__}: {value}"}))
            else:
                events.append("tool_timeout")
                responses.append(
                    json.dumps({"error": f"tool {call.name!r} timed out after {self.cfg.tool_timeout_s}s"})
                )
        if len(calls) > limit:
            events.append("too_many_tool_calls")
            responses.append(
                json.dumps({"error": f"{len(calls) - limit} more tool calls not run: at most {limit} a turn"})
            )
        return Observation(text="\n".join(responses), role="tool", events=events)

"""OpenAI's chat-completions format as the gateway speaks it: the request parsed and bounded, the reply built.

`parse_request` takes `messages`, `tools`, `temperature`, `max_tokens` / `max_completion_tokens`,
`stop` and `logprobs`; unknown fields are ignored, `stream` and `n` > 1 refused. Every refusal is a
`RequestError` 400 naming the field. A message is refused past `MAX_MESSAGE_CHARS` characters (its
content, name, tool-call id and tool calls together), naming its index, its size and the bound; a
tool call's `arguments` string is parsed as the request body is (`http.body.parse_json`: nesting at
most `MAX_DEPTH` levels, ...), and kept as the string it is when it is not JSON.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from aiohttp import web

from megatron_rl.envs.tools import MalformedCall, ToolCall, parse_tool_calls
from megatron_rl.http.body import BodyError, parse_json

ROLES = ("system", "developer", "user", "assistant", "tool")
# 2^20: a message this long is some 250,000 tokens or more, past any context a run trains on; its
# render takes seconds (a render thread's, never the gateway's loop)
MAX_MESSAGE_CHARS = 1 << 20


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


def _arguments(text: str, where: str) -> Any:
    """A tool call's `arguments` string: its JSON value ({} when blank), or the string when it is not JSON."""
    if not text.strip():
        return {}
    try:
        json.loads(text)
    except RecursionError:
        pass  # deeper than json's decoder can recurse: parse_json refuses it below
    except json.JSONDecodeError:
        return text
    except ValueError:
        pass  # an integer past Python's digit limit: parse_json names it below
    try:
        return parse_json(text.encode("utf-8"))
    except BodyError as err:  # its problem's path within the arguments, "body" for the whole value
        raise RequestError(400, f"{where}: {str(err).removeprefix('body: ')}") from None


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
            args = _arguments(args, f"{where}[{k}].function.arguments")
        calls.append(
            {"id": str(call.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return calls


def _chars(message: dict[str, Any]) -> int:
    """The characters of a parsed message: content, name, tool-call id, each tool call's id, name and
    arguments (as JSON text)."""
    size = sum(len(value) for key, value in message.items() if key != "role" and isinstance(value, str))
    for call in message.get("tool_calls", ()):
        args = call["function"]["arguments"]
        size += len(call["id"]) + len(call["function"]["name"])
        size += len(args) if isinstance(args, str) else len(json.dumps(args, ensure_ascii=False))
    return size


def parse_message(value: Any, k: int) -> dict[str, Any]:
    """Request message `k`, normalized: role, content (a string), tool_calls, tool_call_id, name."""
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
    size = _chars(message)
    if size > MAX_MESSAGE_CHARS:
        raise RequestError(400, f"{where}: {size} characters, over the gateway's limit of {MAX_MESSAGE_CHARS}")
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
        [parse_message(m, k) for k, m in enumerate(messages)],
        tools or None,
        None if temperature is None else float(temperature),
        max_tokens,
        list(stop or []),
        bool(logprobs),
    )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: tool calls without ids, arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"type": "function", "function": c["function"]} for c in m["tool_calls"]]
        out.append(m)
    return out


def reply_message(text: str, truncated: bool, events: Counter) -> tuple[dict[str, Any], str]:
    """The assistant message of generated `text` and its finish reason: its `<tool_call>`s as
    `tool_calls` (`finish_reason` "tool_calls", the content before the first call), counted in `events`."""
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    events["malformed_tool_call"] += sum(isinstance(c, MalformedCall) for c in parsed)
    if not calls:
        return {"role": "assistant", "content": text}, "length" if truncated else "stop"
    events["tool_call"] += len(calls)
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


def logprobs_content(tokenizer: Any, out: list[int], logprobs: list[float]) -> dict[str, Any]:
    """The choice's `logprobs`: one entry per generated token."""
    content = []
    for t, lp in zip(out, logprobs, strict=True):
        piece = tokenizer.decode([t])
        content.append(
            {
                "token": piece,
                "logprob": lp if math.isfinite(lp) else -9999.0,
                "bytes": list(piece.encode()),
                "top_logprobs": [],
            }
        )
    return {"content": content}

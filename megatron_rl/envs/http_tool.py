"""The `http_tool` environment: every tool call is POSTed to the user's tool server.

Request: `POST env.tool_url` with JSON `{"name": ..., "arguments": {...}}` (and
`Authorization: Bearer env.tool_api_key` when set); the answer is JSON `{"result": ...}` (a
string, or any JSON value, sent back as JSON) or `{"error": "..."}`. Each call waits at most
`env.tool_timeout_s` and reads at most `env.max_tool_reply_bytes`; an HTTP error, a bad or longer
answer or the timeout become the tool's error response (counted), as for any tool.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from megatron_rl.envs.tools import ToolEnvironment, ToolTimeout


class ToolServerError(RuntimeError):
    pass


class HttpToolEnv(ToolEnvironment):
    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        url = self.cfg.tool_url
        if not url:
            raise ToolServerError("env.type = http_tool needs env.tool_url")
        headers = {"Content-Type": "application/json"}
        if self.cfg.tool_api_key:
            headers["Authorization"] = f"Bearer {self.cfg.tool_api_key}"
        body = json.dumps({"name": name, "arguments": arguments}).encode()
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.tool_timeout_s) as reply:
                data = reply.read(self.cfg.max_tool_reply_bytes + 1)
            if len(data) > self.cfg.max_tool_reply_bytes:
                raise ToolServerError(
                    f"tool server {url} answered more than env.max_tool_reply_bytes = {self.cfg.max_tool_reply_bytes}"
                )
            answer = json.loads(data.decode())
        except urllib.error.HTTPError as err:
            raise ToolServerError(f"tool server {url} answered HTTP {err.code}") from err
        except TimeoutError as err:
            raise ToolTimeout(f"tool server {url} did not answer within {self.cfg.tool_timeout_s}s") from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise ToolTimeout(f"tool server {url} did not answer within {self.cfg.tool_timeout_s}s") from err
            raise ToolServerError(f"tool server {url} is unreachable: {err.reason}") from err
        except json.JSONDecodeError as err:
            raise ToolServerError(f"tool server {url} answered with invalid JSON: {err.msg}") from err
        if not isinstance(answer, dict) or ("result" not in answer and "error" not in answer):
            raise ToolServerError(
                f'tool server {url}: expected {{"result": ...}} or {{"error": ...}}, got {answer!r:.200}'
            )
        if "error" in answer:
            raise ToolServerError(str(answer["error"]))
        result = answer["result"]
        return result if isinstance(result, str) else json.dumps(result)

"""The tiny_tools episode as a black-box agent, written with the `openai` package.

It asks the model, runs the calculator on each tool call of the reply and sends the results back as
`tool` messages, and asks again, until a reply holds no tool call (the final answer) or it has
asked `MAX_CALLS` times. The run's reward rule scores the final answer. Two ways to run it:

- As a program, one per episode: `env.agent_command: "python examples/tiny_tools/openai_agent.py"`.
  It reads `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` from its environment, and the task
  row as JSON from stdin.
- As a function, in the trainer's process: `env.agent: examples.tiny_tools.openai_agent:agent`.
  This is what run.sh's gateway command uses: a program costs a Python start-up and an `openai`
  import (about 1 s of CPU) for each of the 256 episodes of a step.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from megatron_rl.envs.calculator import CalculatorError, evaluate_expression

MAX_CALLS = 3  # rl.yaml's env.max_turns


def calculator(name: str, arguments: str) -> str:
    """The tool's answer to one call, or an error the model can read (as the environment words it)."""
    if name != "calculator":
        return json.dumps({"error": f"unknown tool {name!r}; tools: ['calculator']"})
    try:
        return evaluate_expression(str(json.loads(arguments)["expression"]))
    except (CalculatorError, ValueError, KeyError, TypeError) as err:
        return json.dumps({"error": f"{type(err).__name__}: {err}"})


async def episode(client: AsyncOpenAI, model: str, messages: list[dict[str, Any]]) -> None:
    for _ in range(MAX_CALLS):
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls or reply.finish_reason == "length":
            return
        for call in reply.message.tool_calls:
            answer = calculator(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})


def client_for(base_url: str, api_key: str) -> AsyncOpenAI:
    """A client of `base_url`. The CA bundle is loaded only for https: loading it costs about 40 ms of
    CPU per client (10 s a step for 256 episodes), and the gateway's URL is plain http."""
    http = DefaultAsyncHttpxClient(verify=not base_url.startswith("http://"))
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)


async def agent(base_url: str, api_key: str, row: Any) -> None:
    """`env.agent`: one episode of the task row (a `megatron_rl.data.Prompt`)."""
    async with client_for(base_url, api_key) as client:
        await episode(client, "policy", list(row.raw["prompt"]))


async def main() -> None:
    row = json.loads(sys.stdin.read())
    env = os.environ
    async with client_for(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]) as client:
        await episode(client, env["OPENAI_MODEL"], list(row["row"]["prompt"]))


if __name__ == "__main__":
    asyncio.run(main())

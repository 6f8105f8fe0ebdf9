"""Benchmark of multi-turn collection with a slow tool: the episodes' environment steps side by side
against one after another, and the same episodes driven by a black-box agent through the gateway.

--episodes episodes (64) x --turns turns (3) on the local engine (`megatron-rl serve`, the tiny_math
policy of examples/tiny_math, seeded); after every model turn the environment POSTs the turn to a
loopback HTTP tool server that answers after --tool-latency-s (0.2 s). Both sides run the
collector's own `run_episodes` on the same engine and prompts, alternating, --repeats times (the
median reported): `one_by_one` with env.max_concurrent_steps = 1 (the steps one after another, as
collection ran them before), `side_by_side` with env.max_concurrent_steps = --episodes, and `gateway`: the collector's
`run_agent_episodes` with an agent written with the `openai` client that does what the
environment does (the model's reply to the tool, its answer back as a `tool` message, for --turns
turns; the same sampling, so the same trajectories). Per side: wall seconds, `tool_wait_share` (the
share of the wall time during which a step was waiting on the tool) and `engine_idle_share` (the
share during which no generation ran); the last line gives `speedup` = one_by_one wall /
side_by_side wall and `gateway_ratio` = gateway wall / side_by_side wall.

    python tools/bench/agentic.py [--episodes 64] [--turns 3] [--tool-latency-s 0.2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class Intervals:
    """Busy intervals recorded from several threads; `covered` is the length of their union."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[float, float]] = []

    def add(self, began: float, ended: float) -> None:
        with self.lock:
            self.spans.append((began, ended))

    def covered(self) -> float:
        total, end = 0.0, float("-inf")
        for began, ended in sorted(self.spans):
            if ended > end:
                total += ended - max(began, end)
                end = ended
        return total


def serve_tool(latency_s: float) -> ThreadingHTTPServer:
    """A loopback tool server (a thread per request) that answers every POST after `latency_s`."""

    class Tool(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(latency_s)  # the tool's latency being measured against, not a synchronisation
            body = b"7"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tool)
    threading.Thread(target=server.serve_forever, daemon=True, name="tool-server").start()
    return server


def timed_engine(engine: Any, busy: Intervals) -> Any:
    """`engine` whose `generate` calls are recorded in `busy`."""

    class Timed:
        restarts = 0

        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await engine.generate(*args, **kwargs)
            finally:
                busy.add(began, time.perf_counter())

        def close(self) -> None:
            pass

    return Timed()


def tool_environment(url: str, waits: Intervals, turns: int) -> type:
    from megatron_rl.envs import Environment, Observation

    class SlowTool(Environment):
        """Every turn is sent to the tool; its answer is the observation, for `turns` turns."""

        def step(self, turn: Any) -> Any:
            began = time.perf_counter()
            request = urllib.request.Request(url, data=turn.text.encode(), method="POST")
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = reply.read().decode()
            waits.add(began, time.perf_counter())
            return Observation(text=answer, done=turn.index + 1 >= turns)

    return SlowTool


def tool_agent(url: str, waits: Intervals, turns: int) -> Any:
    """The environment's episode as an OpenAI-API agent: each reply POSTed to the tool, its answer
    sent back as a `tool` message, for `turns` turns."""
    import aiohttp

    sys.path.insert(0, str(REPO / "examples" / "tiny_tools"))
    from openai_agent import client_for  # the example agent's client

    async def agent(base_url: str, api_key: str, row: Any) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": row.text}]
        async with client_for(base_url, api_key) as client, aiohttp.ClientSession() as http:
            for turn in range(turns):
                reply = await client.chat.completions.create(model="policy", messages=messages)
                content = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": content})
                if reply.choices[0].finish_reason == "length" or turn + 1 >= turns:
                    return
                began = time.perf_counter()
                async with http.post(url, data=content.encode()) as answer:
                    text = await answer.text()
                waits.add(began, time.perf_counter())
                messages.append({"role": "tool", "content": text})

    return agent


def collect(engine: Any, tokenizer: Any, url: str, args: argparse.Namespace, side: str) -> dict:
    from megatron_rl.agents import run_agent_episodes
    from megatron_rl.config import EnvConfig
    from megatron_rl.data import Prompt, RowLocation
    from megatron_rl.envs import TurnRenderer, run_episodes
    from megatron_rl.rollout.types import SamplingParams

    concurrent_steps = 1 if side == "one_by_one" else args.episodes
    cfg = EnvConfig(max_turns=args.turns, max_concurrent_steps=concurrent_steps, max_total_tokens=256)
    generating, waiting = Intervals(), Intervals()
    rows = []
    for i in range(args.episodes):
        messages = [{"role": "user", "content": f"{i % 10}+{i % 7}="}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(Prompt(i, tuple(ids), messages[0]["content"], "0", {}, RowLocation("bench", "row", i)))

    # a turn ends at one of these characters (about 1 token in 7 of the untrained policy's): turns of
    # a few tokens, rarely cut at --max-new-tokens (a cut turn would end its episode early)
    stops = tuple(tokenizer.convert_tokens_to_ids(list(" \n=:")))

    def params(turn: int, i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, sampling_seed=turn * 1000 + i)

    timed, renderer = timed_engine(engine, generating), TurnRenderer(tokenizer)
    agent = tool_agent(url, waiting, args.turns) if side == "gateway" else None
    began = time.perf_counter()
    if agent is not None:
        agents = run_agent_episodes(timed, rows, params, renderer, cfg, max_concurrency=args.episodes, agent=agent)
        episodes = engine.loop.run(agents, 3600)
        trajectories = [e.trajectory for e in episodes]
    else:
        env_class = tool_environment(url, waiting, args.turns)
        run = run_episodes(timed, [env_class(cfg) for _ in rows], rows, params, renderer, cfg)
        trajectories = engine.loop.run(run, 3600)
    wall = time.perf_counter() - began
    turns = sum(t.turns for t in trajectories)
    return {
        "wall_s": wall,
        "turns": turns,
        "tool_wait_share": waiting.covered() / wall,
        "engine_idle_share": 1.0 - generating.covered() / wall,
        "tokens": [t.prompt_ids + t.output_ids for t in trajectories],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-latency-s", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO / "examples" / "tiny_math"))
    from megatron_rl.config import RolloutConfig
    from megatron_rl.data import load_tokenizer
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.event_loop import RolloutLoop

    import tiny_model

    tool = serve_tool(args.tool_latency_s)
    url = f"http://127.0.0.1:{tool.server_address[1]}/tool"
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        tiny_model.build_model(model, seed=0)
        tokenizer = load_tokenizer(str(model))
        rollout = RolloutConfig(max_concurrency=args.episodes, request_timeout_s=600)
        engine = RolloutEngine.from_config(
            rollout, RolloutLoop(), str(model), extra_args=["--threads", str(args.threads)]
        )
        try:
            runs: dict[str, list[dict]] = {name: [] for name in ("one_by_one", "side_by_side", "gateway")}
            for _ in range(args.repeats):
                for name in runs:
                    runs[name].append(collect(engine, tokenizer, url, args, name))
        finally:
            engine.close()
            engine.loop.close()
            tool.shutdown()
    median = {}
    for name, results in runs.items():
        median[name] = sorted(results, key=lambda r: r["wall_s"])[len(results) // 2]
        line = {"side": name, "episodes": args.episodes, "turns_per_episode": args.turns, **median[name]}
        del line["tokens"]
        line["wall_s_runs"] = [round(r["wall_s"], 3) for r in results]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}))
    speedup = median["one_by_one"]["wall_s"] / median["side_by_side"]["wall_s"]
    spread = statistics.pstdev(r["wall_s"] for r in runs["side_by_side"])
    ratio = median["gateway"]["wall_s"] / median["side_by_side"]["wall_s"]
    # the same sampling on both: the gateway's trajectories are the environment's, token for token
    same = [a["tokens"] == b["tokens"] for a, b in zip(runs["gateway"], runs["side_by_side"], strict=True)]
    summary = {
        "same_trajectories_as_side_by_side": same,
        "speedup": round(speedup, 2),
        "gateway_ratio": round(ratio, 2),
        "side_by_side_wall_s_stdev": round(spread, 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

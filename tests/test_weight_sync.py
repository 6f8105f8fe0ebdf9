"""Weight sync from the Megatron actor to the local engine, all three modes, one gloo launch per world size
(tests/mrl_multiproc/scenarios_weight_sync.py): after every sync the engine's tensors equal the trainer's
bit for bit, every tensor was sent once, by a sender (PP stage, EP rank) that holds it, and the engine's
log-probs of its own samples equal the actor's (<= 1e-4), routing agrees off near-ties, R3 replay dispatches exactly the engine's
experts; refused updates name the tensor and leave the old weights serving; with fully_async partial
rollouts a sync under running requests retracts and continues them, each token's version and log-prob right;
without partial rollouts a distributed sync pauses them with mode "abort" for the whole transfer.

Two engine subprocesses serve both launches (world size 1: every mode and the refusals, into the
first; world size 2: TP=2 into the first, EP=2 and PP=2 (uneven stages: 1 + 3 layers) into both: several senders into servers that
take one update at a time, as SGLang's do, each behind a proxy that holds every control request a
random few milliseconds, so that requests posted at once reach the two in different orders).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from megatron_rl.rollout.local.launcher import LocalEngineProcess, spawn_local_engine

from mrl_configs import hf_config, save_random_hf_model
from mrl_multiproc.launcher import ScenarioLaunches, scenario_test

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

WORLDS = {
    1: ["w1_three_modes", "w1_refused_updates", "w1_partial_rollout", "w1_lora_sync"],
    2: ["w2_tp2", "w2_ep2", "w2_pp2"],
}


def make_policy(folder: Path) -> str:
    """A tiny Qwen3-MoE (4 layers, the first dense, 4 experts top-2) with O(1) activations, so routing
    margins are rarely near-ties."""
    config = hf_config(
        "qwen3_moe",
        "split",
        vocab_size=256,
        max_position_embeddings=128,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    return str(save_random_hf_model(folder, config))


_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding"}


class JitterProxy:
    """An HTTP proxy in front of a server that holds each control request (every POST but /generate) for a
    random few milliseconds before forwarding it, as a network between trainer and engines may: requests that
    several senders post at once then reach two servers in different orders, which is what deadlocks servers
    that take one update at a time unless the senders post in turns (issue 35's reproduction). Runs on a thread
    and event loop of its own; `url` is its address."""

    def __init__(self, target: str, max_delay_s: float = 0.01, seed: int = 0) -> None:
        self.target, self.max_delay_s, self.rng = target, max_delay_s, random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="jitter-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError(f"the jitter proxy in front of {target} did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._started.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.method == "POST" and request.path != "/generate":
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as r:
            data = await r.read()
            kept = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_BY_HOP}
            return web.Response(body=data, status=r.status, headers=kept)

    def stop(self) -> None:
        async def close() -> None:
            await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_policy(tmp_path_factory.mktemp("sync") / "policy")


@pytest.fixture(scope="module")
def engines(policy: str) -> Iterator[list[LocalEngineProcess]]:
    args, env = ["--threads", "1", "--no-auth"], {"OMP_NUM_THREADS": "1"}
    starting = [spawn_local_engine(policy, extra_args=args, env=env) for _ in range(2)]  # they load side by side
    procs = []
    try:
        procs += [engine.wait() for engine in starting]
        yield procs
    finally:
        for engine in starting[len(procs) :]:
            engine.kill()
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def jittered(engines: list[LocalEngineProcess]) -> Iterator[list[str]]:
    proxies = [JitterProxy(engine.url, seed=i) for i, engine in enumerate(engines)]
    try:
        yield [proxy.url for proxy in proxies]
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.fixture(scope="module")
def launches(policy: str, engines: list[LocalEngineProcess], jittered: list[str]) -> ScenarioLaunches:
    def engine_alive() -> None:
        for engine in engines:
            if not engine.alive():
                raise AssertionError(f"an engine died during the launch:\n{engine.log_tail()}")

    return ScenarioLaunches(
        "scenarios_weight_sync",
        WORLDS,
        params={"model": policy, "engine_urls": [engine.url for engine in engines], "jittered_urls": jittered},
        after_launch=engine_alive,
        timeout_s=300,
    )


test_scenario = scenario_test(WORLDS)

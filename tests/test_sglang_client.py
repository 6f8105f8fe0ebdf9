"""The SGLang client against an in-process HTTP server that answers as a given SGLang release does
(the fields and statuses read from the 0.5.23 wheel): per-token weight versions required by partial
rollouts (refused before 0.5.19), /model_info and /server_info before their deprecated aliases, the
admin key on control endpoints."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from mrl_engine import on_loop, rollout_loop

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sglang import SGLangClient, SGLangError, UnauthorizedError
from megatron_rl.rollout.types import SamplingParams

KEY, ADMIN = "user-key", "admin-key"


class FakeSGLang:
    """An HTTP server on 127.0.0.1 (own thread and loop) answering as SGLang `version`: `/model_info`
    and `/server_info` only from 0.5.10 here (older: the `get_` aliases alone), `weight_versions`
    spans from 0.5.19, and `--admin-api-key` semantics when `admin_key` is set. `seen` records
    (path, Authorization) of every request."""

    def __init__(self, version: str, admin_key: str | None = None) -> None:
        self.version, self.admin_key = version, admin_key
        self.seen: list[tuple[str, str | None]] = []
        self.modern = tuple(int(n) for n in version.split(".")) >= (0, 5, 10)
        self.spans = tuple(int(n) for n in version.split(".")) >= (0, 5, 19)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the fake SGLang server did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/workers", self._not_found)
        info = {"model_info": self._model_info, "server_info": self._server_info}
        for name, handler in info.items():
            app.router.add_get(f"/get_{name}", handler)
            if self.modern:
                app.router.add_get(f"/{name}", handler)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/pause_generation", self._paused)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._started.set()
        self._loop.run_forever()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        auth = request.headers.get("Authorization")
        self.seen.append((request.path, auth))
        control = request.path == "/pause_generation"
        wanted = ADMIN if control and self.admin_key else KEY
        if auth != f"Bearer {wanted}":
            return web.Response(status=401)
        return await handler(request)

    async def _not_found(self, request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def _paused(self, request: web.Request) -> web.Response:
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "weight_version": "3"})

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version, "internal_states": [{}]})

    async def _generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        n = int(body["sampling_params"]["max_new_tokens"])
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": n},
            "weight_version": "3",
            "output_token_logprobs": [[-1.0, 7, None]] * n,
        }
        if self.spans:
            meta["weight_versions"] = [{"version": "3", "start": 0, "end": n}]
        return web.json_response({"text": "", "output_ids": [7] * n, "meta_info": meta})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture
def servers() -> Iterator[dict[str, FakeSGLang]]:
    made = {v: FakeSGLang(v) for v in ("0.5.9", "0.5.18", "0.5.23")}
    try:
        yield made
    finally:
        for server in made.values():
            server.close()


def _partial(url: str, **keys: object) -> RolloutConfig:
    return RolloutConfig(
        engine="sglang", sglang_urls=[url], api_key=KEY, async_mode="fully_async", partial_rollout=True, **keys
    )


def test_partial_rollouts_refuse_servers_without_per_token_versions(servers: dict[str, FakeSGLang]) -> None:
    old = servers["0.5.18"]
    with pytest.raises(SGLangError, match=rf"{old.url} runs SGLang 0\.5\.18, whose replies give one weight version"):
        RolloutEngine.from_config(_partial(old.url), rollout_loop())
    with pytest.raises(SGLangError, match=r"runs SGLang 0\.5\.9.*SGLang >= 0\.5\.19"):  # via /get_server_info
        RolloutEngine.from_config(_partial(servers["0.5.9"].url), rollout_loop())
    params = SamplingParams(max_new_tokens=3)
    with RolloutEngine.from_config(_partial(servers["0.5.23"].url), rollout_loop()) as engine:
        (sample,) = on_loop(engine.generate([[1, 2]], params))
        assert sample.weight_versions == ["3"] * 3
    # without partial rollouts a response has one version: the reply's is every token's
    plain = _partial(old.url)
    plain.partial_rollout = False
    with RolloutEngine.from_config(plain, rollout_loop()) as engine:
        assert on_loop(engine.generate([[1, 2]], params))[0].weight_versions == ["3"] * 3

    # a server whose version does not tell (a development build) is refused at its first reply without spans
    async def unknown_build() -> None:
        async with SGLangClient([old.url], api_key=KEY) as client:
            client.token_versions_required = True
            client.server_versions[old.url] = "0.5.18"
            await client.generate([1, 2], params)

    with pytest.raises(SGLangError, match=r"no meta_info.weight_versions .* report .*: 0\.5\.18\)"):
        asyncio.run(unknown_build())


def test_model_info_before_the_deprecated_alias_and_the_admin_key_on_control_endpoints(
    servers: dict[str, FakeSGLang],
) -> None:
    new, old = servers["0.5.23"], servers["0.5.9"]

    async def infos() -> tuple[dict, dict]:
        async with SGLangClient([new.url], api_key=KEY) as a, SGLangClient([old.url], api_key=KEY) as b:
            return await a.get_model_info(), await b.get_model_info()

    assert [i["weight_version"] for i in asyncio.run(infos())] == ["3", "3"]
    assert [p for p, _ in new.seen] == ["/model_info"]  # never the alias that logs a warning per call
    assert [p for p, _ in old.seen] == ["/model_info", "/get_model_info"]  # 404, then the alias

    admin = FakeSGLang("0.5.23", admin_key=ADMIN)
    try:

        async def pause(admin_key: str | None) -> None:
            async with SGLangClient([admin.url], api_key=KEY, admin_api_key=admin_key) as client:
                await client.pause_generation("abort")
                await client.generate([1, 2], SamplingParams(max_new_tokens=1))

        with pytest.raises(UnauthorizedError, match=r"--admin-api-key takes only that key here: set rollout.admin"):
            asyncio.run(pause(None))
        asyncio.run(pause(ADMIN))
        assert admin.seen[-2:] == [("/pause_generation", f"Bearer {ADMIN}"), ("/generate", f"Bearer {KEY}")]
    finally:
        admin.close()


def test_lora_adapter_sync_refuses_servers_too_old_for_its_adapters(servers: dict[str, FakeSGLang]) -> None:
    from megatron_rl.config import LoraConfig, ModelConfig

    experts = ModelConfig(num_experts=4, lora=LoraConfig(rank=4))  # the default targets adapt the experts too
    attention = ModelConfig(num_experts=4, lora=LoraConfig(rank=4, target_modules=["q_proj"]))

    def rollout(version: str, **keys: object) -> RolloutConfig:
        return RolloutConfig(engine="sglang", sglang_urls=[servers[version].url], api_key=KEY, **keys)

    with pytest.raises(
        SGLangError,
        match=r"runs SGLang 0\.5\.9, which serves no adapter on MoE layers: model.lora.target_modules "
        r"\['down_proj', 'gate_proj', 'up_proj'\] with rollout.lora_sync = 'adapter' needs .* SGLang >= 0\.5\.10; "
        r"upgrade the servers or set rollout.lora_sync = 'merged'",
    ):
        RolloutEngine.from_config(rollout("0.5.9"), rollout_loop(), model=experts)
    with pytest.raises(
        SGLangError,
        match=r"0\.5\.9, which loads adapters from tensors only as one serialized_tensors string .*0\.5\.17",
    ):
        RolloutEngine.from_config(rollout("0.5.9", weight_sync="tensor"), rollout_loop(), model=attention)
    RolloutEngine.from_config(
        rollout("0.5.9"), rollout_loop(), model=attention
    ).close()  # disk, attention only: any version
    RolloutEngine.from_config(
        rollout("0.5.9", lora_sync="merged"), rollout_loop(), model=experts
    ).close()  # full weights
    RolloutEngine.from_config(rollout("0.5.18", weight_sync="tensor"), rollout_loop(), model=experts).close()


def test_servers_that_do_not_answer_or_refuse_the_key_are_one_line_before_the_model_starts() -> None:
    """`rollout.sglang_urls` that nobody serves, or a server refusing `rollout.api_key`, ended the run after the
    slow model start with a `GET /workers failed` traceback; `check_rollout_servers` (rank 0, before the actor
    starts) asks as the engine's start does and raises one ConfigError line naming the address."""
    from megatron_rl.config import Config, ConfigError
    from megatron_rl.loop.runtime import check_rollout_servers
    from megatron_rl.parallel.launch import free_port

    def run(url: str, key: str) -> Config:
        return Config(rollout=RolloutConfig(engine="sglang", sglang_urls=[url], api_key=key))

    gone = f"http://127.0.0.1:{free_port()}"
    server = FakeSGLang("0.5.23")
    try:
        check_rollout_servers(run(server.url, KEY), rollout_loop())  # it answers and takes the key
        with pytest.raises(ConfigError) as refused:
            check_rollout_servers(run(gone, KEY), rollout_loop())
        with pytest.raises(ConfigError) as wrong_key:
            check_rollout_servers(run(server.url, "not-the-key"), rollout_loop())
    finally:
        server.close()
    assert str(refused.value) == (
        f"rollout.sglang_urls: GET /workers failed after 1 tries; last server {gone}: connection refused"
    )
    assert str(wrong_key.value) == (
        f"rollout.sglang_urls: GET /workers to {server.url}: HTTP 401 (missing or wrong API key); the key sent is "
        "rollout.api_key, else $MEGATRON_RL_ENGINE_API_KEY"
    )
    check_rollout_servers(Config(), rollout_loop())  # the local engine: nothing to ask

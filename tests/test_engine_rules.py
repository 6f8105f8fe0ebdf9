"""The local engine follows SGLang 0.5.23's rules where the trainer depends on them, each rule read
from the wheel here (tests/sglang_wheel.py), so that a change in SGLang is one failing test:

- keys: `/health*`, `/ready*`, `/metrics*` open; the admin key, when set, alone on the endpoints SGLang
  marks `ADMIN_OPTIONAL`; the API key on the others (`srt/utils/auth.py` `decide_request_auth`);
- weight-update requests one at a time per server, in arrival order, each blocking inside its receive
  (`FanOutCommunicator.queueing_call`, the scheduler's synchronous handlers);
- a group's init and its first broadcast wait for every rank of the group.

Two engines served in this process (two `LocalServer`s on their own engine threads, one tiny model).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import sglang_wheel
import torch
from aiohttp import web

from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout import wire
from megatron_rl.rollout.local import auth
from megatron_rl.rollout.local.engine_thread import EngineThread
from megatron_rl.rollout.local.generator import Generator
from megatron_rl.rollout.local.model import load_model
from megatron_rl.rollout.local.server import LocalServer

from mrl_configs import make_tiny_model

KEY, ADMIN = "api-key", "admin-key"
WAIT_S = 60.0  # the most any wait below takes before the test fails
NORM = "model.norm.weight"  # the tensor the updates below send


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("rules") / "model"), "qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def engines(model: str) -> Iterator[list[EngineThread]]:
    threads = []
    for _ in range(2):
        weights, info = load_model(model, "cpu", "auto")
        threads.append(EngineThread(weights, info, Generator(weights, info, 4, 1024, seed=0)))
        threads[-1].start()
    try:
        yield threads
    finally:
        for thread in threads:
            thread.stop()


@pytest.fixture(autouse=True)
def both_sides_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's and the engines' sides of a group register one group name in this process: torch's
    registry of names (for its functional collectives, which nothing here uses) keeps the first."""
    from torch.distributed import distributed_c10d as c10d

    register = c10d._register_process_group

    def first_wins(name: str, group: Any) -> None:
        with contextlib.suppress(RuntimeError):
            register(name, group)

    monkeypatch.setattr(c10d, "_register_process_group", first_wins)


@contextlib.asynccontextmanager
async def served(*servers: LocalServer) -> AsyncIterator[list[str]]:
    runners = []
    try:
        for server in servers:
            runners.append(web.AppRunner(server.app()))
            await runners[-1].setup()
            site = web.TCPSite(runners[-1], "127.0.0.1", 0)
            await site.start()
        yield [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
    finally:
        for runner in runners:
            await runner.cleanup()
        for server in servers:
            server.updates.close()


def servers(engines: list[EngineThread], api_key: str | None = None, admin: str | None = None) -> list[LocalServer]:
    return [LocalServer(e, e.info, api_key, None, admin) for e in engines]


async def call(url: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        method = "GET" if body is None else "POST"
        async with session.request(method, url + path, json=body, headers=headers) as reply:
            text = await reply.text()
            try:
                return reply.status, json.loads(text)
            except ValueError:
                return reply.status, text


# ---- keys ----


def sglang_admin_levels() -> tuple[dict[str, str], set[str]]:
    """SGLang 0.5.23's http_server: path -> the level its endpoint is marked with (ADMIN_OPTIONAL, or
    NORMAL without a mark), and the paths whose endpoint demands the admin key by hand (its
    `_admin_api_key_missing_response`: the ADMIN_FORCE endpoints in all but name)."""
    tree = ast.parse(sglang_wheel.source("srt/entrypoints/http_server.py").read_text())
    levels: dict[str, str] = {}
    forced: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
            if isinstance(d.args[0].value, str) and d.args[0].value.startswith("/")
        ]
        marks = {ast.unparse(d) for d in node.decorator_list}
        level = "ADMIN_OPTIONAL" if "auth_level(AuthLevel.ADMIN_OPTIONAL)" in marks else "NORMAL"
        if "auth_level(AuthLevel.ADMIN_FORCE)" in marks or "_admin_api_key_missing_response" in ast.unparse(node):
            forced.update(paths)
        levels.update(dict.fromkeys(paths, level))
    return levels, forced


def test_every_endpoint_has_sglangs_key_level(engines: list[EngineThread]) -> None:
    """Each path the local engine serves is one of SGLang's, at SGLang's level: open (/health*),
    admin (ADMIN_OPTIONAL: `auth.ADMIN_PATHS`) or normal; none is one SGLang keeps for the admin key alone."""
    levels, forced = sglang_admin_levels()
    served_paths = {route.resource.canonical for route in servers(engines[:1])[0].app().router.routes()}
    assert served_paths - set(levels) == set(), "paths SGLang does not serve"
    assert served_paths & forced == set()
    for path in served_paths - {p for p in served_paths if p.startswith(auth.OPEN_PREFIXES)}:
        assert (path in auth.ADMIN_PATHS) == (levels[path] == "ADMIN_OPTIONAL"), path


def test_key_decisions_are_decide_request_auths() -> None:
    """`auth.allowed` answers as the wheel's own `decide_request_auth` for every method, path class,
    header form and key configuration (the level as SGLang marks the path)."""
    wheel = sglang_wheel.load_module("srt/utils/auth.py")
    paths = ["/health", "/health_generate", "/ready", "/metrics", "/generate", "/model_info", "/flush_cache"]
    paths += ["/update_weights_from_distributed", "/load_lora_adapter", "/pause_generation"]
    headers = [None, "", "Bearer k", "bearer k", "BEARER k", "Bearer  k", "Bearerk", "Basic k", "Bearer a", "Bearer x"]
    checked = 0
    for api_key in (None, "k"):
        for admin_key in (None, "a"):
            for method in ("GET", "POST", "OPTIONS"):
                for path in paths:
                    level = wheel.AuthLevel.ADMIN_OPTIONAL if path in auth.ADMIN_PATHS else wheel.AuthLevel.NORMAL
                    for header in headers:
                        theirs = wheel.decide_request_auth(
                            method=method,
                            path=path,
                            authorization_header=header,
                            api_key=api_key,
                            admin_api_key=admin_key,
                            auth_level=level,
                        )
                        ours = auth.allowed(method, path, header, api_key, admin_key)
                        assert ours == theirs.allowed, (method, path, header, api_key, admin_key)
                        assert theirs.allowed or theirs.error_status_code == 401
                        checked += 1
    assert checked == 2 * 2 * 3 * len(paths) * len(headers)


@pytest.mark.parametrize("kind", ["open", "normal", "admin"])
def test_each_endpoint_class_takes_its_key(engines: list[EngineThread], kind: str) -> None:
    """Over HTTP, one endpoint of each class, on an engine with both keys and on one with the API key only."""
    path, body = {
        "open": ("/health", None),
        "normal": ("/get_model_info", None),
        "admin": ("/update_weights_from_tensor", {"serialized_named_tensors": []}),  # refused 400, once let in
    }[kind]

    async def go() -> None:
        both, api_only = servers(engines[:1], KEY, ADMIN)[0], servers(engines[1:], KEY)[0]
        async with served(both, api_only) as (with_admin, without_admin):
            statuses = {
                (url, key): (await call(url, path, body, key))[0]
                for url in (with_admin, without_admin)
                for key in (None, "wrong", KEY, ADMIN)
            }
        let_in = {
            "open": {(u, k) for u in (with_admin, without_admin) for k in (None, "wrong", KEY, ADMIN)},
            "normal": {(with_admin, KEY), (without_admin, KEY)},
            "admin": {(with_admin, ADMIN), (without_admin, KEY)},
        }[kind]
        for (url, key), status in statuses.items():
            assert (status != 401) == ((url, key) in let_in), (kind, url == with_admin, key, status)

    asyncio.run(go())


# ---- one update at a time, in arrival order ----


def test_the_queue_and_blocking_rules_are_sglangs() -> None:
    """What the local engine's queue copies, read in the wheel: each control communicator's call is
    FIFO (an asyncio.Lock held until its reply), the group, session, update and LoRA communicators
    queue, and the scheduler's handlers for them are synchronous (the scheduler blocks in them): the
    group init in `init_custom_process_group`, the distributed update in its broadcasts."""
    communicator = sglang_wheel.source("srt/managers/communicator.py").read_text()
    tree = ast.parse(communicator)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "queueing_call")
    assert "async with self._queueing_lock:" in ast.unparse(call)
    assert "self._queueing_lock = asyncio.Lock()" in communicator
    mixin = ast.parse(sglang_wheel.source("srt/managers/tokenizer_control_mixin.py").read_text())
    specs = next(
        n.value for n in mixin.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_COMMUNICATOR_SPECS"
    )
    modes = {ast.literal_eval(e.elts[0]): len(e.elts) for e in specs.elts}
    queued = ["init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed"]
    queued += ["update_weights_from_tensor", "begin_weight_update", "end_weight_update", "update_lora_adapter"]
    assert {name: modes[name] for name in queued} == dict.fromkeys(queued, 2), "a third element is a non-queueing mode"
    handlers = ast.parse(sglang_wheel.source("srt/managers/scheduler_components/weight_updater.py").read_text())
    kinds = {n.name: type(n) for n in ast.walk(handlers) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed"):
        assert kinds[name] is ast.FunctionDef, name
    runner = sglang_wheel.source("srt/model_executor/model_runner_components/weight_updater.py").read_text()
    runner_tree = ast.parse(runner)
    functions = {n.name: ast.unparse(n) for n in ast.walk(runner_tree) if isinstance(n, ast.FunctionDef)}
    assert "init_custom_process_group(" in functions["init_weights_update_group"]
    receive = functions["receive_weights_from_distributed"]
    assert "torch.distributed.broadcast(" in receive and "handle.wait()" in receive


def join_as_trainer(port: int, world: int, name: str, timeout_s: float = WAIT_S) -> Any:
    """Rank 0 of a weight-update group (the trainer's side), on a thread: a future of the group."""
    return wire.in_daemon_thread(wire.init_weights_update_group, "127.0.0.1", port, 0, world, name, "gloo", timeout_s)


async def init_group(urls: list[str], port: int, name: str) -> list[tuple[int, Any]]:
    world = 1 + len(urls)
    bodies = [
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1 + i, "world_size": world}
        | {"group_name": name, "backend": "gloo"}
        for i in range(len(urls))
    ]
    return list(
        await asyncio.gather(*(call(u, "/init_weights_update_group", b) for u, b in zip(urls, bodies, strict=True)))
    )


def update_body(name: str, value: torch.Tensor) -> dict:
    return {"names": [NORM], "dtypes": ["float32"], "shapes": [list(value.shape)], "group_name": name}


def test_updates_are_taken_one_at_a_time_in_arrival_order(engines: list[EngineThread], model: str) -> None:
    """A distributed update waits in its receive; a tensor update, a disk update, a second group's init
    and a LoRA unload posted after it (in this order) are all answered after it, in their order."""
    from megatron_rl.weight_sync.send import serialize_named_tensors

    norm = engines[0].layout.targets[NORM]
    sent = torch.full_like(norm, 2.0)
    payload, shm = serialize_named_tensors([(NORM, torch.full_like(norm, 3.0).share_memory_())])
    later = [
        ("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "shm_names": shm}),
        ("/update_weights_from_disk", {"model_path": model}),
        ("/init_weights_update_group", None),  # the second group's, filled in below
        ("/unload_lora_adapter", {"lora_name": "none-loaded"}),
    ]

    async def go() -> list[str]:
        (server,) = servers(engines[:1])
        async with served(server) as (url,):
            first, second = free_port(), free_port()
            trainer = join_as_trainer(first, 2, "first")
            got = await init_group([url], first, "first")
            assert [s for s, _ in got] == [200], got
            group = trainer.result(WAIT_S)
            assert (await call(url, "/begin_weight_update", {}))[0] == 200
            answered: list[str] = []

            async def post(path: str, body: dict) -> None:
                status, reply = await call(url, path, body)
                answered.append(path)
                if path != "/unload_lora_adapter":  # no such adapter: refused, after its turn
                    assert status == 200, (path, reply)

            queue = server.updates.queue

            async def queued(waiting: int) -> None:
                """Until the queue is held and `waiting` requests wait for it (each arrives after the one before)."""
                async with asyncio.timeout(WAIT_S):
                    while not (queue.locked() and len(queue._waiters or ()) == waiting):
                        await asyncio.sleep(0.01)

            tasks = [asyncio.create_task(post("/update_weights_from_distributed", update_body("first", sent)))]
            await queued(0)
            joining = join_as_trainer(second, 2, "second")
            for waiting, (path, body) in enumerate(later, start=1):
                if body is None:
                    body = {"master_address": "127.0.0.1", "master_port": second, "rank_offset": 1, "world_size": 2}
                    body |= {"group_name": "second", "backend": "gloo"}
                tasks.append(asyncio.create_task(post(path, body)))
                await queued(waiting)
            await asyncio.sleep(1.0)
            assert answered == [], f"answered while an update waits in its receive: {answered}"
            await asyncio.to_thread(torch.distributed.broadcast, sent.clone(), 0, group)
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            assert (await call(url, "/end_weight_update", {}))[0] == 200
            for trainer_group in (group, joining.result(WAIT_S)):
                wire.destroy_weights_update_group(trainer_group)
            return answered

    assert asyncio.run(go()) == ["/update_weights_from_distributed"] + [path for path, _ in later]


def test_a_groups_first_broadcast_waits_for_every_engine_rank(engines: list[EngineThread]) -> None:
    """Two engines in one group: the first broadcast, posted to one of them, is not received until the
    other one has it too; once both have, both take it. A group whose first broadcast reaches one engine
    only fails there after the group-init timeout, naming the group and the engine ranks that arrived."""
    norm = engines[0].layout.targets[NORM]

    async def go() -> None:
        pair = servers(engines)
        for server in pair:
            server.updates.group_init_timeout_s = 3.0
        trainer_groups = []
        async with served(*pair) as urls:
            for url in urls:
                assert (await call(url, "/begin_weight_update", {}))[0] == 200
            for name, value in (("both", 5.0), ("one", 7.0)):
                port = free_port()
                trainer = join_as_trainer(port, 3, name)
                assert [s for s, _ in await init_group(urls, port, name)] == [200, 200]
                group = trainer.result(WAIT_S)
                trainer_groups.append(group)
                sent = torch.full_like(norm, value)
                first = asyncio.create_task(call(urls[0], "/update_weights_from_distributed", update_body(name, sent)))
                if name == "one":  # the other engine never gets the request
                    status, reply = await first
                    assert status == 400, reply
                    message = reply["message"]
                    assert f"first broadcast of group '{name}' waits for every engine rank, and 1 of 2" in message
                    continue
                broadcast = asyncio.create_task(asyncio.to_thread(torch.distributed.broadcast, sent.clone(), 0, group))
                await asyncio.sleep(1.0)
                assert not first.done(), "the first engine received before the other engine joined the broadcast"
                second = await call(urls[1], "/update_weights_from_distributed", update_body(name, sent))
                assert second[0] == 200 and (await first)[0] == 200, (second, first.result())
                await asyncio.wait_for(broadcast, WAIT_S)
                assert all(torch.equal(e.layout.targets[NORM], sent) for e in engines)
            for url in urls:
                assert (await call(url, "/end_weight_update", {}))[0] == 200
        for group in trainer_groups:
            wire.destroy_weights_update_group(group)

    asyncio.run(go())

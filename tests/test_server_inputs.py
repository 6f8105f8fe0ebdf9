"""Both HTTP servers (the local engine `megatron-rl serve` and `megatron-rl reward-server`) against
hostile or broken input, served in this process through their own `_serve`: strict JSON (integers
over 4300 digits, lone surrogates, deep nesting), empty prompts and oversized batches on /generate,
half-sent requests (read timeouts), non-UTF-8 keys, and the refusal to start without a key."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from megatron_rl.http.body import MAX_DEPTH, BodyError, parse_json
from megatron_rl.rewards import server as reward_server
from megatron_rl.rollout.local import serve as engine_serve
from megatron_rl.rollout.local import server as engine_server
from megatron_rl.rollout.local.engine_thread import EngineThread
from megatron_rl.rollout.local.generator import Generator
from megatron_rl.rollout.local.launcher import API_KEY_ENV
from megatron_rl.rollout.local.model import load_model

import tiny_model

KEY = "inputs-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_RUNNING = 4
READ_TIMEOUT_S = 1.0
WAIT_S = 60.0  # the most any wait below takes before the test fails


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("inputs") / "model"
    tiny_model.build_model(folder)  # with tiny_math's tokenizer: /generate takes text
    return folder


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[engine_server.LocalServer]:
    model, info = load_model(str(model_dir), "cpu", "auto")
    thread = EngineThread(model, info, Generator(model, info, MAX_RUNNING, 1024, seed=0))
    thread.start()
    server = engine_server.LocalServer(thread, info, KEY, engine_serve._tokenizer(str(model_dir)))
    server.read_timeout_s = READ_TIMEOUT_S
    try:
        yield server
    finally:
        thread.stop()


@pytest.fixture
def rewards() -> Iterator[reward_server.RewardServer]:
    server = reward_server.RewardServer("dapo", 1, KEY, 1.0, read_timeout_s=READ_TIMEOUT_S)
    try:
        yield server
    finally:
        server.pool.close()


@contextlib.asynccontextmanager
async def serving(serve: Callable[..., Awaitable[None]], server: Any, tmp_path: Path) -> AsyncIterator[int]:
    """`serve(server, ...)` (a module's `_serve`) on a free port of 127.0.0.1; yields the port."""
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    task = asyncio.create_task(serve(server, "127.0.0.1", 0, str(port_file)))
    async with asyncio.timeout(WAIT_S):
        while not (port_file.exists() and port_file.read_text().strip()):
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
    try:
        yield int(port_file.read_text())
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _message(text: str) -> str:
    """The error message of an answer (the engine's {"error": {"message"}}, the reward server's
    {"error": "..."}), or its text."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text
    return error.get("message", "") if isinstance(error, dict) else str(error)


async def post(port: int, path: str, body: bytes | dict) -> tuple[int, str]:
    """The status and the text of the answer (its error message for an error)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(f"http://127.0.0.1:{port}{path}", data=data) as reply:
            text = await reply.text()
            return reply.status, text if reply.status == 200 else _message(text)


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send `data` and never more; what the server answers until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            return await reader.read()
    finally:
        writer.close()


def test_strict_json_names_the_field_of_huge_integers_lone_surrogates_and_deep_nesting() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # json's own parser raises RecursionError on it
    just_too_deep = b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    cases = [
        (b'{"sampling_params": {"max_new_tokens": 1' + b"0" * 4300 + b"}}", "sampling_params.max_new_tokens: an "),
        (b'{"a": [1, -' + b"9" * 5000 + b"]}", "a[1]: an integer of 5000 digits is over the limit of 4300 digits"),
        (deep, f"body: nested deeper than {MAX_DEPTH} levels"),
        (just_too_deep, f"{'[0]' * (MAX_DEPTH - 1)}: nested deeper than {MAX_DEPTH} levels"),
        (b'{"text": ["ok", "1+\\ud800"]}', r"text[1]: a lone surrogate '\ud800' at character 2"),
        (b'{"text": "\xed\xa0\x80"}', r"text: a lone surrogate '\ud800'"),  # the surrogate as UTF-8 bytes
        (b'{"row": {"\\udfff": 1}}', r"row: the key '\udfff' holds a lone surrogate"),
    ]
    for raw, message in cases:
        with pytest.raises(BodyError) as caught:
            parse_json(raw)
        assert caught.value.status == 400 and message in str(caught.value), (raw[:60], str(caught.value))
    fine = (
        b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b', "b": "\\ud83d\\ude00", "c": 1' + b"0" * 4299
    )
    assert parse_json(fine + b"}")["b"] == "\U0001f600"  # a surrogate pair is one character, not a lone one


def test_generate_answers_400_naming_the_field_where_it_answered_500(engine, tmp_path: Path) -> None:
    cases = [
        ({"text": ""}, "text: an empty prompt"),
        ({"text": ["", "1+1="]}, "text[0]: an empty prompt"),
        ({"input_ids": [[1, 2], []]}, "input_ids[1]: expected a non-empty list of token ids"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": 10**400}}, "sampling_params.temperature: an "),
        ({"input_ids": [1], "sampling_params": {"top_p": -(10**400)}}, "top_p: an integer of 401 digits is out of"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b"}}", "5001 digits"),
        (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than"),
        (b'{"text": "1+1=\\udc80"}', r"text: a lone surrogate '\udc80' at character 4"),
        ({"input_ids": [[1]] * (MAX_RUNNING + 1)}, f"a batch of {MAX_RUNNING + 1} prompts is over this engine's"),
        ({"text": ["1"] * (MAX_RUNNING + 1)}, f"text: a batch of {MAX_RUNNING + 1} prompts is over"),
    ]

    async def scenario() -> list[tuple[int, str]]:
        async with serving(engine_serve._serve, engine, tmp_path) as port:
            replies = [await post(port, "/generate", body) for body, _ in cases]
            url = f"http://127.0.0.1:{port}/get_weights_by_name?name=lm_head.weight&truncate_size=abc"
            async with aiohttp.ClientSession(headers=AUTH) as session, session.get(url) as reply:
                replies.append((reply.status, _message(await reply.text())))
            replies.append(await post(port, "/generate", {"input_ids": [[1]] * MAX_RUNNING}))
            return replies

    *refused, truncate, full_batch = asyncio.run(scenario())
    for (body, message), (status, text) in zip(cases, refused, strict=True):
        assert status == 400 and message in text, (str(body)[:80], status, text[:300])
    assert truncate[0] == 400 and "truncate_size: expected an integer, got 'abc'" in truncate[1], truncate
    assert full_batch[0] == 200 and len(json.loads(full_batch[1])) == MAX_RUNNING  # at the limit: served


def test_an_empty_prompt_never_reaches_the_requests_in_flight(engine, tmp_path: Path) -> None:
    """An empty prompt once made the prefill fail, which aborted every running request."""
    running = {"text": "1+1=", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}

    async def scenario() -> tuple[tuple[int, str], list[tuple[int, str]]]:
        async with serving(engine_serve._serve, engine, tmp_path) as port:
            long = asyncio.create_task(post(port, "/generate", running))
            async with asyncio.timeout(WAIT_S):
                while not await asyncio.wrap_future(engine.engine.call(lambda e: len(e.generator.running))):
                    await asyncio.sleep(0.01)
            refused = [await post(port, "/generate", body) for body in ({"text": ""}, {"text": ["", "1+1="]})]
            return await long, refused

    (status, text), refused = asyncio.run(scenario())
    assert [s for s, _ in refused] == [400, 400], refused
    assert status == 200, text
    reply = json.loads(text)
    assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == 200


def _half_sent(path: str) -> tuple[bytes, bytes]:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
    return head.encode(), (head + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode() + b'{"a"'


@pytest.mark.parametrize("which", ["engine", "reward_server"])
def test_half_sent_requests_are_closed_after_the_read_timeout(which: str, request, tmp_path: Path) -> None:
    """A head that never completes is dropped; a body that never completes answers 408 naming the
    timeout. Neither holds the connection open (before: an hour, the aiohttp default, or forever)."""
    if which == "engine":
        serve, server, path = engine_serve._serve, request.getfixturevalue("engine"), "/generate"
    else:
        serve, server, path = reward_server._serve, request.getfixturevalue("rewards"), "/score"
    head_only, body_cut = _half_sent(path)

    async def scenario() -> tuple[bytes, bytes, tuple[int, str]]:
        async with serving(serve, server, tmp_path) as port:
            dropped, timed_out = await asyncio.gather(raw_exchange(port, head_only), raw_exchange(port, body_cut))
            return dropped, timed_out, await post(port, path, {})  # the server goes on serving

    dropped, timed_out, after = asyncio.run(scenario())
    assert dropped == b""
    assert timed_out.startswith(b"HTTP/1.1 408"), timed_out[:200]
    assert f"the body did not arrive within the read timeout of {READ_TIMEOUT_S:g} s".encode() in timed_out
    assert after[0] == 400  # an empty body: refused as such, not a timeout


@pytest.mark.parametrize("which", ["engine", "reward_server"])
def test_a_key_that_is_not_utf8_is_401_and_deep_rows_are_400(which: str, request, tmp_path: Path) -> None:
    if which == "engine":  # its /health is open, as SGLang's
        serve, server, path, keyed = engine_serve._serve, request.getfixturevalue("engine"), "/generate", "/model_info"
    else:
        serve, server, path, keyed = reward_server._serve, request.getfixturevalue("rewards"), "/score", "/health"
    wrong = f"GET {keyed} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {KEY}".encode()
    row = b'{"a": ' * 100 + b"1" + b"}" * 100
    items = b'{"items": [{"response": "Answer: 1", "answer": "1", "row": ' + row + b"}]}"
    deeper = b'{"items": [{"response": "x", "answer": "1", "row": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"

    async def scenario() -> tuple[bytes, tuple[int, str], tuple[int, str]]:
        async with serving(serve, server, tmp_path) as port:
            reply = await raw_exchange(port, wrong + b"\xff\xfe\r\n\r\n")
            return reply, await post(port, path, items), await post(port, path, deeper)

    unauthorized, nested, very_deep = asyncio.run(scenario())
    assert unauthorized.startswith(b"HTTP/1.1 401"), unauthorized[:200]
    assert nested[0] == 400 and "items[0].row" + ".a" * (MAX_DEPTH - 3) + ": nested deeper than" in nested[1]
    assert very_deep[0] == 400 and "nested deeper than" in very_deep[1], very_deep


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_refuses_to_start_without_a_key_or_with_unusable_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked before the model is loaded (the folder here does not exist); before, the engine served
    every endpoint, weight updates included, to anyone, and answered 413 to everything with
    --max-running-requests 0."""
    missing = str(tmp_path / "no_model")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    refusals = [
        ([], f"no API key: pass --api-key KEY, set ${API_KEY_ENV}, or serve without one with --no-auth"),
        (["--no-auth", "--api-key", "k"], "--no-auth and an API key"),
        (["--no-auth", "--max-running-requests", "0"], "--max-running-requests 0: must be >= 1"),
        (["--no-auth", "--max-prefill-tokens", "-1"], "--max-prefill-tokens -1: must be >= 1"),
        (["--no-auth", "--read-timeout-s", "0"], "--read-timeout-s 0.0: must be > 0"),
    ]
    for argv, message in refusals:
        assert engine_serve.run(_serve_args("--model", missing, *argv)) == 2, argv
        assert f"megatron-rl serve: {message}" in capsys.readouterr().err, argv
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the key from the environment, off the command line
    assert engine_serve.run(_serve_args("--model", missing, "--no-auth")) == 2
    assert "contradict" in capsys.readouterr().err

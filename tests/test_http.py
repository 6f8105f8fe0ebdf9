"""megatron_rl/http/: the clients' retry policy (failover, backoff, what ends a call at once, the last
failure kept) and session, and the servers' one start-up (127.0.0.1 and a free port, the key checked
before any handler, the port as ready signal, a close bounded even when a cleanup hangs, the
command-line start's one line)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest
from aiohttp import web

from megatron_rl.http.client import (
    RetriesExhausted,
    RetryableFailure,
    RetryPolicy,
    client_session,
    retrying,
)
from megatron_rl.http.server import application, authorized, command_start, key_check, start

KEY = "http-key"
WAIT_S = 30.0  # the most any wait below takes before the test fails
log = logging.getLogger("test_http")


def test_the_policy_doubles_its_waits() -> None:
    policy = RetryPolicy(max_retries=3, backoff_s=0.5)
    assert policy.tries == 4
    assert [policy.wait_s(k) for k in range(3)] == [0.5, 1.0, 2.0]
    assert policy.total_wait_s() == 3.5


def test_retrying_fails_over_and_keeps_the_last_failure(caplog: pytest.LogCaptureFixture) -> None:
    servers = ["http://a", "http://b", "http://c"]
    seen: list[set[str]] = []

    async def attempt(failed: set[str]) -> str:
        seen.append(set(failed))
        target = next(s for s in servers if s not in failed)
        raise RetryableFailure(f"POST /x to {target}", f"HTTP 503 from {target}", target)

    with caplog.at_level(logging.WARNING, logger="test_http"):
        with pytest.raises(RetriesExhausted) as out:
            asyncio.run(retrying(attempt, RetryPolicy(max_retries=2, backoff_s=0.001), log))
    assert seen == [set(), {"http://a"}, {"http://a", "http://b"}]
    assert out.value.tries == 3
    assert out.value.last.reason == "HTTP 503 from http://c" and out.value.last.target == "http://c"
    assert out.value.failed == set(servers)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "POST /x to http://a failed (HTTP 503 from http://a); try 2 of 3 in 0.0 s",
        "POST /x to http://b failed (HTTP 503 from http://b); try 3 of 3 in 0.0 s",
    ]


def test_retrying_returns_the_first_success_and_lets_other_errors_through() -> None:
    calls = []

    async def flaky(failed: set[str]) -> str:
        calls.append("flaky")
        if len(calls) == 1:
            raise RetryableFailure("GET /y", "connection refused", replied=False)
        return "ok"

    assert asyncio.run(retrying(flaky, RetryPolicy(max_retries=3, backoff_s=0.001), log)) == "ok"
    assert len(calls) == 2

    async def refused(failed: set[str]) -> str:
        calls.append("refused")
        raise PermissionError("HTTP 401")

    with pytest.raises(PermissionError, match="HTTP 401"):
        asyncio.run(retrying(refused, RetryPolicy(max_retries=3, backoff_s=0.001), log))
    assert calls.count("refused") == 1  # not retried


def _app(handled: list[str]) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        handled.append(request.headers.get("X-Extra", ""))
        return web.json_response({"authorization": request.headers.get("Authorization")})

    refusal = lambda: web.json_response({"error": "no key"}, status=401)  # noqa: E731
    app = application(1024, [key_check(lambda r: authorized(r, KEY), refusal)])
    app.router.add_post("/echo", echo)
    return app


def test_a_server_starts_on_a_free_loopback_port_and_checks_the_key_before_any_handler(tmp_path) -> None:
    handled: list[str] = []

    async def go() -> None:
        serving = await start(_app(handled), shutdown_timeout_s=1.0)
        try:
            assert serving.host == "127.0.0.1" and serving.port > 0
            serving.write_port(str(tmp_path / "port"))
            assert int((tmp_path / "port").read_text()) == serving.port
            async with asyncio.timeout(WAIT_S):
                async with client_session(None, 4) as anonymous:
                    async with anonymous.post(serving.url + "/echo", json={}) as reply:
                        assert reply.status == 401
                assert handled == []  # refused before the handler
                async with client_session(KEY, 4, headers={"X-Extra": "sent"}) as keyed:
                    async with keyed.post(serving.url + "/echo", json={}) as reply:
                        assert reply.status == 200
                        assert (await reply.json())["authorization"] == f"Bearer {KEY}"
                assert handled == ["sent"]
        finally:
            await serving.close()

    asyncio.run(go())


def test_a_close_is_bounded_even_when_a_cleanup_hangs(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        app = _app([])
        never = asyncio.Event()

        async def hang(_: web.Application) -> None:
            await never.wait()

        app.on_cleanup.append(hang)
        serving = await start(app, shutdown_timeout_s=0.1)
        async with asyncio.timeout(WAIT_S):
            await serving.close(timeout_s=0.2)

    with caplog.at_level(logging.WARNING, logger="megatron_rl.http.server"):
        asyncio.run(go())
    assert any("did not close within" in r.getMessage() for r in caplog.records)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--no-auth", action="store_true")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def test_a_command_line_server_without_a_key_or_with_a_bad_argument_is_one_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HTTP_TEST_KEY", raising=False)
    fine = lambda args: None  # noqa: E731
    assert command_start("serve", _args(), "HTTP_TEST_KEY", fine, "use it") == (None, 2)
    assert capsys.readouterr().err == (
        "megatron-rl serve: no API key: pass --api-key KEY, set $HTTP_TEST_KEY, or serve without one with --no-auth\n"
    )
    bad = lambda args: "--workers 0: must be >= 1"  # noqa: E731
    assert command_start("reward-server", _args("--api-key", "k"), "HTTP_TEST_KEY", bad, "use it") == (None, 2)
    assert capsys.readouterr().err == "megatron-rl reward-server: --workers 0: must be >= 1\n"
    monkeypatch.setenv("HTTP_TEST_KEY", "from-env")
    assert command_start("serve", _args(), "HTTP_TEST_KEY", fine, "use it") == ("from-env", 0)

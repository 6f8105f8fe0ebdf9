"""reward.type=remote against real `megatron-rl reward-server` processes, and against a scripted server
that breaks the protocol, hangs or is gone."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from mrl_engine import FakeEngine, on_loop, rollout_loop

from megatron_rl.config import ConfigError, RewardConfig, load_config
from megatron_rl.data import Prompt, PromptSampler, RowLocation
from megatron_rl.loop.collect import RolloutCollector
from megatron_rl.rewards import RewardFailureError, RewardScorer
from megatron_rl.rewards import server as reward_server
from megatron_rl.rewards.protocol import API_KEY_ENV
from megatron_rl.rewards.remote import RemoteRewardError
from megatron_rl.rollout.types import Sample

from mrl_runs import wait_until

KEY = "test-key-123"

FUNCTIONS = """
import math
import os
import time

def reward(response, answer, prompt, row):
    if response == "boom":
        raise RuntimeError("verifier crashed")
    if response == "nan":
        return math.nan
    if response == "hang":
        time.sleep(3600)
    if response == "exact":
        return response == answer
    return len(prompt) + row["weight"] + (0.5 if answer in response else 0.0)

def gated(response, answer):
    # returns once the test creates `release` in the server's working directory
    deadline = time.monotonic() + 60
    while not os.path.exists("release"):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never released the gate")
        time.sleep(0.01)
    return 1.0
"""


class ServerProcess:
    """A `megatron-rl reward-server` child process serving on a free port."""

    def __init__(self, tmp: Path, function: str, *args: str, api_key: str | None = KEY) -> None:
        port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log = tmp / f"server-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "megatron_rl.cli", "reward-server", "--function", function, "--port", "0"]
        cmd += ["--port-file", str(port_file), *args] + (["--api-key", api_key] if api_key else [])
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        self.api_key = api_key
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.process.poll() is None, f"reward-server exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"reward-server did not start: {self.log.read_text()}"
            time.sleep(0.1)
        self.base = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.url = self.base + "/score"

    def health(self) -> dict[str, Any]:
        request = urllib.request.Request(self.base + "/health", headers={"Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reward_server")
    (path / "my_verifiers.py").write_text(FUNCTIONS, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dapo_server(workdir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(workdir, "dapo")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def custom_server(workdir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        workdir, "my_verifiers:reward", "--workers", "2", "--max-request-mb", "0.01", "--item-timeout-s", "1"
    )
    yield server
    server.stop()


def remote(url: str, **kwargs: Any) -> RewardConfig:
    return RewardConfig(type="remote", url=url, **{"api_key": KEY, "retry_backoff_s": 0.05, **kwargs})


RESPONSES = ["Answer: 22", "Answer: 21", "no answer", "Answer: 0.5", "Answer: \\boxed{7}", "answer: -3", "Answer:"]
ANSWERS = ["22", "22", "22", "1/2", "7", "-3", "5"]


def test_remote_scores_equal_the_local_rule(dapo_server: ServerProcess) -> None:
    rewards = dict(correct_reward=2.0, incorrect_reward=-0.5)
    local = RewardScorer(RewardConfig(type="dapo", **rewards)).score(RESPONSES, ANSWERS)
    # 7 responses in batches of 3 (3 requests, 2 at a time): the order survives the batching
    got = RewardScorer(
        remote(dapo_server.url, batch_size=3, max_concurrency=2, **rewards), run=rollout_loop().run
    ).score(RESPONSES, ANSWERS)
    assert got == local
    assert got.rewards == [2.0, -0.5, -0.5, 2.0, 2.0, 2.0, -0.5] and got.stats.no_answer == 1
    assert got.extracted[4] == "\\boxed{7}"


def test_remote_math_verify_equals_the_local_rule(workdir: Path) -> None:
    pytest.importorskip("math_verify")
    responses = ["so \\boxed{\\frac{\\sqrt{2}}{2}}", "Answer: 22", "\\boxed{3}", "nothing here"]
    answers = ["\\frac{1}{\\sqrt{2}}", "22", "4", "4"]
    server = ServerProcess(workdir, "math_verify")
    try:
        got = RewardScorer(remote(server.url), run=rollout_loop().run).score(responses, answers)
    finally:
        server.stop()
    assert got == RewardScorer(RewardConfig(type="math_verify")).score(responses, answers)
    assert got.correct == [True, True, False, False] and got.stats.no_answer == 1


def test_remote_custom_function_gets_prompt_and_row(custom_server: ServerProcess, workdir: Path) -> None:
    responses = ["x 22", "x", "boom", "nan", "exact"]
    answers = ["22", "22", "1", "1", "exact"]
    prompts = ["What is 4*5+2?", "ab", "c", "d", "e"]
    rows = [{"weight": 3}, {"weight": -1}, {"weight": 0}, {"weight": 0}, {"weight": 0}]
    cfg = dict(correct_reward=10.0, failure_reward=-7.0)
    local_cfg = RewardConfig(type="custom", custom_function=str(workdir / "my_verifiers.py") + ":reward", **cfg)
    local = RewardScorer(local_cfg).score(responses, answers, prompts, rows)
    got = RewardScorer(remote(custom_server.url, batch_size=2, **cfg), run=rollout_loop().run).score(
        responses, answers, prompts, rows
    )
    # len(prompt) + weight (+ 0.5 when the answer is in the response); a raise or a NaN: the failure reward
    assert got.rewards == local.rewards == [14 + 3 + 0.5, 2 - 1, -7.0, -7.0, 10.0]
    assert got.correct == local.correct and got.failed == local.failed == [False, False, True, True, False]
    assert got.stats.failed == 2 and got.stats.reward_sum == local.stats.reward_sum
    assert "the server's reward function failed: RuntimeError: verifier crashed" in got.stats.errors[0]
    assert "returned nan" in got.stats.errors[1]


class CodePointTokenizer:
    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(map(chr, row)) for row in ids]


def test_the_loop_sends_each_responses_prompt_text_and_row(custom_server: ServerProcess) -> None:
    cfg = load_config(
        overrides=["reward.type=remote", f"reward.url={custom_server.url}", f"reward.api_key={KEY}"]
        + ["rollout.n_samples_per_prompt=2", "reward.batch_size=3"]
    )
    prompts = [
        Prompt(i, (1, 2), text, "7", {"weight": weight, "id": i}, RowLocation("t.jsonl", "line", i + 1))
        for i, (text, weight) in enumerate([("What is 3+4?", 1), ("Seven?", 10)])
    ]
    grouped = [
        [Sample([1, 2], [ord(c) for c in text], [0.0] * len(text), "stop") for text in pair]
        for pair in (("7", "x"), ("no", "77"))
    ]
    collector = RolloutCollector(
        cfg, None, CodePointTokenizer(), RewardScorer(cfg.reward, run=rollout_loop().run), PromptSampler(prompts)
    )
    groups, stats = collector.score(prompts, grouped)
    # len(prompt text) + row weight (+ 0.5 when the answer "7" is in the response), computed on the server
    assert [g.scores for g in groups] == [[12 + 1 + 0.5, 12 + 1], [6 + 10, 6 + 10 + 0.5]]
    assert stats.count == 4 and stats.failed == 0


def test_a_hanging_call_fails_its_item_and_the_worker_goes_on(custom_server: ServerProcess) -> None:
    scorer = RewardScorer(remote(custom_server.url, batch_size=4), run=rollout_loop().run)
    for _ in range(2):  # the second request finds the workers free again
        result = scorer.score(["hang", "x 1", "hang", "y"], ["1"] * 4, ["pp"] * 4, [{"weight": 1}] * 4)
        assert result.failed == [True, False, True, False] and result.rewards == [-1.0, 3.5, -1.0, 3.0]
        assert "TimeoutError: the reward function ran longer than --item-timeout-s = 1 s" in result.stats.errors[0]


def test_requests_over_the_size_limit_name_the_batch_size(custom_server: ServerProcess) -> None:
    scorer = RewardScorer(remote(custom_server.url), run=rollout_loop().run)
    with pytest.raises(RemoteRewardError, match=r"HTTP 413.*lower reward.batch_size"):
        scorer.score(["x" * 20_000], ["1"], ["p"], [{"weight": 0}])


def test_the_key_is_required(dapo_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for key in (None, "wrong-key"):
        with pytest.raises(RemoteRewardError, match=r"HTTP 401 .*set reward.api_key"):
            RewardScorer(remote(dapo_server.url, api_key=key), run=rollout_loop().run)
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the key from the environment, out of config.yaml
    assert RewardScorer(remote(dapo_server.url, api_key=None), run=rollout_loop().run).score(
        ["Answer: 1"], ["1"]
    ).correct == [True]
    with pytest.raises(RemoteRewardError, match=r"HTTP 404.*the server's /score endpoint"):
        RewardScorer(remote(dapo_server.base + "/nope"), run=rollout_loop().run)


def test_concurrency_is_bounded(workdir: Path) -> None:
    server = ServerProcess(workdir, "my_verifiers:gated")
    try:
        scorer = RewardScorer(remote(server.url, batch_size=2, max_concurrency=3), run=rollout_loop().run)
        with ThreadPoolExecutor(1) as pool:
            scoring = pool.submit(scorer.score, [str(i) for i in range(24)], ["1"] * 24)
            # the gate holds every request: the scorer's three reach the server together
            wait_until(lambda: server.health()["in_flight"] == 3, 60, "3 requests in flight at the reward server")
            (workdir / "release").touch()
            result = scoring.result(timeout=120)
        assert result.rewards == [1.0] * 24 and result.stats.failed == 0
        health = server.health()
    finally:
        server.stop()
    # 12 requests of 2 items (+ the scorer's empty check), never more than 3 at once
    assert (health["requests"], health["items"], health["max_in_flight"]) == (13, 24, 3)


def test_a_server_gone_mid_run_gives_counted_failures(workdir: Path) -> None:
    server = ServerProcess(workdir, "dapo")
    scorer = RewardScorer(remote(server.url, max_retries=1, failure_reward=-4.0), run=rollout_loop().run)
    server.stop()
    result = scorer.score(["Answer: 1", "Answer: 2"], ["1", "2"])
    assert result.rewards == [-4.0, -4.0] and result.failed == [True, True] and result.stats.failed == 2
    assert "failed after 2 tries: connection refused" in result.stats.errors[0]
    # a server that is not there at start-up fails the run at once, naming reward.url
    with pytest.raises(RemoteRewardError, match=r"reward.url = 'http://127.0.0.1:\d+/score' cannot be used"):
        RewardScorer(remote(server.url, max_retries=0), run=rollout_loop().run)


class ScriptedServer:
    """An in-process /score server that answers empty batches correctly and other batches by `mode`."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.started = self.finished = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=1)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/score", self.score)
        return app

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/score"

    async def score(self, request: web.Request) -> web.Response:
        items = (await request.json())["items"]
        results: list[Any] = [{"score": 1.0} for _ in items]
        if self.mode == "no_key":  # every request, the start-up check's empty one included
            return web.json_response({"error": "bad key"}, status=401)
        if not items:
            return web.json_response({"results": []})
        self.started += 1
        if self.mode == "slow":
            await asyncio.sleep(60)
        elif self.mode == "missing":
            results[1] = {"correct": True}
        elif self.mode == "length":
            results.pop()
        elif self.mode == "nan":
            results[2] = {"score": float("nan")}
        elif self.mode == "not_a_list":
            return web.json_response({"scores": [1.0] * len(items)})
        elif self.mode == "busy":
            return web.json_response({"error": "overloaded"}, status=503)
        elif self.mode == "html":
            return web.Response(text="<html><body>\n  Bad gateway\n</body></html>", content_type="text/html")
        elif self.mode == "unauthorized":
            return web.json_response({"error": "bad key"}, status=401)
        self.finished += 1
        return web.Response(text=json.dumps({"results": results}), content_type="application/json")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def test_a_reward_server_unusable_at_start_up_is_one_config_error_line(scripted: ScriptedServer) -> None:
    """A reward server that is not there, or refuses the key, at start-up (`RewardScorer` on rank 0, before the
    model starts) raised a RuntimeError the stage printed as a traceback; now a ConfigError: one line naming
    reward.url and what happened."""
    from megatron_rl.parallel.launch import free_port

    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(ConfigError) as gone:
        RewardScorer(remote(url, max_retries=0), run=rollout_loop().run)
    scripted.mode = "no_key"
    with pytest.raises(ConfigError) as refused:
        RewardScorer(remote(scripted.url), run=rollout_loop().run)
    assert str(gone.value) == (
        f"reward.url = {url!r} cannot be used: reward server {url}, an empty batch: failed after 1 tries: connection "
        "refused (is `megatron-rl reward-server` running there?)"
    )
    assert str(refused.value).startswith(f"reward server {scripted.url}, an empty batch: HTTP 401 (the API key is")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("mode", "failed", "message"),
    [
        ("missing", [False, True, False], "result 1 has no 'score' (keys: ['correct'])"),
        ("nan", [False, False, True], "result 2: 'score' is nan, not a finite number"),
        ("length", [True, True, True], "the reply holds 2 results for 3 items"),
        ("not_a_list", [True, True, True], 'the reply is not {"results": [...]}'),
    ],
)
def test_malformed_replies_are_named_and_counted(
    scripted: ScriptedServer, mode: str, failed: list[bool], message: str
) -> None:
    scorer = RewardScorer(remote(scripted.url, failure_reward=-9.0), run=rollout_loop().run)
    scripted.mode = mode
    result = scorer.score(["a", "b", "c"], ["1", "1", "1"])
    assert result.failed == failed and result.stats.failed == sum(failed)
    assert result.rewards == [-9.0 if f else 1.0 for f in failed]
    assert f"reward server {scripted.url}, responses 0-2: malformed reply: {message}" in result.stats.errors[0]
    assert scripted.started == 1  # a malformed reply is not retried


@pytest.mark.parametrize("mode", ["slow", "busy"])
def test_a_slow_or_busy_server_gives_counted_failures_after_the_retries(scripted: ScriptedServer, mode: str) -> None:
    scorer = RewardScorer(remote(scripted.url, timeout_s=0.5, max_retries=2), run=rollout_loop().run)
    scripted.mode = mode
    result = scorer.score(["a", "b"], ["1", "1"])
    assert result.rewards == [-1.0, -1.0] and result.stats.failed == 2
    last = "no reply within reward.timeout_s = 0.5 s" if mode == "slow" else "HTTP 503"
    assert f"failed after 3 tries: {last}" in result.stats.errors[0]
    # three tries reached the server and none got results (a hanging one was abandoned before it answered)
    assert scripted.started == 3 and scripted.finished == 0


def serve(argv: list[str]) -> int:
    """`megatron-rl reward-server ARGV` in this process (the CLI's console set-up left out)."""
    parser = argparse.ArgumentParser()
    reward_server.add_arguments(parser)
    return reward_server.run(parser.parse_args(argv))


def test_the_server_refuses_to_start_without_a_key_or_with_a_bad_function(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert serve(["--function", "dapo"]) == 2
    assert "no API key: pass --api-key KEY, set $MEGATRON_RL_REWARD_API_KEY, or" in capsys.readouterr().err
    assert serve(["--function", "no_such_module_xyz:f", "--no-auth"]) == 2
    assert "--function 'no_such_module_xyz:f': cannot import module" in capsys.readouterr().err
    assert serve(["--function", "dapo", "--no-auth", "--api-key", "k"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_config_needs_an_http_url_for_remote() -> None:
    with pytest.raises(ConfigError, match=r"reward.type = 'remote' needs reward.url"):
        load_config(overrides=["reward.type=remote"])
    with pytest.raises(ConfigError, match=r"reward.url = 'host:8000/score' must start with http://"):
        load_config(overrides=["reward.type=remote", "reward.url=host:8000/score"])
    assert load_config(overrides=["reward.type=remote", "reward.url=http://h:1/score"]).reward.batch_size == 64


def test_non_finite_json_and_oversized_bodies_are_refused(custom_server: ServerProcess) -> None:
    """NaN and 1e999 (Python's json reads both) answer 400 naming the field, not a score; a body over
    --max-request-mb (0.01 MiB) answers 413 naming the limit in bytes."""

    def post(body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(
            custom_server.url, data=body, headers={"Authorization": f"Bearer {KEY}"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def body(*weights: str) -> bytes:
        items = [f'{{"response": "x", "answer": "1", "prompt": "p", "row": {{"weight": {w}}}}}' for w in weights]
        return ('{"items": [' + ", ".join(items) + "]}").encode()

    assert post(body("2"))[0] == 200
    for value in ("NaN", "-Infinity", "1e999"):
        status, text = post(body("1", value))
        assert status == 400 and f"items[1].row.weight: {value} is not a finite number" in text, text
    limit = int(0.01 * (1 << 20))
    status, text = post(b" " * (limit + 1))
    assert (
        status == 413
        and f"--max-request-mb: a body of {limit + 1} bytes is over this endpoint's limit of {limit} bytes" in text
    )


class OneLetterEngine(FakeEngine):
    """Answers every request with the one token "a" (a finished response)."""

    def answer(self, ids, params, routed):
        return Sample(list(ids), [ord("a")], [0.0], "stop")


def remote_collector(url: str, *overrides: str) -> RolloutCollector:
    cfg = load_config(
        overrides=["reward.type=remote", f"reward.url={url}", f"reward.api_key={KEY}", "reward.retry_backoff_s=0.05"]
        + ["rollout.n_samples_per_prompt=2", "train.prompts_per_step=2", *overrides]
    )
    prompts = [Prompt(i, (1, 2), "q", "1", {}, RowLocation("t.jsonl", "line", i + 1)) for i in range(2)]
    return RolloutCollector(
        cfg,
        OneLetterEngine(),
        CodePointTokenizer(),
        RewardScorer(cfg.reward, run=rollout_loop().run),
        PromptSampler(prompts),
    )


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("html", "malformed reply: the reply is not JSON: '<html><body>\\n Bad gateway"),
        ("busy", "failed after 2 tries: HTTP 503"),
        ("slow", "failed after 2 tries: no reply within reward.timeout_s = 0.3 s"),
        ("length", "the reply holds 3 results for 4 items"),
        ("nan", "result 2: 'score' is nan, not a finite number"),
    ],
)
def test_a_failing_server_mid_run_stops_the_step_naming_it(scripted: ScriptedServer, mode: str, reason: str) -> None:
    collector = remote_collector(scripted.url, "reward.max_retries=1", "reward.timeout_s=0.3")  # the check passed
    scripted.mode = mode
    with pytest.raises(RewardFailureError) as err:
        on_loop(collector.collect(step=2))
    message = str(err.value)
    failed = 1 if mode == "nan" else 4
    assert message.startswith(f"step 2: {failed} of 4 rewards failed") and "\n" not in message
    assert f"from the reward server at reward.url = {scripted.url}; first: response " in message
    assert reason in message


def test_one_nan_leaves_its_group_out_and_the_others_are_trained_on(scripted: ScriptedServer) -> None:
    collector = remote_collector(scripted.url, "reward.max_failure_frac=0.25")
    scripted.mode = "nan"  # response 2 (the first of prompt 1's group) gets a NaN score
    step_batch = on_loop(collector.collect(step=1))
    assert (step_batch.metrics["reward/failures"], step_batch.metrics["groups/reward_failed"]) == (1.0, 1.0)
    assert step_batch.batch is not None and len(step_batch.batch) == 2 and step_batch.rewards.tolist() == [1.0, 1.0]
    assert collector.sampler.position == 2  # prompt 1 was generated, scored and left out


def test_a_refused_key_mid_run_raises_without_an_unrelated_chained_error(scripted: ScriptedServer) -> None:
    scorer = RewardScorer(remote(scripted.url), run=rollout_loop().run)
    scripted.mode = "unauthorized"
    with pytest.raises(RemoteRewardError, match="HTTP 401") as err:
        scorer.score(["a"], ["1"])
    assert err.value.__context__ is None and err.value.__cause__ is None

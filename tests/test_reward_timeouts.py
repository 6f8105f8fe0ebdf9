"""Local reward rules run in worker processes (`megatron_rl/rewards/workers.py`), each response under
reward.item_timeout_s: a function that hangs, blocks SIGALRM, cancels its timer or kills its worker
fails its responses (counted in reward/timeouts when it ran too long) and the next batch is scored."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp import web
from mrl_engine import rollout_loop

from megatron_rl.config import ConfigError, RewardConfig, load_config
from megatron_rl.rewards import RewardScorer
from megatron_rl.rewards import server as reward_server
from megatron_rl.rewards.protocol import ItemError, RemoteItemError, decode_reply

from mrl_runs import wait_until

FUNCTIONS = """
import os
import signal
import threading
import time

def reward(response, answer):
    if response == "hang":
        time.sleep(3600)
    if response == "block":  # SIGALRM never reaches it: only the parent's watch ends this
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if response == "untimed":  # cancels the worker's timer, as math-verify's own timeouts do
        signal.setitimer(signal.ITIMER_REAL, 0)
        time.sleep(3600)
    if response == "die":
        os._exit(1)
    if response == "main":  # math-verify's timeouts need the main thread
        return threading.current_thread() is threading.main_thread()
    return response == answer
"""

TIMEOUT = "TimeoutError: the reward function ran longer than reward.item_timeout_s = 1 s"


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("reward_timeouts") / "slow_verifiers.py"
    path.write_text(FUNCTIONS, encoding="utf-8")
    return f"{path}:reward"


@pytest.fixture
def make_scorer(spec: str) -> Iterator[Any]:
    scorers: list[RewardScorer] = []

    def make(**kwargs: Any) -> RewardScorer:
        cfg = RewardConfig(type="custom", custom_function=spec, item_timeout_s=1.0, failure_reward=-5.0, **kwargs)
        scorers.append(RewardScorer(cfg, run=rollout_loop().run))
        return scorers[-1]

    yield make
    for scorer in scorers:
        scorer.close()


def test_a_function_that_never_returns_times_out_and_the_others_are_scored(make_scorer: Any) -> None:
    scorer = make_scorer()
    assert scorer.workers is not None and scorer.workers._pool is None  # nothing spawned before the first batch
    result = scorer.score(["1", "hang", "2", "1"], ["1", "1", "1", "2"])
    assert result.failed == [False, True, False, False] and result.rewards == [1.0, -5.0, -1.0, -1.0]
    assert result.correct == [True, False, False, False]
    stats = result.stats
    assert (stats.count, stats.failed, stats.timeouts, stats.correct) == (4, 1, 1, 1)
    assert stats.metrics()["reward/timeouts"] == 1.0 and stats.metrics()["reward/failures"] == 1.0
    assert stats.errors == [f"response 1: {TIMEOUT}"]
    assert scorer.workers.restarts == 0  # the worker went on with the next response
    assert stats.merge(stats).timeouts == 2


def test_scoring_on_a_background_thread_also_times_out(make_scorer: Any) -> None:
    """one_step_off scores on its collection thread: the rule still runs in a worker's main thread."""
    scorer = make_scorer()
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(scorer.score, ["hang", "main", "3"], ["1", "1", "3"]).result(timeout=120)
    assert result.failed == [True, False, False] and result.correct == [False, True, True]
    assert result.stats.timeouts == 1 and result.stats.errors == [f"response 0: {TIMEOUT}"]


def test_a_function_that_cancels_its_timer_gets_sigalrm_from_the_parent(make_scorer: Any) -> None:
    scorer = make_scorer()
    result = scorer.score(["untimed", "1"], ["1", "1"])
    assert result.failed == [True, False] and result.stats.timeouts == 1
    assert result.stats.errors == [f"response 0: {TIMEOUT}"]
    assert scorer.workers is not None and scorer.workers.restarts == 0


def test_a_worker_deaf_to_sigalrm_is_killed_and_the_next_batch_gets_new_workers(make_scorer: Any) -> None:
    scorer = make_scorer(workers=2)
    workers = scorer.workers
    assert workers is not None
    assert scorer.score(["1", "2"], ["1", "1"]).correct == [True, False]
    first = workers._pool
    assert first is not None
    processes = first.processes()
    assert len(processes) == 2
    result = scorer.score(["block", "1"], ["1", "1"])  # one response per worker
    assert result.failed == [True, False] and result.rewards == [-5.0, 1.0]
    assert (result.stats.failed, result.stats.timeouts) == (1, 1)
    assert "did not stop at SIGALRM (it blocks the signal, or a C call does not return)" in result.stats.errors[0]
    assert workers.restarts == 1
    # killed, not left running (the one deaf to SIGALRM sleeps for an hour)
    wait_until(lambda: all(p.exitcode is not None for p in processes), 60, "the killed reward workers to exit")
    result = scorer.score(["1", "2", "2"], ["1", "1", "2"])
    assert result.correct == [True, False, True] and result.stats.failed == 0
    assert workers._pool is not None and workers._pool is not first


def test_a_worker_that_dies_fails_its_responses_and_the_next_batch_is_scored(make_scorer: Any) -> None:
    scorer = make_scorer()
    result = scorer.score(["1", "die", "1"], ["1", "1", "1"])  # one worker: one chunk, lost with it
    assert result.failed == [True, True, True] and result.rewards == [-5.0] * 3
    assert (result.stats.failed, result.stats.timeouts) == (3, 0)
    assert result.stats.errors[0].startswith("response 0: a reward worker process died (BrokenProcessPool")
    assert scorer.workers is not None and scorer.workers.restarts == 1
    result = scorer.score(["1", "2"], ["1", "1"])
    assert result.correct == [True, False] and result.stats.failed == 0


def test_close_ends_the_workers_and_an_explicit_rule_runs_in_process(make_scorer: Any) -> None:
    scorer = make_scorer()
    assert scorer.score(["1"], ["1"]).correct == [True]
    assert scorer.workers is not None and scorer.workers._pool is not None
    processes = scorer.workers._pool.processes()
    scorer.close()
    scorer.close()  # idempotent
    assert processes
    wait_until(lambda: all(p.exitcode is not None for p in processes), 60, "the closed reward workers to exit")
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["1"], ["1"])
    seen: list[str] = []
    in_process = RewardScorer(RewardConfig(type="dapo"), rule=lambda r, a: seen.append(threading.current_thread().name))
    assert in_process.workers is None
    in_process.score(["x"], ["y"])
    assert seen == [threading.current_thread().name]
    in_process.close()


def test_the_config_bounds() -> None:
    cfg = load_config(overrides=[])
    assert (cfg.reward.workers, cfg.reward.item_timeout_s) == (1, 30.0)
    with pytest.raises(ConfigError, match="reward.workers = 0 is out of range"):
        load_config(overrides=["reward.workers=0"])
    with pytest.raises(ConfigError, match=r"reward.item_timeout_s = 0(\.0)? is out of range"):
        load_config(overrides=["reward.item_timeout_s=0"])


def test_the_protocol_carries_a_timeout_flag() -> None:
    assert ItemError("TimeoutError: slow", timeout=True).to_json() == {"error": "TimeoutError: slow", "timeout": True}
    assert ItemError("ValueError: bad").to_json() == {"error": "ValueError: bad"}
    reply = '{"results": [{"error": "slow", "timeout": true}, {"error": "bad"}, {"error": "x", "timeout": 1}]}'
    outputs = decode_reply(reply, 3, "r")
    assert all(isinstance(out, RemoteItemError) for out in outputs)
    assert [out.timeout for out in outputs] == [True, False, False]  # only true is a timeout


class InProcessRewardServer:
    """`megatron-rl reward-server`'s app on an event loop thread of this process."""

    def __init__(self, spec: str) -> None:
        self.server = reward_server.RewardServer(spec, 1, "k", 1.0, item_timeout_s=1.0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(self.server.app())
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/score"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.server.pool.close()


def test_the_reward_servers_item_timeouts_are_counted(spec: str) -> None:
    served = InProcessRewardServer(spec)
    try:
        scorer = RewardScorer(
            RewardConfig(type="remote", url=served.url, api_key="k", failure_reward=-5.0), run=rollout_loop().run
        )
        result = scorer.score(["hang", "1"], ["1", "1"])
    finally:
        served.close()
    assert result.failed == [True, False] and result.rewards == [-5.0, 1.0]
    assert (result.stats.failed, result.stats.timeouts) == (1, 1)
    assert "TimeoutError: the reward function ran longer than --item-timeout-s = 1 s" in result.stats.errors[0]

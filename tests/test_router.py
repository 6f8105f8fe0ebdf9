"""An sglang-router address in `rollout.sglang_urls`: the real router (PyPI `sglang-router`, a Rust binary,
started with the workers' `--api-key`) in front of two keyed local engines (`megatron-rl serve`, whose
/health is open as SGLang's, so the router's health check registers them). Generation goes through
the router, weight updates reach both workers it lists, a run trains through it; a router whose
workers cannot be found fails at start-up, naming it.

Skipped only when the sglang-router package (its binary) is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mrl_engine import on_loop, rollout_loop

from megatron_rl.config import Config, RolloutConfig
from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.local.launcher import LocalEngineProcess, StartingEngine, spawn_local_engine
from megatron_rl.rollout.sglang import SGLangError
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.weight_sync.memory import release_colocated_engines

import mrl_runs
import tiny_model

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

pytest.importorskip("sglang_router.sglang_router_rs", reason="the sglang-router binary is not installed")

ENV = {"OMP_NUM_THREADS": "1"}
KEY = "router-test-key"  # the workers' API key, which the router sends them


def _get(url: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def _worker(model: str) -> StartingEngine:
    return spawn_local_engine(model, api_key=KEY, extra_args=["--threads", "1"], env=ENV)


class Router:
    """`python -m sglang_router launch` on a free port, in front of `workers` (keyed with KEY)."""

    def __init__(self, workers: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1", "--port", port]
        cmd += ["--policy", "round_robin", "--log-level", "warn", "--api-key", KEY]
        if workers:
            cmd += ["--worker-urls", *workers]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"sglang-router exited: {self.process.stdout.read().decode()[-2000:]}")
            try:
                if len(_get(self.url + "/workers")["workers"]) == len(workers):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"sglang-router at {self.url} did not list {workers} in 120 s")
            time.sleep(0.3)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def models(work: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A: the end-to-end runs' tiny_math model (a run trains on it); B: the same model with other weights."""
    other = tmp_path_factory.mktemp("router") / "B"
    tiny_model.build_model(other, seed=1)
    return {"A": str(work / "model"), "B": str(other)}


@pytest.fixture(scope="module")
def workers(models: dict[str, str]) -> Iterator[list[LocalEngineProcess]]:
    starting = [_worker(models["A"]) for _ in range(2)]
    procs = [engine.wait() for engine in starting]  # the two load side by side
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _spread(samples: list[Sample]) -> float:
    """The largest difference of the samples' log-probs, token by token."""
    logprobs = torch.tensor([s.logprobs for s in samples])
    return float((logprobs.max(0).values - logprobs.min(0).values).max())


def _rollout(url: str) -> RolloutConfig:
    return RolloutConfig(engine="sglang", sglang_urls=[url], max_concurrency=4, max_retries=1, api_key=KEY)


def test_router_generates_and_weight_updates_reach_every_worker(
    workers: list[LocalEngineProcess], models: dict[str, str]
) -> None:
    worker_urls = [w.url for w in workers]
    router = Router(worker_urls)
    try:
        engine = RolloutEngine.from_config(_rollout(router.url), rollout_loop(), models["A"])
        try:
            client = engine.client
            assert client.router == router.url and sorted(client.urls) == sorted(worker_urls)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            before = on_loop(engine.generate([[5, 6, 7]] * 4, greedy))
            assert {s.server for s in before} == {router.url}  # every request went through the router
            # both workers serve model A (equal up to the rounding of each worker's own batch history)
            assert _spread(before) <= 1e-5, _spread(before)
            # the weight update goes to the workers the router listed (the router itself answers 404)
            replies = engine.run(client.update_weights_from_disk(models["B"], weight_version="7"))
            assert len(replies) == 2 and all(r["success"] for r in replies)
            for url in worker_urls:
                assert _get(url + "/get_model_info")["weight_version"] == "7"
            after = on_loop(engine.generate([[5, 6, 7]] * 4, greedy))
            assert {s.weight_version for s in after} == {"7"} and _spread(after) <= 1e-5, _spread(after)
            assert _spread([after[0], before[0]]) > 1e-3  # model B's weights serve now
            assert engine.run(client.health()) == dict.fromkeys(client.urls, True)
        finally:
            engine.close()
    finally:
        router.stop()


def test_a_run_trains_through_the_router_in_front_of_keyed_engines(
    workers: list[LocalEngineProcess], work: Path, tmp_path: Path
) -> None:
    """`megatron-rl train` with `rollout.sglang_urls=[router]` and the workers' key as `rollout.api_key`:
    a step's rollouts go through the router, its weights to both workers, which then serve its version."""
    router = Router([w.url for w in workers])
    try:
        run = tmp_path / "run"
        overrides = ["rollout.engine=sglang", f'rollout.sglang_urls=["{router.url}"]', f"rollout.api_key={KEY}"]
        mrl_runs.train(work, run, *overrides, "train.steps=1", "eval.every=0", ranks=1)
        assert [r["step"] for r in mrl_runs.steps_logged(run)] == [1]
        for worker in workers:
            assert _get(worker.url + "/get_model_info")["weight_version"] == "1"
    finally:
        router.stop()


def test_plain_servers_are_not_taken_for_a_router(workers: list[LocalEngineProcess], models: dict[str, str]) -> None:
    cfg = RolloutConfig(engine="sglang", sglang_urls=[w.url for w in workers], max_retries=0, api_key=KEY)
    engine = RolloutEngine.from_config(cfg, rollout_loop(), models["A"])
    try:
        assert engine.client.router is None and engine.client.urls == [w.url for w in workers]
    finally:
        engine.close()


def test_router_without_reachable_workers_fails_at_start_naming_the_address(
    workers: list[LocalEngineProcess], models: dict[str, str]
) -> None:
    empty = Router([])
    try:
        with pytest.raises(SGLangError, match=rf"sglang-router {empty.url} lists no worker .* pass the servers' own"):
            RolloutEngine.from_config(_rollout(empty.url), rollout_loop(), models["A"])
    finally:
        empty.stop()
    # a worker the router still lists but this machine cannot reach (here: one of its own that has stopped)
    lost = _worker(models["A"]).wait()
    router = Router([lost.url])
    try:
        lost.stop()
        with pytest.raises(
            SGLangError, match=rf"sglang-router {router.url} (lists workers \['{lost.url}'\], but|lists no)"
        ):
            RolloutEngine.from_config(_rollout(router.url), rollout_loop(), models["A"])
        # a router next to other addresses is ambiguous
        mixed = RolloutConfig(engine="sglang", sglang_urls=[router.url, workers[0].url], max_retries=0, api_key=KEY)
        with pytest.raises(SGLangError, match=rf"{router.url} is an sglang-router; give the router alone"):
            RolloutEngine.from_config(mixed, rollout_loop(), models["A"])
    finally:
        router.stop()
        lost.stop()


def test_routed_experts_aborts_and_memory_release_go_to_the_workers_not_the_router(
    workers: list[LocalEngineProcess], models: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """sglang-router 0.3.2 rebuilds /generate bodies without `return_routed_experts` and answers
    /abort_request and /release_memory_occupation with an empty 404: an R3 request goes to a worker
    directly, the abort of a request that timed out through the router goes to the worker (where it
    was waiting), and a colocated run's start-up release goes to the workers the router lists."""
    worker = workers[0]  # alive in every test of the module
    router = Router([worker.url])
    try:
        engine = RolloutEngine.from_config(_rollout(router.url), rollout_loop(), models["A"])
        try:
            client = engine.client
            greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            (sample,) = on_loop(engine.generate([[5, 6, 7]], greedy, return_routed_experts=True))
            assert sample.server == worker.url and sample.routed_experts is not None
            assert sample.routed_experts.shape[0] == 3 + 4 - 1
            # a request that cannot finish (the worker is paused) times out through the router
            engine.run(client.pause_generation("in_place"))
            client.timeout_s = 2.0
            with caplog.at_level("WARNING", logger="megatron_rl.rollout.sglang"):
                with pytest.raises(SGLangError, match=rf"POST /generate .* to {router.url} timed out"):
                    on_loop(engine.generate([[5, 6, 7]], greedy))
            assert not [r.message for r in caplog.records if "could not abort" in r.message]  # no 404
            state = _get(worker.url + "/get_server_info")["internal_states"][0]
            assert state["waiting"] == 0 and state["running"] == 0, state
            engine.run(client.continue_generation())
            colocated = dataclasses.replace(_rollout(router.url), colocate=True)
            assert release_colocated_engines(Config(rollout=colocated), rollout_loop())
            with pytest.raises(SGLangError, match="weights are released; call /resume_memory_occupation"):
                engine.run(client.update_weights_from_disk(models["A"]))  # released: no weights until resumed
            engine.run(client.resume_memory_occupation())
        finally:
            engine.close()
    finally:
        router.stop()

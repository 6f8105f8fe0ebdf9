"""Engine restarts under concurrency, without processes: a scripted client whose engine dies under
several rollout threads at once, and the hand-off of the restart and its resync to the main thread."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.handoff import HandoffClosedError, MainThreadCalls
from megatron_rl.rollout.sglang import EngineDiedError
from megatron_rl.rollout.types import Sample, SamplingParams

WORKERS = 3
PARAMS = SamplingParams(max_new_tokens=2)


class Process:
    """What `RolloutEngine` reads of a local engine child."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.url = f"http://127.0.0.1:{30000 + serial}"
        self.log_path = f"engine-{serial}.log"

    def log_tail(self) -> str:
        return ""

    def stop(self) -> None:
        pass


class DyingClient:
    """The engine dies once `WORKERS` requests are in flight: every one of them fails with
    `EngineDiedError`; later requests are answered (recording the engine's version at that time)."""

    routed_experts_layout = (1, 1)
    dead_reason = None
    replies = 0

    def __init__(self) -> None:
        self.waiting = 0
        self.died = False
        self.version = "default"  # what the engine serves: "trained" once resynced
        self.answered_with: list[str] = []
        self.death: asyncio.Event | None = None

    async def start(self) -> None:
        self.death = asyncio.Event()

    async def close(self) -> None:
        pass

    async def generate_batch(self, prompts, params, return_routed_experts=False, done=None):  # noqa: ANN001, ANN201
        assert self.death is not None
        if not self.died:
            self.waiting += 1
            if self.waiting == WORKERS:
                self.died = True
                self.death.set()
            await asyncio.wait_for(self.death.wait(), 30)
            raise EngineDiedError("the local engine (pid 1) exited with code -9", server="http://127.0.0.1:30000")
        self.answered_with.append(self.version)
        for i, prompt in enumerate(prompts):
            done[i] = Sample(list(prompt), [7], [-0.5], "stop", weight_version=self.version)


def make_engine(client: DyingClient, restarted: list[str]) -> RolloutEngine:
    def restart(dead: Process) -> Process:
        restarted.append(threading.current_thread().name)
        return Process(dead.serial + 1)

    engine = RolloutEngine(client, Process(0), restart=restart, max_restarts=2)  # type: ignore[arg-type]

    def resync() -> None:
        client.version = "trained"
        restarted.append(f"resync on {threading.current_thread().name}")

    engine.resync = resync
    return engine


def generate_on_workers(engine: RolloutEngine) -> list:
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="worker")
    return [pool.submit(engine.generate, [[1, 2, i]], PARAMS) for i in range(WORKERS)]


def test_workers_that_see_one_death_restart_the_engine_once_on_the_main_thread() -> None:
    client, restarted = DyingClient(), []
    engine = make_engine(client, restarted)
    handoff = MainThreadCalls()
    engine.handoff = handoff
    try:
        futures = generate_on_workers(engine)
        for future in futures:
            future.add_done_callback(lambda _: handoff.notify())
        with handoff.cond:  # the main thread's safe point: it runs what the workers hand it
            assert handoff.wait_for(lambda: all(f.done() for f in futures), 60)
        samples = [f.result(0)[0] for f in futures]
    finally:
        engine.close()
    main = threading.current_thread().name
    assert engine.restarts == 1 and restarted == [main, f"resync on {main}"]
    # every request was sent again, and only to the resynced engine
    assert client.answered_with == ["trained"] * WORKERS
    assert sorted(s.prompt_ids[-1] for s in samples) == list(range(WORKERS))


def test_without_a_handoff_one_worker_restarts_and_the_others_wait_for_its_resync() -> None:
    client, restarted = DyingClient(), []
    engine = make_engine(client, restarted)
    try:
        futures = generate_on_workers(engine)
        samples = [f.result(60)[0] for f in futures]
    finally:
        engine.close()
    assert engine.restarts == 1 and len(restarted) == 2 and restarted[1] == f"resync on {restarted[0]}"
    assert client.answered_with == ["trained"] * WORKERS and len(samples) == WORKERS


def test_a_call_handed_to_a_main_thread_that_ends_fails_instead_of_waiting() -> None:
    handoff = MainThreadCalls()
    with ThreadPoolExecutor(1) as pool:
        handed = pool.submit(handoff.call, lambda: 1, "a resync")
        with handoff.cond:  # the condition's own wait: handed over, not run
            assert handoff.cond.wait_for(lambda: bool(handoff._calls), 30)
        handoff.close()
        with pytest.raises(HandoffClosedError, match="a resync: the run is ending"):
            handed.result(30)
    assert handoff.call(lambda: 2, "on the main thread") == 2  # the owner's own call runs at once


class StalledClient(DyingClient):
    """A client with two requests in flight on one server and no reply."""

    def in_flight(self) -> dict[str, int]:
        return {"http://127.0.0.1:30000": 2}


def test_threads_waiting_on_one_stall_give_one_warning_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    engine = RolloutEngine(StalledClient(), stall_warning_s=60.0)  # type: ignore[arg-type]
    try:
        with caplog.at_level("WARNING", logger="megatron_rl.rollout.engine"):
            with ThreadPoolExecutor(WORKERS) as pool:  # the episodes' threads, each seeing the same stall
                list(pool.map(lambda _: engine._warn_stalled(60.0), range(WORKERS)))
            engine._last_stall_warning -= 60.0  # one interval later
            engine._warn_stalled(120.0)
    finally:
        engine.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0] == (
        "no reply from the rollout engine for 60 s (rollout.stall_warning_s): 2 request(s) in flight "
        "(http://127.0.0.1:30000: 2)"
    )
    assert warnings[1].startswith("no reply from the rollout engine for 120 s")

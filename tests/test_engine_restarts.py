"""Engine restarts under concurrency, without processes: a scripted client whose engine dies under
several requests at once on the rollout loop, and the hand-off of the resync to the main thread."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.handoff import HandoffClosedError, MainThreadCalls
from megatron_rl.rollout.sglang import EngineDiedError, SGLangClient
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
    waiting_for_weights = 0
    max_retries, timeout_s, backoff_s = 0, 60.0, 0.0

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


@pytest.fixture
def loop():
    with RolloutLoop() as rollout_loop:
        yield rollout_loop


def make_engine(client: DyingClient, restarted: list[str], loop: RolloutLoop) -> RolloutEngine:
    def restart(dead: Process) -> Process:
        restarted.append(threading.current_thread().name)
        return Process(dead.serial + 1)

    engine = RolloutEngine(client, loop, Process(0), restart=restart, max_restarts=2)  # type: ignore[arg-type]

    def resync() -> None:
        client.version = "trained"
        restarted.append(f"resync on {threading.current_thread().name}")

    engine.resync = resync
    return engine


def generate_on_the_loop(engine: RolloutEngine, loop: RolloutLoop) -> list:
    return [loop.submit(engine.generate([[1, 2, i]], PARAMS)) for i in range(WORKERS)]


def test_requests_that_see_one_death_restart_the_engine_once_and_resync_on_the_main_thread(loop) -> None:
    client, restarted = DyingClient(), []
    engine = make_engine(client, restarted, loop)
    handoff = MainThreadCalls()
    engine.handoff = handoff
    try:
        futures = generate_on_the_loop(engine, loop)
        for future in futures:
            future.add_done_callback(lambda _: handoff.notify())
        with handoff.cond:  # the main thread's safe point: it runs what the loop hands it
            assert handoff.wait_for(lambda: all(f.done() for f in futures), 60)
        samples = [f.result(0)[0] for f in futures]
    finally:
        engine.close()
    main = threading.current_thread().name
    # the child's start blocks: on a worker thread, not the loop's nor the main thread; only the resync is handed over
    assert engine.restarts == 1 and restarted[1:] == [f"resync on {main}"]
    assert restarted[0] not in (main, "rollout-runtime")
    # every request was sent again, and only to the resynced engine
    assert client.answered_with == ["trained"] * WORKERS
    assert sorted(s.prompt_ids[-1] for s in samples) == list(range(WORKERS))


def test_without_a_handoff_one_request_restarts_and_the_others_wait_for_its_resync(loop) -> None:
    client, restarted = DyingClient(), []
    engine = make_engine(client, restarted, loop)
    try:
        samples = [f.result(60)[0] for f in generate_on_the_loop(engine, loop)]
    finally:
        engine.close()
    assert engine.restarts == 1 and len(restarted) == 2 and restarted[1].startswith("resync on ")
    assert client.answered_with == ["trained"] * WORKERS and len(samples) == WORKERS


def test_a_call_handed_to_a_main_thread_that_ends_fails_instead_of_waiting() -> None:
    handoff = MainThreadCalls()
    with ThreadPoolExecutor(1) as pool:
        handed = pool.submit(handoff.submit, lambda: 1, "a resync").result(30)
        handoff.close()
        with pytest.raises(HandoffClosedError, match="the run is ending"):
            handed.result(30)
    assert handoff.submit(lambda: 2, "on the main thread").result(0) == 2  # the owner's own call runs at once


def test_the_main_thread_waits_for_the_loop_within_a_bound(loop) -> None:
    handoff = MainThreadCalls()
    never = asyncio.Event()

    async def stuck() -> None:
        await never.wait()

    with pytest.raises(TimeoutError, match="within 0 s"):
        loop.run(stuck(), 0.05, handoff)
    with pytest.raises(RuntimeError, match="from the loop's own thread"):  # would deadlock: refused

        async def nested() -> None:
            loop.submit(stuck())

        loop.run(nested(), 30)


class StalledClient(DyingClient):
    """A client with two requests in flight on one server and no reply."""

    def in_flight(self) -> dict[str, int]:
        return {"http://127.0.0.1:30000": 2}


def test_a_stall_is_warned_about_once_per_interval_naming_the_requests(loop, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.engine"):
        engine = RolloutEngine(StalledClient(), loop, stall_warning_s=0.05)  # type: ignore[arg-type]
        try:
            deadline = time.monotonic() + 30  # a hang guard
            while len(caplog.records) < 2:
                assert time.monotonic() < deadline, "no stall warnings"
                time.sleep(0.01)
        finally:
            engine.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings[0] == (
        "no reply from the rollout engine for 0 s (rollout.stall_warning_s): 2 request(s) in flight "
        "(http://127.0.0.1:30000: 2)"
    )


class ScriptedServer:
    """One address for the engine child before and after a restart (own thread and loop, raw HTTP): the
    old child holds the request of prompt [1] until `drop_held` and drops every connection; the new
    child answers, recording for each request whether the resync had ended when it arrived."""

    def __init__(self) -> None:
        self.restarted = False
        self.resynced = False
        self.held_arrived = threading.Event()
        self.arrivals: list[tuple[list[int], bool]] = []  # at the new child: (prompt, resync ended)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._drop = asyncio.Event()
            server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="scripted-engine", daemon=True)
        self._thread.start()
        assert started.wait(30)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")
        )
        body = json.loads(await reader.readexactly(length))
        if not self.restarted:  # the old child: gone
            if body["input_ids"] == [1]:
                self.held_arrived.set()
                await asyncio.wait_for(self._drop.wait(), 30)
            writer.close()
            return
        self.arrivals.append((body["input_ids"], self.resynced))
        meta = {"finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-1.0, 7, None]]}
        reply = json.dumps({"text": "", "output_ids": [7], "meta_info": meta}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply))
        await writer.drain()
        writer.close()

    def drop_held(self) -> None:
        self._loop.call_soon_threadsafe(self._drop.set)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


class Child:
    """A local engine child at `url`: the old one has exited (code -9); the new one runs."""

    def __init__(self, url: str, exited: bool) -> None:
        self.url, self.port, self.exited = url, int(url.rsplit(":", 1)[1]), exited
        self.process = self
        self.pid, self.log_path = 1, "engine.log"

    def wait(self, timeout: float) -> int:
        if not self.exited:
            raise subprocess.TimeoutExpired("engine", timeout)
        return -9

    def stopped(self) -> bool:
        return False

    def log_tail(self) -> str:
        return ""

    def stop(self) -> None:
        pass


def test_a_request_retrying_across_a_restart_reaches_the_engine_only_after_its_resync(loop) -> None:
    """Request R is on the old child when it dies; request Q sees the death and restarts it. R's
    connection error comes only once the new child runs (so R is retried, not restarted), and its
    retry must wait until the resync has ended."""
    server = ScriptedServer()
    client = SGLangClient([server.url], max_retries=2, backoff_s=0.01, routed_experts_layout=(1, 1))
    new_child = Child(server.url, exited=False)

    def restart(dead: Child) -> Child:
        server.restarted = True
        return new_child

    engine = RolloutEngine(client, loop, Child(server.url, exited=True), restart=restart, max_restarts=1)  # type: ignore[arg-type]

    def resync() -> None:  # the connection of R drops now, while the new child runs and is not resynced
        server.drop_held()
        deadline = time.monotonic() + 30  # a hang guard
        # R held at the gate (an attribute code without the gate lacks), or R retried and arrived
        while not (getattr(client, "waiting_for_weights", 0) or any(p == [1] for p, _ in server.arrivals)):
            assert time.monotonic() < deadline, "R was neither retried nor held"
            time.sleep(0.005)
        server.resynced = True

    engine.resync = resync
    try:
        held = loop.submit(engine.generate([[1]], PARAMS))
        assert server.held_arrived.wait(30)
        restarting = loop.submit(engine.generate([[2]], PARAMS))
        samples = held.result(60) + restarting.result(60)
    finally:
        engine.close()
        server.close()
    assert engine.restarts == 1 and [s.output_ids for s in samples] == [[7], [7]]
    assert sorted(server.arrivals) == [([1], True), ([2], True)]  # nothing reached the new child before its resync

"""What the trainer sees of a rollout engine: sampling parameters in, samples out.

`SamplingParams` and `Sample` are plain data (`types.py`). `RolloutEngine` is the synchronous handle
the trainer holds: it runs an `SGLangClient` on a private event-loop thread (so the trainer needs no
asyncio) against real SGLang servers or the local engine, which it starts itself when no SGLang
address is configured, with `configured_api_key` or else a random key of its own (`client.api_key`). A configured address that is an sglang-router is found at start-up
(`SGLangClient.use_router`): generation goes through it, control calls and weight updates to the
workers it lists. Any client coroutine can also be run with `run` or started with `submit`
(e.g. post `/update_weights_from_distributed`, then broadcast, then wait).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from megatron_rl.rollout.local.launcher import API_KEY_ENV, LocalEngineProcess, start_local_engine
from megatron_rl.rollout.sglang import SGLangClient
from megatron_rl.rollout.types import Sample, SamplingParams

T = TypeVar("T")


def configured_api_key(rollout: Any) -> str | None:
    """The engines' key: `rollout.api_key`, else $MEGATRON_RL_ENGINE_API_KEY (the Slurm scripts' job key)."""
    return rollout.api_key or os.environ.get(API_KEY_ENV) or None


def moe_layout(model_path: str) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) of a Hugging Face MoE folder; None for a dense model."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_path) / "config.json").read_text())
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return None
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


class RolloutEngine:
    """Synchronous access to SGLang servers (or the local engine) for a trainer."""

    def __init__(self, client: SGLangClient, local_process: LocalEngineProcess | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self.client = client
        self.local_process = local_process
        self.run(client.start())
        if local_process is not None and client.routed_experts_layout is None:
            self.run(client.load_model_layout())

    @classmethod
    def from_config(cls, rollout: Any, model_path: str | None = None, **local_kwargs: Any) -> RolloutEngine:
        """Connect to `rollout.sglang_urls`, or start the local engine on `model_path` when there are none."""
        process = None
        urls = list(rollout.sglang_urls)
        api_key = configured_api_key(rollout)
        if rollout.engine == "local" or not urls:
            if model_path is None:
                raise ValueError("rollout.engine = local needs a model folder (model.hf_path) to serve")
            # the engine this run starts requires a key: without one, any local process could post it weights
            api_key = api_key or secrets.token_urlsafe(32)
            process = start_local_engine(
                model_path, host=rollout.host, port=rollout.port, api_key=api_key, **local_kwargs
            )
            urls = [process.url]
        client = SGLangClient(
            urls,
            api_key=api_key,
            max_concurrency=rollout.max_concurrency,
            timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            routed_experts_layout=moe_layout(model_path) if model_path else None,
        )
        engine = cls(client, process)
        if process is None:
            try:
                engine.run(client.use_router())  # an sglang-router: generate through it, sync its workers
            except BaseException:
                engine.close()
                raise
        return engine

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a client coroutine on the engine's loop and wait for its result."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        """Start a client coroutine on the engine's loop; returns a `concurrent.futures.Future`."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """Generate one response per prompt (repeat a prompt for a group), in prompt order; `params`
        is shared or one per prompt (e.g. a `sampling_seed` each)."""
        return self.run(self.client.generate_batch(prompts, params, return_routed_experts=return_routed_experts))

    def close(self) -> None:
        try:
            self.run(self.client.close(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            if self.local_process is not None:
                self.local_process.stop()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

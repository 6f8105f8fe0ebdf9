"""What the trainer sees of a rollout engine: sampling parameters in, samples out.

`SamplingParams` and `Sample` are plain data. `RolloutEngine` is the synchronous handle the
trainer holds: it runs an `SGLangClient` on a private event-loop thread (so the trainer needs no
asyncio) against real SGLang servers or the local engine, which it starts itself when no SGLang
address is configured. Any client coroutine can also be run with `run` or started with `submit`
(e.g. post `/update_weights_from_distributed`, then broadcast, then wait).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options, always sent to the server explicitly (SGLang fills omitted ones itself)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None  # the request's own random stream: same seed, same tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise ValueError(f"sampling_seed must be in [0, 2**63), got {self.sampling_seed}")

    @classmethod
    def from_config(cls, rollout: Any, **overrides: Any) -> SamplingParams:
        """From a `RolloutConfig` (temperature, top_p, top_k, max_new_tokens)."""
        values = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
        )
        values.update(overrides)
        return cls(**values)

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": int(self.max_new_tokens),
            "ignore_eos": bool(self.ignore_eos),
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.sampling_seed is not None:
            params["sampling_seed"] = int(self.sampling_seed)
        return params


@dataclass
class Sample:
    """One generated response and what the trainer needs from the engine about it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None  # one per output token: log_softmax(logits / T) of the sampled token
    finish_reason: str  # "stop", "length" or "abort"
    matched_stop: int | str | None = None
    routed_experts: np.ndarray | None = None  # int32 [len(prompt) + len(output) - 1, layers, top_k]
    weight_version: str | None = None
    rid: str = ""
    server: str = ""
    meta_info: dict = field(default_factory=dict, repr=False)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


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

    def __init__(self, client: Any, local_process: Any = None):
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
        from megatron_rl.rollout.sglang import SGLangClient

        process = None
        urls = list(rollout.sglang_urls)
        if rollout.engine == "local" or not urls:
            from megatron_rl.rollout.local.launcher import start_local_engine

            if model_path is None:
                raise ValueError("rollout.engine = local needs a model folder (model.hf_path) to serve")
            process = start_local_engine(
                model_path, host=rollout.host, port=rollout.port, api_key=rollout.api_key, **local_kwargs
            )
            urls = [process.url]
        client = SGLangClient(
            urls,
            api_key=rollout.api_key,
            max_concurrency=rollout.max_concurrency,
            timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            routed_experts_layout=moe_layout(model_path) if model_path else None,
        )
        return cls(client, process)

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

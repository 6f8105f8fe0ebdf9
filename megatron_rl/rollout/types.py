"""Plain data the trainer and the engines share: sampling parameters in, samples out, memory tags.

Nothing here talks to an engine: the SGLang client (`sglang.py`), the engine handle (`engine.py`), the
local engine (`local/`) and the weight sync (`megatron_rl/weight_sync/`) import it. `Engine` is what the
rollout side (episodes, agents' gateway, collection, evaluation) asks of an engine handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# What `/release_memory_occupation` and `/resume_memory_occupation` accept, in SGLang's order
# (`GPU_MEMORY_ALL_TYPES`); the default of both is all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options, always sent to the server explicitly (SGLang fills omitted ones itself)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()  # SGLang's stop strings: the output ends with the token that completes one
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
        """From a `RolloutConfig` (temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids)."""
        values = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            stop=tuple(str(s) for s in rollout.stop),
            stop_token_ids=tuple(int(t) for t in rollout.stop_token_ids),
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
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.sampling_seed is not None:
            params["sampling_seed"] = int(self.sampling_seed)
        return params


class Finished:
    """`truncated` and `aborted` of what carries the engine's `finish_reason` (a response, an episode)."""

    finish_reason: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass
class PromptScores:
    """An engine's scoring of given tokens (`GenerationClient.prompt_scores`), per scored token:
    its log-prob, and (with a top-k) the k most likely token ids there and their log-probs, descending."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class Sample(Finished):
    """One generated response and what the trainer needs from the engine about it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None  # one per output token: log_softmax(logits / T) of the sampled token
    finish_reason: str  # "stop", "length" or "abort"
    matched_stop: int | str | None = None
    routed_experts: np.ndarray | None = None  # int32 [len(prompt) + len(output) - 1, layers, top_k]
    weight_version: str | None = None
    # the weight version that generated each output token (SGLang's meta_info.weight_versions); None = not reported
    weight_versions: list[str] | None = None
    rid: str = ""
    server: str = ""
    meta_info: dict = field(default_factory=dict, repr=False)


class Engine(Protocol):
    """What the rollout side needs of an engine (`engine.RolloutEngine`, and the tests' fake engine).
    `generate` runs on the rollout runtime's event loop."""

    restarts: int  # how many times the engine was restarted after a death, so far in this process

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """One response per prompt (repeat a prompt for a group), in prompt order; `params` shared or one
        per prompt."""
        ...

    def close(self) -> None:
        """Stop the engine (a local engine's child process) or disconnect."""
        ...

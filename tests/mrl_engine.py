"""The tests' one fake engine: `megatron_rl.rollout.types.Engine` answered from a script.

A test subclasses `FakeEngine` and says how one request is answered (`answer`); the fake records every
request (`requests`: prompt ids and sampling) and every `generate` call's sampling (`calls`), and runs on
the rollout runtime's event loop like the real handle. `answer` may be a coroutine function (a test that
holds a request back awaits there). Tests run the product's coroutines on one rollout loop (`on_loop`).
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.types import Sample, SamplingParams

T = TypeVar("T")


class FakeEngine:
    """An `Engine` whose answers a subclass scripts (`answer`); records the requests in order."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.calls: list[list[SamplingParams]] = []
        self.restarts = 0  # a fake engine never dies
        self.closed = False

    def answer(self, ids: list[int], params: SamplingParams, routed: bool) -> Sample:
        """The response to one request (`ids`, `params`); `routed`: return routed experts."""
        raise NotImplementedError

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        self.calls.append(per_prompt)
        out = []
        for ids, p in zip(prompts, per_prompt, strict=True):
            self.requests.append((list(ids), p))
            sample = self.answer(list(ids), p, return_routed_experts)
            out.append(await sample if inspect.isawaitable(sample) else sample)
        return out

    def close(self) -> None:
        self.closed = True


_LOOP: RolloutLoop | None = None


def rollout_loop() -> RolloutLoop:
    """The tests' rollout loop: one per test process, as a run has one on rank 0 (`RolloutLoop`)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = RolloutLoop()
    return _LOOP


def on_loop(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
    """`coro`'s result, run on the tests' rollout loop (the product's `RolloutLoop.run`)."""
    return rollout_loop().run(coro, timeout)


def fake_runtime(
    cfg: Any, engine: Any, tokenizer: Any, prompts: list, eval_prompts: list | None = None, teacher: Any = None
) -> Any:
    """The product's `RolloutRuntime` around a fake `engine` (and a fake distillation `teacher`), its prompts drawn in
    order, on a loop of its own (an abort after a stop signal holds for the loop's life); `runtime.close()`, then
    `runtime.data.close()` end it."""
    from megatron_rl.data import PromptSampler
    from megatron_rl.loop.runtime import RolloutData, RolloutRuntime
    from megatron_rl.rewards import RewardScorer

    loop = RolloutLoop()
    scorer = RewardScorer(cfg.reward, run=loop.run)
    sampler = PromptSampler(prompts, shuffle=False)
    data = RolloutData(tokenizer, sampler, eval_prompts or [], scorer, {}, loop)
    return RolloutRuntime(cfg, data, model_path=None, engine_log=Path("engine.log"), engine=engine, teacher=teacher)

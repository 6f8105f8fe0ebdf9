"""The tests' one fake engine: `megatron_rl.rollout.types.Engine` answered from a script.

A test subclasses `FakeEngine` and says how one request is answered (`answer`); the fake records every
request (`requests`: prompt ids and sampling) and every `generate` call's sampling (`calls`), and runs on
the rollout runtime's event loop like the real handle. `answer` may be a coroutine function (a test that
holds a request back awaits there).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from megatron_rl.rollout.types import Sample, SamplingParams


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

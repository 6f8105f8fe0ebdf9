"""The teacher of on-policy distillation, served in this process: the local engine's prompt log-probs (a
prefill only, SGLang's `max_new_tokens` 0 with `logprob_start_len`) through the SGLang client equal
transformers' on the same tokens (fp32), and a teacher that stops answering stops the scoring with its
reason after the client's retries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
from mrl_engine import on_loop

from megatron_rl.http.server import start as start_serving
from megatron_rl.rollout.local import server as engine_server
from megatron_rl.rollout.local.engine_thread import EngineThread
from megatron_rl.rollout.local.generator import Generator
from megatron_rl.rollout.local.model import load_model
from megatron_rl.rollout.sglang import GenerationClient, SGLangError

from mrl_configs import make_tiny_model

KEY = "teacher-key"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_model(str(tmp_path_factory.mktemp("teacher") / "model"), family="qwen3", seed=3))


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Iterator[engine_server.LocalServer]:
    model, info = load_model(str(teacher_dir), "cpu", "float32")
    thread = EngineThread(model, info, Generator(model, info, 8, 1024, seed=0))
    thread.start()
    try:
        yield engine_server.LocalServer(thread, info, KEY)
    finally:
        thread.stop()


@asynccontextmanager
async def served(server: engine_server.LocalServer) -> AsyncIterator[str]:
    """`server` on a free port of 127.0.0.1, on the running loop; yields its address."""
    serving = await start_serving(server.app(), port=0, shutdown_timeout_s=1.0, handler_cancellation=True)
    try:
        yield f"http://127.0.0.1:{serving.port}"
    finally:
        await serving.close()


@torch.no_grad()
def transformers_logprobs(folder: Path, ids: list[int], start: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return lp[start - 1 :].tolist()


def test_local_teacher_logprobs_equal_transformers(teacher, teacher_dir, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 17, 30)]
    starts = [4, 1, 22]  # a prompt of 4 tokens; every token after the first; the last 8 of 30

    async def score() -> list[list[float]]:
        async with served(teacher) as url:
            async with GenerationClient([url], api_key=KEY, max_retries=0) as client:
                asked = [client.prompt_logprobs(s, k) for s, k in zip(sequences, starts, strict=True)]
                return list(await asyncio.gather(*asked))

    got = on_loop(score())
    for ids, start, values in zip(sequences, starts, got, strict=True):
        expected = transformers_logprobs(teacher_dir, ids, start)
        assert len(values) == len(ids) - start
        assert max(abs(a - b) for a, b in zip(values, expected, strict=True)) <= 1e-5
        assert max(abs(a) for a in values) > 1.0  # real log-probs of a random model, not zeros


def test_prompt_logprobs_refuse_a_start_outside_the_tokens():
    client = GenerationClient(["http://127.0.0.1:1"])
    for start in (0, 3):
        with pytest.raises(ValueError, match=f"start {start} is not inside the 3 tokens"):
            on_loop(client.prompt_logprobs([1, 2, 3], start))


def test_a_teacher_that_stops_answering_fails_after_the_retries(teacher, tmp_path):
    async def score_after_stop() -> None:
        async with served(teacher) as url:
            pass  # the server stops here
        async with GenerationClient([url], api_key=KEY, max_retries=2, backoff_s=0.01) as client:
            await client.prompt_logprobs([5, 6, 7, 8], 2)

    with pytest.raises(
        SGLangError, match=r"failed after 3 tries; last server http://127\.0\.0\.1:\d+: connection refused"
    ):
        on_loop(score_after_stop())

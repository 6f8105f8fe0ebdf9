"""The teacher of on-policy distillation, served in this process: the local engine's prompt log-probs (a
prefill only, SGLang's `max_new_tokens` 0 with `logprob_start_len`) through the SGLang client equal
transformers' on the same tokens (fp32), and a teacher that stops answering stops the scoring with its
reason after the client's retries."""

from __future__ import annotations

import asyncio
import json
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
from megatron_rl.rollout.types import SamplingParams

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


@torch.no_grad()
def transformers_top(folder: Path, ids: list[int], start: int, k: int) -> torch.return_types.topk:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)[start - 1 :].topk(k, dim=-1)


def test_local_teacher_top_logprobs_equal_transformers(teacher, teacher_dir):
    """`top_logprobs_num` on a prefill: per scored token the k largest log-probs of the distribution that
    predicts it, and their ids, equal to transformers' top-k of log_softmax (fp32); the sampled tokens'
    own log-probs come back as without a top-k."""
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 25)]
    starts, k = [5, 1], 6

    async def score() -> list:
        async with served(teacher) as url:
            async with GenerationClient([url], api_key=KEY, max_retries=0) as client:
                asked = [client.prompt_scores(s, at, k) for s, at in zip(sequences, starts, strict=True)]
                return list(await asyncio.gather(*asked))

    for ids, start, got in zip(sequences, starts, on_loop(score()), strict=True):
        expected = transformers_top(teacher_dir, ids, start, k)
        assert len(got.top_ids) == len(got.top_logprobs) == len(got.logprobs) == len(ids) - start
        assert got.top_ids == expected.indices.tolist()
        assert (torch.tensor(got.top_logprobs) - expected.values).abs().max() <= 1e-5
        own = transformers_logprobs(teacher_dir, ids, start)
        assert max(abs(a - b) for a, b in zip(got.logprobs, own, strict=True)) <= 1e-5
        assert all(row == sorted(row, reverse=True) for row in got.top_logprobs)


def test_prompt_top_logprobs_are_sglangs_request_and_reply(teacher):
    """Read in SGLang 0.5.23's wheel: the client's prefill body with a top-k is a `GenerateRequest` of its API
    schema (`top_logprobs_num`, `return_logprob`, `logprob_start_len`, max_new_tokens 0); the local engine's
    reply is a `GenerateResponse` whose `meta_info.input_top_logprobs` has one row per entry of
    `input_token_logprobs`, the first null (its scheduler starts the rows with [None]), then k
    [logprob, token_id, text] entries each; and the client reads them back."""
    pytest.importorskip("msgspec", reason="SGLang's API schema is msgspec")
    import sglang_wheel

    api = sglang_wheel.load_module("api/v1/api_types.py", "sglang_api_types")
    scheduler = sglang_wheel.function_source(
        "srt/managers/scheduler_components/logprob_result_processor.py",
        "_process_input_top_logprobs",
        "SchedulerLogprobResultProcessor",
    )
    assert "req.logprob.input_top_logprobs_val = [] if uses_scoring_positions else [None]" in scheduler
    ids, start, k = [3, 9, 4, 1, 7, 7], 2, 4
    client = GenerationClient(["http://127.0.0.1:1"])
    body = client.generate_body(ids, SamplingParams(max_new_tokens=1), "r")
    body["sampling_params"]["max_new_tokens"] = 0
    body.update(logprob_start_len=start - 1, top_logprobs_num=k)
    request = api.GenerateRequest.from_json_value(body)
    assert (request.top_logprobs_num, request.logprob_start_len, request.return_logprob) == (k, start - 1, True)

    async def ask() -> tuple[dict, object]:
        async with served(teacher) as url:
            async with GenerationClient([url], api_key=KEY, max_retries=0) as c:
                _, _, text = await c._call("POST", "/generate", body, what="r")
                return json.loads(text), await c.prompt_scores(ids, start, k)

    reply, scores = on_loop(ask())
    meta = api.GenerateResponse.from_json_value(reply).meta_info
    assert len(meta.input_top_logprobs) == len(meta.input_token_logprobs) == len(ids) - start + 1
    assert meta.input_top_logprobs[0] is None and meta.input_token_logprobs[0].logprob is None
    assert all(len(row) == k for row in meta.input_top_logprobs[1:])
    assert scores.top_ids == [[e.token_id for e in row] for row in meta.input_top_logprobs[1:]]
    assert scores.top_logprobs == [[e.logprob for e in row] for row in meta.input_top_logprobs[1:]]


def test_the_local_engine_refuses_top_logprobs_on_generated_tokens(teacher):
    """The local engine serves `top_logprobs_num` on a prefill only: a generation asking for it is refused by name."""

    async def ask() -> None:
        async with served(teacher) as url:
            async with GenerationClient([url], api_key=KEY, max_retries=0) as client:
                body = client.generate_body([1, 2, 3], SamplingParams(max_new_tokens=2), "r")
                await client._call("POST", "/generate", {**body, "top_logprobs_num": 3}, what="r")

    with pytest.raises(SGLangError, match="top_logprobs_num: the local engine serves it for a prefill only"):
        on_loop(ask())


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

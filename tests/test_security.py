"""The local engine (`megatron-rl serve`) against hostile or broken requests: per-endpoint body limits
(413), non-finite JSON numbers (400 naming the field), foreign shared-memory names in a tensor update,
truncated or garbage safetensors, SIGTERM during a pending group init, and no temporary folder left.
(The per-run API key of the trainer's engine is checked mid-run in tests/test_trainer.py.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from megatron_rl.rollout.local.launcher import start_local_engine
from megatron_rl.rollout.local.server import (
    CONTROL_BODY_BYTES,
    GENERATE_BYTES_PER_POSITION,
    GENERATE_BYTES_PER_PROMPT,
    UPDATE_BYTES_PER_TENSOR,
)

from mrl_configs import make_tiny_model

KEY = "security-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = {"OMP_NUM_THREADS": "1"}
MAX_RUNNING = 4
POSITIONS = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        str(tmp_path_factory.mktemp("security") / "model"), "qwen3_moe", seed=0, max_position_embeddings=POSITIONS
    )


@pytest.fixture(scope="module")
def engine(model: str):
    args = ["--threads", "1", "--max-running-requests", str(MAX_RUNNING)]
    proc = start_local_engine(model, api_key=KEY, extra_args=args, env=ENV)
    yield proc
    proc.stop()


def post(url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, str]:
    async def go() -> tuple[int, str]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, data=data, headers={**AUTH, **(headers or {})}) as reply:
                return reply.status, await reply.text()

    return asyncio.run(go())


def get(url: str, path: str) -> dict:
    async def go() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + path, headers=AUTH) as reply:
                assert reply.status == 200
                return await reply.json()

    return asyncio.run(go())


def checkpoint_tensors(model: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        return len(list(f.keys()))


def test_body_limits_by_endpoint(engine, model: str) -> None:
    generate = MAX_RUNNING * (POSITIONS * GENERATE_BYTES_PER_POSITION + GENERATE_BYTES_PER_PROMPT)
    weights = CONTROL_BODY_BYTES + checkpoint_tensors(model) * UPDATE_BYTES_PER_TENSOR
    limits = get(engine.url, "/get_server_info")["max_body_bytes"]
    assert limits == {
        "/generate": generate,
        "/update_weights_from_tensor": weights,
        "/update_weights_from_distributed": weights,
        "other": CONTROL_BODY_BYTES,
    }
    for path, limit in [
        ("/generate", generate),
        ("/update_weights_from_tensor", weights),
        ("/abort_request", CONTROL_BODY_BYTES),
    ]:
        status, text = post(engine.url, path, b" " * (limit + 1))  # whitespace: valid JSON padding, only too long
        assert status == 413 and f"over this endpoint's limit of {limit} bytes" in text, (path, text)
        status, text = post(engine.url, path, b" " * limit)  # at the limit: read, then refused as empty
        assert status != 413, (path, text)

    async def chunked() -> tuple[int, str]:  # no Content-Length: refused once the limit is passed
        async def body():
            for _ in range(CONTROL_BODY_BYTES // 4096 + 2):
                yield b" " * 4096

        async with aiohttp.ClientSession() as session:
            async with session.post(engine.url + "/flush_cache", data=body(), headers=AUTH) as reply:
                return reply.status, await reply.text()

    status, text = asyncio.run(chunked())
    assert status == 413 and f"passed this endpoint's limit of {CONTROL_BODY_BYTES} bytes" in text
    # an unauthenticated client is refused before its body is read
    assert post(engine.url, "/generate", b" " * (generate + 1), {"Authorization": "Bearer wrong"})[0] == 401


def test_non_finite_numbers_are_refused_naming_the_field(engine) -> None:
    ok = {"input_ids": [1, 2], "sampling_params": {"temperature": 1.0, "max_new_tokens": 2}}
    assert post(engine.url, "/generate", ok)[0] == 200
    cases = [
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature: NaN"),
        (
            b'{"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": Infinity}]}',
            "sampling_params[1].top_p: Infinity",
        ),
        (
            b'{"input_ids": [1, 2], "sampling_params": {"temperature": -Infinity}}',
            "sampling_params.temperature: -Infinity",
        ),
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1e999}}', "sampling_params.temperature: 1e999"),
    ]
    for body, field in cases:
        status, text = post(engine.url, "/generate", body)
        assert status == 400 and f"{field} is not a finite number" in text, (body, text)
    status, text = post(engine.url, "/update_weights_from_disk", b'{"model_path": "x", "weight_version": NaN}')
    assert status == 400 and "weight_version: NaN is not a finite number" in text

"""The local engine (`megatron-rl serve`) against hostile or broken requests: per-endpoint body limits
(413), non-finite JSON numbers (400 naming the field), foreign shared-memory names in a tensor update,
truncated or garbage safetensors, SIGTERM during a pending group init, and no temporary folder left.
(The per-run API key of the trainer's engine is checked mid-run in tests/test_trainer.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from mrl_engine import rollout_loop

from megatron_rl.rollout.local.launcher import spawn_local_engine, start_local_engine
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


def _weights(url: str, name: str) -> list:
    async def go() -> list:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + "/get_weights_by_name", json={"name": name, "truncate_size": 4}, headers=AUTH
            ) as r:
                assert r.status == 200
                return await r.json()

    return asyncio.run(go())


@pytest.mark.e2e
def test_a_broken_safetensors_update_answers_400_naming_the_file_and_the_old_weights_serve(
    engine, model: str, tmp_path: Path
) -> None:
    import struct

    from safetensors.torch import load_file, save_file

    original = load_file(str(Path(model) / "model.safetensors"))
    changed = {name: tensor + 1.0 for name, tensor in original.items()}
    good = tmp_path / "good"
    good.mkdir()
    save_file(changed, str(good / "model.safetensors"))
    raw = (good / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    header.pop("__metadata__", None)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])  # its bytes are the ones a truncation cuts
    probe = next(iter(header))  # the first tensor read: copied first by an update that checks nothing
    broken = {
        "truncated": (raw[: len(raw) - 8], f"tensor {last!r} needs data bytes"),
        "garbage": (bytes(range(256)) * 16, "not a safetensors file"),
        "bad_entry": (struct.pack("<Q", 16) + b'{"x": 5}        ', "tensor 'x': malformed header entry"),
    }
    before = _weights(engine.url, probe)
    for name, (content, problem) in broken.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(content)
        status, text = post(engine.url, "/update_weights_from_disk", {"model_path": str(folder)})
        assert status == 400 and str(folder / "model.safetensors") in text and problem in text, (name, text)
        assert _weights(engine.url, probe) == before  # nothing was copied
    status, text = post(engine.url, "/update_weights_from_disk", {"model_path": str(good)})
    assert status == 200, text
    assert torch.equal(torch.tensor(_weights(engine.url, probe)), torch.tensor(before) + 1.0)
    status, text = post(engine.url, "/update_weights_from_disk", {"model_path": model})
    assert status == 200, text


def _group_init(url: str, port: int, timeout_s: float) -> tuple[int, str]:
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}

    async def go() -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.post(url + "/init_weights_update_group", json=body, headers=AUTH) as reply:
                return reply.status, await reply.text()

    return asyncio.run(go())


@pytest.mark.e2e
def test_sigterm_during_a_pending_group_init_and_no_temporary_folder_left(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No store listens at the group's port. With a short --group-init-timeout-s the init fails and
    says so; with a long one, SIGTERM while it waits ends the engine (exit 0) well before it would
    give up. The launcher's temporary folder (the port file) is gone as soon as the engine serves."""
    import signal
    import tempfile
    import threading

    from megatron_rl.parallel.launch import free_port

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["--threads", "1", "--group-init-timeout-s"]
    with contextlib.ExitStack() as stack:
        starting = [spawn_local_engine(model, api_key=KEY, extra_args=[*args, s], env=ENV) for s in ("2", "600")]
        for engine in starting:
            stack.callback(engine.kill)  # whatever fails below: a no-op once the engine has exited
        quick, slow = (engine.wait() for engine in starting)  # they load side by side
        assert list(tmp_path.glob("megatron-rl-serve-*")) == []
        status, text = _group_init(quick.url, free_port(), timeout_s=120)
        assert status == 400 and "Failed to initialize custom process group" in text, text
        assert "timeout" in text.lower() or "timed out" in text.lower(), text
        quick.stop()

        def wait_on_group() -> None:
            try:
                _group_init(slow.url, free_port(), 600)
            except aiohttp.ClientError:  # the server went away under the request: what SIGTERM does
                pass

        pending = threading.Thread(target=wait_on_group, daemon=True)
        pending.start()
        for _ in range(100):
            if "joining weight-update group" in slow.log_tail():
                break
            threading.Event().wait(0.1)
        assert "joining weight-update group" in slow.log_tail()
        slow.process.send_signal(signal.SIGTERM)
        assert slow.process.wait(60) == 0, slow.log_tail()  # 600 s before the store would time out
        assert "shutting down" in slow.log_tail()
        slow.stop()
    assert list(tmp_path.glob("megatron-rl-serve-*")) == []


@pytest.mark.e2e
def test_a_tensor_update_maps_only_the_shared_memory_it_announced(engine, model: str) -> None:
    """The payload's segments must be the ones the request names in shm_names: a payload that names
    another segment (here: one of a second serialisation, as a foreign process's would be) is
    refused with 400 and nothing changes; announced, the same payload updates the weights."""
    from safetensors.torch import load_file

    from megatron_rl.weight_sync import send

    original = sorted(load_file(str(Path(model) / "model.safetensors")).items())
    probe = original[0][0]
    payload, names = send.serialize_named_tensors([(n, t + 1.0) for n, t in original])
    other, other_names = send.serialize_named_tensors([(probe, torch.zeros_like(original[0][1]))])
    assert names and other_names and not set(names) & set(other_names)
    before = _weights(engine.url, probe)
    assert post(engine.url, "/begin_weight_update", {})[0] == 200
    try:
        for announced in ([], other_names, [*other_names, *names[1:]]):
            body = {"serialized_named_tensors": [payload], "shm_names": announced}
            status, text = post(engine.url, "/update_weights_from_tensor", body)
            assert status == 400 and f"shared-memory segment {names[0]!r} is not one the sender announced" in text
            assert _weights(engine.url, probe) == before
        status, text = post(
            engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "shm_names": names}
        )
        assert status == 200, text
        assert torch.equal(torch.tensor(_weights(engine.url, probe)), torch.tensor(before) + 1.0)
        restore, restore_names = send.serialize_named_tensors(original)
        body = {"serialized_named_tensors": [restore], "shm_names": restore_names}
        assert post(engine.url, "/update_weights_from_tensor", body)[0] == 200
        assert _weights(engine.url, probe) == before
    finally:
        assert post(engine.url, "/end_weight_update", {})[0] == 200


def test_config_yaml_redacts_every_key_and_a_redacted_key_is_refused(tmp_path: Path) -> None:
    from megatron_rl.config import REDACTED, SECRET_KEYS, ConfigError, load_config, to_yaml

    secrets = {key: f"secret-{i}-value" for i, key in enumerate(SECRET_KEYS)}
    teacher = ["distill.teacher_urls=[http://127.0.0.1:1]", "distill.tokenizer=/t"]  # distill.api_key's owner
    cfg = load_config(overrides=[f"{k}={v}" for k, v in secrets.items()] + teacher)
    assert cfg.rollout.api_key == secrets["rollout.api_key"]  # the run itself has the key
    text = to_yaml(cfg)
    assert not [v for v in secrets.values() if v in text] and text.count(REDACTED) == len(SECRET_KEYS)
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"rollout\.api_key = '<redacted>' is what config\.yaml writes"):
        load_config(tmp_path / "config.yaml")
    assert REDACTED not in to_yaml(load_config())  # unset keys stay null


@pytest.mark.e2e
def test_the_local_engine_gets_a_per_run_key_off_the_command_line(model: str) -> None:
    """The second engine also gets `rollout.admin_api_key`: its control endpoints then take that key alone,
    and the trainer's own control calls (the client sends the admin key there) still pass."""
    import psutil

    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.local.launcher import ADMIN_API_KEY_ENV, API_KEY_ENV

    keys = []
    for admin in (None, "the-admin-key"):
        config = RolloutConfig(admin_api_key=admin)
        with RolloutEngine.from_config(config, rollout_loop(), model, extra_args=["--threads", "1"], env=ENV) as engine:
            key = engine.client.api_key
            assert key and len(key) >= 32
            keys.append(key)
            child = psutil.Process(engine.local_process.process.pid)
            assert key not in " ".join(child.cmdline()) and child.environ()[API_KEY_ENV] == key
            assert child.environ().get(ADMIN_API_KEY_ENV) == admin
            url = engine.local_process.url
            status, _ = post(url, "/update_weights_from_disk", {"model_path": model}, {"Authorization": ""})
            assert status == 401
            control_key = admin or key
            if admin:
                assert (
                    post(url, "/update_weights_from_disk", {"model_path": model}, {"Authorization": f"Bearer {key}"})[0]
                    == 401
                )
            assert (
                post(
                    url, "/update_weights_from_disk", {"model_path": model}, {"Authorization": f"Bearer {control_key}"}
                )[0]
                == 200
            )
            engine.run(engine.client.flush_cache())  # the trainer's own call to a control endpoint
            assert key not in engine.local_process.log_tail(1000)
    assert keys[0] != keys[1]

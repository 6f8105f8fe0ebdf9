"""The LoRA bodies the client sends, read by SGLang 0.5.23's own request classes from the wheel
(`LoadLoRAAdapterReqInput`, `LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`,
msgspec Structs: every key a field, every required field there, every value of the field's type), and
/generate's `lora_path` by its generated schema; the tensors payload is what SGLang's unpickler reads."""

from __future__ import annotations

import io

import pytest
import sglang_wheel
import torch

from megatron_rl.rollout.sglang import lora_load_body, lora_tensors_body

CLASSES = ("LoadLoRAAdapterReqInput", "LoadLoRAAdapterFromTensorsReqInput", "UnloadLoRAAdapterReqInput")


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    pytest.importorskip("msgspec", reason="SGLang's request classes are msgspec Structs")
    return sglang_wheel.io_struct_classes(*CLASSES)


def test_load_and_unload_bodies_are_sglangs(classes: dict[str, type]) -> None:
    parsed = sglang_wheel.as_request(
        classes["LoadLoRAAdapterReqInput"], lora_load_body("policy-v3", "/runs/x/weights/lora-policy-v3")
    )
    assert (parsed.lora_name, parsed.lora_path, parsed.pinned) == ("policy-v3", "/runs/x/weights/lora-policy-v3", False)
    assert (
        sglang_wheel.as_request(classes["UnloadLoRAAdapterReqInput"], {"lora_name": "policy-v2"}).lora_name
        == "policy-v2"
    )
    with pytest.raises(AssertionError):  # the check does refuse a body SGLang lacks a field for
        sglang_wheel.as_request(classes["UnloadLoRAAdapterReqInput"], {"lora_name": "x", "lora_path": "/y"})


def test_tensor_body_is_sglangs_and_its_tensors_unpickle_in_sglang(
    classes: dict[str, type], monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_rl.weight_sync.send import serialize_named_tensors

    named = [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.arange(8.0).view(2, 4)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(6, 2)),
    ]
    payload, shm_names = serialize_named_tensors(named)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}
    body = {**lora_tensors_body("policy-v4", config, [payload]), "shm_names": shm_names}
    parsed = sglang_wheel.as_request(
        classes["LoadLoRAAdapterFromTensorsReqInput"], body, extra=frozenset({"shm_names"})
    )
    assert parsed.config_dict == config and parsed.load_format is None
    sglang_wheel.tensor_bucket(monkeypatch)
    loaded = sglang_wheel.safe_unpickler()(io.BytesIO(parsed.serialized_named_tensors[0])).load()
    assert [n for n, _ in loaded] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded, named, strict=True))


def test_generate_names_the_adapter_in_sglangs_schema() -> None:
    pytest.importorskip("msgspec", reason="msgspec is needed to load sglang's api_types.py")
    from megatron_rl.rollout.sglang import SGLangClient
    from megatron_rl.rollout.types import SamplingParams

    api = sglang_wheel.load_module("api/v1/api_types.py", "sglang_api_types")
    client = SGLangClient(["http://127.0.0.1:9"])
    assert "lora_path" not in client.generate_body([1, 2], SamplingParams(), "r0")
    client.lora_path = "policy-v7"
    body = client.generate_body([1, 2], SamplingParams(), "r1")
    assert body["lora_path"] == "policy-v7"
    assert api.GenerateRequest.from_json_value(body).lora_path == "policy-v7"

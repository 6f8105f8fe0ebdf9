"""The LoRA bodies the client sends, read by SGLang 0.5.23's own request classes from the wheel
(`LoadLoRAAdapterReqInput`, `LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`,
msgspec Structs: every key a field, every required field there, every value of the field's type), and
/generate's `lora_path` by its generated schema; the tensors payload is what SGLang's unpickler reads."""

from __future__ import annotations

import base64
import io

import pytest
import sglang_wheel
import torch

from megatron_rl.rollout.sglang import lora_load_body, lora_tensors_body

CLASSES = ("LoadLoRAAdapterReqInput", "LoadLoRAAdapterFromTensorsReqInput", "UnloadLoRAAdapterReqInput")


def _check(cls: type, body: dict, extra: frozenset[str] = frozenset()) -> object:
    """`body` as SGLang's struct: keys, required fields, and types (a msgspec round trip type-checks)."""
    import msgspec

    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    assert set(body) - extra <= set(fields), sorted(set(body) - set(fields))
    required = {n for n, f in fields.items() if f.required}
    assert required <= set(body), sorted(required - set(body))
    values = {k: v for k, v in body.items() if k not in extra}
    if "serialized_named_tensors" in values:  # Base64Bytes: the server decodes the strings to bytes
        values["serialized_named_tensors"] = [
            base64.b64decode(p, validate=True) for p in values["serialized_named_tensors"]
        ]
    return msgspec.json.decode(msgspec.json.encode(cls(**values)), type=cls)


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    pytest.importorskip("msgspec", reason="SGLang's request classes are msgspec Structs")
    return sglang_wheel.io_struct_classes(*CLASSES)


def test_load_and_unload_bodies_are_sglangs(classes: dict[str, type]) -> None:
    parsed = _check(classes["LoadLoRAAdapterReqInput"], lora_load_body("policy-v3", "/runs/x/weights/lora-policy-v3"))
    assert (parsed.lora_name, parsed.lora_path, parsed.pinned) == ("policy-v3", "/runs/x/weights/lora-policy-v3", False)
    assert _check(classes["UnloadLoRAAdapterReqInput"], {"lora_name": "policy-v2"}).lora_name == "policy-v2"
    with pytest.raises(AssertionError):  # the check does refuse a body SGLang lacks a field for
        _check(classes["UnloadLoRAAdapterReqInput"], {"lora_name": "x", "lora_path": "/y"})


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
    parsed = _check(classes["LoadLoRAAdapterFromTensorsReqInput"], body, extra=frozenset({"shm_names"}))
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

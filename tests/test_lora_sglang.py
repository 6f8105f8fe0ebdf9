"""The LoRA bodies the client sends, read by SGLang 0.5.23's own request classes from the wheel
(`LoadLoRAAdapterReqInput`, `LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`,
msgspec Structs: every key a field, every required field there, every value of the field's type), and
/generate's `lora_path` by its generated schema; the tensors payload is what SGLang's unpickler reads. The
target modules the trainer sends are SGLang's names, and the local engine refuses what SGLang refuses; the
rules behind refusing adapter-only sync under `fully_async` are read from the wheel too."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sglang_wheel
import torch

from megatron_rl.rollout.sglang_weights import lora_load_body, lora_tensors_body

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


def _lora_model(family: str, targets: list[str]) -> object:
    from megatron_rl.config import LoraConfig, ModelConfig

    return ModelConfig(family=family, num_experts=4, lora=LoraConfig(rank=4, target_modules=targets))


def test_target_modules_sent_are_sglangs_and_its_renamed_expert_tensors_match_them() -> None:
    from megatron_rl.models.lora_targets import LORA_TARGETS, family_module_names, sglang_target_modules
    from megatron_rl.rollout.local.lora import SGLANG_TARGET_MODULES

    supported = sglang_wheel.constant("srt/utils/common.py", "SUPPORTED_LORA_TARGET_MODULES")
    assert frozenset(supported) == SGLANG_TARGET_MODULES  # the local engine's copy is the wheel's
    normalized = sglang_wheel.function("srt/lora/utils.py", "get_normalized_target_modules")
    rename = sglang_wheel.function("srt/lora/lora.py", "_rename_expert_w_to_proj", owner="LoRAAdapter")
    for family in LORA_TARGETS:
        sent = sglang_target_modules(_lora_model(family, family_module_names(family)))
        assert set(sent) <= set(supported), (family, sent)  # what --lora-target-modules takes
        for target in LORA_TARGETS[family]:
            if not target.linear.startswith("mlp.experts"):
                continue
            (module,) = sglang_target_modules(_lora_model(family, [target.peft_name]))
            weights = {f"base_model.model.model.layers.0.{target.hf_module.format(expert=0)}.lora_A.weight": None}
            rename(None, weights)  # SGLang's own rename of the tensors it loads
            (renamed,) = weights
            assert renamed.endswith(f".experts.0.{module}.lora_A.weight"), (family, target, renamed)
    mixtral = sglang_target_modules(_lora_model("mixtral", ["q_proj", "w1", "w2", "w3"]))
    assert mixtral == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    # Mixtral's own names are no SGLang target module: an adapter naming them fits no server
    assert not normalized(["w1", "w2", "w3"]) <= normalized(supported)


def test_the_local_engine_refuses_target_modules_sglang_refuses() -> None:
    pytest.importorskip("peft")
    from megatron_rl.rollout.local.lora import AdapterError, LocalAdapters

    adapters = LocalAdapters(torch.nn.Module())
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0}
    with pytest.raises(AdapterError, match=r"target_modules \['w1'\] are not modules SGLang adapts"):
        adapters.load("policy-v1", {**config, "target_modules": ["q_proj", "w1"]}, {})
    with pytest.raises(AdapterError, match=r"as a string only 'all' or 'all-linear'"):
        adapters.load("policy-v1", {**config, "target_modules": "w1"}, {})
    with pytest.raises(AdapterError) as passed:  # SGLang's names pass on to PEFT (here: no such module)
        adapters.load("policy-v1", {**config, "target_modules": ["model.layers.0.self_attn.q_proj"]}, {})
    assert "SGLang" not in str(passed.value) and not adapters.loaded


def test_sglang_relabels_every_running_request_and_unloads_an_adapter_only_when_unused() -> None:
    """Why `rollout.lora_sync = adapter` is refused with `fully_async` (`lora_targets.check_lora_sync`)."""
    import types

    # with WeightVersionEvent(old_version, num_output_tokens) as a plain record
    scope = {"Req": object, "WeightVersionEvent": types.SimpleNamespace}
    record = sglang_wheel.function("srt/utils/weight_versions.py", "record_weight_version_events", namespace=scope)
    running = [types.SimpleNamespace(lora_id=lora, output_ids=[1, 2], weight_version_events=[]) for lora in "ab"]
    assert record(running, old_version="1") == 2  # every running request, whatever adapter it runs
    assert [r.weight_version_events[0].old_version for r in running] == ["1", "1"]
    change = sglang_wheel.function_source("srt/managers/scheduler.py", "record_weight_version_change", "Scheduler")
    assert "record_weight_version_events(live_reqs" in change and "lora" not in change
    unload = sglang_wheel.function_source(
        "srt/managers/tokenizer_control_mixin.py", "_unload_lora_adapter_locked", "TokenizerControlMixin"
    )
    assert "self.lora_update_lock.locked()" in unload and "await self.lora_registry.wait_for_unload(lora_id)" in unload


def test_adapter_sync_sends_sglangs_target_module_names(world_of_one: None, tmp_path: Path) -> None:
    import types

    from megatron_rl.config import Config, RolloutConfig
    from megatron_rl.weight_sync.lora import AdapterSync

    model = _lora_model("mixtral", ["q_proj", "w1", "w2", "w3"])
    cfg = Config(model=model, rollout=RolloutConfig(sync_dir=str(tmp_path)))  # type: ignore[arg-type]
    actor = types.SimpleNamespace(lora=object(), chunks=[])
    sync = AdapterSync(cfg, types.SimpleNamespace(client=None), actor)  # type: ignore[arg-type]
    assert sync.config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]

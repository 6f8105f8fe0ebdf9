"""The PEFT round trip of a LoRA run's export, in this process (a world of one): a dense Qwen3 policy
with adapters on every module (q, k, v, o, gate, up, down), exported as the run folder does, RUN_DIR/hf/
(merged) and RUN_DIR/hf_adapter/ (PEFT), read by transformers and peft.

Dense here; the local engine's test (tests/test_lora_local_moe.py) serves MoE expert adapters through
peft's fused-expert layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.config import Config, LoraConfig, TrainConfig, preset

from mrl_configs import actor_of_one, layout, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def actor() -> Iterator[object]:
    model = dataclasses.replace(tiny_model("qwen3"), lora=LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS))
    with actor_of_one(
        Config(model=model, parallel=layout(), algorithm=preset("grpo"), train=TrainConfig(seed=4))
    ) as actor:
        yield actor


def test_exported_adapter_loads_in_peft_on_the_base_with_the_merged_logits(actor, tmp_path) -> None:  # noqa: ANN001
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from megatron_rl.actor.adapters import save_adapter_folder
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.hf_config import hf_config_from_model
    from megatron_rl.models.lora import gather_adapters, load_adapters, merged_weights

    model = actor.cfg.model
    gen = torch.Generator().manual_seed(7)
    adapters = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in gather_adapters(actor.lora).items()}
    assert len(adapters) == 2 * 7 * model.num_layers
    load_adapters(actor.lora, adapters)
    for name in ("base", "hf"):
        (tmp_path / name).mkdir()
    save_hf_folder(actor.chunks, model, tmp_path / "base", hf_config_from_model(model))
    with merged_weights(actor.lora):
        save_hf_folder(actor.chunks, model, tmp_path / "hf", hf_config_from_model(model))
    save_adapter_folder(actor, tmp_path / "hf_adapter", str(tmp_path / "base"))
    config = (tmp_path / "hf_adapter" / "adapter_config.json").read_text()
    assert f'"base_model_name_or_path": "{tmp_path / "base"}"' in config
    ids = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        base_logits = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "hf_adapter").eval()
        peft_logits = adapted(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapters change the model
    gap = (peft_logits - merged_logits).abs().max().item()
    assert gap <= 1e-5, gap

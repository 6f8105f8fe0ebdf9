"""DeepSeek-V3 and GLM-4.5 in one process: config.json -> `model` (published configs, every refusal naming
its field), the way back, the name/shape table against what `transformers` writes, HF -> Megatron -> HF
tensors bit for bit through the mapping, transformers 5's fused experts, MTP layers, TransformerConfig.
(Megatron forward == transformers forward and the layouts: tests/test_models_distributed.py and
tests/test_convert_distributed.py.)"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from presets import DEEPSEEK_V3_671B, GLM_45_355B
from presets import KIMI_K2 as KIMI_K2_CONFIG
from safetensors.torch import load_file, save_file

from megatron_rl.config import ConfigError, ParallelConfig
from megatron_rl.models.builder import transformer_config
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_config_sigmoid import mtp_dropped_config
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import (
    SIGMOID_FAMILIES,
    hf_config,
    hf_config_json,
    megatron_names,
    save_random_hf_model,
    tiny_sigmoid_model,
    with_key,
)

# Published config.json files (slurm/presets.py; the bf16 releases: no quantization_config), with the
# bookkeeping keys the Hub files also hold, which the mapping must accept.
_BOOKKEEPING = {
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "transformers_version": "4.33.1",
    "use_cache": True,
}
DEEPSEEK_V3: dict[str, Any] = {
    **DEEPSEEK_V3_671B, **_BOOKKEEPING, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "seq_aux": True,
}  # fmt: skip
KIMI_K2: dict[str, Any] = {**KIMI_K2_CONFIG, **_BOOKKEEPING}
GLM_45: dict[str, Any] = {**GLM_45_355B, **_BOOKKEEPING, "pad_token_id": 151329, "eos_token_id": [151329, 151336]}


def test_deepseek_v3_config() -> None:
    m = model_config_from_hf(DEEPSEEK_V3)
    assert (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        "deepseek_v3",
        61,
        7168,
        128,
        128,
    )
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.first_k_dense_layers) == (256, 8, 2048, 3)
    assert (m.moe_shared_expert_size, m.moe_router_num_groups, m.moe_router_group_topk) == (2048, 8, 4)
    assert m.moe_router_scaling_factor == 2.5 and m.moe_router_norm_topk and m.freeze_expert_bias
    assert (m.rope_scaling, m.yarn_factor, m.yarn_original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert (m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_mscale, m.yarn_mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)
    assert (m.rope_theta, m.params_dtype, m.qk_layernorm, m.add_qkv_bias) == (10000.0, "bf16", True, False)


def test_kimi_k2_and_glm_45_configs() -> None:
    k = model_config_from_hf(KIMI_K2)
    assert (k.num_experts, k.moe_router_num_groups, k.moe_router_group_topk) == (384, None, None)  # one group
    assert (k.moe_router_scaling_factor, k.yarn_factor, k.yarn_beta_fast, k.rope_theta) == (2.827, 32.0, 1.0, 5e4)
    g = model_config_from_hf(GLM_45)
    assert (g.family, g.num_layers, g.num_attention_heads, g.num_query_groups, g.kv_channels) == (
        "glm4_moe",
        92,
        96,
        8,
        128,
    )
    assert (g.add_qkv_bias, g.qk_layernorm, g.rotary_percent, g.rope_scaling) == (True, True, 0.5, "none")
    assert (g.num_experts, g.moe_shared_expert_size, g.first_k_dense_layers, g.moe_router_scaling_factor) == (
        160,
        1536,
        3,
        2.5,
    )


@pytest.mark.parametrize(
    ("base", "path", "value", "needle"),
    [
        (DEEPSEEK_V3, "quantization_config", {"quant_method": "fp8"}, "quantization_config is not handled"),
        (DEEPSEEK_V3, "index_topk", 2048, "index_topk is not handled by the deepseek_v3 mapping"),
        (DEEPSEEK_V3, "rope_scaling.extrapolation_factor", 1.0, "rope_scaling.extrapolation_factor is not handled"),
        (DEEPSEEK_V3, "rope_scaling.mscale", ..., "rope_scaling.mscale_all_dim = 1.0 without mscale"),
        (DEEPSEEK_V3, "rope_scaling.type", "longrope", "rope_type = 'longrope' is not supported"),
        (DEEPSEEK_V3, "rope_scaling.truncate", False, "rope_scaling.truncate = False"),
        (DEEPSEEK_V3, "norm_topk_prob", False, "norm_topk_prob = false"),
        (DEEPSEEK_V3, "topk_method", "greedy", "topk_method = 'greedy'"),
        (GLM_45, "num_experts_per_tok", 1, "norm_topk_prob = true with num_experts_per_tok = 1"),
        (DEEPSEEK_V3, "scoring_func", "softmax", "scoring_func = 'softmax'"),
        (DEEPSEEK_V3, "topk_group", 2, "num_experts_per_tok // topk_group = 8 // 2 must be 2"),
        (DEEPSEEK_V3, "moe_layer_freq", 2, "moe_layer_freq = 2"),
        (DEEPSEEK_V3, "attention_bias", True, "attention_bias = true is not supported for deepseek_v3"),
        (DEEPSEEK_V3, "rope_interleave", False, "rope_interleave = false"),
        (DEEPSEEK_V3, "first_k_dense_replace", 61, "first_k_dense_replace = 61 leaves no MoE layer"),
        (DEEPSEEK_V3, "n_group", 7, "model.moe_router_num_groups (7) must split model.num_experts (256)"),
        (GLM_45, "rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
         "rope_type = 'yarn' is only supported for deepseek_v3"),
        (GLM_45, "use_sliding_window", False, "use_sliding_window is not handled by the glm4_moe mapping"),
        (GLM_45, "hidden_act", "gelu", "hidden_act = 'gelu'"),
        (GLM_45, "q_lora_rank", 8, "q_lora_rank is not handled by the glm4_moe mapping"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(base: dict[str, Any], path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(base, path, value))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_sigmoid_switches_are_refused_elsewhere() -> None:
    from megatron_rl.models.families import check_family

    from mrl_configs import tiny_model

    with pytest.raises(ConfigError, match="qwen3_moe' has no model.moe_shared_expert_size"):
        check_family(tiny_model("qwen3_moe", moe_shared_expert_size=64))
    with pytest.raises(
        ConfigError, match=r"rope_scaling = .yarn. is only supported for deepseek_v3 \(MLA\) and gpt_oss"
    ):
        check_family(tiny_model("qwen3_moe", rope_scaling="yarn"))


@pytest.mark.parametrize("family", SIGMOID_FAMILIES)
def test_config_round_trip_and_transformers_reads_it(family: str) -> None:
    model = tiny_sigmoid_model(family)
    hf = hf_config_from_model(model)
    again = model_config_from_hf(hf, params_dtype="fp32")
    assert again == model
    cls = {"deepseek_v3": transformers.DeepseekV3Config, "glm4_moe": transformers.Glm4MoeConfig}[family]
    config = cls(**hf)
    assert config.num_nextn_predict_layers == 0 and config.n_group == (model.moe_router_num_groups or 1)
    assert transformers.AutoModelForCausalLM.from_config(config).config.routed_scaling_factor == (
        model.moe_router_scaling_factor
    )


@pytest.mark.parametrize(("family", "extra"), [("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": None}),
                                               ("deepseek_v3", {"n_shared_experts": 0}), ("glm4_moe", {}),
                                               ("glm4_moe", {"use_qk_norm": False}),
                                               ("glm4_moe", {"n_shared_experts": 0})])  # fmt: skip
def test_names_shapes_and_tensors_round_trip(tmp_path: Path, family: str, extra: dict[str, Any]) -> None:
    """The table is exactly what save_pretrained writes (names, shapes; the bias as fp32), and
    HF -> Megatron -> HF through the mapping gives every tensor back bit for bit. Without shared experts
    (n_shared_experts = 0) transformers writes them 0 wide: no Megatron parameter, skipped on import
    (the export writes them again: tests/test_convert_distributed.py)."""
    folder = save_random_hf_model(tmp_path / family, hf_config(family, "small", **extra), seed=2)
    model = tiny_sigmoid_model(family, hf=hf_config_json(family, "small", **extra))
    mapping = HFMapping(model)
    ckpt = open_hf_checkpoint(str(folder), model)
    assert ckpt.shapes == mapping.expected_hf_shapes()
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert ckpt.dtypes[bias] == "F32" and ckpt.read(bias).abs().min() > 0  # non-zero expert bias
    original = load_file(folder / "model.safetensors")
    back: dict[str, torch.Tensor] = {}
    for name in megatron_names(mapping):
        hf_names = mapping.hf_names(name)
        shape = list(ckpt.shapes[hf_names[0]])
        shape[0] = sum(ckpt.shapes[n][0] for n in hf_names) if len(hf_names) > 1 else shape[0]
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            shape[0] = 384  # Megatron's padded vocabulary
        full = mapping.to_megatron(name, ckpt.read, shape)
        for hf_name, tensor in mapping.to_hf(name, full):
            assert hf_name not in back, hf_name
            back[hf_name] = tensor
    empty = mapping.empty_hf_shapes()
    assert bool(empty) == (extra.get("n_shared_experts") == 0), empty
    assert {name: tuple(original[name].shape) for name in empty} == empty  # what transformers wrote
    assert set(back) == set(original) - set(empty)
    for name, tensor in back.items():
        assert original[name].dtype == tensor.dtype and torch.equal(original[name], tensor), name


def test_fused_experts_folder_reads_as_per_expert_tensors(tmp_path: Path) -> None:
    """A folder holding transformers 5's fused experts (as a model's state_dict has them) imports
    with exactly the tensors of the per-expert folder."""
    family = "glm4_moe"
    per_expert = save_random_hf_model(tmp_path / "per_expert", hf_config(family, "small"), seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(per_expert)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors")
    model = tiny_sigmoid_model(family, hf=hf_config_json(family, "small"))
    a, b = open_hf_checkpoint(str(per_expert), model), open_hf_checkpoint(str(fused), model)
    assert a.shapes == b.shapes
    for name in a.shapes:
        assert torch.equal(a.read(name), b.read(name)), name


def test_mtp_layers_are_dropped_on_import_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note is a warning (the training console shows warnings, not INFO), once per folder and process
    (the actor, then the reference, open the same folder), on the launch's rank 0 only."""
    family = "deepseek_v3"
    folder = save_random_hf_model(tmp_path / family, hf_config(family, "small", num_nextn_predict_layers=1), seed=1)
    tensors = load_file(folder / "model.safetensors")
    layers = hf_config(family, "small").num_hidden_layers
    mtp = {k.replace("layers.1.", f"layers.{layers}."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(32, 64)
    save_file({**tensors, **mtp}, folder / "model.safetensors")
    model = tiny_sigmoid_model(family, hf=hf_config_json(family, "small"))
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="megatron_rl.models.import_hf"):
        open_hf_checkpoint(str(folder), model)  # another rank: no note
        monkeypatch.setenv("RANK", "0")
        ckpt = open_hf_checkpoint(str(folder), model)
        open_hf_checkpoint(str(folder), model)  # the same folder again: no second note
    assert not any(f"layers.{layers}." in n for n in ckpt.shapes)
    notes = [r for r in caplog.records if "MTP" in r.getMessage()]
    assert len(notes) == 1 and f"{len(mtp)} tensors of layers {layers}..{layers}" in notes[0].getMessage(), notes
    assert notes[0].levelno == logging.WARNING
    assert mtp_dropped_config({"num_nextn_predict_layers": 1, "a": 2}) == {"num_nextn_predict_layers": 0, "a": 2}
    extra = tmp_path / "extra"  # a layer beyond the MTP count is still refused
    extra.mkdir()
    (extra / "config.json").write_text((folder / "config.json").read_text().replace('"num_nextn_predict_layers": 1',
                                                                                    '"num_nextn_predict_layers": 0'))  # fmt: skip
    save_file({**tensors, **mtp}, extra / "model.safetensors")
    with pytest.raises(ConversionError, match="num_hidden_layers"):
        open_hf_checkpoint(str(extra), model)
    assert isinstance(HFCheckpoint(folder), HFCheckpoint)


def test_transformer_configs() -> None:
    deepseek = transformer_config(tiny_sigmoid_model("deepseek_v3"), ParallelConfig())
    assert type(deepseek).__name__ == "MLATransformerConfig" and deepseek.multi_latent_attention
    assert (deepseek.q_lora_rank, deepseek.kv_lora_rank, deepseek.qk_head_dim, deepseek.qk_pos_emb_head_dim) == (
        22,
        18,
        10,
        6,
    )
    assert (deepseek.v_head_dim, deepseek.rope_type, deepseek.rotary_scaling_factor) == (14, "yarn", 4.0)
    assert (deepseek.original_max_position_embeddings, deepseek.mscale, deepseek.mscale_all_dim) == (16, 1.0, 1.0)
    assert (deepseek.moe_router_score_function, deepseek.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert deepseek.moe_router_bias_update_rate == 0.0  # frozen by default
    assert (deepseek.moe_router_num_groups, deepseek.moe_router_group_topk) == (4, 2)
    assert (deepseek.moe_router_topk_scaling_factor, deepseek.moe_shared_expert_intermediate_size) == (2.5, 48)
    assert deepseek.moe_layer_freq == [0, 1, 1, 1] and not deepseek.moe_router_pre_softmax
    glm = transformer_config(tiny_sigmoid_model("glm4_moe", freeze_expert_bias=False), ParallelConfig())
    assert type(glm).__name__ == "TransformerConfig" and glm.add_qkv_bias and glm.qk_layernorm
    assert glm.moe_router_bias_update_rate == 1e-3 and glm.moe_router_group_topk is None
    assert glm.moe_router_topk_scaling_factor == 1.8 and glm.moe_shared_expert_intermediate_size == 20


def test_mla_latent_widths_must_split_over_tp() -> None:
    from megatron_rl.config import Config, validate

    from mrl_configs import layout

    model = tiny_sigmoid_model("deepseek_v3", kv_lora_rank=19)
    with pytest.raises(ConfigError, match=r"must divide model.kv_lora_rank \+ model.qk_rope_head_dim \(25\)"):
        validate(Config(model=model, parallel=layout(tp=2)))
    validate(Config(model=model, parallel=layout()))

"""HF <-> Megatron conversion pieces in one process: config derivation, the name/shape table against
what `transformers` writes, the tensor rules on hand-built tensors, and every bad-input error.
(Conversions across layouts: tests/test_convert_distributed.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ModelConfig
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import QWEN3_30B_A3B, tiny_model

# Published config.json files (abridged to the keys that matter; Qwen3-30B-A3B's: tests/mrl_configs.py).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def test_qwen3_moe_hub_config() -> None:
    model = model_config_from_hf(QWEN3_30B_A3B)
    expected = ModelConfig(
        family="qwen3_moe",
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,  # 32 x 128 != 2048: explicit
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1e6,
        norm_epsilon=1e-6,
        qk_layernorm=True,
        add_qkv_bias=False,
        tie_word_embeddings=False,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        moe_layer_freq=1,
        first_k_dense_layers=0,
        moe_router_norm_topk=True,
        params_dtype="bf16",
    )
    assert model == expected


def test_mixtral_and_qwen2_hub_configs() -> None:
    mixtral = model_config_from_hf(MIXTRAL_8X7B)
    assert (mixtral.family, mixtral.num_experts, mixtral.moe_router_topk) == ("mixtral", 8, 2)
    assert (mixtral.ffn_hidden_size, mixtral.moe_ffn_hidden_size, mixtral.moe_router_norm_topk) == (14336, 14336, True)
    assert (mixtral.kv_channels, mixtral.num_query_groups, mixtral.norm_epsilon) == (None, 8, 1e-5)
    assert (mixtral.qk_layernorm, mixtral.add_qkv_bias) == (False, False)
    qwen2 = model_config_from_hf(QWEN2_7B)
    assert (qwen2.family, qwen2.num_experts, qwen2.add_qkv_bias, qwen2.qk_layernorm) == ("qwen2", None, True, False)
    assert (qwen2.vocab_size, qwen2.ffn_hidden_size, qwen2.num_query_groups) == (152064, 18944, 4)


def test_transformers_5_config_spellings() -> None:
    """transformers 5 saves rope_parameters, num_local_experts (Qwen3-MoE) and dtype."""
    config = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=3,
        mlp_only_layers=[0, 1],
        decoder_sparse_step=1,
        rope_theta=5000.0,
        dtype="float32",
    ).to_dict()
    assert "rope_parameters" in config and "rope_theta" not in config
    model = model_config_from_hf(config)
    assert (model.num_experts, model.moe_router_topk, model.first_k_dense_layers) == (6, 3, 2)
    assert (model.rope_theta, model.params_dtype, model.kv_channels) == (5000.0, "fp32", None)


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"architectures": ["PhiForCausalLM"]}, "PhiForCausalLM"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration.*vision-language"),
        ({"architectures": None}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"mlp_only_layers": [1, 3]}, "mlp_only_layers"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 5}, "num_query_groups"),
    ],
)
def test_unsupported_configs(change: dict, culprit: str) -> None:
    with pytest.raises(ConversionError, match=culprit):
        model_config_from_hf({**QWEN3_30B_A3B, **change}, source="x/config.json")


FAMILIES = ["qwen3_moe", "mixtral", "qwen3", "qwen2", "llama", "mistral"]


def _family_model(family: str) -> ModelConfig:
    """Tiny models; dense ones keep the MoE fields at their defaults (config.json has none)."""
    if family == "mixtral":
        return tiny_model("mixtral", ffn_hidden_size=32, moe_ffn_hidden_size=32, num_layers=2)
    if family == "qwen3":
        return tiny_model("qwen3", tie_word_embeddings=True, num_layers=2, moe_ffn_hidden_size=128)
    if family == "qwen2":
        return tiny_model("qwen2", num_layers=2, kv_channels=24, moe_ffn_hidden_size=128)
    if family == "llama":
        return tiny_model(
            "llama", num_layers=2, kv_channels=24, rope_scaling="llama3", llama3_factor=4.0, moe_ffn_hidden_size=128
        )
    if family == "mistral":
        return tiny_model("mistral", num_layers=2, tie_word_embeddings=True, rope_theta=1e6, moe_ffn_hidden_size=128)
    return tiny_model("qwen3_moe", num_layers=3, kv_channels=24)  # head_dim x heads != hidden


def _save_transformers_model(folder: Path, hf: dict, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_mapping_matches_what_transformers_writes(tmp_path: Path, family: str) -> None:
    """hf_config_from_model -> transformers builds and saves the model; its checkpoint holds exactly the
    names and shapes of the mapping's table, and its config.json gives the same ModelConfig back."""
    model = _family_model(family)
    folder = _save_transformers_model(tmp_path / family, hf_config_from_model(model))
    ckpt = HFCheckpoint(folder)
    assert ckpt.shapes == HFMapping(model).expected_hf_shapes()
    saved = json.loads((folder / "config.json").read_text())
    assert model_config_from_hf(saved) == model
    open_hf_checkpoint(str(folder), model)  # passes every check


def test_qkv_rows_are_grouped_per_kv_head() -> None:
    """4 heads, 2 KV groups, head_dim 1: Megatron rows [q0 q1 k0 v0 q2 q3 k1 v1]."""
    model = tiny_model("qwen2", hidden_size=4, num_attention_heads=4, num_query_groups=2, num_layers=1)
    mapping = HFMapping(model)
    qkv = torch.tensor([10.0, 11, 20, 30, 12, 13, 21, 31]).unsqueeze(1).repeat(1, 4)
    out = dict(mapping.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", qkv))
    assert out["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == [10, 11, 12, 13]
    assert out["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == [20, 21]
    assert out["model.layers.0.self_attn.v_proj.weight"][:, 0].tolist() == [30, 31]
    bias = dict(mapping.to_hf("decoder.layers.0.self_attention.linear_qkv.bias", qkv[:, 0]))
    assert bias["model.layers.0.self_attn.k_proj.bias"].tolist() == [20, 21]
    back = mapping.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", out.__getitem__, (8, 4))
    assert torch.equal(back, qkv)


def test_gate_up_experts_and_vocab_rules() -> None:
    model = tiny_model("mixtral", vocab_size=5, num_layers=2, num_experts=4)
    mapping = HFMapping(model)
    fc1 = torch.arange(12.0).reshape(6, 2)
    out = mapping.to_hf("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", fc1)
    assert [n for n, _ in out] == [
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    ]
    assert torch.equal(out[0][1], fc1[:3]) and torch.equal(out[1][1], fc1[3:])
    assert out[0][1].data_ptr() == fc1.data_ptr()  # views: no copy on export
    router = mapping.hf_names("decoder.layers.0.mlp.router.weight")
    assert router == ("model.layers.0.block_sparse_moe.gate.weight",)
    padded = torch.cat([torch.ones(5, 2), torch.full((3, 2), 7.0)])  # 3 padding rows
    ((name, trimmed),) = mapping.to_hf("output_layer.weight", padded)
    assert name == "lm_head.weight" and torch.equal(trimmed, torch.ones(5, 2))
    repadded = mapping.to_megatron("output_layer.weight", lambda n: torch.ones(5, 2), (8, 2))
    assert torch.equal(repadded[5:], torch.zeros(3, 2)) and torch.equal(repadded[:5], torch.ones(5, 2))


def test_safetensors_io_agrees_with_the_library(tmp_path: Path) -> None:
    """Files written from views (shared memory, mixed dtypes) read the same with `safetensors`, and
    files the library writes read the same here, as views of the mapped file."""
    from megatron_rl.models.safetensors_io import MappedSafetensors, write_safetensors

    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    tensors = {
        "gate": base[:3],
        "up": base[3:],
        "half": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "odd": torch.tensor([7], dtype=torch.int16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = load_file(tmp_path / "ours.safetensors")
    assert set(theirs) == set(tensors)
    for name, value in tensors.items():
        assert theirs[name].dtype == value.dtype and torch.equal(theirs[name], value), name
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "lib.safetensors")
    mapped = MappedSafetensors(tmp_path / "lib.safetensors")
    for name, value in tensors.items():
        got = mapped.get(name)
        assert got.dtype == value.dtype and torch.equal(got, value), name


def test_unknown_megatron_parameter() -> None:
    mapping = HFMapping(tiny_model("qwen3"))
    with pytest.raises(ConversionError, match=r"decoder\.layers\.0\.mlp\.router\.weight"):
        mapping.hf_names("decoder.layers.0.mlp.router.weight")  # qwen3 is dense
    with pytest.raises(ConversionError, match="lm_head|output_layer"):
        HFMapping(tiny_model("qwen3", tie_word_embeddings=True)).hf_names("output_layer.weight")


# --- a real checkpoint with one defect each ---------------------------------------------------


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    model = _family_model("qwen3_moe")
    return _save_transformers_model(tmp_path_factory.mktemp("hf") / "moe", hf_config_from_model(model)), model


def _tampered(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:  # noqa: ANN001
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if edit_config is not None:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _open(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    open_hf_checkpoint(str(folder), model_config_from_hf(config))


def test_missing_tensor(moe_folder: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    name = "model.layers.2.self_attn.k_proj.weight"
    folder = _tampered(moe_folder[0], tmp_path / "x", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ConversionError, match=f"missing tensor '{name}'"):
        _open(folder)


def test_unexpected_tensor(moe_folder: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    name = "model.layers.1.mlp.shared_expert.up_proj.weight"
    folder = _tampered(moe_folder[0], tmp_path / "x", edit_tensors=lambda t: t.update({name: torch.zeros(2, 2)}))
    with pytest.raises(ConversionError, match=f"unexpected tensor '{name}'"):
        _open(folder)


def test_shape_mismatch(moe_folder: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    name = "model.layers.2.mlp.experts.1.down_proj.weight"  # [hidden 64, expert width 32]

    def edit(tensors: dict) -> None:
        tensors[name] = torch.zeros(64, 30)

    folder = _tampered(moe_folder[0], tmp_path / "x", edit_tensors=edit)
    with pytest.raises(ConversionError, match=rf"'{name}' has shape \[64, 30\].*expects \[64, 32\]"):
        _open(folder)


def test_tied_embeddings_with_a_stored_copy(tmp_path: Path) -> None:
    """A tied model whose file also holds lm_head.weight: accepted when it equals the embedding."""
    model = _family_model("qwen3")
    src = _save_transformers_model(tmp_path / "tied", hf_config_from_model(model))

    def add_head(same: bool) -> Path:
        def edit(tensors: dict) -> None:
            embed = tensors["model.embed_tokens.weight"]
            tensors["lm_head.weight"] = embed.clone() if same else embed + 1

        return _tampered(src, tmp_path / f"head-{same}", edit_tensors=edit)

    assert "lm_head.weight" not in open_hf_checkpoint(str(add_head(True)), model).shapes
    with pytest.raises(ConversionError, match="tie_word_embeddings = true contradicts the checkpoint"):
        open_hf_checkpoint(str(add_head(False)), model)


@pytest.mark.parametrize(
    "key, value, evidence",
    [
        ("num_hidden_layers", 2, "layers 0..2"),
        ("hidden_size", 96, r"model\.embed_tokens\.weight has shape \[300, 64\]"),
        ("num_experts", 8, "experts 0..3"),
        ("moe_intermediate_size", 64, r"experts\.0\.gate_proj\.weight has shape \[32, 64\]"),
        ("vocab_size", 256, r"model\.embed_tokens\.weight has shape \[300, 64\]"),
        ("head_dim", 16, r"q_proj\.weight has shape \[96, 64\]"),
    ],
)
def test_config_contradicting_checkpoint(
    moe_folder: tuple[Path, ModelConfig], tmp_path: Path, key: str, value: int, evidence: str
) -> None:
    folder = _tampered(moe_folder[0], tmp_path / "x", edit_config=lambda c: c.update({key: value}))
    with pytest.raises(
        ConversionError, match=rf"config\.json: [^=]*{key} = .*contradicts the checkpoint: .*{evidence}"
    ):
        _open(folder)


def test_cli_errors(moe_folder: tuple[Path, ModelConfig], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`megatron-rl convert` and the tools print one error line and exit 2, before any model exists."""
    from megatron_rl.commands.convert import main as tool_main

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(moe_folder[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and "--force" in err[0], err
    assert (out / "keep.txt").exists()

    phi = _tampered(moe_folder[0], tmp_path / "phi", edit_config=lambda c: c.update(architectures=["PhiForCausalLM"]))
    assert tool_main("hf-to-megatron", ["--hf-dir", str(phi), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PhiForCausalLM" in err[0] and "Qwen3MoeForCausalLM" in err[0], err

    assert tool_main("megatron-to-hf", ["--ckpt", str(moe_folder[0]), "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Megatron distributed checkpoint" in err[0], err

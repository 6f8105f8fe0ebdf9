"""Stream a Hugging Face checkpoint into this rank's Megatron parameters, tensor by tensor.

    hf = read_hf_config(folder); model = model_config_from_hf(hf)
    ckpt = open_hf_checkpoint(folder, hf, model)       # validated from headers only
    ... init_distributed, build_model ...
    load_hf_weights(chunks, model, ckpt)               # each rank reads only what its shards need

Validation happens before any Megatron state exists, so bad input fails fast and names the
culprit: a config.json value the tensors contradict (key, both values, the tensor), then a
missing or unexpected tensor (name), then a wrong shape (name and both shapes).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl.config import MLA_FAMILIES, ModelConfig
from megatron_rl.models.hf_config import ConversionError, hf_int, read_hf_config
from megatron_rl.models.hf_config_sigmoid import SIGMOID_FAMILIES
from megatron_rl.models.hf_io import HFCheckpoint, check_tensors
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.init import ParamShard, iter_param_shards, take_shard
from megatron_rl.parallel.launch import launch_rank

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_MTP_NOTED: set[str] = set()  # folders whose MTP note this process gave (the actor's, then the reference's)


def _contradiction(source: str, key: str, config_value: Any, evidence: str) -> ConversionError:
    return ConversionError(f"{source}: {key} = {config_value} contradicts the checkpoint: {evidence}")


def check_config_against_checkpoint(
    model: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str = "config.json"
) -> None:
    """Raise ConversionError when a config.json value disagrees with the tensors' names or shapes."""
    mapping = HFMapping(model)
    dims = mapping.dims

    def shape_check(key: str, value: int, name: str, dim: int, config_text: str | None = None) -> None:
        shape = shapes.get(name)
        if shape is not None and len(shape) > dim and shape[dim] != value:
            raise _contradiction(source, key, config_text or value, f"{name} has shape {list(shape)}")

    shape_check("vocab_size", dims["V"], "model.embed_tokens.weight", 0)
    shape_check("hidden_size", dims["H"], "model.embed_tokens.weight", 1)
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    if layers and max(layers) + 1 != model.num_layers:
        raise _contradiction(
            source, "num_hidden_layers", model.num_layers, f"it has layers {min(layers)}..{max(layers)}"
        )
    if model.family in MLA_FAMILIES:
        shape_check("q_lora_rank", dims["QA"], "model.layers.0.self_attn.q_a_proj.weight", 0)
        shape_check("kv_lora_rank", dims["KVL"], "model.layers.0.self_attn.kv_a_layernorm.weight", 0)
        heads = f"{model.num_attention_heads} x (qk_nope_head_dim + qk_rope_head_dim)"
        shape_check("num_attention_heads", dims["QH"], "model.layers.0.self_attn.q_b_proj.weight", 0, heads)
        shape_check("num_attention_heads", dims["QH"], "model.layers.0.self_attn.q_proj.weight", 0, heads)
        wq_b = "model.layers.0.self_attn.indexer.wq_b.weight"
        shape_check("index_n_heads x index_head_dim", dims["IQ"], wq_b, 0, f"{dims['IN']} x {dims['ID']}")
    else:
        heads = f"{model.num_attention_heads} x {mapping.head_dim}"
        shape_check("num_attention_heads x head_dim", dims["Q"], "model.layers.0.self_attn.q_proj.weight", 0, heads)
        kv = f"{model.num_query_groups} x {mapping.head_dim}"
        shape_check("num_key_value_heads x head_dim", dims["KV"], "model.layers.0.self_attn.k_proj.weight", 0, kv)
        if model.family == "minimax_m2":  # its QK-norm spans the whole projection
            shape_check("num_attention_heads x head_dim", dims["Q"], "model.layers.0.self_attn.q_norm.weight", 0, heads)
        else:
            shape_check("head_dim", dims["D"], "model.layers.0.self_attn.q_norm.weight", 0)
    if model.tie_word_embeddings and "lm_head.weight" in shapes:
        raise _contradiction(source, "tie_word_embeddings", "true", "it has an lm_head.weight unlike the embedding")
    dense = [i for i, moe in enumerate(mapping.moe_layers) if not moe]
    if dense and model.family != "mixtral":
        shape_check("intermediate_size", dims["F"], f"model.layers.{dense[0]}.mlp.gate_proj.weight", 0)
    if model.num_experts is None:
        return
    first_moe = mapping.moe_layers.index(1)
    found = {int(m.group(2)) for n in shapes if (m := _EXPERT.match(n)) and int(m.group(1)) == first_moe}
    key = "num_local_experts" if model.family in ("mixtral", "minimax_m2", "gpt_oss") else "num_experts"
    key = "n_routed_experts" if model.family in SIGMOID_FAMILIES else key
    if found and max(found) + 1 != model.num_experts:
        raise _contradiction(source, key, model.num_experts, f"layer {first_moe} has experts 0..{max(found)}")
    if model.family in SIGMOID_FAMILIES:
        shared = f"model.layers.{first_moe}.mlp.shared_experts.gate_proj.weight"
        shape_check("n_shared_experts x moe_intermediate_size", dims["S"], shared, 0)
    width = "intermediate_size" if model.family in ("mixtral", "minimax_m2", "gpt_oss") else "moe_intermediate_size"
    gate = mapping.hf_names(f"decoder.layers.{first_moe}.mlp.experts.local_experts.0.linear_fc1.weight")[0]
    if model.family == "gpt_oss":  # [hidden, 2 x width]: stored transposed, gate and up interleaved
        shape_check(width, dims["2M"], gate, 1, f"{dims['M']} (x 2 columns)")
    else:
        shape_check(width, dims["M"], gate, 0)


def open_hf_checkpoint(
    folder: str, model: ModelConfig, source: str | None = None, head: dict[str, tuple[int, ...]] | None = None
) -> HFCheckpoint:
    """The checkpoint of `folder`, checked against `model` from the headers. (The one tensor ever
    read: an lm_head.weight stored next to tied embeddings, ignored when it equals them.) `head`: the
    tensors and shapes the folder holds in place of lm_head.weight (a token-classification model's
    score.weight and score.bias: the critic's value model)."""
    ckpt = HFCheckpoint(folder)
    ckpt.split_fused_experts(model.family)
    _drop_mtp_layers(ckpt, model, read_hf_config(folder))
    for name, shape in HFMapping(model).empty_hf_shapes().items():  # n_shared_experts = 0: nothing to load
        if ckpt.shapes.get(name) == shape:
            del ckpt.shapes[name], ckpt.files[name], ckpt.dtypes[name]
    if model.tie_word_embeddings and "lm_head.weight" in ckpt.shapes and "model.embed_tokens.weight" in ckpt.shapes:
        stored_head, embed = ckpt.read("lm_head.weight"), ckpt.read("model.embed_tokens.weight")
        if stored_head.shape == embed.shape and torch.equal(stored_head, embed):
            del ckpt.shapes["lm_head.weight"], ckpt.files["lm_head.weight"], ckpt.dtypes["lm_head.weight"]
    check_config_against_checkpoint(model, ckpt.shapes, source or f"{folder}/config.json")
    expected = HFMapping(model).expected_hf_shapes()
    if head is not None:
        expected.pop("lm_head.weight", None)
        expected.update(head)
    check_tensors(ckpt, expected, f"the {model.family} model of config.json")
    return ckpt


def _drop_mtp_layers(ckpt: HFCheckpoint, model: ModelConfig, hf: dict[str, Any]) -> None:
    """Forget the multi-token-prediction layers (num_nextn_predict_layers, stored after the last
    decoder layer): the policy is trained and served without them. A warning says so once per folder,
    on the launch's rank 0 (the console shows warnings)."""
    source = f"{ckpt.folder}/config.json"
    mtp = hf_int(hf, source, "num_nextn_predict_layers", "num_mtp_layers", default=0, minimum=0)
    if not mtp:
        return
    extra = range(model.num_layers, model.num_layers + mtp)
    dropped = [n for n in ckpt.shapes if (m := _LAYER.match(n)) and int(m.group(1)) in extra]
    for name in dropped:
        del ckpt.shapes[name], ckpt.files[name], ckpt.dtypes[name]
    if dropped and launch_rank() == 0 and str(ckpt.folder) not in _MTP_NOTED:
        _MTP_NOTED.add(str(ckpt.folder))
        log.warning(
            "%s: dropped the %d MTP layer(s) (num_nextn_predict_layers; %d tensors of layers %d..%d): not trained, "
            "not exported",
            ckpt.folder, mtp, len(dropped), extra[0], extra[-1],
        )  # fmt: skip


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    model: ModelConfig,
    ckpt: HFCheckpoint,
    progress: Callable[[int], None] | None = None,
    skip: Callable[[ParamShard], bool] | None = None,
) -> int:
    """Copy this rank's share of every parameter from `ckpt` (cast to the parameter's dtype);
    returns the number of parameters set. `progress(n)` is called after each parameter; the
    parameters `skip` names are left as they are (the critic's value head)."""
    mapping = HFMapping(model)
    count = 0
    for shard in iter_param_shards(chunks, model):
        if skip is not None and skip(shard):
            continue
        if shard.partition_dim is None:  # this rank holds the whole tensor: build it in place
            mapping.to_megatron(shard.global_name, ckpt.read, shard.full_shape, out=shard.param.data)
        else:
            full = mapping.to_megatron(shard.global_name, ckpt.read, shard.full_shape)
            shard.param.copy_(take_shard(full, shard))
        count += 1
        if progress is not None:
            progress(1)
    return count

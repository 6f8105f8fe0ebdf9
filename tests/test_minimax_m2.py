"""MiniMax-M2 in one process: its config.json (the Hub's spelling and transformers 5's) -> `model`, every
refusal naming its field, the way back; the name/shape table against what `transformers` writes; HF ->
Megatron -> HF bit for bit; and the Megatron model on one rank against transformers' MiniMaxM2: fp32
log-probs within 1e-5 on a tiny random model with non-default options (partial RoPE on 6 of 10 head
dimensions, the QK-norm over the whole projection, GQA 6/2, top-3 of 6 experts with a non-zero expert bias
that changes the routing)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_rl.config import ParallelConfig
from megatron_rl.models.builder import transformer_config
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import (
    MINIMAX_M2_TINY,
    actor_log_probs,
    megatron_names,
    save_random_hf_model,
    tiny_minimax_model,
    with_key,
)
from mrl_replay import r2_record_and_replay, r3_replay_config

# MiniMaxAI/MiniMax-M2's config.json (bf16 shape; the Hub release adds an FP8 quantization_config).
MINIMAX_M2: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attention_dropout": 0.0,
    "attn_type_list": [1] * 62, "bos_token_id": None, "eos_token_id": None, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 1536, "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_beta": 1.0, "layernorm_mlp_beta": 1.0, "max_model_len": None,
    "max_position_embeddings": 196608, "mlp_intermediate_size": 8192, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "output_router_logits": False, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "shared_moe_mode": "sigmoid",
    "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.46.1", "use_cache": True,
    "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064, "torch_dtype": "bfloat16",
}  # fmt: skip


def _tiny_folder(folder: Path, seed: int = 3) -> Path:
    return save_random_hf_model(folder, transformers.MiniMaxM2Config(**MINIMAX_M2_TINY), seed=seed)


def test_hub_config() -> None:
    m = model_config_from_hf(MINIMAX_M2)
    assert (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        "minimax_m2", 62, 3072, 48, 8
    )  # fmt: skip
    assert (m.kv_channels, m.rotary_percent, m.rope_theta, m.qk_layernorm, m.add_qkv_bias) == (
        128, 0.5, 5e6, True, False
    )  # fmt: skip
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.first_k_dense_layers) == (256, 8, 1536, 0)
    assert m.moe_router_norm_topk and m.moe_shared_expert_size is None and m.moe_router_num_groups is None
    assert (m.params_dtype, m.norm_epsilon, m.vocab_size) == ("bf16", 1e-6, 200064)
    config = transformer_config(m, ParallelConfig(expert_model_parallel_size=8, tensor_model_parallel_size=8))
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert config.moe_router_topk_scaling_factor == 1.0 and config.moe_router_num_groups is None


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config is not handled by the minimax_m2"),
        ("qk_norm_type", "per_head", "qk_norm_type = 'per_head' is not supported"),
        ("use_qk_norm", False, "use_qk_norm = False is not supported"),
        ("scoring_func", "softmax", "scoring_func = 'softmax'"),
        ("use_routing_bias", False, "use_routing_bias = False"),
        ("shared_intermediate_size", 1024, "shared_intermediate_size = 1024"),
        ("num_expert_group", 8, "num_expert_group = 8"),
        ("routed_scaling_factor", 2.0, "routed_scaling_factor = 2.0"),
        ("layernorm_mlp_beta", 0.5, "layernorm_mlp_beta = 0.5"),
        ("sliding_window", 4096, "sliding_window = 4096"),
        ("attn_type_list", [0] + [1] * 61, "attn_type_list = [0, 1,"),
        ("rotary_dim", 63, "is not an even number of rotated dimensions"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling.factor is not handled"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("num_experts_per_tok", 1, "num_experts_per_tok = 1 is not supported"),
        ("n_shared_experts", 1, "n_shared_experts is not handled by the minimax_m2 mapping"),
    ],
)
def test_refusals_name_the_field(path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(MINIMAX_M2, path, value))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_config_round_trip_and_table_match_what_transformers_writes(tmp_path: Path) -> None:
    """transformers 5's config.json (rope_parameters.partial_rotary_factor) gives the model; the config.json
    written back builds the same transformers model; save_pretrained's names (the Hub's block_sparse_moe and
    per-expert w1/w2/w3) and shapes are the mapping's table; HF -> Megatron -> HF gives every tensor back bit
    for bit (the expert bias fp32 and non-zero)."""
    folder = _tiny_folder(tmp_path / "hf")
    saved = json.loads((folder / "config.json").read_text())
    model = model_config_from_hf(saved, params_dtype="fp32")
    assert model == tiny_minimax_model()
    assert (model.rotary_percent, model.kv_channels, model.num_query_groups) == (0.6, 10, 2)
    assert model_config_from_hf(hf_config_from_model(model)) == model
    again = transformers.MiniMaxM2Config(**{k: v for k, v in hf_config_from_model(model).items() if k != "model_type"})
    assert again.rope_parameters["partial_rotary_factor"] == 0.6 and again.num_local_experts == 6
    mapping = HFMapping(model)
    ckpt = open_hf_checkpoint(str(folder), model)
    assert ckpt.shapes == mapping.expected_hf_shapes()
    assert ckpt.shapes["model.layers.0.self_attn.q_norm.weight"] == (60,)  # the whole projection's norm
    bias = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    assert ckpt.dtypes[bias] == "F32" and ckpt.read(bias).abs().min() > 0
    original = load_file(folder / "model.safetensors")
    back: dict[str, torch.Tensor] = {}
    for name in megatron_names(mapping):
        hf_names = mapping.hf_names(name)
        shape = list(ckpt.shapes[hf_names[0]])
        shape[0] = sum(ckpt.shapes[n][0] for n in hf_names) if len(hf_names) > 1 else shape[0]
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            shape[0] = 384  # Megatron's padded vocabulary
        for hf_name, tensor in mapping.to_hf(name, mapping.to_megatron(name, ckpt.read, shape)):
            assert hf_name not in back, hf_name
            back[hf_name] = tensor
    assert set(back) == set(original)
    for name, tensor in back.items():
        assert original[name].dtype == tensor.dtype and torch.equal(original[name], tensor), name


def test_contradicting_checkpoint_names_the_key(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path / "hf")
    hf = json.loads((folder / "config.json").read_text())
    wrong = copy.deepcopy(hf)
    wrong["num_attention_heads"] = 4
    model = model_config_from_hf(wrong, params_dtype="fp32")
    with pytest.raises(ConversionError, match=r"num_attention_heads x head_dim = 4 x 10 contradicts"):
        open_hf_checkpoint(str(folder), model)


def test_megatron_forward_equals_transformers(tmp_path: Path) -> None:
    """One rank, local spec, fp32: log-probs within 1e-5 of transformers' eager MiniMaxM2, and the expert
    bias decides the routing (zeroing it in transformers moves the log-probs by far more)."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.import_hf import load_hf_weights
    from megatron_rl.models.norm import KeyProjectionRMSNorm, QueryProjectionRMSNorm
    from megatron_rl.parallel import init_distributed

    from mrl_configs import launch_of_one, layout
    from mrl_multiproc.model_helpers import forward_logits

    folder = _tiny_folder(tmp_path / "hf")
    model = model_config_from_hf(json.loads((folder / "config.json").read_text()), params_dtype="fp32")
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_model(model, layout(), use_transformer_engine=False)
        attention = chunks[0].decoder.layers[0].self_attention
        assert type(attention.q_layernorm) is QueryProjectionRMSNorm and type(attention.k_layernorm) is (
            KeyProjectionRMSNorm
        )
        load_hf_weights(chunks, model, open_hf_checkpoint(str(folder), model))
        logp = forward_logits(chunks, ids, model.vocab_size).log_softmax(-1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits.log_softmax(-1)
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.zero_()
        unbiased = hf(input_ids=ids).logits.log_softmax(-1)
    gap = (logp - expected).abs().max().item()
    assert gap <= 1e-5, gap
    assert (unbiased - expected).abs().max().item() > 1e-2


def test_local_engine_serves_it_and_r3_replays_its_routing(tmp_path: Path) -> None:
    """The local engine loads MiniMax-M2 through transformers, its weight-update names are the checkpoint's
    (block_sparse_moe, the expert bias included), and the routed experts it returns (SGLang's layout
    [tokens - 1, layers, top_k]) are the routers' own choice (sigmoid + expert bias). The trainer (one rank,
    the actor loading the folder) gives the sampled tokens the engine's log-probs within 1e-5 (fp32; the
    engine attends with SDPA), right-padded on its own routing, packed recording it (R2: the recorded routing
    is the engine's) and right-padded replaying it, packed replaying the engine's (R3); replaying other experts
    moves them by far more (the replay is what routes)."""

    import numpy as np

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.weights import CheckpointLayout

    from mrl_configs import actor_of_one

    folder = _tiny_folder(tmp_path / "hf")
    served, info = load_model(str(folder))
    assert (info.family, info.moe_layers, info.num_experts, info.top_k) == ("minimax_m2", (0, 1), 6, 3)
    assert set(CheckpointLayout(served, info.family).targets) == set(load_file(folder / "model.safetensors"))
    gen = Generator(served, info, max_running=3, max_prefill_tokens=64, seed=5)
    prompts = ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16])
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=6 + 3 * i, temperature=1.0, top_p=1.0, top_k=-1,
                   return_logprob=True, return_routed_experts=True)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    tokens = [torch.tensor(r.input_ids + r.output_ids) for r in reqs]
    routed = [torch.from_numpy(np.concatenate(r.routed)) for r in reqs]
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: chosen.append(o[2])) for layer in served.model.layers]
    for req, ids, experts in zip(reqs, tokens, routed, strict=True):
        chosen.clear()
        with torch.no_grad():
            served(ids[None])
        assert experts.shape == (len(ids) - 1, 2, 3)
        for layer in range(2):
            assert torch.equal(experts[:, layer].sort(-1).values, chosen[layer][:-1].sort(-1).values), (req.rid, layer)
    cfg = r3_replay_config(folder, 48)
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], advantages=[torch.tensor(1.0) for _ in prompts]
    )
    engine = [torch.tensor(r.output_logprobs) for r in reqs]
    with actor_of_one(cfg) as actor:
        own = actor_log_probs(actor, batch, TokenBudget(48)).log_probs
        recorded, r2 = r2_record_and_replay(actor, batch, routed, padded_tokens=48)
        replayed = actor_log_probs(
            actor, batch.with_fields(routed_experts=routed), TokenBudget(40, packed=True), "replay"
        )
        shifted = [(r + 1) % 6 for r in routed]
        other = actor_log_probs(actor, batch.with_fields(routed_experts=shifted), TokenBudget(48), "replay").log_probs
    runs = (("own routing", own), ("R2 record, packed", recorded), ("R2 replay", r2), ("R3 replay", replayed.log_probs))
    for name, got in runs:
        gap = max((g - e).abs().max().item() for g, e in zip(got, engine, strict=True))
        assert gap <= 1e-5, (name, gap)
    assert max((g - e).abs().max().item() for g, e in zip(other, engine, strict=True)) > 1e-2
    for hook in hooks:
        hook.remove()

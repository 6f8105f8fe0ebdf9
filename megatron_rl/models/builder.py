"""Build a Megatron-Core GPTModel (and its TransformerConfig) from the `model` and `parallel` config.

Call after `megatron_rl.parallel.init_distributed`: the pipeline stage, TP/EP ranks and sizes come
from Megatron's parallel_state, and must agree with `parallel`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_rl.config import ModelConfig, ParallelConfig, pipeline_stage_layers
from megatron_rl.models.attention_choice import check_attention_backend, transformer_engine_layers, use_sdpa
from megatron_rl.models.context_attention import ContextParallelAttention
from megatron_rl.models.dsa_attention import SparseMLAttention
from megatron_rl.models.experts_choice import check_grouped_experts, use_grouped_experts
from megatron_rl.models.families import check_family, moe_layer_pattern
from megatron_rl.models.fusion_choice import CPU, Platform, fusion_fields
from megatron_rl.models.gated_delta import linear_attention_fields, qwen3_next_block_spec
from megatron_rl.models.gemma import gemma_block_spec, gemma_fields, prepare_gemma
from megatron_rl.models.grouped_experts import GroupedExperts
from megatron_rl.models.hf_config_dsa import indexer_rope_interleaved
from megatron_rl.models.mla_attention import MLADotProductAttention
from megatron_rl.models.norm import KeyProjectionRMSNorm, QueryProjectionRMSNorm, SequenceParallelRMSNorm
from megatron_rl.models.packed_attention import PackedDotProductAttention
from megatron_rl.models.recompute_choice import recompute_fields
from megatron_rl.models.sdpa_attention import SDPAttention
from megatron_rl.parallel.device import local_device, transformer_engine_available, transformer_engine_version
from megatron_rl.parallel.layout import resolve_expert_tensor_parallel, resolve_sequence_parallel

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    enable_routing_replay: bool = False,
    moe_grouped_gemm: bool = False,
    platform: Platform = CPU,
    overrides: Mapping[str, Any] | None = None,
) -> TransformerConfig:
    """The TransformerConfig of `model` under `parallel` (no dropout, fp32 router, dropless MoE) on `platform`
    (the fusions that run there: `fusion_choice`; `moe_grouped_gemm`: Transformer Engine's grouped experts).

    `overrides` sets any other TransformerConfig field (e.g. `calculate_per_token_loss`).
    """
    spec = check_family(model)
    dtype = DTYPES[model.params_dtype]
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_dropout_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=resolve_expert_tensor_parallel(parallel),
        sequence_parallel=resolve_sequence_parallel(parallel),
        context_parallel_size=parallel.context_parallel_size,
        cp_comm_type=parallel.cp_comm_type if parallel.context_parallel_size > 1 else None,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
    )
    kwargs.update(fusion_fields(model, platform, routing_replay=enable_routing_replay))
    te = platform.transformer_engine is not None
    kwargs.update(recompute_fields(model, transformer_engine=te, te_grouped_experts=te and moe_grouped_gemm))
    if model.num_experts is not None:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_layer_freq=moe_layer_pattern(model),
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_topk=model.moe_router_topk,
            moe_router_score_function=spec.score_function,
            # Renormalised top-k of softmax(all) == softmax(top-k logits) (Qwen3-MoE norm_topk_prob,
            # Mixtral); without renormalisation the weights are the top-k of softmax(all).
            moe_router_pre_softmax=spec.score_function == "softmax" and not model.moe_router_norm_topk,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_token_dispatcher_type=model.moe_token_dispatcher,
            moe_expert_capacity_factor=None,
            moe_grouped_gemm=moe_grouped_gemm,
            moe_enable_routing_replay=enable_routing_replay,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_size,
        )
        if spec.score_function == "sigmoid":
            kwargs.update(sigmoid_router_fields(model))
    elif enable_routing_replay:
        raise ValueError(f"routing replay needs an MoE model; model.family = {model.family!r} is dense")
    if spec.multi_latent_attention:
        kwargs.update(mla_fields(model))
    if spec.sparse_attention:  # Megatron's MLA then hands the core attention its hidden states and compressed query
        kwargs.update(
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=model.dsa_index_n_heads,
            dsa_indexer_head_dim=model.dsa_index_head_dim,
            dsa_indexer_topk=model.dsa_index_topk,
            dsa_indexer_loss_coeff=0.0,
        )
    if spec.linear_attention:
        kwargs.update(linear_attention_fields(model))
    if spec.gpt_oss:
        kwargs.update(gpt_oss_fields(model))
    if spec.gemma:
        kwargs.update(gemma_fields(model))
    if model.sliding_window is not None:
        # Megatron's window (w - 1, 0) keeps the query's own key and the w - 1 before it, as transformers'
        # `sliding_window` w; every `sliding_window_pattern`-th layer full
        kwargs.update(window_size=(model.sliding_window - 1, 0), window_attn_skip_freq=model.sliding_window_pattern)
    kwargs.update(overrides or {})
    config = (MLATransformerConfig if spec.multi_latent_attention else TransformerConfig)(**kwargs)
    if model.rope_scaling == "yarn" and not spec.multi_latent_attention:
        # GPTModel's yarn (position_embedding_type = yarn) and its attention's cos/sin factor read these
        # attributes, which are no TransformerConfig fields
        config.yarn_rotary_scaling_factor = model.yarn_factor
        config.yarn_original_max_position_embeddings = model.yarn_original_max_position_embeddings
        config.yarn_beta_fast, config.yarn_beta_slow = model.yarn_beta_fast, model.yarn_beta_slow
        config.yarn_mscale, config.yarn_mscale_all_dim = model.yarn_mscale, model.yarn_mscale_all_dim
        config.yarn_correction_range_round_to_int = model.yarn_truncate
    if spec.sparse_attention:  # no TransformerConfig field: the indexer's RoPE layout (models.dsa_attention)
        config.dsa_indexer_interleaved = indexer_rope_interleaved(model.family)
    return config


class GatedSigmoid:
    """SwiGLU's gate with a gain: g * sigmoid(alpha * g) (gpt-oss's alpha 1.702; alpha 1 is SiLU)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x * self.alpha)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GatedSigmoid) and other.alpha == self.alpha

    def __hash__(self) -> int:
        return hash(self.alpha)


def gpt_oss_fields(model: ModelConfig) -> dict[str, Any]:
    """gpt-oss's attention and experts: biases on every linear and the router (`add_bias_linear`), a learnable
    sink logit per head; the SwiGLU clamped, gated by g * sigmoid(alpha * g), its linear half offset by 1 (its
    sliding-window layers: `transformer_config`)."""
    return dict(
        add_bias_linear=True,
        softmax_type="learnable",
        glu_linear_offset=1.0,
        activation_func_clamp_value=model.swiglu_limit,
        activation_func=GatedSigmoid(model.swiglu_alpha),
    )


def sigmoid_router_fields(model: ModelConfig) -> dict[str, Any]:
    """DeepSeek's router: sigmoid scores plus the fp32 expert bias (HF's e_score_correction_bias,
    Megatron's `expert_bias`) choose the experts, group-limited when groups are set; the gates are
    the chosen sigmoid scores renormalised, times the routed scaling factor. With
    `model.freeze_expert_bias` the bias update runs at rate 0: the bias stays what was loaded."""
    return dict(
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0 if model.freeze_expert_bias else model.expert_bias_update_rate,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_router_scaling_factor,
    )


def mla_fields(model: ModelConfig) -> dict[str, Any]:
    """MLATransformerConfig's fields: the latent ranks, head dimensions and RoPE (yarn or plain).
    Megatron's MLA softmax scale is mscale(factor, mscale_all_dim)^2 / sqrt(q head dim), as DeepSeek's."""
    yarn = model.rope_scaling == "yarn"
    return dict(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=model.rope_theta,
        rotary_percent=1.0,
        rotary_scaling_factor=model.yarn_factor if yarn else 1.0,
        original_max_position_embeddings=model.yarn_original_max_position_embeddings,
        beta_fast=model.yarn_beta_fast,
        beta_slow=model.yarn_beta_slow,
        mscale=model.yarn_mscale if yarn else 1.0,
        mscale_all_dim=model.yarn_mscale_all_dim if yarn else 0.0,
    )


def _local_layer(spec: ModuleSpec, context_parallel: bool, grouped_experts: bool, sdpa: bool) -> ModuleSpec:
    """A copy of a local layer spec with every norm replaced by the sequence-parallel RMSNorm, the
    core attention by `SDPAttention` with `sdpa`, else by one that also takes packed sequences
    (`packed_attention`) and, under context parallelism, gathers the keys and values over the CP ranks
    (`context_attention`), and with `grouped_experts`, Megatron's `SequentialMLP` experts by
    `GroupedExperts` (same parameters)."""
    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = SequenceParallelRMSNorm
    sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    experts = getattr(sub.mlp.submodules, "experts", None)  # MoE layers only
    if grouped_experts and experts is not None and experts.module is SequentialMLP:
        experts.module = GroupedExperts
    attn = sub.self_attention.submodules
    mla = hasattr(attn, "linear_kv_down_proj")
    if sdpa:
        attn.core_attention = SDPAttention
    elif context_parallel:
        attn.core_attention = ContextParallelAttention
    else:
        attn.core_attention = MLADotProductAttention if mla else PackedDotProductAttention
    for name in ("q_layernorm", "kv_layernorm") if mla else ("q_layernorm", "k_layernorm"):
        if getattr(attn, name) not in (None, IdentityOp):
            setattr(attn, name, SequenceParallelRMSNorm)
    return spec


def decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    pp_rank: int | None = None,
    grouped_experts: bool = False,
    sdpa: bool = False,
    qk_norm_whole_projection: bool = False,
) -> TransformerBlockSubmodules:
    """Layer specs of this pipeline stage: Transformer Engine's (grouped experts: `config.moe_grouped_gemm`), or
    Megatron's local ones whose norms are `SequenceParallelRMSNorm` (Megatron's local norm refuses sequence
    parallel), whose core attention takes packed (THD) sequences too, and context parallelism, and whose
    experts are `GroupedExperts` with `grouped_experts`, whose core attention is `SDPAttention` with `sdpa`.
    With `qk_norm_whole_projection` (either spec) the QK-norms span all heads of q and of k (MiniMax-M2)."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm", pp_rank=pp_rank
    )
    if not use_transformer_engine:
        block = TransformerBlockSubmodules(
            layer_specs=[
                _local_layer(s, config.context_parallel_size > 1, grouped_experts, sdpa) for s in block.layer_specs
            ],
            layer_norm=SequenceParallelRMSNorm,
        )
    if config.experimental_attention_variant == "dsa":
        block = _sparse_attention_block(block, use_transformer_engine)
    if config.experimental_attention_variant == "gated_delta_net":  # always the local specs (attention_choice)
        block = qwen3_next_block_spec(block, config)
    if qk_norm_whole_projection:
        block = copy.deepcopy(block)  # Megatron's specs may be shared module-level objects
        for layer in block.layer_specs:
            attn = layer.submodules.self_attention.submodules
            attn.q_layernorm, attn.k_layernorm = QueryProjectionRMSNorm, KeyProjectionRMSNorm
    return block


def _sparse_attention_block(block: TransformerBlockSubmodules, use_te: bool) -> TransformerBlockSubmodules:
    """The layers' core attention `SparseMLAttention`; on Transformer Engine's spec the query's latent norm apart
    from its up projection (TE fuses them, and the indexer reads the normalised latent)."""
    block = copy.deepcopy(block)
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention.submodules
        attn.core_attention = SparseMLAttention
        if use_te:
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

            attn.linear_q_up_proj, attn.q_layernorm = TEColumnParallelLinear, TENorm
    return block


def _check_parallel_state(parallel: ParallelConfig) -> None:
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel state is not initialised: call megatron_rl.parallel.init_distributed first"
        )
    expected = {
        "parallel.tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "parallel.pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "parallel.expert_model_parallel_size": parallel.expert_model_parallel_size,
        "parallel.expert_tensor_parallel_size": resolve_expert_tensor_parallel(parallel),
        "parallel.context_parallel_size": parallel.context_parallel_size,
    }
    actual = {
        "parallel.tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "parallel.pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "parallel.expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "parallel.expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "parallel.context_parallel_size": ps.get_context_parallel_world_size(),
    }
    wrong = {k: (v, actual[k]) for k, v in expected.items() if actual[k] != v}
    if wrong:
        detail = ", ".join(f"{k} = {v} but parallel_state has {a}" for k, (v, a) in wrong.items())
        raise RuntimeError(f"config and Megatron parallel state disagree: {detail}")


def _check_stage_layers(gpt: GPTModel, model: ModelConfig, parallel: ParallelConfig) -> None:
    """RuntimeError unless this stage holds the global layers `pipeline_stage_layers` gives it: conversion,
    checkpoints and weight sync name every layer by its global number (`models.init`)."""
    stage = ps.get_pipeline_model_parallel_rank()
    want = pipeline_stage_layers(model, parallel)[stage]
    built = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    if built != list(want):
        raise RuntimeError(
            f"pipeline stage {stage} built global layers {built}, but the config's split gives it "
            f"{want.start}..{want.stop - 1}"
        )


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    enable_routing_replay: bool = False,
    use_transformer_engine: bool | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage; one today), as Megatron's schedules expect.

    The first pipeline stage holds the embedding, the last the final norm and output layer, whose
    logits stay split over TP (`parallel_output`, vocabulary padded by `padded_vocab_size`: the
    padded columns are not tokens and must be masked out of any softmax). With
    `enable_routing_replay`, every router gets a Megatron `RouterReplay` instance; the registry is
    cleared first, so it holds this model's routers only (in layer order).
    `use_transformer_engine`: None = whenever TE and CUDA are present.
    """
    _check_parallel_state(parallel)
    spec = check_family(model)
    if use_transformer_engine and (spec.gemma or spec.linear_attention):
        raise ValueError(f"model.family = {model.family!r} is built on the local specs, not Transformer Engine's")
    use_te = transformer_engine_layers(
        model, available=transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    )
    check_grouped_experts(model, parallel, transformer_engine=use_te)
    grouped = use_grouped_experts(model, parallel, transformer_engine=use_te)
    check_attention_backend(model, parallel, transformer_engine=use_te)
    config = transformer_config(
        model,
        parallel,
        enable_routing_replay=enable_routing_replay,
        moe_grouped_gemm=use_te and grouped,  # Megatron's own grouped experts are Transformer Engine's
        platform=Platform(
            cuda=torch.cuda.is_available(), transformer_engine=transformer_engine_version() if use_te else None
        ),
        overrides=config_overrides,
    )
    RouterReplay.clear_global_router_replay_instances()
    layer_spec = decoder_block_spec(
        config,
        use_te,
        grouped_experts=grouped,
        sdpa=not use_te and use_sdpa(model, parallel, cuda=torch.cuda.is_available()),
        qk_norm_whole_projection=spec.qk_norm_whole_projection,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=gemma_block_spec(layer_spec, model) if spec.gemma else layer_spec,
        vocab_size=padded_vocab_size(
            model.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor_model_parallel_size
        ),
        max_sequence_length=model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="yarn" if model.rope_scaling == "yarn" and not spec.multi_latent_attention else "rope",
        rotary_percent=model.rotary_percent,
        rotary_base=model.rope_theta,
        rope_scaling=model.rope_scaling == "llama3",  # Megatron's: low/high frequency factors 1, 4; 8192 positions
        rope_scaling_factor=model.llama3_factor,
        seq_len_interpolation_factor=model.rope_linear_factor if model.rope_scaling == "linear" else None,
    )
    gpt.to(local_device())  # local-spec norms are created on the CPU
    _check_stage_layers(gpt, model, parallel)
    if spec.gpt_oss:
        _prepare_sinks_and_expert_biases(gpt)
    if spec.gemma:
        prepare_gemma(gpt, model)
    reduce_experts_over_expert_data_parallel(gpt, parallel)
    return [gpt]


def _prepare_sinks_and_expert_biases(gpt: GPTModel) -> None:
    """Tag the attention sinks (`softmax_offset`, one per head of this TP rank) as split over TP on heads, as
    Megatron's sharded state dict splits them, and let each expert of a `SequentialMLP` own its output: its MLP
    adds the output bias in place, which autograd refuses on the view that the reduction over one expert-TP
    rank returns (without expert parallelism)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for layer in gpt.decoder.layers:
        offset = layer.self_attention.core_attention.softmax_offset
        if not isinstance(offset, torch.nn.Parameter):  # Megatron sets it to what the init method returns
            raise RuntimeError(f"layer {layer.layer_number}: no attention sinks (an init method returned {offset!r})")
        set_tensor_model_parallel_attributes(offset, True, 0, 1)
    for module in gpt.modules():
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                expert.linear_fc2.register_forward_hook(_own_output)


def _own_output(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    out, bias = output
    return (out.clone() if out._is_view() else out), bias


def reduce_experts_over_expert_data_parallel(model: torch.nn.Module, parallel: ParallelConfig) -> None:
    """Mark the routed experts' parameters for Megatron's expert topology (`allreduce = False`: DDP reduces
    their gradients over the expert-data-parallel group, the optimizer shards and norms them with the
    expert groups) where Megatron-Core 0.16 leaves them marked dense: with EP = 1 it reduces them over
    the dense data-parallel group, which under expert-TP != TP holds other shards of the experts (ETP > TP:
    the shards' gradients summed together) or misses ranks that hold the same ones (ETP < TP: ranks drift
    apart). Megatron-LM fixed it later (NVIDIA/Megatron-LM#5916, #6080); with EP > 1, or expert-TP = TP,
    the two groups coincide and Megatron's marks stay."""
    if parallel.expert_model_parallel_size > 1 or resolve_expert_tensor_parallel(parallel) == (
        parallel.tensor_model_parallel_size
    ):
        return
    for module in model.modules():
        if isinstance(module, MoELayer):  # its `experts` only: the router and shared experts are dense
            for param in module.experts.parameters():
                param.allreduce = False

"""What each supported model family fixes about the architecture, and the MoE layer pattern."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class FamilySpec:
    """Switches a family fixes; `None` = free. Everything else (sizes, tying) comes from the config."""

    moe: bool
    qk_layernorm: bool | None
    add_qkv_bias: bool | None
    norm_topk: bool | None = None
    score_function: str = "softmax"  # sigmoid: DeepSeek's router, with the expert bias
    multi_latent_attention: bool = False
    router_extras: bool = False  # DeepSeek's group-limited routing, shared experts and routed scaling factor
    qk_norm_whole_projection: bool = False  # QK-norm over all heads of q (and of k) at once, not per head
    gpt_oss: bool = False  # learnable attention sinks, biases on every linear and the router, (1 + up) SwiGLU
    gemma: bool = False  # (1 + weight) RMSNorms, sandwich norms, sqrt(hidden)-scaled embeddings, tanh-GELU GLU
    sparse_attention: bool = False  # DeepSeek sparse attention: a lightning indexer picks each query's top-k keys
    linear_attention: bool = False  # Gated DeltaNet layers between gated full-attention ones (models.gated_delta)


FAMILIES: dict[str, FamilySpec] = {
    # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob; QK-norm; no bias.
    "qwen3_moe": FamilySpec(moe=True, qk_layernorm=True, add_qkv_bias=False),
    # Qwen3 dense: QK-norm, no bias.
    "qwen3": FamilySpec(moe=False, qk_layernorm=True, add_qkv_bias=False),
    # Qwen2 dense: bias on the QKV projection only, no QK-norm.
    "qwen2": FamilySpec(moe=False, qk_layernorm=False, add_qkv_bias=True),
    # Mixtral: softmax of the top-k logits, which is the renormalised top-k softmax.
    "mixtral": FamilySpec(moe=True, qk_layernorm=False, add_qkv_bias=False, norm_topk=True),
    # DeepSeek-V3 (Kimi-K2, Moonlight, DeepSeek-R1): MLA (its q_a/kv_a layernorms are the
    # qk_layernorm), sigmoid router with the expert bias, group-limited top-k, renormalised, scaled.
    "deepseek_v3": FamilySpec(
        moe=True,
        qk_layernorm=True,
        add_qkv_bias=False,
        norm_topk=True,
        score_function="sigmoid",
        multi_latent_attention=True,
        router_extras=True,
    ),
    # DeepSeek-V3.2: DeepSeek-V3 whose MLA attends only the top-k keys a lightning indexer picks per query
    # (models.dsa_attention; the indexer's RoPE half-split). GLM-5: the same on GLM's sizes, the indexer's RoPE
    # interleaved.
    **{
        family: FamilySpec(
            moe=True,
            qk_layernorm=True,
            add_qkv_bias=False,
            norm_topk=True,
            score_function="sigmoid",
            multi_latent_attention=True,
            router_extras=True,
            sparse_attention=True,
        )
        for family in ("deepseek_v32", "glm_moe_dsa")
    },
    # GLM-4.5: GQA with QKV biases, optional QK-norm, partial RoPE; DeepSeek's sigmoid router.
    "glm4_moe": FamilySpec(
        moe=True, qk_layernorm=None, add_qkv_bias=None, norm_topk=True, score_function="sigmoid", router_extras=True
    ),
    # Llama 2/3/3.1/3.2/3.3 dense: no bias, no QK-norm; Llama 3.1's RoPE scaling (rope_scaling = llama3).
    "llama": FamilySpec(moe=False, qk_layernorm=False, add_qkv_bias=False),
    # Mistral dense (v0.2+, Nemo; full attention): no bias, no QK-norm.
    "mistral": FamilySpec(moe=False, qk_layernorm=False, add_qkv_bias=False),
    # MiniMax-M2: GQA whose QK-norm spans the whole q (and k) projection, partial RoPE; sigmoid router with the
    # expert bias, renormalised, without groups, shared experts or scaling; MoE in every layer.
    "minimax_m2": FamilySpec(
        moe=True,
        qk_layernorm=True,
        add_qkv_bias=False,
        norm_topk=True,
        score_function="sigmoid",
        qk_norm_whole_projection=True,
    ),
    # gpt-oss: GQA with biases on q/k/v/o and a learnable sink logit per head, sliding-window layers between
    # full ones, yarn RoPE; router with a bias (softmax of the top-k logits), biased experts whose SwiGLU
    # clamps its inputs and gates (up + 1); MoE in every layer.
    "gpt_oss": FamilySpec(moe=True, qk_layernorm=False, add_qkv_bias=True, norm_topk=True, gpt_oss=True),
    # Gemma 2 dense: Gemma's layer (models.gemma), attention and final logit soft-capping, sliding-window layers.
    "gemma2": FamilySpec(moe=False, qk_layernorm=False, add_qkv_bias=False, gemma=True),
    # Gemma 3 text: Gemma's layer with (1 + weight) QK-norm, the sliding layers' own RoPE base, linear RoPE scaling.
    "gemma3_text": FamilySpec(moe=False, qk_layernorm=True, add_qkv_bias=False, gemma=True),
    # Qwen3-Next and Qwen3.5's text model: Gated DeltaNet layers, every n-th layer a full attention whose output is
    # gated by sigmoid(a second query), (1 + weight) RMSNorms, partial RoPE; softmax router, a shared expert scaled
    # by sigmoid(its gate). Qwen3.5 stores DeltaNet's projections apart, Qwen3-Next fused per key head.
    **{
        family: FamilySpec(moe=True, qk_layernorm=True, add_qkv_bias=False, linear_attention=True)
        for family in ("qwen3_next", "qwen3_5_moe")
    },
}
LINEAR_ATTENTION_FAMILIES = ("qwen3_next", "qwen3_5_moe")
_GEMMA = ("gemma2", "gemma3_text")
# The ModelConfig switches only some families have (set: the families that have them), refused for the others.
_FAMILY_ONLY = {
    "model.sliding_window": (lambda m: m.sliding_window is not None, ("gpt_oss", *_GEMMA)),
    "model.swiglu_alpha": (lambda m: m.swiglu_alpha != 1.0, ("gpt_oss",)),
    "model.swiglu_limit": (lambda m: m.swiglu_limit is not None, ("gpt_oss",)),
    "model.yarn_truncate": (lambda m: not m.yarn_truncate, ("gpt_oss",)),
    "model.query_pre_attn_scalar": (lambda m: m.query_pre_attn_scalar is not None, _GEMMA),
    "model.final_logit_softcapping": (lambda m: m.final_logit_softcapping is not None, _GEMMA),
    "model.attn_logit_softcapping": (lambda m: m.attn_logit_softcapping is not None, ("gemma2",)),
    "model.rope_local_theta": (lambda m: m.rope_local_theta is not None, ("gemma3_text",)),
    "model.rope_scaling = 'linear'": (lambda m: m.rope_scaling == "linear", ("gemma3_text",)),
    **{
        f"model.{key}": (lambda m, key=key: getattr(m, key) is not None, ("deepseek_v32", "glm_moe_dsa"))
        for key in ("dsa_index_n_heads", "dsa_index_head_dim", "dsa_index_topk")
    },
    "model.linear_attention.full_attention_interval": (
        lambda m: m.linear_attention.full_attention_interval is not None,
        LINEAR_ATTENTION_FAMILIES,
    ),
}


def is_gpt_oss(model: ModelConfig) -> bool:
    """Whether `model` has gpt-oss's attention sinks, sliding-window layers and biased experts."""
    spec = FAMILIES.get(model.family)
    return spec is not None and spec.gpt_oss


def check_family(model: ModelConfig) -> FamilySpec:
    """The family's spec, or ConfigError naming the key that contradicts `model.family`."""
    if model.family not in FAMILIES:
        raise ConfigError(f"model.family = {model.family!r}; allowed: {sorted(FAMILIES)}")
    spec = FAMILIES[model.family]
    fam = f"model.family = {model.family!r}"
    if spec.moe and model.num_experts is None:
        raise ConfigError(f"{fam} is a mixture of experts: set model.num_experts")
    if not spec.moe and model.num_experts is not None:
        raise ConfigError(f"{fam} is dense: set model.num_experts = null (got {model.num_experts})")
    if spec.qk_layernorm is not None and model.qk_layernorm != spec.qk_layernorm:
        raise ConfigError(f"{fam} needs model.qk_layernorm = {str(spec.qk_layernorm).lower()}")
    if spec.add_qkv_bias is not None and model.add_qkv_bias != spec.add_qkv_bias:
        raise ConfigError(f"{fam} needs model.add_qkv_bias = {str(spec.add_qkv_bias).lower()}")
    if spec.norm_topk is not None and model.moe_router_norm_topk != spec.norm_topk:
        raise ConfigError(f"{fam} needs model.moe_router_norm_topk = {str(spec.norm_topk).lower()}")
    _check_sigmoid_router(model, spec, fam)
    for key, (used, owners) in _FAMILY_ONLY.items():
        if used(model) and model.family not in owners:
            raise ConfigError(f"{fam} has no {key} (only {', '.join(owners)})")
    if spec.gpt_oss and (model.first_k_dense_layers or model.moe_layer_freq != 1):
        raise ConfigError(
            f"{fam} has MoE in every layer: needs model.first_k_dense_layers = 0, model.moe_layer_freq = 1"
        )
    if spec.sparse_attention:
        _check_sparse_attention(model, fam)
    if spec.linear_attention:
        _check_linear_attention(model, fam)
    if model.rope_scaling == "yarn" and not (spec.multi_latent_attention or spec.gpt_oss):
        raise ConfigError(f"{fam}: model.rope_scaling = 'yarn' is only supported for deepseek_v3 (MLA) and gpt_oss")
    if model.rope_scaling == "llama3" and model.family != "llama":
        raise ConfigError(f"{fam}: model.rope_scaling = 'llama3' is only supported for model.family = 'llama'")
    if spec.multi_latent_attention and model.rotary_percent != 1.0:
        raise ConfigError(f"{fam} rotates the whole qk_rope_head_dim: needs model.rotary_percent = 1.0")
    return spec


def _check_sparse_attention(model: ModelConfig, fam: str) -> None:
    """The indexer's sizes are set, it reads MLA's compressed query, and its keys' RoPE part fits its heads."""
    unset = [k for k in ("dsa_index_n_heads", "dsa_index_head_dim", "dsa_index_topk") if getattr(model, k) is None]
    if unset:
        raise ConfigError(f"{fam} has DeepSeek sparse attention: set model.{unset[0]}")
    if model.q_lora_rank is None:
        raise ConfigError(f"{fam}: the indexer reads the compressed query: set model.q_lora_rank")
    if model.dsa_index_head_dim is not None and model.dsa_index_head_dim < model.qk_rope_head_dim:
        raise ConfigError(
            f"{fam}: model.dsa_index_head_dim ({model.dsa_index_head_dim}) must be >= model.qk_rope_head_dim "
            f"({model.qk_rope_head_dim}, the part RoPE rotates)"
        )


def _check_linear_attention(model: ModelConfig, fam: str) -> None:
    """Linear attention's layer pattern is set, its value heads group its key heads, and the shared expert (which
    both families have) is set."""
    linear = model.linear_attention
    if linear.full_attention_interval is None:
        raise ConfigError(f"{fam} has Gated DeltaNet layers: set model.linear_attention.full_attention_interval")
    if linear.num_value_heads % linear.num_key_heads:
        raise ConfigError(
            f"{fam}: model.linear_attention.num_value_heads ({linear.num_value_heads}) must be a multiple of "
            f"model.linear_attention.num_key_heads ({linear.num_key_heads})"
        )
    if model.moe_shared_expert_size is None:
        raise ConfigError(f"{fam} has a gated shared expert in every MoE layer: set model.moe_shared_expert_size")


def linear_attention_pattern(model: ModelConfig) -> list[int]:
    """1 for a Gated DeltaNet layer, 0 for a full-attention one, per layer (all 0 without linear attention)."""
    period = model.linear_attention.full_attention_interval
    return [0 if period is None else int((i + 1) % period != 0) for i in range(model.num_layers)]


def is_linear_attention(model: ModelConfig) -> bool:
    """Whether `model` has Gated DeltaNet layers (Qwen3-Next, Qwen3.5)."""
    spec = FAMILIES.get(model.family)
    return spec is not None and spec.linear_attention


def is_sparse_attention(model: ModelConfig) -> bool:
    """Whether `model` has DeepSeek sparse attention (DeepSeek-V3.2, GLM-5)."""
    spec = FAMILIES.get(model.family)
    return spec is not None and spec.sparse_attention


def _check_sigmoid_router(model: ModelConfig, spec: FamilySpec, fam: str) -> None:
    """Group-limited routing, shared experts and the routed scaling factor belong to DeepSeek's and GLM's
    routers only; the groups must split the experts, and Megatron scores a group by its top
    (topk / group_topk) experts where DeepSeek's and GLM's routers use the top 2, so that quotient must be 2."""
    extras_only = {
        "model.moe_shared_expert_size": model.moe_shared_expert_size is not None and not spec.linear_attention,
        "model.moe_router_num_groups": model.moe_router_num_groups is not None,
        "model.moe_router_group_topk": model.moe_router_group_topk is not None,
        "model.moe_router_scaling_factor": model.moe_router_scaling_factor != 1.0,
    }
    if not spec.router_extras:
        used = [key for key, set_ in extras_only.items() if set_]
        if used:
            owners = ", ".join(name for name, other in FAMILIES.items() if other.router_extras)
            raise ConfigError(f"{fam} has no {used[0]} (families with it: {owners})")
        return
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError("model.moe_router_num_groups and model.moe_router_group_topk are set together (or neither)")
    if groups is None or group_topk is None:
        return
    experts = model.num_experts or 0
    if experts % groups or experts // groups < 2:
        raise ConfigError(
            f"model.moe_router_num_groups ({groups}) must split model.num_experts ({experts}) into groups of >= 2"
        )
    if group_topk >= groups or model.moe_router_topk // group_topk != 2:
        raise ConfigError(
            f"model.moe_router_group_topk ({group_topk}) must be < model.moe_router_num_groups ({groups}) with "
            f"model.moe_router_topk ({model.moe_router_topk}) // it = 2 (groups are scored by their top-2 experts)"
        )


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (0-based index i).

    Layer i is MoE when i >= `first_k_dense_layers` and (i + 1) % `moe_layer_freq` == 0: Hugging
    Face's Qwen-MoE `decoder_sparse_step` rule, with DeepSeek-style leading dense layers.
    """
    if model.num_experts is None:
        return [0] * model.num_layers
    pattern = [
        int(i >= model.first_k_dense_layers and (i + 1) % model.moe_layer_freq == 0) for i in range(model.num_layers)
    ]
    if not any(pattern):
        raise ConfigError(
            f"model.moe_layer_freq ({model.moe_layer_freq}) with model.first_k_dense_layers "
            f"({model.first_k_dense_layers}) leaves no MoE layer in model.num_layers ({model.num_layers})"
        )
    return pattern


def parameter_counts(model: ModelConfig) -> tuple[int, int]:
    """(dense, expert) parameter counts of `model` (experts: the routed experts' weights, which EP and
    ETP split; everything else, shared experts and routers included, is dense). For sizing arithmetic:
    the vocabulary is counted unpadded."""
    return stage_parameter_counts(model, range(model.num_layers), first=True, last=True)


def stage_parameter_counts(
    model: ModelConfig, layers: range, first: bool, last: bool, *, value_head: bool = False
) -> tuple[int, int]:
    """(dense, expert) parameter counts, as `parameter_counts`, of the pipeline stage holding the global
    transformer `layers`: the `first` stage also holds the input embedding, the `last` the final norm and
    the output layer (with tied embeddings a copy of the embedding, unless that stage is also the first).
    `value_head`: the critic's value model (`megatron_rl.critic`), untied, whose output layer is a [1, H] head
    with its bias."""
    spec = check_family(model)
    h, heads = model.hidden_size, model.num_attention_heads
    if spec.multi_latent_attention:
        q_head = model.qk_nope_head_dim + model.qk_rope_head_dim
        q = h * heads * q_head if model.q_lora_rank is None else model.q_lora_rank * (h + 1 + heads * q_head)
        kv = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
        kv += model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim)
        attention = q + kv + heads * model.v_head_dim * h
        if spec.sparse_attention:  # the indexer: wq_b, wk, its key LayerNorm (weight and bias), weights_proj
            width, index_heads = model.dsa_index_head_dim or 0, model.dsa_index_n_heads or 0
            attention += (model.q_lora_rank or 0) * index_heads * width + h * width + 2 * width + h * index_heads
    else:
        d = model.kv_channels or h // heads
        qkv = (heads + 2 * model.num_query_groups) * d
        norms = (heads + model.num_query_groups) * d if spec.qk_norm_whole_projection else 2 * d
        attention = qkv * h + heads * d * h + (qkv if model.add_qkv_bias else 0) + (norms if model.qk_layernorm else 0)
        attention += (h + heads) if spec.gpt_oss else 0  # o_proj's bias, the sinks
        attention += 2 * h if spec.gemma else 0  # the norms after the attention and after the MLP
        attention += heads * d * h if spec.linear_attention else 0  # the output gate's query
    pattern = moe_layer_pattern(model)
    moe_layers = sum(pattern[i] for i in layers)
    dense_mlp = 3 * h * model.ffn_hidden_size * (len(layers) - moe_layers)
    router = (model.num_experts or 0) * (h + (1 if spec.score_function == "sigmoid" or spec.gpt_oss else 0))
    shared = 3 * h * (model.moe_shared_expert_size or 0)
    embedding = model.vocab_size * h
    head = h + 1 if value_head else (0 if model.tie_word_embeddings and first else embedding)
    output = h + head  # the final norm and the output layer
    ends = (embedding if first else 0) + (output if last else 0)
    shared += h if spec.linear_attention else 0  # the shared expert's gate
    linear = sum(linear_attention_pattern(model)[i] for i in layers)
    attention_params = (len(layers) - linear) * attention + linear * _delta_net_parameters(model)
    dense = ends + len(layers) * 2 * h + attention_params + dense_mlp + moe_layers * (router + shared)
    expert = 3 * h * model.moe_ffn_hidden_size + ((2 * model.moe_ffn_hidden_size + h) if spec.gpt_oss else 0)
    experts = moe_layers * (model.num_experts or 0) * expert
    return dense, experts


def _delta_net_parameters(model: ModelConfig) -> int:
    """One Gated DeltaNet layer's: in_proj (q, k, v, z, b, a), the convolution over q, k, v, A_log, dt_bias, the
    gated norm and out_proj."""
    linear, h = model.linear_attention, model.hidden_size
    qk, v = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
    in_proj = h * (2 * qk + 2 * v + 2 * linear.num_value_heads)
    return in_proj + (2 * qk + v) * linear.conv_kernel + 2 * linear.num_value_heads + linear.value_head_dim + v * h

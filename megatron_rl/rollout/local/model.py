"""Load a Hugging Face causal LM for the local engine and describe what the engine needs of it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = (
    "qwen3_moe",
    "qwen3",
    "qwen2",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "llama",
    "mistral",
    "minimax_m2",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "deepseek_v32",
    "glm_moe_dsa",
    "qwen3_next",
    "qwen3_5_moe_text",
)
# MLA families: transformers caches the compressed latent and the rotary key; with an indexer (DeepSeek sparse
# attention) its keys too, and the layers take their mask as "indexed_attention"
_MLA = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
_INDEXED = ("deepseek_v32", "glm_moe_dsa")
# transformers' attention the engine runs: SDPA, but eager for gpt-oss (its attention sinks) and Gemma 2 (its
# attention soft-capping): transformers refuses SDPA for both
_EAGER = ("gpt_oss", "gemma2")
# families whose sliding-window layers the engine masks (`ModelInfo.sliding_window`)
_SLIDING = ("gpt_oss", "gemma2", "gemma3_text")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model: shapes for the KV cache and routed experts, stop tokens."""

    path: str
    family: str
    num_layers: int
    num_kv_heads: int  # heads of the KV cache (MLA: 1, its latent)
    head_dim: int  # width of a cached key (MLA: kv_lora_rank)
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    moe_layers: tuple[int, ...]  # indices of layers with a router, in order
    num_experts: int  # 0 for dense models
    top_k: int  # experts per token, 0 for dense models
    dtype: torch.dtype
    device: torch.device
    value_dim: int = 0  # width of a cached value; 0 = head_dim (MLA: qk_rope_head_dim, the shared rotary key)
    sliding_window: int | None = None  # keys a sliding layer sees (the query's own included); None: no sliding layer
    final_logit_softcapping: float | None = None  # Gemma: logits c * tanh(logits / c)
    indexer_dim: int = 0  # DeepSeek sparse attention: width of an indexer key the cache keeps (0: no indexer)
    linear_layers: tuple[int, ...] = ()  # Gated DeltaNet layers (Qwen3-Next, Qwen3.5): a recurrent state each
    conv_shape: tuple[int, int] = (0, 0)  # their convolution window: [q, k, v channels, kernel]
    state_shape: tuple[int, int, int] = (0, 0, 0)  # their recurrent state: [value heads, key width, value width]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def resolve_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """`auto` = float32 on CPU (exact log-probs), the checkpoint's dtype on GPU."""
    if name == "auto":
        if device.type == "cpu" or config_dtype is None:
            return torch.float32
        return config_dtype
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r}: allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _eos_ids(path: Path, config) -> tuple[int, ...]:
    ids: list[int] = []
    gen_cfg = path / "generation_config.json"
    sources = [getattr(config, "eos_token_id", None)]
    if gen_cfg.is_file():
        sources.append(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    for value in sources:
        if value is None:
            continue
        for tok in value if isinstance(value, list) else [value]:
            if int(tok) not in ids:
                ids.append(int(tok))
    return tuple(ids)


def load_model(path: str, device: str = "cpu", dtype: str = "auto") -> tuple[torch.nn.Module, ModelInfo]:
    """The model in eval mode on `device`, with SDPA attention, and its `ModelInfo`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model {path}: no config.json (expected a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(folder)
    family = getattr(config, "model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"--model {path}: model_type {family!r} is not supported; allowed: {SUPPORTED_FAMILIES}")
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev, getattr(config, "dtype", None))
    attention = "eager" if family in _EAGER else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=attention)
    model.to(dev).eval()
    model.requires_grad_(False)

    moe_layers = tuple(i for i, layer in enumerate(model.model.layers) if router_of(layer) is not None)
    num_experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads, value_dim = config.num_key_value_heads, 0
    if family in _MLA:  # transformers caches MLA's compressed latent and rotary key, one "head"
        kv_heads, head_dim, value_dim = 1, config.kv_lora_rank, config.qk_rope_head_dim
        latent_norms_at_rms_norm_eps(model, config.rms_norm_eps)
    info = ModelInfo(
        path=str(folder),
        family=family,
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        eos_token_ids=_eos_ids(folder, config),
        moe_layers=moe_layers,
        num_experts=num_experts if moe_layers else 0,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if moe_layers else 0,
        dtype=torch_dtype,
        device=dev,
        sliding_window=_sliding_window(config),
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        indexer_dim=config.index_head_dim if family in _INDEXED else 0,
        **_linear_attention(config),
    )
    return model, info


def _linear_attention(config: Any) -> dict[str, Any]:
    """`ModelInfo`'s DeltaNet fields of a config with `linear_attention` layers (none otherwise)."""
    types = getattr(config, "layer_types", None) or ()
    if "linear_attention" not in types:
        return {}
    keys, values = config.linear_key_head_dim, config.linear_value_head_dim
    return dict(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        conv_shape=(2 * config.linear_num_key_heads * keys + config.linear_num_value_heads * values,
                    config.linear_conv_kernel_dim),
        state_shape=(config.linear_num_value_heads, keys, values),
    )  # fmt: skip


def latent_norms_at_rms_norm_eps(model: torch.nn.Module, eps: float) -> None:
    """MLA's latent RMSNorms at `rms_norm_eps`, as the trainer (Megatron's one norm epsilon), SGLang and vLLM
    compute them: transformers fixes theirs at 1e-6 (DeepSeek-V3's value; GLM-5's rms_norm_eps is 1e-5)."""
    for layer in model.model.layers:
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(layer.self_attn, name, None)
            if norm is not None:
                norm.variance_epsilon = eps


def router_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's router (`mlp.gate`; gpt-oss: `mlp.router`), whose forward returns the chosen experts
    third; None in a dense layer."""
    router = getattr(layer.mlp, "router", None)
    return getattr(layer.mlp, "gate", None) if router is None else router


def _sliding_window(config: Any) -> int | None:
    """The window of a config with sliding layers (`_SLIDING`; other families' windows are refused or absent)."""
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "model_type", "") not in _SLIDING or "sliding_attention" not in types:
        return None
    return getattr(config, "sliding_window", None)

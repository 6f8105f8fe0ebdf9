"""Hugging Face checkpoint names <-> Megatron parameter names, one declarative table per family.

Megatron names here are *global* names (`models.init.iter_param_shards`): local-spec names
(Transformer Engine's fused norms and grouped experts are mapped to them there), global layer
numbers across pipeline stages, global expert ids across EP. HF names are the checkpoint names
that `save_pretrained`, the Hub and SGLang use (one tensor per expert).

A rule joins one Megatron tensor and one or more HF tensors:

- `copy`: the same tensor.
- `vocab`: the same rows; Megatron's vocabulary padding is cut on export and zero-filled on import.
- `qkv`: Megatron's fused QKV rows are grouped per KV head, `[q of the group's heads, k, v]` per
  group; HF has separate q, k, v projections (weights and biases alike).
- `gate_up`: Megatron's SwiGLU `linear_fc1` is `[gate; up]` stacked on rows.
- `interleaved` / `interleaved_t`: gpt-oss's expert `gate_up_proj` (bias / weight) interleaves gate and up
  (gate j at 2j, up j at 2j + 1); its weights, and `down_proj`'s (`transpose`), are stored transposed ([in, out]).
  Its checkpoints stack a layer's experts (`fused_experts`): the rules name one slice per expert.
- `gated_qkv`, `delta_fused`, `delta_split`: Qwen3-Next's and Qwen3.5's gated attention and DeltaNet projections
  (`delta_layouts`); their rules apply to full-attention (`layers="full"`) or DeltaNet (`"linear"`) layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.config import ModelConfig
from megatron_rl.models.delta_layouts import DELTA_KINDS, from_hf_parts, to_hf_parts
from megatron_rl.models.families import check_family, linear_attention_pattern, moe_layer_pattern
from megatron_rl.models.fused_experts import stacked_shapes, stacks_experts
from megatron_rl.models.hf_config import ConversionError

_L = "decoder.layers.{layer}."
_P = "model.layers.{layer}."


@dataclass(frozen=True)
class Rule:
    """Megatron pattern <-> HF patterns; `{layer}` / `{expert}` are global indices.

    `shapes` gives each HF tensor's shape in symbols (see `HFMapping.dims`); `layers` limits a
    per-layer rule to dense or MoE layers; `requires` names the ModelConfig switch it needs
    (`untied` = not `tie_word_embeddings`; `q_lora` / `no_q_lora`: MLA with or without a
    query compression; `shared_experts`: `moe_shared_expert_size` set).
    """

    megatron: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[str, ...], ...]
    kind: str = "copy"
    layers: str = "all"
    requires: str | None = None


_BASE: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (("V", "H"),), "vocab"),
    Rule("output_layer.weight", ("lm_head.weight",), (("V", "H"),), "vocab", requires="untied"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), (("H",),)),
    Rule(_L + "input_layernorm.weight", (_P + "input_layernorm.weight",), (("H",),)),
    Rule(_L + "pre_mlp_layernorm.weight", (_P + "post_attention_layernorm.weight",), (("H",),)),
    Rule(
        _L + "mlp.linear_fc1.weight",
        (_P + "mlp.gate_proj.weight", _P + "mlp.up_proj.weight"),
        (("F", "H"), ("F", "H")),
        "gate_up",
        layers="dense",
    ),
    Rule(_L + "mlp.linear_fc2.weight", (_P + "mlp.down_proj.weight",), (("H", "F"),), layers="dense"),
)
_GQA: tuple[Rule, ...] = (
    Rule(
        _L + "self_attention.linear_qkv.weight",
        tuple(_P + f"self_attn.{x}_proj.weight" for x in "qkv"),
        (("Q", "H"), ("KV", "H"), ("KV", "H")),
        "qkv",
    ),
    Rule(
        _L + "self_attention.linear_qkv.bias",
        tuple(_P + f"self_attn.{x}_proj.bias" for x in "qkv"),
        (("Q",), ("KV",), ("KV",)),
        "qkv",
        requires="add_qkv_bias",
    ),
    Rule(_L + "self_attention.linear_proj.weight", (_P + "self_attn.o_proj.weight",), (("H", "Q"),)),
)


def _qk_norms(q_shape: str, k_shape: str) -> tuple[Rule, ...]:
    """QK-norm weights: per head (`D`, Qwen3) or over the whole projection (`Q` / `KV`, MiniMax-M2)."""
    return tuple(
        Rule(_L + f"self_attention.{x}_layernorm.weight", (_P + f"self_attn.{x}_norm.weight",), ((shape,),),
             requires="qk_layernorm")
        for x, shape in (("q", q_shape), ("k", k_shape))
    )  # fmt: skip


_COMMON = _BASE + _GQA + _qk_norms("D", "D")
_A = _L + "self_attention."
_HA = _P + "self_attn."
# DeepSeek's MLA: every tensor is a copy (Megatron's per-head [nope, rope] and [nope, v] rows are HF's).
_MLA: tuple[Rule, ...] = (
    Rule(_A + "linear_q_proj.weight", (_HA + "q_proj.weight",), (("QH", "H"),), requires="no_q_lora"),
    Rule(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",), (("QA", "H"),), requires="q_lora"),
    Rule(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",), (("QA",),), requires="q_lora"),
    Rule(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",), (("QH", "QA"),), requires="q_lora"),
    Rule(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",), (("KVA", "H"),)),
    Rule(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",), (("KVL",),)),
    Rule(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",), (("KVB", "KVL"),)),
    Rule(_A + "linear_proj.weight", (_HA + "o_proj.weight",), (("H", "OV"),)),
)
# DeepSeek sparse attention's lightning indexer (models.dsa_attention), named as Megatron-Core's DSAIndexer.
_INDEXER: tuple[Rule, ...] = tuple(
    Rule(_A + f"core_attention.indexer.{mg}", (_HA + f"indexer.{hf}",), (shape,))
    for mg, hf, shape in (
        ("linear_wq_b.weight", "wq_b.weight", ("IQ", "QA")),
        ("linear_wk.weight", "wk.weight", ("ID", "H")),
        ("k_norm.weight", "k_norm.weight", ("ID",)),
        ("k_norm.bias", "k_norm.bias", ("ID",)),
        ("linear_weights_proj.weight", "weights_proj.weight", ("IN", "H")),
    )
)
# The sigmoid router's fp32 expert bias, and the shared experts (one SwiGLU MLP of width S).
_SIGMOID_MOE: tuple[Rule, ...] = (
    Rule(_L + "mlp.router.expert_bias", (_P + "mlp.gate.e_score_correction_bias",), (("E",),), layers="moe"),
    Rule(
        _L + "mlp.shared_experts.linear_fc1.weight",
        (_P + "mlp.shared_experts.gate_proj.weight", _P + "mlp.shared_experts.up_proj.weight"),
        (("S", "H"), ("S", "H")),
        "gate_up",
        layers="moe",
        requires="shared_experts",
    ),
    Rule(
        _L + "mlp.shared_experts.linear_fc2.weight",
        (_P + "mlp.shared_experts.down_proj.weight",),
        (("H", "S"),),
        layers="moe",
        requires="shared_experts",
    ),
)


def _experts(router: str, expert: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    mg = _L + "mlp.experts.local_experts.{expert}."
    return (
        Rule(_L + "mlp.router.weight", (_P + router,), (("E", "H"),), layers="moe"),
        Rule(
            mg + "linear_fc1.weight",
            (_P + expert + gate, _P + expert + up),
            (("M", "H"), ("M", "H")),
            "gate_up",
            layers="moe",
        ),
        Rule(mg + "linear_fc2.weight", (_P + expert + down,), (("H", "M"),), layers="moe"),
    )


_DEEPSEEK_EXPERTS = _experts(
    "mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"
)
_MIXTRAL_EXPERTS = _experts(
    "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.", "w1.weight", "w3.weight", "w2.weight"
)
_MG_EXPERT = _L + "mlp.experts.local_experts.{expert}."
_GPT_OSS_EXPERT = _P + "mlp.experts.{expert}."  # a slice of the stacked tensor (fused_experts)
# gpt-oss: o_proj's bias, the sinks, the router's bias, the experts' biases and their stacked, transposed layout.
_GPT_OSS: tuple[Rule, ...] = (
    Rule(_A + "linear_proj.bias", (_HA + "o_proj.bias",), (("H",),)),
    Rule(_A + "core_attention.softmax_offset", (_HA + "sinks",), (("NH",),)),
    Rule(_L + "mlp.router.weight", (_P + "mlp.router.weight",), (("E", "H"),), layers="moe"),
    Rule(_L + "mlp.router.bias", (_P + "mlp.router.bias",), (("E",),), layers="moe"),
    Rule(_MG_EXPERT + "linear_fc1.weight", (_GPT_OSS_EXPERT + "gate_up_proj",), (("H", "2M"),), "interleaved_t",
         layers="moe"),
    Rule(_MG_EXPERT + "linear_fc1.bias", (_GPT_OSS_EXPERT + "gate_up_proj_bias",), (("2M",),), "interleaved",
         layers="moe"),
    Rule(_MG_EXPERT + "linear_fc2.weight", (_GPT_OSS_EXPERT + "down_proj",), (("M", "H"),), "transpose",
         layers="moe"),
    Rule(_MG_EXPERT + "linear_fc2.bias", (_GPT_OSS_EXPERT + "down_proj_bias",), (("H",),), layers="moe"),
)  # fmt: skip
# Gemma: the norm before the MLP is pre_feedforward_layernorm; post_attention_layernorm and post_feedforward_layernorm
# normalise the attention's and the MLP's outputs (models.gemma's post_layernorm).
_GEMMA: tuple[Rule, ...] = (
    *(r for r in _COMMON if r.megatron != _L + "pre_mlp_layernorm.weight"),
    Rule(_L + "pre_mlp_layernorm.weight", (_P + "pre_feedforward_layernorm.weight",), (("H",),)),
    Rule(_L + "self_attention.post_layernorm.weight", (_P + "post_attention_layernorm.weight",), (("H",),)),
    Rule(_L + "mlp.post_layernorm.weight", (_P + "post_feedforward_layernorm.weight",), (("H",),)),
)
_LA = _L + "self_attention."
_HL = _P + "linear_attn."
# Qwen3-Next and Qwen3.5: the gated full attention and its QK-norms, DeltaNet's tensors, the gated shared expert.
_QWEN3_NEXT: tuple[Rule, ...] = (
    Rule(_A + "linear_qkv.weight", tuple(_HA + f"{x}_proj.weight" for x in "qkv"), (("Q2", "H"), ("KV", "H"),
         ("KV", "H")), "gated_qkv", layers="full"),
    Rule(_A + "linear_proj.weight", (_HA + "o_proj.weight",), (("H", "Q"),), layers="full"),
    Rule(_A + "q_layernorm.weight", (_HA + "q_norm.weight",), (("D",),), layers="full"),
    Rule(_A + "k_layernorm.weight", (_HA + "k_norm.weight",), (("D",),), layers="full"),
    Rule(_LA + "conv1d.weight", (_HL + "conv1d.weight",), (("LC", "1", "LK"),), layers="linear"),
    Rule(_LA + "A_log", (_HL + "A_log",), (("LNV",),), layers="linear"),
    Rule(_LA + "dt_bias", (_HL + "dt_bias",), (("LNV",),), layers="linear"),
    Rule(_LA + "out_norm.weight", (_HL + "norm.weight",), (("LVD",),), layers="linear"),
    Rule(_LA + "out_proj.weight", (_HL + "out_proj.weight",), (("H", "LV"),), layers="linear"),
    Rule(_L + "mlp.shared_experts.linear_fc1.weight", (_P + "mlp.shared_expert.gate_proj.weight",
         _P + "mlp.shared_expert.up_proj.weight"), (("S", "H"), ("S", "H")), "gate_up", layers="moe"),
    Rule(_L + "mlp.shared_experts.linear_fc2.weight", (_P + "mlp.shared_expert.down_proj.weight",), (("H", "S"),),
         layers="moe"),
    Rule(_L + "mlp.shared_experts.gate_weight", (_P + "mlp.shared_expert_gate.weight",), (("1", "H"),), layers="moe"),
)  # fmt: skip
_DELTA_FUSED = Rule(_LA + "in_proj.weight", (_HL + "in_proj_qkvz.weight", _HL + "in_proj_ba.weight"),
                    (("LQKVZ", "H"), ("LBA", "H")), "delta_fused", layers="linear")  # fmt: skip
_DELTA_SPLIT = Rule(_LA + "in_proj.weight", tuple(_HL + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                    (("LC", "H"), ("LV", "H"), ("LNV", "H"), ("LNV", "H")), "delta_split", layers="linear")  # fmt: skip
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "qwen3_next": _BASE + _QWEN3_NEXT + (_DELTA_FUSED,) + _DEEPSEEK_EXPERTS,
    "qwen3_5_moe": _BASE + _QWEN3_NEXT + (_DELTA_SPLIT,) + _DEEPSEEK_EXPERTS,
    "qwen3_moe": _COMMON + _DEEPSEEK_EXPERTS,
    "deepseek_v3": _BASE + _MLA + _DEEPSEEK_EXPERTS + _SIGMOID_MOE,
    "glm4_moe": _COMMON + _DEEPSEEK_EXPERTS + _SIGMOID_MOE,
    "deepseek_v32": _BASE + _MLA + _INDEXER + _DEEPSEEK_EXPERTS + _SIGMOID_MOE,
    "glm_moe_dsa": _BASE + _MLA + _INDEXER + _DEEPSEEK_EXPERTS + _SIGMOID_MOE,
    "qwen3": _COMMON,
    "qwen2": _COMMON,
    "llama": _COMMON,
    "mistral": _COMMON,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "mixtral": _COMMON + _MIXTRAL_EXPERTS,
    "minimax_m2": _BASE
    + _GQA
    + _qk_norms("Q", "KV")
    + _MIXTRAL_EXPERTS
    + (
        Rule(
            _L + "mlp.router.expert_bias", (_P + "block_sparse_moe.e_score_correction_bias",), (("E",),), layers="moe"
        ),
    ),
    "gpt_oss": _BASE + _GQA + _GPT_OSS,
}


def _regex(pattern: str) -> re.Pattern[str]:
    escaped = re.escape(pattern).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(escaped)


class HFMapping:
    """The name and tensor mapping of one model (`ModelConfig`) of a supported family."""

    def __init__(self, model: ModelConfig) -> None:
        check_family(model)
        self.model = model
        self.rules = tuple(r for r in FAMILY_RULES[model.family] if self._enabled(r))
        self._compiled = [(_regex(r.megatron), r) for r in self.rules]
        self.moe_layers = moe_layer_pattern(model)
        self.linear_layers = linear_attention_pattern(model)
        linear = model.linear_attention
        qk, v, nv = linear.num_key_heads * linear.key_head_dim, linear.value_head_dim, linear.num_value_heads
        v *= nv
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        self.head_dim = head_dim
        self.dims: dict[str, int] = {
            "V": model.vocab_size,
            "H": model.hidden_size,
            "Q": model.num_attention_heads * head_dim,
            "KV": model.num_query_groups * head_dim,
            "D": head_dim,
            "NH": model.num_attention_heads,
            "F": model.ffn_hidden_size,
            "M": model.moe_ffn_hidden_size,
            "2M": 2 * model.moe_ffn_hidden_size,
            "E": model.num_experts or 0,
            "S": model.moe_shared_expert_size or 0,
            "QA": model.q_lora_rank or 0,
            "QH": model.num_attention_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim),
            "KVL": model.kv_lora_rank,
            "KVA": model.kv_lora_rank + model.qk_rope_head_dim,
            "KVB": model.num_attention_heads * (model.qk_nope_head_dim + model.v_head_dim),
            "OV": model.num_attention_heads * model.v_head_dim,
            "IQ": (model.dsa_index_n_heads or 0) * (model.dsa_index_head_dim or 0),
            "ID": model.dsa_index_head_dim or 0,
            "IN": model.dsa_index_n_heads or 0,
            "1": 1,
            "Q2": 2 * model.num_attention_heads * head_dim,
            "LC": 2 * qk + v,
            "LK": linear.conv_kernel,
            "LV": v,
            "LNV": nv,
            "LVD": linear.value_head_dim,
            "LQKVZ": 2 * qk + 2 * v,
            "LBA": 2 * nv,
        }

    def _enabled(self, rule: Rule) -> bool:
        if rule.requires is None:
            return True
        derived = {
            "untied": not self.model.tie_word_embeddings,
            "q_lora": self.model.q_lora_rank is not None,
            "no_q_lora": self.model.q_lora_rank is None,
            "shared_experts": self.model.moe_shared_expert_size is not None,
        }
        if rule.requires in derived:
            return derived[rule.requires]
        return bool(getattr(self.model, rule.requires))

    def _applies(self, rule: Rule, layer: int | None) -> bool:
        if rule.layers == "all" or layer is None:
            return True
        if rule.layers in ("full", "linear"):
            return bool(self.linear_layers[layer]) == (rule.layers == "linear")
        return bool(self.moe_layers[layer]) == (rule.layers == "moe")

    def _match(self, megatron_name: str) -> tuple[Rule, dict[str, str]]:
        for regex, rule in self._compiled:
            found = regex.fullmatch(megatron_name)
            if found is not None:
                fields = found.groupdict()
                layer = int(fields["layer"]) if "layer" in fields else None
                if self._applies(rule, layer):
                    return rule, fields
        raise ConversionError(
            f"Megatron parameter {megatron_name!r} has no Hugging Face name in the {self.model.family} mapping"
        )

    def hf_names(self, megatron_name: str) -> tuple[str, ...]:
        """The HF checkpoint names one Megatron (global) parameter is made of."""
        rule, fields = self._match(megatron_name)
        return tuple(p.format(**fields) for p in rule.hf)

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint tensor of this model and its shape, layer by layer."""
        out: dict[str, tuple[int, ...]] = {}
        experts = range(self.model.num_experts or 0)
        for rule in self.rules:
            if "{layer}" not in rule.megatron:
                self._add(out, rule, {})
                continue
            for layer in range(self.model.num_layers):
                if not self._applies(rule, layer):
                    continue
                if "{expert}" in rule.megatron:
                    for e in experts:
                        self._add(out, rule, {"layer": layer, "expert": e})
                else:
                    self._add(out, rule, {"layer": layer})
        return out

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """`expected_hf_shapes` as the checkpoint files hold them: where the family stacks a layer's experts
        (`fused_experts`), the stacked tensors in place of the per-expert slices."""
        shapes = self.expected_hf_shapes()
        if not stacks_experts(self.model.family):
            return shapes
        return stacked_shapes(shapes, self.model.family, self.model.num_experts or 0)

    def empty_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The 0-width tensors `transformers` writes for a sigmoid-router model without shared experts
        (`n_shared_experts = 0`: `mlp.shared_experts` of width 0 in every MoE layer). No Megatron parameter
        holds them: skipped on import, written as they are by `save_hf_folder`, never synced."""
        out: dict[str, tuple[int, ...]] = {}
        if self.model.moe_shared_expert_size is not None:
            return out
        for rule in FAMILY_RULES[self.model.family]:
            if rule.requires == "shared_experts":
                for layer in range(self.model.num_layers):
                    if self._applies(rule, layer):
                        self._add(out, rule, {"layer": layer})
        return out

    def _add(self, out: dict[str, tuple[int, ...]], rule: Rule, fields: dict[str, int]) -> None:
        for pattern, shape in zip(rule.hf, rule.shapes, strict=True):
            out[pattern.format(**fields)] = tuple(self.dims[s] for s in shape)

    def to_hf(self, megatron_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of one full (unsharded) Megatron parameter, contiguous. No copy is made
        where none is needed: outputs may be views of `tensor` (and share its memory)."""
        rule, fields = self._match(megatron_name)
        names = [p.format(**fields) for p in rule.hf]
        if rule.kind == "copy":
            parts = [tensor]
        elif rule.kind == "vocab":
            parts = [tensor[: self.model.vocab_size]]
        elif rule.kind == "qkv":
            parts = list(self._split_qkv(tensor))
        elif rule.kind == "gate_up":
            parts = list(tensor.chunk(2, dim=0))
        elif rule.kind in DELTA_KINDS:
            rows = [self.dims[shape[0]] for shape in rule.shapes]
            parts = to_hf_parts(rule.kind, tensor, self.model, rows)
        else:
            parts = [_to_stored(rule.kind, tensor)]
        return [(n, p.contiguous()) for n, p in zip(names, parts, strict=True)]

    def to_megatron(
        self,
        megatron_name: str,
        read: Callable[[str], torch.Tensor],
        full_shape: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The full Megatron parameter of shape `full_shape` built from the HF tensors `read(name)`;
        written into `out` (the full parameter itself, cast to its dtype) when given."""
        rule, fields = self._match(megatron_name)
        names = [p.format(**fields) for p in rule.hf]
        parts = [read(n) for n in names]
        shape = _merged_shape(rule.kind, parts, full_shape, self.model.vocab_size)
        if shape != tuple(full_shape):
            raise ConversionError(
                f"{megatron_name}: built from {names} with shape {list(shape)}, "
                f"but the Megatron model has {list(full_shape)}"
            )
        if out is None:
            out = torch.empty(full_shape, dtype=parts[0].dtype, device=parts[0].device)
        if rule.kind == "copy":
            out.copy_(parts[0])
        elif rule.kind in _STORED:
            out.copy_(_from_stored(rule.kind, parts[0]))
        elif rule.kind in DELTA_KINDS:
            out.copy_(from_hf_parts(rule.kind, parts, self.model))
        elif rule.kind == "vocab":  # Megatron's padding rows are zero
            out[: parts[0].shape[0]].copy_(parts[0])
            out[parts[0].shape[0] :].zero_()
        else:
            groups = self.model.num_query_groups if rule.kind == "qkv" else 1
            dest = out.view(groups, -1, *out.shape[1:])
            row = 0
            for part in parts:  # each part's rows of every group, in place
                part = part.view(groups, -1, *part.shape[1:])
                dest[:, row : row + part.shape[1]].copy_(part)
                row += part.shape[1]
        return out

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups = self.model.num_query_groups
        per_group = self.model.num_attention_heads // groups
        d, rest = self.head_dim, qkv.shape[1:]
        grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


_STORED = ("interleaved", "interleaved_t", "transpose")  # gpt-oss's expert layouts


def _to_stored(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Megatron expert tensor in gpt-oss's stored layout: [gate; up] rows interleaved, weights transposed."""
    if kind != "transpose":
        tensor = torch.stack(tensor.chunk(2, dim=0), dim=1).reshape(tensor.shape)
    return tensor if kind == "interleaved" else tensor.transpose(0, 1)


def _from_stored(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of `_to_stored`."""
    if kind != "interleaved":
        tensor = tensor.transpose(0, 1)
    return tensor if kind == "transpose" else torch.cat([tensor[0::2], tensor[1::2]], dim=0)


def _merged_shape(kind: str, parts: list[torch.Tensor], full_shape: Sequence[int], vocab: int) -> tuple[int, ...]:
    """The shape the Megatron tensor made of `parts` has (vocab: `vocab` rows padded to `full_shape`)."""
    first = tuple(parts[0].shape)
    if kind in ("copy", "interleaved"):
        return first
    if kind in ("transpose", "interleaved_t"):
        return first[::-1]
    if kind == "vocab":
        return (full_shape[0], *first[1:]) if first and first[0] == vocab <= full_shape[0] else first
    if any(tuple(p.shape[1:]) != first[1:] for p in parts):
        return (-1, *first[1:])  # parts of different widths: reported as a mismatch
    return (sum(p.shape[0] for p in parts), *first[1:])

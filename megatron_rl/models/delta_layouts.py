"""The tensor layouts of Qwen3-Next's and Qwen3.5's checkpoints <-> Megatron's (`hf_mapping`'s rule kinds).

- `gated_qkv`: Megatron's `linear_qkv` with the output gate holds, per query group, [q heads, gate heads, k, v]
  rows; transformers' `q_proj` holds [q, gate] per head, `k_proj` and `v_proj` apart.
- `delta_fused`: Megatron's DeltaNet `in_proj` is [q, k, v, z, b, a] rows, each over all heads; Qwen3-Next's
  `in_proj_qkvz` holds [q, k, v, z] per key head (v and z: the key head's group of value heads) and `in_proj_ba`
  [b, a] per key head.
- `delta_split`: Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, stacked in that order.
"""

from __future__ import annotations

import torch

from megatron_rl.config import ModelConfig

DELTA_KINDS = ("gated_qkv", "delta_fused", "delta_split")


def _sections(model: ModelConfig) -> tuple[int, int, int, int]:
    """Key heads, key width, value heads per key head, value width."""
    linear = model.linear_attention
    return (
        linear.num_key_heads,
        linear.key_head_dim,
        linear.num_value_heads // linear.num_key_heads,
        (linear.value_head_dim),
    )


def to_hf_parts(kind: str, tensor: torch.Tensor, model: ModelConfig, hf_rows: list[int]) -> list[torch.Tensor]:
    """The HF tensors of one full Megatron tensor of a `DELTA_KINDS` rule (`hf_rows`: their row counts)."""
    rest = tensor.shape[1:]
    if kind == "delta_split":
        return list(tensor.split(hf_rows))
    if kind == "gated_qkv":
        groups = model.num_query_groups
        per, d = model.num_attention_heads // groups, hf_rows[1] // groups
        q, gate, k, v = tensor.reshape(groups, -1, *rest).split([per * d, per * d, d, d], dim=1)
        q_proj = torch.stack([q.reshape(groups, per, d, *rest), gate.reshape(groups, per, d, *rest)], dim=2)
        return [q_proj.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    nk, dk, r, dv = _sections(model)
    q, k, v, z, b, a = (
        part.reshape(nk, -1, *rest)
        for part in tensor.split([nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r])
    )
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, *rest), torch.cat([b, a], dim=1).reshape(-1, *rest)]


def from_hf_parts(kind: str, parts: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """The full Megatron tensor of a `DELTA_KINDS` rule from its HF tensors (the inverse of `to_hf_parts`)."""
    rest = parts[0].shape[1:]
    if kind == "delta_split":
        return torch.cat(parts)
    if kind == "gated_qkv":
        groups = model.num_query_groups
        per, d = model.num_attention_heads // groups, parts[1].shape[0] // groups
        q_proj = parts[0].reshape(groups, per, 2, d, *rest)
        q, gate = (q_proj[:, :, i].reshape(groups, per * d, *rest) for i in range(2))
        k, v = (p.reshape(groups, d, *rest) for p in parts[1:])
        return torch.cat([q, gate, k, v], dim=1).reshape(-1, *rest)
    nk, dk, r, dv = _sections(model)
    q, k, v, z = parts[0].reshape(nk, -1, *rest).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = parts[1].reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v, z, b, a)])

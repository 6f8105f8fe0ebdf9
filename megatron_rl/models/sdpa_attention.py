"""The local specs' core attention through torch's fused kernels (`model.attention_backend = sdpa`).

Megatron's local `DotProductAttention` writes a [b x heads, s, s] score buffer and runs the softmax
unfused. `SDPAttention` computes the same causal attention without one:
- right-padded rows: one causal `F.scaled_dot_product_attention` (flash, cuDNN or memory-efficient
  on CUDA, torch's flash kernel on the CPU); the padding lies after every real token, so causality
  keeps it out of their results, as Megatron's causal mask does;
- a packed (THD) micro-batch on CUDA in bf16/fp16: `torch.nn.attention.varlen.varlen_attn` over the
  whole pack with the packer's `cu_seqlens` (on the device) and `max_seqlen` (an int), no host sync.
  Its signature changed after torch 2.10 (`is_causal` became `window_size=(-1, 0)`; `scale` and
  `enable_gqa` came later): `_varlen_kernel` reads which one is installed;
- a packed micro-batch elsewhere (the CPU, fp32, a torch without varlen): one causal SDPA per
  sequence (the block-diagonal mask without building it), the bounds read once per micro-batch
  (`_segment_sizes`), not once per layer.
Grouped-query attention is SDPA's `enable_gqa` (query head i uses key group i // (heads / groups), as
Megatron's `repeat_interleave`). Multi-latent attention's widths and softmax scale come in as
`MLADotProductAttention` takes them; flash kernels take one head width, so its narrower values are
zero-padded to the keys' width and the padding sliced off the result (without it SDPA would fall back
to its unfused kernel, which writes the scores).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_rl.models.mla_attention import MLADotProductAttention
from megatron_rl.models.packed_attention import check_packed

_VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # its flash kernel's


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., Tensor] | None, frozenset[str]]:
    """torch's `varlen_attn` and its parameter names; (None, empty) before torch 2.10. Imported on first
    use on CUDA only: the module imports TorchDynamo, about 1.3 s of CPU a process that never calls it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed micro-batches of `dtype` on `device` run as one varlen attention."""
    return device.type == "cuda" and dtype in _VARLEN_DTYPES and _varlen_kernel()[0] is not None


_last_bounds: tuple[Tensor, list[int]] | None = None


def _segment_sizes(cu_seqlens: Tensor) -> list[int]:
    """The pack's sequence lengths; read from `cu_seqlens` once per micro-batch (every layer of a
    forward gets the same tensor), so the per-sequence path costs one host read per micro-batch."""
    global _last_bounds
    if _last_bounds is None or _last_bounds[0] is not cu_seqlens:
        _last_bounds = (cu_seqlens, torch.diff(cu_seqlens).tolist())
    return _last_bounds[1]


class SDPAttention(MLADotProductAttention):
    """Causal core attention by `F.scaled_dot_product_attention` / varlen attention: q [s, b, heads, dim],
    k and v [s, b, groups, dim] (right-padded rows), or [t, heads/groups, dim] with `packed_seq_params` (THD)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """`MLADotProductAttention`'s arguments; the builder's attention dropout (0) only."""
        super().__init__(*args, **kwargs)
        if self.attention_dropout.p:
            raise ValueError(f"SDPA attention runs without dropout, but attention_dropout = {self.attention_dropout.p}")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPA attention takes no attention_bias (Megatron's local attention takes none either)")
        if packed_seq_params is None:
            return self._rows(query, key, value, attention_mask)
        check_packed(packed_seq_params, attention_mask)
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):  # the actor passes one tensor: no sync
            raise ValueError(
                f"packed attention: cu_seqlens_q {cu_q.tolist()} and cu_seqlens_kv {cu_kv.tolist()} differ"
            )
        if varlen_available(query.device, query.dtype):
            out = self._varlen(query, key, value, packed_seq_params)
        else:
            sizes = _segment_sizes(packed_seq_params.cu_seqlens_q)
            parts = [  # [n, heads, dim] -> [1, heads, n, dim]: the fused kernels take 4-D tensors only
                self._sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in qkv), None)[0].transpose(0, 1)
                for qkv in zip(query.split(sizes), key.split(sizes), value.split(sizes), strict=True)
            ]
            out = torch.cat(parts, dim=0)
        return out.reshape(out.shape[0], 1, -1)  # [t, 1, heads x v dim]

    @property
    def scale(self) -> float:
        """Megatron's softmax scale: it divides by the layer number under query-key layer scaling and
        its softmax multiplies by it again."""
        return self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def _sdpa(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        """SDPA of [b, heads, s, dim] tensors: causal, or where Megatron's mask (True hides a key) allows."""
        v_width = value.shape[-1]
        out = F.scaled_dot_product_attention(
            query,
            key,
            _pad_to(value, key.shape[-1]),
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            scale=self.scale,
            enable_gqa=query.shape[-3] != key.shape[-3],
        )
        return out[..., :v_width]

    def _rows(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Right-padded rows: [s, b, n, d] -> SDPA on [b, n, s, d] -> [s, b, heads x v dim]."""
        out = self._sdpa(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), attention_mask)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _varlen(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        """The whole pack in one varlen attention: [t, heads, dim] -> [t, heads, v dim]."""
        varlen_attn, parameters = _varlen_kernel()
        width, v_width = query.shape[-1], value.shape[-1]
        value = _pad_to(value, width)
        kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
        if "scale" in parameters:
            kwargs["scale"] = self.scale
        else:  # its default scale is 1 / sqrt(width)
            query = query * (self.scale * math.sqrt(width))
        if query.shape[1] != key.shape[1]:
            if "enable_gqa" in parameters:
                kwargs["enable_gqa"] = True
            else:
                repeat = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        cu = params.cu_seqlens_q
        out = varlen_attn(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_q, **kwargs)
        return out[..., :v_width]


def _pad_to(value: Tensor, width: int) -> Tensor:
    """Multi-latent attention's values zero-padded to the keys' width: flash kernels (CUDA's and the CPU's)
    take one head width; the padded channels of the result are zeros, sliced off by the caller."""
    return value if value.shape[-1] == width else F.pad(value, (0, width - value.shape[-1]))

"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA's core attention restricted to the keys a lightning indexer
picks, on the local and Transformer Engine specs alike.

Megatron-Core 0.16's `experimental_attention_variant/dsa.py` has the same indexer, but computed differently from
the checkpoints' (transformers' `DeepseekV32Indexer`, the reference inference code): it rotates the last
`qk_rope_head_dim` channels of an index head where the checkpoints rotate the first, always in MLA's interleaved
layout (DeepSeek-V3.2's indexer rotates the halves), applies a Hadamard rotation that needs bf16 and the
`fast_hadamard_transform` package, takes no packed sequences, and masks a right-padded row's keys by a dense causal
mask only. This module computes transformers' indexer, so that the trainer picks the engine's keys:

- `LightningIndexer`: q = wq_b(qr) in `index_n_heads` heads of `index_head_dim`, k = LayerNorm(wk(x)) (one head,
  eps 1e-6), both with RoPE on their first `qk_rope_head_dim` channels (half-split for DeepSeek-V3.2, interleaved
  for GLM-5; yarn's cos/sin factor as MLA's); score(i, j) = sum_h w_h(x_i) n_heads^-1/2 relu(q_ih . k_j d^-1/2),
  w = weights_proj(x); each query keeps the `index_topk` best of its causal keys (all of them when fewer).
- `SparseMLAttention`: the core attention over the kept keys (fp32 scores and softmax, as transformers' eager
  attention), `QUERY_CHUNK` queries at a time; packed (THD) sequences one at a time, positions restarting at each,
  as `packed_attention`.

The indexer is frozen (no gradient, `requires_grad` off; docs/training.md says why): it runs under `no_grad`, as in
transformers, and DeepSeek's indexer KL loss is not computed. Context parallelism is refused (`attention_choice`).
`take_near_ties` reports how often a query's selection sits at a near tie, where the engine's may differ.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megatron_rl.models.packed_attention import check_packed

_INDEXER_NORM_EPS = 1e-6  # transformers' and the reference code's, whatever rms_norm_eps is
# A query's k-th and (k+1)-th best keys scoring within this share of its best key's score of each other (exact ties
# included): float noise of another computation order (the engine's kernels, its KV-cached decode) may swap them.
NEAR_TIE = 1e-3
# Queries per block of the core attention: its buffers are [b, heads, QUERY_CHUNK, keys] (attention, fp32) and
# [b, QUERY_CHUNK, index heads, keys] (indexer), not s x s.
QUERY_CHUNK = 1024


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE on the last dimension of x [b, s, heads, r] (cos / sin [s, r], the two halves' frequencies repeated);
    `interleaved`: pairs (2i, 2i + 1) rotate, first gathered to [even; odd] as transformers does."""
    if interleaved:
        b, s, h, r = x.shape
        x = x.view(b, s, h, r // 2, 2).transpose(-1, -2).reshape(b, s, h, r)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class LightningIndexer(MegatronModule):
    """The indexer of one layer (parameters named as Megatron-Core's `DSAIndexer`'s), duplicated on TP ranks."""

    def __init__(self, config: Any, interleaved: bool, cp_group: Any = None) -> None:
        super().__init__(config=config)
        self.heads, self.width = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk, self.rope_width, self.interleaved = config.dsa_indexer_topk, config.qk_pos_emb_head_dim, interleaved
        dtype = config.params_dtype
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, self.heads * self.width, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(config.hidden_size, self.width, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(self.width, eps=_INDEXER_NORM_EPS, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, self.heads, bias=False, dtype=dtype)
        with torch.no_grad():
            for linear in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
                config.init_method(linear.weight)
        self.requires_grad_(False)
        self.near_ties: Tensor | None = None  # [near ties, contested queries] since the last take_near_ties
        if config.rope_type == "yarn":
            self.rotary: Any = YarnRotaryEmbedding(
                self.rope_width, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings,
                beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim, cp_group=cp_group,
            )  # fmt: skip
        else:
            self.rotary = RotaryEmbedding(self.rope_width, rotary_percent=1.0, rotary_base=config.rotary_base,
                                          cp_group=cp_group)  # fmt: skip

    def _cos_sin(self, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        out = self.rotary(length)
        emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
        emb = emb.reshape(length, self.rope_width).float()
        return (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)

    def _with_rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rope, rest = x.split([self.rope_width, self.width - self.rope_width], dim=-1)
        return torch.cat((_rotate(rope, cos, sin, self.interleaved), rest), dim=-1)

    @torch.no_grad()
    def project(self, x: Tensor, qr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries [b, s, heads, d], keys [b, s, d] and head weights [b, s, heads] (fp32, n_heads^-1/2 in) of
        hidden states x and compressed queries qr ([b, s, ...], positions 0..s-1), as transformers computes them."""
        b, s, _ = x.shape
        cos, sin = self._cos_sin(s, x.dtype)
        q = self._with_rope(self.linear_wq_b(qr).view(b, s, self.heads, self.width), cos, sin)
        k = self._with_rope(self.k_norm(self.linear_wk(x)).unsqueeze(2), cos, sin).squeeze(2)
        weights = self.linear_weights_proj(x.to(self.linear_weights_proj.weight.dtype)).float() * self.heads**-0.5
        return q, k, weights

    def scores(self, q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
        """Index scores [b, queries, keys] (fp32) of `project`'s outputs (any rows of q and weights, any keys)."""
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.width**-0.5
        return torch.matmul(weights.unsqueeze(-2), torch.relu(scores)).squeeze(-2)

    @torch.no_grad()
    def forward(self, q: Tensor, k: Tensor, weights: Tensor, allowed: Tensor) -> Tensor:
        """The keys each query attends, [b, queries, keys] bool: the `index_topk` best-scoring of its `allowed`
        keys. Counts the queries with more allowed keys than that, and those among them whose k-th and (k+1)-th
        best score within `NEAR_TIE` of each other (`take_near_ties`)."""
        scores = self.scores(q, k, weights).masked_fill(~allowed, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        top = scores.topk(min(k + 1, scores.shape[-1]), dim=-1)
        if k < scores.shape[-1]:
            last, after = top.values[..., k - 1], top.values[..., k]
            contested = after > float("-inf")
            near = contested & (last - after <= NEAR_TIE * top.values[..., 0].abs())
            counts = torch.stack((near.sum(), contested.sum())).to(torch.float64)
            self.near_ties = counts if self.near_ties is None else self.near_ties + counts
        return torch.zeros_like(allowed).scatter_(-1, top.indices[..., :k], True) & allowed


class SparseMLAttention(MegatronModule):
    """MLA's core attention (queries/keys of `k_channels`, values of `v_channels` per head) over the indexer's keys.
    Megatron's MLA passes the layer's hidden states `x` and compressed queries `qr` with
    `config.experimental_attention_variant = "dsa"`."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        width = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else width**-0.5
        self.indexer = LightningIndexer(
            config, config.dsa_indexer_interleaved, getattr(pg_collection, "cp", None) if pg_collection else None
        )
        self.tp_group = getattr(pg_collection, "tp", None) if pg_collection else None

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, x: Tensor, qr: Tensor, mask: Tensor | None) -> Tensor:
        """query/key [s, b, heads, dk], value [s, b, heads, dv], x [s, b, h], qr [s, b, r]; mask [b, 1, s, s] True =
        masked, or None. Out: [s, b, heads x dv]."""
        s, b, heads, dv = value.shape
        allowed = torch.ones(s, s, dtype=torch.bool, device=query.device).tril().expand(b, s, s)
        if mask is not None:
            allowed = allowed & ~mask[:, 0].to(torch.bool)
        q, k, weights = self.indexer.project(x.detach().transpose(0, 1), qr.detach().transpose(0, 1))
        out = []
        for start in range(0, s, QUERY_CHUNK):  # the score buffers of QUERY_CHUNK queries at a time
            end = min(start + QUERY_CHUNK, s)  # causal: these queries see the keys before `end` only
            keep = self.indexer(q[:, start:end], k[:, :end], weights[:, start:end], allowed[:, start:end, :end])
            scores = torch.einsum("sbhd,tbhd->bhst", query[start:end].float(), key[:end].float()) * self.softmax_scale
            probs = scores.masked_fill(~keep[:, None], float("-inf")).softmax(dim=-1)
            out.append(torch.einsum("bhst,tbhd->sbhd", probs.to(value.dtype), value[:end]))
        return torch.cat(out).reshape(s, b, heads * dv)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        x: Tensor | None = None,
        qr: Tensor | None = None,
    ) -> Tensor:
        if x is None or qr is None:
            raise ValueError("sparse attention needs the layer's hidden states and compressed queries (x, qr)")
        if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            if qr.shape[0] != x.shape[0]:
                qr = gather_from_sequence_parallel_region(qr, group=self.tp_group)
        if packed_seq_params is None:
            return self._attend(query, key, value, x, qr, attention_mask)
        check_packed(packed_seq_params, attention_mask)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds != packed_seq_params.cu_seqlens_kv.tolist() or bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(
                f"packed sparse attention: cu_seqlens {bounds} must start at 0, end at the {query.shape[0]} tokens "
                "and be the same for queries and keys"
            )
        sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
        qr = qr.reshape(query.shape[0], 1, -1)  # MLA squeezes the packs' batch dimension
        parts = zip(*(t.split(sizes) for t in (query, key, value, x, qr)), strict=True)
        out = [self._attend(q[:, None], k[:, None], v[:, None], h, r, None) for q, k, v, h, r in parts]
        return torch.cat(out, dim=0)  # [t, 1, heads x dv]


def take_near_ties(chunks: list[torch.nn.Module]) -> dict[str, float]:
    """`indexer_near_tie_frac`: of the queries whose indexer chose among more keys than it keeps, the share at a
    near tie (`NEAR_TIE`), over this rank's indexers since the last call, summed over all ranks; the counts reset.
    Empty without an indexer. The engine's own choice is not returned (SGLang has no such output): this measures
    how often the trainer's and the engine's selections can differ, the log-prob gap what it costs."""
    import torch.distributed as dist

    indexers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, LightningIndexer)]
    if not indexers:
        return {}
    device = next(chunks[0].parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for indexer in indexers:
        if indexer.near_ties is not None:
            total += indexer.near_ties
        indexer.near_ties = None
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"indexer_near_tie_frac": float(total[0] / total[1])} if total[1] > 0 else {}

"""Low-rank adapters (LoRA) on Megatron's column- and row-parallel linears and on the experts.

`attach_lora(chunks, model, seed)` freezes every base parameter and gives each targeted linear
(`models.lora_targets`: PEFT module names -> Megatron linears and their row slots) one adapter per
PEFT module, y = W x + (alpha / r) B A x, added by a forward hook on the base linear (the base keeps
its parameter names, so export, mapping and checkpoints of the base are unchanged). The adapters of a
chunk live in `chunk.lora_adapters`, outside the base modules.

Parallel layouts (A: [r, in], B: [out, r]; "partial" = a sum over the TP group is still due):

- column-parallel (q/k/v, gate/up): A whole on every rank, B split on its rows as W is. With
  sequence parallel the input is the rank's sequence shard: A x is all-gathered over the sequence
  (reduce-scattered in backward) and A's gradient, a sum over the sequence shards, is all-reduced;
  without it, A x enters the TP region as Megatron's own input does (all-reduce in backward).
- row-parallel (o, down): A split on its columns as W is, B whole. A x is partial: all-reduced
  (reduce-scattered over the sequence with SP, then B's gradient is all-reduced).
- experts (Megatron's explicit expert communication: the dispatcher gathers the input and reduces
  the output over expert-TP): no communication in the forward; fc2's output stays partial as W's
  does, and the gradients the expert-TP ranks hold in part (A of fc1, B of fc2) are all-reduced.
  Megatron's `SequentialMLP` experts are column/row linears; Transformer Engine's grouped experts
  (`weight{i}` per local expert, input split by `m_splits`) get one adapter set per expert; the local
  grouped experts (`models.grouped_experts`) do not call their linears and apply the same adapters themselves.

The reference policy is the same module with the adapters off (`adapters_disabled`); `merged_weights`
adds (alpha / r) B A into the base weights for the export and the merged sync, and restores them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_rl.config import ModelConfig
from megatron_rl.models.init import ParamShard, iter_param_shards
from megatron_rl.models.lora_targets import LORA_TARGETS, Target, check_target_modules

CONTAINER = "lora_adapters"  # the ModuleDict of a chunk that holds its adapters
_LINEAR = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.(?P<path>.+?)(?:\.local_experts\.(?P<expert>\d+))?\.(?P<name>linear_\w+)\.weight$"
)
_ROW_LINEARS = ("linear_proj", "linear_fc2")


class _GradSum(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over `group`: for a parameter whose
    gradient each rank of the group holds in part."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT module of one linear (and expert): where its A and B sit in the global model."""

    peft_module: str  # the HF module path, e.g. model.layers.0.self_attn.q_proj
    in_full: int
    out_full: int
    split: str | None  # "B" (column-parallel: B's rows), "A" (row-parallel: A's columns), None
    shard_rank: int
    shard_count: int
    is_expert: bool


class Adapter(torch.nn.Module):
    """A ([r, in] or its shard) and B ([out, r] or its shard) of one PEFT module."""

    def __init__(self, spec: AdapterSpec, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        in_local = spec.in_full // spec.shard_count if spec.split == "A" else spec.in_full
        out_local = spec.out_full // spec.shard_count if spec.split == "B" else spec.out_full
        self.A = torch.nn.Parameter(torch.empty(rank, in_local, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        for param, split in ((self.A, spec.split == "A"), (self.B, spec.split == "B")):
            param.tensor_model_parallel = split and spec.shard_count > 1
            param.partition_dim = 1 if param is self.A else 0
            param.partition_stride = 1
            if spec.is_expert:
                param.allreduce = False  # Megatron's DDP: reduced over the expert-data-parallel group

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full A or B."""
        spec = self.spec
        if spec.split != name or spec.shard_count == 1:
            return full
        return full.chunk(spec.shard_count, dim=1 if name == "A" else 0)[spec.shard_rank]


class AdapterContainer(torch.nn.ModuleDict):
    """`chunk.lora_adapters`: the LoraLinears of a chunk. Its sharded state dict names every A and B by
    its PEFT key (global layer and expert ids) under `ADAPTER_KEY_PREFIX`, split over (expert-)TP as it
    is held, so an adapter checkpoint loads under any layout."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, ShardedTensor]:
        out: dict[str, ShardedTensor] = {}
        for lora in self.values():
            for row in lora.experts:
                for adapter in row:
                    for name in ("A", "B"):
                        key = ADAPTER_KEY_PREFIX + peft_key(adapter.spec.peft_module, name)
                        out[key] = _sharded(key, adapter, name)
        return out


ADAPTER_KEY_PREFIX = "lora."


def _sharded(key: str, adapter: Adapter, name: str) -> ShardedTensor:
    spec = adapter.spec
    split = spec.split == name and spec.shard_count > 1
    if spec.is_expert:
        dp = ps.get_expert_data_parallel_rank()
    else:
        dp = ps.get_data_parallel_rank(with_context_parallel=True)
    offsets = [(1 if name == "A" else 0, spec.shard_rank, spec.shard_count)] if split else []
    replica = (0 if split else spec.shard_rank, dp)  # one writer: the first rank of each replica group
    return ShardedTensor.from_rank_offsets(key, getattr(adapter, name), *offsets, replica_id=replica)


def _peft_module(target: Target, layer: int, expert: int | None) -> str:
    return f"model.layers.{layer}." + target.hf_module.replace("{expert}", str(expert))


class LoraLinear(torch.nn.Module):
    """The adapters of one base linear (per local expert for grouped experts, per slot), and the hook
    that adds their output to the base's."""

    def __init__(
        self,
        kind: str,
        slots: list[str],
        adapters: list[list[Adapter]],
        *,
        scaling: float,
        dropout: float,
        sequence_parallel: bool,
        is_expert: bool,
        row_layout: tuple[int, list[tuple[str, int]]],
        norm: tuple[torch.Tensor, float] | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.slots, self.scaling = kind, slots, scaling
        self.experts = torch.nn.ModuleList(torch.nn.ModuleList(row) for row in adapters)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.sequence_parallel, self.is_expert = sequence_parallel, is_expert
        self.row_layout = row_layout  # (groups, [(slot, local rows per group)]) of the base's output rows
        self._norm = norm  # Transformer Engine's fused-norm linear: (norm weight, eps) applied to the input
        self.enabled = True
        self.group = ps.get_expert_tensor_parallel_group() if is_expert else ps.get_tensor_model_parallel_group()
        self.group_size = dist.get_world_size(self.group) if dist.is_initialized() else 1

    # --- forward ---
    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        if not self.enabled:
            return output
        out, bias = output
        x = args[0]
        if self._norm is not None:
            weight, eps = self._norm
            x = F.rms_norm(x, (x.shape[-1],), weight, eps)
        if len(self.experts) == 1:
            delta = self._delta(self.experts[0], x)
        else:  # grouped experts: the input is sorted by local expert, args[1] the tokens of each
            parts = torch.split(x, [int(n) for n in args[1]], dim=0)
            delta = torch.cat([self._delta(row, part) for row, part in zip(self.experts, parts, strict=True)], dim=0)
        return out + delta.to(out.dtype), bias

    def grad_summed(self, param: torch.Tensor, partial: bool) -> torch.Tensor:
        """`param`, whose gradient is summed over the TP (expert-TP) group in backward when `partial`."""
        return _GradSum.apply(param, self.group) if partial and self.group_size > 1 else param

    def _delta(self, adapters: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        sp = self.sequence_parallel and self.group_size > 1
        if self.kind == "column":
            partial_a = sp or (self.is_expert and self.group_size > 1)
            h = torch.cat([F.linear(x, self.grad_summed(a.A, partial_a)) for a in adapters], dim=-1)
            if not self.is_expert and self.group_size > 1:
                h = (
                    gather_from_sequence_parallel_region(h, group=self.group)
                    if sp
                    else (copy_to_tensor_model_parallel_region(h, group=self.group))
                )
            parts = [F.linear(hi, a.B) for hi, a in zip(h.chunk(len(adapters), dim=-1), adapters, strict=True)]
            return self._combine(parts) * self.scaling
        (adapter,) = adapters
        h = F.linear(x, adapter.A)
        partial_b = False
        if not self.is_expert and self.group_size > 1:
            if sp:
                h, partial_b = reduce_scatter_to_sequence_parallel_region(h, group=self.group), True
            else:
                h = reduce_from_tensor_model_parallel_region(h, group=self.group)
        elif self.is_expert:
            partial_b = True  # the output stays a partial sum; so does B's gradient
        return F.linear(h, self.grad_summed(adapter.B, partial_b)) * self.scaling

    def _combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The slots' outputs (last dim) in the base's local row layout (`row_layout`), zeros for a slot
        without an adapter: a fused QKV is [q, k, v] per query group, fc1 [gate; up]."""
        return in_row_layout(parts, self.slots, self.row_layout)

    # --- merged weights ---
    @torch.no_grad()
    def delta_weights(self) -> list[torch.Tensor]:
        """(alpha / r) B A per expert, this rank's shard in the base weight's layout."""
        out = []
        for row in self.experts:
            parts = [(a.B.float() @ a.A.float()).T for a in row]  # [in, out]: slots on the last dim
            out.append(in_row_layout(parts, self.slots, self.row_layout).T * self.scaling)
        return out


@dataclass
class LoraState:
    """What `attach_lora` built: per chunk the (base linear, its weights per expert, LoraLinear)."""

    linears: list[tuple[torch.nn.Module, list[torch.nn.Parameter], LoraLinear]]
    handles: list[torch.utils.hooks.RemovableHandle]

    def adapters(self) -> Iterator[Adapter]:
        for _, _, lora in self.linears:
            for row in lora.experts:
                yield from row


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial_a(peft_module: str, rank: int, in_full: int, seed: int) -> torch.Tensor:
    """PEFT's A initialisation (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn from
    `seed` and the module's name only, so that every layout starts from the same adapters."""
    bound = 1.0 / math.sqrt(in_full)
    return (torch.rand(rank, in_full, generator=_generator(seed, peft_module)) * 2 - 1) * bound


def _targets_of(model: ModelConfig) -> dict[str, list[Target]]:
    """Megatron linear path (e.g. self_attention.linear_qkv, mlp.experts.linear_fc1) -> its targets."""
    names = set(check_target_modules(model))
    by_linear: dict[str, list[Target]] = {}
    for target in LORA_TARGETS[model.family]:
        if target.peft_name in names:
            by_linear.setdefault(target.linear, []).append(target)
    return by_linear


def attach_lora(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> LoraState:
    """Freeze the base and add the adapters of `model.lora` to `chunks` (see the module doc)."""
    by_linear = _targets_of(model)
    state = LoraState(linears=[], handles=[])
    for chunk in chunks:
        chunk.requires_grad_(False)
        modules = dict(chunk.named_modules())
        per_module: dict[str, list[ParamShard]] = {}
        for shard in iter_param_shards([chunk], model):
            match = _LINEAR.match(shard.global_name)
            if match is not None and by_linear.get(f"{match['path']}.{match['name']}"):
                per_module.setdefault(shard.local_name.rsplit(".", 1)[0], []).append(shard)
        container = AdapterContainer()
        for path, shards in per_module.items():
            match = _LINEAR.match(shards[0].global_name)
            targets = by_linear[f"{match['path']}.{match['name']}"]
            lora = _build_linear(chunk, modules[path], shards, targets, model, seed)
            container[path.replace(".", "__")] = lora
            state.handles.append(modules[path].register_forward_hook(lora.hook))
            state.linears.append((modules[path], [s.param for s in shards], lora))
        chunk.add_module(CONTAINER, container)
    return state


def _build_linear(
    chunk: torch.nn.Module,
    base: torch.nn.Module,
    shards: list[ParamShard],
    targets: list[Target],
    model: ModelConfig,
    seed: int,
) -> LoraLinear:
    config = chunk.config
    lora_cfg = model.lora
    name = _LINEAR.match(shards[0].global_name)["name"]
    kind = "row" if name in _ROW_LINEARS else "column"
    rows: list[list[Adapter]] = []
    for shard in shards:  # one per local expert for grouped experts, else one
        match = _LINEAR.match(shard.global_name)
        layer, expert = int(match["layer"]), match["expert"]
        out_full, in_full = shard.full_shape
        slot_rows = _slot_rows(targets, out_full, model) if kind == "column" else [out_full]
        row = []
        for target, out_rows in zip(targets, slot_rows, strict=True):
            spec = AdapterSpec(
                peft_module=_peft_module(target, layer, None if expert is None else int(expert)),
                in_full=in_full,
                out_full=out_rows,
                split=None if shard.partition_dim is None else ("B" if kind == "column" else "A"),
                shard_rank=shard.shard_rank,
                shard_count=shard.shard_count,
                is_expert=shard.is_expert,
            )
            adapter = Adapter(spec, lora_cfg.rank, shard.param.dtype, shard.param.device)
            with torch.no_grad():
                adapter.A.copy_(adapter.take("A", initial_a(spec.peft_module, lora_cfg.rank, in_full, seed)))
            row.append(adapter)
        rows.append(row)
    count = shards[0].shard_count
    head = model.kv_channels or model.hidden_size // model.num_attention_heads
    if name == "linear_qkv":
        per_group = model.num_attention_heads // model.num_query_groups * head
        layout = (model.num_query_groups // count, [("q", per_group), ("k", head), ("v", head)])
    elif kind == "column" and targets[0].slot in ("gate", "up"):
        half = shards[0].full_shape[0] // 2 // count
        layout = (1, [("gate", half), ("up", half)])
    else:
        layout = (1, [("", shards[0].param.shape[0])])
    norm = None
    if hasattr(base, "layer_norm_weight"):  # Transformer Engine's LayerNorm + linear
        norm = (base.layer_norm_weight, config.layernorm_epsilon)
    return LoraLinear(
        kind,
        [t.slot for t in targets],
        rows,
        scaling=lora_cfg.alpha / lora_cfg.rank,
        dropout=lora_cfg.dropout,
        sequence_parallel=bool(config.sequence_parallel) and not shards[0].is_expert,
        is_expert=shards[0].is_expert,
        row_layout=layout,
        norm=norm,
    )


def in_row_layout(
    parts: list[torch.Tensor], slots: list[str], layout: tuple[int, list[tuple[str, int]]]
) -> torch.Tensor:
    """`parts` (one per slot in `slots`, the slot's rows on the last dim) in the row layout `layout`."""
    groups, pattern = layout
    by_slot = dict(zip(slots, parts, strict=True))
    like = parts[0]
    pieces = []
    for slot, rows in pattern:
        part = by_slot.get(slot)
        if part is None:
            part = like.new_zeros(*like.shape[:-1], groups * rows)
        pieces.append(part.reshape(*like.shape[:-1], groups, rows))
    return torch.cat(pieces, dim=-1).flatten(-2)


def _slot_rows(targets: list[Target], out_full: int, model: ModelConfig) -> list[int]:
    """The full output rows of each targeted slot of a fused column linear."""
    head = model.kv_channels or model.hidden_size // model.num_attention_heads
    rows = {
        "q": model.num_attention_heads * head,
        "k": model.num_query_groups * head,
        "v": model.num_query_groups * head,
        "gate": out_full // 2,
        "up": out_full // 2,
        "": out_full,
    }
    return [rows[t.slot] for t in targets]


def peft_key(peft_module: str, name: str) -> str:
    """The key of A ("A") or B ("B") of `peft_module` in a PEFT adapter_model.safetensors."""
    return f"base_model.model.{peft_module}.lora_{name}.weight"


@contextlib.contextmanager
def adapters_disabled(state: LoraState) -> Iterator[None]:
    """The base model alone (the reference policy) inside the block."""
    before = [lora.enabled for _, _, lora in state.linears]
    for _, _, lora in state.linears:
        lora.enabled = False
    try:
        yield
    finally:
        for (_, _, lora), was in zip(state.linears, before, strict=True):
            lora.enabled = was


@contextlib.contextmanager
def merged_weights(state: LoraState) -> Iterator[None]:
    """Inside the block the base weights hold W + (alpha / r) B A and the adapters are off (what the
    model computes is unchanged up to rounding); after it, the base weights are restored bit for bit."""
    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad(), adapters_disabled(state):
            for _, weights, lora in state.linears:
                for weight, delta in zip(weights, lora.delta_weights(), strict=True):
                    saved.append((weight, weight.detach().clone()))
                    weight.add_(delta.to(weight.dtype))
            yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


@torch.no_grad()
def gather_adapters(state: LoraState) -> dict[str, torch.Tensor]:
    """Every adapter tensor, full and fp32 on the CPU, under its PEFT key (sorted), on every rank (collective)."""
    mine: dict[str, torch.Tensor] = {}
    for adapter in state.adapters():
        spec = adapter.spec
        for name in ("A", "B"):
            local = getattr(adapter, name).detach()
            if spec.split == name and spec.shard_count > 1:
                group = (
                    ps.get_expert_tensor_parallel_group() if spec.is_expert else ps.get_tensor_model_parallel_group()
                )
                parts = [torch.empty_like(local) for _ in range(spec.shard_count)]
                dist.all_gather(parts, local.contiguous(), group=group)
                local = torch.cat(parts, dim=1 if name == "A" else 0)
            mine[peft_key(spec.peft_module, name)] = local.float().cpu().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(sorted(mine.items()))  # the same order under every layout
    everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return dict(sorted(merged.items()))


@torch.no_grad()
def load_adapters(state: LoraState, tensors: dict[str, torch.Tensor]) -> None:
    """Set every adapter of this rank from full tensors under their PEFT keys (e.g. `gather_adapters`'s
    or a PEFT adapter_model.safetensors); a key missing or of another shape raises ValueError."""
    for adapter in state.adapters():
        for name in ("A", "B"):
            key = peft_key(adapter.spec.peft_module, name)
            if key not in tensors:
                raise ValueError(f"adapter tensor {key!r} is missing")
            param = getattr(adapter, name)
            part = adapter.take(name, tensors[key])
            if part.shape != param.shape:
                raise ValueError(f"adapter tensor {key!r}: shape {tuple(tensors[key].shape)} does not fit")
            param.copy_(part)


def trainable_params(state: LoraState) -> int:
    """Trainable parameters of the whole model (every adapter counted once, across all ranks)."""
    counts = {a.spec.peft_module: a.A.shape[0] * (a.spec.in_full + a.spec.out_full) for a in state.adapters()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sum(counts.values())
    everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, counts)
    return sum({k: v for part in everyone for k, v in part.items()}.values())

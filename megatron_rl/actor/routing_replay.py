"""MoE routing replay (R2 and R3) on Megatron-Core's own `RouterReplay`.

Megatron gives every router a `RouterReplay` (built with `moe_enable_routing_replay`) whose
action decides the top-k: RECORD keeps the indices it computed, REPLAY_FORWARD uses the target
indices set before the forward, REPLAY_BACKWARD pops them (one entry per forward, first in first
out) when activation recompute reruns the layer in backward. This module drives those instances
of one model; Megatron is not patched.

Layouts. Routing per sample is SGLang's `[n - 1, num_layers, top_k]` (positions 0 .. n - 2; see
`actor.batch`). A router sees this rank's tokens of a micro-batch's [rows, max_len] input (right-
padded rows, or one packed row: each sample from its first position on) flattened position-major
(Megatron's [s, b, h] order): under context parallelism only the positions its CP rank holds
(`parallel.context_parallel`, in their local order), and with sequence parallelism only its
contiguous slice of those / TP; each pipeline stage holds only its layers. Recorded routing is
gathered over TP and CP back into the original positions.

Replay. Positions without given routing (each sample's last token, padding, extra rows) are routed
freely: a forward pre-hook on each router computes the free top-k (Megatron's own
`topk_routing_with_score_function`, recorded by the router's own RouterReplay) and sets the
router's target to the given experts where there are some and to the free ones elsewhere. So a
replay of routing recorded at unchanged weights repeats the forward bit for bit (every expert
sees the same tokens), and the same pass yields the metric: per layer, the given tokens whose
free expert set differs from the given one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor

from megatron_rl.parallel.context_parallel import ContextSplit, gather_from_context
from megatron_rl.parallel.device import local_device


def moe_routers(chunks: Sequence[torch.nn.Module]) -> list[tuple[int, TopKRouter]]:
    """(global 0-based layer index, router) of every MoE layer in this rank's model chunks, by layer."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ValueError(
                        "routing replay: the model was built without moe_enable_routing_replay "
                        "(megatron_rl.models.build_model(..., enable_routing_replay=True))"
                    )
                found.append((int(module.layer_number) - 1, module))
    return sorted(found, key=lambda item: item[0])


@dataclass(frozen=True)
class TokenSlice:
    """The positions of every row of a [rows, max_len] micro-batch that this rank routes, in its
    order: entries [start, stop) of `held` (the positions its CP rank holds; None = all, in order)."""

    rows: int
    max_len: int
    start: int
    stop: int
    held: Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.rows * (self.stop - self.start)

    @property
    def positions(self) -> Tensor:
        """long [stop - start]: the routed positions of a row."""
        if self.held is None:
            return torch.arange(self.start, self.stop)
        return self.held[self.start : self.stop].cpu()


def token_slice(
    rows: int, max_len: int, tp_rank: int, tp_size: int, sequence_parallel: bool, held: Tensor | None = None
) -> TokenSlice:
    """This rank's router tokens: all positions its CP rank holds (`held`; None = every one), or its
    sequence-parallel slice of them."""
    local = max_len if held is None else int(held.numel())
    if not sequence_parallel or tp_size == 1:
        return TokenSlice(rows, max_len, 0, local, held)
    if local % tp_size:
        where = "" if held is None else " on this CP rank"
        raise ValueError(f"sequence parallel needs max_len ({local}{where}) divisible by TP ({tp_size})")
    width = local // tp_size
    return TokenSlice(rows, max_len, tp_rank * width, (tp_rank + 1) * width, held)


def given_routing(
    routed: Sequence[Tensor],
    placements: Sequence[tuple[int, int]],
    sl: TokenSlice,
    layers: Sequence[int],
    top_k: int,
) -> list[Tensor]:
    """Per local layer, int64 [sl.tokens, top_k]: the given experts in a router's token order (0 where
    none is given; see `routed_token_mask`). `routed[k]`: sample k's routing in SGLang's layout
    [len - 1, num_layers, top_k], placed at (row, first position) `placements[k]` of the micro-batch.
    """
    if len(routed) != len(placements):
        raise ValueError(f"given_routing: {len(routed)} routing entries for {len(placements)} samples")
    full = torch.zeros(sl.rows, sl.max_len, len(layers), top_k, dtype=torch.long)
    layer_index = torch.tensor(list(layers), dtype=torch.long)
    for r, (row, start) in zip(routed, placements, strict=True):
        m = min(int(r.shape[0]), sl.max_len - start)
        full[row, start : start + m] = r[:m].cpu().index_select(1, layer_index).to(torch.long)
    local = full[:, sl.positions].transpose(0, 1)  # [s_local, rows, L_local, K]
    return [local[:, :, j].reshape(-1, top_k) for j in range(len(layers))]


def routed_token_mask(lengths: Sequence[int], placements: Sequence[tuple[int, int]], sl: TokenSlice) -> Tensor:
    """bool [sl.tokens]: this rank's tokens that have routing in SGLang's layout (all of a sample's
    positions but its last), for samples of `lengths` at `placements` (row, first position)."""
    full = torch.zeros(sl.rows, sl.max_len, dtype=torch.bool)
    for n, (row, start) in zip(lengths, placements, strict=True):
        full[row, start : start + max(n - 1, 0)] = True
    return full[:, sl.positions].transpose(0, 1).reshape(-1)


def check_routing_values(routed: Sequence[Tensor | None], layers: Sequence[int], num_experts: int) -> None:
    """Expert ids of the MoE layers must lie in [0, num_experts) and be distinct per token (None:
    another DP rank's sample, not checked here)."""
    index = torch.tensor(list(layers), dtype=torch.long)
    for i, r in enumerate(routed):
        if r is None:
            continue
        moe = r.index_select(1, index).to(torch.long)
        if moe.numel() == 0:
            continue
        lo, hi = int(moe.min()), int(moe.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routed_experts[{i}] holds expert ids in [{lo}, {hi}], outside [0, {num_experts})")
        ordered = moe.sort(dim=-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ValueError(f"routed_experts[{i}] repeats an expert within one token's top-k")


class RoutingReplay:
    """Record and replay the routing of one model's routers (this rank's MoE layers)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.routers = moe_routers(chunks)
        self.layers = [layer for layer, _ in self.routers]
        cfg = chunks[0].config
        if cfg.num_moe_experts is None:
            raise ValueError("routing replay needs an MoE model (model.num_experts)")
        self.top_k, self.num_experts = int(cfg.moe_router_topk), int(cfg.num_moe_experts)
        self.sequence_parallel = bool(cfg.sequence_parallel)
        self._given: list[Tensor | None] = [None] * len(self.routers)
        self._has: Tensor | None = None
        self._measure = False
        self._changed = torch.zeros(len(self.routers), dtype=torch.int64)
        self._total = torch.zeros(len(self.routers), dtype=torch.int64)
        self._hooks = [
            router.register_forward_pre_hook(self._make_pre_hook(j)) for j, (_, router) in enumerate(self.routers)
        ]

    # --- layout -----------------------------------------------------------------------------

    def token_slice(self, rows: int, max_len: int, context: ContextSplit | None = None) -> TokenSlice:
        """This rank's router tokens of a [rows, max_len] micro-batch split over CP by `context`."""
        return token_slice(
            rows,
            max_len,
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            self.sequence_parallel,
            None if context is None else context.positions(),
        )

    def _set_action(self, action: RouterReplayAction | None) -> None:
        for _, router in self.routers:
            if action is None:
                router.router_replay.clear_router_replay_action()
            else:
                router.router_replay.set_router_replay_action(action)

    # --- record -----------------------------------------------------------------------------

    def start_recording(self) -> None:
        """The next forwards compute their routing freely and keep it (read with `take_recorded`)."""
        self._given = [None] * len(self.routers)
        self._set_action(RouterReplayAction.RECORD)

    def take_recorded(self, rows: int, max_len: int, context: ContextSplit | None = None) -> Tensor:
        """int32 [rows, max_len, L_local, K]: the routing of the last forward, all positions of every
        row (gathered over TP under sequence parallelism, and over CP by `context`)."""
        sl = self.token_slice(rows, max_len, context)
        width = sl.stop - sl.start
        parts = []
        for layer, router in self.routers:
            idx = router.router_replay.get_recorded_indices()
            if idx is None or tuple(idx.shape) != (sl.tokens, self.top_k):
                got = None if idx is None else tuple(idx.shape)
                raise RuntimeError(f"layer {layer}: recorded routing is {got}, expected {(sl.tokens, self.top_k)}")
            parts.append(idx.to(torch.int32).view(width, rows, self.top_k))
        if parts:
            local = torch.stack(parts, dim=2)  # [s_local, rows, L_local, K]
        else:
            local = torch.zeros(width, rows, 0, self.top_k, dtype=torch.int32, device=local_device())
        if width != (max_len if context is None else context.local_length):
            group = ps.get_tensor_model_parallel_group()
            pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, local.contiguous(), group=group)
            local = torch.cat(pieces, dim=0)
        if context is not None:
            local = gather_from_context(local, context, dim=0)
        return local.transpose(0, 1).cpu()

    # --- replay -----------------------------------------------------------------------------

    def start_replay(
        self,
        routed: Sequence[Tensor],
        placements: Sequence[tuple[int, int]],
        lengths: Sequence[int],
        shape: tuple[int, int],
        measure: bool,
        context: ContextSplit | None = None,
    ) -> None:
        """The next forward, of a [rows, max_len] `shape` input (split over CP by `context`), replays
        `routed` (per sample, SGLang layout, at (row, first position) `placements`; free routing
        elsewhere); with `measure`, count the given tokens whose free routing differs."""
        sl = self.token_slice(*shape, context)
        self._given = given_routing(routed, placements, sl, self.layers, self.top_k)
        self._has = routed_token_mask(lengths, placements, sl)
        self._measure = measure
        self._set_action(RouterReplayAction.REPLAY_FORWARD)

    def replay_in_backward(self, output: Tensor) -> None:
        """Switch to REPLAY_BACKWARD when backward reaches `output` (before any recompute of this micro-batch)."""
        if not self.routers or not output.requires_grad:
            return

        def to_backward(grad: Tensor) -> Tensor:
            self._set_action(RouterReplayAction.REPLAY_BACKWARD)
            return grad

        output.register_hook(to_backward)

    def _make_pre_hook(self, j: int):
        def pre_hook(router: TopKRouter, args: tuple) -> None:
            replay = router.router_replay
            given = self._given[j]
            if replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD or given is None:
                return
            self._given[j] = None  # one target per forward; recompute pops it from Megatron's list
            with torch.no_grad():
                cfg = router.config
                logits = router.gating(args[0]).view(-1, self.num_experts)
                replay.set_router_replay_action(RouterReplayAction.RECORD)
                topk_routing_with_score_function(
                    logits,
                    self.top_k,
                    use_pre_softmax=cfg.moe_router_pre_softmax,
                    num_groups=cfg.moe_router_num_groups,
                    group_topk=cfg.moe_router_group_topk,
                    scaling_factor=cfg.moe_router_topk_scaling_factor,
                    score_function=router.score_function,
                    expert_bias=router.expert_bias,
                    router_replay=replay,
                )
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                free = replay.get_recorded_indices()
                has = self._has.to(free.device)
                given = given.to(free.device)
                if given.shape != free.shape:
                    raise RuntimeError(
                        f"layer {self.layers[j]}: given routing {tuple(given.shape)} but the router "
                        f"sees {tuple(free.shape)} tokens x top-k"
                    )
                replay.set_target_indices(torch.where(has.unsqueeze(-1), given, free))
                if self._measure:
                    changed = (given.sort(dim=-1).values != free.sort(dim=-1).values).any(dim=-1) & has
                    self._changed[j] += int(changed.sum())
                    self._total[j] += int(has.sum())

        return pre_hook

    def stop(self) -> None:
        """Free routing again; forget every recorded and target index."""
        self._set_action(None)
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self._given = [None] * len(self.routers)
        self._has, self._measure = None, False

    def close(self) -> None:
        self.stop()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # --- metric -----------------------------------------------------------------------------

    def take_change_counts(self) -> tuple[list[int], Tensor, Tensor]:
        """(local layer indices, changed tokens, given tokens) counted since the last call; resets."""
        out = (list(self.layers), self._changed.clone(), self._total.clone())
        self._changed.zero_()
        self._total.zero_()
        return out

"""Megatron's forward(-backward) schedule over this rank's micro-batches, and results on every rank.

Every rank holds the whole batch's index (lengths, masks, log-probs; a scattered step batch holds
the routed experts of this DP rank's samples only, `actor.batch_scatter`). `plan_for_rank` splits it
over the data-parallel (DP) ranks (token-balanced, per mini-batch for a step: `step_shares`) and
cuts this rank's share into micro-batches, right-padded or packed (`micro_batches.TokenBudget`), with the same count on every DP rank; `run_schedule` feeds them to
`get_forward_backward_func()` (1F1B when PP > 1), driving routing record/replay per micro-batch. A
packed micro-batch reaches the model as one [1, T] sequence with Megatron's `PackedSeqParams`
(THD, `cu_seqlens`): Transformer Engine's attention takes it on GPUs, the local spec's
`models.packed_attention` elsewhere; RoPE restarts with every sequence. On the last stage the
model stops at the decoder's final hidden states (no logits): `LogProbHead` turns them and the
output layer's weight shard into log-probs and entropy chunk by chunk
(`logprobs.vocab_parallel_logprobs_from_hidden`; packed, straight from the packed hidden states),
so no [tokens, V/TP] tensor exists in forward or backward. `compute_log_probs` returns the log-probs and
entropy of every response token (and, recording, the routing in SGLang's layout) of the WHOLE
batch on EVERY rank: owners fill their part of a zero buffer and one all-reduce sums it (exact:
each value has a single contributor).

Context parallelism (CP > 1, Transformer Engine's attention): every CP rank of a DP rank plans the
same micro-batches; each is padded so that it splits into 2 x CP chunks (right-padded rows to a
multiple of 2 x CP, packed samples each to one, `input_shapes`), and a CP rank feeds the model its
positions only (`batch.split_for_context`: Megatron's load-balanced chunks, per packed sequence
with the padded `cu_seqlens`). The head computes log-probs and entropy of those positions, and
`MicroBatchInputs.to_rows` gathers them over the CP group, so the loss sees whole rows on every CP
rank: every token mean, sequence count and GSPO's per-sequence ratio is the un-split one. One CP
rank reports (`is_output_owner`); each back-propagates its positions' share, which Megatron's DDP
sums over DP x CP (`optimizer.loss_scale` undoes its averaging).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_model_config, unwrap_model
from torch import Tensor

from megatron_rl.actor.batch import ActorBatch, MicroBatchInputs, build_inputs, packed_length, split_for_context
from megatron_rl.actor.logprobs import (
    LogProbs,
    TopLogProbs,
    vocab_parallel_logprobs_from_hidden,
    vocab_parallel_top_logprobs_from_hidden,
)
from megatron_rl.actor.micro_batches import (
    MicroBatch,
    TokenBudget,
    balance_across_ranks,
    plans_with_equal_count,
    step_shares,
    token_imbalance,
)
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.models.gemma import final_logit_softcap
from megatron_rl.parallel.context_parallel import round_up
from megatron_rl.parallel.device import local_device

LossFn = Callable[[MicroBatchInputs, Any], tuple[Tensor, Any]]
# The last stage's output of a micro-batch: (model, its final hidden states [s, b, H], the inputs) -> what the
# loss function reads: `LogProbHead`'s `LogProbs`, or the critic's values (`megatron_rl.critic`)
Head = Callable[[torch.nn.Module, Tensor, MicroBatchInputs], Any]


def _dp_shares(lengths: Sequence[int]) -> list[list[int]]:
    dp = ps.get_data_parallel_world_size()
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} samples cannot be split over {dp} data-parallel ranks (need >= {dp})")
    return balance_across_ranks(lengths, dp)


def plan_for_rank(lengths: Sequence[int], budget: TokenBudget, updates: int = 1) -> list[MicroBatch]:
    """This DP rank's micro-batches (indices into `lengths`); every DP rank gets the same count.
    `updates` > 1: a whole step's batch, split as its `updates` mini-batches are (`step_shares`), so
    that a DP rank computes log-probs of the samples it trains on (and holds)."""
    _dp_shares(lengths)  # the error for too few samples
    shares = step_shares(lengths, updates, ps.get_data_parallel_world_size())
    plans = plans_with_equal_count(
        [[lengths[i] for i in share] for share in shares], budget.tokens, packed=budget.packed
    )
    rank = ps.get_data_parallel_rank()
    mine = shares[rank]
    return [MicroBatch(tuple(mine[j] for j in mb.indices), mb.lengths, mb.packed) for mb in plans[rank].micro_batches]


def dp_token_imbalance(lengths: Sequence[int]) -> float:
    """max / mean of the DP ranks' token counts under `plan_for_rank`'s split."""
    return token_imbalance([sum(lengths[i] for i in share) for share in _dp_shares(lengths)])


def context_align() -> int:
    """What every sequence's length must be a multiple of for the CP split: 2 x CP, or 1 without CP."""
    cp = ps.get_context_parallel_world_size()
    return 2 * cp if cp > 1 else 1


def input_shapes(micro_batches: Sequence[MicroBatch], config: Any) -> list[tuple[int, int]]:
    """The model's input shape of each micro-batch over all CP ranks, (rows, max_len) or, packed,
    (1, tokens) with every sample padded to a multiple of 2 x CP (`context_align`): the length a
    multiple of 2 x CP, and of TP x that under sequence parallelism (each CP rank's part splits over
    TP), and one shape for all when pipeline stages exchange fixed-shape tensors (no
    `variable_seq_lengths`)."""
    tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    align = context_align()
    own = [(1, packed_length(mb.lengths, align)) if mb.packed else (mb.rows, mb.max_len) for mb in micro_batches]
    shapes = [(rows, round_up(length, tp * align)) for rows, length in own]
    if ps.get_pipeline_model_parallel_world_size() > 1 and not config.variable_seq_lengths:
        uniform = (max(r for r, _ in shapes), max(s for _, s in shapes))
        shapes = [uniform] * len(shapes)
    return shapes


def prepare_inputs(
    chunks: Sequence[torch.nn.Module],
    batch: ActorBatch,
    micro_batches: Sequence[MicroBatch],
    *,
    with_fields: Sequence[str] = (),
    every_response_token: bool = False,
) -> list[MicroBatchInputs]:
    """The micro-batches' tensors as this rank feeds them to the model (its CP part, under CP)."""
    config = get_model_config(chunks[0])
    device = local_device()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    return [
        split_for_context(
            build_inputs(
                batch,
                mb,
                device,
                pad_to=shape,
                with_fields=with_fields,
                every_response_token=every_response_token,
                align=context_align(),
            ),
            cp,
            cp_rank,
        )
        for mb, shape in zip(micro_batches, input_shapes(micro_batches, config), strict=True)
    ]


@dataclass(frozen=True)
class LogProbHead:
    """The last stage's output: log-probs of the targets and entropy, at `temperature`, over the real
    vocabulary (`vocab_size`: Megatron's padding rows ignored), `chunk_tokens` rows at a time; with the
    teacher's top-k in the micro-batch (`MicroBatchInputs.top_ids`), their log-probs too (`TopLogProbs`)."""

    temperature: float
    vocab_size: int
    chunk_tokens: int

    def __call__(self, model: torch.nn.Module, hidden: Tensor, mb: MicroBatchInputs) -> LogProbs | TopLogProbs:
        """`hidden`: what the last stage's GPTModel returned with its output layer skipped, [s, b, H]
        (s / TP rows under sequence parallelism). The output layer's computation as Megatron does it:
        the sequence gathered over TP (its backward a reduce-scatter), or, without sequence
        parallelism, a copy whose gradient is all-reduced over TP; the weight shard of
        `output_layer` or, tied, the embedding's; the logits soft-capped where the model's are (Gemma)."""
        gpt = unwrap_model(model)
        tied = gpt.share_embeddings_and_output_weights
        weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
        sequence_parallel = gpt.output_layer.sequence_parallel
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=ps.get_tensor_model_parallel_group()
            )
        # Float16Module upcasts the last stage's output; the output layer computes in the weights' dtype
        hidden = hidden.to(weight.dtype)
        # [s, b] views of the [b, s] targets: the hidden states are used as they lie, never copied
        options = dict(
            mask=mb.head_mask.t(),
            chunk_tokens=self.chunk_tokens,
            vocab_size=self.vocab_size,
            reduce_hidden_grad=not sequence_parallel,
            softcap=final_logit_softcap(gpt),
        )
        top_ids = mb.head_top_ids
        if top_ids is not None:
            top = vocab_parallel_top_logprobs_from_hidden(
                hidden, weight, mb.head_target.t(), top_ids.transpose(0, 1), self.temperature, **options
            )
            rows = (mb.to_rows(top.logprobs.t()), mb.to_rows(top.entropy.t()), mb.to_rows(top.top.transpose(0, 1)))
            return TopLogProbs(*rows)
        out = vocab_parallel_logprobs_from_hidden(hidden, weight, mb.head_target.t(), self.temperature, **options)
        return LogProbs(mb.to_rows(out.logprobs.t()), mb.to_rows(out.entropy.t()))


@contextmanager
def hidden_states_out(model: torch.nn.Module) -> Iterator[None]:
    """While open, a last-stage GPTModel returns its final hidden states instead of logits (what its
    `post_process = False` means: the decoder, final norm included, but no output layer)."""
    gpt = unwrap_model(model)
    last = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = last


def packed_seq_params(mb: MicroBatchInputs) -> PackedSeqParams | None:
    """Megatron's THD description of a packed micro-batch (None for a right-padded one). Under CP the
    bounds are those of the whole sequence (every sample padded to a multiple of 2 x CP), given as
    `cu_seqlens_*_padded` too, as `get_thd_batch_on_this_cp_rank` gives them to Transformer
    Engine: a sample's padding is part of its segment, after its tokens, so causal attention keeps
    it out of every real token's result."""
    if mb.packing is None:
        return None
    p = mb.packing
    padded = p.cu_seqlens if mb.context is not None else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=p.cu_seqlens,
        cu_seqlens_kv=p.cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=p.max_seqlen,
        max_seqlen_kv=p.max_seqlen,
    )


@dataclass
class ScheduleOutput:
    """Per micro-batch, in plan order: what `loss_fn` returned second (last stage only, else empty),
    and the recorded routing [rows, max_len, L_local, K] (every rank, when recording)."""

    extras: list[Any]
    recorded: list[Tensor]


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    inputs: Sequence[MicroBatchInputs],
    loss_fn: LossFn,
    *,
    head: Head,
    forward_only: bool,
    routing: RoutingReplay | None = None,
    routing_mode: str | None = None,
    measure_routing: bool = False,
) -> ScheduleOutput:
    """One call of Megatron's forward-backward function over `inputs`.

    On the last pipeline stage `loss_fn(inputs, out)` gets `out = head(...)` (`LogProbHead`: `LogProbs` in
    the row layout at the target positions, 0 outside `target_mask`, both differentiable), and returns
    (loss to back-propagate, anything to keep). `routing_mode`: None (free routing), "record" or
    "replay" (the inputs' `routed_experts`, also during recompute in backward).
    """
    if routing_mode not in (None, "record", "replay"):
        raise ValueError(f"routing_mode must be None, 'record' or 'replay', got {routing_mode!r}")
    if routing_mode is not None and routing is None:
        raise ValueError(f"routing_mode = {routing_mode!r} needs a RoutingReplay")
    extras: list[Any] = []
    recorded: list[Tensor] = []

    def forward_step(data_iterator, model):
        mb: MicroBatchInputs = next(data_iterator)
        if routing_mode == "replay":
            if mb.routed_experts is None:
                raise ValueError(
                    "routing replay needs ActorBatch.routed_experts (R2: record them first; R3: the engine's)"
                )
            routing.start_replay(
                mb.routed_experts,
                mb.placements,
                mb.micro_batch.lengths,
                (mb.rows, mb.max_len),
                measure_routing,
                context=mb.context.split if mb.context is not None else None,
            )
        elif routing_mode == "record":
            routing.start_recording()
        with hidden_states_out(model):
            output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=packed_seq_params(mb))
        if routing_mode == "record":
            recorded.append(
                routing.take_recorded(mb.rows, mb.max_len, mb.context.split if mb.context is not None else None)
            )
        elif routing_mode == "replay" and not forward_only:
            routing.replay_in_backward(output)

        def loss_func(hidden: Tensor):
            loss, extra = loss_fn(mb, head(model, hidden, mb))
            extras.append(extra)
            return loss, {}

        return output, loss_func

    first = inputs[0]
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(inputs),
            model=list(chunks),
            num_microbatches=len(inputs),
            seq_length=first.max_len,
            micro_batch_size=first.rows,
            forward_only=forward_only,
        )
    finally:
        if routing is not None:
            routing.stop()
        for chunk in chunks:
            _drop_dispatcher_graphs(chunk)
    return ScheduleOutput(extras, recorded)


def _drop_dispatcher_graphs(model: torch.nn.Module) -> None:
    """Forget the tensors with an autograd graph that Megatron's MoE token dispatchers keep from their last
    forward (the routing probabilities: `probs`, `local_probs`). Through that graph the parameters' gradient
    accumulators, whose DDP hooks hold the model, stay reachable from the model itself: a cycle through
    autograd's C++ nodes, which Python's collector cannot see, so a model that has trained outlived its owner
    (and kept its process groups' gloo threads). A dispatcher recomputes them in every forward."""
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        for name, value in list(vars(dispatcher).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(dispatcher, name, None)


def is_output_owner() -> bool:
    """The one rank per pipeline replica whose last-stage results are shared (TP peers agree, and so
    do CP peers: the results are gathered over CP)."""
    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and is_context_owner()


def is_context_owner() -> bool:
    """CP rank 0, or every rank without CP: the one of the CP peers (which hold the same gathered
    results) that contributes them to a sum over all ranks."""
    return ps.get_context_parallel_rank() == 0


def share_response_values(batch: ActorBatch, owned: dict[int, Tensor]) -> list[Tensor]:
    """float32 [r_i] for every sample on every rank, from the ranks that computed them (`owned`)."""
    sizes = [batch.response_length(i) for i in range(len(batch))]
    buf = torch.zeros(sum(sizes), dtype=torch.float32, device=local_device())
    parts = list(buf.split(sizes))
    for i, value in owned.items():
        parts[i].copy_(value)
    dist.all_reduce(buf)
    return [p.cpu() for p in buf.split(sizes)]


def share_routing(
    batch: ActorBatch, owned: dict[int, Tensor], layers: Sequence[int], num_layers: int, top_k: int
) -> list[Tensor]:
    """int32 [n_i - 1, num_layers, top_k] for every sample on every rank; -1 in layers without a router.

    `owned[i]`: [n_i - 1, len(layers), top_k], this rank's layers of sample i.
    """
    sizes = [n - 1 for n in batch.lengths]
    buf = torch.zeros(sum(sizes), num_layers, top_k, dtype=torch.int32, device=local_device())
    parts = list(buf.split(sizes))
    index = torch.tensor(list(layers), dtype=torch.long, device=buf.device)
    for i, value in owned.items():
        parts[i].index_copy_(1, index, value.to(buf.device) + 1)  # +1: 0 marks "no router"
    dist.all_reduce(buf)
    buf -= 1
    return [p.cpu() for p in buf.split(sizes)]


@dataclass
class LogProbResult:
    """Whole-batch results, on every rank: float32 [r_i] per sample, and routing in SGLang's layout."""

    log_probs: list[Tensor]
    entropy: list[Tensor]
    routed_experts: list[Tensor] | None = None


def compute_log_probs(
    chunks: Sequence[torch.nn.Module],
    batch: ActorBatch,
    *,
    temperature: float,
    vocab_size: int,
    budget: TokenBudget,
    chunk_tokens: int,
    routing: RoutingReplay | None = None,
    routing_mode: str | None = None,
    updates: int = 1,
) -> LogProbResult:
    """Log-probs and entropy of every response token (no grad), optionally recording or replaying
    routing; `updates`: the step's `train.updates_per_step`, whose split over the DP ranks this one
    follows (`plan_for_rank`)."""
    micro_batches = plan_for_rank(batch.lengths, budget, updates)
    inputs = prepare_inputs(chunks, batch, micro_batches, every_response_token=True)
    head = LogProbHead(temperature, vocab_size, chunk_tokens)

    def loss_fn(mb: MicroBatchInputs, out: LogProbs) -> tuple[Tensor, Any]:
        return out.logprobs.new_zeros(()), (mb.response_rows(out.logprobs), mb.response_rows(out.entropy))

    training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            result = run_schedule(
                chunks, inputs, loss_fn, head=head, forward_only=True, routing=routing, routing_mode=routing_mode
            )
    finally:
        for c, was in zip(chunks, training, strict=True):
            c.train(was)
    owner = is_output_owner()
    logp: dict[int, Tensor] = {}
    ent: dict[int, Tensor] = {}
    if owner:
        for mb, (lp_rows, ent_rows) in zip(inputs, result.extras, strict=True):
            for i, lp, e in zip(mb.micro_batch.indices, lp_rows, ent_rows, strict=True):
                logp[i], ent[i] = lp, e
    out = LogProbResult(share_response_values(batch, logp), share_response_values(batch, ent))
    if routing_mode == "record":
        mine: dict[int, Tensor] = {}
        if ps.get_tensor_model_parallel_rank() == 0 and is_context_owner():
            for mb, rec in zip(inputs, result.recorded, strict=True):
                for i, n, (row, start) in zip(
                    mb.micro_batch.indices, mb.micro_batch.lengths, mb.placements, strict=True
                ):
                    mine[i] = rec[row, start : start + n - 1]
        config = get_model_config(chunks[0])
        out.routed_experts = share_routing(batch, mine, routing.layers, config.num_layers, config.moe_router_topk)
    return out

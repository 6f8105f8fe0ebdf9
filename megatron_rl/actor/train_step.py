"""One RL update of the actor: mini-batches (optimizer steps) x micro-batches through Megatron's schedule.

Every rank holds the whole batch. It is cut into `train.updates_per_step` consecutive
mini-batches (fewer for a short batch: as many as hold one sample per DP rank), trained in order
`train.ppo_epochs` times over (verl's `ppo_epochs`: the same mini-batches each pass, the batch's old
log-probs those of before the first pass, so the ratio leaves 1 wherever the policy has moved); each gets one
global normaliser (`megatron_rl.losses.global_normalizer` over its whole response mask, after
`algorithm.is_correction = reject` took the rejected tokens out of it), is split over the DP ranks and
into micro-batches (`forward.plan_for_rank`; right-padded or packed, `micro_batches.TokenBudget`:
the loss sees one sample per row either way, so the normalisation is exact under any packing),
and runs forward + backward (1F1B when PP > 1) with the policy loss (or another `TokenLoss`, such as
the SFT cross-entropy), then one optimizer step with gradient clipping. Log-probs and entropy come
from the decoder's hidden states without logits (`forward.LogProbHead`). With the policy loss,
`algorithm.entropy_coef` > 0 adds the entropy bonus (`losses.entropy_bonus`: -coef x the entropy of the
loss tokens aggregated as the policy loss, `algorithm.loss_agg_mode`), back-propagated through the entropy.
Metrics are reduced over micro-batches and ranks with each key's own
operation (`losses.metric_reduce_op`) and returned, the same, on every rank: those of
`policy_loss` after `finalize_metrics` (with a bonus, `loss` includes it and `entropy_bonus` is
its value; with the teacher's top-k, it includes the distillation term, `distill_loss` is that term and
forward_kl_mean the top-k forward KL per loss token), plus entropy_mean (per loss token), grad_norm (before clipping), lr (the update's),
update_skipped, micro_batches (per DP rank), dp_token_imbalance (the DP ranks' token counts, max /
mean), is_rejected_frac (with is_correction reject: the share
of the loss tokens rejected) and, when replaying routing,
routing_changed_frac_layer{i} (per MoE layer i: the share of tokens with given routing whose free
top-k expert set differs) and routing_changed_frac (all layers); with DeepSeek sparse attention,
indexer_near_tie_frac (`models.dsa_attention.take_near_ties`: the share of the step's indexer selections at a near
tie, where the engine's may differ).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config
from torch import Tensor

from megatron_rl.actor.batch import RESPONSE_FIELDS, VALUE_FIELDS, ActorBatch, MicroBatchInputs
from megatron_rl.actor.forward import (
    Head,
    LogProbHead,
    dp_token_imbalance,
    is_output_owner,
    plan_for_rank,
    prepare_inputs,
    run_schedule,
)
from megatron_rl.actor.logprobs import LogProbs, TopLogProbs
from megatron_rl.actor.micro_batches import TokenBudget, mini_batches
from megatron_rl.actor.optimizer import TrainingState, apply_update, gather_updated_params, loss_scale
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.losses import (
    LossSpec,
    Normalizer,
    finalize_metrics,
    global_normalizer,
    merge_metrics,
    metric_reduce_op,
    policy_loss,
)
from megatron_rl.losses.distill import forward_kl_loss
from megatron_rl.losses.entropy import entropy_bonus
from megatron_rl.losses.importance import kept_mask
from megatron_rl.losses.metrics import masked_sum
from megatron_rl.models.dsa_attention import take_near_ties
from megatron_rl.parallel.device import local_device

_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reject_tokens(batch: ActorBatch, spec: LossSpec) -> tuple[ActorBatch, float]:
    """`batch` with the tokens that `algorithm.is_correction = reject` rejects out of its response mask
    (`losses.importance.kept_mask`), and the share of its loss tokens rejected; unchanged otherwise."""
    if spec.is_correction != "reject":
        return batch, 0.0
    if batch.old_log_probs is None or batch.rollout_log_probs is None:
        raise ValueError("algorithm.is_correction = 'reject' needs ActorBatch.old_log_probs and rollout_log_probs")
    given = [batch.loss_mask(i) for i in range(len(batch))]
    kept = [
        kept_mask(spec, m.view(1, -1), old.view(1, -1), ro.view(1, -1)).view(-1)
        for m, old, ro in zip(given, batch.old_log_probs, batch.rollout_log_probs, strict=True)
    ]
    total = sum(int(m.sum()) for m in given)
    rejected = total - sum(int(m.sum()) for m in kept)
    return batch.with_fields(response_mask=kept), rejected / total if total else 0.0


def reduce_metrics(local: dict[str, Tensor] | None, contribute: bool) -> dict[str, Tensor]:
    """Reduce metric statistics over all ranks, float64; only ranks with `contribute` add theirs.

    `local` must be given on the last rank (always on the last pipeline stage): its key set is used.
    """
    world = dist.get_world_size()
    keys = [sorted(local) if local is not None else None]
    dist.broadcast_object_list(keys, src=world - 1)
    names: list[str] = keys[0]
    out: dict[str, Tensor] = {}
    for op in ("sum", "max", "min"):
        group = [k for k in names if metric_reduce_op(k) == op]
        if not group:
            continue
        buf = torch.full((len(group),), _IDENTITY[op], dtype=torch.float64, device=local_device())
        if contribute:
            buf.copy_(torch.stack([local[k].to(torch.float64) for k in group]))
        dist.all_reduce(buf, op=_OPS[op])
        out.update({k: v for k, v in zip(group, buf.cpu(), strict=True)})
    return out


# (log-probs [rows, max_len] at the target positions, response fields there, loss mask, global
# normaliser) -> (loss to back-propagate, metric statistics reduced with `metric_reduce_op`, holding
# "tokens"). The loss must be the micro-batch's share of the whole-batch loss (see `losses.aggregation`).
TokenLoss = Callable[[Tensor, dict[str, Tensor], Tensor, Normalizer], tuple[Tensor, dict[str, Tensor]]]


def policy_token_loss(spec: LossSpec) -> TokenLoss:
    """The RL objective of `spec` (`losses.policy_loss`); needs old_log_probs and advantages."""

    def loss(
        logprobs: Tensor, f: dict[str, Tensor], mask: Tensor, normalizer: Normalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy_loss(
            logprobs,
            f["old_log_probs"],
            f["advantages"],
            mask,
            spec,
            rollout_log_probs=f.get("rollout_log_probs"),
            ref_log_probs=f.get("ref_log_probs"),
            normalizer=normalizer,
        )

    return loss


def _loss_fn(
    token_loss: TokenLoss,
    normalizer: Normalizer,
    scale: float,
    entropy_coef: float,
    loss_agg_mode: str,
    distill_coef: float = 0.0,
):
    def loss_fn(mb: MicroBatchInputs, out: LogProbs | TopLogProbs | Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if not isinstance(out, LogProbs | TopLogProbs):  # another head's per-token values (the critic's): no entropy
            loss, metrics = token_loss(out, mb.fields, mb.target_mask, normalizer)
            return loss * scale, metrics
        loss, metrics = token_loss(out.logprobs, mb.fields, mb.target_mask, normalizer)
        metrics["entropy_sum"] = masked_sum(out.entropy, mb.target_mask)
        if entropy_coef > 0:
            bonus = entropy_bonus(out.entropy, mb.target_mask, entropy_coef, normalizer, loss_agg_mode)
            loss = loss + bonus
            metrics["loss"] = metrics["loss"] + bonus.detach().to(torch.float64)
            metrics["entropy_bonus"] = bonus.detach().to(torch.float64)
        if isinstance(out, TopLogProbs):  # on-policy distillation's top-k forward KL (`losses.distill`)
            assert mb.top_logprobs is not None
            term, per_token = forward_kl_loss(
                out.top, mb.top_logprobs, mb.target_mask, distill_coef, normalizer, loss_agg_mode
            )
            loss = loss + term
            metrics["loss"] = metrics["loss"] + term.detach().to(torch.float64)
            metrics["distill_loss"] = term.detach().to(torch.float64)
            metrics["forward_kl_sum"] = masked_sum(per_token, mb.target_mask)
        return loss * scale, metrics

    return loss_fn


def _routing_metrics(routing: RoutingReplay, num_layers: int) -> dict[str, float]:
    layers, changed, total = routing.take_change_counts()
    buf = torch.zeros(2, num_layers, dtype=torch.float64, device=local_device())
    index = torch.tensor(layers, dtype=torch.long, device=buf.device)
    buf[0].index_add_(0, index, changed.to(buf))
    buf[1].index_add_(0, index, total.to(buf))
    dist.all_reduce(buf)
    buf = buf.cpu()
    out = {}
    for layer in range(num_layers):
        if buf[1, layer] > 0:
            out[f"routing_changed_frac_layer{layer}"] = float(buf[0, layer] / buf[1, layer])
    if float(buf[1].sum()) > 0:
        out["routing_changed_frac"] = float(buf[0].sum() / buf[1].sum())
    return out


def train_on_batch(
    state: TrainingState,
    batch: ActorBatch,
    spec: LossSpec,
    *,
    updates: int,
    epochs: int = 1,
    budget: TokenBudget,
    chunk_tokens: int,
    temperature: float,
    vocab_size: int,
    token_norm: float,
    routing: RoutingReplay | None = None,
    replay: bool = False,
    loss: TokenLoss | None = None,
    distill_coef: float = 0.0,
    head: Head | None = None,
    finalize: Callable[[dict[str, Tensor]], dict[str, float]] = finalize_metrics,
) -> list[dict[str, float]]:
    """`updates` optimizer steps over consecutive mini-batches of `batch`, `epochs` times over (each pass the
    same mini-batches in the same order); one metrics dict per step, pass by pass.

    `loss`: None = the policy loss of `spec` (with its entropy bonus), for which `batch` needs
    old_log_probs and advantages (plus rollout/ref log-probs when the algorithm uses them); any other
    `TokenLoss` (e.g. the SFT cross-entropy) gets the fields the batch has, and no entropy bonus.
    With `replay`, routed_experts (R2 recorded or R3). `head`: None = the log-probs and entropy of the
    targets at `temperature` (`LogProbHead`); another head's output (the critic's values) goes to `loss`
    as it is. `finalize` turns the reduced statistics into the update's metrics. With the policy loss, a batch
    with the teacher's top-k (`ActorBatch.teacher_top_ids`, `distill.mode = forward_topk`) adds `distill_coef`
    x the top-k forward KL (`losses.distill`); another loss leaves them out.
    """
    policy = loss is None
    entropy_coef = spec.entropy_coef if policy else 0.0
    if loss is None:
        for name in ("old_log_probs", "advantages"):
            if getattr(batch, name) is None:
                raise ValueError(f"train: ActorBatch.{name} is required")
        loss = policy_token_loss(spec)
    if batch.teacher_top_ids is not None and not policy:  # the teacher's top-k are the policy loss's only
        batch = batch.with_fields(teacher_top_ids=None, teacher_top_logprobs=None)
    if batch.teacher_top_ids is not None and distill_coef <= 0:
        raise ValueError(
            "train: ActorBatch.teacher_top_ids (distill.mode = forward_topk) need distill_coef > 0 "
            f"(distill.kl_coef), got {distill_coef}"
        )
    fields = [name for name in (*RESPONSE_FIELDS, *VALUE_FIELDS) if getattr(batch, name) is not None]
    head = LogProbHead(temperature, vocab_size, chunk_tokens) if head is None else head
    config = get_model_config(state.model[0])
    history = []
    runs = mini_batches(len(batch), updates, ps.get_data_parallel_world_size())
    for indices in runs * epochs:
        sub, rejected = reject_tokens(batch.subset(indices), spec) if policy else (batch.subset(indices), 0.0)
        masks = [sub.loss_mask(i).view(1, -1) for i in range(len(sub))]
        normalizer = global_normalizer(masks, token_norm=token_norm)
        micro = plan_for_rank(sub.lengths, budget)
        inputs = prepare_inputs(state.model, sub, micro, with_fields=fields)
        loss_fn = _loss_fn(loss, normalizer, loss_scale(len(inputs)), entropy_coef, spec.loss_agg_mode, distill_coef)
        for chunk in state.model:
            chunk.train()
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        result = run_schedule(
            state.model,
            inputs,
            loss_fn,
            head=head,
            forward_only=False,
            routing=routing if replay else None,
            routing_mode="replay" if replay else None,
            measure_routing=replay,
        )
        ok, grad_norm, lr = apply_update(state)
        local = merge_metrics(result.extras) if result.extras else None  # every last-stage rank
        metrics = finalize(reduce_metrics(local, is_output_owner()))
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            update_skipped=0.0 if ok else 1.0,
            micro_batches=float(len(inputs)),
            dp_token_imbalance=dp_token_imbalance(sub.lengths),
        )
        if policy and spec.is_correction == "reject":
            metrics["is_rejected_frac"] = rejected
        if replay and routing is not None:
            metrics.update(_routing_metrics(routing, config.num_layers))
        metrics.update(take_near_ties(state.model))
        history.append(metrics)
    gather_updated_params(state)
    return history

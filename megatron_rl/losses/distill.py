"""On-policy distillation's top-k forward KL (`distill.mode = forward_topk`), a term of the actor's loss.

At every loss token t the teacher gave its K most likely next tokens v_1..v_K and their log-probs
log p_T(v_k) (`Trajectory.teacher_top_ids` / `teacher_top_logprobs`); the trainer computes the student's
log p_S(v_k) from its full vocab-parallel log-softmax (`actor.logprobs.vocab_parallel_top_logprobs_from_hidden`).
The per-token term is the top-k part of KL(p_T || p_S):

    F_t = sum_k p_T(v_k) (log p_T(v_k) - log p_S(v_k)),     p_T(v_k) = exp(log p_T(v_k)), NOT renormalised

as verl's `compute_forward_kl_topk` (its `kl_divergence` of the gathered log-probs, no renormalisation).
Not renormalising keeps F_t the exact top-k terms of the full forward KL: 0 when the student equals the
teacher, each token's pull weighted by the teacher's own probability (a flat teacher pulls less), the tail
beyond the top-k left out rather than spread over it. Its gradient on the student's logits z at token t is
sum_k p_T(v_k) (p_S - onehot(v_k)) = m_T p_S - p_T|topk (m_T: the teacher's top-k mass).

F is aggregated over the loss tokens as the policy loss is (`algorithm.loss_agg_mode` weights with the
step's global normaliser, `losses.aggregation`), so micro-batch shares add up to the batch value, and added
to the objective times `distill.kl_coef`.
"""

from __future__ import annotations

import torch

from megatron_rl.losses.aggregation import Normalizer, token_weights


def topk_forward_kl(student_top: torch.Tensor, teacher_top: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """F_t per token, [B, T] (0 outside the bool `mask`), from the student's and the teacher's log-probs of the
    teacher's top-k, [B, T, K] each; differentiable in `student_top` only, float64 for float64 input else fp32."""
    if student_top.shape != teacher_top.shape or student_top.shape[:-1] != mask.shape:
        raise ValueError(
            f"topk_forward_kl: student {tuple(student_top.shape)} and teacher {tuple(teacher_top.shape)} log-probs "
            f"must both be [*mask shape {tuple(mask.shape)}, K]"
        )
    dtype = torch.float64 if student_top.dtype == torch.float64 else torch.float32
    teacher = teacher_top.detach().to(dtype)
    inside = mask.unsqueeze(-1)
    gap = torch.where(inside, teacher - student_top.to(dtype), 0.0)
    return (torch.where(inside, teacher.exp(), 0.0) * gap).sum(dim=-1)


def forward_kl_loss(
    student_top: torch.Tensor,
    teacher_top: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    normalizer: Normalizer,
    loss_agg_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of coef x F aggregated over the whole batch's loss tokens, F [B, T] detached)."""
    per_token = topk_forward_kl(student_top, teacher_top, mask)
    weights = token_weights(mask, mask.sum(dim=-1), loss_agg_mode, normalizer, per_token.dtype)
    return (per_token * weights).sum() * float(coef), per_token.detach()

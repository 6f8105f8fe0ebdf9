"""On-policy distillation's top-k forward KL (`distill.mode = forward_topk`), in process:
- the per-token term sum_k p_T(v_k) (log p_T(v_k) - log p_S(v_k)) and its gradient on the student's logits, by
  hand (a wrong sign or a renormalised p_T fails);
- the train step's loss with the term: loss and gradients equal autograd through a full log_softmax, the
  teacher's ids placed through the padded and the packed layouts;
- the rollout side: the teacher asked for its top-k, the step batch carrying them, no reverse-KL advantage."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distill import FakeTeacher, G, data_dir, runtime, runtime_config  # noqa: F401 (a fixture)

from megatron_rl.actor.batch import ActorBatch, build_inputs
from megatron_rl.actor.logprobs import TopLogProbs, vocab_parallel_top_logprobs_from_hidden
from megatron_rl.actor.micro_batches import MicroBatch
from megatron_rl.actor.train_step import _loss_fn, policy_token_loss
from megatron_rl.config import loss_spec, preset
from megatron_rl.losses import global_normalizer, policy_loss
from megatron_rl.losses.distill import forward_kl_loss, topk_forward_kl
from megatron_rl.rollout.types import PromptScores

LN2 = math.log(2.0)


def test_the_top_k_forward_kl_and_its_gradient_by_hand() -> None:
    """Student softmax [1/4, 1/2, 1/4] over 3 tokens; the teacher's top-2 are tokens 0 (p 1/2) and 1 (p 1/4),
    mass 3/4: F = 1/2 (ln 1/2 - ln 1/4) + 1/4 (ln 1/4 - ln 1/2) = ln2 / 4 (renormalised over the top-2 it would be
    2/3 ln(8/3) + 1/3 ln(2/3) = 0.519; with the sign flipped -ln2 / 4). Its gradient on the logits is
    m_T p_S - p_T|top = 3/4 [1/4, 1/2, 1/4] - [1/2, 1/4, 0] = [-5/16, 1/8, 3/16]. A second token outside the
    mask counts for nothing; token-mean over the one loss token, times kl_coef 2."""
    logits = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]])).requires_grad_()
    ids = torch.tensor([[[0, 1], [2, 0]]])
    teacher = torch.log(torch.tensor([[[0.5, 0.25], [0.9, 0.05]]]))
    mask = torch.tensor([[True, False]])
    student = torch.log_softmax(logits, -1).gather(-1, ids)
    per_token = topk_forward_kl(student, teacher, mask)
    assert per_token[0, 0].item() == pytest.approx(LN2 / 4, abs=1e-7) and per_token[0, 1].item() == 0.0
    term, _ = forward_kl_loss(student, teacher, mask, 2.0, global_normalizer([mask], token_norm=2.0), "token-mean")
    term.backward()
    torch.testing.assert_close(logits.grad[0, 0], 2 * torch.tensor([-5 / 16, 1 / 8, 3 / 16]), rtol=0, atol=1e-7)
    assert logits.grad[0, 1].abs().max() == 0.0
    same = topk_forward_kl(teacher, teacher, torch.ones(1, 2, dtype=torch.bool))
    assert same.abs().max() == 0.0  # 0 when the student is the teacher, whatever the top-k's mass
    with pytest.raises(ValueError, match=r"must both be \[\*mask shape \(1, 2\), K\]"):
        topk_forward_kl(student[..., :1], teacher, mask)


def _batch(k: int, gen: torch.Generator) -> ActorBatch:
    tokens = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3])]
    prompts = [2, 1]
    responses = [3, 2]
    top = [torch.randint(0, 10, (r, k), generator=gen) for r in responses]
    top[0][:, 0] = tokens[0][2:]  # the sampled token among the teacher's top
    return ActorBatch(
        tokens=tokens,
        prompt_lengths=prompts,
        advantages=[torch.tensor(0.5), torch.tensor([1.0, -1.0])],
        old_log_probs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0])],
        response_mask=[torch.tensor([True, False, True]), torch.tensor([True, True])],
        teacher_top_ids=[t.to(torch.int32) for t in top],
        teacher_top_logprobs=[torch.log_softmax(torch.randn(r, k + 2, generator=gen), -1)[:, :k] for r in responses],
    )


@pytest.mark.parametrize("packed", [False, True])
def test_the_train_step_loss_adds_the_forward_kl(packed: bool) -> None:
    """The micro-batch loss of the train step with the teacher's top-3 and distill.kl_coef 0.7 (GRPO,
    seq-mean-token-mean): loss and gradients equal autograd through a full log_softmax of the policy loss plus
    0.7 x the per-sequence mean of F over the loss tokens; the metrics report the term and F per token."""
    gen = torch.Generator().manual_seed(0)
    batch, k, coef, temperature = _batch(3, gen), 3, 0.7, 0.9
    batch.validate(vocab_size=10, num_layers=1, top_k=1, num_experts=None)
    spec = loss_spec(preset("grpo"))
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3), packed=packed)
    inp = build_inputs(batch, mb, torch.device("cpu"), with_fields=("old_log_probs", "advantages"))
    norm = global_normalizer([inp.target_mask], token_norm=8.0)
    rows_hidden, weight = torch.randn(2, 5, 4, generator=gen), torch.randn(10, 4, generator=gen)
    hidden = rows_hidden
    if packed:  # the rows' hidden states at their packed positions
        hidden = torch.zeros(1, inp.packing.target.shape[1], 4)
        hidden[0, inp.packing.index[inp.target_mask]] = rows_hidden[inp.target_mask]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_top_logprobs_from_hidden(
        h, w, inp.head_target, inp.head_top_ids, temperature, mask=inp.head_mask, chunk_tokens=3
    )
    rows = TopLogProbs(inp.to_rows(out.logprobs), inp.to_rows(out.entropy), inp.to_rows(out.top))
    loss, metrics = _loss_fn(policy_token_loss(spec), norm, 1.0, 0.0, spec.loss_agg_mode, coef)(inp, rows)
    loss.backward()

    hr, wr = rows_hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lsm = torch.log_softmax(hr @ wr.t() / temperature, dim=-1)
    logp = lsm.gather(-1, inp.target.unsqueeze(-1)).squeeze(-1)
    f, m = inp.fields, inp.target_mask
    pg, _ = policy_loss(logp, f["old_log_probs"], f["advantages"], m, spec, normalizer=norm)
    kl = []
    for i, (p, n) in enumerate([(2, 5), (1, 3)]):  # F at each loss token of sample i, by its formula
        t_ids, t_lp = batch.teacher_top_ids[i].long(), batch.teacher_top_logprobs[i]
        s_lp = lsm[i, p - 1 : n - 1].gather(-1, t_ids)
        per = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
        kl.append(per[batch.response_mask[i]])
    ref = pg + coef * sum(x.mean() for x in kl) / 2
    ref.backward()
    grad_h = h.grad[0, inp.packing.index] * m.unsqueeze(-1) if packed else h.grad
    assert abs(loss.item() - ref.item()) <= 1e-5 and abs(float(metrics["loss"]) - ref.item()) <= 1e-5
    assert (grad_h - hr.grad).abs().max() <= 1e-5 and (w.grad - wr.grad).abs().max() <= 1e-5
    assert abs(float(metrics["distill_loss"]) - coef * (sum(x.mean() for x in kl) / 2).item()) <= 1e-5
    assert abs(float(metrics["forward_kl_sum"]) - sum(x.sum() for x in kl).item()) <= 1e-5
    assert float(metrics["distill_loss"]) > 0.05  # the term is there, not a rounding of zero
    assert inp.top_ids.shape[-1] == k


# ---- the rollout side ----
class TopTeacher(FakeTeacher):
    """`FakeTeacher`'s log-probs; its top-2 at every position: ids t + 1, t + 2 at -0.1, -0.2."""

    async def prompt_scores(self, sequences: Any, starts: Any, top_k: int) -> list[PromptScores]:
        values = await self.prompt_logprobs(sequences, starts)
        return [
            PromptScores(
                v, [[t + 1 + j for j in range(top_k)] for t in s[k:]], [[-0.1 * (j + 1) for j in range(top_k)]] * len(v)
            )
            for v, s, k in zip(values, sequences, starts, strict=True)
        ]


def test_the_step_batch_carries_the_teachers_top_k(data_dir: Path, rank0_env: None) -> None:  # noqa: F811
    teacher = TopTeacher()
    cfg = runtime_config(data_dir, "distill.mode=forward_topk", "distill.top_k=2")
    driver = runtime(cfg, data_dir, lambda loop: teacher)
    try:
        plan = driver.collect(1, 0)
        driver.finish_step()
    finally:
        driver.close()
        driver.data.close()
    batch = plan.batch
    assert batch is not None and len(batch.teacher_top_ids) == 2 * G
    for ids, values in zip(batch.teacher_top_ids, batch.teacher_top_logprobs, strict=True):
        assert ids.tolist() == [[8, 9], [9, 10]] and ids.dtype == torch.int32  # tokens 7, 8 of TwoTokens
        torch.testing.assert_close(values, torch.tensor([[-0.1, -0.2], [-0.1, -0.2]]))
    assert all(float(a.abs().max()) == 0.0 for a in batch.advantages)  # opd: no reverse-KL advantage
    assert plan.metrics["distill/reverse_kl"] == pytest.approx(0.0)  # still reported from the sampled tokens


def test_forward_topk_takes_what_reverse_kl_refuses() -> None:
    from test_distill import config

    cfg = config("distill.mode=forward_topk", "algorithm.name=gspo")  # one advantage per sequence: no matter
    assert cfg.distill.top_k == 20 and dataclasses.asdict(cfg.distill)["mode"] == "forward_topk"
    with pytest.raises(Exception, match="distill.top_k"):
        config("distill.mode=forward_topk", "distill.top_k=0")

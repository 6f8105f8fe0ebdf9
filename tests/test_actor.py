"""Single-process parts of the actor: batch layout, routing layouts, mini-batches, the LR schedule."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch, build_inputs
from megatron_rl.actor.micro_batches import MicroBatch
from megatron_rl.actor.optimizer import TrainingState, apply_update, lr_scheduler
from megatron_rl.actor.routing_replay import (
    check_routing_values,
    given_routing,
    routed_token_mask,
    token_slice,
)
from megatron_rl.actor.train_step import mini_batches, reject_tokens
from megatron_rl.config import Config, TrainConfig, preset, validate
from megatron_rl.losses import LossSpec


def _batch() -> ActorBatch:
    return ActorBatch(
        tokens=[torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3])],
        prompt_lengths=[2, 1],
        advantages=[torch.tensor(0.5), torch.tensor([1.0, -1.0])],
        old_log_probs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0])],
        response_mask=[torch.tensor([True, False, True]), torch.tensor([True, True])],
    )


def test_build_inputs_places_targets_and_fields() -> None:
    batch = _batch()
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3))
    inp = build_inputs(batch, mb, torch.device("cpu"), pad_to=(3, 6), with_fields=("old_log_probs", "advantages"))
    assert inp.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 0, 0, 0], [0] * 6]
    # logits at position t predict token t + 1
    assert inp.target.tolist() == [[6, 7, 8, 9, 0, 0], [2, 3, 0, 0, 0, 0], [0] * 6]
    # sample 0: prompt 2, response tokens 7 8 9 at target positions 1 2 3, the middle one masked out
    assert inp.target_mask.tolist() == [
        [False, True, False, True, False, False],
        [True, True, False, False, False, False],
        [False] * 6,
    ]
    assert inp.fields["old_log_probs"][0, 1:4].tolist() == [-1.0, -2.0, -3.0]
    assert inp.fields["old_log_probs"][1, 0:2].tolist() == [-4.0, -5.0]
    assert inp.fields["advantages"][0, 1:4].tolist() == [0.5, 0.5, 0.5]  # a 0-dim advantage broadcasts
    assert inp.position_ids[2].tolist() == list(range(6))
    assert inp.placements == ((0, 0), (1, 0)) and inp.packing is None
    every = build_inputs(batch, mb, torch.device("cpu"), every_response_token=True)
    assert every.target_mask[0].tolist() == [False, True, True, True, False]
    rows = every.response_rows(torch.arange(10.0).view(2, 5))
    assert [r.tolist() for r in rows] == [[1.0, 2.0, 3.0], [5.0, 6.0]]


def test_build_inputs_packed_layout() -> None:
    """The two samples end to end in one sequence padded to 10 (the tail one more segment), positions
    restarting per sample; the loss side keeps one sample per row, and `to_rows` maps back to it."""
    batch = _batch()
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3), packed=True)
    inp = build_inputs(batch, mb, torch.device("cpu"), pad_to=(1, 10), with_fields=("old_log_probs",))
    assert inp.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 0, 0]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    p = inp.packing
    assert p.starts == (0, 5) and p.cu_seqlens.tolist() == [0, 5, 8, 10] and p.max_seqlen == 5
    assert p.cu_seqlens.dtype == torch.int32
    # each sample's last token predicts nothing: target 0 at positions 4 and 7, never a target
    assert p.target.tolist() == [[6, 7, 8, 9, 0, 2, 3, 0, 0, 0]]
    assert p.target_mask.tolist() == [[False, True, False, True, False, True, True, False, False, False]]
    assert inp.target.tolist() == [[6, 7, 8, 9, 0], [2, 3, 0, 0, 0]]  # the row layout, as padded
    assert inp.fields["old_log_probs"].tolist() == [[0.0, -1.0, -2.0, -3.0, 0.0], [-4.0, -5.0, 0.0, 0.0, 0.0]]
    assert inp.placements == ((0, 0), (0, 5)) and (inp.rows, inp.max_len) == (1, 10)
    values = torch.arange(10.0).view(1, 10).requires_grad_()
    rows = inp.to_rows(values)
    assert rows.tolist() == [[0.0, 1.0, 0.0, 3.0, 0.0], [5.0, 6.0, 0.0, 0.0, 0.0]]
    rows.sum().backward()
    assert values.grad.tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]]
    assert build_inputs(batch, mb, torch.device("cpu")).packing.cu_seqlens.tolist() == [0, 5, 8]
    with pytest.raises(ValueError, match=r"pad_to \(2, 10\) does not hold the micro-batch"):
        build_inputs(batch, mb, torch.device("cpu"), pad_to=(2, 10))


def test_batch_validate_names_field_and_shapes() -> None:
    batch = _batch()
    batch.validate(vocab_size=10, num_layers=2, top_k=2, num_experts=4)
    bad = batch.with_fields(old_log_probs=[torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"old_log_probs\[1\] has shape \(3,\), expected \(2,\)"):
        bad.validate(vocab_size=10, num_layers=2, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match=r"tokens\[0\] holds ids in \[5, 9\], outside \[0, 8\)"):
        batch.validate(vocab_size=8, num_layers=2, top_k=2, num_experts=4)
    routed = batch.with_fields(routed_experts=[torch.zeros(4, 2, 2, dtype=torch.int32), torch.zeros(3, 2, 2)])
    with pytest.raises(ValueError, match=r"routed_experts\[1\] is torch.float32 \(3, 2, 2\), expected int \(2, 2, 2\)"):
        routed.validate(vocab_size=10, num_layers=2, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="prompt_lengths\\[1\\] = 4 is outside \\[1, 3\\]"):
        ActorBatch(tokens=batch.tokens, prompt_lengths=[2, 4]).validate(
            vocab_size=10, num_layers=2, top_k=2, num_experts=None
        )
    sub = batch.subset([1])
    assert len(sub) == 1 and sub.tokens[0].tolist() == [1, 2, 3] and sub.old_log_probs[0].tolist() == [-4.0, -5.0]


def test_token_slice_sequence_parallel() -> None:
    sl = token_slice(2, 8, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert (sl.start, sl.stop, sl.tokens) == (4, 8, 8)
    full = token_slice(2, 8, tp_rank=1, tp_size=2, sequence_parallel=False)
    assert (full.start, full.stop, full.tokens) == (0, 8, 16)
    with pytest.raises(ValueError, match="max_len \\(7\\) divisible by TP \\(2\\)"):
        token_slice(2, 7, 0, 2, True)


def test_given_routing_is_position_major_and_picks_layers() -> None:
    # 2 rows, 3 layers, top-2; entry = 100*row + 10*pos + layer (+ slot)
    routed = []
    for row, n in enumerate((4, 3)):
        r = torch.zeros(n - 1, 3, 2, dtype=torch.int32)
        for pos in range(n - 1):
            for layer in range(3):
                r[pos, layer] = torch.tensor([100 * row + 10 * pos + layer, 1000])
        routed.append(r)
    sl = token_slice(2, 4, tp_rank=1, tp_size=2, sequence_parallel=True)  # positions 2, 3
    rows = [(0, 0), (1, 0)]
    per_layer = given_routing(routed, rows, sl, layers=[2, 0], top_k=2)
    assert len(per_layer) == 2
    # token order: (pos 2, row 0), (pos 2, row 1), (pos 3, row 0), (pos 3, row 1); none given -> 0
    assert per_layer[0][:, 0].tolist() == [22, 0, 0, 0]
    assert per_layer[1][:, 0].tolist() == [20, 0, 0, 0]
    mask = routed_token_mask([4, 3], rows, sl)
    assert mask.tolist() == [True, False, False, False]
    sl0 = token_slice(2, 4, tp_rank=0, tp_size=2, sequence_parallel=True)  # positions 0, 1
    assert given_routing(routed, rows, sl0, layers=[1], top_k=2)[0][:, 0].tolist() == [1, 101, 11, 111]
    assert routed_token_mask([4, 3], rows, sl0).tolist() == [True, True, True, True]


def test_given_routing_of_a_packed_sequence() -> None:
    """Samples of 4 and 3 tokens end to end in one row of 8 (the last position padding): each sample's
    routing from its own first position on; its last token, and the padding, routed freely."""
    routed = [
        torch.tensor([[[10 + pos, 50]] for pos in range(3)]),
        torch.tensor([[[20 + pos, 50]] for pos in range(2)]),
    ]
    packed = [(0, 0), (0, 4)]
    sl = token_slice(1, 8, tp_rank=0, tp_size=1, sequence_parallel=False)
    assert given_routing(routed, packed, sl, layers=[0], top_k=2)[0][:, 0].tolist() == [10, 11, 12, 0, 20, 21, 0, 0]
    assert routed_token_mask([4, 3], packed, sl).tolist() == [True, True, True, False, True, True, False, False]
    upper = token_slice(1, 8, tp_rank=1, tp_size=2, sequence_parallel=True)  # positions 4 .. 7
    assert given_routing(routed, packed, upper, layers=[0], top_k=2)[0][:, 0].tolist() == [20, 21, 0, 0]


def test_check_routing_values() -> None:
    ok = torch.tensor([[[0, 0], [1, 3]]], dtype=torch.int32)  # layer 0 dense (ignored), layer 1 MoE
    check_routing_values([ok], layers=[1], num_experts=4)
    with pytest.raises(ValueError, match=r"routed_experts\[0\] holds expert ids in \[1, 4\], outside \[0, 4\)"):
        check_routing_values([torch.tensor([[[0, 0], [1, 4]]])], layers=[1], num_experts=4)
    with pytest.raises(ValueError, match="repeats an expert"):
        check_routing_values([torch.tensor([[[0, 0], [2, 2]]])], layers=[1], num_experts=4)


def test_mini_batches() -> None:
    assert mini_batches(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mini_batches(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]
    # a short batch (dynamic sampling ran out of rounds): fewer mini-batches, each with >= DP samples
    assert mini_batches(2, 3) == [[0], [1]]
    assert mini_batches(5, 4, min_size=2) == [[0, 1], [2, 3, 4]]
    with pytest.raises(
        ValueError,
        match=r"cannot cut 1 samples into mini-batches of >= 2 \(the data-parallel size\) for train.updates_per_step = 1",
    ):
        mini_batches(1, 1, min_size=2)


def test_reject_tokens_leave_the_response_mask_and_are_counted() -> None:
    batch = _batch().with_fields(
        old_log_probs=[torch.zeros(3), torch.zeros(2)],
        rollout_log_probs=[-torch.log(torch.tensor([3.0, 1.0, 1.2])), -torch.log(torch.tensor([0.25, 1.0]))],
    )
    spec = LossSpec.from_section(dataclasses.replace(preset("grpo"), is_correction="reject", is_mask_max=2.0))
    kept, frac = reject_tokens(batch, spec)
    # token 0 of sample 0 (w = 3 > 2) and token 0 of sample 1 (w = 0.25 < 0.5) are rejected; token 1 of
    # sample 0 was already out of the loss
    assert [m.tolist() for m in kept.response_mask] == [[False, False, True], [False, True]]
    assert frac == pytest.approx(2 / 4)
    same, zero = reject_tokens(batch, dataclasses.replace(spec, is_correction="mask"))
    assert same is batch and zero == 0.0


class _StubOptimizer:
    """Megatron's optimizer interface as `apply_update` uses it: step() -> (applied, grad_norm, zeros)."""

    def __init__(self, lr: float, applied: list[bool]) -> None:
        self.param_groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}]
        self.applied = iter(applied)

    def step(self) -> tuple[bool, float, None]:
        return next(self.applied), 1.0, None


def _lrs(train: TrainConfig, applied: list[bool] | None = None) -> list[float]:
    """The learning rate of every update through `apply_update`, the train step's own path."""
    n = train.steps * train.updates_per_step
    applied = [True] * n if applied is None else applied
    opt = _StubOptimizer(train.lr, applied)
    state = TrainingState(model=[], optimizer=opt, scheduler=lr_scheduler(opt, train))  # type: ignore[arg-type]
    return [apply_update(state)[2] for _ in applied]


def test_lr_schedule_warmup_then_decay() -> None:
    linear = TrainConfig(steps=3, updates_per_step=2, lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="linear")
    # warm-up k/2, then 1 - (k - 2)/5 * 0.9: min_lr is reached after the last update, not at it
    assert _lrs(linear) == pytest.approx([0.5, 1.0, 0.82, 0.64, 0.46, 0.28])
    cosine = TrainConfig(steps=2, updates_per_step=2, lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="cosine")
    assert _lrs(cosine) == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    assert _lrs(cosine)[-1] > 0.1  # the last update is not at lr 0
    constant = TrainConfig(steps=2, updates_per_step=1, lr=0.3, lr_warmup_steps=4, lr_decay_style="constant")
    assert _lrs(constant) == pytest.approx([0.075, 0.15])


def test_lr_warmup_ratio_is_the_floored_fraction_of_all_updates_and_not_with_warmup_steps() -> None:
    # 0.25 x (5 x 2 = 10 updates) = 2.5, floored to a warm-up of 2: the schedule of lr_warmup_steps = 2, whose
    # linear decay then runs over N - (W - 1) = 9 updates
    ratio = TrainConfig(steps=5, updates_per_step=2, lr=1.0, min_lr=0.0, lr_warmup_ratio=0.25, lr_decay_style="linear")
    steps = TrainConfig(steps=5, updates_per_step=2, lr=1.0, min_lr=0.0, lr_warmup_steps=2, lr_decay_style="linear")
    assert _lrs(ratio) == pytest.approx(_lrs(steps)) and _lrs(ratio)[:3] == pytest.approx([0.5, 1.0, 1.0 - 1 / 9])
    with pytest.raises(ValueError, match=r"train.lr_warmup_steps \(2\) and train.lr_warmup_ratio \(0.25\) both"):
        validate(Config(train=TrainConfig(lr_warmup_steps=2, lr_warmup_ratio=0.25)))


def test_lr_schedule_does_not_advance_on_skipped_updates() -> None:
    linear = TrainConfig(steps=4, updates_per_step=1, lr=1.0, min_lr=0.0, lr_decay_style="linear")
    # the 2nd update is skipped (non-finite gradients): the 3rd runs at the value the 2nd would have had
    assert _lrs(linear, [True, False, True, True]) == pytest.approx([1.0, 0.75, 0.75, 0.5])
    with pytest.raises(ValueError, match="train.lr_warmup_steps \\(4\\) must be below"):
        validate(Config(train=TrainConfig(steps=2, updates_per_step=1, lr_warmup_steps=4, lr_decay_style="linear")))


def test_package_exports_megatron_parts_lazily() -> None:
    """`import megatron_rl.actor` leaves Megatron-Core unimported (checked in a fresh interpreter);
    MegatronActor and LogProbResult resolve on first use to the defining modules' classes."""
    import megatron_rl.actor as actor
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.forward import LogProbResult

    code = "import sys, megatron_rl.actor; assert 'megatron.core' not in sys.modules, 'eager Megatron import'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert actor.MegatronActor is MegatronActor and actor.LogProbResult is LogProbResult
    assert actor.ActorBatch is ActorBatch
    assert {"MegatronActor", "LogProbResult", "ActorBatch"} <= set(actor.__all__) <= set(dir(actor))
    with pytest.raises(AttributeError, match="NoSuchName"):
        _ = actor.NoSuchName


def test_entropy_coef_adds_the_bonus_to_the_policy_loss() -> None:
    """The train step's micro-batch loss with `algorithm.entropy_coef` = c on a tiny batch: loss and
    gradients equal autograd through a full log_softmax of policy_loss - c x H (GRPO's seq-mean-token-mean
    of the entropy over the loss tokens of the whole batch); the metrics report the bonus and include it in `loss`; c = 0
    leaves the entropy without gradient and the policy loss as it was."""
    import dataclasses

    from megatron_rl.actor.logprobs import vocab_parallel_logprobs_from_hidden
    from megatron_rl.actor.train_step import _loss_fn, policy_token_loss
    from megatron_rl.config import loss_spec, preset
    from megatron_rl.losses import global_normalizer, policy_loss

    batch = _batch()
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3))
    inp = build_inputs(batch, mb, torch.device("cpu"), with_fields=("old_log_probs", "advantages"))
    norm = global_normalizer([inp.target_mask], token_norm=8.0)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 4, generator=gen), torch.randn(10, 4, generator=gen)
    temperature = 0.7
    results = {}
    for coef in (0.0, 0.25):
        spec = loss_spec(dataclasses.replace(preset("grpo"), entropy_coef=coef))
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = vocab_parallel_logprobs_from_hidden(h, w, inp.target, temperature, mask=inp.target_mask, chunk_tokens=3)
        loss, metrics = _loss_fn(policy_token_loss(spec), norm, 1.0, spec.entropy_coef, spec.loss_agg_mode)(inp, out)
        loss.backward()

        hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lsm = torch.log_softmax(hr @ wr.t() / temperature, dim=-1)
        logp = lsm.gather(-1, inp.target.unsqueeze(-1)).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        f = inp.fields
        ref_pg, _ = policy_loss(logp, f["old_log_probs"], f["advantages"], inp.target_mask, spec, normalizer=norm)
        rows = inp.target_mask.sum(-1)  # the loss tokens of each of the 2 sequences
        h_mean = sum(ent[i][inp.target_mask[i]].sum() / rows[i] for i in range(2)) / 2
        ref = ref_pg - coef * h_mean
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5
        assert (h.grad - hr.grad).abs().max() <= 1e-5 and (w.grad - wr.grad).abs().max() <= 1e-5
        assert abs(float(metrics["loss"]) - ref.item()) <= 1e-5
        if coef:
            assert abs(float(metrics["entropy_bonus"]) + coef * h_mean.item()) <= 1e-5
        else:
            assert "entropy_bonus" not in metrics
        results[coef] = (w.grad, float(metrics["entropy_sum"]))
    assert (results[0.0][0] - results[0.25][0]).abs().max() > 1e-3, "the bonus must change the gradient"
    assert results[0.0][1] == pytest.approx(results[0.25][1])

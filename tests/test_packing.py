"""Packed micro-batches (`train.micro_batch_tokens`) against right-padded ones on one rank, in this process.

The tiny MoE policy of the multi-process scenarios, fp32: log-probs and entropy (free routing, R2
recorded routing, R3 given routing), every parameter's gradient of a probe loss, and whole updates
(`lr` 0, so that both layouts see the same weights) must agree within 1e-5. The packed budget of 40
tokens puts several samples in one sequence and leaves the 22-token sample nearly alone; the
padded one of 48 gives other micro-batches, so nothing is compared with itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.config import Config, RolloutConfig, TrainConfig, preset

from mrl_configs import actor_of_one, layout, seeded_batch, tiny_model

LENGTHS = (22, 7, 15, 11, 19, 9, 13, 17)
PROMPTS = (5, 3, 6, 2, 4, 3, 5, 6)
PADDED, PACKED = TokenBudget(48), TokenBudget(40, packed=True)
TOL = 1e-5


def _config(micro_batch_tokens: int = 0) -> Config:
    return Config(
        model=tiny_model("qwen3_moe"),
        parallel=layout(),
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=24),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2", entropy_coef=0.01),
        train=TrainConfig(
            updates_per_step=2,
            max_tokens_per_micro_batch=48,
            micro_batch_tokens=micro_batch_tokens,
            logprob_chunk_tokens=16,
            lr=0.0,
            seed=11,
        ),
    )


@pytest.fixture(scope="module")
def actor() -> Iterator[object]:
    """A world of one: the actor of `_config()` (padded), torn down afterwards."""
    with actor_of_one(_config()) as actor:
        yield actor


def _batch(vocab: int) -> ActorBatch:
    return seeded_batch(vocab, LENGTHS, PROMPTS)


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def _log_probs(actor, batch: ActorBatch, budget: TokenBudget, mode: str | None = None):  # noqa: ANN001, ANN202
    from megatron_rl.actor.forward import compute_log_probs

    cfg = actor.cfg
    return compute_log_probs(
        actor.state.model,
        batch,
        temperature=cfg.rollout.temperature,
        vocab_size=cfg.model.vocab_size,
        budget=budget,
        chunk_tokens=cfg.train.logprob_chunk_tokens,
        routing=actor.routing,
        routing_mode=mode,
    )


@pytest.mark.parametrize(("mode", "expected"), [("token-mean", -51 / 6), ("seq-mean-token-mean", -7.0)])
def test_loss_normalisation_holds_under_packing(mode: str, expected: float) -> None:
    """Responses of 1, 2 and 3 tokens with advantages 3, 6, 12, on-policy (ratio 1, so each token's loss is
    -A): token-mean -(3 + 2 x 6 + 3 x 12) / 6, seq-mean-token-mean -(3 + 6 + 12) / 3. Packed into [5, 3] and
    [4] tokens, the micro-batches' losses with the one global normaliser add up to those numbers, and
    the gradient of each packed log-prob is that token's weight x -A."""
    from megatron_rl.actor.batch import build_inputs
    from megatron_rl.actor.micro_batches import plan_micro_batches
    from megatron_rl.losses import LossSpec, global_normalizer, policy_loss

    spec = LossSpec.from_section(dataclasses.replace(preset("grpo"), loss_agg_mode=mode))
    old = [torch.full((r,), -1.5) for r in (1, 2, 3)]
    batch = ActorBatch(
        tokens=[torch.arange(2 + r) for r in (1, 2, 3)],
        prompt_lengths=[2, 2, 2],
        advantages=[torch.tensor(a) for a in (3.0, 6.0, 12.0)],
        old_log_probs=old,
    )
    plan = plan_micro_batches(batch.lengths, 8, packed=True)
    assert [mb.indices for mb in plan.micro_batches] == [(2, 0), (1,)]  # first fit: 5 + 3 tokens, then 4
    normalizer = global_normalizer([batch.loss_mask(i).view(1, -1) for i in range(3)], token_norm=24)
    total, grads = 0.0, {}
    for mb in plan.micro_batches:
        inp = build_inputs(batch, mb, torch.device("cpu"), with_fields=("old_log_probs", "advantages"))
        packed = torch.full(inp.packing.target.shape, -1.5, requires_grad=True)  # the head's output, packed
        logp = inp.to_rows(packed)
        f = inp.fields
        loss, _ = policy_loss(logp, f["old_log_probs"], f["advantages"], inp.target_mask, spec, normalizer=normalizer)
        loss.backward()
        total += float(loss)
        for i, (_, start), n in zip(mb.indices, inp.placements, mb.lengths, strict=True):
            grads[i] = packed.grad[0, start + 1 : start + n - 1].tolist()  # the response's target positions
    assert total == pytest.approx(expected, abs=1e-6)
    weight = {"token-mean": lambda r: 1 / 6, "seq-mean-token-mean": lambda r: 1 / (3 * r)}[mode]
    for i, (a, r) in enumerate(((3.0, 1), (6.0, 2), (12.0, 3))):
        assert grads[i] == pytest.approx([-a * weight(r)] * r, abs=1e-6), i


def test_the_plans_differ(actor) -> None:  # noqa: ANN001
    from megatron_rl.actor.forward import plan_for_rank

    packed = plan_for_rank(list(LENGTHS), PACKED)
    padded = plan_for_rank(list(LENGTHS), PADDED)
    # first fit decreasing into 40: [22, 17] [19, 15] [13, 11, 9, 7]; padded: 2 x 22, 2 x 17 ... runs
    assert [mb.lengths for mb in packed] == [(22, 17), (19, 15), (13, 11, 9, 7)]
    assert all(mb.packed for mb in packed) and not any(mb.packed for mb in padded)
    assert [mb.lengths for mb in padded] != [mb.lengths for mb in packed]


def test_log_probs_entropy_and_routing_equal_the_padded_path(actor) -> None:  # noqa: ANN001
    batch = _batch(actor.cfg.model.vocab_size)
    padded = _log_probs(actor, batch, PADDED, "record")
    packed = _log_probs(actor, batch, PACKED, "record")
    assert _worst(packed.log_probs, padded.log_probs) <= TOL
    assert _worst(packed.entropy, padded.entropy) <= TOL
    assert float(padded.log_probs[0].abs().min()) > 0.1  # real values, not zeros on both sides
    # R2: the routing recorded in the packed sequence is each sample's own
    assert [r.shape for r in packed.routed_experts] == [(n - 1, 4, 2) for n in LENGTHS]
    assert all(torch.equal(a, b) for a, b in zip(packed.routed_experts, padded.routed_experts, strict=True))
    replayed = _log_probs(actor, batch.with_fields(routed_experts=packed.routed_experts), PACKED, "replay")
    assert _worst(replayed.log_probs, packed.log_probs) == 0.0
    # R3: random experts given per token land on the packed tokens as on the padded rows
    gen = torch.Generator().manual_seed(5)
    r3 = [torch.rand(n - 1, 4, 4, generator=gen).argsort(dim=-1)[..., :2].to(torch.int32) for n in LENGTHS]
    r3_padded = _log_probs(actor, batch.with_fields(routed_experts=r3), PADDED, "replay")
    r3_packed = _log_probs(actor, batch.with_fields(routed_experts=r3), PACKED, "replay")
    assert _worst(r3_padded.log_probs, padded.log_probs) > 1e-2, "R3 of random routing must move log-probs"
    assert _worst(r3_packed.log_probs, r3_padded.log_probs) <= TOL
    assert _worst(r3_packed.entropy, r3_padded.entropy) <= TOL


def _probe_grads(actor, batch: ActorBatch, budget: TokenBudget) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every parameter's gradient of sum_i (a_i . logp_i + b_i . H_i) over the response tokens."""
    from megatron_rl.actor.forward import LogProbHead, plan_for_rank, prepare_inputs, run_schedule

    gen = torch.Generator().manual_seed(17)
    coef = [
        (torch.randn(n - p, generator=gen), torch.randn(n - p, generator=gen))
        for n, p in zip(LENGTHS, PROMPTS, strict=True)
    ]
    model = actor.state.model
    inputs = prepare_inputs(model, batch, plan_for_rank(batch.lengths, budget), every_response_token=True)

    def loss_fn(mb, out):  # noqa: ANN001, ANN202
        terms = [
            (lp * coef[i][0]).sum() + (h * coef[i][1]).sum()
            for i, lp, h in zip(
                mb.micro_batch.indices, mb.response_rows(out.logprobs), mb.response_rows(out.entropy), strict=True
            )
        ]
        return torch.stack(terms).sum() * len(inputs), None  # Megatron's schedule divides by the count

    cfg = actor.cfg
    head = LogProbHead(cfg.rollout.temperature, cfg.model.vocab_size, cfg.train.logprob_chunk_tokens)
    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    run_schedule(model, inputs, loss_fn, head=head, forward_only=False)
    grads = {name: p.main_grad.detach().clone() for chunk in model for name, p in chunk.named_parameters()}
    for chunk in model:
        chunk.zero_grad_buffer()
    return grads


def test_every_gradient_equals_the_padded_path(actor) -> None:  # noqa: ANN001
    batch = _batch(actor.cfg.model.vocab_size)
    padded, packed = _probe_grads(actor, batch, PADDED), _probe_grads(actor, batch, PACKED)
    assert padded.keys() == packed.keys()
    assert min(float(g.abs().max()) for g in padded.values()) > 0, "every parameter gets a gradient"
    for name, want in padded.items():
        scale = max(1.0, float(want.abs().max()))
        assert float((packed[name] - want).abs().max()) <= TOL * scale, name


def test_updates_equal_the_padded_path(actor) -> None:  # noqa: ANN001
    """Whole updates (GRPO, seq-mean-token-mean, entropy bonus, R2 replay): loss, gradient norm and every
    metric equal; `lr` 0 keeps the weights, so both see the same policy."""
    batch = _batch(actor.cfg.model.vocab_size)
    old = _log_probs(actor, batch, PADDED, "record")
    gen = torch.Generator().manual_seed(3)
    train = batch.with_fields(
        old_log_probs=[lp + 0.2 * torch.randn(lp.shape, generator=gen) for lp in old.log_probs],
        routed_experts=old.routed_experts,
    )
    padded = actor.train(train)
    actor.cfg.train.micro_batch_tokens = 26  # 3 packed micro-batches per update where padding makes 2
    try:
        packed = actor.train(train)
    finally:
        actor.cfg.train.micro_batch_tokens = 0
    assert len(padded) == len(packed) == 2
    for got, want in zip(packed, padded, strict=True):
        assert got["grad_norm"] > 1e-3 and got["clip_high_frac"] + got["clip_low_frac"] > 0
        for key, value in want.items():
            if key == "micro_batches":
                continue
            assert abs(got[key] - value) <= TOL * max(1.0, abs(value)), (key, got[key], value)
    assert [h["micro_batches"] for h in packed] == [3.0, 3.0] and [h["micro_batches"] for h in padded] == [2.0, 2.0]
    assert all(h["dp_token_imbalance"] == 1.0 for h in packed)  # one DP rank


def test_sft_updates_and_reference_log_probs_pack_the_same(actor) -> None:  # noqa: ANN001
    """The SFT cross-entropy trains through the same packing (loss, gradient norm equal at `lr` 0), and
    the frozen reference, which reads the run's `train` section, gives the padded path's log-probs."""
    from megatron_rl.actor.policy import FrozenPolicy
    from megatron_rl.sft import cross_entropy_loss

    batch = _batch(actor.cfg.model.vocab_size)
    reference = FrozenPolicy.start(actor.cfg)
    try:
        padded_sft = actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
        padded_ref = reference.compute_log_probs(batch)
        actor.cfg.train.micro_batch_tokens = 26
        try:
            packed_sft = actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
            packed_ref = reference.compute_log_probs(batch)
        finally:
            actor.cfg.train.micro_batch_tokens = 0
    finally:
        reference.close()
    for got, want in zip(packed_sft, padded_sft, strict=True):
        assert got["micro_batches"] == 3.0 and want["micro_batches"] == 2.0
        for key in ("loss", "grad_norm", "tokens"):
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (key, got[key], want[key])
    assert padded_sft[0]["loss"] > 1.0  # the mean -log p of random tokens under a random policy
    assert _worst(packed_ref.log_probs, padded_ref.log_probs) <= TOL
    assert _worst(packed_ref.entropy, padded_ref.entropy) <= TOL

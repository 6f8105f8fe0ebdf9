"""Context parallelism on the CPU (gloo, the local specs' `ContextParallelAttention`): CP = 2 and
TP = 2 x CP = 2 reproduce world size 1. Run in tests/test_actor_distributed.py's launches.

`check_layout_against_reference` (scenarios_actor.py) compares CP = 2 with `w1_reference`'s GRPO
run with R2 replay: log-probs, entropy, recorded routing (every token's experts checked on the rank
that routes it), R3 log-probs, padded and packed; two updates (loss, grad norm, parameters) padded,
then two more from a world-size-1 checkpoint, padded and packed. `w1_cp_references` adds a second
sequence on a fresh actor: two GSPO updates (the sequence ratio: a mean over tokens that lie on both
CP ranks) replaying R3 routing (the engine's), then two SFT updates (the cross-entropy through the
same train step), which CP = 2 repeats padded and packed; and DeepSeek-V3 (multi-latent attention):
log-probs (CP = 2: padded and packed) and two GRPO updates. TP = 2 x CP = 2 on 4 ranks:
`check_layout_briefly`. The grad norm is what the CP loss scale got wrong (Megatron's schedule
multiplies a 2-tuple loss by CP: `actor.optimizer.loss_scale`); `train.grad_clip` = 0.5 clips every
update, so the parameters would move otherwise too. Tolerances: metrics 1e-5 relative, parameters
1e-6 (fp32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext

import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.config import Config, ParallelConfig, preset, validate
from megatron_rl.parallel import destroy_distributed
from megatron_rl.sft.loss import cross_entropy_loss

from mrl_configs import layout, tiny_sigmoid_model
from mrl_multiproc.scenarios_actor import (
    LOGPROB_TOL,
    MOE_LAYERS,
    actor_config,
    assert_close,
    assert_params_close,
    check_layout_against_reference,
    load_ref,
    make_batch,
    packed,
    random_routing,
    save_ref,
    train_batch,
)

METRIC_TOL = 1e-5


def _close_metrics(got: list[dict[str, float]], want: list[dict[str, float]], keys: tuple[str, ...], what: str) -> None:
    assert len(got) == len(want), (len(got), len(want), what)
    for step, (have, expected) in enumerate(zip(got, want, strict=True)):
        for key in keys:
            if abs(have[key] - expected[key]) > METRIC_TOL * max(1.0, abs(expected[key])):
                raise AssertionError(f"{what}, update {step + 1}, {key}: {have[key]} vs reference {expected[key]}")


def gspo_config(parallel: ParallelConfig) -> Config:
    cfg = actor_config(parallel)
    cfg.algorithm = dataclasses.replace(preset("gspo"), routing_replay="r3")
    cfg.rollout.return_routed_experts = True
    validate(cfg)
    return cfg


def gspo_then_sft(ctx, parallel: ParallelConfig, pack: bool) -> dict[str, object]:  # noqa: ANN001
    """Two GSPO updates with R3 routing, then two SFT updates, on a fresh actor: histories and parameters."""
    actor = MegatronActor(gspo_config(parallel))
    cfg = actor.cfg
    batch = make_batch(cfg.model.vocab_size)
    engine_routing = random_routing(cfg.model.num_layers, cfg.model.moe_router_topk, cfg.model.num_experts)
    with packed(actor) if pack else nullcontext():
        gspo = actor.train(train_batch(batch, load_ref(ctx, "log_probs"), engine_routing))
        gspo_params = actor.full_params()
        sft = actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
    result = {"gspo": gspo, "gspo_params": gspo_params, "sft": sft, "sft_params": actor.full_params()}
    actor.close()
    destroy_distributed(process_group=False)
    return result


def mla_run(parallel: ParallelConfig) -> dict[str, object]:
    """DeepSeek-V3's attention: log-probs with R2 recording (packed too, when split over CP), then two
    GRPO updates replaying it."""
    cfg = dataclasses.replace(actor_config(parallel), model=tiny_sigmoid_model("deepseek_v3", "split"))
    validate(cfg)
    actor = MegatronActor(cfg)
    batch = make_batch(cfg.model.vocab_size)
    result: dict[str, object] = {}
    if parallel.context_parallel_size > 1:
        with packed(actor):
            result["packed_log_probs"] = actor.compute_log_probs(batch).log_probs
    out = actor.compute_log_probs(batch, record_routing=True)
    result.update(log_probs=out.log_probs, routing=out.routed_experts)
    result["history"] = actor.train(train_batch(batch, out.log_probs, out.routed_experts))
    result["params"] = actor.full_params()
    actor.close()
    destroy_distributed(process_group=False)
    return result


def w1_cp_references(ctx) -> None:  # noqa: ANN001
    """The references of `check_cp_sequences` (world size 1, padded)."""
    gspo = gspo_then_sft(ctx, layout(), pack=False)
    assert all(h["grad_norm"] > 0.5 for h in gspo["gspo"] + gspo["sft"]), (
        "every update must be clipped (train.grad_clip = 0.5) for the parameters to see a wrong gradient scale"
    )
    save_ref(ctx, "cp_gspo_sft", gspo)
    save_ref(ctx, "cp_mla", mla_run(layout()))


def check_cp_sequences(ctx, parallel: ParallelConfig) -> None:  # noqa: ANN001
    """GSPO with R3, then SFT, padded and packed; DeepSeek-V3's log-probs (padded and packed), routing
    and updates: against the world-size-1 references."""
    want = load_ref(ctx, "cp_gspo_sft")
    for pack in (False, True):
        what = f"{'packed' if pack else 'padded'}, {parallel}"
        got = gspo_then_sft(ctx, parallel, pack)
        gspo_keys = ("loss", "grad_norm", "ratio_mean", "clip_high_frac", "tokens")
        _close_metrics(got["gspo"], want["gspo"], gspo_keys, f"GSPO R3, {what}")
        assert_params_close(got["gspo_params"], want["gspo_params"], f"parameters after GSPO R3, {what}")
        _close_metrics(got["sft"], want["sft"], ("loss", "grad_norm", "tokens"), f"SFT, {what}")
        assert_params_close(got["sft_params"], want["sft_params"], f"parameters after SFT, {what}")

    want = load_ref(ctx, "cp_mla")
    got = mla_run(parallel)
    what = f"DeepSeek-V3, {parallel}"
    assert_close(got["log_probs"], want["log_probs"], LOGPROB_TOL, f"log-probs, {what}")
    assert_close(got["packed_log_probs"], want["log_probs"], LOGPROB_TOL, f"packed log-probs, {what}")
    dense = slice(1, None)  # layer 0 is dense: no routing
    assert all(torch.equal(a[:, dense], b[:, dense]) for a, b in zip(got["routing"], want["routing"], strict=True)), (
        f"recorded routing differs, {what}"
    )
    _close_metrics(got["history"], want["history"], ("loss", "grad_norm"), what)
    assert_params_close(got["params"], want["params"], f"parameters, {what}")


def check_layout_briefly(
    ctx,  # noqa: ANN001
    parallel: ParallelConfig,
    then: Callable[[MegatronActor, ActorBatch], None] | None = None,
) -> None:
    """`check_layout_against_reference`'s log-probs, entropy, recorded routing and R3 log-probs, padded
    and packed, and its first two (padded) updates: loss, grad norm, parameters; then `then(actor, batch)`."""
    actor = MegatronActor(actor_config(parallel))
    cfg = actor.cfg
    batch = make_batch(cfg.model.vocab_size)
    r3 = random_routing(cfg.model.num_layers, cfg.model.moe_router_topk, cfg.model.num_experts)
    for pack in (False, True):
        what = f"{'packed' if pack else 'padded'}, {parallel}"
        with packed(actor) if pack else nullcontext():
            out = actor.compute_log_probs(batch, record_routing=True)
            r3_out = actor.compute_log_probs(batch.with_fields(routed_experts=r3), replay_routing=True)
        assert_close(out.log_probs, load_ref(ctx, "log_probs"), LOGPROB_TOL, f"log-probs, {what}")
        assert_close(out.entropy, load_ref(ctx, "entropy"), LOGPROB_TOL, f"entropy, {what}")
        assert_close(r3_out.log_probs, load_ref(ctx, "r3_log_probs"), LOGPROB_TOL, f"R3 log-probs, {what}")
        moe = list(MOE_LAYERS)
        routing = zip(out.routed_experts, load_ref(ctx, "routing"), strict=True)
        assert all(torch.equal(a[:, moe], b[:, moe]) for a, b in routing), f"recorded routing differs, {what}"
    history = actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    _close_metrics(history, load_ref(ctx, "history"), ("loss", "grad_norm", "tokens"), f"GRPO R2, {parallel}")
    assert_params_close(actor.full_params(), load_ref(ctx, "params_2"), f"parameters after 2 updates, {parallel}")
    if then is not None:
        then(actor, batch)
    actor.close()


def w2_cp2(ctx) -> None:  # noqa: ANN001
    check_layout_against_reference(ctx, layout(cp=2), direct_routing_check=True)


def w2_cp2_gspo_sft_mla(ctx) -> None:  # noqa: ANN001
    check_cp_sequences(ctx, layout(cp=2))


def w4_tp2_cp2(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout(tp=2, sp=True, cp=2))

"""Scenarios for tests/test_actor_distributed.py (run by launcher.py, one process per rank).

The world-size-1 launch computes the references (log-probs, entropy, recorded routing, R3
log-probs, parameters after 2 and 4 optimizer steps, a checkpoint and a weights-only checkpoint
after 2) into the folder `ctx.params["ref_dir"]`; every other layout must reproduce them. The
vocabulary (300) pads to 384 rows at TP = 1 and 512 at TP = 2, so checkpoints cross paddings. The tiny policy has 4 layers (the
first dense, so layer 0 has no router), 4 experts top-2, and a token budget that gives several
micro-batches of different shapes per rank; packed (`packed`: `train.micro_batch_tokens` = 40), 2 to
4 samples share a sequence, and the packed results must match the same (padded) references.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.forward import LogProbHead, packed_seq_params, plan_for_rank, prepare_inputs, run_schedule
from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.checkpoints import ACTOR_DIR, MANIFEST_FILE, CheckpointWriteError, checkpoint_dir
from megatron_rl.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    LoggingConfig,
    ParallelConfig,
    RolloutConfig,
    TrainConfig,
    preset,
    validate,
)
from megatron_rl.data import PromptSampler
from megatron_rl.models.checkpoint_io import save_model_weights
from megatron_rl.parallel import destroy_distributed
from megatron_rl.run_folder import RunFolder

from mrl_configs import SIGMOID_FAMILIES, layout, tiny_model, tiny_sigmoid_model
from mrl_multiproc.model_helpers import forward_logits

TEMPERATURE = 0.7
LOGPROB_TOL = 1e-5
PARAM_TOL = 1e-6

LENGTHS = (22, 7, 15, 11, 19, 9, 13, 17)
PACKED_TOKENS = 40  # train.micro_batch_tokens of the packed runs: 2-4 samples per sequence
PROMPTS = (5, 3, 6, 2, 4, 3, 5, 6)
MOE_LAYERS = (1, 2, 3)


# --- set-up --------------------------------------------------------------------------------


def actor_config(parallel: ParallelConfig, **model_overrides: object) -> Config:
    """The tiny MoE policy with GRPO; Adam eps 1e-3 keeps fp32 rounding from being amplified."""
    cfg = Config(
        model=tiny_model("qwen3_moe", **model_overrides),
        parallel=parallel,
        rollout=RolloutConfig(temperature=TEMPERATURE, max_new_tokens=24),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2"),
        train=TrainConfig(
            steps=3,
            updates_per_step=2,
            max_tokens_per_micro_batch=48,
            logprob_chunk_tokens=16,
            lr=3e-3,
            lr_warmup_steps=1,
            lr_decay_style="linear",
            min_lr=3e-4,
            adam_eps=1e-3,
            grad_clip=0.5,
            seed=11,
        ),
    )
    validate(cfg)
    return cfg


def make_batch(vocab_size: int, seed: int = 0) -> ActorBatch:
    """8 samples of different lengths, the same on every rank; advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab_size, (n,), generator=gen) for n in LENGTHS]
    adv = [torch.randn((), generator=gen) for _ in LENGTHS]
    return ActorBatch(tokens=tokens, prompt_lengths=list(PROMPTS), advantages=adv)


def random_routing(num_layers: int, top_k: int, num_experts: int, seed: int = 5) -> list[torch.Tensor]:
    """R3 input in SGLang's layout: distinct random experts per token and layer."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        scores = torch.rand(n - 1, num_layers, num_experts, generator=gen)
        out.append(scores.argsort(dim=-1)[..., :top_k].to(torch.int32))
    return out


def train_batch(batch: ActorBatch, log_probs: list[torch.Tensor], routing: list[torch.Tensor]) -> ActorBatch:
    """Old log-probs a little off the current ones (ratios away from 1: clipping happens), R2 routing."""
    gen = torch.Generator().manual_seed(3)
    old = [lp + 0.2 * torch.randn(lp.shape, generator=gen) for lp in log_probs]
    return batch.with_fields(old_log_probs=old, routed_experts=routing)


def ref_dir(ctx) -> Path:  # noqa: ANN001
    """The folder the world-size-1 launch writes the references to (the same for every launch)."""
    return Path(ctx.params["ref_dir"])


def save_ref(ctx, name: str, value: object) -> None:  # noqa: ANN001
    if ctx.rank == 0:
        torch.save(value, ref_dir(ctx) / f"{name}.pt")
    dist.barrier()


def load_ref(ctx, name: str) -> object:  # noqa: ANN001
    return torch.load(ref_dir(ctx) / f"{name}.pt", weights_only=False)


def diff(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape, (a.shape, e.shape)
    return max(float((a.double() - e.double()).abs().max()) for a, e in zip(actual, expected, strict=True))


def assert_close(actual, expected, tol: float, what: str) -> None:  # noqa: ANN001
    d = diff(actual, expected)
    if not d <= tol:
        raise AssertionError(f"{what}: max abs diff {d:.3e} > {tol:.0e}")


def assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: parameter names differ: {sorted(set(actual) ^ set(expected))[:5]}")
    worst = max(((actual[k] - expected[k]).abs().max().item(), k) for k in expected)
    if not worst[0] <= PARAM_TOL:
        raise AssertionError(f"{what}: {worst[1]} differs by {worst[0]:.3e} > {PARAM_TOL:.0e}")


def plain_log_probs(actor: MegatronActor, batch: ActorBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reference: each sample alone through the model, full-vocabulary log_softmax(logits / T) in fp64."""
    vocab = actor.cfg.model.vocab_size
    logp, ent = [], []
    for tok, p in zip(batch.tokens, batch.prompt_lengths, strict=True):
        logits = forward_logits(actor.state.model, tok.unsqueeze(0), vocab)[0].double() / TEMPERATURE
        lsm = F.log_softmax(logits, dim=-1)
        logp.append(lsm[p - 1 : -1].gather(-1, tok[p:].unsqueeze(-1)).squeeze(-1).float())
        ent.append(-(lsm.exp() * lsm).sum(-1)[p - 1 : -1].float())
    return logp, ent


# --- the hidden-state log-prob path against the logits path -------------------------------


def _logits_path(actor: MegatronActor, inputs, coef) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """The pre-fusion path: the model's own output layer, its logits gathered over TP, a full-vocabulary
    fp32 log_softmax / T; forward and backward of `_probe_loss` through Megatron's schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    vocab = actor.cfg.model.vocab_size
    outs = []
    it = iter(zip(inputs, coef, strict=True))

    def step(data_iterator, model):  # noqa: ANN001, ANN202 - Megatron's forward_step_func contract
        mb, (a, b) = next(data_iterator)

        def loss_func(logits: torch.Tensor):  # noqa: ANN202
            if ps.get_tensor_model_parallel_world_size() > 1:
                logits = gather_from_tensor_model_parallel_region(logits)
            lsm = F.log_softmax(logits[..., :vocab].float() / TEMPERATURE, dim=-1)
            logp = mb.to_rows(lsm.gather(-1, mb.head_target.unsqueeze(-1)).squeeze(-1).where(mb.head_mask, 0.0))
            ent = mb.to_rows((-(lsm.exp() * lsm).sum(-1)).where(mb.head_mask, 0.0))
            outs.append((logp.detach(), ent.detach()))
            return _probe_loss(logp, ent, a, b), {}

        return model(mb.input_ids, mb.position_ids, None, packed_seq_params=packed_seq_params(mb)), loss_func

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=it,
        model=list(actor.state.model),
        num_microbatches=len(inputs),
        seq_length=inputs[0].max_len,
        micro_batch_size=inputs[0].rows,
        forward_only=False,
    )
    return outs


def _hidden_path(actor: MegatronActor, inputs, coef) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """The actor's path: `run_schedule` with its `LogProbHead`, forward and backward of `_probe_loss`."""
    outs = []
    pairs = dict(zip((id(mb) for mb in inputs), coef, strict=True))

    def loss_fn(mb, out):  # noqa: ANN001, ANN202
        a, b = pairs[id(mb)]
        outs.append((out.logprobs.detach(), out.entropy.detach()))
        return _probe_loss(out.logprobs, out.entropy, a, b), None

    cfg = actor.cfg
    head = LogProbHead(TEMPERATURE, cfg.model.vocab_size, cfg.train.logprob_chunk_tokens)
    run_schedule(actor.state.model, inputs, loss_fn, head=head, forward_only=False)
    return outs


def _probe_loss(logp: torch.Tensor, ent: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (logp * a).sum() + (ent * b).sum()


def _grads(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {
        f"{k}.{name}": p.main_grad.detach().clone()
        for k, chunk in enumerate(actor.state.model)
        for name, p in chunk.named_parameters()
    }


def check_hidden_path_against_logits(actor: MegatronActor, batch: ActorBatch, what: str) -> None:
    """The actor's log-prob path (decoder hidden states -> `LogProbHead`, no logits) against the logits
    path on the same weights and layout: log-probs, entropy and the gradient of every parameter (this
    rank's shard, after Megatron's gradient finalisation) of sum_t a_t logp_t + b_t H_t with random
    a, b over the response tokens, so both outputs' gradients count; within 1e-5 (gradients: relative
    to their largest entry when it exceeds 1). Leaves the gradients zeroed."""
    model = actor.state.model
    micro = plan_for_rank(batch.lengths, TokenBudget.of(actor.cfg.train))
    inputs = prepare_inputs(model, batch, micro, every_response_token=True)
    gen = torch.Generator().manual_seed(17)
    coef = [tuple(torch.randn(mb.target.shape, generator=gen).to(mb.target.device) for _ in "ab") for mb in inputs]
    results = []
    for path in (_hidden_path, _logits_path):
        for chunk in model:
            chunk.train()
            chunk.zero_grad_buffer()
        outs = path(actor, inputs, coef)
        results.append((outs, _grads(actor)))
    for chunk in model:
        chunk.zero_grad_buffer()
    (fused, fused_grads), (plain, plain_grads) = results
    from megatron.core import parallel_state as ps

    expected = len(inputs) if ps.is_pipeline_last_stage() else 0
    assert len(fused) == len(plain) == expected, (len(fused), len(plain), expected)
    for k, ((lp, ent), (lp_ref, ent_ref)) in enumerate(zip(fused, plain, strict=True)):
        for name, got, want in (("log-probs", lp, lp_ref), ("entropy", ent, ent_ref)):
            d = float((got.double() - want.double()).abs().max())
            if not d <= LOGPROB_TOL:
                raise AssertionError(f"hidden vs logits path, {name} of micro-batch {k}: {d:.3e} > 1e-5, {what}")
    assert fused_grads.keys() == plain_grads.keys()
    assert any(float(g.abs().max()) > 0 for g in plain_grads.values()), "no gradient reached the parameters"
    for name, want in plain_grads.items():
        # fp32 sums in another order: 1e-5 relative to the gradient's largest entry (absolute below 1)
        scale = max(1.0, float(want.abs().max()))
        d = float((fused_grads[name].double() - want.double()).abs().max())
        if not d <= LOGPROB_TOL * scale:
            raise AssertionError(
                f"hidden vs logits path, gradient of {name}: {d:.3e} > 1e-5 x {scale:.3g} (its max), {what}"
            )


# --- routing checks ------------------------------------------------------------------------


class RoutingCapture:
    """Forward hooks that keep every router's routing map (this rank's tokens), per forward."""

    def __init__(self, actor: MegatronActor) -> None:
        self.maps: dict[int, list[torch.Tensor]] = {layer: [] for layer in actor.routing.layers}
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in actor.routing.routers]

    def _hook(self, layer: int):  # noqa: ANN202
        def hook(module, args, output) -> None:  # noqa: ANN001
            self.maps[layer].append(output[1].detach().cpu())

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def check_replayed_experts(actor: MegatronActor, batch: ActorBatch, routing: list[torch.Tensor]) -> None:
    """Replay `routing` in a log-prob pass and check, token by token, that every router of every rank
    dispatched each given token to exactly the given experts; every (token, MoE layer) is checked once."""
    capture = RoutingCapture(actor)
    try:
        actor.compute_log_probs(batch.with_fields(routed_experts=routing), replay_routing=True)
    finally:
        capture.close()
    # the split compute_log_probs uses: the step's mini-batches' (train.updates_per_step)
    micro = plan_for_rank(batch.lengths, TokenBudget.of(actor.cfg.train), actor.cfg.train.updates_per_step)
    inputs = prepare_inputs(actor.state.model, batch, micro)
    checked = 0
    for layer, maps in capture.maps.items():
        assert len(maps) == len(micro), f"layer {layer}: {len(maps)} forwards for {len(micro)} micro-batches"
        for mb, routing_map in zip(inputs, maps, strict=True):
            split = mb.context.split if mb.context is not None else None  # CP: this rank's positions
            held = actor.routing.token_slice(mb.rows, mb.max_len, split).positions.tolist()
            local = routing_map.view(len(held), mb.rows, -1)
            for i, n, (row, start) in zip(mb.micro_batch.indices, mb.micro_batch.lengths, mb.placements, strict=True):
                for k, pos in enumerate(held):
                    if not start <= pos < start + n - 1:
                        continue
                    got = sorted(local[k, row].nonzero().flatten().tolist())
                    want = sorted(routing[i][pos - start, layer].tolist())
                    if got != want:
                        raise AssertionError(
                            f"sample {i} position {pos - start} layer {layer}: experts {got}, given {want}"
                        )
                    checked += 1
    total = torch.tensor([checked], dtype=torch.int64)
    dist.all_reduce(total)
    expected = sum(n - 1 for n in LENGTHS) * len(MOE_LAYERS)
    if int(total) != expected:
        raise AssertionError(f"checked {int(total)} (token, layer) pairs over all ranks, expected {expected}")


@contextmanager
def packed(actor: MegatronActor) -> Iterator[None]:
    """While open, the actor packs its micro-batches (`train.micro_batch_tokens` = PACKED_TOKENS)."""
    actor.cfg.train.micro_batch_tokens = PACKED_TOKENS
    try:
        yield
    finally:
        actor.cfg.train.micro_batch_tokens = 0


def check_log_probs_and_routing(ctx, actor: MegatronActor, batch: ActorBatch, what: str, direct: bool) -> None:  # noqa: ANN001
    """The hidden-state path against the logits path, then log-probs, entropy, recorded routing and R3
    log-probs against the world-size-1 references; R2 replay at unchanged weights exact."""
    cfg = actor.cfg
    check_hidden_path_against_logits(actor, batch, what)
    out = actor.compute_log_probs(batch, record_routing=True)
    assert_close(out.log_probs, load_ref(ctx, "log_probs"), LOGPROB_TOL, f"log-probs, {what}")
    assert_close(out.entropy, load_ref(ctx, "entropy"), LOGPROB_TOL, f"entropy, {what}")
    moe = list(MOE_LAYERS)
    mismatch = sum(
        int((a[:, moe] != b[:, moe]).any(dim=-1).sum())
        for a, b in zip(out.routed_experts, load_ref(ctx, "routing"), strict=True)
    )
    assert mismatch == 0, f"recorded routing differs from the reference at {mismatch} (token, layer) pairs, {what}"

    replayed = actor.compute_log_probs(batch.with_fields(routed_experts=out.routed_experts), replay_routing=True)
    assert diff(replayed.log_probs, out.log_probs) == 0.0, f"R2 replay at unchanged weights moved log-probs, {what}"
    assert diff(replayed.entropy, out.entropy) == 0.0, f"R2 replay at unchanged weights moved entropy, {what}"

    r3 = random_routing(cfg.model.num_layers, cfg.model.moe_router_topk, cfg.model.num_experts)
    r3_out = actor.compute_log_probs(batch.with_fields(routed_experts=r3), replay_routing=True)
    assert_close(r3_out.log_probs, load_ref(ctx, "r3_log_probs"), LOGPROB_TOL, f"R3 log-probs, {what}")
    if direct:
        check_replayed_experts(actor, batch, r3)


def check_w1_checkpoint_resumes(ctx, actor: MegatronActor, batch: ActorBatch, what: str) -> None:  # noqa: ANN001
    """`w1_reference`'s checkpoint (after 2 updates; model and optimizer state) loaded into `actor`: its
    log-probs, then 2 more updates (the LR schedule, the parameters) are the world-size-1 run's."""
    info = actor.load(ref_dir(ctx) / "ckpt_w1")
    assert info["step"] == 2 and actor.step == 2 and not info["rng_restored"], info
    after_load = actor.compute_log_probs(batch)
    assert_close(after_load.log_probs, load_ref(ctx, "log_probs_2"), LOGPROB_TOL, f"log-probs after loading, {what}")
    history = actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    assert [h["lr"] for h in history] == [h["lr"] for h in load_ref(ctx, "history_4")], "LR schedule after loading"
    assert_params_close(actor.full_params(), load_ref(ctx, "params_4"), f"parameters after loading + 2 steps, {what}")


def check_layout_against_reference(
    ctx, parallel: ParallelConfig, *, direct_routing_check: bool, save_as: str = ""
) -> None:  # noqa: ANN001
    """Everything one layout must reproduce of the world-size-1 run (see the module docstring)."""
    cfg = actor_config(parallel)
    actor = MegatronActor(cfg)
    batch = make_batch(cfg.model.vocab_size)
    what = f"layout {parallel}"

    check_log_probs_and_routing(ctx, actor, batch, what, direct_routing_check)
    with packed(actor):
        check_log_probs_and_routing(ctx, actor, batch, f"packed, {what}", direct_routing_check)
    ref_routing = load_ref(ctx, "routing")

    history = actor.train(train_batch(batch, load_ref(ctx, "log_probs"), ref_routing))
    assert len(history) == 2 and actor.step == 2
    expected_hist = load_ref(ctx, "history")
    for got, want in zip(history, expected_hist, strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens", "clip_high_frac", "routing_changed_frac"):
            if abs(got[key] - want[key]) > 1e-5 * max(1.0, abs(want[key])):
                raise AssertionError(f"metric {key}: {got[key]} vs reference {want[key]}, {what}")
    assert_params_close(actor.full_params(), load_ref(ctx, "params_2"), f"parameters after 2 steps, {what}")
    if save_as:
        actor.save(ref_dir(ctx) / save_as)

    check_w1_checkpoint_resumes(ctx, actor, batch, what)

    with packed(actor):  # the same two updates from the same checkpoint, packed
        actor.load(ref_dir(ctx) / "ckpt_w1")
        history = actor.train(train_batch(batch, load_ref(ctx, "log_probs"), ref_routing))
        for got, want in zip(history, load_ref(ctx, "history_4"), strict=True):
            for key in ("loss", "grad_norm", "entropy_mean", "clip_high_frac", "routing_changed_frac"):
                if abs(got[key] - want[key]) > 1e-5 * max(1.0, abs(want[key])):
                    raise AssertionError(f"packed, metric {key}: {got[key]} vs reference {want[key]}, {what}")
        assert_params_close(actor.full_params(), load_ref(ctx, "params_4"), f"packed, parameters, {what}")
    actor.close()


# --- sigmoid, grouped, biased routing (DeepSeek-V3, GLM-4.5) ---------------------------------


class GateCapture:
    """Forward hooks keeping every router's input and output (probs, routing map), per forward."""

    def __init__(self, actor: MegatronActor) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in actor.routing.routers]

    def _hook(self, layer: int):  # noqa: ANN202
        def hook(module, args, output) -> None:  # noqa: ANN001
            self.calls.append((layer, args[0].detach(), output[0].detach(), output[1].detach()))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def check_sigmoid_gates(actor: MegatronActor, calls: list, scaling: float) -> int:
    """Every routed token's gate weights are the sigmoid of the *current* router logits at the routed
    experts, renormalised over them and times the routed scaling factor (computed here, by hand);
    returns the tokens checked."""
    routers = dict(actor.routing.routers)
    checked = 0
    for layer, hidden, probs, routing_map in calls:
        weight = routers[layer].weight.detach().float()
        scores = torch.sigmoid(hidden.reshape(-1, hidden.shape[-1]).float() @ weight.t())
        chosen = torch.where(routing_map, scores, torch.zeros_like(scores))
        expected = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) * scaling
        gap = (probs.float() - expected).abs().max().item()
        assert gap <= 1e-6, f"layer {layer}: gate weights differ from the renormalised current scores by {gap:.2e}"
        assert int(routing_map.sum(dim=-1).min()) == actor.cfg.model.moe_router_topk
        checked += routing_map.shape[0]
    return checked


def sigmoid_replay(parallel: ParallelConfig) -> None:
    """Per family: R2 records the grouped, biased routing and replays it exactly (every token to the
    recorded experts, log-probs bit for bit); after the router's weights and the expert bias move (so
    that free routing changes), the replay still sends every token to the recorded experts with gates
    from the current scores; R3 routes as the engine says."""
    for family in SIGMOID_FAMILIES:
        cfg = dataclasses.replace(actor_config(parallel), model=tiny_sigmoid_model(family, "split"))
        validate(cfg)
        actor = MegatronActor(cfg)
        model = cfg.model
        batch = make_batch(model.vocab_size)
        assert all(float(r.expert_bias.abs().min()) > 0 for _, r in actor.routing.routers), "expert bias is zero"
        out = actor.compute_log_probs(batch, record_routing=True)
        replayed = actor.compute_log_probs(batch.with_fields(routed_experts=out.routed_experts), replay_routing=True)
        assert diff(replayed.log_probs, out.log_probs) == 0.0, (
            f"{family}: R2 replay at unchanged weights moved log-probs"
        )
        check_replayed_experts(actor, batch, out.routed_experts)

        gen = torch.Generator().manual_seed(9)
        with torch.no_grad():  # the same change on every rank (routers are replicated)
            for _, router in actor.routing.routers:
                router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=gen).to(router.weight))
                router.expert_bias.add_(0.2 * torch.randn(router.expert_bias.shape, generator=gen))
        moved = actor.compute_log_probs(batch, record_routing=True)
        moe = list(MOE_LAYERS)
        changed = sum(
            int((a[:, moe].sort(-1).values != b[:, moe].sort(-1).values).any(-1).sum())
            for a, b in zip(moved.routed_experts, out.routed_experts, strict=True)
        )
        assert changed > 0, f"{family}: the moved router routes every token as before: the check means nothing"
        capture = GateCapture(actor)
        try:
            check_replayed_experts(actor, batch, out.routed_experts)
        finally:
            capture.close()
        checked = check_sigmoid_gates(actor, capture.calls, model.moe_router_scaling_factor)
        assert checked > 0 and model.moe_router_scaling_factor != 1.0

        r3 = random_routing(model.num_layers, model.moe_router_topk, model.num_experts)
        check_replayed_experts(actor, batch, r3)
        actor.close()
        destroy_distributed(process_group=False)


# --- world size 1 --------------------------------------------------------------------------


def w1_sigmoid_replay(ctx) -> None:  # noqa: ANN001
    sigmoid_replay(layout())


def w1_reference(ctx) -> None:  # noqa: ANN001
    """Log-probs/entropy equal a plain full-vocab log_softmax; R2 replay exact; R3 routes as given;
    the references for the other layouts."""
    cfg = actor_config(layout())
    actor = MegatronActor(cfg)
    batch = make_batch(cfg.model.vocab_size)
    check_hidden_path_against_logits(actor, batch, "world size 1")
    out = actor.compute_log_probs(batch, record_routing=True)
    ref_lp, ref_ent = plain_log_probs(actor, batch)
    assert_close(out.log_probs, ref_lp, LOGPROB_TOL, "log-probs vs full-vocab log_softmax")
    assert_close(out.entropy, ref_ent, LOGPROB_TOL, "entropy vs full-vocab log_softmax")
    assert [r.shape for r in out.routed_experts] == [(n - 1, 4, 2) for n in LENGTHS]
    assert all(bool((r[:, 0] == -1).all()) for r in out.routed_experts), "dense layer 0 must read -1"

    replayed = actor.compute_log_probs(batch.with_fields(routed_experts=out.routed_experts), replay_routing=True)
    assert diff(replayed.log_probs, out.log_probs) == 0.0 and diff(replayed.entropy, out.entropy) == 0.0

    r3 = random_routing(cfg.model.num_layers, cfg.model.moe_router_topk, cfg.model.num_experts)
    r3_out = actor.compute_log_probs(batch.with_fields(routed_experts=r3), replay_routing=True)
    assert diff(r3_out.log_probs, out.log_probs) > 1e-2, "R3 replay of random routing must change log-probs"
    check_replayed_experts(actor, batch, r3)

    for name, value in (
        ("log_probs", out.log_probs),
        ("entropy", out.entropy),
        ("routing", out.routed_experts),
        ("r3_log_probs", r3_out.log_probs),
    ):
        save_ref(ctx, name, value)

    history = actor.train(train_batch(batch, out.log_probs, out.routed_experts))
    # warm-up over 1 update, then linear decay towards 3e-4, reached after update 6: update 2 is 1/6 of the way
    lrs = [h["lr"] for h in history]
    assert abs(lrs[0] - 3e-3) < 1e-12 and abs(lrs[1] - (3e-3 - 2.7e-3 / 6)) < 1e-12, lrs
    assert history[0]["routing_changed_frac"] == 0.0, "first update replays routing of unchanged weights"
    assert history[1]["routing_changed_frac"] > 0.0, "the second update sees re-routed tokens"
    save_ref(ctx, "history", history)
    save_ref(ctx, "params_2", actor.full_params())
    save_ref(ctx, "log_probs_2", actor.compute_log_probs(batch).log_probs)
    save_model_weights(actor.chunks, ref_dir(ctx) / "weights_w1")  # what the HF -> Megatron converter writes
    actor.save(ref_dir(ctx) / "ckpt_w1")
    draws = (torch.rand(4), torch.randn(2))
    save_ref(ctx, "draws_after_save", draws)
    history = actor.train(train_batch(batch, out.log_probs, out.routed_experts))
    save_ref(ctx, "history_4", history)
    save_ref(ctx, "params_4", actor.full_params())

    # weights only: the model (and the optimizer's master copy) as saved, the optimizer state untouched
    info = actor.load(ref_dir(ctx) / "ckpt_w1", load_optimizer=False)
    assert actor.step == 4 and info["step"] == 2
    assert_close(actor.compute_log_probs(batch).log_probs, load_ref(ctx, "log_probs_2"), 0.0, "weights-only load")

    # the same layout also gets its RNG states back: the draws after saving repeat
    info = actor.load(ref_dir(ctx) / "ckpt_w1")
    assert info["rng_restored"] and info["step"] == 2 and actor.step == 2
    assert torch.equal(torch.rand(4), draws[0]) and torch.equal(torch.randn(2), draws[1]), "RNG not restored"
    actor.close()


def recompute_replay(ctx, parallel: ParallelConfig) -> None:  # noqa: ANN001
    """With activation recompute, replay also holds in backward (REPLAY_BACKWARD): the update equals
    the one without recompute. Under 1F1B (PP = 2) several forwards precede the first backward, so
    the recompute must take the routing of its own micro-batch."""
    cfg = actor_config(parallel, recompute=True)
    actor = MegatronActor(cfg)
    assert actor.chunks[0].config.recompute_granularity == "full"
    batch = make_batch(cfg.model.vocab_size)
    actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    assert_params_close(
        actor.full_params(), load_ref(ctx, "params_2"), f"parameters after 2 steps with recompute, {parallel}"
    )
    with packed(actor):  # the recompute in backward replays the packed tokens' routing
        actor.load(ref_dir(ctx) / "ckpt_w1")
        actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
        assert_params_close(
            actor.full_params(), load_ref(ctx, "params_4"), f"packed, 2 more steps with recompute, {parallel}"
        )
    actor.close()


def hidden_path_tied(parallel: ParallelConfig) -> None:
    """Tied embeddings: the log-prob path reads the embedding's weight (PP = 1) or the last stage's
    copy of it (PP = 2, its gradient then summed over the embedding group); the logits path agrees."""
    cfg = actor_config(parallel, tie_word_embeddings=True)
    actor = MegatronActor(cfg)
    assert all(chunk.share_embeddings_and_output_weights for chunk in actor.chunks)
    check_hidden_path_against_logits(actor, make_batch(cfg.model.vocab_size), f"tied embeddings, {parallel}")
    actor.close()


def w1_hidden_path_tied(ctx) -> None:  # noqa: ANN001
    hidden_path_tied(layout())


def w1_recompute_replay(ctx) -> None:  # noqa: ANN001
    recompute_replay(ctx, layout())


def w1_checkpoint_load_both_kinds(ctx) -> None:  # noqa: ANN001
    """`checkpoint.load` at start-up takes a weights-only checkpoint saved under the same layout (no
    RNG or optimizer state is asked for) and a full one; `load` of a weights-only checkpoint keeps
    the optimizer state, schedule and step."""
    batch = make_batch(actor_config(layout()).model.vocab_size)
    cfg = actor_config(layout())
    cfg.checkpoint.load = str(ref_dir(ctx) / "weights_w1")
    actor = MegatronActor(cfg)
    assert actor.step == 0
    assert_close(
        actor.compute_log_probs(batch).log_probs, load_ref(ctx, "log_probs_2"), 0.0, "checkpoint.load, weights"
    )
    actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    lrs = [g["lr"] for g in actor.state.optimizer.param_groups]
    info = actor.load(ref_dir(ctx) / "weights_w1")
    assert info["weights_only"] and not info["optimizer_loaded"] and not info["rng_restored"], info
    assert actor.step == 2 and [g["lr"] for g in actor.state.optimizer.param_groups] == lrs, "schedule moved"
    assert_close(actor.compute_log_probs(batch).log_probs, load_ref(ctx, "log_probs_2"), 0.0, "load of weights")
    actor.close()
    destroy_distributed(process_group=False)

    cfg.checkpoint.load = str(ref_dir(ctx) / "ckpt_w1")
    actor = MegatronActor(cfg)
    assert actor.step == 2 and torch.equal(torch.rand(4), load_ref(ctx, "draws_after_save")[0]), "RNG not restored"
    assert_close(actor.compute_log_probs(batch).log_probs, load_ref(ctx, "log_probs_2"), 0.0, "checkpoint.load, full")
    actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    assert_params_close(actor.full_params(), load_ref(ctx, "params_4"), "checkpoint.load, full, + 2 steps")
    actor.close()


def reject_run(ctx, parallel: ParallelConfig) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:  # noqa: ANN001
    """Two updates with `algorithm.is_correction = reject` on engine log-probs 0.3-noisy around the old ones."""
    cfg = actor_config(parallel)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, is_correction="reject", is_mask_min=0.8, is_mask_max=1.25)
    actor = MegatronActor(cfg)
    old = load_ref(ctx, "log_probs")
    gen = torch.Generator().manual_seed(9)
    rollout = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in old]
    batch = make_batch(cfg.model.vocab_size).with_fields(
        old_log_probs=old, rollout_log_probs=rollout, routed_experts=load_ref(ctx, "routing")
    )
    history = actor.train(batch)
    params = actor.full_params()
    actor.close()
    return history, params


def w1_reject_reference(ctx) -> None:  # noqa: ANN001
    """IS rejection: some tokens rejected (out of the normaliser), the reference for data parallelism."""
    history, params = reject_run(ctx, layout())
    assert all(0.1 < h["is_rejected_frac"] < 0.9 for h in history), [h["is_rejected_frac"] for h in history]
    save_ref(ctx, "reject_history", history)
    save_ref(ctx, "reject_params", params)


# --- world size 2 --------------------------------------------------------------------------


def w2_reject_dp2(ctx) -> None:  # noqa: ANN001
    """IS rejection over 2 DP ranks equals one rank: the kept masks, and so the global normaliser, agree."""
    history, params = reject_run(ctx, layout())
    for got, want in zip(history, load_ref(ctx, "reject_history"), strict=True):
        for key in ("loss", "grad_norm", "tokens", "is_rejected_frac"):
            if abs(got[key] - want[key]) > 1e-5 * max(1.0, abs(want[key])):
                raise AssertionError(f"metric {key}: {got[key]} vs reference {want[key]}, DP 2")
    assert_params_close(params, load_ref(ctx, "reject_params"), "parameters after 2 rejection updates, DP 2")


# --- LoRA: every layout reproduces the world-size-1 adapters -----------------------------


def lora_actor(parallel: ParallelConfig, **model_overrides: object) -> MegatronActor:
    """The tiny policy with rank-4 adapters on every module (attention, the dense layer's MLP, the routed
    experts), their B drawn away from 0 (the same full tensors on every layout) so that every gradient flows."""
    from megatron_rl.config import LoraConfig
    from megatron_rl.models.lora import gather_adapters, load_adapters

    cfg = actor_config(parallel, **model_overrides)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig(rank=4, alpha=8.0)))
    actor = MegatronActor(cfg)
    gen = torch.Generator().manual_seed(21)
    start = gather_adapters(actor.lora)
    load_adapters(
        actor.lora, {k: v if "lora_A" in k else 0.1 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    )
    return actor


def lora_run(actor: MegatronActor) -> dict[str, object]:
    """Log-probs, then 2 updates (R2): the metrics, the adapters, and the base (which must not move)."""
    from megatron_rl.models.lora import gather_adapters

    batch = make_batch(actor.cfg.model.vocab_size)
    out = actor.compute_log_probs(batch, record_routing=True)
    history = actor.train(train_batch(batch, out.log_probs, out.routed_experts))
    return {
        "log_probs": out.log_probs,
        "history": history,
        "adapters": gather_adapters(actor.lora),
        "trainable": actor.trainable_params,
    }


def w1_lora_reference(ctx) -> None:  # noqa: ANN001
    """The references of the LoRA layouts; the base stays where it started."""
    actor = lora_actor(layout())
    base = actor.full_params()
    result = lora_run(actor)
    assert_params_close(actor.full_params(), base, "LoRA: the frozen base after 2 updates")
    save_ref(ctx, "lora", result)
    actor.close()


def check_lora_layout(ctx, parallel: ParallelConfig) -> None:  # noqa: ANN001
    """Log-probs, update metrics and adapters after 2 updates under `parallel` equal world size 1's."""
    actor = lora_actor(parallel)
    want = load_ref(ctx, "lora")
    got = lora_run(actor)
    what = f"LoRA, layout {parallel}"
    assert got["trainable"] == want["trainable"], (got["trainable"], want["trainable"])
    assert_close(got["log_probs"], want["log_probs"], LOGPROB_TOL, f"log-probs, {what}")
    for have, expected in zip(got["history"], want["history"], strict=True):
        for key in ("loss", "grad_norm"):
            if abs(have[key] - expected[key]) > 1e-5 * max(1.0, abs(expected[key])):
                raise AssertionError(f"{what}, metric {key}: {have[key]} vs reference {expected[key]}")
    assert_params_close(got["adapters"], want["adapters"], f"adapters after 2 updates, {what}")
    actor.close()


def w2_lora_tp2_sp(ctx) -> None:  # noqa: ANN001
    check_lora_layout(ctx, layout(tp=2, sp=True))  # expert-TP 2 as well: the experts' partial gradients


def w2_lora_ep2(ctx) -> None:  # noqa: ANN001
    check_lora_layout(ctx, layout(ep=2))


def w2_lora_pp2(ctx) -> None:  # noqa: ANN001
    check_lora_layout(ctx, layout(pp=2))


# --- grouped experts (model.moe_grouped_gemm) against Megatron's SequentialMLP --------------------


def experts_run(parallel: ParallelConfig, grouped: bool, lora: bool) -> dict[str, object]:
    """Log-probs, then 2 updates (R2) with the experts as grouped GEMMs or one after another: the
    metrics and the parameters after them (with LoRA: the adapters)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.models.grouped_experts import GroupedExperts

    actor = (
        lora_actor(parallel, moe_grouped_gemm=grouped)
        if lora
        else MegatronActor(actor_config(parallel, moe_grouped_gemm=grouped))
    )
    assert type(actor.chunks[0].decoder.layers[-1].mlp.experts) is (GroupedExperts if grouped else SequentialMLP)
    if lora:
        result = lora_run(actor)
        result["params"] = result.pop("adapters")
    else:
        batch = make_batch(actor.cfg.model.vocab_size)
        out = actor.compute_log_probs(batch, record_routing=True)
        history = actor.train(train_batch(batch, out.log_probs, out.routed_experts))
        result = {"log_probs": out.log_probs, "history": history, "params": actor.full_params()}
    actor.close()
    return result


def check_experts(got: dict[str, object], want: dict[str, object], what: str) -> None:
    """The same log-probs, loss and gradient norm of 2 updates, and parameters after them, within 1e-6."""
    assert_close(got["log_probs"], want["log_probs"], PARAM_TOL, f"log-probs, {what}")
    for have, expected in zip(got["history"], want["history"], strict=True):
        for key in ("loss", "grad_norm"):
            if abs(have[key] - expected[key]) > PARAM_TOL * max(1.0, abs(expected[key])):
                raise AssertionError(f"{what}, {key}: {have[key]} vs {expected[key]}")
    assert_params_close(got["params"], want["params"], f"parameters after 2 updates, {what}")


def w1_grouped_experts(ctx) -> None:  # noqa: ANN001
    """Sequential experts, without and with expert LoRA, against world size 1's references, which
    ran grouped (`auto` on the CPU)."""
    from megatron_rl.models.experts_choice import use_grouped_experts

    assert use_grouped_experts(actor_config(layout()).model, layout(), transformer_engine=False)
    want = {"log_probs": load_ref(ctx, "log_probs"), "history": load_ref(ctx, "history")}
    check_experts(experts_run(layout(), False, lora=False), {**want, "params": load_ref(ctx, "params_2")}, "w1")
    lora = load_ref(ctx, "lora")
    check_experts(experts_run(layout(), False, lora=True), {**lora, "params": lora["adapters"]}, "w1 LoRA")


def w2_grouped_experts_ep2(ctx) -> None:  # noqa: ANN001
    """EP 2 (2 local experts per rank, the alltoall dispatcher's counts): grouped against sequential."""
    ep2 = layout(ep=2)
    check_experts(experts_run(ep2, True, lora=False), experts_run(ep2, False, lora=False), "EP2")


def w2_grouped_experts_etp2(ctx) -> None:  # noqa: ANN001
    """Expert-TP 2 with expert LoRA (each rank half of every expert; the adapters' partial gradients)."""
    etp2 = layout(tp=2, sp=True)
    check_experts(experts_run(etp2, True, lora=True), experts_run(etp2, False, lora=True), "expert-TP 2 LoRA")


def w2_tp2_sp(ctx) -> None:  # noqa: ANN001
    check_layout_against_reference(ctx, layout(tp=2, sp=True), direct_routing_check=True)


def w2_sigmoid_replay_ep2(ctx) -> None:  # noqa: ANN001
    """Grouped, biased routing replayed with the experts split over EP."""
    sigmoid_replay(layout(ep=2))


def w2_ep2_alltoall(ctx) -> None:  # noqa: ANN001
    check_layout_against_reference(ctx, layout(ep=2), direct_routing_check=False)


def w2_pp2(ctx) -> None:  # noqa: ANN001
    check_layout_against_reference(ctx, layout(pp=2), direct_routing_check=True, save_as="ckpt_pp2")


def w2_pp2_allgather(ctx) -> None:  # noqa: ANN001
    """PP = 2 with the allgather dispatcher: Megatron refuses variable shapes there, so every
    micro-batch of a step is padded to one shape; results are unchanged."""
    cfg = actor_config(layout(pp=2), moe_token_dispatcher="allgather")
    actor = MegatronActor(cfg)
    assert not actor.chunks[0].config.variable_seq_lengths
    batch = make_batch(cfg.model.vocab_size)
    out = actor.compute_log_probs(batch, record_routing=True)
    assert_close(out.log_probs, load_ref(ctx, "log_probs"), LOGPROB_TOL, "log-probs, PP2 allgather")
    with packed(actor):  # packed micro-batches of different lengths, padded to one for the pipeline
        assert_close(actor.compute_log_probs(batch).log_probs, out.log_probs, LOGPROB_TOL, "packed, PP2 allgather")
    replayed = actor.compute_log_probs(batch.with_fields(routed_experts=out.routed_experts), replay_routing=True)
    assert diff(replayed.log_probs, out.log_probs) == 0.0, "R2 replay at unchanged weights, PP2 allgather"
    actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    assert_params_close(actor.full_params(), load_ref(ctx, "params_2"), "parameters after 2 steps, PP2 allgather")
    actor.close()


def w2_pp2_hidden_path_tied(ctx) -> None:  # noqa: ANN001
    hidden_path_tied(layout(pp=2))


def w2_tp2_hidden_path_tied(ctx) -> None:  # noqa: ANN001
    hidden_path_tied(layout(tp=2))


def w2_pp2_recompute_replay(ctx) -> None:  # noqa: ANN001
    recompute_replay(ctx, layout(pp=2))


def w2_bad_layout(ctx) -> None:  # noqa: ANN001
    """The actor refuses an impossible layout before building anything, naming the keys."""
    from megatron.core import parallel_state as ps

    cases = [
        (
            layout(ep=2),
            dict(num_experts=3),
            "parallel.expert_model_parallel_size (2) must divide model.num_experts (3)",
        ),
        (layout(tp=2), dict(num_attention_heads=6, num_query_groups=3), "parallel.tensor_model_parallel_size (2)"),
        (layout(pp=4), {}, "world size 2 is not divisible"),
    ]
    for parallel, overrides, needle in cases:
        cfg = actor_config(layout())
        cfg.parallel = parallel
        cfg.model = tiny_model("qwen3_moe", **overrides)
        try:
            MegatronActor(cfg)
        except ConfigError as err:
            assert needle in str(err), f"{needle!r} not in {err}"
        else:
            raise AssertionError(f"{parallel} with {overrides} was accepted")
        assert not ps.model_parallel_is_initialized()


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_rows(path: Path) -> set[int]:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    return {meta[k].global_shape[0] for k in VOCAB_KEYS}


def assert_same_training_state(actual: Path, expected: Path) -> None:
    """The checkpoints hold the same model and optimizer tensors (Adam moments, master weights), bit
    for bit; a vocabulary tensor padded to more rows holds the other's rows and then zeros. Collective."""
    from megatron.core import dist_checkpointing

    a, e = (
        {k: v for k, v in dist_checkpointing.load_plain_tensors(str(p)).items() if isinstance(v, torch.Tensor)}
        for p in (actual, expected)
    )
    assert set(a) == set(e), sorted(set(a) ^ set(e))[:5]
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in e), sorted(e)[:5]
    for key, want in e.items():
        got = a[key]
        rows = min(got.shape[0], want.shape[0])
        if got.shape[1:] != want.shape[1:] or not torch.equal(got[:rows], want[:rows]):
            raise AssertionError(f"{key}: {list(got.shape)} in {actual.name} differs from {list(want.shape)}")
        assert not got[rows:].any() and not want[rows:].any(), f"{key}: nonzero rows past {rows}"
    ca, ce = (dist_checkpointing.load_common_state_dict(str(p)) for p in (actual, expected))
    assert ca["step"] == ce["step"] and ca["scheduler"] == ce["scheduler"], (ca["scheduler"], ce["scheduler"])


def w2_vocab_padding_tp1_tp2_tp1(ctx) -> None:  # noqa: ANN001
    """The world-size-1 checkpoint (vocabulary padded to 384 rows) loads under TP = 2 (512 rows) and
    the TP = 2 re-save loads back under TP = 1 (DP = 2): log-probs as the reference, model and
    optimizer tensors of both re-saves identical to the original's, 2 more steps as the reference's."""
    batch = make_batch(actor_config(layout()).model.vocab_size)
    original, as_tp2, back = ref_dir(ctx) / "ckpt_w1", ctx.shared_dir / "ckpt_tp2", ctx.shared_dir / "ckpt_back_tp1"
    for parallel, source, target in ((layout(tp=2), original, as_tp2), (layout(), as_tp2, back)):
        actor = MegatronActor(actor_config(parallel))
        info = actor.load(source)
        assert info["optimizer_loaded"] and info["step"] == 2 and actor.step == 2, info
        lp = actor.compute_log_probs(batch).log_probs
        assert_close(lp, load_ref(ctx, "log_probs_2"), LOGPROB_TOL, f"log-probs, {source.name} under {parallel}")
        actor.save(target)
        if parallel.tensor_model_parallel_size == 1:
            actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
            assert_params_close(actor.full_params(), load_ref(ctx, "params_4"), "TP1 -> TP2 -> TP1 + 2 steps")
        actor.close()
        destroy_distributed(process_group=False)
    assert vocab_rows(original) == {384} and vocab_rows(as_tp2) == {512} and vocab_rows(back) == {384}
    assert_same_training_state(as_tp2, original)
    assert_same_training_state(back, original)


# --- world size 4 --------------------------------------------------------------------------


def w4_tp2_ep2(ctx) -> None:  # noqa: ANN001
    check_layout_against_reference(ctx, layout(tp=2, ep=2), direct_routing_check=True)


def w4_load_pp2_checkpoint(ctx) -> None:  # noqa: ANN001
    """A checkpoint saved under PP=2 (world 2) loads under TP=2 x EP=2 (world 4)."""
    cfg = actor_config(layout(tp=2, ep=2))
    actor = MegatronActor(cfg)
    batch = make_batch(cfg.model.vocab_size)
    info = actor.load(ref_dir(ctx) / "ckpt_pp2")
    assert info["saved_layout"]["pipeline_model_parallel_size"] == 2 and info["step"] == 2
    assert_close(
        actor.compute_log_probs(batch).log_probs, load_ref(ctx, "log_probs_2"), LOGPROB_TOL, "after PP2 -> TP2xEP2"
    )
    actor.train(train_batch(batch, load_ref(ctx, "log_probs"), load_ref(ctx, "routing")))
    assert_params_close(actor.full_params(), load_ref(ctx, "params_4"), "PP2 checkpoint + 2 steps under TP2xEP2")
    actor.close()


# --- the step batch scattered (actor/batch_scatter.py) -------------------------------------


def scattered_batch(ctx, parallel: ParallelConfig) -> None:  # noqa: ANN001
    """Rank 0's step batch with R3 routing, (a) pickled to every rank as `on_rank0` sent it before,
    (b) scattered: every rank gets the same index and fields, the routing of exactly its DP rank's
    samples (its TP/EP peers the same), uint8 on the wire, and the bytes the report says; log-probs
    under replay, two updates' metrics and the parameters after them equal (a) bit for bit."""
    import pickle

    from megatron.core import parallel_state as ps

    from megatron_rl.actor.batch_scatter import scatter_batch
    from megatron_rl.actor.batch_wire import WireBatch, pack_light
    from megatron_rl.actor.micro_batches import step_shares
    from megatron_rl.loop.collect import StepBatch
    from megatron_rl.parallel.rank0 import on_rank0

    cfg = actor_config(parallel)
    actor = MegatronActor(cfg)
    model = cfg.model
    routing = random_routing(model.num_layers, model.moe_router_topk, model.num_experts)
    gen = torch.Generator().manual_seed(9)
    full = train_batch(make_batch(model.vocab_size), load_ref(ctx, "log_probs"), routing)
    full = full.with_fields(rollout_log_probs=[lp - 0.1 for lp in full.old_log_probs])
    rewards = torch.rand(len(LENGTHS), generator=gen)
    versions = [[2] * (n - p) for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    rank0 = dist.get_rank() == 0

    before = on_rank0(lambda: StepBatch(full, {}, rewards, versions))  # today's path: the whole pickle
    wire = WireBatch(full, rewards, versions) if rank0 else None
    got, report = scatter_batch(wire, updates=cfg.train.updates_per_step, num_experts=model.num_experts)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    assert dp == 2, f"the scatter needs 2 DP ranks here, got {dp}"
    shares = step_shares(list(LENGTHS), cfg.train.updates_per_step, dp)
    mine = shares[dp_rank]
    assert sorted(shares[0] + shares[1]) == list(range(len(LENGTHS))) and 2 <= len(mine) <= 6, shares
    held = [r is not None for r in got.batch.routed_experts]
    assert held == [i in mine for i in range(len(LENGTHS))], f"rank {dist.get_rank()}: holds {held}, owns {mine}"
    for i in mine:
        r = got.batch.routed_experts[i]
        assert torch.equal(r.to(torch.int32), routing[i]), f"routing of sample {i}"
        assert r.dtype == (torch.int32 if rank0 else torch.uint8), r.dtype  # 4 experts: uint8 on the wire
    for name in ("tokens", "response_mask", "advantages", "rollout_log_probs", "old_log_probs"):
        ours, theirs = getattr(got.batch, name), getattr(before.batch, name)
        assert (ours is None) == (theirs is None), name
        if ours is not None:
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, theirs, strict=True)), name
    assert got.batch.prompt_lengths == before.batch.prompt_lengths
    assert torch.equal(got.rewards, before.rewards) and got.versions == before.versions

    light = pack_light(WireBatch(full, rewards, versions), num_experts=model.num_experts).nbytes
    dp_of: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(dp_of, dp_rank)
    want = [0] + [
        light + sum((LENGTHS[i] - 1) * model.num_layers * 2 for i in shares[dp_of[r]]) for r in range(1, len(dp_of))
    ]
    assert list(report.received) == want and report.sent == sum(want), (report, want)
    whole = len(pickle.dumps(before))
    assert report.metrics()["actor/batch_bytes_per_rank"] < whole / 2, (report, whole)

    # the losses: replayed log-probs and two updates from the same state, (a) against (b)
    lp_before = actor.compute_log_probs(before.batch, replay_routing=True)
    lp_after = actor.compute_log_probs(got.batch, replay_routing=True)
    assert diff(lp_after.log_probs, lp_before.log_probs) == 0.0 and diff(lp_after.entropy, lp_before.entropy) == 0.0
    start = ref_dir(ctx) / f"scatter_start_w{dist.get_world_size()}"
    actor.save(start)
    history_before = actor.train(before.batch, replay_routing=True)
    params_before = actor.full_params()
    actor.load(start)
    history_after = actor.train(got.batch, replay_routing=True)
    assert history_after == history_before, (history_after, history_before)
    assert history_before[0]["loss"] != 0.0 and len(history_before) == 2
    params_after = actor.full_params()
    assert all(torch.equal(params_after[k], v) for k, v in params_before.items()), "parameters after the updates"
    actor.close()


def w2_scattered_batch(ctx) -> None:  # noqa: ANN001
    scattered_batch(ctx, layout())


def w4_scattered_batch(ctx) -> None:  # noqa: ANN001
    scattered_batch(ctx, layout(tp=2, ep=2))


# --- the frozen reference policy (world size 1) --------------------------------------------

BETA = 0.04


def kl_config(**train: object) -> Config:
    """`actor_config` with GRPO's KL term to the reference (beta 0.04, k3)."""
    cfg = actor_config(layout())
    cfg.algorithm = dataclasses.replace(cfg.algorithm, kl_coef=BETA)
    cfg.train = dataclasses.replace(cfg.train, **train)
    validate(cfg)
    return cfg


def w1_reference_policy_kl(ctx) -> None:  # noqa: ANN001
    """The reference built from the actor's start: its log-probs equal the actor's bit for bit (free
    routing and R2 replay), so KL(pi_old || pi_ref) is exactly 0 before any update; after updates it is
    positive and grows, and the reference's own log-probs never move (no optimizer reaches it)."""
    from megatron_rl.actor.policy import FrozenPolicy
    from megatron_rl.trainer import reference_kl

    cfg = kl_config()
    actor = MegatronActor(cfg)
    generator = torch.get_rng_state()
    reference = FrozenPolicy.start(cfg)
    assert torch.equal(torch.get_rng_state(), generator), "building the reference moved the actor's generator"
    assert all(not p.requires_grad for p in reference.chunks[0].parameters())
    batch = make_batch(cfg.model.vocab_size)
    masks = [batch.loss_mask(i) for i in range(len(batch))]
    old = actor.compute_log_probs(batch, record_routing=True)
    start_routing = batch.with_fields(routed_experts=old.routed_experts)
    ref = reference.compute_log_probs(start_routing, replay_routing=True)
    assert diff(ref.log_probs, old.log_probs) == 0.0, "reference at the start policy, R2 replay"
    assert diff(reference.compute_log_probs(batch).log_probs, old.log_probs) == 0.0, "reference, free routing"
    _, kl = reference_kl(old.log_probs, ref.log_probs, masks, "k3", cfg.algorithm.max_log_ratio)
    assert kl == {"actor/kl_ref_mean": 0.0, "actor/kl_ref_max": 0.0}, kl

    kls = []
    for _ in range(2):  # 2 steps of 2 updates each, the trainer's order: old log-probs (R2), reference, update
        old = actor.compute_log_probs(batch, record_routing=True)
        routed = batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
        ref_now = reference.compute_log_probs(routed, replay_routing=True)
        history = actor.train(routed.with_fields(ref_log_probs=ref_now.log_probs))
        assert all(h["kl_loss"] >= 0.0 for h in history)
        now = actor.compute_log_probs(batch).log_probs
        kls.append(reference_kl(now, ref.log_probs, masks, "k3", cfg.algorithm.max_log_ratio)[1]["actor/kl_ref_mean"])
    assert 0.0 < kls[0] < kls[1], kls
    assert diff(reference.compute_log_probs(start_routing, replay_routing=True).log_probs, ref.log_probs) == 0.0
    reference.close()
    actor.close()


def w1_kl_gradient_by_hand(ctx) -> None:  # noqa: ANN001
    """One update with all advantages 0 (the policy-gradient term and its gradient vanish) against a
    reference with other weights: the loss is beta * sum_i 1/(B n_i) sum_t min(e^x - 1 - x, 10), x = log
    pi_ref - log pi (k3 clamped as verl's low_var_kl: some tokens of these two random models pass 10), and
    the gradient norm equals that of this expression differentiated by autograd through a
    plain full-vocabulary forward of the same model."""
    from megatron_rl.actor.policy import FrozenPolicy

    cfg = kl_config(updates_per_step=1, grad_clip=1e9, lr=0.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="constant")
    actor = MegatronActor(cfg)
    reference = FrozenPolicy.start(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=12)))
    batch = make_batch(cfg.model.vocab_size)
    batch = batch.with_fields(advantages=[torch.zeros(()) for _ in batch.tokens])
    old = actor.compute_log_probs(batch, record_routing=True)
    ref = reference.compute_log_probs(batch.with_fields(routed_experts=old.routed_experts), replay_routing=True)
    assert diff(ref.log_probs, old.log_probs) > 0.1, "the reference must differ from the policy"

    chunk = actor.chunks[0]
    hand = torch.zeros((), dtype=torch.float64)
    for tok, p, ref_lp in zip(batch.tokens, batch.prompt_lengths, ref.log_probs, strict=True):
        positions = torch.arange(tok.shape[0]).unsqueeze(0)
        logits = chunk(tok.unsqueeze(0), positions, None)[0, :, : cfg.model.vocab_size].double() / TEMPERATURE
        logp = F.log_softmax(logits, dim=-1)[p - 1 : -1].gather(-1, tok[p:].unsqueeze(-1)).squeeze(-1)
        x = ref_lp.double() - logp
        hand = hand + (torch.exp(x) - 1 - x).clamp(max=10.0).sum() / (len(LENGTHS) * x.numel())
    hand = BETA * hand
    grads = torch.autograd.grad(hand, [q for q in chunk.parameters() if q.requires_grad], allow_unused=True)
    hand_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))

    history = actor.train(
        batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts, ref_log_probs=ref.log_probs)
    )
    (h,) = history
    assert h["pg_loss"] == 0.0, h["pg_loss"]
    for key, got, want in (("loss", h["loss"], float(hand)), ("grad_norm", h["grad_norm"], hand_norm)):
        if abs(got - want) > 1e-5 * abs(want):
            raise AssertionError(f"{key}: actor {got!r}, by hand {want!r}")
    assert hand_norm > 1e-3, hand_norm
    reference.close()
    actor.close()


# --- checkpoints: the real save path into a RunFolder (tests/test_checkpoint_integrity.py's subject) ---


def _run_config(run_dir: Path, parallel_cfg: Config) -> Config:
    return dataclasses.replace(
        parallel_cfg, logging=LoggingConfig(run_dir=str(run_dir)), checkpoint=CheckpointConfig(keep_last=0)
    )


def _save_steps(ctx, cfg: Config, steps: tuple[int, ...]) -> tuple[MegatronActor, Path]:  # noqa: ANN001
    """`steps` saved by the real actor through `RunFolder.save_checkpoint`; the checkpoint root."""
    actor = MegatronActor(cfg)
    folder = RunFolder(cfg, rank=ctx.rank, resume=False)
    sampler = PromptSampler(list(range(16)), seed=3)
    for step in steps:
        sampler.next(4)
        folder.save_checkpoint(actor, step, {"sampler": sampler.state_dict()})
    folder.close()
    return actor, folder.ckpt_root


def _check_manifest_against_the_bytes(step_dir: Path) -> dict:
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk, (sorted(manifest["files"]), sorted(on_disk))
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry["size"] == len(data), name
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), f"{name}: the digest computed while writing"
    return manifest


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _flip_a_bit(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _damage(step_dir: Path, how: str) -> Path:
    """Damage a size check against the manifest does not see; the file the warning names."""
    shard = sorted((step_dir / ACTOR_DIR).glob("*.distcp"))[0]
    if how == "bit flip in a shard":
        _flip_a_bit(shard, shard.stat().st_size // 2)
        return shard
    if how == "one byte of .metadata":
        _flip_a_bit(step_dir / ACTOR_DIR / ".metadata", 40)
        return step_dir / ACTOR_DIR / ".metadata"
    if how == "4 KiB of garbage in a shard":
        with shard.open("r+b") as f:
            f.seek(shard.stat().st_size // 3)
            f.write(os.urandom(4096))
        return shard
    # a shard removed with its manifest entry: the manifest is silent, the actor's .metadata names it
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    del manifest["files"][shard.relative_to(step_dir).as_posix()]
    (step_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    shard.unlink()
    return shard


def w1_shards_hashed_while_written_and_damage_falls_back(ctx) -> None:  # noqa: ANN001
    """Every file's SHA-256 in the manifest is that of its bytes on disk; each damage that keeps the
    size is one warning naming the file, and resume takes step 1, which loads."""
    cfg = _run_config(ctx.shared_dir / "integrity" / "run", actor_config(layout()))
    actor, root = _save_steps(ctx, cfg, (1, 2))
    manifest = _check_manifest_against_the_bytes(checkpoint_dir(root, 2))
    shards = [name for name in manifest["files"] if name.endswith(".distcp")]
    assert shards == [f"{ACTOR_DIR}/__0_0.distcp"], shards
    handler = _Warnings()
    logging.getLogger("megatron_rl.checkpoints").addHandler(handler)
    try:
        damages = (
            "bit flip in a shard",
            "one byte of .metadata",
            "4 KiB of garbage in a shard",
            "shard and entry gone",
        )
        for how in damages:
            run_dir = ctx.shared_dir / "integrity" / how.replace(" ", "_")
            shutil.copytree(ctx.shared_dir / "integrity" / "run", run_dir)
            victim = _damage(checkpoint_dir(run_dir / "checkpoints", 2), how)
            handler.messages.clear()
            folder = RunFolder(_run_config(run_dir, cfg), rank=0, resume=True)
            folder.close()
            assert folder.resume_from == checkpoint_dir(run_dir / "checkpoints", 1), (how, folder.resume_from)
            assert len(handler.messages) == 1 and str(victim) in handler.messages[0], (how, handler.messages)
    finally:
        logging.getLogger("megatron_rl.checkpoints").removeHandler(handler)
    info = actor.load(folder.resume_from / ACTOR_DIR)
    assert info["step"] == actor.step and info["optimizer_loaded"], info
    check_a_failed_write_is_one_line(ctx, actor, cfg)
    actor.close()


def check_a_failed_write_is_one_line(ctx, actor: MegatronActor, cfg: Config) -> None:  # noqa: ANN001
    """A write that fails in the shard writer (over the file size limit: EFBIG, where a full disk gives
    ENOSPC) is one `CheckpointWriteError` line naming the staging folder."""
    folder = RunFolder(_run_config(ctx.shared_dir / "integrity" / "full", cfg), rank=0, resume=False)
    staging = checkpoint_dir(folder.ckpt_root, 1).with_name("step_000001.tmp")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        folder.save_checkpoint(actor, 1, {"sampler": PromptSampler(list(range(16)), seed=3).state_dict()})
    except CheckpointWriteError as err:
        message = str(err)
    else:
        raise AssertionError("a save over the file size limit did not fail")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
        folder.close()
    assert message.startswith(f"{staging}: the checkpoint could not be written (") and "\n" not in message, message
    assert "File too large" in message and "bytes free there" in message, message


def w2_every_ranks_shard_is_in_the_manifest(ctx) -> None:  # noqa: ANN001
    """Under EP = 2 each rank hashes the shard it writes; rank 0's manifest holds both ranks' digests."""
    cfg = _run_config(ctx.shared_dir / "integrity" / "run", actor_config(layout(ep=2)))
    actor, root = _save_steps(ctx, cfg, (1,))
    dist.barrier()
    manifest = _check_manifest_against_the_bytes(checkpoint_dir(root, 1))
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert shards == [f"{ACTOR_DIR}/__0_0.distcp", f"{ACTOR_DIR}/__1_0.distcp"], shards
    actor.close()


def _cp_batch() -> ActorBatch:
    gen = torch.Generator().manual_seed(11)
    lengths, prompts = (13, 6, 9, 17, 4), (4, 2, 5, 3, 1)
    return ActorBatch(
        tokens=[torch.randint(0, 300, (n,), generator=gen) for n in lengths],
        prompt_lengths=list(prompts),
        response_mask=[torch.rand(n - p, generator=gen) > 0.2 for n, p in zip(lengths, prompts, strict=True)],
        old_log_probs=[-torch.rand(n - p, generator=gen) for n, p in zip(lengths, prompts, strict=True)],
        advantages=[torch.randn((), generator=gen) for _ in lengths],
    )


def _loss_and_grads(loss_fn, inputs, logp: torch.Tensor, ent: torch.Tensor):  # noqa: ANN001, ANN202
    """(loss, metrics, d loss / d logp, d loss / d ent) of per-position values in the model's layout."""
    from megatron_rl.actor.logprobs import LogProbs

    logp, ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    loss, metrics = loss_fn(inputs, LogProbs(inputs.to_rows(logp), inputs.to_rows(ent)))
    loss.backward()
    return loss.detach(), metrics, logp.grad, ent.grad


def w2_cp_reductions(ctx) -> None:  # noqa: ANN001
    """CP = 2 over gloo, the model's side left out (scenarios_cp.py runs the model): the two ranks
    hold their positions of per-position log-probs and entropy (as the head gives them), of a
    right-padded and of a packed micro-batch; `to_rows` gathers them over the CP group and the actor's
    loss function (`train_step`) runs on them. Loss and metrics (token and sequence counts, the GSPO
    sequence ratio's sum) equal the un-split single-process values, in token-mean,
    seq-mean-token-mean and GSPO with an entropy bonus, within 1e-6; each rank's gradient is the
    un-split gradient at its positions (so DDP's sum over CP is the whole one), within 1e-6."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from megatron_rl.actor.batch import build_inputs, split_for_context
    from megatron_rl.actor.forward import is_context_owner
    from megatron_rl.actor.micro_batches import MicroBatch
    from megatron_rl.actor.train_step import _loss_fn, policy_token_loss
    from megatron_rl.losses import LossSpec, global_normalizer
    from megatron_rl.parallel import cpu_compat
    from megatron_rl.parallel.context_parallel import round_up

    cpu_compat.apply_cpu_compat()
    ps.initialize_model_parallel(context_parallel_size=2)
    rank = ps.get_context_parallel_rank()
    assert ps.get_context_parallel_world_size() == 2 and is_context_owner() == (rank == 0)
    batch = _cp_batch()
    normalizer = global_normalizer([batch.loss_mask(i).view(1, -1) for i in range(len(batch))], token_norm=32)
    specs = {
        "token-mean": dataclasses.replace(preset("grpo"), loss_agg_mode="token-mean"),
        "seq-mean-token-mean": preset("grpo"),
        "gspo": dataclasses.replace(preset("gspo"), entropy_coef=0.01),
    }
    order = tuple(sorted(range(len(batch)), key=lambda i: -batch.lengths[i]))
    for packed in (False, True):
        mb = MicroBatch(order, tuple(batch.lengths[i] for i in order), packed)
        shape = (1, sum(round_up(n, 4) for n in mb.lengths)) if packed else (mb.rows, round_up(mb.max_len, 4))
        whole = build_inputs(
            batch, mb, torch.device("cpu"), pad_to=shape, with_fields=("old_log_probs", "advantages"), align=4
        )
        mine = split_for_context(whole, 2, rank)
        held = mine.context.split.positions()
        gen = torch.Generator().manual_seed(5)
        full_logp, full_ent = -torch.rand(shape, generator=gen) * 3, torch.rand(shape, generator=gen) * 2
        for name, section in specs.items():
            spec = LossSpec.from_section(section)
            what = f"{'packed' if packed else 'padded'}, {name}"

            loss_fn = _loss_fn(policy_token_loss(spec), normalizer, 1.0, spec.entropy_coef, spec.loss_agg_mode)
            want_loss, want_metrics, want_g_logp, want_g_ent = _loss_and_grads(loss_fn, whole, full_logp, full_ent)
            loss, metrics, g_logp, g_ent = _loss_and_grads(loss_fn, mine, full_logp[:, held], full_ent[:, held])
            assert float((loss - want_loss).abs()) <= 1e-6, f"{what}: loss {float(loss)} vs {float(want_loss)}"
            assert metrics.keys() == want_metrics.keys(), what
            for key, value in metrics.items():
                assert float((value - want_metrics[key]).abs()) <= 1e-6, f"{what}: {key} {value} vs {want_metrics[key]}"
            for got, want, label in ((g_logp, want_g_logp, "log-prob"), (g_ent, want_g_ent, "entropy")):
                if want is None:  # no entropy bonus: the entropy has no gradient, split or not
                    assert got is None and spec.entropy_coef == 0, f"{what}: {label} gradient"
                    continue
                err = float((got - want[:, held]).abs().max())
                assert err <= 1e-6, f"{what}: {label} gradient at this CP rank's positions off by {err}"
                # the ranks' shares, put together, are the whole gradient: nothing twice, nothing lost
                pieces = [torch.empty_like(got) for _ in range(2)]
                dist.all_gather(pieces, got, group=ps.get_context_parallel_group())
                total = mine.context.split.restore_order(pieces, dim=1)
                assert float((total - want).abs().max()) <= 1e-6, f"{what}: {label} gradients of both ranks"
            if name == "gspo":  # the sequence ratio: a mean over tokens that lie on both ranks
                assert float(metrics["ratio_sum"]) != 0.0 and float(want_g_logp.abs().sum()) > 0, what


# Context parallelism's scenarios live in scenarios_cp.py, the remaining layouts' in scenarios_layouts.py;
# the launches run them from here, and those of PPO's critic (scenarios_critic.py).
from mrl_multiproc.scenarios_cp import w1_cp_references, w2_cp2, w2_cp2_gspo_sft_mla, w4_tp2_cp2  # noqa: E402, F401
from mrl_multiproc.scenarios_critic import (  # noqa: E402, F401
    w1_critic_reference,
    w2_critic_ep2,
    w2_critic_pp2,
    w2_critic_tp2_sp,
)
from mrl_multiproc.scenarios_layouts import (  # noqa: E402, F401
    w2_dp2,
    w2_etp2,
    w2_pp2_uneven,
    w2_tp2_etp1,
    w4_pp2_ep2,
    w4_tp2_ep2_etp1,
)

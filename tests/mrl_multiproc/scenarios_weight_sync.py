"""Scenarios for tests/test_weight_sync.py (run by launcher.py, one process per rank).

Two local engines (started by the pytest module, addresses in `ctx.params["engine_urls"]`) serve the
tiny MoE policy in `ctx.params["model"]`: the first alone for every launch but EP=2's and PP=2's,
which sync into both (several senders into several servers that take one update at a time), each
behind a proxy that holds control requests a random few milliseconds (`ctx.params["jittered_urls"]`). Each scenario builds a Megatron actor from that HF
folder (the import path), and global rank 0 holds the RolloutEngine. Then, for each sync mode:
one optimizer step on the engine's own rollouts (the weights move: the actor's log-probs of
those tokens change by far more than the tolerance), a sync, fresh rollouts, and THE INVARIANT:

- the actor's free routing picks the engine's experts on every token that is not a near-tie
  (router top-k margin > 1e-4), and near-ties are rare;
- the engine's log-probs of its sampled tokens equal the actor's (fp32, max abs diff <= 1e-4; 1e-5 into
  two servers) on every sample the actor routes as the engine did (all but at most one: a near-tie the
  engine's rounding flipped moves the rest of its sample);
- with R3 replay of the engine's routed experts, every router dispatches every token to exactly
  the engine's experts, and the log-probs again equal the engine's.

Buckets are small (50 KiB), so every sync sends many buckets, and the reports must give the exact
weight bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
from collections.abc import Iterator

import torch
import torch.distributed as dist
from mrl_engine import on_loop, rollout_loop

from megatron_rl.config import Config, ParallelConfig, RolloutConfig, TrainConfig, validate

from mrl_configs import layout

TEMPERATURE = 0.8
NEW_TOKENS = 10
LOGPROB_TOL = 1e-4
SERVERS_LOGPROB_TOL = 1e-5  # syncs into two servers (several senders in turns): issue 35's bound
TIE = 1e-4  # router logits: top-k margin below this is a near-tie (engine/actor rounding may flip it)
BUCKET_MB = 0.05
PROMPT_LENGTHS = (3, 9, 5, 12, 7, 4)


# --- set-up --------------------------------------------------------------------------------


def policy_config(ctx, parallel: ParallelConfig, mode: str = "disk", servers: int = 1) -> Config:  # noqa: ANN001
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    folder = ctx.params["model"]
    cfg = Config(
        model=model_config_from_hf(read_hf_config(folder), hf_path=folder),
        parallel=parallel,
        rollout=RolloutConfig(
            engine="sglang",
            sglang_urls=ctx.params["engine_urls"][:1] if servers == 1 else ctx.params["jittered_urls"][:servers],
            temperature=TEMPERATURE,
            max_new_tokens=NEW_TOKENS,
            return_routed_experts=True,
            request_timeout_s=120.0,
            max_retries=1,
            sync_dir=str(ctx.shared_dir / "weights"),
        ),
        train=TrainConfig(steps=10, lr=3e-3, max_tokens_per_micro_batch=48, logprob_chunk_tokens=32, seed=5),
    )
    validate(cfg)
    return with_mode(cfg, mode)


def with_mode(cfg: Config, mode: str) -> Config:
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, weight_sync=mode, colocate=mode == "tensor")
    )


def build_actor(cfg: Config):  # noqa: ANN201 - MegatronActor
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint

    folder = cfg.model.hf_path
    return MegatronActor(
        cfg, initializer=lambda chunks: load_hf_weights(chunks, cfg.model, open_hf_checkpoint(folder, cfg.model))
    )


def connect(cfg: Config):  # noqa: ANN201 - RolloutEngine on rank 0, None elsewhere
    from megatron_rl.rollout.engine import RolloutEngine

    return RolloutEngine.from_config(cfg.rollout, rollout_loop(), cfg.model.hf_path) if dist.get_rank() == 0 else None


def weight_bytes(cfg: Config) -> int:
    from megatron_rl.models.hf_mapping import HFMapping

    return sum(int(torch.Size(shape).numel()) * 4 for shape in HFMapping(cfg.model).expected_hf_shapes().values())


def on_every_rank(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rollout(engine, cfg: Config, seed: int, greedy: bool = False) -> list[dict]:  # noqa: ANN001
    """Rank 0 samples one response per prompt (routed experts included); every rank gets them."""
    from megatron_rl.rollout.types import SamplingParams

    samples = None
    if engine is not None:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, cfg.model.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        if greedy:
            params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        else:
            params = SamplingParams.from_config(cfg.rollout, ignore_eos=True)
        got = on_loop(engine.generate(prompts, params, return_routed_experts=not greedy))
        samples = [
            dict(
                prompt=s.prompt_ids,
                output=s.output_ids,
                logprobs=s.logprobs,
                routed=None if s.routed_experts is None else torch.from_numpy(s.routed_experts.copy()),
                version=s.weight_version,
            )
            for s in got
        ]
    return on_every_rank(samples)


def as_batch(samples: list[dict]):  # noqa: ANN201 - ActorBatch
    from megatron_rl.actor.batch import ActorBatch

    return ActorBatch(
        tokens=[torch.tensor(s["prompt"] + s["output"]) for s in samples],
        prompt_lengths=[len(s["prompt"]) for s in samples],
        routed_experts=[s["routed"] for s in samples] if samples[0]["routed"] is not None else None,
    )


def engine_log_probs(samples: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor(s["logprobs"], dtype=torch.float32) for s in samples]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b], ([x.shape for x in a], [y.shape for y in b])
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def train_step(actor, samples: list[dict]) -> None:  # noqa: ANN001
    """One optimizer step on the engine's rollouts (its log-probs as the old ones, advantages +-1),
    then check that the weights moved: the actor's log-probs of those tokens are far from the engine's."""
    batch = as_batch(samples).with_fields(routed_experts=None)
    advantages = [torch.tensor(1.0 if i % 2 else -1.0) for i in range(len(samples))]
    history = actor.train(batch.with_fields(old_log_probs=engine_log_probs(samples), advantages=advantages))
    assert len(history) == 1, history
    moved = max_diff(actor.compute_log_probs(batch).log_probs, engine_log_probs(samples))
    assert moved > 100 * LOGPROB_TOL, f"one optimizer step moved the log-probs by only {moved:.2e}"


# --- routing probe -------------------------------------------------------------------------


class RouterProbe:
    """Hooks on every router of this rank: per forward, the top-k margin of the router logits
    (k-th minus (k+1)-th largest) and the experts each token was dispatched to; `take` maps them
    to SGLang's layout [n - 1, num_layers] / [n - 1, num_layers, top_k] on every rank."""

    def __init__(self, actor) -> None:  # noqa: ANN001
        self.actor = actor
        cfg = actor.chunks[0].config
        self.top_k, self.num_experts = int(cfg.moe_router_topk), int(cfg.num_moe_experts)
        self.margins: dict[int, list[torch.Tensor]] = {layer: [] for layer in actor.routing.layers}
        self.experts: dict[int, list[torch.Tensor]] = {layer: [] for layer in actor.routing.layers}
        self.handles = []
        for layer, router in actor.routing.routers:
            self.handles.append(router.register_forward_pre_hook(self._pre(layer)))
            self.handles.append(router.register_forward_hook(self._post(layer)))

    def _pre(self, layer: int):  # noqa: ANN202
        def hook(router, args) -> None:  # noqa: ANN001
            with torch.no_grad():
                logits = router.gating(args[0]).view(-1, self.num_experts).double()
            top = logits.topk(self.top_k + 1, dim=-1).values
            self.margins[layer].append((top[:, self.top_k - 1] - top[:, self.top_k]).cpu())

        return hook

    def _post(self, layer: int):  # noqa: ANN202
        def hook(router, args, output) -> None:  # noqa: ANN001
            routing_map = output[1].detach().cpu()
            self.experts[layer].append(routing_map.nonzero()[:, 1].view(-1, self.top_k))

        return hook

    def take(self, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
        from megatron.core import parallel_state as ps

        from megatron_rl.actor.forward import input_shapes, plan_for_rank
        from megatron_rl.actor.micro_batches import TokenBudget

        actor = self.actor
        config = actor.chunks[0].config
        micro = plan_for_rank(batch.lengths, TokenBudget.of(actor.cfg.train), actor.cfg.train.updates_per_step)
        shapes = input_shapes(micro, config)
        sizes = [n - 1 for n in batch.lengths]
        layers = actor.cfg.model.num_layers
        margins = torch.zeros(sum(sizes), layers, dtype=torch.float64)
        experts = torch.zeros(sum(sizes), layers, self.top_k, dtype=torch.int64)
        m_parts, e_parts = list(margins.split(sizes)), list(experts.split(sizes))
        owner = bool(config.sequence_parallel) or ps.get_tensor_model_parallel_rank() == 0
        for layer in self.margins:
            assert len(self.margins[layer]) == len(micro), f"layer {layer}: {len(self.margins[layer])} forwards"
            for mb, (rows, max_len), m, e in zip(micro, shapes, self.margins[layer], self.experts[layer], strict=True):
                if not owner:
                    continue
                sl = actor.routing.token_slice(rows, max_len)
                width = sl.stop - sl.start
                m, e = m.view(width, rows), e.view(width, rows, self.top_k)
                for row, (i, n) in enumerate(zip(mb.indices, mb.lengths, strict=True)):
                    stop = min(sl.stop, n - 1)
                    if stop > sl.start:
                        m_parts[i][sl.start : stop, layer] = m[: stop - sl.start, row]
                        e_parts[i][sl.start : stop, layer] = e[: stop - sl.start, row] + 1
        dist.all_reduce(margins)
        dist.all_reduce(experts)
        experts -= 1  # 0 marked "not this rank's"; layers without a router stay -1
        for values in (*self.margins.values(), *self.experts.values()):
            values.clear()
        return list(margins.split(sizes)), list(experts.split(sizes))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def probe(actor) -> Iterator[RouterProbe]:  # noqa: ANN001
    p = RouterProbe(actor)
    try:
        yield p
    finally:
        p.close()


def sorted_experts(routed: torch.Tensor, layers: list[int]) -> torch.Tensor:
    return routed[:, layers].to(torch.int64).sort(dim=-1).values


def check_invariant(actor, samples: list[dict], what: str) -> None:  # noqa: ANN001
    """The engine's log-probs and routing of its own samples against the actor (module docstring)."""
    batch = as_batch(samples)
    engine_lp = engine_log_probs(samples)
    tol = LOGPROB_TOL if len(actor.cfg.rollout.sglang_urls) == 1 else SERVERS_LOGPROB_TOL
    with probe(actor) as p:
        free = actor.compute_log_probs(batch.with_fields(routed_experts=None), record_routing=True)
        margins, dispatched = p.take(batch)
    moe = [layer for layer in range(actor.cfg.model.num_layers) if int(free.routed_experts[0][0, layer, 0]) >= 0]
    assert moe == list(range(actor.cfg.model.first_k_dense_layers, actor.cfg.model.num_layers)), moe
    ties = total = 0
    same_routing = []  # the samples whose every token the actor routes as the engine did
    for i, s in enumerate(samples):
        mine, theirs = sorted_experts(free.routed_experts[i], moe), sorted_experts(s["routed"], moe)
        assert torch.equal(sorted_experts(dispatched[i], moe), mine), f"{what}: probe and recorded routing differ"
        clear = margins[i][:, moe] > TIE
        differs = (mine != theirs).any(dim=-1)
        wrong = differs & clear
        if bool(wrong.any()):
            pos, layer = (int(v) for v in wrong.nonzero()[0])
            raise AssertionError(
                f"{what}: sample {i} position {pos} layer {moe[layer]}: actor routes to {mine[pos, layer].tolist()}, "
                f"engine to {theirs[pos, layer].tolist()} (margin {float(margins[i][pos, moe[layer]]):.2e})"
            )
        if not bool(differs.any()):
            same_routing.append(i)
        ties += int((~clear).sum())
        total += clear.numel()
    assert ties <= 0.05 * total, f"{what}: {ties} of {total} routing choices are near-ties"
    # a near-tie the engine's rounding flipped changes that sample's free log-probs: R3 below checks it exactly
    assert len(same_routing) >= len(samples) - 1, f"{what}: only samples {same_routing} routed as the engine's"
    d = max_diff([free.log_probs[i] for i in same_routing], [engine_lp[i] for i in same_routing])
    assert d <= tol, f"{what}: engine vs actor log-probs differ by {d:.3e} > {tol:.0e}"

    with probe(actor) as p:
        replayed = actor.compute_log_probs(batch, replay_routing=True)
        _, used = p.take(batch)
    for i, s in enumerate(samples):
        mine, theirs = sorted_experts(used[i], moe), sorted_experts(s["routed"], moe)
        mismatch = int((mine != theirs).any(dim=-1).sum())
        assert mismatch == 0, f"{what}: R3 replay dispatched {mismatch} (token, layer) pairs of sample {i} elsewhere"
    d = max_diff(replayed.log_probs, engine_lp)
    assert d <= tol, f"{what}: R3-replayed vs engine log-probs differ by {d:.3e} > {tol:.0e}"


# --- rounds --------------------------------------------------------------------------------


def check_engine_weights_equal(actor, engine, cfg: Config, what: str) -> None:  # noqa: ANN001
    """Every tensor every engine serves equals the trainer's (fp32 both sides: bit for bit), read back
    with /get_weights_by_name; collective (the trainer's full parameters are gathered on every rank)."""
    from megatron_rl.models.hf_mapping import HFMapping

    mapping = HFMapping(cfg.model)
    trainer = {n: t for name, full in actor.full_params().items() for n, t in mapping.to_hf(name, full)}
    if engine is None:
        return
    assert sorted(trainer) == sorted(mapping.expected_hf_shapes()), what
    for url in engine.client.urls:
        for name, want in trainer.items():
            body = {"name": name, "truncate_size": want.shape[0]}
            rows = engine.run(engine.client._json("POST", "/get_weights_by_name", body, server=url), timeout=60)
            got = torch.tensor(rows, dtype=torch.float32).reshape(want.shape)
            if not torch.equal(got, want.float()):
                raise AssertionError(f"{what}: {url}'s {name} differs from the trainer's by {(got - want).abs().max()}")


def sync_round(ctx, actor, engine, cfg: Config, mode: str, samples: list[dict], step: int) -> list[dict]:  # noqa: ANN001
    """Train one step on `samples`, sync in `mode`, sample again and check the invariant; returns the new samples.
    Disk syncs twice with one `DiskSync`, a step apart, so the second writes the other of the two folders."""
    from megatron_rl.weight_sync import make_weight_sync

    cfg = with_mode(cfg, mode)
    train_step(actor, samples)
    sync = make_weight_sync(cfg, engine, actor, bucket_mb=BUCKET_MB)
    version = f"{mode}-{step}"
    try:
        if mode == "tensor":
            sync.release_engine_memory()  # colocated: the sync must bring weights and KV cache back
        if mode == "disk":  # a first sync, then a step, then the checked one into the other folder
            sync.sync(f"{version}-first")
            check_disk_files(cfg, sync._serving, version)
            check_engine_weights_equal(actor, engine, cfg, f"first disk sync, layout {actor.cfg.parallel}")
            train_step(actor, samples)
        with recorded_sends(sync) as sent:
            report = sync.sync(version)
    finally:
        sync.close()
    if mode == "disk":
        check_disk_files(cfg, sync._serving, version)
    else:
        check_each_sender_sent_what_it_holds(actor, cfg, sent)
    assert (report.mode, report.weight_version) == (mode, version), report
    expected = weight_bytes(cfg)
    if mode == "disk":  # files: the tensors plus safetensors headers
        assert expected < report.bytes < expected + 64 * 1024, (report.bytes, expected)
    else:
        assert report.bytes == expected, (report.bytes, expected)
    check_engine_weights_equal(actor, engine, cfg, f"{mode} sync, layout {actor.cfg.parallel}")
    fresh = rollout(engine, cfg, seed=step)
    assert {s["version"] for s in fresh} == {version}, [s["version"] for s in fresh]
    check_invariant(actor, fresh, f"{mode} sync, layout {actor.cfg.parallel}")
    return fresh


@contextlib.contextmanager
def recorded_sends(sync) -> Iterator[list[str]]:  # noqa: ANN001
    """The names of the tensors this rank's sender posts during the block (distributed and tensor modes)."""
    sent: list[str] = []
    send = getattr(sync, "_send", None)
    if send is None:
        yield sent
        return

    def recording(bucket, version):  # noqa: ANN001, ANN202
        sent.extend(name for name, _ in bucket)
        return send(bucket, version)

    sync._send = recording
    try:
        yield sent
    finally:
        del sync._send


def check_each_sender_sent_what_it_holds(actor, cfg: Config, sent: list[str]) -> None:  # noqa: ANN001
    """Every HF tensor was posted exactly once, across the senders; each by a rank that holds it (its
    pipeline stage's layers, embedding or head; its EP rank's experts; dense tensors only from the
    stage's first TP / data-parallel rank); with PP or EP > 1, more than one rank sent."""
    import re

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_rl.models.hf_mapping import HFMapping

    layers = {
        int(m.layer_number) - 1 for chunk in actor.chunks for m in chunk.modules() if isinstance(m, TransformerLayer)
    }
    ep, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    local = (cfg.model.num_experts or 0) // ep_size
    dense_sender = (
        ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    for name in sent:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if layer is not None:
            assert int(layer.group(1)) in layers, f"rank {dist.get_rank()} sent {name}, its layers are {sorted(layers)}"
        elif name.startswith("model.embed_tokens"):
            assert ps.is_pipeline_first_stage(), f"rank {dist.get_rank()} sent {name} off the first stage"
        else:
            assert ps.is_pipeline_last_stage(), f"rank {dist.get_rank()} sent {name} off the last stage"
        if expert is not None:
            assert ep * local <= int(expert.group(1)) < (ep + 1) * local, f"EP rank {ep} sent {name}"
        else:
            assert dense_sender, f"rank {dist.get_rank()} is not its stage's first rank but sent {name}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sent)
    names = [n for mine in everyone for n in mine]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"sent more than once: {twice[:4]}"
    assert sorted(names) == sorted(HFMapping(cfg.model).expected_hf_shapes()), "not every tensor was sent"
    if ps.get_pipeline_model_parallel_world_size() > 1 or ep_size > 1:
        assert sum(1 for mine in everyone if mine) > 1, "one rank sent everything"


def check_disk_files(cfg: Config, serving, version: str) -> None:  # noqa: ANN001
    """The folder the engine now serves (rank 0): each sender's own files (by stage and EP rank,
    experts of that EP rank only), every tensor once in the index, no other safetensors file."""
    import json
    import re

    from megatron.core import parallel_state as ps

    from megatron_rl.models.hf_mapping import HFMapping

    if dist.get_rank() != 0:
        return
    ep_size = ps.get_expert_model_parallel_world_size()
    local = (cfg.model.num_experts or 0) // ep_size
    weight_map = json.loads((serving / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(HFMapping(cfg.model).expected_hf_shapes()), version
    assert sorted(p.name for p in serving.glob("*.safetensors")) == sorted(set(weight_map.values())), version
    for name, file in weight_map.items():
        sender = re.fullmatch(r"part-pp(\d{3})(?:-ep(\d{3}))?-\d{5}\.safetensors", file)
        assert sender is not None, file
        assert (sender.group(2) is not None) == (ep_size > 1), file
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if expert is not None and ep_size > 1:
            ep = int(sender.group(2))
            assert ep * local <= int(expert.group(1)) < (ep + 1) * local, (name, file)


def run_modes(ctx, parallel: ParallelConfig, modes: tuple[str, ...], servers: int = 1) -> tuple:  # noqa: ANN001
    """Build the actor; sync its initial weights (first mode) into `servers` engines and check; then one
    round per mode."""
    from megatron_rl.weight_sync import make_weight_sync

    cfg = policy_config(ctx, parallel, modes[0], servers)
    actor = build_actor(cfg)
    engine = connect(cfg)
    with make_weight_sync(cfg, engine, actor, bucket_mb=BUCKET_MB) as sync:
        sync.sync("init")
    samples = rollout(engine, cfg, seed=100)
    check_invariant(actor, samples, f"initial weights, layout {parallel}")
    for step, mode in enumerate(modes, start=1):
        samples = sync_round(ctx, actor, engine, cfg, mode, samples, step)
    return cfg, actor, engine, samples


@contextlib.contextmanager
def corrupt_export(name: str, kind: str) -> Iterator[None]:
    """Make the exporter rename ("name") or cut a row off ("shape") the tensor `name`."""
    import megatron_rl.models.export as export_module
    import megatron_rl.weight_sync.senders as senders_module

    original = export_module.export_hf_weights

    def corrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        for bucket in original(*args, **kwargs):
            out = []
            for n, t in bucket:
                if n == name:
                    n, t = (n + "_renamed", t) if kind == "name" else (n, t[:-1])
                out.append((n, t))
            yield out

    export_module.export_hf_weights = senders_module.export_hf_weights = corrupted
    try:
        yield
    finally:
        export_module.export_hf_weights = senders_module.export_hf_weights = original


def expect_refused(sync, version: str, pattern: str) -> None:  # noqa: ANN001
    import re

    from megatron_rl.weight_sync import WeightSyncError

    try:
        sync.sync(version)
    except WeightSyncError as err:
        assert re.search(pattern, str(err)), f"error does not match {pattern!r}: {err}"
        assert f"version {version!r}" in str(err), err
    else:
        raise AssertionError(f"a corrupted {sync.mode} sync was accepted")


@contextlib.contextmanager
def full_disk(module: str = "megatron_rl.models.hf_io") -> Iterator[None]:
    """Every safetensors file `module` writes (the export's; the adapter folder's: models.peft_format)
    fails as on a full disk (ENOSPC)."""
    import importlib

    writer = importlib.import_module(module)
    original = writer.write_safetensors

    def no_space(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    writer.write_safetensors = no_space
    try:
        yield
    finally:
        writer.write_safetensors = original


def expect_full_disk(sync) -> None:  # noqa: ANN001
    """A disk sync onto a full disk: one line on every rank naming the sync folder and the free bytes."""
    from megatron_rl.models.write_errors import StorageWriteError

    try:
        sync.sync("disk-full")
    except StorageWriteError as err:
        message = str(err)
    else:
        raise AssertionError("a disk sync onto a full disk was accepted")
    assert message.startswith(f"{sync.next_folder()}: no space left to write the weights for the engine ("), message
    assert "bytes free on its file system" in message and "rollout.sync_dir" in message and "\n" not in message


def greedy_changed(a: list[dict], b: list[dict]) -> bool:
    """Whether two greedy rollouts of the same prompts come from visibly different weights."""
    if [s["output"] for s in a] != [s["output"] for s in b]:
        return True
    return max_diff(engine_log_probs(a), engine_log_probs(b)) > 1e-3


def engine_version(engine) -> str | None:  # noqa: ANN001
    return on_every_rank(None if engine is None else engine.run(engine.client.get_model_info())["weight_version"])


# --- world size 1 --------------------------------------------------------------------------


def w1_three_modes(ctx) -> None:  # noqa: ANN001
    """The invariant after disk, distributed and tensor syncs (tensor after releasing engine memory)."""
    _, _, engine, _ = run_modes(ctx, layout(), ("disk", "distributed", "tensor"))
    if engine is not None:
        engine.close()


EMBED = "model.embed_tokens.weight"  # the exporter's first tensor: a corrupted first bucket applies nothing
REFUSALS = (
    ("disk", "shape", r"'model\.embed_tokens\.weight': shape \[255, 64\] does not match the model's \[256, 64\]"),
    ("distributed", "name", r"unknown tensor 'model\.embed_tokens\.weight_renamed'"),
    ("tensor", "shape", r"'model\.embed_tokens\.weight': shape \[255, 64\] does not match the model's \[256, 64\]"),
)


def w1_refused_updates(ctx) -> None:  # noqa: ANN001
    """Per mode, an export with a wrong name or shape is refused on every rank with an error that
    names the tensor (and a disk sync onto a full disk is one line naming the folder); the engine
    keeps serving the old weights (greedy outputs and log-probs
    unchanged, old version); the next good sync of the same sync object works. A distributed sync
    whose group the engine forgot is refused, and the next one builds a new group."""
    from megatron_rl.weight_sync import make_weight_sync

    cfg = policy_config(ctx, layout())
    actor = build_actor(cfg)
    engine = connect(cfg)
    samples = rollout(engine, cfg, seed=7)
    for step, (mode, kind, pattern) in enumerate(REFUSALS):
        with make_weight_sync(with_mode(cfg, mode), engine, actor, bucket_mb=BUCKET_MB) as sync:
            good = f"{mode}-good"
            sync.sync(good)
            before = rollout(engine, cfg, seed=50 + step, greedy=True)
            samples = rollout(engine, cfg, seed=60 + step)
            train_step(actor, samples)
            with corrupt_export(EMBED, kind):
                expect_refused(sync, f"{mode}-bad", pattern)
            if mode == "disk":
                with full_disk():
                    expect_full_disk(sync)
            after = rollout(engine, cfg, seed=50 + step, greedy=True)
            assert engine_version(engine) == good
            assert [s["output"] for s in after] == [s["output"] for s in before], f"{mode}: outputs changed"
            # the engine's batching of concurrent requests moves log-probs by ~1e-6; new weights by > 1e-3
            assert max_diff(engine_log_probs(after), engine_log_probs(before)) <= 1e-5, f"{mode}: weights changed"
            assert {s["version"] for s in after} == {good}
            sync.sync(f"{mode}-fixed")
            fixed = rollout(engine, cfg, seed=50 + step, greedy=True)
            assert greedy_changed(fixed, before), f"{mode}: the good sync after the refused one changed nothing"
    # the engine forgets the group (as after a restart): refused, then the next sync builds a new group
    quick = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, request_timeout_s=10.0))
    with make_weight_sync(with_mode(quick, "distributed"), engine, actor, bucket_mb=BUCKET_MB) as sync:
        sync.sync("group-1")
        if engine is not None:
            engine.run(engine.client.destroy_weights_update_group(sync._group_name))
        expect_refused(
            sync, "group-2", r"no group 'megatron-rl-\d+-pp0-ep0-\d+'; call /init_weights_update_group first"
        )
        train_step(actor, rollout(engine, cfg, seed=98))
        sync.sync("group-3")
    assert engine_version(engine) == "group-3"
    check_invariant(actor, rollout(engine, cfg, seed=99), "after refused updates")
    if engine is not None:
        engine.close()


LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def w1_lora_sync(ctx) -> None:  # noqa: ANN001
    """LoRA (rank 4 on q, k, v, o of every layer): the merged sync of the start (B = 0: the base) puts the
    engine back on the base; then, after an update each, adapter-only syncs (disk: a PEFT folder through
    /load_lora_adapter; tensor: /load_lora_adapter_from_tensors) make the engine serve `policy-v<version>`
    through PEFT, /generate naming it: its log-probs equal the actor's (the invariant), and a sync sends
    the adapters' bytes alone; a merged sync then sends the full weights and the base alone serves them."""
    from megatron_rl.config import LoraConfig
    from megatron_rl.models.lora import gather_adapters
    from megatron_rl.weight_sync import WeightSyncError, make_weight_sync

    plain = policy_config(ctx, layout())
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=LORA_ATTENTION)
    cfg = dataclasses.replace(plain, model=dataclasses.replace(plain.model, lora=lora))
    merged = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, lora_sync="merged"))
    actor = build_actor(cfg)
    engine = connect(cfg)
    full = weight_bytes(cfg)
    with make_weight_sync(merged, engine, actor, bucket_mb=BUCKET_MB) as sync:
        assert sync.sync("lora-start").bytes > full  # a disk folder of the whole (merged = base) model
    samples = rollout(engine, cfg, seed=300)
    check_invariant(actor, samples, "LoRA start (B = 0), merged sync")
    adapter_bytes = sum(t.numel() * 4 for t in gather_adapters(actor.lora).values())
    for step, mode in enumerate(("disk", "tensor"), start=1):
        train_step(actor, samples)
        with make_weight_sync(with_mode(cfg, mode), engine, actor, bucket_mb=BUCKET_MB) as sync:
            report = sync.sync(f"lora-{mode}-{step}")
        assert (report.mode, report.bytes) == ("lora_adapter", adapter_bytes), (report, adapter_bytes)
        assert engine is None or engine.client.lora_path == f"policy-vlora-{mode}-{step}"
        samples = rollout(engine, cfg, seed=300 + step)
        assert {s["version"] for s in samples} == {f"lora-{mode}-{step}"}
        check_invariant(actor, samples, f"LoRA adapter-only sync ({mode})")
    assert 20 * adapter_bytes < full, (adapter_bytes, full)
    with (
        make_weight_sync(with_mode(cfg, "disk"), engine, actor, bucket_mb=BUCKET_MB) as sync,
        full_disk("megatron_rl.models.peft_format"),
    ):
        try:
            sync.sync("lora-disk-full")
        except WeightSyncError as err:  # one line; the engine keeps serving the adapter it had
            folder = sync.root / "lora-policy-vlora-disk-full"
            assert f"{folder}: no space left to write the adapter for the engine (" in str(err), err
            assert "rollout.sync_dir" in str(err) and "\n" not in str(err) and not folder.exists()
        else:
            raise AssertionError("an adapter sync onto a full disk was accepted")
    assert engine is None or engine.client.lora_path == "policy-vlora-tensor-2"
    train_step(actor, samples)
    if engine is not None:
        engine.client.lora_path = None  # the merged policy is the base model's weights
    with make_weight_sync(merged, engine, actor, bucket_mb=BUCKET_MB) as sync:
        assert sync.sync("lora-merged").bytes > full
    check_invariant(actor, rollout(engine, cfg, seed=310), "LoRA merged sync")
    if engine is not None:
        engine.close()


# --- world size 2 --------------------------------------------------------------------------


def w2_tp2(ctx) -> None:  # noqa: ANN001
    """TP=2 with sequence parallelism: TP shards gathered on rank 0; all three modes."""
    _, _, engine, _ = run_modes(ctx, layout(tp=2), ("disk", "distributed", "tensor"))
    if engine is not None:
        engine.close()


def w2_ep2(ctx) -> None:  # noqa: ANN001
    """EP=2 (and DP=2): each EP rank sends its own experts, named by their global id, into two engines that
    take one update at a time; all three modes."""
    _, _, engine, _ = run_modes(ctx, layout(ep=2), ("disk", "distributed", "tensor"), servers=2)
    if engine is not None:
        engine.close()


def w2_pp2(ctx) -> None:  # noqa: ANN001
    """PP=2 with uneven stages (`parallel.num_layers_in_last_pipeline_stage` = 3: the embedding and layer 0,
    then layers 1-3 and the head): each stage sends its own buckets, its layers under their global numbers,
    in every mode (its own files, group or handles), into two engines that take one update at a time.
    A tensor of stage 1 refused mid-stream: the error reaches both ranks, the version stays, the
    group stays usable, and the next sync restores the invariant."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_rl.weight_sync import make_weight_sync

    cfg, actor, engine, samples = run_modes(ctx, layout(pp=2, last=3), ("distributed", "tensor", "disk"), servers=2)
    layers = [m.layer_number - 1 for c in actor.chunks for m in c.modules() if isinstance(m, TransformerLayer)]
    assert layers == ([0] if ps.is_pipeline_first_stage() else [1, 2, 3]), layers
    with make_weight_sync(with_mode(cfg, "distributed"), engine, actor, bucket_mb=BUCKET_MB) as sync:
        sync.sync("pp-good")
        train_step(actor, rollout(engine, cfg, seed=11))
        with corrupt_export("model.norm.weight", "name"):
            expect_refused(sync, "pp-bad", r"unknown tensor 'model\.norm\.weight_renamed'")
        assert engine_version(engine) == "pp-good"
        sync.sync("pp-fixed")
    fresh = rollout(engine, cfg, seed=12)
    assert {s["version"] for s in fresh} == {"pp-fixed"}
    check_invariant(actor, fresh, "PP=2 after a refused distributed sync")
    if engine is not None:
        engine.close()


def w1_partial_rollout(ctx) -> None:  # noqa: ANN001
    """rollout.async_mode=fully_async with partial rollouts: a distributed sync while six long requests
    generate pauses them with mode "retract", updates and continues them. Every request then carries
    version "0" on its first tokens and "1" on the rest; the engine's log-probs of the version-1 tokens
    equal the updated actor's over the whole sequence, and those of the version-0 tokens a plain forward
    of the weights before the update (the HF folder the actor started from), <= 1e-4."""
    import time

    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.weight_sync import make_weight_sync

    cfg = policy_config(ctx, layout(), "distributed")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, async_mode="fully_async"))
    actor = build_actor(cfg)
    engine = connect(cfg)
    with make_weight_sync(cfg, engine, actor, bucket_mb=BUCKET_MB) as sync:
        assert (sync.in_flight.pause, sync.in_flight.abort_all_requests) == ("retract", False)
        sync.sync("0")
        train_step(actor, rollout(engine, cfg, seed=200))
        pending = None
        if engine is not None:
            client = engine.client
            gen = torch.Generator().manual_seed(201)
            prompts = [torch.randint(2, cfg.model.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
            longest = cfg.model.max_position_embeddings - max(PROMPT_LENGTHS) - 1
            params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=longest, ignore_eos=True)
            pending = engine.submit(client.generate_batch(prompts, params))
            while True:  # every request prefilled: each has a token of version 0
                info = engine.run(client._json("GET", "/get_server_info", server=client.urls[0]))
                if info["internal_states"][0]["running"] == len(prompts):
                    break
                time.sleep(0.005)
        sync.sync("1")
        got = None if pending is None else pending.result(timeout=120)
    samples = on_every_rank(
        None
        if got is None
        else [
            dict(prompt=s.prompt_ids, output=s.output_ids, logprobs=s.logprobs, versions=s.weight_versions) for s in got
        ]
    )
    splits = [s["versions"].count("0") for s in samples]
    for s, k in zip(samples, splits, strict=True):
        assert s["versions"] == ["0"] * k + ["1"] * (len(s["output"]) - k), s["versions"]
        assert k > 0, "every request sampled a token before the sync"
    assert any(k < len(s["output"]) for s, k in zip(samples, splits, strict=True)), "no request spans the sync"
    batch = as_batch([dict(s, routed=None) for s in samples])
    actor_lp = actor.compute_log_probs(batch).log_probs
    before = AutoModelForCausalLM.from_pretrained(cfg.model.hf_path, dtype=torch.float32).eval()
    for s, k, lp in zip(samples, splits, actor_lp, strict=True):
        engine_lp = torch.tensor(s["logprobs"], dtype=torch.float32)
        with torch.no_grad():
            logits = before(torch.tensor([s["prompt"] + s["output"]])).logits[0].float() / TEMPERATURE
        p = len(s["prompt"])
        hf_lp = torch.log_softmax(logits, -1)[p - 1 : -1].gather(1, torch.tensor(s["output"])[:, None])[:, 0]
        d0 = float((engine_lp[:k] - hf_lp[:k]).abs().max())
        assert d0 <= LOGPROB_TOL, f"version-0 tokens: engine vs the weights before the sync differ by {d0:.3e}"
        if k < len(s["output"]):
            d1 = float((engine_lp[k:] - lp[k:]).abs().max())
            assert d1 <= LOGPROB_TOL, f"version-1 tokens: engine vs the updated actor differ by {d1:.3e}"
    aborted_by_the_sync(cfg, actor, engine)
    if engine is not None:
        engine.close()


def aborted_by_the_sync(cfg: Config, actor, engine) -> None:  # noqa: ANN001
    """fully_async without partial rollouts: a distributed sync under long requests pauses with mode
    "abort" for the whole transfer, so the requests come back aborted with their version-1 tokens. A
    session opened on a server that is not paused would wait for them to run to their length instead."""
    import time

    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.weight_sync import make_weight_sync

    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, partial_rollout=False))
    with make_weight_sync(cfg, engine, actor, bucket_mb=BUCKET_MB) as sync:
        assert (sync.in_flight.pause, sync.in_flight.abort_all_requests) == ("abort", True)
        got = None
        longest = cfg.model.max_position_embeddings - max(PROMPT_LENGTHS) - 1
        if engine is not None:
            client = engine.client
            params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=longest, ignore_eos=True)
            prompts = [[2 + n] * n for n in PROMPT_LENGTHS]
            pending = engine.submit(client.generate_batch(prompts, params))
            while True:  # every request prefilled
                info = engine.run(client._json("GET", "/get_server_info", server=client.urls[0]))
                if info["internal_states"][0]["running"] == len(prompts):
                    break
                time.sleep(0.005)
        sync.sync("2")
        if engine is not None:
            got = [(s.finish_reason, len(s.output_ids), set(s.weight_versions)) for s in pending.result(timeout=120)]
    for finish, n, versions in on_every_rank(got):
        assert finish == "abort" and 0 < n < longest and versions == {"1"}, (finish, n, versions)

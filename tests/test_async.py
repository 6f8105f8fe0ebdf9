"""Asynchronous rollouts (`rollout.async_mode`, issue 12's loop).

In process (no Megatron; the product's `RolloutRuntime` on a test-side engine):
- the version arithmetic and the `async/` metrics by hand-computed values;
- fully_async: a request held back until the trainer is two versions ahead comes back stale, is
  dropped (counted) and resubmitted; every trained token is within `rollout.max_staleness` of the
  trainer; a checkpoint of the rollout state, a crash two steps later and a resume neither lose nor
  repeat a prompt (every prompt's uses counted from the batches the runtime handed over);
- refused combinations name their keys.

End to end (`megatron-rl train`, one trainer rank, the local engine on the tiny_math model):
- one_step_off: kill -9 after the checkpoint of step 2 and `--resume`: steps 1-2 (the first
  process) and 3 (the resumed one) equal an uninterrupted seeded run's, timings aside; batches 1
  and 2 come from the start weights (staleness 0 then 1);
- fully_async: the staleness bound holds on every trained step, the metrics are there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.config import Config, ConfigError, load_config
from megatron_rl.envs import Trajectory
from megatron_rl.loop.async_rollout import (
    StalenessBound,
    staleness_metrics,
    token_versions,
    too_stale,
    trained_versions,
    version_number,
)
from megatron_rl.loop.runtime import RolloutData, RolloutRuntime
from megatron_rl.rollout.types import Sample

from mrl_runs import RunCache, assert_resume_matches, kill_after_checkpoint, leftovers, steps_logged, train

G = 2  # responses per prompt in the in-process tests


# ---- the version arithmetic ----
def test_version_numbers_and_staleness_metrics_by_hand() -> None:
    assert [version_number(v) for v in (None, "default", "0", "7")] == [0, 0, 0, 7]
    with pytest.raises(ValueError, match="'v2' is not a step number"):
        version_number("v2")
    reported = Trajectory([1], [5, 6, 7], [0.0] * 3, "stop", weight_version="2", weight_versions=["1", "1", "2"])
    single = Trajectory([1], [5, 6], [0.0] * 2, "stop", weight_version="3")
    start = Sample([1], [5], [0.0], "stop", weight_version="default")
    assert token_versions(reported) == [1, 1, 2] and token_versions(single) == [3, 3] and token_versions(start) == [0]
    with pytest.raises(ValueError, match="2 weight versions for 3 output tokens"):
        token_versions(Sample([1], [5, 6, 7], None, "stop", weight_versions=["1", "2"]))
    # trainer at version 3: staleness 2, 2, 1 | 0, 0 -> mean 5/5 = 1, max 2; one partial sample of 3 tokens
    metrics = staleness_metrics(3, [token_versions(reported), token_versions(single)])
    assert metrics == {
        "async/staleness_mean": 1.0,
        "async/staleness_max": 2.0,
        "async/partial_rollouts": 1.0,
        "async/partial_token_share": 3 / 5,
        "async/tokens_per_version": 5 / 3,  # versions 1, 2, 3
    }
    assert staleness_metrics(4, [[4, 4], [2]])["async/staleness_mean"] == pytest.approx(2 / 3)
    assert staleness_metrics(0, [])["async/staleness_max"] == 0.0
    assert too_stale(3, [reported], max_staleness=1) and not too_stale(3, [reported], max_staleness=2)
    assert not too_stale(3, [single], max_staleness=0)
    # a trajectory's observation tokens (loss mask 0) are not trained on: only generated tokens count
    traj = Trajectory([1], [5, 6, 7], [0.0] * 3, "stop", weight_versions=["1", "2", "2"], loss_mask=[True, False, True])
    assert trained_versions(traj) == [1, 2]


def test_the_staleness_bound_counts_every_live_group_and_caps_a_round() -> None:
    # B = 4 groups a step, max_staleness 1: (v + 2) x 4 groups may ever exist at version v
    bound = StalenessBound(max_staleness=1, batch_groups=4)
    assert (bound.capacity, bound.allowance(pending=0)) == (8, 8)
    assert bound.round_size(12, counted=0) == 8  # oversample 3.0 asks 12: the round waits for 8 at most
    bound.taken = 3  # 3 kept this step, 2 buffered and 1 in flight: 8 - 3 - 3 = 2 more may be submitted
    assert bound.allowance(pending=3) == 2 and bound.round_size(6, counted=3) == 5
    bound.consumed, bound.taken, bound.version = 4, 0, 1  # step 1 trained on 4; synced version 1
    assert (bound.capacity, bound.allowance(pending=2), bound.round_size(12, counted=0)) == (12, 6, 8)
    assert bound.describe() == "staleness bound 12, consumed 4, taken 0"


def test_decoupled_importance_weight_is_per_token_on_a_mixed_version_sample() -> None:
    """A partial rollout: tokens 0-1 from a stale version (behaviour log-prob log 3 below pi_prox), 2-3
    from the current one (equal): the weight pi_prox / pi_behav is per token, truncated at C = 2."""
    import math

    import torch

    from megatron_rl.losses.importance import importance_weights

    prox = torch.tensor([[-1.0, -2.0, -0.5, -0.7]], dtype=torch.float64)
    behaviour = prox - torch.tensor([[math.log(3.0), math.log(3.0), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(prox, dtype=torch.bool)
    kw = dict(threshold=2.0, mask_min=0.5, mask_max=2.0, max_log_ratio=20.0)
    weights = importance_weights(prox, behaviour, mask, mode="truncate", level="token", **kw)
    assert torch.allclose(weights.raw, torch.tensor([[3.0, 3.0, 1.0, 1.0]], dtype=torch.float64))
    assert weights.weight.tolist() == [[2.0, 2.0, 1.0, 1.0]]
    masked = importance_weights(prox, behaviour, mask, mode="mask", level="token", **kw)
    assert masked.weight.tolist() == [[0.0, 0.0, 1.0, 1.0]]  # the stale tokens out, the fresh ones kept


# ---- refused combinations ----
@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["rollout.async_mode=one_step_off", "rollout.colocate=true"], ["rollout.async_mode", "rollout.colocate"]),
        (["rollout.async_mode=fully_async", "rollout.colocate=true"], ["rollout.async_mode", "rollout.colocate"]),
        (
            ["rollout.async_mode=fully_async", "rollout.max_staleness=0"],
            ["rollout.async_mode", "rollout.max_staleness"],
        ),
    ],
)
def test_refused_async_combinations_name_the_keys(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert all(name in str(err.value) for name in names), err.value
    load_config(None, [o for o in overrides if "colocate" not in o and "max_staleness" not in o])  # each alone runs


# ---- fully_async in process: a held-back request, the staleness bound, resume ----
class VersionedEngine:
    """A test-side engine: each response is its prompt's last token repeated, tagged with the weight
    version the engine serves when the request finishes (`sync` sets it, as a weight update would).
    Every response is a partial rollout: its first token of the version the request arrived at, its
    second of the version it finished at. The first request of `held_prompt` is held back until the
    engine is `hold` versions further than when it arrived (or closes)."""

    def __init__(self, held_prompt: tuple[int, ...], hold: int) -> None:
        self.version = 0
        self.held_prompt = held_prompt
        self.hold = hold
        self.cond = threading.Condition()
        self.closed = False
        self.calls: Counter[tuple[int, ...]] = Counter()  # group requests per prompt
        self.restarts = 0  # as `RolloutEngine` reports them (this engine never dies)

    def sync(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    async def generate(
        self, prompts: list[list[int]], params: Any, return_routed_experts: bool = False
    ) -> list[Sample]:
        # the hold blocks (on the trainer's `sync`): on a worker thread, never the rollout loop's
        return await asyncio.to_thread(self._generate, prompts)

    def _generate(self, prompts: list[list[int]]) -> list[Sample]:
        key = tuple(prompts[0])
        with self.cond:
            self.calls[key] += 1
            began = self.version
            if key == self.held_prompt and self.calls[key] == 1:
                while self.version < began + self.hold and not self.closed:
                    self.cond.wait()
            now = self.version
        versions = [str(began), str(now)]
        return [Sample(list(p), [7, 7], [-0.5, -0.5], "stop", weight_version=str(now), weight_versions=versions)
                for p in prompts]  # fmt: skip

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiny_model
    import tiny_task

    root = tmp_path_factory.mktemp("async_data")
    tiny_model.save_tokenizer(tiny_model.build_tokenizer(), root / "tokenizer")
    train_rows, _ = tiny_task.split_problems(seed=0)
    rows = [json.dumps(tiny_task.task_row(p, i, "train")) for i, p in enumerate(train_rows[:40])]
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    # a reward that varies within a group is not needed: dynamic sampling is off
    (root / "rewards.py").write_text("def one(response: str, answer: str) -> float:\n    return 1.0\n")
    return root


def in_process_config(root: Path) -> Config:
    cfg = load_config(
        None,
        [
            f"data.train_path={root / 'train.jsonl'}",
            f"data.tokenizer_path={root / 'tokenizer'}",
            "data.shuffle=false",
            "data.max_prompt_tokens=64",
            "reward.type=custom",
            f"reward.custom_function={root / 'rewards.py'}:one",
            f"rollout.n_samples_per_prompt={G}",
            f"rollout.max_concurrency={4 * G}",
            "rollout.async_mode=fully_async",
            "rollout.max_staleness=1",
            "train.prompts_per_step=3",
            "train.steps=8",
        ],
    )
    return cfg


def prompt_key(data: RolloutData, row: int) -> tuple[int, ...]:
    return tuple(data.sampler.items[row].input_ids)


Uses = dict[tuple[int, ...], list[int]]


def wait_for_producer(driver: RolloutRuntime, engine: VersionedEngine) -> None:
    """Until every group the producer may submit at its version has come back, but a held one: so
    that every response of version v is buffered before v + 1 (no group of an earlier version is
    overtaken by a later one and goes stale by thread timing alone)."""
    producer = driver.producer
    assert producer is not None

    def idle() -> bool:
        held = all(
            job.attempt == 0 and tuple(job.prompt.input_ids) == engine.held_prompt
            for job in producer.in_flight.values()
        )
        return (
            held and not producer.retry and (producer.allowance() <= 0 or len(producer.in_flight) >= producer.workers)
        )

    # the producer's state is the runtime loop's: the predicate is evaluated there
    assert driver.run(producer.wait_until(idle, 30)), (producer.in_flight, producer.allowance())


def run_steps(driver: RolloutRuntime, engine: VersionedEngine, steps: range, uses: Uses) -> list[dict]:
    """The trainer's side of `steps`: take the batch, (no update), let the producer settle, sync the
    next version."""
    records = []
    version = steps.start - 1
    for step in steps:
        step_batch = driver.collect(step, version)
        driver.finish_step()
        assert step_batch.batch is not None and step_batch.versions is not None
        seen: set[tuple[int, ...]] = set()  # the step's prompts (a group's samples share theirs)
        for tokens, length in zip(step_batch.batch.tokens, step_batch.batch.prompt_lengths, strict=True):
            seen.add(tuple(tokens[:length].tolist()))
        for key in seen:
            uses.setdefault(key, []).append(step)
        staleness = [version - v for vs in step_batch.versions for v in vs]
        assert max(staleness) <= driver.cfg.rollout.max_staleness, (step, step_batch.versions)
        assert step_batch.metrics["async/staleness_max"] == max(staleness)
        records.append(step_batch.metrics)
        version = step
        wait_for_producer(driver, engine)
        engine.sync(version)
    return records


def start_driver(cfg: Config, root: Path, engine: VersionedEngine, sampler_state: dict | None = None) -> RolloutRuntime:
    data = RolloutData.load(cfg)
    if sampler_state is not None:
        data.sampler.load_state_dict(sampler_state)
    return RolloutRuntime(cfg, data, model_path=None, engine_log=root / "engine.log", engine=engine)


def test_fully_async_drops_a_stale_group_and_trains_its_prompt_after_resubmission(
    tiny_data: Path, rank0_env: None
) -> None:
    cfg = in_process_config(tiny_data)
    data = RolloutData.load(cfg)
    held = prompt_key(data, 1)  # the second prompt drawn: back with a token of version 0 at version >= 2
    assert len({prompt_key(data, i) for i in range(len(data.sampler.items))}) == len(data.sampler.items)
    engine = VersionedEngine(held, hold=2)
    driver = start_driver(cfg, tiny_data, engine)
    uses: Uses = {}
    try:
        records = run_steps(driver, engine, range(1, 9), uses)
    finally:
        driver.close()
        engine.close()
    assert sum(r["async/dropped_stale"] for r in records) == G  # the held group's samples, once
    assert engine.calls[held] == 2 and uses[held]  # held back, dropped, resubmitted, trained on
    assert all(len(steps) == 1 for steps in uses.values())
    assert max(r["async/staleness_max"] for r in records) == 1.0  # the bound is reached, never passed


def test_fully_async_resume_after_a_crash_neither_loses_nor_repeats_a_prompt(tiny_data: Path, rank0_env: None) -> None:
    cfg = in_process_config(tiny_data)
    data = RolloutData.load(cfg)
    held = prompt_key(data, 4)  # in flight at the checkpoint of step 2: resubmitted on resume
    engine = VersionedEngine(held, hold=5)
    driver = start_driver(cfg, tiny_data, engine)
    uses: Uses = {}
    try:
        first = run_steps(driver, engine, range(1, 3), uses)
        with driver.checkpoint_state() as saved:
            sampler_state = driver.data.sampler.state_dict()
        run_steps(driver, engine, range(3, 5), {})  # trained on, then the run dies: not kept
    finally:
        driver.close()
        engine.close()
    import pickle

    pending = {tuple(job.prompt.input_ids) for job in pickle.loads(saved)["pending"]}
    assert held in pending and held not in uses
    # the resumed run: a fresh engine serving the checkpoint's weights (version 2), the saved rollout state
    engine = VersionedEngine(held_prompt=(), hold=0)
    engine.sync(2)
    driver = start_driver(cfg, tiny_data, engine, sampler_state)
    driver.load_state_dict(saved)
    try:
        resumed = run_steps(driver, engine, range(3, 9), uses)
        with driver.checkpoint_state() as end_state:
            pass
    finally:
        driver.close()
        engine.close()
    assert all(r["groups/groups_used"] == 3 for r in first + resumed)
    assert sum(len(steps) for steps in uses.values()) == 8 * 3
    repeated = {k: steps for k, steps in uses.items() if len(steps) > 1}
    assert not repeated, repeated
    # not lost: every prompt the sampler handed out was trained on or is still buffered / in flight
    state = pickle.loads(end_state)
    waiting = {tuple(job.prompt.input_ids) for job, _ in state["buffer"]} | {
        tuple(job.prompt.input_ids) for job in state["pending"]
    }
    sampler = driver.data.sampler
    drawn = {prompt_key(driver.data, i) for i in range(sampler.position)}
    assert sampler.epoch == 0 and set(uses) | waiting == drawn and not set(uses) & waiting
    assert held in uses


# ---- end to end ----
@pytest.mark.e2e
def test_one_step_off_resume_after_kill_equals_an_uninterrupted_seeded_run(
    work: Path, straight_runs: RunCache, tmp_path: Path
) -> None:
    overrides = (
        "rollout.async_mode=one_step_off",
        "train.steps=3",
        "eval.every=0",
        "checkpoint.every=2",
    )
    run_dir = tmp_path / "killed"
    # kill -9 after step 2's checkpoint (batch 3 was generated before it)
    kill_after_checkpoint(work, run_dir, *overrides, step=2, ranks=1)
    assert [r["step"] for r in steps_logged(run_dir)] == [1, 2]
    # steps 1-2: a second seeded run; 3: resumed
    reference, _ = assert_resume_matches(straight_runs, work, run_dir, *overrides, ranks=1)
    # batches 1 and 2 both come from the start weights; batch 3 from step 1's
    assert [r["async/staleness_max"] for r in reference] == [0.0, 1.0, 1.0]
    # batch 1 comes from the weights it trains (engine and trainer agree); batches 2 and 3 from one update
    # behind: pi_prox (recomputed) and pi_behav (the engine's) differ, the policy moved (not vacuous)
    gaps = [r["logprob_gap/abs_max"] for r in reference]
    assert gaps[0] <= 1e-4 and min(gaps[1:]) > 1e-2, gaps
    assert all(r["time/wait_batch"] >= 0.0 and "time/engine_idle" in r for r in reference)
    assert leftovers(work) == []


@pytest.mark.e2e
def test_fully_async_trains_within_the_staleness_bound(work: Path, tmp_path: Path) -> None:
    records = train(
        work,
        tmp_path / "fully_async",
        "rollout.async_mode=fully_async",
        "rollout.max_staleness=1",
        "rollout.max_concurrency=8",
        "train.steps=3",
        "eval.every=0",
        "checkpoint.every=0",
        ranks=1,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # the groups of odd answers (the reward fails on them) are left out; the rest are trained as generated
        assert r["async/staleness_max"] <= 1.0 and r["groups/groups_used"] + r["groups/reward_failed"] == 4
        assert (r["actor/tokens"] < r["response/tokens"]) == (r["groups/reward_failed"] > 0)
    assert leftovers(work) == []


# ---- fully_async with dynamic sampling: a round takes what the staleness bound leaves it ----
def _collect_within(driver: RolloutRuntime, step: int, version: int, timeout: float = 120.0):
    """`driver.collect(step, version)` on a thread; fails instead of hanging when it does not return."""
    done: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: done.setdefault("step_batch", driver.collect(step, version)), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"step {step}: collect waited for groups the staleness bound never lets exist"
    return done["step_batch"]


def test_fully_async_dynamic_sampling_oversampling_past_the_bound_takes_what_the_bound_allows(
    tiny_data: Path, rank0_env: None
) -> None:
    # B = 4, G = 2, max_staleness 1: at most (0 + 1 + 1) x 4 = 8 live groups at version 0, while a round of
    # oversample_factor 3 asks for 12 (it waited for them forever); every group is uninformative (reward 1)
    cfg = in_process_config(tiny_data)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, dynamic_sampling=True, oversample_factor=3.0, max_gen_rounds=2)
    cfg.train.prompts_per_step = 4
    engine = VersionedEngine(held_prompt=(), hold=0)
    driver = start_driver(cfg, tiny_data, engine)
    try:
        first = _collect_within(driver, 1, 0)
        second = _collect_within(driver, 2, 0)  # a skipped step: still version 0, nothing consumed
    finally:
        driver.close()
        engine.close()
    for step_batch in (first, second):
        assert step_batch.batch is None and step_batch.metrics["groups/target_missed"] == 1.0
        metrics = step_batch.metrics
        assert (metrics["groups/rounds"], metrics["groups/groups_generated"]) == (2.0, 16.0)  # 8 a round


def test_a_round_after_kept_groups_takes_the_slots_they_leave(tiny_data: Path) -> None:
    from megatron_rl.loop.async_rollout import AsyncProducer, BusyMeter

    cfg = in_process_config(tiny_data)
    cfg.train.prompts_per_step = 4  # bound (0 + 1 + 1) x 4 = 8 groups at version 0
    data = RolloutData.load(cfg)
    answer = [Trajectory([1], [7, 7], [-0.5, -0.5], "stop", weight_version="0")] * G

    async def group(job: object) -> list[Trajectory]:
        return list(answer)

    async def rounds() -> list[int]:
        producer = AsyncProducer(cfg, group, lambda: data.sampler.next(1)[0], BusyMeter())
        try:
            _, first = await asyncio.wait_for(producer.take(6, 0), 60)
            # 3 of the first round's 6 kept: 8 - 3 = 5 slots left for the next round, which asks for 6
            # (a wait past 60 s: take(6) waited for a sixth group the bound never lets exist)
            _, second = await asyncio.wait_for(producer.take(6, 3), 60)
        finally:
            await producer.stop()
        return [len(first), len(second)]

    assert asyncio.run(rounds()) == [6, 5]


def test_a_round_that_no_group_can_reach_fails_naming_the_bound_and_one_in_flight_is_waited_for(
    tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_rl.loop import async_rollout
    from megatron_rl.loop.async_rollout import AsyncProducer, BusyMeter

    monkeypatch.setattr(async_rollout, "STARVATION_CHECK_S", 0.01)
    cfg = in_process_config(tiny_data)
    data = RolloutData.load(cfg)
    answer = [Trajectory([1], [7, 7], [-0.5, -0.5], "stop", weight_version="0")] * G

    async def scenario() -> tuple[int, list[bool]]:
        release, checked = asyncio.Event(), asyncio.Event()

        async def slow_group(job: object) -> list[Trajectory]:
            await release.wait()
            return list(answer)

        producer = AsyncProducer(cfg, slow_group, lambda: data.sampler.next(1)[0], BusyMeter())
        starved = producer._starved
        checks: list[bool] = []

        def counted() -> bool:
            checks.append(starved())
            if len(checks) >= 3:
                checked.set()
            return checks[-1]

        monkeypatch.setattr(producer, "_starved", counted)
        try:
            took = asyncio.ensure_future(producer.take(1, 0))
            await asyncio.wait_for(checked.wait(), 60)  # three checks while the group is in flight: none ends the wait
            release.set()
            _, grouped = await asyncio.wait_for(took, 60)
        finally:
            await producer.stop()
        held = AsyncProducer(cfg, slow_group, lambda: data.sampler.next(1)[0], BusyMeter())
        held.held = True  # nothing in flight and nothing may be submitted: the wait ends with an error
        try:
            with pytest.raises(RuntimeError, match=r"can never arrive .*staleness bound \d+, consumed 0, taken 0"):
                await asyncio.wait_for(held.take(1, 0), 60)
        finally:
            await held.stop()
        return len(grouped), checks

    took, checks = asyncio.run(scenario())
    assert took == 1 and len(checks) >= 3 and not any(checks)

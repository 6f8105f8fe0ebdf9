"""The RL loop's pieces without Megatron: rollout collection (fake engine), metrics, loop state, model source, plots."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mrl_engine import FakeEngine, on_loop

from megatron_rl.checkpoints import (
    LoopState,
    capture_rng,
    checkpoint_dir,
    latest_checkpoint,
    load_loop_state,
    prune_checkpoints,
    restore_rng,
    save_loop_state,
    write_manifest,
)
from megatron_rl.config import Config, ConfigError, load_config, loss_spec, preset, uses_reference
from megatron_rl.data import Prompt, PromptSampler, RowLocation
from megatron_rl.loop.collect import (
    RolloutCollector,
    advantages_of,
    kl_penalized_advantages,
    sampling_seed,
)
from megatron_rl.loop.evaluation import evaluate, pass_at_k
from megatron_rl.metrics import MetricsLogger, read_metrics, summarize_updates, truncate_metrics
from megatron_rl.models.source import resolve_model
from megatron_rl.rewards import RewardFailureError, RewardScorer
from megatron_rl.rollout.local.sampling import sample_tokens
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.trainer import logprob_gap, reference_kl
from megatron_rl.validation import validate_run


class CharTokenizer:
    """ids are code points; decoding drops id 0 (the 'special' EOS)."""

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(i) for i in row if not (skip_special_tokens and i == 0)) for row in ids]


class ScriptedEngine(FakeEngine):
    """Answers each prompt (by its first token) with the next of its scripted responses, in turn."""

    def __init__(self, script: dict[int, list[str]], max_new_tokens: int) -> None:
        super().__init__()
        self.script = script
        self.max_new_tokens = max_new_tokens
        self.turn: dict[int, int] = {}

    def answer(self, prompt, params, routed):
        key = prompt[0]
        k = self.turn.get(key, 0)
        self.turn[key] = k + 1
        text = self.script[key][k % len(self.script[key])]
        ids = [ord(c) for c in text][: self.max_new_tokens]
        finish = "length" if len(text) >= self.max_new_tokens else "stop"
        if text == ABORT:  # the engine aborted the request after a few tokens
            finish = "abort"
        elif finish == "stop":
            ids.append(0)
        lps = [-0.5] * len(ids)
        return Sample(list(prompt), ids, lps, finish, weight_version="0")


def prompt(index: int, answer: str) -> Prompt:
    return Prompt(index, (100 + index, 61), f"q{index}", answer, {}, RowLocation("t.jsonl", "line", index + 1))


def make_cfg(**over: object) -> Config:
    base = {
        "model.hf_path": "unused",
        "data.train_path": "unused",
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 12,
        "train.prompts_per_step": 2,
        "data.shuffle": False,
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def collector(
    cfg: Config, script: dict[int, list[str]], prompts: list[Prompt]
) -> tuple[RolloutCollector, ScriptedEngine]:
    engine = ScriptedEngine(script, cfg.rollout.max_new_tokens)
    sampler = PromptSampler(prompts, shuffle=False)
    return RolloutCollector(cfg, engine, CharTokenizer(), RewardScorer(cfg.reward), sampler), engine


RIGHT, WRONG, ABORT = "Answer: 7", "Answer: 3", "Answer: 7?"


def test_sampling_seeds_are_stable_distinct_and_63_bit() -> None:
    seeds = {sampling_seed(1234, s, r, i) for s in range(3) for r in range(3) for i in range(50)}
    assert len(seeds) == 450 and all(0 <= x < 2**63 for x in seeds)
    assert sampling_seed(1234, 2, 1, 7) == sampling_seed(1234, 2, 1, 7) != sampling_seed(1235, 2, 1, 7)


def test_per_row_generators_draw_like_separate_calls() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    temp, top_p, top_k = torch.tensor([1.0, 0.0, 0.7]), torch.ones(3), torch.full((3,), -1)
    seeds = [5, 6, 7]
    tokens, _ = sample_tokens(logits, temp, top_p, top_k, [torch.Generator().manual_seed(s) for s in seeds])
    for row in (0, 2):  # each sampled row equals that row sampled alone with its own generator
        alone, _ = sample_tokens(
            logits[row : row + 1], temp[row : row + 1], top_p[:1], top_k[:1], torch.Generator().manual_seed(seeds[row])
        )
        assert int(tokens[row]) == int(alone[0])
    assert int(tokens[1]) == int(logits[1].argmax())


def test_dynamic_sampling_all_wrong_stops_at_the_round_limit_with_the_warning() -> None:
    cfg = make_cfg(**{"algorithm.name": "dapo", "algorithm.max_gen_rounds": 3, "algorithm.overlong_buffer_len": 4})
    prompts = [prompt(i, "7") for i in range(10)]
    col, engine = collector(cfg, {100 + i: [WRONG] for i in range(10)}, prompts)
    step_batch = on_loop(col.collect(step=1))
    assert step_batch.batch is None
    m = step_batch.metrics
    assert (m["groups/rounds"], m["groups/target_missed"], m["groups/groups_used"]) == (3.0, 1.0, 0.0)
    assert (m["groups/groups_generated"], m["groups/filtered"], m["reward/count"]) == (6.0, 6.0, 24.0)
    assert col.sampler.position == 6 and len(engine.calls) == 3
    # every request of the step has its own seed, derived from (train.seed, step, round, index)
    seeds = [p.sampling_seed for call in engine.calls for p in call]
    assert seeds[:4] == [sampling_seed(cfg.train.seed, 1, 0, i) for i in range(4)] and len(set(seeds)) == 24


def test_dynamic_sampling_keeps_informative_groups_with_hand_computed_advantages() -> None:
    cfg = make_cfg(**{"algorithm.name": "dapo", "algorithm.overlong_buffer_len": 4})
    script = {100: [WRONG], 101: [RIGHT, WRONG, WRONG, WRONG], 102: [RIGHT, RIGHT, WRONG, WRONG], 103: [WRONG]}
    col, _ = collector(cfg, script, [prompt(i, "7") for i in range(4)])
    step_batch = on_loop(col.collect(step=1))
    m = step_batch.metrics
    assert (m["groups/rounds"], m["groups/groups_kept"], m["groups/target_missed"]) == (2.0, 2.0, 0.0)
    batch = step_batch.batch
    assert len(batch) == 8
    # every response is 9 characters + EOS = 10 tokens > L_max - L_cache = 12 - 4: the same -0.5 penalty
    # on every reward, which group advantages cancel
    adv = torch.stack(batch.advantages)
    std1 = math.sqrt((1.5**2 + 3 * 0.5**2) / 3) + 1e-6  # rewards [1, -1, -1, -1]: mean -0.5, unbiased std 1
    std2 = math.sqrt(4 / 3) + 1e-6  # rewards [1, 1, -1, -1]
    want = [1.5 / std1, -0.5 / std1, -0.5 / std1, -0.5 / std1, 1 / std2, 1 / std2, -1 / std2, -1 / std2]
    torch.testing.assert_close(adv, torch.tensor(want))
    assert step_batch.metrics["reward/train_mean"] == pytest.approx((-2 + 0) / 8 - 0.5)
    assert step_batch.rewards.tolist() == [0.5, -1.5, -1.5, -1.5, 0.5, 0.5, -1.5, -1.5]  # shaped: the advantages' input
    assert batch.prompt_lengths == [2] * 8 and batch.response_mask is None
    assert batch.tokens[0].tolist() == [101, 61, *[ord(c) for c in RIGHT], 0]
    assert batch.rollout_log_probs[0].tolist() == [-0.5] * 10


def test_without_dynamic_sampling_one_round_is_used_whole() -> None:
    cfg = make_cfg()
    col, _ = collector(cfg, {100: [WRONG], 101: [RIGHT, WRONG]}, [prompt(0, "7"), prompt(1, "7")])
    step_batch = on_loop(col.collect(step=3))
    m = step_batch.metrics
    assert (m["groups/rounds"], m["groups/groups_used"], m["groups/informative"], m["groups/filtered"]) == (1, 2, 1, 1)
    assert len(step_batch.batch) == 8
    assert torch.stack(step_batch.batch.advantages[:4]).abs().max() == 0  # the uninformative group trains on nothing
    assert m["reward/accuracy"] == 2 / 8 and m["reward/mean"] == (2 - 6) / 8


def test_aborted_requests_leave_their_group_out_of_the_batch() -> None:
    cfg = make_cfg()
    # prompt 0's third response was aborted (its text would even score as right); prompt 1's group is whole
    script = {100: [RIGHT, WRONG, ABORT, WRONG], 101: [RIGHT, WRONG, WRONG, WRONG]}
    col, _ = collector(cfg, script, [prompt(0, "7"), prompt(1, "7")])
    step_batch = on_loop(col.collect(step=1))
    m = step_batch.metrics
    assert (m["rollout/aborted"], m["groups/aborted"], m["groups/groups_used"]) == (1.0, 1.0, 1.0)
    assert len(step_batch.batch) == 4 and all(int(t[0]) == 101 for t in step_batch.batch.tokens)
    # only the whole group is scored: rewards 1, -1, -1, -1 -> advantages (r - mean) / std
    adv = torch.stack([a.reshape(-1)[0] for a in step_batch.batch.advantages])
    std = torch.tensor([1.0, -1.0, -1.0, -1.0]).std()
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (std + 1e-6))
    assert m["reward/count"] == 4.0
    # every group aborted: nothing to train on, the step is skipped (no crash)
    col, _ = collector(cfg, {100: [ABORT], 101: [RIGHT, ABORT]}, [prompt(0, "7"), prompt(1, "7")])
    step_batch = on_loop(col.collect(step=1))
    assert (
        step_batch.batch is None
        and step_batch.metrics["groups/aborted"] == 2.0
        and step_batch.metrics["rollout/aborted"] == 6.0
    )


def test_short_batch_with_fewer_samples_than_data_parallel_ranks_is_dropped() -> None:
    cfg = make_cfg(**{"algorithm.name": "dapo", "algorithm.max_gen_rounds": 1, "algorithm.overlong_buffer_len": 4})
    script = {100: [RIGHT, WRONG], 101: [WRONG]}  # one informative group of 4 after the only round
    for dp, dropped in ((8, True), (4, False)):
        engine = ScriptedEngine(script, cfg.rollout.max_new_tokens)
        sampler = PromptSampler([prompt(0, "7"), prompt(1, "7")], shuffle=False)
        col = RolloutCollector(cfg, engine, CharTokenizer(), RewardScorer(cfg.reward), sampler, min_samples=dp)
        step_batch = on_loop(col.collect(step=1))
        assert step_batch.metrics["groups/target_missed"] == 1.0 and step_batch.metrics["groups/groups_used"] == 1.0
        assert step_batch.metrics["groups/short_batch_dropped"] == float(dropped)
        assert (step_batch.batch is None) == dropped and (dropped or len(step_batch.batch) == 4)


def test_overlong_shaping_filtering_and_reward_failures() -> None:
    def rule(response: str, answer: str) -> float:
        if "x" in response:
            raise ValueError("x is not allowed")
        return float(len(response))

    cfg = make_cfg(
        **{
            "algorithm.soft_overlong_punishment": True,
            "algorithm.overlong_buffer_len": 4,
            "algorithm.overlong_filter": True,
            "reward.type": "custom",
            "reward.custom_function": "unused:unused",
            "reward.max_failure_frac": 0.125,  # 1 of the step's 8 responses fails: at the limit, not above
        }
    )
    short, mid, long_, bad = "ab", "abcdefghi", "abcdefghijklmnop", "x"
    engine = ScriptedEngine(
        {100: [short, mid, long_, "abc"], 101: [bad, short, short, short]}, cfg.rollout.max_new_tokens
    )
    sampler = PromptSampler([prompt(0, "1"), prompt(1, "1")], shuffle=False)
    col = RolloutCollector(cfg, engine, CharTokenizer(), RewardScorer(cfg.reward, rule=rule), sampler)
    step_batch = on_loop(col.collect(step=1))
    groups, stats = col.score([prompt(0, "1")], [on_loop(engine.generate([[100, 61]] * 4, [SamplingParams()] * 4))])
    # lengths: 3, 10 (9 + EOS), 12 (truncated, no EOS), 4 tokens; L_max 12, L_cache 4: penalty zone above 8
    assert groups[0].scores == [2.0, 9.0, 12.0, 3.0]
    assert groups[0].rewards == pytest.approx([2.0, 9.0 - 2 / 4, 12.0 - 1.0, 3.0])
    assert stats.failed == 0 and step_batch.metrics["reward/failures"] == 1.0
    # the group with the failed response is left out whole: only prompt 0's group is trained on
    assert (step_batch.metrics["groups/reward_failed"], step_batch.metrics["groups/groups_used"]) == (1.0, 1.0)
    assert [int(t[0]) for t in step_batch.batch.tokens] == [100] * 4
    assert [m.tolist() for m in step_batch.batch.response_mask] == [[True] * 3, [True] * 10, [False] * 12, [True] * 4]
    assert step_batch.rewards.tolist() == pytest.approx([2.0, 8.5, 11.0, 3.0])
    assert step_batch.metrics["response/clipped_frac"] == 0.125 and step_batch.metrics["response/length_max"] == 12


def test_evaluate_is_greedy_accuracy() -> None:
    cfg = make_cfg(**{"eval.temperature": 0.0})
    engine = ScriptedEngine({100: [RIGHT], 101: [WRONG], 102: [RIGHT]}, 12)
    out = on_loop(
        evaluate(engine, [prompt(i, "7") for i in range(3)], CharTokenizer(), RewardScorer(cfg.reward), cfg, 5)
    )
    assert out["eval/greedy_accuracy"] == pytest.approx(2 / 3) and out["eval/prompts"] == 3
    assert all(p.temperature == 0.0 and p.sampling_seed is None for p in engine.calls[0])


def test_pass_at_k_is_the_codex_estimator() -> None:
    # 1 - C(n - c, k) / C(n, k): n = 5, c = 2, k = 2 gives 1 - 3/10; k = 1 is c / n; k = n is "any correct"
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7) and pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert (pass_at_k(4, 1, 4), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)) == (1.0, 0.0, 1.0)
    assert pass_at_k(20, 3, 7) == pytest.approx(1 - math.comb(17, 7) / math.comb(20, 7))


def test_sampled_evaluation_reports_mean_and_pass_at_k_pooled_and_per_file() -> None:
    """4 seeded samples per prompt: prompt 0 right once, prompt 1 never, prompt 2 three times; files a = {0, 1},
    b = {2}: mean@4 = 4/12, pass@4 = 2/3, pass@2 = (1 - C(3,2)/C(4,2) + 0 + 1) / 3 = 0.5, and per file."""
    cfg = make_cfg(**{"eval.temperature": 0.6, "eval.n_samples": 4, "eval.pass_k": "[2]"})
    script = {100: [RIGHT, WRONG, WRONG, WRONG], 101: [WRONG], 102: [RIGHT, RIGHT, WRONG, RIGHT]}
    engine = ScriptedEngine(script, 12)
    files = {"a": [prompt(0, "7"), prompt(1, "7")], "b": [prompt(2, "7")]}
    out = on_loop(evaluate(engine, files, CharTokenizer(), RewardScorer(cfg.reward), cfg, 5))
    assert out["eval/mean@4"] == pytest.approx(4 / 12) and out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/pass@2"] == pytest.approx(0.5) and out["eval/prompts"] == 3
    assert (out["eval/a/mean@4"], out["eval/a/pass@4"], out["eval/a/pass@2"]) == pytest.approx((1 / 8, 0.5, 0.25))
    assert (out["eval/b/mean@4"], out["eval/b/pass@4"], out["eval/b/prompts"]) == pytest.approx((0.75, 1.0, 1.0))
    assert "eval/accuracy" not in out and "eval/a/greedy_accuracy" not in out
    seeds = [p.sampling_seed for call in engine.calls for p in call]
    assert len(set(seeds)) == 12 and all(p.temperature == 0.6 for call in engine.calls for p in call)
    with pytest.raises(ConfigError, match=r"eval.n_samples = 4 with eval.temperature = 0"):
        make_cfg(**{"eval.n_samples": 4})
    with pytest.raises(ConfigError, match=r"eval.pass_k\[0\] = 4: a k in \[1, eval.n_samples = 4\)"):
        make_cfg(**{"eval.temperature": 1.0, "eval.n_samples": 4, "eval.pass_k": "[4]"})


def test_loop_config_checks_name_the_key() -> None:
    with pytest.raises(ConfigError, match="data.train_path"):
        validate_run(load_config(None, ["model.hf_path=x"]), "train", world_size=1)
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        validate_run(make_cfg(**{"algorithm.name": "dapo"}), "train", world_size=1)  # 256 > max_new_tokens 12
    with pytest.raises(ConfigError, match="data.eval_path"):
        validate_run(make_cfg(**{"eval.every": 2}), "train", world_size=1)
    with pytest.raises(ConfigError, match="algorithm.ref_path = '/no/such/folder' is not a folder"):
        validate_run(
            make_cfg(**{"algorithm.kl_coef": 0.04, "algorithm.ref_path": "/no/such/folder"}), "train", world_size=1
        )
    with pytest.raises(ConfigError, match="routing_replay = 'r2' replays the routing recorded"):
        validate_run(
            make_cfg(**{"algorithm.routing_replay": "r2", "algorithm.old_logprob_source": "rollout"}),
            "train",
            world_size=1,
        )
    with pytest.raises(ConfigError, match="updates_per_step"):
        validate_run(make_cfg(**{"train.updates_per_step": 9}), "train", world_size=1)


def test_summarize_updates_reduces_each_key_by_its_kind() -> None:
    history = [
        {"approx_kl_mean": 0.0, "ratio_max": 1.5, "ratio_min": 0.9, "lr": 1e-3, "loss": 2.0},
        {"approx_kl_mean": 0.2, "ratio_max": 1.1, "ratio_min": 0.7, "lr": 2e-3, "loss": 4.0},
    ]
    out = summarize_updates(history)
    assert out == {
        "actor/approx_kl_mean": 0.1,
        "actor/ratio_max": 1.5,
        "actor/ratio_min": 0.7,
        "actor/lr": 2e-3,
        "actor/loss": 3.0,
        "actor/approx_kl_mean_first_update": 0.0,
        "actor/updates": 2.0,
    }


def test_logprob_gap_by_hand() -> None:
    out = logprob_gap(
        [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5])],
        [torch.tensor([-1.0, -1.5, 0.0]), torch.tensor([-1.0])],
        [torch.tensor([True, True, False]), torch.tensor([True])],  # an observation token: no engine log-prob
    )
    diffs = [0.0, -0.5, 0.5]
    assert out["logprob_gap/abs_mean"] == pytest.approx(1 / 3) and out["logprob_gap/abs_max"] == 0.5
    assert out["logprob_gap/kl_k3"] == pytest.approx(sum(math.expm1(d) - d for d in diffs) / 3)


def test_metrics_file_round_trip_and_truncation(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, enabled=True, total_steps=3, progress=False)
    for step in range(4):
        log.log({"step": step, "reward/mean": step / 2, "actor/grad_norm": float("nan") if step == 2 else 1.0})
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and math.isnan(records[2]["actor/grad_norm"])
    assert truncate_metrics(tmp_path, 1) == 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    MetricsLogger(tmp_path, enabled=False, total_steps=3).log({"step": 9})  # other ranks write nothing
    assert len(read_metrics(tmp_path)) == 2


def test_tensorboard_on_without_the_package_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorBoard is a tracker by default (logging.backends) but no dependency: without it nothing was written
    and nothing said. Now one warning at start names the package, how to install it and how to turn it off."""
    import sys

    from megatron_rl.config import LoggingConfig

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as without the package
    with caplog.at_level("WARNING", logger="megatron_rl.metrics.trackers"):
        log = MetricsLogger(tmp_path, enabled=True, total_steps=2, progress=False, tracking=LoggingConfig())
        log.log({"step": 1, "reward/mean": 0.5})
        log.log({"step": 2, "reward/mean": 0.7})
        log.close()
        off = LoggingConfig(backends=[])
        MetricsLogger(tmp_path / "off", enabled=True, total_steps=2, progress=False, tracking=off).close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "TensorBoard cannot be imported" in warnings[0] and "pip install tensorboard" in warnings[0]
    assert "leave it out of logging.backends" in warnings[0]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2] and not (tmp_path / "tensorboard").exists()


def test_loop_state_round_trip_latest_and_pruning(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    rng = capture_rng()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for step in (1, 2, 3):
        folder = checkpoint_dir(tmp_path, step)
        folder.mkdir()
        state = LoopState(step=step, entries={"sampler": {"position": step}}, rollout_seed=7, rng=rng)
        write_manifest(folder, step, {"loop_state.pt": save_loop_state(folder, state)})
    checkpoint_dir(tmp_path, 4).mkdir()  # a save that was killed half-way: no loop_state.pt
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    state = load_loop_state(latest_checkpoint(tmp_path))
    assert (state.step, state.entries, state.rollout_seed) == (3, {"sampler": {"position": 3}}, 7)
    restore_rng(state.rng)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path / "missing") is None


def test_kl_to_a_reference_and_r3_with_recomputed_old_logprobs_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    model = {"model.hf_path": tmp_path}
    for over in (
        {"algorithm.kl_coef": 0.04},  # GRPO's KL term (refused before the reference policy existed)
        {"algorithm.kl_coef": 0.04, "algorithm.kl_in_reward": True, "algorithm.kl_estimator": "k1"},
        {"algorithm.ref_kl_metrics": True, "algorithm.ref_path": str(tmp_path)},
        {
            "algorithm.routing_replay": "r3",
            "algorithm.old_logprob_source": "recompute",
            "algorithm.is_correction": "truncate",
            "rollout.return_routed_experts": True,
        },
    ):
        cfg = validate_run(make_cfg(**model, **over), "train", world_size=1)
        assert all(getattr(cfg.algorithm, k.split(".")[1]) == v for k, v in over.items() if k.startswith("algo"))
    spec = loss_spec(make_cfg(**{"algorithm.kl_coef": 0.04, "algorithm.kl_in_reward": True}).algorithm)
    assert spec.kl_coef == 0.0  # the KL is in the reward: the loss only reports it
    assert loss_spec(make_cfg(**{"algorithm.kl_coef": 0.04}).algorithm).kl_coef == 0.04
    assert preset("grpo").kl_coef == 0.0 and not uses_reference(preset("grpo"))


def test_reference_kl_and_kl_penalised_advantages_by_hand() -> None:
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.25, -3.0])]
    ref = [torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-0.25, -1.0])]
    masks = [torch.tensor([True, True, False]), torch.tensor([True, True])]
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731 - x = log pi_ref - log pi
    per_token = [[k3(-0.5), k3(1.0)], [k3(0.0), k3(2.0)]]  # the third token of sample 0 is masked out
    kl, metrics = reference_kl(old, ref, masks, "k3", 20.0)
    assert kl[0].tolist() == pytest.approx([*per_token[0], 0.0]) and kl[1].tolist() == pytest.approx(per_token[1])
    assert metrics["actor/kl_ref_mean"] == pytest.approx(sum(map(sum, per_token)) / 4)
    assert metrics["actor/kl_ref_max"] == pytest.approx(k3(2.0))
    k1, _ = reference_kl(old, ref, masks, "k1", 20.0)
    assert [float(k.sum()) for k in k1] == pytest.approx([0.5 - 1.0, -2.0])  # k1 = log pi - log pi_ref

    # kl_in_reward: group advantages of R - beta * KL; groups of 2 (n_samples_per_prompt), mean-only
    cfg = make_cfg(**{"rollout.n_samples_per_prompt": 2, "algorithm.kl_coef": 0.5, "algorithm.adv_norm_std": False})
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    kl = torch.tensor([0.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    adv, m = kl_penalized_advantages(cfg, rewards, kl)
    # group 1: R - 0.5 KL = [1, 0] -> [0.5, -0.5]; group 2: [-0.5, 0.5] -> [-0.5, 0.5]
    assert [float(a) for a in adv] == [0.5, -0.5, -0.5, 0.5]
    assert m["reward/kl_penalty_mean"] == pytest.approx(0.5 * 4 / 4)
    assert [float(a) for a in advantages_of(cfg, rewards)] == [0.0, 0.0, -0.5, 0.5]  # without the penalty
    with pytest.raises(ValueError, match="kl_sums has shape"):
        kl_penalized_advantages(cfg, rewards, kl[:3])
    # an agent episode of several sequences (episode 0: samples 0-2): its KL is their sum, its reward
    # theirs; every sequence gets its episode's advantage. Episodes: R - 0.5 KL = [1 - 1.5, 0 - 0.5]
    # (group 1) and [1 - 0.5, 1 - 0] (group 2) -> [0, 0], [-0.25, 0.25]
    episodes = torch.tensor([0, 0, 0, 1, 2, 3])
    seq_rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    seq_kl = torch.tensor([0.5, 1.0, 1.5, 1.0, 1.0, 0.0])
    adv, m = kl_penalized_advantages(cfg, seq_rewards, seq_kl, episodes)
    assert [float(a) for a in adv] == [0.0, 0.0, 0.0, 0.0, -0.25, 0.25]
    assert m["reward/kl_penalty_mean"] == pytest.approx(0.5 * (3.0 + 1.0 + 1.0 + 0.0) / 4)
    assert m["reward/kl_penalized_mean"] == pytest.approx((-0.5 - 0.5 + 0.5 + 1.0) / 4)


HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "vocab_size": 50,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_model_config_comes_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    cfg = load_config(None, [f"model.hf_path={tmp_path}", "model.num_layers=9", "model.recompute=true"])
    model = resolve_model(cfg).model
    assert (model.num_layers, model.hidden_size, model.num_experts, model.vocab_size) == (3, 64, 4, 50)
    assert model.recompute and model.params_dtype == "fp32"  # training choices stay the run's
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):
        resolve_model(load_config(None, [f"model.hf_path={tmp_path}", "parallel.expert_model_parallel_size=8"]))


def test_plot_writes_a_png_per_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from megatron_rl.metrics.plot import plot_run

    log = MetricsLogger(tmp_path, enabled=True, total_steps=3, progress=False)
    log.log({"step": 0, "eval/greedy_accuracy": 0.1}, advance=False)
    for step in (1, 2, 3):
        log.log({"step": step, "reward/mean": step, "reward/accuracy": step / 4, "time/generate": 0.5})
    log.close()
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["accuracy.png", "overview.png", "reward.png", "stage_times.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_kl_in_the_reward_takes_k3_clamped_to_10_per_token() -> None:
    # x = log pi_ref - log pi_old = 7.5 on token 0 (1799.54 unclamped), 0.5 on token 1 (e^0.5 - 1.5)
    kl, metrics = reference_kl([torch.tensor([-8.0, -1.0])], [torch.tensor([-0.5, -0.5])],
                               [torch.tensor([True, True])], "k3", 20.0)  # fmt: skip
    assert kl[0].tolist() == pytest.approx([10.0, math.exp(0.5) - 1.5], abs=1e-12)
    assert metrics["actor/kl_ref_max"] == 10.0


# ---- the weight version across a resume (the loop state holds it) ----
class VersionRecordingDriver:
    """Rank 0's driver for `Trainer.run`: step `step`'s batch is trained (a stand-in object) when `step`
    is in `trained`, else empty (a skipped step); records the version each step starts from."""

    def __init__(self, trained: set[int]) -> None:
        self.trained = trained
        self.versions: dict[int, int] = {}
        self.data = type("Data", (), {"sampler": PromptSampler(list(range(10)), seed=1)})()

    def collect(self, step: int, version: int):
        from megatron_rl.loop.collect import StepBatch

        self.versions[step] = version
        return StepBatch(object() if step in self.trained else None, {"time/wait_batch": 0.0})

    def finish_step(self) -> dict[str, float]:
        return {"time/wait_batch": 0.0, "time/engine_idle": 0.0}

    def checkpoint_state(self):
        import contextlib

        return contextlib.nullcontext(b"")

    def load_state_dict(self, state: bytes) -> None:
        pass


class LabelRecordingSync:
    def __init__(self) -> None:
        self.labels: list[str] = []

    def sync(self, version: str):
        self.labels.append(version)
        return type("Report", (), {"seconds": 0.0, "bytes": 0})()


class FileActor:
    def save(self, path: Path) -> dict[str, str]:
        path.mkdir(parents=True)
        (path / "common.pt").write_bytes(b"weights")
        return {}  # no shard hashed while written: the run folder hashes common.pt itself


def _run_trainer(cfg: Config, trained: set[int], *, resume: bool) -> tuple[Any, VersionRecordingDriver, Any]:
    from megatron_rl.run_folder import RunFolder
    from megatron_rl.trainer import Trainer

    run_folder = RunFolder(cfg, rank=0, resume=resume)
    driver, sync = VersionRecordingDriver(trained), LabelRecordingSync()
    log = run_folder.open_log(desc="rl")
    trainer = Trainer(cfg, run_folder, FileActor(), log, sync, driver)  # type: ignore[arg-type]
    run_folder.restore(trainer)  # as `Trainer.start` does
    trainer._update = lambda step_batch, step: {}  # the actor's update is not what is tested
    try:
        trainer.run()
    finally:
        log.close()
    return trainer, driver, sync


def test_resume_from_the_checkpoint_of_a_skipped_step_keeps_the_weight_version(tmp_path: Path) -> None:
    import torch.distributed as dist

    def cfg(steps: int) -> Config:
        over = {"logging.run_dir": str(tmp_path / "run"), "train.steps": steps, "checkpoint.every": 1}
        return make_cfg(**over, **{"checkpoint.export_hf": False, "logging.backends": []})

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        # step 1 trains (the engine then serves version 1); steps 2 and 3 are skipped (no informative group)
        _, first, sync = _run_trainer(cfg(3), {1}, resume=False)
        assert first.versions == {1: 0, 2: 1, 3: 1} and sync.labels == ["1"]
        assert load_loop_state(checkpoint_dir(tmp_path / "run" / "checkpoints", 3)).entries["weight_version"] == 1
        # resumed from step 3's checkpoint: version 1, as the uninterrupted run (which would say 1 at step 4)
        trainer, resumed, sync = _run_trainer(cfg(5), {5}, resume=True)
        assert resumed.versions == {4: 1, 5: 1} and sync.labels == ["5"] and trainer.version == 5
    finally:
        dist.destroy_process_group()


def test_a_loop_state_of_format_1_is_read_as_named_entries(tmp_path: Path) -> None:
    """Before named entries, the sampler, the rollout state and the weight version were fields of their
    own; a checkpoint written before the version was kept resumes at its step's version."""
    fields = {"step": 5, "rollout_seed": 0, "async_mode": None, "rng": capture_rng(), "format_version": 1}
    for saved_version, resumed_version in ((None, 5), (3, 3)):
        old = {**fields, "sampler": {"position": 5}, "rollout": None, "weight_version": saved_version}
        torch.save(old, tmp_path / "loop_state.pt")
        state = load_loop_state(tmp_path)
        assert state.entries == {"sampler": {"position": 5}, "rollout": None, "weight_version": resumed_version}
        assert (state.step, state.format_version) == (5, 2)


def test_reward_failures_above_the_fraction_stop_the_step_naming_the_source(caplog: pytest.LogCaptureFixture) -> None:
    def rule(response: str, answer: str) -> float:
        if "x" in response:
            raise ValueError("x is not allowed")
        return 1.0

    def run(max_failure_frac: float, script: dict[int, list[str]]):
        cfg = make_cfg(**{"reward.type": "custom", "reward.custom_function": "mod:fn"})
        cfg.reward.max_failure_frac = max_failure_frac
        engine = ScriptedEngine(script, cfg.rollout.max_new_tokens)
        sampler = PromptSampler([prompt(0, "1"), prompt(1, "1")], shuffle=False)
        col = RolloutCollector(cfg, engine, CharTokenizer(), RewardScorer(cfg.reward, rule=rule), sampler)
        return on_loop(col.collect(step=4)), col

    # 2 of 8 (25%) above 0.2: the step stops with one line naming the function and the first failure
    with pytest.raises(RewardFailureError) as err:
        run(0.2, {100: ["ab"], 101: ["x", "b"]})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("step 4: 2 of 8 rewards failed (25%, above reward.max_failure_frac = 0.2)")
    assert "reward.custom_function = 'mod:fn'; first: response 4: ValueError: x is not allowed" in message
    # at the fraction: the failed group is left out, the other trained, and this step's failures reported
    with caplog.at_level("WARNING", logger="megatron_rl.loop.collect"):
        step_batch, col = run(0.25, {100: ["ab"], 101: ["x", "b"]})
        step_batch, col = run(0.25, {100: ["ab"], 101: ["x", "b"]})  # again: each step warns, not only the first
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all(
        "step 4: 2 of 8 rewards failed" in w and "1 group(s) left out" in w for w in warnings
    )
    assert (step_batch.metrics["reward/failures"], step_batch.metrics["groups/reward_failed"]) == (2.0, 1.0)
    assert len(step_batch.batch) == 4 and all(int(t[0]) == 100 for t in step_batch.batch.tokens)
    # every group failed under a lenient fraction: nothing is trained on (no made-up reward)
    step_batch, _ = run(1.0, {100: ["x"], 101: ["x"]})
    assert step_batch.batch is None and step_batch.metrics["groups/reward_failed"] == 2.0
    # an evaluation whose rewards fail stops the same way
    cfg = make_cfg(**{"reward.type": "custom", "reward.custom_function": "mod:fn"})
    engine = ScriptedEngine({100: ["x"], 101: ["b"]}, 12)
    with pytest.raises(RewardFailureError, match=r"the evaluation at step 5: 1 of 2 rewards failed"):
        on_loop(
            evaluate(
                engine, [prompt(0, "1"), prompt(1, "1")], CharTokenizer(), RewardScorer(cfg.reward, rule=rule), cfg, 5
            )
        )

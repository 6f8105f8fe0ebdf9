"""End to end: `megatron-rl train` with the local engine on the tiny_math model (2 trainer ranks, EP=2).

- lr 0 with GRPO's KL term and R3 + recomputed old log-probs + truncated IS: the KL to the frozen
  reference is exactly 0, the IS weight 1 (<= 1e-4); the first update's KL(old || new) is 0, the engine's and the trainer's log-probs agree
  (<= 1e-4) before and after a weight sync, the exported HF folder holds the starting weights, bad
  data rows and reward failures are counted (a failed response's group is not trained on), the
  engine is gone after the run.
- kill -9 during a step after a checkpoint, `--resume` (PPO: a critic and GAE, with a KL penalty in the
  reward): the metrics, the critic's included, equal an uninterrupted run's, the reference is the start
  policy in both, the KL to it grows, the critic's checkpoint is part of the run's.
- dynamic sampling on a task the policy always fails stops at the round limit with the warning
  metric; mid-run the engine refuses a request without the run's generated key (401), a key found
  on no command line, in no config.yaml or log; SIGTERM to torchrun and a terminal's Ctrl-C under
  `python -m megatron_rl.torchrun` (exit 130, one line) end the run with no process left.

The policy is the example's randomly initialised tiny Qwen3-MoE; a custom reward (the share of
digits in the response, failing on prompts with an odd answer: 3 of the 8, so every step trains on
a group, with `reward.max_failure_frac` = 1) gives varied rewards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from mrl_runs import (
    BAD_ROWS,
    GOOD_ROWS,
    RESUME_RUN,
    RunCache,
    assert_resume_matches,
    command,
    descendants,
    kill_after_checkpoint,
    leftovers,
    no_leftovers,
    start,
    steps_logged,
    train,
    wait_ended,
    wait_for,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def test_frozen_policy_first_kl_zero_logprob_gap_counts_and_export(work: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "lr0"
    # GRPO's KL term to the frozen reference (the start policy): at lr 0 the KL is exactly 0. R3 with
    # recomputed old log-probs: the actor and the reference replay the engine's routing, and the
    # importance weight pi_old / pi_rollout is 1 up to the engine/trainer numerics
    kl_r3 = (
        "algorithm.kl_coef=0.04",
        "algorithm.routing_replay=r3",
        "rollout.return_routed_experts=true",
        "algorithm.old_logprob_source=recompute",
        "algorithm.is_correction=truncate",
    )
    records = train(work, run_dir, "train.lr=0", "checkpoint.every=0", *kl_r3)
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [0, 1, 2]
    for step in (1, 2):  # step 2 generates after a weight sync of the unchanged weights
        r = by_step[step]
        assert r["actor/approx_kl_mean_first_update"] == 0.0 and r["actor/lr"] == 0.0
        assert r["actor/kl_ref_mean"] == r["actor/kl_ref_max"] == 0.0  # pi_old vs pi_ref, before the update
        assert r["actor/ref_kl_mean"] == r["actor/kl_loss"] == 0.0  # in the update's loss
        assert r["time/ref_logprobs"] > 0.0
        assert abs(r["actor/is_weight_mean"] - 1.0) <= 1e-4 and "actor/routing_changed_frac" in r  # replayed
        assert r["logprob_gap/abs_max"] <= 1e-4, r["logprob_gap/abs_max"]
        # the batch scattered as tensors: rank 1 is the one receiver (its R3 routing as uint8)
        assert r["actor/batch_bytes_per_rank"] == r["actor/batch_bytes_sent"] > 0 and r["time/batch_scatter"] >= 0
        # the groups of odd answers are left out: the trained tokens are the other groups'
        assert (
            r["groups/groups_used"] + r["groups/reward_failed"] == 4
            and r["reward/failures"] == 4 * r["groups/reward_failed"]
        )
        assert (r["actor/tokens"] < r["response/tokens"]) == (r["groups/reward_failed"] > 0)
        assert r["data/train_rows_kept"] == GOOD_ROWS and r["data/train_rows_skipped"] == sum(BAD_ROWS.values())
        assert all(r[f"data/train_skipped_{reason}"] == n for reason, n in BAD_ROWS.items())
    failures = by_step[1]["reward/failures"] + by_step[2]["reward/failures"]
    assert failures == 4 * int((work / "odd_answers").read_text())  # every response to an odd answer
    assert by_step[2]["eval/greedy_accuracy"] == by_step[0]["eval/greedy_accuracy"]
    assert by_step[2]["eval/length_mean"] == by_step[0]["eval/length_mean"]
    exported, start_weights = (
        load_file(run_dir / "hf" / "model.safetensors"),
        load_file(work / "model" / "model.safetensors"),
    )
    assert sorted(exported) == sorted(start_weights)
    assert all(torch.equal(exported[k], start_weights[k]) for k in start_weights)  # lr 0: nothing moved
    assert leftovers(work) == []
    from megatron_rl.metrics.plot import plot_run

    assert (run_dir / "plots" / "overview.png") in plot_run(run_dir)


def test_kill_after_a_checkpoint_then_resume_matches_an_uninterrupted_run(
    work: Path, straight_runs: RunCache, tmp_path: Path
) -> None:
    """PPO with a KL penalty in the reward: the resumed run's reference is the start policy, as the
    uninterrupted run's (a reference taken from the checkpoint would read KL 0 at step 3), and its critic the
    checkpoint's (a fresh critic would give other values, returns and advantages at step 3)."""
    run_dir = tmp_path / "killed"
    # kill -9 every process of the run after step 2's checkpoint
    kill_after_checkpoint(work, run_dir, *RESUME_RUN, step=2)
    assert len(steps_logged(run_dir)) == 2
    assert (run_dir / "checkpoints" / "step_000002" / "critic" / ".metadata").is_file()
    reference, _ = assert_resume_matches(straight_runs, work, run_dir, *RESUME_RUN)
    assert reference[-1]["actor/approx_kl_mean"] > 0.0  # the second update moved the policy: not vacuous
    kl_ref = [r["actor/kl_ref_mean"] for r in reference]
    assert kl_ref[0] == 0.0 < kl_ref[1] < kl_ref[2], kl_ref  # pi_old moves away from the reference
    assert reference[-1]["reward/kl_penalty_mean"] > 0.0 and reference[0]["reward/kl_penalty_mean"] == 0.0
    assert "actor/kl_loss" in reference[0] and reference[0]["actor/kl_loss"] == 0.0  # in the reward, not the loss
    # the critic trained every step: its values moved (the fresh head's are near 0) and its loss is finite
    assert all(r["critic/updates"] == 2.0 and r["critic/vf_loss"] > 0.0 for r in reference)
    assert reference[0]["critic/values_mean"] != reference[2]["critic/values_mean"]
    assert leftovers(work) == []


def test_packed_micro_batches_train_the_first_step_as_the_padded_ones(
    work: Path, straight_runs: RunCache, tmp_path: Path
) -> None:
    """train.micro_batch_tokens: the same seed's run with packed micro-batches (balanced over the 2 DP
    ranks) trains step 1 (the same samples) to the loss and gradient norm of the right-padded run, the
    actor's and the critic's. The
    packed run stops after step 1: at a constant learning rate step 1 does not depend on train.steps."""
    padded = straight_runs.records(work, *RESUME_RUN)[0]
    packed_run = train(work, tmp_path / "packed", *RESUME_RUN, "train.micro_batch_tokens=40", "train.steps=1")
    assert [r["step"] for r in packed_run] == [1] and padded["step"] == 1
    packed = packed_run[0]
    assert packed["reward/mean"] == padded["reward/mean"]
    assert packed["actor/micro_batches"] > padded["actor/micro_batches"]  # other micro-batches, not the same ones
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy_mean", "critic/vf_loss", "critic/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5), key  # measured: <= 2.1e-6


ALL_WRONG = (
    "algorithm.name=dapo",
    "algorithm.overlong_buffer_len=4",
    "algorithm.max_gen_rounds=2",
    "reward.type=dapo",  # the untrained policy never writes "Answer: <right number>"
    "reward.custom_function=null",  # the shared config's custom reward would imply reward.type=custom
    "train.steps=50",
    "eval.every=0",
    "checkpoint.every=0",
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_all_wrong_task_stops_at_the_round_limit_and_a_signal_leaves_no_process(
    work: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM to torchrun's agent (a scheduler's stop); Ctrl-C in a terminal (SIGINT to the launcher's
    process group, which torchrun passes on to every rank's group: the reward workers included) under
    `python -m megatron_rl.torchrun`: exit code 130 and one line, no traceback."""
    run_dir = tmp_path / "all_wrong"
    log = tmp_path / "all_wrong.log"
    launcher = "torchrun" if sig == signal.SIGTERM else "megatron_rl.torchrun"
    process = start(command(work, run_dir, *ALL_WRONG, ranks=2, launcher=launcher), log)
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, process, log)
    first = steps_logged(run_dir)[0]
    assert (first["groups/rounds"], first["groups/target_missed"], first["groups/groups_used"]) == (2.0, 1.0, 0.0)
    assert (first["groups/groups_generated"], first["reward/accuracy"], first["actor/skipped"]) == (8.0, 0.0, 1.0)
    assert any("serve" in p.cmdline() for p in descendants(process.pid))  # the engine runs
    _engine_refuses_strangers(work, process, run_dir)
    os.killpg(process.pid, sig)  # the launcher's process group, as a terminal's Ctrl-C
    # SIGTERM finishes the step and saves it; the engine handle's close alone may take 80 s (its timeouts)
    text = wait_ended(process, log, f"stop on {sig.name}")
    assert process.returncode != 0
    assert "dynamic sampling kept 0 informative groups of 4 in 2 rounds" in text
    if sig == signal.SIGINT:  # Ctrl-C: a quiet exit, one line and no traceback
        assert process.returncode == 130, text[-3000:]
        assert text.count("train: interrupted (SIGINT): stopped at once, nothing saved") == 1, text[-3000:]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert "could not be written" not in text, text[-3000:]
    no_leftovers(work)


def _engine_refuses_strangers(work: Path, process: subprocess.Popen, run_dir: Path) -> None:
    """Mid-run, the engine the run started wants the run's own key: an unauthenticated POST
    /update_weights_from_disk (which once trained the next step on a stranger's weights) gets 401.
    The key is on no command line and not in config.yaml, engine.log or the run's output."""
    (engine,) = [p for p in descendants(process.pid) if "serve" in p.cmdline()]
    key = engine.environ()["MEGATRON_RL_ENGINE_API_KEY"]
    port = next(c.laddr.port for c in engine.net_connections("tcp") if c.status == psutil.CONN_LISTEN)

    def status(path: str, headers: dict, body: dict | None = None) -> int:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code

    stranger = {"model_path": str(work / "model")}
    assert status("/update_weights_from_disk", {"Content-Type": "application/json"}, stranger) == 401
    assert status("/get_model_info", {"Authorization": f"Bearer {key}"}) == 200  # the key found is the one it wants
    assert len(key) >= 32
    assert not [p.pid for p in [psutil.Process(process.pid), *descendants(process.pid)] if key in " ".join(p.cmdline())]
    for name in ("config.yaml", "engine.log"):
        assert key not in (run_dir / name).read_text(), name
    assert key not in run_dir.with_suffix(".log").read_text()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_engine_outlives_no_killed_parent(work: Path) -> None:
    """kill -9 runs no clean-up: the engine's parent-death signal is what ends it then."""
    script = (
        "import sys, time\n"
        "from megatron_rl.rollout.local.launcher import start_local_engine\n"
        "print(start_local_engine(sys.argv[1], extra_args=['--no-auth']).process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(work / "model")], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        engine = int(parent.stdout.readline())
        assert _alive(engine)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not _alive(engine), 60, f"the engine {engine} to exit after its parent's kill -9")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)

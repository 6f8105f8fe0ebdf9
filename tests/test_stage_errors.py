"""How `megatron-rl train`/`sft` end on a run error raised on every rank, and on Ctrl-C: one line from
rank 0 (none from the others), no traceback, a non-zero exit code (1; 130 after SIGINT) on every rank."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_rl.checkpoints import CheckpointWriteError
from megatron_rl.commands import sft as sft_command
from megatron_rl.commands import train as train_command
from megatron_rl.config import ModelConfig
from megatron_rl.envs.episodes import EnvRewardError
from megatron_rl.envs.failures import EnvStartError, EpisodeFailureError
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.parallel.rank0 import RankZeroError
from megatron_rl.rewards import RewardFailureError
from megatron_rl.run_folder import RunFolderError
from megatron_rl.trainer import LogprobGapError

GAP = "the engine's log-probs differ from the trainer's by 0.3 per token on average"


@pytest.fixture
def run_config(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig(num_experts=4))))
    run = {
        "model": {"hf_path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "logging": {"run_dir": str(tmp_path / "run")},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(run))
    return tmp_path / "run.yaml"


@pytest.fixture
def launched_as(monkeypatch: pytest.MonkeyPatch):
    """Set this process's launch variables to rank `rank` of 2; the stop-signal handlers the stage installs
    are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}

    def launch(rank: int) -> None:
        env = {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))

    yield launch
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _run(command, run_config: Path) -> int:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args([str(run_config)]))


@pytest.mark.parametrize("rank", [0, 1])
# (rank 0's error, the other ranks'): the gap is found by every rank; a reward failure reaches the
# others through on_rank0 as RankZeroError
@pytest.mark.parametrize(
    "errors",
    [
        (LogprobGapError, LogprobGapError),
        (RewardFailureError, RankZeroError),
        # the rollout's own stops (issue 34: a traceback before): failed episodes, a NaN turn reward, a start
        (EpisodeFailureError, RankZeroError),
        (EnvRewardError, RankZeroError),
        (EnvStartError, RankZeroError),
    ],
)
def test_a_run_stop_ends_train_with_one_error_line_from_rank_0(
    rank: int,
    errors: tuple[type[Exception], type[Exception]],
    run_config: Path,
    launched_as,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def stop(cfg, *, resume: bool, force: bool) -> None:
        raise errors[0](GAP) if rank == 0 else errors[1](GAP)

    monkeypatch.setattr("megatron_rl.trainer.run_training", stop)
    launched_as(rank)
    assert _run(train_command, run_config) == 1
    err = capsys.readouterr().err
    assert err == (f"train: error: {GAP}\n" if rank == 0 else "")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("command", [train_command, sft_command])
def test_ctrl_c_is_a_quiet_exit_130_on_every_rank(
    rank: int,
    command,
    run_config: Path,
    launched_as,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def interrupted(cfg, *, resume: bool, force: bool) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("megatron_rl.trainer.run_training", interrupted)
    monkeypatch.setattr("megatron_rl.sft.stage.run_sft", interrupted)
    launched_as(rank)
    name = "train" if command is train_command else "sft"
    assert _run(command, run_config) == 130
    err = capsys.readouterr().err
    assert err == (f"{name}: interrupted (SIGINT): stopped at once, nothing saved\n" if rank == 0 else "")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("command", [train_command, sft_command])
def test_a_run_folder_lost_mid_run_ends_either_stage_with_one_error_line_from_rank_0(
    rank: int,
    command,
    run_config: Path,
    launched_as,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`RunFolder.check_lock` raises on every rank alike (tests/test_checkpoint_integrity.py shows when)."""
    lost = "RUN_DIR/.run.lock was removed while this run (pid 7) held it: stopped before the record of step 3"

    def stop(cfg, *, resume: bool, force: bool) -> None:
        raise RunFolderError(lost)

    monkeypatch.setattr("megatron_rl.trainer.run_training", stop)
    monkeypatch.setattr("megatron_rl.sft.stage.run_sft", stop)
    launched_as(rank)
    name = "train" if command is train_command else "sft"
    assert _run(command, run_config) == 1
    assert capsys.readouterr().err == (f"{name}: error: {lost}\n" if rank == 0 else "")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(
    "echo",
    [
        # a distributed save whose KeyboardInterrupt torch.distributed.checkpoint turns into a failed write
        CheckpointWriteError("ckpt/step_000003.tmp: the checkpoint could not be written (KeyboardInterrupt: )"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
    ],
)
def test_an_error_after_ctrl_c_is_the_interruption(
    rank: int,
    echo: Exception,
    run_config: Path,
    launched_as,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGINT reaches every rank (a terminal's Ctrl-C, torchrun passing it on); what a rank then ends with
    (a save cut short, a collective whose peer already stopped) is the interruption: exit 130, no other line."""

    def interrupted_then_failed(cfg, *, resume: bool, force: bool) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler the stage installed runs here
            time.sleep(5)
        except KeyboardInterrupt:
            raise echo from None

    monkeypatch.setattr("megatron_rl.trainer.run_training", interrupted_then_failed)
    monkeypatch.setattr("megatron_rl.parallel.signals._INTERRUPTED", [], raising=False)  # Ctrl-C not seen yet
    launched_as(rank)
    assert _run(train_command, run_config) == 130
    assert capsys.readouterr().err == (
        "train: interrupted (SIGINT): stopped at once, nothing saved\n" if rank == 0 else ""
    )

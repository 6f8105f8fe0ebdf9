"""The one `Stage` of the RL and SFT stages (megatron_rl/stage.py): its loop's order and schedules, one
validation per launch, and the launch's one teardown of torch.distributed."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from megatron_rl.commands import sft as sft_command
from megatron_rl.commands import train as train_command
from megatron_rl.config import Config, ModelConfig, load_config
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.stage import Stage


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
def world_of_this_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The launch variables of a world of one; the signal handlers a stage installs put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
    for name, value in {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_PORT", "1")
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("command", [train_command, sft_command])
def test_a_launch_validates_its_config_once(
    command, run_config: Path, world_of_this_process: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The command line and the stage both validated before (the model read twice from its config.json)."""
    from megatron_rl import validation

    resolved: list[str] = []
    resolve = validation.resolve_model

    def counted(cfg: Config) -> Config:
        resolved.append(str(cfg.model.hf_path))
        return resolve(cfg)

    monkeypatch.setattr(validation, "resolve_model", counted)
    run_dir = run_config.parent / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # a run it refuses, right after validation
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args([str(run_config)])) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert len(resolved) == 1, resolved


@pytest.mark.parametrize("stage", ["train", "sft"])
def test_a_stage_that_fails_after_distributed_started_tears_it_down(
    stage: str, run_config: Path, world_of_this_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The SFT stage left torch.distributed running when a piece failed before its teardown was registered
    (the command line's `finally` stopped it; a stage launched from Python kept it)."""
    from megatron_rl import run_folder, trainer
    from megatron_rl.sft import stage as sft_stage

    def starts_distributed_then_fails(*args: Any, **kwargs: Any) -> None:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        raise RuntimeError("a piece failed to start")

    monkeypatch.setattr(run_folder, "RunFolder", starts_distributed_then_fails)
    monkeypatch.setattr(trainer, "RunFolder", starts_distributed_then_fails)
    launch = trainer.run_training if stage == "train" else sft_stage.run_sft
    with pytest.raises(RuntimeError, match="a piece failed to start"):
        launch(load_config(run_config))
    assert not dist.is_initialized()


@pytest.mark.parametrize("stage", ["train", "sft"])
def test_train_epochs_gives_the_run_folder_and_what_follows_the_derived_steps(
    stage: str, run_config: Path, world_of_this_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """train.epochs = 3 over the 10 rows of train.jsonl, 4 a step: 8 steps, in the configuration every piece from
    the run folder on is given (its resume, the step log's progress and ETA, the actor's learning-rate schedule)."""
    from megatron_rl import run_folder, trainer
    from megatron_rl.sft.stage import SFTStage
    from megatron_rl.validation import validate_run

    import tiny_tokenizer

    tiny_tokenizer.build_tokenizer(tmp_path / "tok")
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "response": f"Answer: {i + 1}"} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = ["train.epochs=3", "train.prompts_per_step=4", "data.answer_key=answer"]
    cfg = validate_run(load_config(run_config, [*overrides, f"data.tokenizer_path={tmp_path / 'tok'}"]), stage)
    assert cfg.train.steps is None
    given: list[Config] = []

    def stop_at_the_run_folder(cfg: Config, **kwargs: Any) -> None:
        given.append(cfg)
        raise RuntimeError("stopped at the run folder")

    monkeypatch.setattr(run_folder, "RunFolder", stop_at_the_run_folder)
    monkeypatch.setattr(trainer, "RunFolder", stop_at_the_run_folder)
    with pytest.raises(RuntimeError, match="stopped at the run folder"), contextlib.ExitStack() as stack:
        (trainer.Trainer if stage == "train" else SFTStage).start(cfg, stack, resume=False, force=False)
    assert (given[0].train.steps, given[0].train.epochs) == (8, 0)


# ---- the loop ----
class Recorder:
    """The run folder and the step log of `ToyStage`: what the loop asks of them, in order."""

    def __init__(self, calls: list[str], start_step: int) -> None:
        self.calls = calls
        self.start_step = start_step

    def save_checkpoint(self, actor: object, step: int, entries: dict[str, Any], models: dict | None = None) -> Path:
        self.calls.append(f"save {step} {entries}")
        return Path(f"ckpt/step_{step}")

    def log(self, record: dict[str, Any], *, advance: bool = True) -> None:
        self.calls.append(f"log {record['step']}" + ("" if advance else " (no step)"))

    def message(self, text: str) -> None:
        self.calls.append(text)


class ToyStage(Stage):
    command = "sft"
    evaluates_first = True

    def __init__(self, cfg: Config, calls: list[str], start_step: int = 0) -> None:
        recorder = Recorder(calls, start_step)
        super().__init__(cfg, recorder, object(), recorder)  # type: ignore[arg-type]
        self.calls = calls

    @classmethod
    def start(cls, cfg: Config, stack: contextlib.ExitStack, *, resume: Any, force: bool) -> ToyStage:
        raise NotImplementedError  # the loop is what is tested

    def step(self, step: int) -> dict[str, Any]:
        self.calls.append(f"step {step}")
        return {"step": step}

    def evaluate(self, step: int) -> dict[str, float]:
        self.calls.append(f"eval {step}")
        return {"eval/accuracy": 1.0}

    def state_dict(self) -> dict[str, Any]:
        return {"position": len(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def holding_still(self) -> Iterator[None]:
        self.calls.append("hold")
        yield
        self.calls.append("release")

    def on_stop(self, stop_request: Any) -> None:
        self.calls.append("on_stop")

    def finish(self) -> None:
        self.calls.append("finish")


class StopAfter:
    """A stop request every rank agrees on after step `step` (SIGUSR1)."""

    def __init__(self, calls: list[str], step: int) -> None:
        self.calls, self.step = calls, step

    def agreed(self) -> int:
        return signal.SIGUSR1 if f"step {self.step}" in self.calls else 0


def test_the_loop_evaluates_logs_then_checkpoints_on_schedule() -> None:
    cfg = load_config(None, ["train.steps=5", "eval.every=2", "checkpoint.every=3"])
    calls: list[str] = []
    record = ToyStage(cfg, calls).run()
    assert calls == [
        "eval 0", "log 0 (no step)",
        "step 1", "log 1",
        "step 2", "eval 2", "log 2",
        "step 3", "log 3", "hold", "save 3 {'position': 10}", "release",
        "step 4", "eval 4", "log 4",
        "step 5", "eval 5", "log 5", "hold", "save 5 {'position': 19}", "release",
        "finish",
    ]  # fmt: skip
    assert record["eval/accuracy"] == 1.0 and "time/checkpoint" not in record and record["time/elapsed"] >= 0


def test_a_stop_signal_ends_the_loop_after_the_step_with_its_checkpoint() -> None:
    cfg = load_config(None, ["train.steps=5", "checkpoint.every=0"])
    calls: list[str] = []
    stage = ToyStage(cfg, calls, start_step=1)
    stage.run(StopAfter(calls, 3))  # type: ignore[arg-type]
    assert calls[:6] == ["on_stop", "step 2", "log 2", "step 3", "log 3", "hold"]
    assert calls[-2:] == [
        "release",
        "SIGUSR1: stopped after step 3 of 5; checkpoint ckpt/step_3; continue with --resume",
    ]
    assert stage.stopped_by == signal.SIGUSR1 and "finish" not in calls
    # a signal during the start-up: stopped before the next step, nothing saved
    calls.clear()
    stage = ToyStage(cfg, calls, start_step=1)
    stage.run(type("Stopped", (), {"agreed": lambda self: signal.SIGTERM})())  # type: ignore[arg-type]
    assert calls == ["on_stop", "SIGTERM: stopped before step 2"] and stage.stopped_by == signal.SIGTERM


def test_resuming_a_finished_run_says_so_and_trains_nothing() -> None:
    cfg = load_config(None, ["train.steps=5", "eval.every=2"])
    calls: list[str] = []
    assert ToyStage(cfg, calls, start_step=5).run() == {}
    assert calls == [
        "the run is already at step 5 of train.steps = 5: no step left to train (raise train.steps to train on)",
        "finish",
    ]

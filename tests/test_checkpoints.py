"""The run folder and its checkpoints (`megatron_rl.run_folder`, `megatron_rl.checkpoints`): no run overwritten, atomic
checkpoints with a manifest, resume past a damaged one, the writable check at start-up.

The save path runs for real in a gloo world of one, with an actor whose `save` writes shard files
the way a distributed checkpoint does (several files in `actor/`); resuming `megatron-rl sft` past a
truncated Megatron shard is shown on tests/test_sft.py's resume run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoints import (
    ACTOR_DIR,
    LOOP_STATE_FILE,
    MANIFEST_FILE,
    checkpoint_dir,
    prune_checkpoints,
    resume_point,
)
from megatron_rl.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
)
from megatron_rl.data import PromptSampler
from megatron_rl.metrics import read_metrics
from megatron_rl.run_folder import LOCK_FILE, RunFolder

import mrl_configs

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_math"


def config(run_dir: Path, *, ckpt_dir: Path | None = None, keep_last: int = 10, **model: object) -> Config:
    return Config(
        model=ModelConfig(**model),
        logging=LoggingConfig(run_dir=str(run_dir)),
        checkpoint=CheckpointConfig(dir=str(ckpt_dir) if ckpt_dir else None, keep_last=keep_last),
    )


# ---- no run is overwritten ----


@pytest.mark.parametrize("left", ["metrics.jsonl", "hf/", "checkpoints/step_000002/", "checkpoints/step_000003.tmp/"])
def test_a_fresh_run_into_a_folder_holding_a_run_is_refused_naming_both_options(tmp_path: Path, left: str) -> None:
    run_dir = tmp_path / "run"
    (run_dir / left).parent.mkdir(parents=True, exist_ok=True)
    if left.endswith("/"):
        (run_dir / left).mkdir()
    else:
        (run_dir / left).write_text('{"step": 1}\n')
    left = left.rstrip("/")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    with pytest.raises(ConfigError, match=r"already holds a run .*--resume.*--force") as err:
        RunFolder(config(run_dir), rank=0, resume=False)
    assert str(run_dir / left) in str(err.value) and f"{run_dir}.old-1" in str(err.value)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # nothing touched


def test_a_folder_without_a_run_is_used_as_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "engine.log").write_text("a run that failed before its first step\n")
    folder = RunFolder(config(run_dir), rank=0, resume=False)
    assert folder.moved_aside == [] and (run_dir / "engine.log").is_file()
    assert (run_dir / "checkpoints").is_dir()  # created by the writable check
    RunFolder(config(tmp_path / "new"), rank=0, resume=False)


def test_force_moves_the_old_run_aside_and_deletes_nothing(tmp_path: Path) -> None:
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpts"
    for n in (1, 2):
        (run_dir / "hf").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": n}) + "\n")
        (ckpt_dir / "step_000001").mkdir(parents=True)
        (ckpt_dir / "step_000001" / LOOP_STATE_FILE).write_text(f"run {n}")
        folder = RunFolder(config(run_dir, ckpt_dir=ckpt_dir), rank=0, resume=False, force=True)
        moved = {(run_dir, tmp_path / f"run.old-{n}"), (ckpt_dir, tmp_path / f"ckpts.old-{n}")}
        assert set(folder.moved_aside) == moved
        assert read_metrics(tmp_path / f"run.old-{n}") == [{"step": n}]
        assert (tmp_path / f"ckpts.old-{n}" / "step_000001" / LOOP_STATE_FILE).read_text() == f"run {n}"
        assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE] and list(ckpt_dir.iterdir()) == []  # fresh, locked
    # another rank sees the same folder and decides the same, but only rank 0 moves it
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert RunFolder(config(run_dir, ckpt_dir=ckpt_dir), rank=1, resume=False, force=True).moved_aside == []
    assert (run_dir / "metrics.jsonl").is_file()


def test_force_refuses_to_move_the_folder_the_run_reads_its_model_from(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "hf").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"model.hf_path = .* is inside it"):
        RunFolder(config(run_dir, hf_path=str(run_dir / "hf")), rank=0, resume=False, force=True)
    assert (run_dir / "hf").is_dir()
    with pytest.raises(ConfigError, match="pass one"):
        RunFolder(config(run_dir), rank=0, resume=True, force=True)


@pytest.mark.e2e
def test_the_cli_refuses_before_the_slow_start_and_names_both_flags(tmp_path: Path) -> None:
    """Exit code 2 and one line: before the data (missing here) and the model (no weights) are read."""
    mrl_configs.hf_config(architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path / "model")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    cmd = [sys.executable, "-m", "megatron_rl.cli", "sft", str(EXAMPLE / "sft.yaml")]
    cmd += [f"model.hf_path={tmp_path / 'model'}", f"logging.run_dir={tmp_path / 'run'}"]
    cmd += [
        f"data.train_path={tmp_path / 'none.jsonl'}",
        "data.eval_path=null",
        "parallel.expert_model_parallel_size=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: logging.run_dir"), proc.stderr
    assert "--resume" in lines[0] and "--force" in lines[0]
    both = subprocess.run([*cmd, "--resume", "--force"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


# ---- atomic checkpoints ----


class ShardWritingActor:
    """Writes what a distributed checkpoint writes: metadata, common state and per-rank shards."""

    def __init__(self) -> None:
        self.saves = 0

    def save(self, path: Path) -> dict[str, str]:
        """Returns each shard's SHA-256, as the real writer computes it while writing."""
        self.saves += 1
        path.mkdir(parents=True)
        (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        torch.save({"step": self.saves}, path / "common.pt")
        digests = {}
        for shard in range(2):
            data = bytes([self.saves]) * (1000 + shard)
            (path / f"__{shard}_0.distcp").write_bytes(data)
            digests[f"__{shard}_0.distcp"] = hashlib.sha256(data).hexdigest()
        return digests


def save_steps(run_dir: Path, steps: list[int], keep_last: int = 0) -> RunFolder:
    folder = RunFolder(config(run_dir, keep_last=keep_last), rank=0, resume=False)
    actor, sampler = ShardWritingActor(), PromptSampler(list(range(10)), seed=1)
    for step in steps:
        sampler.next(2)
        folder.save_checkpoint(actor, step, {"sampler": sampler.state_dict()})  # type: ignore[arg-type]
    return folder


def test_a_checkpoint_is_renamed_into_place_with_a_manifest_of_its_files(tmp_path: Path, world_of_one: None) -> None:
    folder = save_steps(tmp_path, [1, 2, 3], keep_last=2)
    root = folder.ckpt_root
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    step3 = checkpoint_dir(root, 3)
    manifest = json.loads((step3 / MANIFEST_FILE).read_text())
    files = {
        p.relative_to(step3).as_posix(): {
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in step3.rglob("*")
        if p.is_file()
    }
    files.pop(MANIFEST_FILE)
    assert manifest["files"] == files and manifest["step"] == 3
    assert files[f"{ACTOR_DIR}/__1_0.distcp"]["size"] == 1001
    point = resume_point(root)
    assert point is not None and point[0] == step3 and point[1].step == 3
    assert point[1].entries["sampler"]["position"] == 6  # 2 prompts drawn per step
    assert not list(root.glob("*.tmp"))


def _damage(folder: Path, how: str) -> Path:
    if how == "missing shard":
        victim = folder / ACTOR_DIR / "__1_0.distcp"
        victim.unlink()
    elif how == "truncated shard":
        victim = folder / ACTOR_DIR / "__0_0.distcp"
        os.truncate(victim, 10)
    else:
        victim = folder / LOOP_STATE_FILE
        os.truncate(victim, victim.stat().st_size // 2)
    return victim


@pytest.mark.parametrize("how", ["missing shard", "truncated shard", "truncated loop state"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint_naming_the_file(
    tmp_path: Path, world_of_one: None, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    root = save_steps(tmp_path, [1, 2]).ckpt_root
    newest = checkpoint_dir(root, 2)
    victim = _damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoints"):
        folder = RunFolder(config(tmp_path), rank=0, resume=True)
    assert folder.resume_from == checkpoint_dir(root, 1) and folder.start_step == 1
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and str(victim) in warned[0] and str(newest) in warned[0]


def test_leftover_staging_folders_are_ignored_then_cleaned_and_pruning_keeps_the_newest_complete(
    tmp_path: Path, world_of_one: None
) -> None:
    folder = save_steps(tmp_path, [1, 2, 3], keep_last=2)
    root = folder.ckpt_root
    killed = root / "step_000004.tmp"  # a save killed half-way
    (killed / ACTOR_DIR).mkdir(parents=True)
    (killed / ACTOR_DIR / "__0_0.distcp").write_bytes(b"half")
    assert resume_point(root)[0] == checkpoint_dir(root, 3)  # type: ignore[index]
    _damage(checkpoint_dir(root, 3), "truncated shard")
    assert prune_checkpoints(root, keep_last=1) == []  # step 2 is the newest complete one now: kept
    resumed = RunFolder(folder.cfg, rank=0, resume=True)
    assert resumed.start_step == 2
    resumed.save_checkpoint(ShardWritingActor(), 3, {"sampler": PromptSampler(list(range(10)), seed=1).state_dict()})  # type: ignore[arg-type]
    # the damaged step 3 is replaced by the new one, the staging folder is gone; keep_last = 2
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert resume_point(root)[1].step == 3  # type: ignore[index]


# ---- the writable check ----


def unwritable_folder(tmp_path: Path) -> Path | None:
    """A folder in which no file can be made (None where there is none to be had)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked
    return Path("/sys/kernel") if Path("/sys/kernel").is_dir() else None  # sysfs: no new files, also for root


def test_an_unusable_checkpoint_folder_fails_at_start_up_naming_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .* is not a writable folder"):
        RunFolder(config(tmp_path / "run", ckpt_dir=blocker / "ckpts"), rank=0, resume=False)
    with pytest.raises(ConfigError, match=r"^logging.run_dir: .* is not a writable folder"):
        RunFolder(config(blocker), rank=0, resume=False)
    locked = unwritable_folder(tmp_path)
    if locked is None:
        return
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .* is not a writable folder \(PermissionError"):
        RunFolder(config(tmp_path / "run", ckpt_dir=locked / "ckpts"), rank=0, resume=False)


def test_an_unusable_sync_dir_fails_at_start_up_naming_the_key(tmp_path: Path) -> None:
    """The disk sync's folder is checked with the run folder, before anything slow: a file is refused by
    the validation, a folder that cannot be written by the run folder (not after the first step)."""
    from megatron_rl.validation import validate_run

    blocker = tmp_path / "a_file"
    blocker.write_text("")

    def sync_config(sync_dir: Path, weight_sync: str = "disk") -> Config:
        rollout = RolloutConfig(sync_dir=str(sync_dir), weight_sync=weight_sync)  # type: ignore[arg-type]
        return dataclasses.replace(config(tmp_path / "run", hf_path=str(tmp_path)), rollout=rollout)

    with pytest.raises(ConfigError, match=r"^rollout.sync_dir = .* is under .*a_file, which is a file"):
        validate_run(
            dataclasses.replace(sync_config(blocker / "w"), data=DataConfig(train_path="x.jsonl")),
            "train",
            world_size=1,
        )
    unwritable = (
        r"^rollout.sync_dir: .* is not a writable folder \(({}): [^)]*\); the run could send the engine no weights"
    )
    with pytest.raises(ConfigError, match=unwritable.format("FileExistsError|NotADirectoryError")):
        RunFolder(sync_config(blocker / "w"), rank=0, resume=False, syncs_weights=True)
    RunFolder(sync_config(blocker / "w"), rank=0, resume=False).close()  # SFT sends no weights
    RunFolder(sync_config(blocker / "w", "tensor"), rank=0, resume=False, syncs_weights=True).close()  # no folder
    locked = unwritable_folder(tmp_path)
    if locked is None:
        return
    with pytest.raises(ConfigError, match=unwritable.format("PermissionError")):
        RunFolder(sync_config(locked / "w"), rank=0, resume=False, syncs_weights=True)

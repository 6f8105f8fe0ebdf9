"""What resuming trusts (`megatron_rl.checkpoints`, `megatron_rl.run_folder`): every file's checksum, computed while writing and
verified at resume; `--resume` / `--resume-if-any` never start a damaged run over; one run per run
folder (the lock); a torn metrics line; one-line save failures; the asynchronous mode of a
checkpoint refused before the actor starts.

Most tests run in-process with an actor that writes shard files the way a distributed checkpoint
does (tests/test_checkpoints.py's); the real Megatron save path (every shard's SHA-256 against its
bytes, on one rank and on two; a bit flip, one byte of `.metadata`, 4 KiB of garbage, a shard removed
with its manifest entry: each one warning naming the file, and step 1 taken and loaded) runs in the
actor's gloo launches (`w1_shards_hashed_while_written_and_damage_falls_back`,
`w2_every_ranks_shard_is_in_the_manifest` in tests/mrl_multiproc/scenarios_actor.py).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from test_checkpoints import ShardWritingActor

from megatron_rl import checkpoints
from megatron_rl.checkpoints import ACTOR_DIR, CheckpointWriteError, checkpoint_dir, resume_point
from megatron_rl.config import CheckpointConfig, Config, ConfigError, LoggingConfig, RolloutConfig, TrainConfig
from megatron_rl.data import PromptSampler
from megatron_rl.metrics import read_metrics, truncate_metrics
from megatron_rl.models import write_errors
from megatron_rl.run_folder import LOCK_FILE, RESUME_IF_ANY, RunFolder, RunFolderError, RunLock

REPO = Path(__file__).resolve().parents[1]


def quiet_logging(run_dir: Path) -> LoggingConfig:
    return LoggingConfig(run_dir=str(run_dir), backends=[], progress=False)


def config(run_dir: Path, *, keep_last: int = 0, async_mode: str = "sync") -> Config:
    return Config(
        logging=LoggingConfig(run_dir=str(run_dir)),
        checkpoint=CheckpointConfig(keep_last=keep_last),
        rollout=RolloutConfig(async_mode=async_mode),
    )


def save_steps(run_dir: Path, steps: list[int], *, keep_last: int = 0, **kwargs: object) -> Path:
    """A fresh run that saved `steps`; its checkpoint root."""
    folder = RunFolder(config(run_dir, keep_last=keep_last, **kwargs), rank=0, resume=False)  # type: ignore[arg-type]
    actor, sampler = ShardWritingActor(), PromptSampler(list(range(10)), seed=1)
    for step in steps:
        sampler.next(2)
        folder.save_checkpoint(actor, step, {"sampler": sampler.state_dict(), "rollout": b"state"})  # type: ignore[arg-type]
    folder.close()
    return folder.ckpt_root


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- checksums ----


def test_a_same_size_bit_flip_in_a_shard_is_named_and_the_previous_checkpoint_taken(
    tmp_path: Path, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    root = save_steps(tmp_path / "run", [1, 2])
    victim = checkpoint_dir(root, 2) / ACTOR_DIR / "__1_0.distcp"
    size = victim.stat().st_size
    flip_a_bit(victim)
    assert victim.stat().st_size == size
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoints"):
        folder = RunFolder(config(tmp_path / "run"), rank=0, resume=True)
    folder.close()
    assert folder.resume_from == checkpoint_dir(root, 1) and folder.start_step == 1
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and f"{victim}: its SHA-256 differs" in warned[0], warned


@pytest.mark.parametrize("manifest", ["removed", "empty", "without the shard's entry"])
def test_a_missing_or_partial_manifest_is_damage_and_the_previous_checkpoint_taken(
    tmp_path: Path, world_of_one: None, caplog: pytest.LogCaptureFixture, manifest: str
) -> None:
    """Every checkpoint is written with a full manifest: a bit flip in a shard whose manifest is gone,
    empty or silent about it is not trained on."""
    root = save_steps(tmp_path / "run", [1, 2])
    step2 = checkpoint_dir(root, 2)
    victim = step2 / ACTOR_DIR / "__0_0.distcp"
    flip_a_bit(victim)
    manifest_path = step2 / "manifest.json"
    content = json.loads(manifest_path.read_text())
    if manifest == "removed":
        manifest_path.unlink()
    else:
        content["files"] = (
            {} if manifest == "empty" else {k: v for k, v in content["files"].items() if "__0_0" not in k}
        )
        manifest_path.write_text(json.dumps(content))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoints"):
        folder = RunFolder(config(tmp_path / "run"), rank=0, resume=True)
    folder.close()
    assert folder.resume_from == checkpoint_dir(root, 1) and folder.start_step == 1
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    named = f"{manifest_path} is missing" if manifest == "removed" else f"is not in {manifest_path}"
    assert len(warned) == 1 and named in warned[0], warned
    if manifest == "without the shard's entry":
        assert f"{victim} is not in" in warned[0]


def test_the_manifest_refuses_a_shard_its_writer_did_not_hash(tmp_path: Path, world_of_one: None) -> None:
    """No shard is read a second time to be hashed: a writer that gives no digest fails the save."""

    class Unhashed(ShardWritingActor):
        def save(self, path: Path) -> dict[str, str]:
            super().save(path)
            return {}

    folder = RunFolder(config(tmp_path / "run"), rank=0, resume=False)
    with pytest.raises(ValueError, match=r"__0_0.distcp: no SHA-256 from its writer"):
        folder.save_checkpoint(Unhashed(), 1, {"sampler": PromptSampler(list(range(4)), seed=1).state_dict()})  # type: ignore[arg-type]
    folder.close()
    assert resume_point(folder.ckpt_root) is None


def test_pruning_never_removes_the_newest_checkpoint_that_verified(tmp_path: Path, world_of_one: None) -> None:
    """Steps 2 and 3 flipped: resume takes step 1, and the save of step 2 with keep_last = 1 keeps
    the new step 2, not the damaged step 3 alone."""
    run_dir = tmp_path / "run"
    root = save_steps(run_dir, [1, 2, 3])
    for step in (2, 3):
        flip_a_bit(checkpoint_dir(root, step) / ACTOR_DIR / "__0_0.distcp")
    folder = RunFolder(config(run_dir, keep_last=1), rank=0, resume=True)
    assert folder.start_step == 1
    folder.save_checkpoint(ShardWritingActor(), 2, {"sampler": PromptSampler(list(range(10)), seed=1).state_dict()})  # type: ignore[arg-type]
    folder.close()
    assert (checkpoint_dir(root, 2)).is_dir()
    point = resume_point(root, warn=False)
    assert point is not None and point[0] == checkpoint_dir(root, 2)


# ---- --resume and --resume-if-any ----


def test_resume_without_a_usable_checkpoint_is_refused_naming_the_damage_and_changes_nothing(
    tmp_path: Path, world_of_one: None
) -> None:
    run_dir = tmp_path / "run"
    root = save_steps(run_dir, [1, 2])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": n}) + "\n" for n in (1, 2, 3)))
    for step in (1, 2):  # every loop state damaged, the actor shards intact
        state = checkpoint_dir(root, step) / "loop_state.pt"
        os.truncate(state, state.stat().st_size // 2)
    before = tree(run_dir)
    for resume in (True, RESUME_IF_ANY):
        with pytest.raises(ConfigError) as err:
            RunFolder(config(run_dir), rank=0, resume=resume)
        message = str(err.value)
        assert "\n" not in message and f"no usable checkpoint in {root}" in message, message
        assert str(checkpoint_dir(root, 1) / "loop_state.pt") in message
        assert str(checkpoint_dir(root, 2) / "loop_state.pt") in message
        assert "holds 3 step records" in message and "--force" in message
        assert tree(run_dir) == before  # records, checkpoints and lock: nothing written, nothing left


def test_resume_of_records_without_any_checkpoint_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"^--resume: no checkpoint in .*holds 1 step records"):
        RunFolder(config(run_dir), rank=0, resume=True)
    assert read_metrics(run_dir) == [{"step": 1}]


def test_resume_if_any_starts_an_empty_folder_afresh_where_resume_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^--resume: no checkpoint in .*nothing to resume.*--resume-if-any"):
        RunFolder(config(run_dir), rank=0, resume=True)
    folder = RunFolder(config(run_dir), rank=0, resume=RESUME_IF_ANY)
    folder.close()
    assert folder.resume_from is None and folder.start_step == 0


def test_resume_if_any_continues_from_a_checkpoint(tmp_path: Path, world_of_one: None) -> None:
    root = save_steps(tmp_path / "run", [1, 2])
    folder = RunFolder(config(tmp_path / "run"), rank=0, resume=RESUME_IF_ANY)
    folder.close()
    assert folder.resume_from == checkpoint_dir(root, 2) and folder.start_step == 2


@pytest.mark.parametrize("killed", ["after the step-0 record", "during the first save"])
def test_a_requeue_of_a_run_killed_before_its_first_checkpoint_starts_afresh(
    tmp_path: Path, world_of_one: None, killed: str
) -> None:
    """A Slurm requeue (--resume-if-any) of a run killed between its step-0 evaluation record and its
    first checkpoint (or during it: a `.tmp` folder) starts from step 0 and drops those records;
    records past the first checkpoint's step, a finished checkpoint or plain --resume are still refused."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    steps = [0] if killed == "after the step-0 record" else [0, 1, 2]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "eval/acc": 0.1}) + "\n" for n in steps))
    if killed == "during the first save":
        (run_dir / "checkpoints" / "step_000002.tmp" / ACTOR_DIR).mkdir(parents=True)
    cfg = dataclasses.replace(
        config(run_dir),
        checkpoint=CheckpointConfig(every=2),
        train=TrainConfig(steps=4),
        logging=quiet_logging(run_dir),
    )
    with pytest.raises(ConfigError, match=r"^--resume: no checkpoint in .* holds \d step records"):
        RunFolder(cfg, rank=0, resume=True)
    folder = RunFolder(cfg, rank=0, resume=RESUME_IF_ANY)
    assert folder.resume_from is None and folder.start_step == 0 and folder.dropped_records == len(steps)
    folder.open_log(desc="rl").close()
    folder.close()
    assert read_metrics(run_dir) == []
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": n}) + "\n" for n in (0, 1, 2, 3)))
    with pytest.raises(ConfigError, match=r"^--resume-if-any: no checkpoint in .* holds 4 step records"):
        RunFolder(cfg, rank=0, resume=RESUME_IF_ANY)


def test_a_damaged_middle_line_of_the_step_records_is_refused_at_resume_naming_it(
    tmp_path: Path, world_of_one: None
) -> None:
    """NUL bytes in a middle line of metrics.jsonl (two runs that wrote it at once): --resume is refused
    in one line naming the file and the line, before the actor starts, and nothing is changed."""
    run_dir = tmp_path / "run"
    save_steps(run_dir, [1, 2])
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1}\n\x00\x00\x00{"step": 2}\n{"step": 3}\n')
    before = tree(run_dir)
    for resume in (True, RESUME_IF_ANY):
        with pytest.raises(ConfigError) as err:
            RunFolder(config(run_dir), rank=0, resume=resume)
        assert str(err.value).startswith(f"{'--resume' if resume is True else '--resume-if-any'}: {metrics}:2: not a")
        assert "\n" not in str(err.value) and "repair or delete that line" in str(err.value)
        assert tree(run_dir) == before


def test_an_empty_metrics_file_of_a_run_stopped_during_its_start_up_lets_a_plain_retry_proceed(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    RunFolder(config(run_dir), rank=0, resume=False).close()
    (run_dir / "metrics.jsonl").write_text("\n")
    RunFolder(config(run_dir), rank=0, resume=False).close()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        RunFolder(config(run_dir), rank=0, resume=False)


def test_flags_after_the_overrides_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """`train CONFIG --resume train.steps=...`: the override after the flag reaches the config (its
    bad value is the error, before anything slow), and an unknown flag is still refused."""
    from megatron_rl import cli

    args = ["train", str(REPO / "examples" / "tiny_math" / "rl.yaml"), "--resume"]
    assert cli.main([*args, "train.steps=many"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and err.startswith("config error: ") and "train.steps" in err, err
    with pytest.raises(SystemExit) as refused:
        cli.main([*args, "--bogus"])
    assert refused.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


# ---- one run per run folder ----


def _hold_lock(run_dir: str, conn: Any) -> None:  # noqa: ANN401 - a multiprocessing connection
    RunLock(Path(run_dir))
    conn.send("locked")
    conn.poll(60)  # until the test kills it (or gives up)


def test_a_second_launch_into_a_locked_run_folder_is_refused_naming_the_pid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    holder = ctx.Process(target=_hold_lock, args=(str(run_dir), there))
    holder.start()
    try:
        assert here.poll(60) and here.recv() == "locked", "the holder did not lock"
        with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {holder.pid}, lock .*{LOCK_FILE}\)"):
            RunFolder(config(run_dir), rank=0, resume=False)
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing created by the refused launch
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # dies holding it: the file stays, the lock goes with the process
        holder.join(60)
    assert (run_dir / LOCK_FILE).read_text().strip() == str(holder.pid)
    folder = RunFolder(config(run_dir), rank=0, resume=False)
    assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
    folder.close()
    assert not (run_dir / LOCK_FILE).exists()


def test_force_locks_the_new_run_folder_and_leaves_no_lock_in_the_old_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    folder = RunFolder(config(run_dir), rank=0, resume=False, force=True)
    assert (run_dir / LOCK_FILE).is_file() and not (tmp_path / "run.old-1" / LOCK_FILE).exists()
    folder.close()
    assert not (run_dir / LOCK_FILE).exists()


def test_a_lock_file_removed_mid_run_stops_the_run_before_its_next_record_or_checkpoint(
    tmp_path: Path, world_of_one: None
) -> None:
    """The lock file removed while the stage runs (a second launch can then lock a new one): the run
    stops before it writes its next record, checkpoint or export, naming the lock; it leaves the
    other launch's lock file alone."""
    run_dir = tmp_path / "run"
    folder = RunFolder(dataclasses.replace(config(run_dir), logging=quiet_logging(run_dir)), rank=0, resume=False)
    log = folder.open_log(desc="rl")
    log.log({"step": 1})
    lock = run_dir / LOCK_FILE
    lock.unlink()
    removed = rf"^{re.escape(str(lock))} was removed while this run \(pid {os.getpid()}\) held it: another launch"
    with pytest.raises(RunFolderError, match=removed + r".*stopped before the record of step 2, which was not written"):
        log.log({"step": 2})
    second = RunLock(run_dir)  # the second launch
    with pytest.raises(RunFolderError, match=r"was replaced while this run .* stopped before the checkpoint of step 2"):
        folder.save_checkpoint(ShardWritingActor(), 2, {"sampler": PromptSampler(list(range(4)), seed=1).state_dict()})  # type: ignore[arg-type]
    with pytest.raises(RunFolderError, match=r"stopped before the export to"):
        folder.export(None, run_dir / "hf")  # type: ignore[arg-type]
    log.close()
    folder.close()
    assert read_metrics(run_dir) == [{"step": 1}] and list(folder.ckpt_root.iterdir()) == []
    assert not (run_dir / "hf").exists() and lock.is_file()  # the second launch's lock stays
    second.release()


def test_a_lock_file_that_is_a_folder_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        RunFolder(config(run_dir), rank=0, resume=False)
    message = str(err.value)
    assert message.startswith(f"logging.run_dir = {str(run_dir)!r}: its lock file {run_dir / LOCK_FILE} cannot be")
    assert "IsADirectoryError" in message and f"remove {run_dir / LOCK_FILE}" in message and "\n" not in message


# ---- metrics.jsonl ----


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "reward/me')
    with caplog.at_level(logging.WARNING, logger="megatron_rl.metrics.records"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
        assert truncate_metrics(tmp_path, 2) == 1
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert any(f"{path}:3: a torn last line" in r.getMessage() for r in caplog.records)
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # not the last line: not a torn write
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON line"):
        truncate_metrics(tmp_path, 3)


# ---- storage ----


def test_a_full_disk_during_a_save_is_one_line_naming_the_folder_and_the_free_bytes(
    tmp_path: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class DiskFull(ShardWritingActor):
        def save(self, path: Path) -> dict[str, str]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "__0_0.distcp"))

    folder = RunFolder(config(tmp_path / "run"), rank=0, resume=False)
    sampler = PromptSampler(list(range(4)), seed=1)
    staging = checkpoint_dir(folder.ckpt_root, 1).with_name("step_000001.tmp")
    with pytest.raises(CheckpointWriteError) as err:
        folder.save_checkpoint(DiskFull(), 1, {"sampler": sampler.state_dict()})  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith(f"{staging}: no space left to write the checkpoint (") and "\n" not in message
    assert " bytes free on its file system" in message

    def torn_zip(*_: object) -> str:  # torch's zip writer on a full disk: no errno, no word of space
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1098")

    monkeypatch.setattr(checkpoints, "save_loop_state", torn_zip)
    monkeypatch.setattr(write_errors, "free_bytes", lambda _: 4096)
    with pytest.raises(CheckpointWriteError, match=r"no space left to write the checkpoint \(4096 bytes free"):
        folder.save_checkpoint(ShardWritingActor(), 1, {"sampler": sampler.state_dict()})  # type: ignore[arg-type]
    folder.close()


def test_an_unwritable_checkpoint_folder_mid_run_is_one_line(tmp_path: Path, world_of_one: None) -> None:
    class Unwritable(ShardWritingActor):
        def save(self, path: Path) -> dict[str, str]:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    folder = RunFolder(config(tmp_path / "run"), rank=0, resume=False)
    with pytest.raises(CheckpointWriteError) as err:
        folder.save_checkpoint(Unwritable(), 1, {"sampler": PromptSampler(list(range(4)), seed=1).state_dict()})  # type: ignore[arg-type]
    folder.close()
    message = str(err.value)
    assert "could not be written (PermissionError: [Errno 13] Permission denied" in message and "\n" not in message
    assert "bytes free there" in message and "continue with --resume" in message


# ---- the asynchronous mode ----


def test_a_checkpoint_of_another_async_mode_is_refused_before_the_actor_starts(
    tmp_path: Path, world_of_one: None
) -> None:
    save_steps(tmp_path / "run", [1], async_mode="fully_async")
    with pytest.raises(ConfigError, match=r"rollout.async_mode = 'one_step_off' but .* was saved with 'fully_async'"):
        RunFolder(config(tmp_path / "run", async_mode="one_step_off"), rank=0, resume=True)
    folder = RunFolder(config(tmp_path / "run", async_mode="fully_async"), rank=0, resume=True)
    folder.close()
    assert folder.loop_state is not None and folder.loop_state.async_mode == "fully_async"


def test_the_sha256_of_the_unhashed_files_is_that_of_their_bytes(tmp_path: Path, world_of_one: None) -> None:
    """Megatron's small metadata files are hashed by reading them; the loop state while writing."""
    root = save_steps(tmp_path / "run", [1])
    manifest = json.loads((checkpoint_dir(root, 1) / "manifest.json").read_text())
    for name in ("loop_state.pt", f"{ACTOR_DIR}/common.pt", f"{ACTOR_DIR}/metadata.json"):
        data = (checkpoint_dir(root, 1) / name).read_bytes()
        assert manifest["files"][name]["sha256"] == hashlib.sha256(data).hexdigest(), name

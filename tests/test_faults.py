"""Faults during a run: stop signals, an engine that dies or freezes, servers that go away, an engine
serving other weights (issue 15).

- The signal rules (`megatron_rl.parallel.signals`) in this process: a stop signal is recorded, the
  same one twice stops at once, the other one is the same request; the exit codes.
- The client's pool: an unreachable server is dropped with a warning while another serves every
  request; when none remains the error says so.
- The local engine child: kill -9 is noticed at once (no retry), the child restarts on its port and
  the same seeded requests give the same samples; one death more than `max_engine_restarts` stops with
  the exit code and the log's tail; a stopped child (SIGSTOP) is reported every `stall_warning_s`.
- Real runs on tiny_math's model (tests/test_trainer.py's setup, `rollout.max_concurrency=1`):
  SIGUSR1 to rank 0 alone of 2 ranks -> both stop after the same step with its checkpoint, exit 0,
  and `--resume` gives the uninterrupted run's metrics; kill -9 of the engine mid-run ->
  `rollout/engine_restarts` 1, the restarted engine serves the trained weights (log-prob gap as small
  as before), with distributed sync every step done, with disk sync then SIGTERM to the single
  process -> the step's checkpoint, exit 143, a quiet log (one launch); an engine serving another
  model -> the run stops on `rollout.max_logprob_gap` before training.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from mrl_engine import on_loop, rollout_loop
from test_jobplan import big, plan
from test_sft import one_process_sft_command

from megatron_rl.config import RolloutConfig
from megatron_rl.metrics import read_metrics
from megatron_rl.parallel.launch import free_port
from megatron_rl.parallel.signals import (
    StopRequest,
    Terminated,
    exit_code,
    remember_stop_signals,
    stop_at_step_boundary,
)
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sglang import EngineDiedError, SGLangClient, SGLangError
from megatron_rl.rollout.types import SamplingParams

import tiny_model
from mrl_runs import (
    RESUME_RUN,
    RunCache,
    assert_resume_matches,
    command,
    descendants,
    finish,
    leftovers,
    no_leftovers,
    start,
    steps_logged,
    wait_ended,
    wait_for,
    wait_until,
)

# tests/test_jobplan.py's 30B plan config (the run's model, data and config, and the SFT data, are
# tests/conftest.py's `work` and `assets`)
__all__ = ["big"]
ROOT = Path(__file__).resolve().parents[1]

ENGINE_ARGS = {"extra_args": ["--threads", "1"], "env": {"OMP_NUM_THREADS": "1"}}  # RolloutEngine gives the key
# an engine a test starts itself, which a run reaches by its address with no key
UNKEYED_ENGINE_ARGS = {"extra_args": ["--threads", "1", "--no-auth"], "env": {"OMP_NUM_THREADS": "1"}}
PROMPTS = [[3, 5, 7, 9], [4, 6, 8], [10, 11, 12, 13, 14], [2, 2, 2]]


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=100 + i) for i in range(n)]


# ---- the signal rules ----


def test_stop_signals_are_recorded_and_the_same_one_twice_stops_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_at_step_boundary() as request:
        assert isinstance(request, StopRequest) and request.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.signum == signal.SIGTERM and request.agreed() == signal.SIGTERM  # no process group: its own
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's TERM and the batch script's USR1: one request
        assert request.signum == signal.SIGTERM
        with pytest.raises(Terminated) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 128 + signal.SIGTERM
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGHUP)
    assert signal.getsignal(signal.SIGTERM) == before  # restored after the block
    assert (exit_code(signal.SIGUSR1), exit_code(signal.SIGTERM)) == (0, 143)


def test_a_stop_signal_during_the_start_up_is_kept_for_the_loop() -> None:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        remember_stop_signals()  # what `megatron-rl train`/`sft` do first
        signal.raise_signal(signal.SIGUSR1)  # its default action would end this process
        with stop_at_step_boundary() as request:
            assert request.signum == signal.SIGUSR1
        with stop_at_step_boundary() as later:  # taken once
            assert later.signum == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---- Slurm ----


def test_slurm_jobs_checkpoint_every_10_steps_unless_the_config_says(big: Path) -> None:
    assert "checkpoint.every=10" in plan(big, "disaggregated").trainer_overrides
    assert "checkpoint.every=10" in plan(big, "colocated", nodes=1, gpu_mem_gib=141).trainer_overrides
    explicit = plan(big, "disaggregated", "checkpoint.every=0").trainer_overrides
    assert not [o for o in explicit if o.startswith("checkpoint.every")]  # the user's 0 is kept
    for script in ("train.sbatch", "train_colocated.sbatch"):
        assert "#SBATCH --signal=B:USR1@300\n" in (ROOT / "slurm" / script).read_text()


TRAINER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    out.joinpath("signal").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
out.joinpath("ready").write_text("")
time.sleep(120)
"""


@pytest.mark.parametrize(("sig", "code"), [("USR1", 0), ("TERM", 143)])
def test_the_batch_shell_lets_the_trainer_checkpoint_before_it_stops_the_steps(
    tmp_path: Path, sig: str, code: int
) -> None:
    """slurm/lib.sh's traps, with a stand-in trainer step (no Slurm here: its process group is signalled)."""
    (tmp_path / "trainer.py").write_text(TRAINER)
    job = f"""
source {ROOT}/slurm/lib.sh
start_step trainer {sys.executable} {tmp_path}/trainer.py {tmp_path}
TRAINER_PID=${{BG_PIDS[-1]}}
install_traps
until [[ -e {tmp_path}/ready ]]; do sleep 0.1; done
kill -{sig} $$
sleep 60
"""
    done = subprocess.run(["bash", "-c", job], capture_output=True, text=True, timeout=90)
    assert done.returncode == code, done.stdout + done.stderr
    assert (tmp_path / "signal").read_text() == "SIGUSR1"  # the trainer's tasks got SIGUSR1 and stopped at their step
    assert "asking the trainer to checkpoint after its current step" in done.stdout


# ---- the pool and the local engine child ----


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("other")
    tiny_model.build_model(root / "model", seed=1)
    return root / "model"


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.e2e
def test_an_unreachable_server_is_dropped_while_another_serves(work: Path, caplog: pytest.LogCaptureFixture) -> None:
    from megatron_rl.rollout.local.launcher import start_local_engine

    engine = start_local_engine(str(work / "model"), **UNKEYED_ENGINE_ARGS)
    gone = dead_url()

    async def scenario() -> tuple[list, list[str], list[str]]:
        async with SGLangClient([gone, engine.url], max_retries=2, backoff_s=0.05, max_concurrency=1) as client:
            samples = await client.generate_batch(PROMPTS * 2, seeded(8))
            return samples, client.urls, client.dropped

    try:
        with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.sglang"):
            samples, urls, dropped = asyncio.run(scenario())
    finally:
        engine.stop()
    assert len(samples) == 8 and all(s.server == engine.url for s in samples)
    assert urls == [engine.url] and dropped == [gone]
    assert any(f"dropping {gone} from the rollout servers" in r.getMessage() for r in caplog.records)

    async def none_left() -> None:
        async with SGLangClient([dead_url(), dead_url()], max_retries=3, backoff_s=0.05) as client:
            await client.generate(PROMPTS[0], seeded(1)[0])

    with pytest.raises(SGLangError, match="no rollout server is reachable"):
        asyncio.run(none_left())


@pytest.mark.e2e
def test_a_killed_engine_restarts_with_the_same_samples_then_stops_past_the_limit(
    work: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rollout = RolloutConfig(max_engine_restarts=1, max_retries=3, max_concurrency=1, stall_warning_s=0)
    engine = RolloutEngine.from_config(rollout, rollout_loop(), str(work / "model"), **ENGINE_ARGS)
    try:
        before = on_loop(engine.generate(PROMPTS, seeded(4)))
        first = engine.local_process
        first.process.kill()  # kill -9
        with caplog.at_level(logging.WARNING):
            again = on_loop(engine.generate(PROMPTS, seeded(4)))
        assert engine.restarts == 1 and engine.local_process is not first and engine.local_process.alive()
        assert engine.local_process.url == first.url  # same port: the client's address holds
        assert [s.output_ids for s in again] == [s.output_ids for s in before]  # seeded: the same samples
        assert [s.logprobs for s in again] == [s.logprobs for s in before]
        messages = [r.getMessage() for r in caplog.records]
        assert any("exited with code -9" in m and "restarting it (1 of" in m for m in messages), messages
        assert not any(" try " in m for m in messages), messages  # noticed at once: no retries

        engine.local_process.process.kill()
        with pytest.raises(EngineDiedError, match=r"exited with code -9.*max_engine_restarts = 1.*Last lines of"):
            on_loop(engine.generate(PROMPTS, seeded(4)))
    finally:
        engine.close()


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no reply from the rollout engine" in r.getMessage()]


@pytest.mark.e2e
def test_a_stopped_engine_is_reported_with_the_requests_in_flight(work: Path, caplog: pytest.LogCaptureFixture) -> None:
    rollout = RolloutConfig(max_concurrency=1, stall_warning_s=1.0)
    engine = RolloutEngine.from_config(rollout, rollout_loop(), str(work / "model"), **ENGINE_ARGS)
    pid = engine.local_process.process.pid
    result: dict = {}
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.engine"):
            os.kill(pid, signal.SIGSTOP)
            worker = threading.Thread(
                target=lambda: result.update(samples=on_loop(engine.generate(PROMPTS, seeded(4))))
            )
            worker.start()
            wait_until(lambda: len(stall_warnings(caplog)) >= 2, 120, "two stall warnings")
            os.kill(pid, signal.SIGCONT)
            worker.join(120)
        stalls = stall_warnings(caplog)
        assert len(stalls) >= 2, stalls  # every stall_warning_s, not once
        assert f"1 request(s) in flight ({engine.local_process.url}: 1)" in stalls[0]  # max_concurrency 1
        assert f"process {pid} is stopped" in stalls[0]
        assert len(result["samples"]) == 4  # it goes on once continued
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()


# ---- real runs ----

SIGNAL_RUN = ("train.steps=3", "eval.every=0", "checkpoint.every=0", "train.updates_per_step=2")
# the stopped runs' steps end whole however slow the machine (a step whose episodes were aborted would
# train on fewer groups than the uninterrupted run compared with)
UNABORTED = "checkpoint.preempt_timeout_s=600"


def rank0_worker(torchrun: subprocess.Popen) -> psutil.Process:
    for child in psutil.Process(torchrun.pid).children():
        if child.environ().get("RANK") == "0":
            return child
    raise AssertionError("no rank-0 worker under torchrun")


def stop_after_first_step(
    work: Path, run_dir: Path, sig: signal.Signals, ranks: int, run: tuple[str, ...] = SIGNAL_RUN
) -> tuple[int, str]:
    """Start the run (`run`'s overrides), send `sig` (to rank 0 alone) once step 1 is logged; (exit code, log)."""
    log = run_dir.with_suffix(".log")
    process = start(command(work, run_dir, *run, UNABORTED, ranks=ranks), log)
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, process, log)
    target = rank0_worker(process).pid if ranks > 1 else process.pid
    os.kill(target, sig)
    text = wait_ended(process, log, f"stop on {sig.name}")
    return process.returncode, text


@pytest.mark.e2e
def test_sigusr1_to_rank0_stops_every_rank_at_a_checkpoint_and_resume_matches(
    work: Path, straight_runs: RunCache, tmp_path: Path
) -> None:
    run_dir = tmp_path / "stopped"
    code, text = stop_after_first_step(work, run_dir, signal.SIGUSR1, ranks=2, run=RESUME_RUN)
    assert code == 0, text[-3000:]
    stopped_at = [r["step"] for r in steps_logged(run_dir)]
    k = stopped_at[-1]
    assert stopped_at == list(range(1, k + 1)) and k < 3, stopped_at  # stopped before the end
    assert f"SIGUSR1: stopped after step {k} of 3" in text
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == [f"step_{k:06d}"]  # checkpoint.every=2 and k < 3: the stop's (and step 2's if k = 2)
    assert (run_dir / "checkpoints" / saved[0] / "loop_state.pt").is_file()
    assert not (run_dir / "hf").exists()  # no final export for an unfinished run
    assert "Task was destroyed" not in text
    # against the straight run test_trainer.py's kill -9 test compares with (one launch for both)
    assert_resume_matches(straight_runs, work, run_dir, *RESUME_RUN)
    assert leftovers(work) == []


def engine_of(process: subprocess.Popen) -> psutil.Process:
    return next(p for p in descendants(process.pid) if "serve" in p.cmdline())


def assert_trained_weights_served(records: dict[int, dict], steps: list[int]) -> None:
    """The engine's log-probs are the trainer's at every step, the restarted engine's included."""
    gaps = [records[s]["logprob_gap/abs_max"] for s in steps]
    assert all(gap <= 1e-4 for gap in gaps), gaps


@pytest.mark.e2e
def test_sigterm_during_an_engine_restart_checkpoints_the_step_and_exits_143_quietly(
    work: Path, tmp_path: Path
) -> None:
    """One single-process run shows both: kill -9 of the engine after step 1 (disk sync: rank 0 reloads
    the folder the engine served), then SIGTERM once the restart is under way: the step finishes on the
    restarted engine with the trained weights, its checkpoint is saved, exit 143, a quiet log."""
    run_dir = tmp_path / "terminated"
    log = run_dir.with_suffix(".log")
    overrides = (*SIGNAL_RUN, "train.steps=4", "rollout.weight_sync=disk", UNABORTED)  # 4: never the last step
    process = start(command(work, run_dir, *overrides, ranks=1), log)
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, process, log)  # the engine serves step 1's weights now
    engine_of(process).kill()
    wait_for(lambda: "restarting it (1 of" in log.read_text(), process, log)
    process.send_signal(signal.SIGTERM)
    text = wait_ended(process, log, "stop on SIGTERM")
    assert process.returncode == 143, text[-3000:]
    records = {r["step"]: r for r in steps_logged(run_dir)}
    k = max(records)
    assert sorted(records) == list(range(1, k + 1)) and 2 <= k < 4, sorted(records)
    assert records[1]["rollout/engine_restarts"] == 0.0 and records[k]["rollout/engine_restarts"] == 1.0
    assert "exited with code -9" in text and "restarting it (1 of rollout.max_engine_restarts = 3)" in text
    assert "try 2 of" not in text  # noticed at once, not retried
    assert_trained_weights_served(records, list(range(1, k + 1)))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{k:06d}"]
    assert (run_dir / "checkpoints" / f"step_{k:06d}" / "loop_state.pt").is_file()
    assert "received SIGTERM: stopping after the current step" in text
    # the custom reward's failures are warned about every step (its first one with a traceback): not noise
    after = "\n".join(line for line in text.split("received SIGTERM")[1].splitlines() if "rewards failed" not in line)
    assert "Task was destroyed" not in text and "Traceback" not in after and "Error" not in after, after
    no_leftovers(work)


@pytest.mark.e2e
def test_kill_9_of_the_engine_mid_run_restarts_it_with_the_trained_weights(work: Path, tmp_path: Path) -> None:
    """Distributed sync (only every rank can send the weights): the step's rollout is collected again
    after a sync from every rank at the step boundary; every step is done. (Disk sync: the SIGTERM test.)"""
    run_dir = tmp_path / "engine_killed"
    log = run_dir.with_suffix(".log")
    process = start(command(work, run_dir, *SIGNAL_RUN, "rollout.weight_sync=distributed", ranks=1), log)
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, process, log)  # the engine serves step 1's weights now
    engine_of(process).kill()
    text = finish(process, log)
    records = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == [1, 2, 3]
    assert records[1]["rollout/engine_restarts"] == 0.0 and records[3]["rollout/engine_restarts"] == 1.0
    assert "exited with code -9" in text and "restarting it (1 of rollout.max_engine_restarts = 3)" in text
    assert "try 2 of" not in text  # noticed at once, not retried
    assert "syncing from every rank, then collecting the step again" in text
    assert_trained_weights_served(records, [1, 2, 3])
    assert leftovers(work) == []


@pytest.mark.e2e
def test_an_engine_serving_other_weights_stops_the_run_before_training(
    work: Path, other_model: Path, tmp_path: Path
) -> None:
    from megatron_rl.rollout.local.launcher import start_local_engine

    engine = start_local_engine(str(other_model), **UNKEYED_ENGINE_ARGS)
    run_dir = tmp_path / "other_weights"
    log = run_dir.with_suffix(".log")
    overrides = (*SIGNAL_RUN, "rollout.engine=sglang", f'rollout.sglang_urls=["{engine.url}"]')
    try:
        process = start(command(work, run_dir, *overrides, ranks=1), log)
        process.wait(240)
    finally:
        engine.stop()
    text = log.read_text()
    assert process.returncode != 0, text[-3000:]
    assert "above rollout.max_logprob_gap = 0.05" in text and f"the SGLang server(s) {engine.url}" in text, text[-3000:]
    assert steps_logged(run_dir) == []  # nothing trained on its rollouts
    # one error line, no traceback (the reward function's failures above are logged with theirs)
    assert process.returncode == 1 and "LogprobGapError" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("train: error: the engine's log-probs differ"), text[-3000:]


@pytest.mark.e2e
def test_sft_stops_on_sigterm_with_a_checkpoint(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "sft"
    log = tmp_path / "sft.log"
    process = start(one_process_sft_command(assets, run_dir, "train.steps=200", "checkpoint.every=0"), log)
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, process, log)
    process.send_signal(signal.SIGTERM)
    text = wait_ended(process, log, "stop on SIGTERM")
    assert process.returncode == 143, text[-3000:]
    k = steps_logged(run_dir)[-1]["step"]
    assert k < 200 and f"sft: SIGTERM: stopped after step {k}" in text
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{k:06d}"]

"""The sbatch scripts (slurm/) on a real two-node Slurm cluster.

The cluster is tests/support/slurm_cluster.sh: Debian's Slurm 22.05, node1 and node2 on this one
machine (installed and started by the session fixture when missing, stopped again if it started it).
Every job is the real script running the tiny_math example's model and task on the CPU:

- train.sbatch, 2 nodes: node1 trains with 2 ranks (EP 2, gloo), node2 serves the local engine;
  the job exits 0, metrics.jsonl has the steps, the engine ends on the last step's weight version,
  and its log-probs match the trainer's after a sync (the weights, not only the version, arrived);
- a job chained with --dependency=afterany resumes from the checkpoint and continues the step
  count; cancelled mid-run it leaves no process behind;
- train_colocated.sbatch, 1 node: trainer and engine share the node, weights by handle, the
  engine's memory released and resumed around the update;
- convert.sbatch converts the tiny model under srun;
- train.sbatch with rollout.async_mode=fully_async against a `megatron-rl serve` the test started
  (rollout.sglang_urls): the job starts no server and trains on both nodes, the keys reach the
  trainer, and every weight sync pauses the engine with mode "retract" (partial rollouts), never aborting;
- USR1 to the batch shell alone, as `--signal=B:USR1@300` sends it before the time limit: the trainer
  checkpoints the step it is in and the job completes;
- misconfigured submissions fail within seconds, naming the problem.

Every test that submits a job is in this module, so that one xdist worker starts the cluster, uses it
and stops it (a second worker's fixture would stop it under the first's jobs). The job planner alone,
without a cluster: tests/test_jobplan.py and tests/test_presets.py.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import jobplan

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "support" / "slurm_cluster.sh"

JOB_TIMEOUT_S = 420  # a hang guard only
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING")  # a job not yet ended
KEY_ENV = jobplan.ENGINE_API_KEY_ENV
REWARD = "def digits(response: str, answer: str) -> float:\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny_math model, 16 training problems, a reward with varied values and a config."""
    tiny_model = importlib.import_module("tiny_model")
    tiny_task = importlib.import_module("tiny_task")
    root = tmp_path_factory.mktemp("slurm")
    tiny_model.build_model(root / "model", seed=0)
    train, _ = tiny_task.split_problems(seed=0)
    (root / "train.jsonl").write_text(
        "".join(json.dumps(tiny_task.task_row(p, i, "train")) + "\n" for i, p in enumerate(train[:16]))
    )
    (root / "rewards.py").write_text(REWARD)
    config = {
        "model": {"hf_path": str(root / "model")},
        "parallel": {"expert_model_parallel_size": 2},
        "data": {"train_path": str(root / "train.jsonl"), "max_prompt_tokens": 64},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 8, "max_concurrency": 1},
        "reward": {"type": "custom", "custom_function": f"{root / 'rewards.py'}:digits"},
        "algorithm": {"name": "grpo"},
        "train": {"steps": 2, "prompts_per_step": 2, "lr": 1e-3, "seed": 3},
        "checkpoint": {"every": 1, "export_hf": False},
        "logging": {"progress": False, "backends": []},
    }
    (root / "rl.yaml").write_text(json.dumps(config))  # JSON is YAML
    return root


def _cluster(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """The local two-node cluster: used when already up, else started here (and stopped afterwards)."""
    if shutil.which("sinfo") and _cluster("status").returncode == 0:
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (to install Debian's slurm packages and run the daemons)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and apt-get is not available to install it")
    started = _cluster("start")
    if started.returncode != 0:
        pytest.fail(f"could not start the local Slurm cluster:\n{started.stdout}\n{started.stderr}")
    try:
        yield
    finally:
        _cluster("stop")


# ---------------------------------------------------------------- job helpers
def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STOP_GRACE="10")
    env.update(extra)
    return env


def submit(
    script: str, args: list[str], out_dir: Path, nodes: int, env: dict[str, str] | None = None, *sbatch: str
) -> int:
    """`sbatch --nodes=N slurm/SCRIPT ARGS` from the repository root; the job id."""
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={out_dir}/slurm-%j.out", *sbatch]
    done = subprocess.run(
        [*cmd, str(ROOT / "slurm" / script), *args], capture_output=True, text=True, env=env or job_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def job_fields(job_id: int) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_job(job_id: int, out_dir: Path, timeout: float = JOB_TIMEOUT_S) -> tuple[str, int, str]:
    """(JobState, exit code, output) once the job has ended."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job_id)
        state = fields.get("JobState", "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state, int(fields["ExitCode"].split(":")[0]), job_output(job_id, out_dir)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job_id)])
            pytest.fail(f"job {job_id} still {state} after {timeout} s:\n{job_output(job_id, out_dir)[-4000:]}")
        time.sleep(0.5)


def job_output(job_id: int, out_dir: Path) -> str:
    path = out_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_step(job_id: int, run_dir: Path, out_dir: Path, step: int, timeout: float = JOB_TIMEOUT_S) -> str | None:
    """None once the job has logged `step` in `run_dir`; else why not (it ended or `timeout` passed first, a hang
    guard), with the end of the job's output."""
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in metrics(run_dir)):
        state = job_fields(job_id).get("JobState")
        if state not in LIVE_STATES or time.monotonic() > deadline:
            return f"job {job_id} {state} before step {step}:\n{job_output(job_id, out_dir)[-4000:]}"
        time.sleep(0.5)
    return None


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def leftovers(job_id: int, marker: str) -> list[str]:
    """Live processes of the job (SLURM_JOB_ID in their environment) or naming `marker` (its run folder)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.environ().get("SLURM_JOB_ID") == str(job_id) or marker in cmdline:
                found.append(f"{proc.pid}: {cmdline[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def train_args(work: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [str(work / "rl.yaml"), f"logging.run_dir={run_dir}", *overrides]


# ---------------------------------------------------------------- on the cluster
@pytest.mark.slurm
def test_misconfigured_submissions_fail_fast_and_dry_run_prints_the_gpu_plan(
    slurm_cluster: None, work: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    too_many = submit("train.sbatch", train_args(work, run_dir), tmp_path, 2, job_env(TRAIN_NODES="3"))
    no_config = submit("train.sbatch", [str(tmp_path / "missing.yaml")], tmp_path, 2)
    dry = submit(
        "train.sbatch",
        # 8 trainer ranks (DP 8) need at least 8 samples a step
        train_args(
            work, run_dir, "rollout.engine_gpus=4", "train.prompts_per_step=4", "rollout.n_samples_per_prompt=2"
        ),
        tmp_path,
        2,
        job_env(GPUS_PER_NODE="8", DRY_RUN="1", SGLANG_ARGS="--mem-fraction-static 0.7"),
    )
    state, code, out = wait_job(too_many, tmp_path, timeout=120)
    assert (state, code) == ("FAILED", 2), out
    assert "error: TRAIN_NODES=3 but the job has 2 nodes (sbatch --nodes=2): 1 to 1 can train" in out
    state, code, out = wait_job(no_config, tmp_path, timeout=120)
    assert (state, code) == ("FAILED", 2), out
    assert f"error: config file {tmp_path / 'missing.yaml'} does not exist" in out
    state, code, out = wait_job(dry, tmp_path, timeout=120)
    assert (state, code) == ("COMPLETED", 0), out
    engines = [line for line in out.splitlines() if " engine" in line and "sglang.launch_server" in line]
    assert len(engines) == 2, out
    assert "engine0 on node2: " in engines[0] and "--tp-size 4 --base-gpu-id 0" in engines[0]
    assert "--base-gpu-id 4" in engines[1] and engines[1].endswith("--mem-fraction-static 0.7")
    assert "trainer on node1 x 8 ranks: " in out and "rollout.weight_sync=distributed" in out
    assert "rollout.sglang_urls=[...] --resume-if-any" in out  # a first job starts afresh, a damaged run is refused
    assert not run_dir.exists()  # nothing started


@pytest.mark.slurm
def test_slurm_time_limit_warning_checkpoints_the_step_and_the_job_completes(
    slurm_cluster: None, work: Path, tmp_path: Path
) -> None:
    """What `--signal=B:USR1@300` does before the time limit, sent by hand: USR1 to the batch shell only."""
    run_dir = tmp_path / "run"
    args = train_args(work, run_dir, "train.steps=50", "checkpoint.every=0", "eval.every=0")
    job = submit("train.sbatch", args, tmp_path, 2, job_env())
    if error := wait_for_step(job, run_dir, tmp_path, 1, timeout=900):  # the 2-core machine is slow to start a job
        subprocess.run(["scancel", str(job)])
        pytest.fail(error)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True)
    state, code, out = wait_job(job, tmp_path)
    assert (state, code) == ("COMPLETED", 0), out[-4000:]
    assert "received SIGUSR1" in out and "asking the trainer to checkpoint after its current step" in out
    k = max(r["step"] for r in metrics(run_dir))
    assert 1 <= k < 50
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{k:06d}"]  # the stop's only
    assert (run_dir / "checkpoints" / f"step_{k:06d}" / "loop_state.pt").is_file()


def wait_no_leftovers(job_id: int, marker: str, timeout: float = 30.0) -> list[str]:
    """Leftover processes, polled until none or `timeout` (Slurm's KillWait is 10 s on the test cluster;
    torch's shared-memory manager exits shortly after its last client)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(job_id, marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def jobs(slurm_cluster: None, work: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """train.sbatch on 2 nodes for 2 steps; chained after it (afterany), train_colocated.sbatch continuing
    the same run for up to 50 steps on one node, and convert.sbatch with 2 ranks on the other node."""
    out_dir = tmp_path_factory.mktemp("jobs")
    run_dir = out_dir / "run"
    submitted = time.monotonic()
    first = submit("train.sbatch", train_args(work, run_dir), out_dir, 2)
    after = f"--dependency=afterany:{first}"
    colocated = submit("train_colocated.sbatch", train_args(work, run_dir, "train.steps=50"), out_dir, 1, None, after)
    convert_args = ["hf-to-megatron", "--hf-dir", str(work / "model"), "--out", str(out_dir / "ckpt"), "--ep", "2"]
    convert = submit("convert.sbatch", [*convert_args, "--no-progress"], out_dir, 1, job_env(RANKS_PER_NODE="2"), after)
    first_step_s = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job_fields(first).get("JobState") in LIVE_STATES and time.monotonic() < deadline:
        if first_step_s is None and metrics(run_dir):
            first_step_s = time.monotonic() - submitted
        time.sleep(0.5)
    state, code, out = wait_job(first, out_dir)
    first_records = metrics(run_dir)  # before the chained job, which starts now, continues the run
    print(f"\ntrain.sbatch: submission to first step {first_step_s or float('nan'):.1f} s")
    # every job is seen through to its end here, so that no test depends on running before another
    # (scontrol forgets an ended job after MinJobAge; the chained job holds a node until cancelled)
    stopped = cancel_mid_run(colocated, run_dir, out_dir)
    converted = wait_job(convert, out_dir)
    yield dict(
        first=first,
        colocated=colocated,
        convert=convert,
        state=state,
        code=code,
        out=out,
        first_records=first_records,
        run_dir=run_dir,
        out_dir=out_dir,
        stopped=stopped,
        converted=converted,
    )
    subprocess.run(["scancel", str(first), str(colocated), str(convert)], capture_output=True)  # after a failure


@pytest.mark.slurm
def test_disaggregated_job_trains_and_syncs_the_engine(jobs: dict) -> None:
    assert (jobs["state"], jobs["code"]) == ("COMPLETED", 0), jobs["out"][-4000:]
    run_dir: Path = jobs["run_dir"]
    records = jobs["first_records"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/skipped"] == 0.0 and r["weight_sync/bytes"] > 0 for r in records)
    # step 2 generated with the weights synced after update 1: the engine's log-probs are the trainer's
    assert records[1]["logprob_gap/abs_max"] <= 1e-4, records[1]["logprob_gap/abs_max"]
    logs = run_dir / "logs" / f"job-{jobs['first']}"
    assert json.loads((logs / "engines.json").read_text())[0]["weight_version"] == "2"
    assert sorted(p.name for p in logs.glob("*.log")) == [
        "engine0-node2.log",
        "train-node1-rank0.log",
        "train-node1-rank1.log",
    ]
    assert "joining weight-update group" in (logs / "engine0-node2.log").read_text()  # a gloo group, not disk
    assert "1 rollout server(s) healthy" in jobs["out"] and "trainer finished" in jobs["out"]
    assert not wait_no_leftovers(jobs["first"], str(logs))


def cancel_mid_run(job: int, run_dir: Path, out_dir: Path) -> dict:
    """Once the chained job has logged step 3 (resumed at step 2, one step done: mid-run), scancel it and
    wait until it has ended: {"error"} when it ended or hung before, else the scancel's exit code, the
    job's end state and output, and the processes left after it."""
    if error := wait_for_step(job, run_dir, out_dir, 3):
        return {"error": error}
    cancelled = subprocess.run(["scancel", str(job)]).returncode
    state, _, out = wait_job(job, out_dir, timeout=120)
    return {"scancel": cancelled, "state": state, "out": out, "left": wait_no_leftovers(job, str(run_dir))}


@pytest.mark.slurm
def test_chained_colocated_job_resumes_and_cancel_leaves_no_process(jobs: dict) -> None:
    job, run_dir, stopped = jobs["colocated"], jobs["run_dir"], jobs["stopped"]
    assert "error" not in stopped, stopped.get("error")
    assert stopped["scancel"] == 0 and stopped["state"] == "CANCELLED", stopped["out"]
    assert not stopped["left"], "\n".join(stopped["left"])

    records = metrics(run_dir)
    assert [r["step"] for r in records][:3] == [1, 2, 3]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    # the checkpoint's weights went to the colocated engine by handle before step 3 generated
    assert records[2]["logprob_gap/abs_max"] <= 1e-4, records[2]["logprob_gap/abs_max"]
    logs = run_dir / "logs" / f"job-{job}"
    (rank0,) = logs.glob("train-*-rank0.log")
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000002'} (step 2)" in rank0.read_text()
    (engine_log,) = logs.glob("engine0-*.log")
    text = engine_log.read_text()
    assert "released memory" in text and "resumed memory" in text
    assert re.search(r"update_weights_from_tensor: .* weight version 3\b", text), text[-3000:]


@pytest.mark.slurm
def test_convert_job_spreads_the_model_over_srun_ranks(jobs: dict) -> None:
    from megatron_rl.models.checkpoint_io import read_common_state

    state, code, out = jobs["converted"]
    assert (state, code) == ("COMPLETED", 0), out[-4000:]
    layout = read_common_state(jobs["out_dir"] / "ckpt")["layout"]
    assert layout["world_size"] == 2 and layout["expert_model_parallel_size"] == 2
    assert (jobs["out_dir"] / "ckpt" / "hf_config" / "config.json").is_file()
    assert "convert on 1 node(s) x 2 ranks" in out and "convert exited with 0" in out


@pytest.mark.slurm
def test_fully_async_job_on_running_servers(slurm_cluster: None, work: Path, tmp_path: Path) -> None:
    """train.sbatch against a `megatron-rl serve` started here (rollout.sglang_urls, its key in the
    submission's environment): the job starts no server, both nodes train, and the async keys reach the
    trainer: with rollout.async_mode=fully_async (partial rollouts) every weight sync pauses the engine
    with mode "retract", never "abort"."""
    from megatron_rl.parallel.launch import free_port

    key, port, engine_log = "key-of-the-running-engine", free_port(), tmp_path / "engine.log"
    serve = [sys.executable, "-m", "megatron_rl.cli", "serve", "--model", str(work / "model"), "--device", "cpu"]
    serve += ["--host", "127.0.0.1", "--port", str(port), "--max-running-requests", "1"]
    with engine_log.open("w") as log:
        engine = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=job_env(**{KEY_ENV: key}))
    try:
        url = f"http://127.0.0.1:{port}"
        jobplan.wait_healthy([url], 120, [engine.pid], key)
        run_dir = tmp_path / "run"
        overrides = ("rollout.async_mode=fully_async", "rollout.max_staleness=1", "rollout.partial_rollout=true")
        args = train_args(work, run_dir, *overrides, f'rollout.sglang_urls=["{url}"]')
        job = submit("train.sbatch", args, tmp_path, 2, job_env(RANKS_PER_NODE="1", **{KEY_ENV: key}))
        state, code, out = wait_job(job, tmp_path)
        assert (state, code) == ("COMPLETED", 0), out[-4000:]
        assert [r["step"] for r in metrics(run_dir)] == [1, 2]
        assert f"no server of its own: waiting for rollout.sglang_urls {url}" in out
        logs = run_dir / "logs" / f"job-{job}"
        assert sorted(p.name for p in logs.glob("*.log")) == ["train-node1-rank0.log", "train-node2-rank1.log"]
        text = engine_log.read_text()
        assert len(re.findall(r"generation paused \(mode retract, \d+ request\(s\) kept\)", text)) == 2, text[-3000:]
        assert "mode abort" not in text
        assert json.loads((logs / "engines.json").read_text())[0]["weight_version"] == "2"
        assert not (logs / "engine_api_key").exists()  # the engine's own key, not one made for the job
        assert not wait_no_leftovers(job, str(logs))
    finally:
        engine.terminate()
        engine.wait(timeout=30)

"""End-to-end `megatron-rl train` runs on the tiny_math model: the run folder the tests share (built
once per session by tests/conftest.py's `work`), the launch helpers, a cache of straight runs keyed by
their overrides (`RunCache`), the one resume check (`assert_resume_matches`), and the example's SFT
warm start, shortened, that test_example_learns trains from and test_sft checks (`tiny_math_warm_start`).

A straight run is deterministic given its overrides and rank count (seeded sampling, seeded model),
so tests that compare against the same uninterrupted run share one launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from megatron_rl.metrics import TIMING_PREFIXES, read_metrics
from megatron_rl.parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_math"
STEP_TIMEOUT_S = 240
# the example's warm start, shortened: 4 RL steps from it gave 10.0% -> 31.0% held-out greedy accuracy
# (2026-12-06); 300 x 128 rows: 18.5% -> 63.5% (past the regime RL is tested in); 300 x 64: 5.5% -> 12.5%
SFT_STEPS, SFT_ROWS = 300, 96
SFT_EVAL_PROMPTS, SFT_EVAL_SAMPLES = 16, 2
GOOD_ROWS = 8  # train.prompts_per_step 4 x 2 steps: one epoch, every row once
BAD_ROWS = {"invalid_json": 1, "missing_key": 1, "empty_prompt": 1, "too_long": 1}
REWARD = """
def digits(response: str, answer: str) -> float:
    if int(answer) % 2:
        raise ValueError("odd answers are not scored")
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def build_work(root: Path, family: str = "qwen3_moe") -> Path:
    """The tiny_math model of `family` (seed 0), GOOD_ROWS training rows with BAD_ROWS among them, 4
    held-out rows, a custom reward (the share of digits, failing on odd answers) and `rl.yaml` (EP=2)
    under `root`."""
    import tiny_model
    import tiny_task

    tiny_model.build_model(root / "model", seed=0, family=family)
    train, heldout = tiny_task.split_problems(seed=0)
    rows = [json.dumps(tiny_task.task_row(p, i, "train")) for i, p in enumerate(train[:GOOD_ROWS])]
    rows.insert(2, "{not json")
    rows.insert(4, json.dumps({"prompt": "1+2*3="}))  # no reward_model.ground_truth
    rows.insert(6, json.dumps({"prompt": "", "reward_model": {"ground_truth": "7"}}))
    rows.append(json.dumps({"prompt": "1+2*3=" * 20, "reward_model": {"ground_truth": "7"}}))  # > 64 tokens
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    (root / "heldout.jsonl").write_text(
        "".join(json.dumps(tiny_task.task_row(p, i, "heldout")) + "\n" for i, p in enumerate(heldout[:4]))
    )
    (root / "rewards.py").write_text(REWARD)
    (root / "odd_answers").write_text(str(sum(p.answer % 2 for p in train[:GOOD_ROWS])))
    config = {
        "model": {"hf_path": str(root / "model")},
        "parallel": {"expert_model_parallel_size": 2},
        "data": {
            "train_path": str(root / "train.jsonl"),
            "eval_path": str(root / "heldout.jsonl"),
            "max_prompt_tokens": 64,
        },
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 12, "max_concurrency": 1},
        "reward": {"type": "custom", "custom_function": f"{root / 'rewards.py'}:digits", "max_failure_frac": 1.0},
        "algorithm": {"name": "grpo"},
        "train": {"steps": 2, "prompts_per_step": 4, "lr": 1e-3, "seed": 7},
        "eval": {"every": 2, "max_prompts": 4},
        "checkpoint": {"every": 1},
        "logging": {"progress": False, "backends": []},
    }
    (root / "rl.yaml").write_text(json.dumps(config))  # JSON is YAML
    return root


def rank_launcher(ranks: int, launcher: str = "mrl_ranks") -> list[str]:
    """The command that starts `ranks` ranks of the python arguments after it: tests/mrl_ranks.py, or
    torchrun itself (`torchrun`, or the product's `megatron_rl.torchrun`) where a test is about its behaviour."""
    if launcher in ("torchrun", "megatron_rl.torchrun"):
        module = "torch.distributed.run" if launcher == "torchrun" else launcher
        return [sys.executable, "-m", module, "--standalone", f"--nproc-per-node={ranks}"]
    return [sys.executable, str(Path(__file__).with_name("mrl_ranks.py")), str(ranks), str(free_port())]


def command(
    work: Path,
    run_dir: Path,
    *overrides: str,
    ranks: int = 2,
    resume: bool = False,
    hold_after: int | None = None,
    launcher: str = "mrl_ranks",
) -> list[str]:
    """`megatron-rl train` of `work`'s run on `ranks` ranks (`rank_launcher`); `hold_after`: through
    tests/mrl_hold.py, every rank stops once that step's checkpoint is saved."""
    launcher_cmd = [sys.executable] if ranks == 1 else rank_launcher(ranks, launcher)
    if ranks == 1:
        overrides = ("parallel.expert_model_parallel_size=1", *overrides)
    entry = ["-m", "megatron_rl.cli"] if hold_after is None else ["-m", "mrl_hold", str(hold_after)]
    cmd = [*launcher_cmd, *entry, "train", str(work / "rl.yaml"), f"logging.run_dir={run_dir}"]
    return cmd + list(overrides) + (["--resume"] if resume else [])


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    tests = str(Path(__file__).parent)  # mrl_hold (pytest's pythonpath does not reach a child process)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    handle = log.open("w")
    return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_run(process: subprocess.Popen) -> None:
    """kill -9 the run and every process under it, then reap it. Its own process group is not enough:
    torchrun starts each rank in a session of its own."""
    for proc in descendants(process.pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    process.kill()
    process.wait()


def wait_ended(process: subprocess.Popen, log: Path, what: str = "end", timeout: float = STEP_TIMEOUT_S) -> str:
    """Wait for the run `process` to exit and return its log; kill it and fail, saying it did not `what`,
    after `timeout` seconds (a hang guard)."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_run(process)
        pytest.fail(f"the run did not {what} within {timeout} s:\n{log.read_text()[-3000:]}")
    return log.read_text()


def finish(process: subprocess.Popen, log: Path, timeout: float = STEP_TIMEOUT_S) -> str:
    text = wait_ended(process, log, timeout=timeout)
    assert process.returncode == 0, text[-5000:]
    return text


def train(work: Path, run_dir: Path, *overrides: str, **kwargs) -> list[dict]:
    log = run_dir.with_suffix(".log")
    finish(start(command(work, run_dir, *overrides, **kwargs), log), log)
    return read_metrics(run_dir)


def leftovers(work: Path) -> list[str]:
    """Processes whose command line names a file of this test (trainers, torchrun, the engine)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(work) in cmdline:
            found.append(f"{proc.pid}: {cmdline[:200]}")
    return found


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds (a hang guard, not a
    claim about speed)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def wait_for(predicate, process: subprocess.Popen, log: Path, timeout: float = STEP_TIMEOUT_S) -> None:
    """Poll `predicate` while the run `process` lives; fail with the log's tail when it ends first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            pytest.fail(f"the run ended early ({process.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            kill_run(process)
            pytest.fail(f"timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def no_leftovers(work: Path, timeout: float = 60.0) -> None:
    """Wait until no process names a file of `work` (a stopped run's children exit shortly after it)."""
    wait_until(lambda: not leftovers(work), timeout, f"the run's processes to exit: {leftovers(work)}")


def steps_logged(run_dir: Path) -> list[dict]:
    try:
        return [r for r in read_metrics(run_dir) if r["step"] > 0]
    except (FileNotFoundError, ValueError):
        return []


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in records]


class RunCache:
    """Straight (uninterrupted) runs of `work` by (overrides, ranks): each launched once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[tuple, list[dict]] = {}

    def records(self, work: Path, *overrides: str, ranks: int = 2) -> list[dict]:
        key = (str(work), overrides, ranks)
        if key not in self._runs:
            run_dir = self.root / f"straight{len(self._runs)}"
            self._runs[key] = train(work, run_dir, *overrides, ranks=ranks)
        return self._runs[key]


def assert_resume_matches(
    runs: RunCache, work: Path, run_dir: Path, *overrides: str, ranks: int = 2
) -> tuple[list[dict], list[dict]]:
    """`--resume` the interrupted run in `run_dir` to the end: it resumes from a checkpoint, and its
    metrics (timings aside) equal the straight run's of the same overrides. (reference, resumed)."""
    reference = runs.records(work, *overrides, ranks=ranks)
    resumed = train(work, run_dir, *overrides, resume=True, ranks=ranks)
    assert f"resuming from {run_dir / 'checkpoints'}" in run_dir.with_suffix(".log").read_text()
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    differences = [
        f"step {a['step']} {key}: resumed {a.get(key)} != straight {b.get(key)}"
        for a, b in zip(comparable(resumed), comparable(reference), strict=True)
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
    ]
    assert not differences, "\n".join(differences)
    return reference, resumed


# The overrides of the straight run the resume tests share (tests/test_trainer.py's kill -9, tests/
# test_faults.py's SIGUSR1): 3 steps of 2 updates, a checkpoint after step 2, PPO (a critic, trained and
# checkpointed beside the actor, and GAE of its values) with a KL penalty in the reward.
RESUME_RUN = (
    "train.steps=3",
    "train.updates_per_step=2",
    "eval.every=0",
    "checkpoint.every=2",
    "algorithm.name=ppo",
    "critic.lr=1e-3",
    "algorithm.kl_coef=0.5",
    "algorithm.kl_in_reward=true",
)


def kill_after_checkpoint(work: Path, run_dir: Path, *overrides: str, step: int = 2, ranks: int = 2) -> None:
    """Start the run and kill -9 every process of it once step `step`'s checkpoint is complete (the run
    holds there: step `step` + 1 is never logged)."""
    log = run_dir.with_suffix(".log")
    process = start(command(work, run_dir, *overrides, ranks=ranks, hold_after=step), log)
    saved = run_dir / "checkpoints" / f"step_{step:06d}" / "loop_state.pt"
    wait_for(saved.is_file, process, log)
    kill_run(process)


def cli_on_ranks(ranks: int, *args: str, log: Path, timeout: float = 600.0) -> None:
    """`megatron-rl ARGS` on `ranks` ranks (`rank_launcher`) from the repository root, without progress bar or
    logging backends; fails with the end of its log `log` unless it exits 0."""
    cmd = [*rank_launcher(ranks), "-m", "megatron_rl.cli", *args, "logging.progress=false", "logging.backends=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-5000:]


@dataclass(frozen=True)
class WarmStart:
    """A finished `megatron-rl sft` run of the example: its task data and model (`assets`), its run folder and
    the overrides it ran with (after examples/tiny_math/sft.yaml)."""

    assets: Path
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def policy(self) -> Path:
        """The trained policy as a Hugging Face folder: the RL stage's model.hf_path."""
        return self.run_dir / "hf"


def tiny_math_warm_start(root: Path) -> WarmStart:
    """The example's data (prepare.py as run.sh calls it) and SFT stage under `root`, on 2 ranks (EP=2), shortened
    to SFT_STEPS steps of SFT_ROWS rows, with the held-out evaluation at the end on SFT_EVAL_PROMPTS prompts."""
    import prepare

    assets = root / "assets"
    rows = ["--sft-rows", str(SFT_STEPS * SFT_ROWS), "--sft-correct-fraction", "0.4"]
    assert prepare.main(["--out", str(assets), *rows]) == 0
    run_dir = root / "sft"
    overrides = (
        f"model.hf_path={assets / 'model'}",
        f"data.train_path={assets / 'data' / 'sft.jsonl'}",
        f"data.eval_path={assets / 'data' / 'heldout.jsonl'}",
        f"logging.run_dir={run_dir}",
        f"train.steps={SFT_STEPS}",
        f"train.prompts_per_step={SFT_ROWS}",
        f"train.lr_warmup_steps={SFT_STEPS // 20}",
        f"eval.max_prompts={SFT_EVAL_PROMPTS}",
        f"rollout.n_samples_per_prompt={SFT_EVAL_SAMPLES}",
    )
    cli_on_ranks(2, "sft", str(EXAMPLE / "sft.yaml"), *overrides, log=root / "sft.log")
    return WarmStart(assets, run_dir, overrides)

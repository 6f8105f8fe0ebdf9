"""The sbatch scripts (slurm/) on a real two-node Slurm cluster, and the job planner on its own.

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
and stops it (a second worker's fixture would stop it under the first's jobs).

The planner tests (unmarked) check the GPU layouts the CPU cluster cannot run: SGLang flags, GPU
offsets, multi-node engines, the weight-sync defaults, distillation's teacher servers and every refusal.
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

import jobcheck
import psutil
import pytest

import jobplan
from mrl_configs import QWEN3_30B_A3B, write_plan_config

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


# ---------------------------------------------------------------- the planner (no cluster)
NODES4 = ["gpu1", "gpu2", "gpu3", "gpu4"]
ADDRS4 = ["10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config for a 30B-A3B-class policy, laid out as in docs/slurm.md (TP 4, EP 8, ETP 1)."""
    root = tmp_path_factory.mktemp("plan")
    write_plan_config(root, "qwen3_30b_a3b", QWEN3_30B_A3B, "rl.yaml")
    (root / "teacher").mkdir()  # a distillation teacher: the same architecture, twice the layers
    (root / "teacher" / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": 96}))
    return root


def plan(big: Path, mode: str, *overrides: str, nodes: int = 4, gpus: int = 8, **kwargs) -> jobplan.JobPlan:
    return jobplan.make_plan(
        mode, str(big / "rl.yaml"), list(overrides), NODES4[:nodes], ADDRS4[:nodes], gpus, "77", **kwargs
    )


def test_plan_disaggregated_gpu_layout(big: Path) -> None:
    p = plan(
        big,
        "disaggregated",
        "rollout.engine_gpus=4",
        "rollout.return_routed_experts=true",
        "algorithm.routing_replay=r3",
        "algorithm.old_logprob_source=rollout",
        train_nodes=2,
        engine_args=["--ep-size", "4", "--mem-fraction-static", "0.8"],
    )
    assert p.train_nodes == ["gpu1", "gpu2"] and p.ranks_per_node == 8 and p.world_size == 16
    assert p.master_addr == "10.1.0.1" and p.device == "gpu" and p.run_dir == str(big / "run")
    assert [(e.nodes, e.addr, e.base_gpu) for e in p.engines] == [
        (("gpu3",), "10.1.0.3", 0),
        (("gpu3",), "10.1.0.3", 4),
        (("gpu4",), "10.1.0.4", 0),
        (("gpu4",), "10.1.0.4", 4),
    ]
    cmd = p.engines[1].command
    assert cmd[1:5] == ("-m", "sglang.launch_server", "--model-path", str(big / "qwen3_30b_a3b"))
    assert cmd[cmd.index("--tp-size") + 1] == "4" and cmd[cmd.index("--base-gpu-id") + 1] == "4"
    assert "--enable-return-routed-experts" in cmd and "--enable-memory-saver" not in cmd
    assert cmd[-4:] == ("--ep-size", "4", "--mem-fraction-static", "0.8") and "--port" not in cmd
    assert "--nnodes" not in cmd
    assert p.trainer_overrides == ["rollout.engine=sglang", "rollout.weight_sync=distributed", "checkpoint.every=10"]
    assert p.log_dir == str(big / "run" / "logs" / "job-77")
    shell = jobplan.to_shell(p)
    assert "ENGINE_COUNT=4\n" in shell and "TRAIN_HOSTS=(gpu1 gpu2)\n" in shell


def test_plan_defaults_multi_node_engines_and_explicit_sync(big: Path) -> None:
    p = plan(big, "disaggregated", "rollout.engine_gpus=16", "rollout.weight_sync=disk")
    assert p.train_nodes == ["gpu1", "gpu2"]  # half of the nodes by default
    assert len(p.engines) == 1 and p.engines[0].nodes == ("gpu3", "gpu4")
    cmd = p.engines[0].command
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--dist-init-addr") + 1] == "10.1.0.3:20077"
    assert "rollout.weight_sync=distributed" not in p.trainer_overrides  # the user's disk sync is kept


def test_plan_colocated(big: Path) -> None:
    one = plan(big, "colocated", "rollout.engine_gpus=8", nodes=1, gpu_mem_gib=141)  # H200: see the memory test
    assert one.train_nodes == ["gpu1"] and one.world_size == 8 and len(one.engines) == 1
    cmd = one.engines[0].command
    assert "--enable-memory-saver" in cmd and cmd[cmd.index("--mem-fraction-static") + 1] == "0.5"
    assert one.trainer_overrides == [
        "rollout.engine=sglang",
        "rollout.colocate=true",
        "rollout.weight_sync=tensor",
        "checkpoint.every=10",
    ]
    offload = (
        plan(big, "colocated", "rollout.colocate_offload=true", "rollout.engine_gpus=8", nodes=1).engines[0].command
    )
    assert offload[offload.index("--mem-fraction-static") + 1] == "0.7"
    for given in (["--mem-fraction-static", "0.45"], ["--mem-fraction-static=0.45"]):  # SGLANG_ARGS wins
        mine = plan(big, "colocated", "rollout.engine_gpus=8", nodes=1, gpu_mem_gib=141, engine_args=given)
        assert [w for w in mine.engines[0].command if "--mem-fraction-static" in w] == given[:1]
        assert "--mem-fraction-static 0.45 (SGLANG_ARGS)" in mine.memory[1]
    # several nodes: never a NCCL group holding GPU 0 twice (trainer rank 0 and engine 0's TP rank 0)
    two = plan(big, "colocated", "rollout.engine_gpus=8", nodes=2, gpu_mem_gib=141)
    assert two.world_size == 16 and [e.nodes for e in two.engines] == [("gpu1",), ("gpu2",)]
    assert "rollout.weight_sync=disk" in two.trainer_overrides
    with pytest.raises(jobplan.PlanError, match=r"rollout.weight_sync = tensor .* other 1 node"):
        plan(big, "colocated", "rollout.weight_sync=tensor", nodes=2)
    with pytest.raises(jobplan.PlanError, match=r"one NCCL communicator, which NCCL refuses \(duplicate GPU\)"):
        plan(big, "colocated", "rollout.weight_sync=distributed", nodes=1)
    assert "rollout.weight_sync=distributed" in plan(big, "colocated", nodes=2, gpus=0).trainer_overrides  # gloo


def test_plan_exports_nccl_settings_and_runs_sglang_from_its_own_python(big: Path) -> None:
    p = plan(big, "disaggregated", sglang_python="/envs/sglang/bin/python", environ={"NCCL_NVLS_ENABLE": "1"})
    assert p.env == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}  # SGLang's default, or the submission's
    shell = jobplan.to_shell(p)
    assert "export NCCL_CUMEM_ENABLE=0\n" in shell and "export NCCL_NVLS_ENABLE=1\n" in shell
    assert all(e.command[:3] == ("/envs/sglang/bin/python", "-m", "sglang.launch_server") for e in p.engines)
    cpu = plan(big, "disaggregated", nodes=2, gpus=0, sglang_python="/envs/sglang/bin/python", environ={})
    assert cpu.env == {} and cpu.engines[0].command[0] == sys.executable  # the local engine is megatron-rl's


def test_plan_cpu_uses_the_least_world_and_the_local_engine(big: Path) -> None:
    p = plan(big, "disaggregated", nodes=2, gpus=0)
    assert p.device == "cpu" and p.ranks_per_node == 8  # TP 4 and ETP 1 x EP 8: the smallest world is 8
    (engine,) = p.engines
    assert engine.command[1:4] == ("-m", "megatron_rl.cli", "serve") and engine.nodes == ("gpu2",)
    assert "rollout.engine_gpus=1" in p.trainer_overrides
    small = ("parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2")
    assert plan(big, "disaggregated", *small, nodes=2, gpus=0).ranks_per_node == 2


def test_plan_binds_loopback_on_one_node_else_the_node_address_and_no_key_on_a_command_line(big: Path) -> None:
    one = plan(big, "colocated", "rollout.api_key=user-key-1", "rollout.engine_gpus=8", nodes=1, gpu_mem_gib=141)
    (engine,) = one.engines
    assert engine.command[engine.command.index("--host") + 1] == "127.0.0.1" and engine.addr == "127.0.0.1"
    assert "--api-key" not in engine.command and "user-key-1" not in " ".join(engine.command)
    assert "ENGINE_API_KEY=user-key-1\n" in jobplan.to_shell(one)  # eval'd by lib.sh into its 0600 key file
    four = plan(big, "disaggregated", "rollout.engine_gpus=8", train_nodes=2)
    hosts = [e.command[e.command.index("--host") + 1] for e in four.engines]
    assert hosts == [e.addr for e in four.engines] == ["10.1.0.3", "10.1.0.4"]  # the node's address, not 0.0.0.0
    anywhere = plan(
        big, "disaggregated", "rollout.engine_gpus=8", train_nodes=2, bind="0.0.0.0"
    )  # ENGINE_BIND=0.0.0.0: asked for
    assert [e.addr for e in anywhere.engines] == ["10.1.0.3", "10.1.0.4"]
    assert all(e.command[e.command.index("--host") + 1] == "0.0.0.0" for e in anywhere.engines)


def test_the_job_key_file_is_private_and_reaches_the_steps_environment(tmp_path: Path) -> None:
    """lib.sh's write_job_key: rollout.api_key when set, else a new random key per job, in a 0600 file
    and $MEGATRON_RL_ENGINE_API_KEY; task.sh appends it to an SGLang command inside the interpreter."""
    script = (
        f"source {ROOT / 'slurm' / 'lib.sh'}; PYTHON={sys.executable}; ENGINE_API_KEY=$1; "
        'write_job_key "$2"; stat -c %a "$2"; echo "$MEGATRON_RL_ENGINE_API_KEY"'
    )

    def key_of(given: str, name: str) -> tuple[str, str]:
        out = subprocess.run(["bash", "-c", script, "x", given, str(tmp_path / name)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        mode, key = out.stdout.split()
        assert (tmp_path / name).read_text() == key
        return mode, key

    assert key_of("user-key-2", "given") == ("600", "user-key-2")
    first, second = key_of("", "a"), key_of("", "b")
    assert first[0] == second[0] == "600" and len(first[1]) >= 32 and first[1] != second[1]
    # task.sh on a server command: the key is an argument inside Python, not on the command line
    probe = tmp_path / "probe.py"
    probe.write_text("import sys; print(sys.argv[1:])\n")
    env = {**os.environ, "MEGATRON_RL_ENGINE_API_KEY": first[1], "PYTHONPATH": str(tmp_path), "SLURM_NODEID": "1"}
    (tmp_path / "logs").mkdir()
    cmd = ["bash", str(ROOT / "slurm" / "task.sh"), "serve", "engine0", "127.0.0.1", str(tmp_path / "logs")]
    out = subprocess.run(
        [*cmd, "--", sys.executable, "-m", "probe", "--host", "127.0.0.1"], env=env, capture_output=True
    )
    assert out.returncode == 0, out.stderr
    log = next((tmp_path / "logs").glob("engine0-*.log")).read_text()
    assert f"['--host', '127.0.0.1', '--api-key', '{first[1]}']" in log
    assert first[1] not in log.splitlines()[0]  # the command line task.sh reports (and ps shows)


@pytest.mark.parametrize(
    "mode, overrides, kwargs, message",
    [
        ("disaggregated", [], {"train_nodes": 4}, r"TRAIN_NODES=4 but the job has 4 nodes \(sbatch --nodes=4\)"),
        ("disaggregated", [], {"nodes": 1}, r"the job has 1 node; train.sbatch needs at least 2"),
        ("disaggregated", ["rollout.colocate=true", "rollout.weight_sync=tensor"], {}, r"train_colocated.sbatch"),
        ("colocated", [], {"train_nodes": 1}, r"TRAIN_NODES=1, but train_colocated.sbatch trains on all 4"),
        ("disaggregated", ["rollout.engine_gpus=3"], {}, r"rollout.engine_gpus \(3\) must divide the GPUs per node"),
        ("disaggregated", ["rollout.engine_gpus=24"], {}, r"needs 3 nodes per engine"),
        ("disaggregated", ["model.hf_path=/nonexistent"], {}, r"model.hf_path = /nonexistent: no config.json"),
        ("disaggregated", [], {"ranks_per_node": 9}, r"RANKS_PER_NODE=9 must be between 1 and the 8 GPUs"),
        (
            "disaggregated",
            [],
            {"train_nodes": 1, "ranks_per_node": 4},
            r"world size 4 is not divisible .* \(trainer world = 1 training node\(s\) x 4 ranks per node\)",
        ),
    ],
)
def test_plan_refusals(big: Path, mode: str, overrides: list[str], kwargs: dict, message: str) -> None:
    nodes = kwargs.pop("nodes", 4)
    with pytest.raises(jobplan.PlanError, match=message):
        plan(big, mode, *overrides, nodes=nodes, **kwargs)


def test_plan_with_running_servers_starts_none_and_trains_on_every_node(big: Path) -> None:
    """rollout.sglang_urls (a router or servers) in the job's config: no server or router of its own,
    every node trains, the URLs reach the trainer as the config gives them; no engine memory to size."""
    urls = 'rollout.sglang_urls=["http://10.9.0.1:30000"]'
    p = plan(big, "disaggregated", urls)
    assert p.train_nodes == NODES4 and p.world_size == 32 and p.engines == [] and p.router is False
    assert p.external_urls == ["http://10.9.0.1:30000"]
    assert p.trainer_overrides == ["rollout.engine=sglang", "rollout.weight_sync=distributed", "checkpoint.every=10"]
    assert len(p.memory) == 1 and p.memory[0].startswith("memory per GPU of 80 GiB (arithmetic): trainer")
    shell = jobplan.to_shell(p)
    assert "ENGINE_COUNT=0\n" in shell and "EXTERNAL_URLS=(http://10.9.0.1:30000)\n" in shell
    assert "START_ROUTER=0\n" in shell and "START_ROUTER=auto\n" in jobplan.to_shell(plan(big, "disaggregated"))
    assert "no server of its own: rollout.sglang_urls = [http://10.9.0.1:30000]" in jobplan.describe(p)
    assert not [w for w in p.warnings if "not used" in w]
    ignored = plan(big, "disaggregated", urls, engine_args=["--ep-size", "8"]).warnings[-1]
    assert ignored == "SGLANG_ARGS (--ep-size 8) is not used: rollout.sglang_urls gives the servers"
    assert plan(big, "disaggregated", urls, nodes=1).world_size == 8  # one node is a job
    assert plan(big, "disaggregated", urls, train_nodes=4).world_size == 32
    with pytest.raises(jobplan.PlanError, match=r"TRAIN_NODES=2, but rollout.sglang_urls = \[http://10.9.0.1:30000\]"):
        plan(big, "disaggregated", urls, train_nodes=2)
    with pytest.raises(jobplan.PlanError, match=r"but train_colocated.sbatch starts its own engines"):
        plan(big, "colocated", urls, nodes=1)
    with pytest.raises(jobplan.PlanError, match=r"ROUTER=1, but rollout.sglang_urls .* unset ROUTER"):
        plan(big, "disaggregated", urls, router=True)


def test_plan_places_the_teachers_servers_and_counts_their_memory(big: Path) -> None:
    """distill.teacher: the last rollout node serves the teacher (TEACHER_GPUS per server, TEACHER_ARGS only),
    its memory is the teacher's own, and the trainer is told the servers instead of the folder."""
    teacher = str(big / "teacher")
    opd = ("algorithm.name=opd", f"distill.teacher={teacher}", "rollout.engine_gpus=4")
    p = plan(big, "disaggregated", *opd, train_nodes=2, teacher_gpus=8, engine_args=["--ep-size", "4"],
             teacher_args=["--enable-torch-compile"])  # fmt: skip
    assert [(e.nodes, e.base_gpu) for e in p.engines] == [(("gpu3",), 0), (("gpu3",), 4)]  # the policy keeps gpu3
    (server,) = p.teachers
    assert (server.nodes, server.addr, server.base_gpu) == (("gpu4",), "10.1.0.4", 0)
    assert server.command[1:5] == ("-m", "sglang.launch_server", "--model-path", teacher)
    assert server.command[server.command.index("--tp-size") + 1] == "8"
    assert server.command[-1] == "--enable-torch-compile" and "--ep-size" not in server.command
    assert p.trainer_overrides[2:4] == ["distill.teacher=null", f"distill.tokenizer={teacher}"]
    # by hand: a layer of Qwen3-30B-A3B holds 623,120,640 parameters (attention 18,874,624, 128 experts of
    # 3 x 2048 x 768, router, norms), the embeddings 2 x 151,936 x 2048, so 96 layers: 60,441,913,344; bf16
    # over 8 GPUs 14.07 GiB. SGLang's default fraction for 80 GiB at TP 8: reserve 512 + 1.5 x 8192 + 1024 +
    # 2 x 512 + 8 x 58 prefill graphs = 15,312 MiB, (81,920 - 15,312) / 81,920 = 0.813: 65.04 GiB. KV per
    # token: 96 layers x (K, V) x 1 of 4 KV heads per GPU x 128 x 2 bytes = 49,152.
    weights = 60_441_913_344 * 2 / 8 / 2**30
    tokens = int((0.813 * 80 - weights) * 2**30 // 49_152)
    assert tokens == 1_113_397
    assert p.memory[2] == (
        f"teacher (8 GPUs): 14.1 GiB bf16 weights (60.4 B parameters) + 51.0 GiB KV cache ({tokens:,} bf16 tokens "
        f"at 49,152 bytes: {tokens // 2048} sequences of 2,048) = 65.0 GiB: --mem-fraction-static 0.813 (SGLang's "
        "default for 80 GiB and TP 8)"
    )
    shell = jobplan.to_shell(p)
    assert "ENGINE_COUNT=2\n" in shell and "TEACHER_COUNT=1\n" in shell and "TEACHER_NODES_0=(gpu4)\n" in shell
    assert f"1 teacher server(s) of {teacher} (distill.teacher): #0 on gpu4 from GPU 0" in jobplan.describe(p)
    two = plan(big, "disaggregated", *opd, train_nodes=2, teacher_gpus=4)  # rollout.engine_gpus by default too
    assert [(e.nodes, e.base_gpu) for e in two.teachers] == [(("gpu4",), 0), (("gpu4",), 4)]
    assert "teacher (4 GPUs): 28.1 GiB bf16 weights" in two.memory[2]
    small = plan(big, "disaggregated", *opd, train_nodes=2, teacher_gpus=2).warnings[-1]
    assert small.startswith("a teacher server's KV cache holds 109,544 tokens: 53 whole sequences of 2,048")
    assert small.endswith("TEACHER_GPUS=4 would hold them")
    # on CPU the teacher's local engine runs beside the policy's, on the rollout node
    cpu = plan(big, "disaggregated", *opd, "parallel.tensor_model_parallel_size=1", nodes=2, gpus=0)
    assert [e.nodes for e in cpu.engines] == [e.nodes for e in cpu.teachers] == [("gpu2",)]
    assert cpu.teachers[0].command[1:6] == ("-m", "megatron_rl.cli", "serve", "--model", teacher)
    # running teacher servers: the job starts none
    urls = plan(big, "disaggregated", "distill.teacher_urls=[http://10.9.0.2:30000]", f"distill.tokenizer={teacher}")
    assert urls.teachers == [] and "TEACHER_COUNT=0\n" in jobplan.to_shell(urls)
    assert "teacher: no server of its own: distill.teacher_urls = [http://10.9.0.2:30000]" in jobplan.describe(urls)


@pytest.mark.parametrize(
    "mode, overrides, kwargs, message",
    [
        ("colocated", [], {"nodes": 1}, r"train_colocated.sbatch gives every GPU .* distill.teacher_urls"),
        ("disaggregated", ['rollout.sglang_urls=["http://h:1"]'], {}, r"rollout.sglang_urls gives the servers: .*"),
        ("disaggregated", [], {"teacher_nodes": 2}, r"TEACHER_NODES=2 of the job's 2 rollout node\(s\) .* 1 to 1 can"),
        ("disaggregated", [], {"teacher_gpus": 3}, r"TEACHER_GPUS \(3\) must divide the GPUs per node \(8\)"),
        # 60.4 B parameters in bf16: 112.6 GiB on 1 GPU, over its 66.4 GiB share; on 2, 56.3 GiB leave 10 GiB
        ("disaggregated", [], {"teacher_gpus": 1}, r"a teacher server needs 112.6 GiB .* TEACHER_GPUS=2 would fit"),
        ("disaggregated", ["distill.teacher=/nonexistent"], {}, r"distill.teacher = /nonexistent: no config.json"),
    ],
)
def test_plan_refuses_a_teacher_it_cannot_serve(
    big: Path, mode: str, overrides: list[str], kwargs: dict, message: str
) -> None:
    nodes = kwargs.pop("nodes", 4)
    opd = ["algorithm.name=opd", f"distill.teacher={big / 'teacher'}", "rollout.engine_gpus=8"]
    with pytest.raises(jobplan.PlanError, match=message):
        plan(big, mode, *opd, *overrides, nodes=nodes, **kwargs)


SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel", "salloc", "sacct")


def path_without_slurm(tmp_path: Path) -> str:
    """$PATH with each folder that holds a Slurm command replaced by links to its other programs."""
    folders = []
    for i, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not any(Path(folder, command).exists() for command in SLURM_COMMANDS):
            folders.append(folder)
            continue
        links = tmp_path / f"path{i}"
        links.mkdir()
        for program in Path(folder).iterdir():
            if program.name not in SLURM_COMMANDS:
                (links / program.name).symlink_to(program)
        folders.append(str(links))
    return os.pathsep.join(folders)


def test_dry_run_plans_without_slurm(big: Path, tmp_path: Path) -> None:
    """DRY_RUN=1 bash slurm/train.sbatch where no Slurm command is on PATH: NODES and GPUS_PER_NODE give
    the job; the plan, its memory figures and the commands are printed, and no missing command was tried
    (bash's command_not_found_handle, exported to the script, would report it)."""
    env = job_env(PATH=path_without_slurm(tmp_path), DRY_RUN="1", NODES="5", GPUS_PER_NODE="8", TRAIN_NODES="2")
    assert shutil.which("sbatch", path=env["PATH"]) is None and shutil.which("bash", path=env["PATH"])
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")} | {"ROUTER": "0"}
    missing = tmp_path / "missing_commands"  # written by the handler even where stderr goes to /dev/null
    env["MISSING_COMMANDS"] = str(missing)
    env["BASH_FUNC_command_not_found_handle%%"] = '() { echo "$1" >>"$MISSING_COMMANDS"; return 127; }'
    env |= {"TEACHER_GPUS": "8", "TEACHER_ARGS": "--enable-torch-compile"}  # node5 serves distill.teacher
    args = [str(big / "rl.yaml"), "rollout.engine_gpus=4", "algorithm.name=opd", f"distill.teacher={big / 'teacher'}"]
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not missing.exists(), missing.read_text()
    *engines, teacher = [line for line in done.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(engines) == 4 and "engine0 on node3: " in engines[0] and "--tp-size 4 --base-gpu-id 4" in engines[1]
    assert "teacher0 on node5: " in teacher and teacher.endswith("--tp-size 8 --base-gpu-id 0 --enable-torch-compile")
    assert "trainer on node1,node2 x 8 ranks: " in done.stdout and "rollout.sglang_urls=[...]" in done.stdout
    assert "distill.teacher=null" in done.stdout and "distill.teacher_urls=[...]" in done.stdout
    assert "memory per GPU of 80 GiB" in done.stderr and "engine (4 GPUs): 14.2 GiB bf16 weights" in done.stderr
    assert "teacher (8 GPUs): 14.1 GiB bf16 weights (60.4 B parameters)" in done.stderr
    assert not (big / "run").exists()  # nothing started


def test_plan_cli_reports_a_missing_config_in_one_line(big: Path, capsys: pytest.CaptureFixture) -> None:
    rc = jobplan._main(["plan", "--mode", "disaggregated", "--nodes", "a,b", "--addrs", "1,2", str(big / "nope.yaml")])
    assert rc == 2
    expected = f"error: config file {big / 'nope.yaml'} does not exist (relative paths start at {os.getcwd()})"
    assert capsys.readouterr().err.strip() == expected


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


def test_colocated_engines_get_no_router_and_a_health_check_that_does_not_generate(big: Path, tmp_path: Path) -> None:
    """A colocated job's SGLang servers release their weights and KV cache while the trainer updates:
    SGLang's default /health generates a token, and sglang-router calls it every 60 s. The plan exports
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 to those jobs and refuses a router; lib.sh starts none
    by default."""
    one = plan(big, "colocated", nodes=1, gpu_mem_gib=141)
    assert one.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert "export SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0\n" in jobplan.to_shell(one)
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in plan(big, "disaggregated").env  # memory stays
    with pytest.raises(jobplan.PlanError, match=r"ROUTER=1 with train_colocated.sbatch: .* unset ROUTER"):
        plan(big, "colocated", nodes=1, router=True)
    assert plan(big, "disaggregated", router=True).router
    # lib.sh's default: a router only in a disaggregated GPU job (here sglang_router imports when installed)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")  # an interpreter whose `import sglang_router` succeeds
    fake.chmod(0o755)

    def default(mode: str, gpus: int) -> str:
        script = f"source {ROOT / 'slurm' / 'lib.sh'}; SGLANG_PYTHON={fake}; default_router {mode} {gpus}"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert [default("disaggregated", 8), default("colocated", 8), default("disaggregated", 0)] == ["1", "0", "0"]


# ---------------------------------------------------------------- presets of the largest MoE models


@pytest.fixture(scope="module")
def preset_configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each preset's published config.json in a folder, and a YAML naming it (nothing else set)."""
    import presets

    root = tmp_path_factory.mktemp("presets")
    for name, preset in presets.PRESETS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(preset.hf_config))
        config = {
            "model": {"hf_path": str(root / name)},
            "data": {"train_path": "t.jsonl"},
            "logging": {"run_dir": "r"},
        }
        (root / f"{name}.yaml").write_text(json.dumps(config))
    return root


def _preset_plan(root: Path, name: str, train_nodes: int, *overrides: str, gpu_mem_gib: float = 80.0):  # noqa: ANN202
    import presets

    nodes = [f"n{i}" for i in range(train_nodes + presets.PRESETS[name].rollout_nodes)]
    addrs = [f"10.2.{i // 200}.{i % 200 + 1}" for i in range(len(nodes))]
    return jobplan.make_plan(
        "disaggregated", str(root / f"{name}.yaml"), list(overrides), nodes, addrs, 8, "9",
        train_nodes=train_nodes, preset=name, gpu_mem_gib=gpu_mem_gib,
    )  # fmt: skip


def test_a_preset_of_another_model_is_refused_naming_what_differs(preset_configs: Path) -> None:
    """GLM-4.5's checkpoint under DeepSeek-V3's preset: one PlanError naming both, not the layout's error."""
    nodes = [f"n{i}" for i in range(32)]
    addrs = [f"10.2.0.{i + 1}" for i in range(32)]
    needle = (
        r"PRESET=deepseek-v3-671b is the layout of another model: model\.hf_path's \S*glm-4\.5-355b/config\.json has "
        r"model_type 'glm4_moe' \(the preset's: 'deepseek_v3'\), num_hidden_layers 92 \(the preset's: 61\), "
        r"hidden_size 5120 \(the preset's: 7168\), num_attention_heads 96 \(the preset's: 128\), "
        r"n_routed_experts 160 \(the preset's: 256\); choose the preset of this model"
    )
    with pytest.raises(jobplan.PlanError, match=needle):
        jobplan.make_plan(
            "disaggregated", str(preset_configs / "glm-4.5-355b.yaml"), [], nodes, addrs, 8, "9",
            train_nodes=28, preset="deepseek-v3-671b",
        )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "nodes", "layout", "figures"),
    [
        (
            "deepseek-v3-671b", 32, (8, 7, 32, False),
            "trainer 55.4 GiB static (weights 6.4 + gradients 12.8 + optimizer 36.2) on its largest pipeline stage, "
            "2 of 7 with 9 layers, within 90% (72.0 GiB)",
        ),
        (
            "kimi-k2", 32, (8, 8, 24, True),
            "trainer 53.5 GiB static (weights 10.8 + gradients 21.6 + optimizer 21.2) on its largest pipeline stage, "
            "2 of 8 with 8 layers, within 90% (72.0 GiB); 84.7 GiB of optimizer state on the host",
        ),
        (
            "glm-4.5-355b", 8, (8, 6, 8, True),
            "trainer 69.6 GiB static (weights 13.9 + gradients 27.9 + optimizer 27.9) on its largest pipeline stage, "
            "6 of 6 with 15 layers, within 90% (72.0 GiB); 111.4 GiB of optimizer state on the host",
        ),
        (
            "deepseek-v3.2-671b", 32, (8, 7, 32, False),
            "trainer 55.5 GiB static (weights 6.4 + gradients 12.8 + optimizer 36.2) on its largest pipeline stage, "
            "2 of 7 with 9 layers, within 90% (72.0 GiB)",
        ),
        (
            "glm-5-744b", 36, (8, 8, 32, False),
            "trainer 52.9 GiB static (weights 6.1 + gradients 12.2 + optimizer 34.5) on its largest pipeline stage, "
            "2 of 8 with 10 layers, within 90% (72.0 GiB)",
        ),
        (
            "qwen3-next-80b-a3b", 5, (1, 2, 16, False),
            "trainer 47.9 GiB static (weights 6.7 + gradients 13.4 + optimizer 27.8) on its largest pipeline stage, "
            "2 of 2 with 24 layers, within 90% (72.0 GiB)",
        ),
        (
            "qwen3.5-397b-a17b", 18, (1, 4, 32, False),
            "trainer 68.2 GiB static (weights 11.2 + gradients 22.3 + optimizer 34.8) on its largest pipeline stage, "
            "1 of 4 with 15 layers, within 90% (72.0 GiB)",
        ),
        (
            "gpt-oss-120b", 5, (2, 1, 32, False),
            "trainer 66.8 GiB static (weights 8.7 + gradients 17.3 + optimizer 40.8) within 90% (72.0 GiB)",
        ),
    ],
)  # fmt: skip
def test_presets_plan_on_their_h100_clusters_with_rollout_nodes(
    preset_configs: Path, name: str, nodes: int, layout: tuple, figures: str
) -> None:
    import presets

    from megatron_rl.config import load_config
    from megatron_rl.models.families import parameter_counts

    preset = presets.PRESETS[name]
    assert preset.train_nodes + preset.rollout_nodes == nodes
    p = _preset_plan(preset_configs, name, preset.train_nodes)
    assert p.world_size == preset.train_nodes * 8 and len(p.engines) == 1
    assert len(p.engines[0].nodes) == preset.rollout_nodes
    assert p.memory[0] == f"memory per GPU of 80 GiB (arithmetic): {figures}"
    assert p.memory[1].startswith(f"engine ({preset.rollout['engine_gpus']} GPUs): ")
    assert f"{p.memory[0]}\n{p.memory[1]}" in jobplan.describe(p)
    assert not [w for w in p.warnings if "max_concurrency" in w]
    cfg = load_config(str(preset_configs / f"{name}.yaml"), presets.preset_overrides(name))
    par = cfg.parallel
    got = (
        *(getattr(par, f"{k}_model_parallel_size") for k in ("tensor", "pipeline", "expert")),
        par.optimizer_cpu_offload,
    )
    assert got == layout
    mem = jobcheck.trainer_memory(cfg, p.world_size)
    assert mem.total <= jobcheck.STATIC_MEMORY_SHARE * 80
    total = sum(parameter_counts(cfg.model)) / 1e9
    published = {"deepseek-v3-671b": 671.0, "kimi-k2": 1026.4, "glm-4.5-355b": 352.8, "gpt-oss-120b": 116.8,
                 "deepseek-v3.2-671b": 671.9, "glm-5-744b": 743.9, "qwen3-next-80b-a3b": 79.7,
                 "qwen3.5-397b-a17b": 396.3}  # fmt: skip
    assert published[name] == pytest.approx(total, abs=0.1)
    with pytest.raises(jobplan.PlanError, match=r"world size .* is not divisible by"):
        _preset_plan(preset_configs, name, preset.train_nodes // 2 - 1)
    # the trainer gets the layout too (lib.sh: before the job's own overrides), without the model's shape
    trainer = load_config(str(preset_configs / f"{name}.yaml"), p.preset_overrides).parallel
    assert vars(trainer) == vars(par)
    assert not [o for o in p.preset_overrides if o.startswith("model.") and o.split("=")[0] not in presets.RUN_CHOICES]


def test_dry_run_trainer_command_holds_the_presets_layout(preset_configs: Path, tmp_path: Path) -> None:
    """PRESET=name lays out the trainer as well as the plan: its command gets the preset's layout before the
    job's own overrides (which win); before, only the planner saw it and the trainer ran the YAML's layout."""
    env = job_env(PATH=path_without_slurm(tmp_path), DRY_RUN="1", NODES="32", GPUS_PER_NODE="8", TRAIN_NODES="28")
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")} | {"ROUTER": "0", "PRESET": "deepseek-v3-671b"}
    config = str(preset_configs / "deepseek-v3-671b.yaml")
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), config, "train.lr=2e-6"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (trainer,) = [line for line in done.stdout.splitlines() if " trainer on node1," in line]
    words = trainer.split(f" train {config} ", 1)[1].split()
    layout = "parallel.tensor_model_parallel_size=8 parallel.pipeline_model_parallel_size=7"
    assert layout in " ".join(words) and words.index("train.lr=2e-6") > words.index("rollout.engine_gpus=32")
    assert "preset overrides (before the job's own): model.params_dtype=bf16" in done.stderr


def test_preset_memory_check_refuses_a_layout_that_does_not_fit(preset_configs: Path) -> None:
    with pytest.raises(
        jobplan.PlanError,
        match=r"needs about 96 GiB per GPU .* stage, 2 of 8 with 8 layers .* 5.64 B expert .* GPU_MEM_GIB=80: .*"
        r"set parallel.optimizer_cpu_offload=true",
    ):
        _preset_plan(preset_configs, "kimi-k2", 24, "parallel.optimizer_cpu_offload=false")
    with pytest.raises(jobplan.PlanError, match=r"needs about 70 GiB .* over 90% of GPU_MEM_GIB=40"):
        _preset_plan(preset_configs, "glm-4.5-355b", 6, gpu_mem_gib=40)  # A100 40 GB
    _preset_plan(preset_configs, "glm-4.5-355b", 6, gpu_mem_gib=141)  # H200
    for name, nodes in (("deepseek-v3.2-671b", 28), ("glm-5-744b", 32)):  # their H100 layouts plan on H200s too
        assert "trainer 5" in _preset_plan(preset_configs, name, nodes, gpu_mem_gib=141).memory[0]
    with pytest.raises(jobplan.PlanError, match=r"needs about 89 GiB .* 2 of 2 with 24 layers .* 4.83 B expert"):
        _preset_plan(preset_configs, "qwen3-next-80b-a3b", 2, "parallel.expert_model_parallel_size=8")
    assert (
        "trainer 89.3 GiB"
        in _preset_plan(  # the same 2 nodes on H200s
            preset_configs, "qwen3-next-80b-a3b", 2, "parallel.expert_model_parallel_size=8", gpu_mem_gib=141
        ).memory[0]
    )
    with pytest.raises(
        jobplan.PlanError,
        match="PRESET='llama-405b'; allowed: deepseek-v3-671b, deepseek-v3.2-671b, glm-4.5-355b, glm-5-744b, gpt-oss",
    ):
        jobplan.make_plan(
            "disaggregated", str(preset_configs / "kimi-k2.yaml"), [], ["a"], ["1"], 8, "1", preset="llama-405b"
        )

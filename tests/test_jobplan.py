"""The Slurm job planner (slurm/jobplan.py) on its own, no cluster: the GPU layouts the CPU cluster of
tests/test_slurm.py cannot run. SGLang flags, GPU offsets, multi-node engines, the weight-sync defaults, NCCL
settings, the job's key, servers already running, distillation's teacher servers and every refusal; a dry run
with no Slurm installed; a colocated job's health checks and router."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm import job_env

import jobplan
from mrl_configs import QWEN3_30B_A3B, write_plan_config

ROOT = Path(__file__).resolve().parents[1]


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

"""Where a Slurm job's parts run: the planner's `make_plan` (slurm/jobplan.py is its command line).

`make_plan` checks the whole submission before anything starts (the config file, the config itself,
the node split, the engines' GPUs and the trainer's parallel layout on the world the job gives it;
memory per GPU and the tokenizer: slurm/jobcheck.py; a layout preset: slurm/presets.py). Its layout:

- disaggregated: the first `train_nodes` nodes train (one rank per GPU; on CPU the smallest world
  the parallel layout accepts), the others serve rollouts: `gpus_per_node / rollout.engine_gpus`
  SGLang servers per node (a server of more GPUs than a node has spans several nodes), or one
  local engine (`megatron-rl serve`) per node on CPU. Weights go over a NCCL (gloo on CPU) group.
- with `rollout.sglang_urls` (servers or a router that already run): no engine, every node trains.
- with `distill.teacher`: the teacher's servers on the last rollout nodes (slurm/jobteacher.py).
- colocated: every node trains and serves; the engines release their memory while the trainer
  updates (`--enable-memory-saver`, a default `--mem-fraction-static`). Weights go by handle
  (`rollout.weight_sync=tensor`) on one node; on more, from disk on GPUs (a NCCL group would hold
  one GPU twice, which NCCL refuses) and over a gloo group on CPU.

GPU jobs export NCCL_CUMEM_ENABLE and NCCL_NVLS_ENABLE to every step (SGLang's defaults unless set
at submission), so trainer and engines agree in the weight-update group. Colocated GPU jobs also export
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (a /health without a generation on released memory) and
start no sglang-router (its periodic health checks). SGLang may run from an
environment of its own (`--sglang-python`, SGLANG_PYTHON in the scripts).

Jobs checkpoint every `CHECKPOINT_EVERY` (10) steps unless the config sets `checkpoint.every`: a
requeued or preempted job (`#SBATCH --requeue`) resumes from the newest checkpoint, not step 0.

Anything the user set explicitly in the YAML or the overrides wins over these defaults, unless the
placement makes it impossible (then the error says which key and why).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings in slurm/
    sys.path.append(str(Path(__file__).resolve().parent))
import jobcheck  # noqa: E402
import jobteacher  # noqa: E402

CHECKPOINT_EVERY = 10  # the trainer's checkpoint cadence in a job, unless the config sets checkpoint.every
TEACHER_GPUS_KEY = jobteacher.TEACHER_ROLE.gpus_key


class PlanError(ValueError):
    """A submission that cannot run; the message names the setting (variable, flag or config key)."""


@dataclass(frozen=True)
class Engine:
    """One rollout server: its nodes (the first serves HTTP), the GPUs it takes on each, its command
    without `--port` (added on the node, where a free port is picked)."""

    index: int
    nodes: tuple[str, ...]
    addr: str
    base_gpu: int
    command: tuple[str, ...]


@dataclass
class JobPlan:
    mode: str
    device: str  # "gpu" or "cpu"
    run_dir: str
    log_dir: str
    train_nodes: list[str]
    ranks_per_node: int
    master_addr: str
    engines: list[Engine]
    trainer_overrides: list[str] = field(default_factory=list)
    # PRESET's layout (slurm/presets.py): the trainer gets it before the job's own overrides, which win
    preset_overrides: list[str] = field(default_factory=list)
    router: bool | None = False  # None: lib.sh's default (when sglang_router imports)
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # exported to every step (trainer and engines)
    external_urls: list[str] = field(default_factory=list)  # rollout.sglang_urls: the job starts no server
    teachers: list[Engine] = field(default_factory=list)  # the servers of distill.teacher (slurm/jobteacher.py)
    teacher_urls: list[str] = field(default_factory=list)  # distill.teacher_urls: running ones, not the job's
    teacher_model: str = ""  # the folder of distill.teacher, which the teachers serve
    memory: list[str] = field(default_factory=list)  # the figures per GPU (GPU jobs)
    warnings: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.train_nodes) * self.ranks_per_node


def _explicit_keys(config_path: str, overrides: Sequence[str]) -> set[str]:
    """Dotted keys set in the YAML file or on the command line (as opposed to defaults)."""
    from omegaconf import OmegaConf

    keys: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            keys.add(prefix.rstrip("."))

    walk(OmegaConf.to_container(OmegaConf.load(config_path)) or {}, "")
    keys.update(item.split("=", 1)[0].lstrip("+~") for item in overrides if "=" in item)
    return keys


def _min_world(cfg: Any) -> int:
    """The smallest trainer world the parallel layout accepts (TP x PP times the least data parallelism);
    the model's side of the layout is `validate_run`'s, in `make_plan`."""
    from megatron_rl.config import ConfigError
    from megatron_rl.parallel.layout import check_layout

    par = cfg.parallel
    step = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    last: ConfigError | None = None
    for dp in range(1, 1025):
        try:
            check_layout(par, step * dp)
            return step * dp
        except ConfigError as err:
            last = err
    raise PlanError(f"no trainer world size up to {step * 1024} fits the parallel layout: {last}")


def _engine_layout(
    mode: str, gpus_per_node: int, engine_gpus: int, rollout_nodes: list[str], key: str = "rollout.engine_gpus"
) -> list[list[tuple[str, int]]]:
    """Per engine, its (node, first GPU) pairs (`key`: the setting of `engine_gpus`, in the messages)."""
    if gpus_per_node == 0:
        return [[(node, 0)] for node in rollout_nodes]
    if engine_gpus <= gpus_per_node:
        if gpus_per_node % engine_gpus:
            raise PlanError(
                f"{key} ({engine_gpus}) must divide the GPUs per node ({gpus_per_node}): "
                "every GPU of a rollout node serves"
            )
        return [[(node, k * engine_gpus)] for node in rollout_nodes for k in range(gpus_per_node // engine_gpus)]
    if engine_gpus % gpus_per_node:
        raise PlanError(
            f"{key} ({engine_gpus}) spans several nodes and must be a multiple of the GPUs per node ({gpus_per_node})"
        )
    span = engine_gpus // gpus_per_node
    if len(rollout_nodes) % span:
        what = "nodes" if mode == "colocated" else "rollout nodes"
        raise PlanError(
            f"{key} ({engine_gpus}) needs {span} nodes per engine, which does not divide the "
            f"{len(rollout_nodes)} {what}"
        )
    return [[(node, 0) for node in rollout_nodes[i : i + span]] for i in range(0, len(rollout_nodes), span)]


# SGLang sets these in its own processes unless they are set (sglang/srt/entrypoints/engine.py,
# 0.5.23: both 0 without symmetric memory); the trainer must use the same values in the weight-update
# group, so the job exports them to every step. A value set at submission wins, on both sides.
NCCL_ENV_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
# SGLang's /health runs a one-token generation by default (0.5.23), also while a colocated engine has
# released its weights and KV cache for the trainer: a prefill on freed memory. Off for those engines.
RELEASED_ENGINE_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
# A colocated engine's static share (weights + KV cache) of each GPU; the trainer keeps the rest
# while the engine generates (its model, gradients and, without rollout.colocate_offload, optimizer state).
COLOCATED_MEM_FRACTION = {False: "0.5", True: "0.7"}  # by rollout.colocate_offload


def nccl_env(environ: dict[str, str]) -> dict[str, str]:
    """The NCCL settings a GPU job exports: the submission's where set, else SGLang's own defaults."""
    return {key: environ.get(key, default) for key, default in NCCL_ENV_DEFAULTS.items()}


def engine_bind(bind: str, job_nodes: int, node_addr: str) -> str:
    """The address a server binds: `bind` unless "auto", which is 127.0.0.1 on a one-node job (only
    this machine reaches it) and else the server's node address (the job's other nodes), not 0.0.0.0."""
    if bind != "auto":
        return bind
    return "127.0.0.1" if job_nodes == 1 else node_addr


def _engine_command(
    cfg: Any, gpu: bool, python: str, bind: str, base_gpu: int, nnodes: int, dist_init: str, extra: Sequence[str]
) -> tuple[str, ...]:
    """`python` runs the engine: megatron-rl's (CPU: the local engine) or SGLang's own environment."""
    ro = cfg.rollout
    model = str(Path(cfg.model.hf_path).resolve())
    if not gpu:
        cmd = [python, "-m", "megatron_rl.cli", "serve", "--model", model, "--host", bind, "--device", "cpu"]
        cmd += ["--max-running-requests", str(ro.max_concurrency)]
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", bind]
        cmd += ["--tp-size", str(ro.engine_gpus), "--base-gpu-id", str(base_gpu)]
        if ro.colocate:
            cmd.append("--enable-memory-saver")
            if jobcheck.flag_value(extra, jobcheck.MEM_FRACTION_FLAG) is None:
                cmd += [jobcheck.MEM_FRACTION_FLAG, COLOCATED_MEM_FRACTION[bool(ro.colocate_offload)]]
        if ro.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if nnodes > 1:
            cmd += ["--nnodes", str(nnodes), "--dist-init-addr", dist_init]  # --node-rank: per node, in task.sh
    return tuple(cmd + list(extra))  # the API key comes from the environment (slurm/task.sh)


def _placement(
    mode: str, nodes: Sequence[str], train_nodes: int | None, cfg: Any, explicit: set[str], gpu: bool
) -> tuple[int, list[str], list[str]]:
    """(training nodes, rollout nodes, the trainer's placement overrides) of `mode`. With servers of its
    own (`rollout.sglang_urls`: a router or servers) a job starts none, and every node trains."""
    nnodes = len(nodes)
    forced = ["rollout.engine=sglang"]
    external = ", ".join(cfg.rollout.sglang_urls)
    if external and mode == "colocated":
        raise PlanError(
            f"rollout.sglang_urls = [{external}], but train_colocated.sbatch starts its own engines on the trainer's "
            "GPUs: submit slurm/train.sbatch to train on every node against those servers"
        )
    if mode == "disaggregated":
        if external:
            if train_nodes not in (None, nnodes):
                raise PlanError(
                    f"TRAIN_NODES={train_nodes}, but rollout.sglang_urls = [{external}] gives the servers: the job "
                    f"starts none and trains on all {nnodes} nodes; unset TRAIN_NODES, or submit --nodes={train_nodes}"
                )
            n_train = nnodes
        else:
            if nnodes < 2:
                raise PlanError(
                    f"the job has {nnodes} node; train.sbatch needs at least 2 (training + rollout): submit with "
                    "--nodes=2 or more, use slurm/train_colocated.sbatch, or give running servers in "
                    "rollout.sglang_urls"
                )
            n_train = nnodes // 2 if train_nodes is None else train_nodes
            if not 1 <= n_train < nnodes:
                raise PlanError(
                    f"TRAIN_NODES={n_train} but the job has {nnodes} nodes (sbatch --nodes={nnodes}): 1 to "
                    f"{nnodes - 1} can train, leaving the others to serve rollouts"
                )
        if cfg.rollout.colocate:
            raise PlanError(
                "rollout.colocate = true, but train.sbatch runs the engines on their own nodes: "
                "submit slurm/train_colocated.sbatch, or set rollout.colocate=false"
            )
        if "rollout.weight_sync" not in explicit:
            forced.append("rollout.weight_sync=distributed")
        return n_train, list(nodes[n_train:]), forced
    if train_nodes is not None and train_nodes != nnodes:
        raise PlanError(
            f"TRAIN_NODES={train_nodes}, but train_colocated.sbatch trains on all {nnodes} nodes of the job: "
            "unset it, or use slurm/train.sbatch to split nodes"
        )
    forced.append("rollout.colocate=true")
    # On GPUs a colocated group would hold trainer rank 0 and engine 0's first TP rank on one GPU,
    # which NCCL refuses: several nodes fall back to disk, one node passes CUDA-IPC handles.
    multi_node = "disk" if gpu else "distributed"
    if "rollout.weight_sync" not in explicit:
        forced.append("rollout.weight_sync=" + ("tensor" if nnodes == 1 else multi_node))
    elif cfg.rollout.weight_sync == "tensor" and nnodes > 1:
        raise PlanError(
            f"rollout.weight_sync = tensor hands tensors over by handle on one machine, and only global rank 0 "
            f"sends: engines on the other {nnodes - 1} node(s) could not open them. Use "
            f"rollout.weight_sync={multi_node}, or --nodes=1"
        )
    elif cfg.rollout.weight_sync == "distributed" and gpu:
        raise PlanError(
            "rollout.weight_sync = distributed on colocated GPUs puts trainer rank 0 and engine 0's first TP rank "
            "(both on GPU 0) in one NCCL communicator, which NCCL refuses (duplicate GPU). Use "
            "rollout.weight_sync=tensor with --nodes=1, or rollout.weight_sync=disk"
        )
    return nnodes, list(nodes), forced


def _ranks_per_node(cfg: Any, gpus_per_node: int, ranks_per_node: int | None) -> int:
    """One rank per GPU; on CPU the smallest world the layout takes (per node); RANKS_PER_NODE overrides."""
    if gpus_per_node:
        rpn = gpus_per_node if ranks_per_node is None else ranks_per_node
        if not 1 <= rpn <= gpus_per_node:
            raise PlanError(f"RANKS_PER_NODE={rpn} must be between 1 and the {gpus_per_node} GPUs per node")
        return rpn
    rpn = _min_world(cfg) if ranks_per_node is None else ranks_per_node
    if rpn < 1:
        raise PlanError(f"RANKS_PER_NODE={rpn} must be >= 1")
    return rpn


def _check_preset_model(preset: str, config_path: str, overrides: Sequence[str]) -> None:
    """PlanError when the run's `model.hf_path` (its config file and `overrides`, without the preset) holds
    another model than `preset`'s: its layout would be planned and trained on a model it was not made for."""
    import json

    from presets import model_mismatch

    from megatron_rl.config import ConfigError, load_config

    if not Path(config_path).is_file():
        return  # said later, with the other checks of the files
    try:
        hf_path = load_config(config_path, list(overrides)).model.hf_path
    except ConfigError:
        return  # the config's own error comes with the plan's
    config_json = Path(hf_path or "") / "config.json"
    if hf_path and config_json.is_file():
        problem = model_mismatch(preset, json.loads(config_json.read_text(encoding="utf-8")))
        if problem is not None:
            raise PlanError(
                f"PRESET={preset} is the layout of another model: model.hf_path's {config_json} has {problem}; "
                "choose the preset of this model (slurm/presets.py), or none and set parallel.* yourself"
            )


def make_plan(
    mode: str,
    config_path: str,
    overrides: Sequence[str],
    nodes: Sequence[str],
    addrs: Sequence[str],
    gpus_per_node: int,
    job_id: str,
    train_nodes: int | None = None,
    ranks_per_node: int | None = None,
    python: str = sys.executable,
    bind: str = "auto",
    engine_args: Sequence[str] = (),
    router: bool | None = None,
    sglang_python: str | None = None,
    environ: dict[str, str] | None = None,
    preset: str | None = None,
    gpu_mem_gib: float = jobcheck.GPU_MEMORY_GIB,
    teacher_nodes: int | None = None,
    teacher_gpus: int | None = None,
    teacher_args: Sequence[str] = (),
) -> JobPlan:
    """The job's layout for `mode` ("disaggregated" or "colocated"); raises PlanError or ConfigError.
    `router`: ROUTER (None: lib.sh's default); `sglang_python` runs the SGLang servers (default `python`:
    one environment for both roles); `environ` (default os.environ) gives NCCL settings set at submission;
    `preset` (slurm/presets.py) puts a model's layout before `overrides`; on GPUs the trainer and the
    engines must fit `gpu_mem_gib` (slurm/jobcheck.py). `teacher_nodes`, `teacher_gpus`, `teacher_args`
    (TEACHER_NODES, TEACHER_GPUS, TEACHER_ARGS): the servers of `distill.teacher` (slurm/jobteacher.py)."""
    from megatron_rl.config import load_config

    preset_keys: list[str] = []
    if preset:
        from presets import preset_overrides, trainer_preset_overrides

        try:
            preset_keys = preset_overrides(preset)
        except ValueError as err:
            raise PlanError(str(err)) from None
        _check_preset_model(preset, config_path, overrides)
        overrides = [*preset_keys, *overrides]
        preset_keys = trainer_preset_overrides(preset_keys)

    if mode not in ("disaggregated", "colocated"):
        raise PlanError(f"mode {mode!r}; allowed: disaggregated, colocated")
    if router and mode == "colocated":
        raise PlanError(
            "ROUTER=1 with train_colocated.sbatch: the engines release their weights and KV cache while the "
            "trainer updates, and sglang-router's health check (every 60 s) would make them generate on freed "
            "memory; unset ROUTER (the trainer talks to every server itself)"
        )
    if not nodes or len(nodes) != len(addrs):
        raise PlanError(f"{len(nodes)} node names but {len(addrs)} addresses")
    if gpus_per_node < 0:
        raise PlanError(f"GPUS_PER_NODE={gpus_per_node} must be >= 0")
    if not Path(config_path).is_file():
        raise PlanError(f"config file {config_path} does not exist (relative paths start at {os.getcwd()})")
    placement = ["rollout.colocate=true"] if mode == "colocated" else []
    cfg = load_config(config_path, [*overrides, *placement])
    explicit = _explicit_keys(config_path, overrides)
    external = list(cfg.rollout.sglang_urls)
    if router and external:
        raise PlanError(
            f"ROUTER=1, but rollout.sglang_urls = [{', '.join(external)}] gives the servers: the job starts neither "
            "servers nor a router; unset ROUTER"
        )
    n_train, rollout_nodes, forced = _placement(mode, nodes, train_nodes, cfg, explicit, gpus_per_node > 0)
    try:
        teacher = jobteacher.split_nodes(mode, cfg, rollout_nodes, gpus_per_node, teacher_nodes, teacher_gpus)
    except jobteacher.TeacherPlanError as err:
        raise PlanError(str(err)) from None
    if teacher is not None:
        rollout_nodes = teacher.rollout_nodes
        forced += jobteacher.trainer_overrides(cfg, teacher)
    if "checkpoint.every" not in explicit:  # a requeued or preempted job resumes from the last of these
        forced.append(f"checkpoint.every={CHECKPOINT_EVERY}")
    if not gpus_per_node:
        forced.append("rollout.engine_gpus=1")  # the local engine is one process

    # the config as the trainer will see it: user settings, the placement's, the servers' addresses (known later)
    pending = [] if external else ['rollout.sglang_urls=["http://servers.pending:1"]']
    pending += [jobteacher.PENDING_URLS] if teacher is not None else []
    cfg = load_config(config_path, [*overrides, *forced, *pending])
    if not cfg.model.hf_path:
        raise PlanError(
            "model.hf_path is not set: the rollout engines load a Hugging Face folder "
            "(on a filesystem every node sees), then receive the trainer's weights"
        )
    if not Path(cfg.model.hf_path, "config.json").is_file():
        raise PlanError(f"model.hf_path = {cfg.model.hf_path}: no config.json there (a Hugging Face model folder)")
    # the checks above need only the config; the trainer's own check imports torch (seconds more)
    from megatron_rl.parallel.layout import LayoutError
    from megatron_rl.validation import validate_run

    rpn = _ranks_per_node(cfg, gpus_per_node, ranks_per_node)
    try:
        # the architecture the trainer will build: from config.json, not the YAML
        cfg = validate_run(cfg, "train", world_size=n_train * rpn, cuda_available=gpus_per_node > 0)
    except LayoutError as err:
        raise PlanError(f"{err} (trainer world = {n_train} training node(s) x {rpn} ranks per node)") from None
    colocated_fraction = COLOCATED_MEM_FRACTION[bool(cfg.rollout.colocate_offload)] if mode == "colocated" else None
    try:
        memory, warnings = jobcheck.check_resources(
            cfg, n_train * rpn, gpus_per_node, gpu_mem_gib, engine_args, not external, colocated_fraction
        )
        if teacher is not None:
            teacher_cfg = jobteacher.teacher_config(cfg, teacher)
            if gpus_per_node:
                line, warning = jobteacher.check_teacher_memory(teacher_cfg, gpus_per_node, gpu_mem_gib, teacher_args)
                memory.append(line)
                warnings += [warning] if warning else []
    except (jobcheck.DoesNotFit, jobteacher.TeacherPlanError) as err:
        raise PlanError(str(err)) from None
    if external and engine_args:
        name = "SGLANG_ARGS" if gpus_per_node else "LOCAL_ENGINE_ARGS"
        warnings.append(f"{name} ({shlex.join(engine_args)}) is not used: rollout.sglang_urls gives the servers")

    addr_of = dict(zip(nodes, addrs, strict=True))
    base_port = 20000 + int(job_id) % 20000 if job_id.isdigit() else 29500  # multi-node engines' rendezvous
    engine_python = (sglang_python or python) if gpus_per_node else python

    def servers(
        server_cfg: Any, placement: list[list[tuple[str, int]]], first_port: int, extra: Sequence[str]
    ) -> list[Engine]:
        found = []
        for i, placed in enumerate(placement):
            first, base_gpu = placed[0]
            dist_init = f"{addr_of[first]}:{first_port + i}"
            host = engine_bind(bind, len(nodes), addr_of[first])
            command = _engine_command(
                server_cfg, gpus_per_node > 0, engine_python, host, base_gpu, len(placed), dist_init, extra
            )
            url_host = addr_of[first] if host in ("0.0.0.0", "::") else host
            found.append(Engine(i, tuple(n for n, _ in placed), url_host, base_gpu, command))
        return found

    engines = servers(
        cfg, _engine_layout(mode, gpus_per_node, cfg.rollout.engine_gpus, rollout_nodes), base_port, engine_args
    )
    teachers = []
    if teacher is not None:
        placement = _engine_layout(mode, gpus_per_node, teacher.gpus, teacher.nodes, TEACHER_GPUS_KEY)
        teachers = servers(teacher_cfg, placement, base_port + len(engines), teacher_args)

    run_dir = str(Path(cfg.logging.run_dir).resolve())
    return JobPlan(
        mode=mode,
        device="gpu" if gpus_per_node else "cpu",
        run_dir=run_dir,
        log_dir=str(Path(run_dir, "logs", f"job-{job_id}")),
        train_nodes=list(nodes[:n_train]),
        ranks_per_node=rpn,
        master_addr=addr_of[nodes[0]],
        engines=engines,
        trainer_overrides=forced,
        preset_overrides=preset_keys,
        router=False if external or mode == "colocated" else router,
        api_key=cfg.rollout.api_key,
        env=_job_env(mode, gpus_per_node, dict(os.environ if environ is None else environ)),
        external_urls=external,
        teachers=teachers,
        teacher_model=teacher.model if teacher is not None else "",
        teacher_urls=list(cfg.distill.teacher_urls) if teacher is None else [],
        memory=memory,
        warnings=warnings,
    )


def _job_env(mode: str, gpus_per_node: int, environ: dict[str, str]) -> dict[str, str]:
    """What a job exports to every step: on GPUs the NCCL settings, and in a colocated job (its SGLang
    servers release their memory) the health check without a generation."""
    if not gpus_per_node:
        return {}
    return {**nccl_env(environ), **(RELEASED_ENGINE_ENV if mode == "colocated" else {})}

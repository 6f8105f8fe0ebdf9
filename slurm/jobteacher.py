"""On-policy distillation's teacher in a Slurm job: where its servers run, the config they serve, their memory.

With `distill.teacher` (a Hugging Face folder) a disaggregated job serves the teacher itself, on servers of
their own, which the trainer reaches as `distill.teacher_urls` (`distill.teacher=null`, and `distill.tokenizer`
the folder unless set, so the trainer still checks the teacher's tokenizer against the student's):

- on GPUs the last `TEACHER_NODES` (default 1) rollout nodes serve the teacher, `gpus_per_node / TEACHER_GPUS`
  SGLang servers a node (`TEACHER_GPUS` defaults to `rollout.engine_gpus`; a server bigger than a node spans
  several), with `TEACHER_ARGS` and no `SGLANG_ARGS`; at least one rollout node is left to the policy's engines.
  Their memory is the rollout engines' arithmetic on the teacher's config.json: its parameters at the engine's
  dtype (SGLang's `auto`: the checkpoint's) over `TEACHER_GPUS`, the KV cache for whole sequences of the
  configured context in what is left of the static share;
- on CPU one `megatron-rl serve` of the teacher on each of the last `TEACHER_NODES` rollout nodes, beside
  their engine (a CPU node has no GPUs to divide).

The teacher's weights never change: no weight sync and no router reach its servers. A colocated job, or one
on running servers (`rollout.sglang_urls`), has no nodes of its own for the teacher: refused, naming
`distill.teacher_urls` (servers of the teacher that already run, which the job starts none of).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings in slurm/
    sys.path.append(str(Path(__file__).resolve().parent))
import jobcheck  # noqa: E402

TEACHER_ROLE = jobcheck.EngineRole("a teacher server", "TEACHER_GPUS", "TEACHER_ARGS")
# what make_plan validates the trainer's config with before the teacher's servers have addresses
PENDING_URLS = 'distill.teacher_urls=["http://teacher.pending:1"]'


class TeacherPlanError(ValueError):
    """A teacher the job cannot serve; the message names the setting (jobplace raises it as a PlanError)."""


@dataclass(frozen=True)
class TeacherNodes:
    """The teacher's share of the rollout nodes: its servers' nodes and GPUs each, and what the policy keeps."""

    model: str  # the teacher's folder, absolute
    nodes: list[str]
    gpus: int  # per server (1 on CPU)
    rollout_nodes: list[str]  # the policy's engines' nodes


def split_nodes(
    mode: str,
    cfg: Any,
    rollout_nodes: Sequence[str],
    gpus_per_node: int,
    teacher_nodes: int | None,
    teacher_gpus: int | None,
) -> TeacherNodes | None:
    """Where the servers of `distill.teacher` run (the module doc); None when the job serves no teacher."""
    teacher = cfg.distill.teacher
    if not teacher:
        return None
    if mode == "colocated":
        raise TeacherPlanError(
            f"distill.teacher = {teacher}: train_colocated.sbatch gives every GPU to the trainer and the policy's "
            "engines, none to the teacher's servers; submit slurm/train.sbatch (the teacher on TEACHER_NODES of "
            "the rollout nodes), or give running servers of the teacher in distill.teacher_urls"
        )
    if cfg.rollout.sglang_urls:
        raise TeacherPlanError(
            f"distill.teacher = {teacher}, but rollout.sglang_urls gives the servers: the job trains on every node "
            "and has none for the teacher's; give running servers of the teacher in distill.teacher_urls"
        )
    if not Path(teacher, "config.json").is_file():
        raise TeacherPlanError(f"distill.teacher = {teacher}: no config.json there (a Hugging Face model folder)")
    count = 1 if teacher_nodes is None else teacher_nodes
    spare = len(rollout_nodes) - (1 if gpus_per_node else 0)  # on GPUs the policy keeps a node of engines
    if not 1 <= count <= spare:
        kept = "one for the policy's engines" if gpus_per_node else "the teacher's servers"
        raise TeacherPlanError(
            f"TEACHER_NODES={count} of the job's {len(rollout_nodes)} rollout node(s) for the teacher's servers "
            f"(distill.teacher): 1 to {spare} can, leaving {kept}; submit more nodes or a smaller TRAIN_NODES"
        )
    gpus = (cfg.rollout.engine_gpus if teacher_gpus is None else teacher_gpus) if gpus_per_node else 1
    if gpus < 1:
        raise TeacherPlanError(f"TEACHER_GPUS={gpus} must be >= 1")
    nodes = list(rollout_nodes[-count:])
    kept_nodes = list(rollout_nodes[:-count]) if gpus_per_node else list(rollout_nodes)
    return TeacherNodes(str(Path(teacher).resolve()), nodes, gpus, kept_nodes)


def trainer_overrides(cfg: Any, teacher: TeacherNodes) -> list[str]:
    """What the trainer is told instead of `distill.teacher`: no local teacher of its own, the folder's
    tokenizer (unless `distill.tokenizer` is set); `distill.teacher_urls` follow once the servers answer."""
    tokenizer = [] if cfg.distill.tokenizer else [f"distill.tokenizer={teacher.model}"]
    return ["distill.teacher=null", *tokenizer]


def teacher_config(cfg: Any, teacher: TeacherNodes) -> Any:
    """`cfg` as a teacher server's command and memory read it: the teacher's `model` from its config.json, on
    `teacher.gpus` GPUs, neither colocated nor returning routed experts."""
    from megatron_rl.config import ConfigError
    from megatron_rl.models.source import resolve_model

    model = dataclasses.replace(cfg.model, hf_path=teacher.model)
    rollout = dataclasses.replace(cfg.rollout, engine_gpus=teacher.gpus, colocate=False, return_routed_experts=False)
    try:
        return resolve_model(dataclasses.replace(cfg, model=model, rollout=rollout))
    except ConfigError as err:
        raise TeacherPlanError(f"distill.teacher = {teacher.model}: {err}") from None


def check_teacher_memory(
    teacher_cfg: Any, gpus_per_node: int, gpu_mem_gib: float, teacher_args: Sequence[str]
) -> tuple[str, str | None]:
    """(the plan's line of a teacher server's memory per GPU, a warning or None); jobcheck.DoesNotFit naming
    TEACHER_GPUS when its weights leave no KV cache for one whole sequence."""
    mem, warning = jobcheck.check_engine_memory(
        teacher_cfg, gpus_per_node, gpu_mem_gib, teacher_args, None, TEACHER_ROLE
    )
    return jobcheck.engine_line("teacher", mem, jobcheck.sequence_tokens(teacher_cfg)[0]), warning

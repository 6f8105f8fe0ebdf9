"""A job plan as the batch script reads it (bash assignments for `eval`) and as people read it."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings in slurm/
    sys.path.append(str(Path(__file__).resolve().parent))
from jobplace import JobPlan  # noqa: E402


def to_shell(plan: JobPlan) -> str:
    """Bash assignments (scalars and arrays) for `eval`."""
    q = shlex.quote

    def array(name: str, items: Sequence[str]) -> str:
        return f"{name}=({' '.join(q(str(x)) for x in items)})"

    lines = [
        f"PLAN_MODE={q(plan.mode)}",
        f"PLAN_DEVICE={q(plan.device)}",
        f"RUN_DIR={q(plan.run_dir)}",
        f"LOG_DIR={q(plan.log_dir)}",
        array("TRAIN_HOSTS", plan.train_nodes),
        f"RANKS_PER_NODE={plan.ranks_per_node}",
        f"WORLD_SIZE_PLANNED={plan.world_size}",
        f"MASTER_ADDR={q(plan.master_addr)}",
        array("TRAINER_OVERRIDES", plan.trainer_overrides),
        array("PRESET_OVERRIDES", plan.preset_overrides),
        f"ENGINE_COUNT={len(plan.engines)}",
        array("EXTERNAL_URLS", plan.external_urls),
        f"START_ROUTER={'auto' if plan.router is None else int(plan.router)}",
        f"ENGINE_API_KEY={q(plan.api_key or '')}",
        f"TEACHER_COUNT={len(plan.teachers)}",
    ]
    lines += [f"export {key}={q(value)}" for key, value in plan.env.items()]
    for prefix, servers in (("ENGINE", plan.engines), ("TEACHER", plan.teachers)):
        for e in servers:
            lines += [
                array(f"{prefix}_NODES_{e.index}", e.nodes),
                f"{prefix}_ADDR_{e.index}={q(e.addr)}",
                array(f"{prefix}_CMD_{e.index}", e.command),
            ]
    return "\n".join(lines) + "\n"


def describe(plan: JobPlan) -> str:
    """A few human lines for the job's output."""
    servers = f"no server of its own: rollout.sglang_urls = [{', '.join(plan.external_urls)}]"
    if not plan.external_urls:
        servers = f"{len(plan.engines)} engine(s): " + "; ".join(
            f"#{e.index} on {','.join(e.nodes)} from GPU {e.base_gpu}" for e in plan.engines
        )
    teachers = []
    if plan.teachers:
        teachers = [
            f"{len(plan.teachers)} teacher server(s) of {plan.teacher_model} (distill.teacher): "
            + "; ".join(f"#{e.index} on {','.join(e.nodes)} from GPU {e.base_gpu}" for e in plan.teachers)
        ]
    elif plan.teacher_urls:
        teachers = [f"teacher: no server of its own: distill.teacher_urls = [{', '.join(plan.teacher_urls)}]"]
    out = [
        f"{plan.mode} on {plan.device}: trainer {len(plan.train_nodes)} node(s) x {plan.ranks_per_node} ranks "
        f"= world {plan.world_size} on {','.join(plan.train_nodes)}, master {plan.master_addr}",
        servers,
        *teachers,
        *plan.memory,
        f"run folder {plan.run_dir}, logs {plan.log_dir}",
        "trainer overrides: " + " ".join(plan.trainer_overrides),
    ]
    if plan.preset_overrides:
        out.append("preset overrides (before the job's own): " + " ".join(plan.preset_overrides))
    if plan.env:
        out.append("exported to every step: " + " ".join(f"{k}={v}" for k, v in plan.env.items()))
    return "\n".join(out + [f"warning: {w}" for w in plan.warnings])

"""What a Slurm job runs where: the helper behind slurm/train.sbatch and slurm/train_colocated.sbatch.

    python slurm/jobplan.py plan --mode disaggregated --nodes node1,node2 --addrs 10.0.0.1,10.0.0.2 \
        --gpus-per-node 8 --job-id 123 CONFIG [key=value ...]      # bash assignments on stdout
    python slurm/jobplan.py free-port                               # a free TCP port of this machine
    python slurm/jobplan.py wait-healthy --timeout 600 --pids 11,12 URL ...
    python slurm/jobplan.py weight-versions --out FILE URL ...      # what each engine serves now

`plan` checks the whole submission before anything starts and prints one error naming the problem
(exit 2) or shell assignments for `eval`, the plan and its memory figures on stderr; it needs no
cluster. What runs where: slurm/jobplace.py (distillation's teacher servers: slurm/jobteacher.py); the memory and tokenizer checks: slurm/jobcheck.py; the
layout presets: slurm/presets.py; the printed plan: slurm/jobshell.py; the other commands:
slurm/jobtools.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from megatron_rl.rollout.local.launcher import API_KEY_ENV as ENGINE_API_KEY_ENV

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings in slurm/
    sys.path.append(str(Path(__file__).resolve().parent))
import jobcheck  # noqa: E402
from jobplace import (  # noqa: E402
    CHECKPOINT_EVERY,
    COLOCATED_MEM_FRACTION,
    NCCL_ENV_DEFAULTS,
    RELEASED_ENGINE_ENV,
    Engine,
    JobPlan,
    PlanError,
    engine_bind,
    make_plan,
    nccl_env,
)
from jobshell import describe, to_shell  # noqa: E402
from jobtools import wait_healthy, weight_versions  # noqa: E402

__all__ = [
    "CHECKPOINT_EVERY", "COLOCATED_MEM_FRACTION", "ENGINE_API_KEY_ENV", "NCCL_ENV_DEFAULTS", "RELEASED_ENGINE_ENV",
    "Engine", "JobPlan", "PlanError", "describe", "engine_bind", "make_plan", "nccl_env", "to_shell",
    "wait_healthy", "weight_versions",
]  # fmt: skip


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jobplan.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="check the submission and print the job's layout as bash assignments")
    p.add_argument("--mode", required=True, choices=["disaggregated", "colocated"])
    p.add_argument("--nodes", required=True, help="the job's node names, comma-separated, in order")
    p.add_argument("--addrs", required=True, help="their addresses (NodeAddr), comma-separated")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--job-id", default="0")
    p.add_argument("--train-nodes", default="", help="nodes that train (disaggregated); empty = half")
    p.add_argument("--ranks-per-node", default="", help="trainer ranks per node; empty = GPUs (CPU: the least)")
    p.add_argument(
        "--bind", default="auto", help="address the engines bind; auto = 127.0.0.1 on one node, else the node's"
    )
    p.add_argument("--engine-args", default="", help="extra engine arguments (shell words)")
    p.add_argument(
        "--router", default="", choices=["", "0", "1"], help="an sglang-router in front of the engines; empty = auto"
    )
    p.add_argument("--sglang-python", default="", help="interpreter of the SGLang servers; empty = the planner's")
    p.add_argument("--preset", default=os.environ.get("PRESET", ""), help="a layout of slurm/presets.py ($PRESET)")
    p.add_argument(
        "--gpu-mem-gib", type=float, default=float(os.environ.get("GPU_MEM_GIB") or jobcheck.GPU_MEMORY_GIB),
        help="memory of one GPU ($GPU_MEM_GIB)",
    )  # fmt: skip
    p.add_argument("--teacher-nodes", default="", help="rollout nodes of distill.teacher's servers; empty = 1")
    p.add_argument("--teacher-gpus", default="", help="GPUs per teacher server; empty = rollout.engine_gpus")
    p.add_argument("--teacher-args", default="", help="extra arguments of the teacher's servers (shell words)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    sub.add_parser("free-port", help="print a free TCP port of this machine")
    w = sub.add_parser("wait-healthy", help="wait until every URL's /health answers 200")
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--pids", default="", help="processes that must stay alive meanwhile, comma-separated")
    w.add_argument("--api-key", default=os.environ.get(ENGINE_API_KEY_ENV), help=f"default ${ENGINE_API_KEY_ENV}")
    w.add_argument("urls", nargs="+")
    v = sub.add_parser("weight-versions", help="print and save each engine's weight version")
    v.add_argument("--out", required=True)
    v.add_argument("--api-key", default=os.environ.get(ENGINE_API_KEY_ENV), help=f"default ${ENGINE_API_KEY_ENV}")
    v.add_argument("urls", nargs="+")
    args = parser.parse_args(argv)

    if args.command == "free-port":
        from megatron_rl.parallel.launch import free_port

        print(free_port(host=""))  # any interface: the port is used by ranks on other nodes
        return 0
    try:
        if args.command == "plan":
            plan = make_plan(
                args.mode,
                args.config,
                args.overrides,
                [n for n in args.nodes.split(",") if n],
                [a for a in args.addrs.split(",") if a],
                args.gpus_per_node,
                args.job_id,
                train_nodes=_int_or_none(args.train_nodes, "TRAIN_NODES"),
                ranks_per_node=_int_or_none(args.ranks_per_node, "RANKS_PER_NODE"),
                bind=args.bind,
                engine_args=shlex.split(args.engine_args),
                router=bool(int(args.router)) if args.router else None,
                sglang_python=args.sglang_python or None,
                preset=args.preset or None,
                gpu_mem_gib=args.gpu_mem_gib,
                teacher_nodes=_int_or_none(args.teacher_nodes, "TEACHER_NODES"),
                teacher_gpus=_int_or_none(args.teacher_gpus, "TEACHER_GPUS"),
                teacher_args=shlex.split(args.teacher_args),
            )
            print(describe(plan), file=sys.stderr)
            print(to_shell(plan), end="")
        elif args.command == "wait-healthy":
            pids = [int(p) for p in args.pids.split(",") if p]
            wait_healthy(args.urls, args.timeout, pids, args.api_key)
        else:
            found = weight_versions(args.urls, args.api_key)
            Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
            for item in found:
                print(f"engine {item['url']}: weight_version {item['weight_version']}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - one line naming the problem is the job's whole report
        from megatron_rl.config import ConfigError

        if not isinstance(err, (PlanError, ConfigError)):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _int_or_none(text: str, name: str) -> int | None:
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"{name}={text!r} is not an integer") from None


if __name__ == "__main__":
    sys.exit(_main())
